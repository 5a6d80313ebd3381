import os

# Before anything imports the reference or Triton: the reference compiles RMSNorm on CPU otherwise (≈10 s per
# process), and Triton kernels must be decorated in interpreter mode to run without a GPU.
os.environ.setdefault("NO_TORCH_COMPILE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from . import parallel, system_tools, triton_interpreter  # noqa: E402
from .live_server import demo_cache  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))
triton_interpreter.install()

# Session fixtures shared by several modules (one server with a TTS model for both of its protocols' tests; one
# demo server without extras for the tests that only ask it a question).
pytest_plugins = ["tests.live_server", "tests.tts_server"]


def pytest_collection_modifyitems(items):
    parallel.order(items)


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_system(*tools): system tools the test needs (tests/system_tools.py)")
    parallel.configure(config)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item):
    """A test's setup, call and teardown share the CPU with the other workers', or have it alone (`realtime`)."""
    with parallel.cpu_share(item):
        return (yield)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture: a test whose system tools are missing skips (or fails) naming them and their install."""
    system_tools.check(item)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests, restored after it: tiny models stepped hundreds of times, and
    references beside a server process, run several times faster than with two threads spinning against each other
    (`pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_launch(monkeypatch) -> list[str]:
    """Triton kernels run as no-ops: the wrappers, their argument handling and the dispatch still run (a meta-device
    step, `tests/host_sync.py`). Returns the names of the kernels launched, in order."""
    from triton.runtime.interpreter import InterpretedFunction

    launched: list[str] = []
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, **kwargs: launched.append(self.__name__))
    return launched


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Never touch the user's cache: the demo model is written under a per-session temp dir."""
    monkeypatch.setenv("DUPLEXD_CACHE", str(demo_cache(tmp_path_factory)))


@pytest.fixture(scope="session")
def gemma4_folder(tmp_path_factory):
    """The tiny random Gemma 4 demo in Hugging Face layout (needs transformers), written once for the run."""
    pytest.importorskip("transformers")
    from duplexd.engine.weights.gemma4_demo import write_demo

    return write_demo(tmp_path_factory.mktemp("gemma4-demo"))


@pytest.fixture(scope="session")
def gemma4_hf(gemma4_folder):
    """The transformers reference on that folder: (processor, Gemma4ForConditionalGeneration)."""
    from .gemma4_ref import load_reference

    return load_reference(gemma4_folder)
