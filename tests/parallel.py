"""The suite on every core, as `scripts/test.sh` runs it: `python -m tests.parallel [pytest arguments]`.

pytest-xdist starts one worker per core and one more, and hands each a whole test file (`--dist loadfile`), so a
module's fixtures (a `duplexd serve` process, a reference model) are built once. The files go out in `FIRST`'s
order, then the others as collected: the long files first, so that none starts near the end and runs on alone,
those that mostly wait on the wall clock (servers, real-time sessions, browsers) taking turns with those that
compute (handing out the longest first with no such turns put the CPU-heavy ones side by side, each slowing the
other: 7.6 minutes against 6.1 with two workers). The extra worker fills the CPU while the others wait: on 2
cores, 1066 tests took 386 s with two workers and 359 s with three, for 14 % more CPU. Every process of the run
(workers, the servers and benches they start) keeps to one intra-op thread: two workers with two threads each on
two cores spent a third more CPU.

Tests marked `realtime` pace sessions against the wall clock and check what arrives late; two workers on two cores
would make them late. Such a test takes the CPU to itself: every test holds a shared `flock` on one file of the
run, a realtime test an exclusive one, and a second lock taken first by both (a turnstile) keeps the workers' next
shared locks from starving a waiting realtime test.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "realtime: paces sessions against the wall clock; runs with no other test beside it"
    )


@contextlib.contextmanager
def cpu_share(item: pytest.Item) -> Iterator[None]:
    """Shared use of the CPU for an ordinary test, sole use for a realtime one; nothing outside xdist."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    folder = Path(tempfile.gettempdir())
    with (
        (folder / f"duplexd-tests-{run}.turnstile").open("a") as turnstile,
        (folder / f"duplexd-tests-{run}.cpu").open("a") as cpu,
    ):
        alone = item.get_closest_marker("realtime") is not None
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(cpu, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(cpu, fcntl.LOCK_UN)


# The long files, longest first by a 2-core run's wall time (2026-12-06: 108 s down to 28 s), computing and
# waiting in turns.
FIRST = (
    "test_bench_smoke.py",  # both: benches run two at a time beside it
    "test_webrtc_agent.py",  # waits: calls paced at real time, a browser
    "test_tts_parity.py",  # computes: the reference's 32-codebook DepFormer
    "test_tts_streaming.py",  # waits: speech paced at real time
    "test_sm90_compile.py",  # computes: Triton and ptxas, 47 kernels
    "test_server_e2e.py",
    "test_infer_persona.py",
    "test_agent_realtime.py",
    "test_tts_codebooks.py",
    "test_kyutai_transcription.py",
    "test_voice_cloning.py",
    "test_web_chromium.py",
    "test_infer.py",
    "test_realtime_transcription.py",
    "test_kernels_rope_kv_store.py",
    "test_web_agent.py",
    "test_asr_e2e.py",
    "test_agent_python_sdk.py",
    "test_clients_live.py",
    "test_voice_server.py",
)


def order(items: list[pytest.Item]) -> None:
    """`FIRST`'s files first, in its order; the rest as collected (xdist keeps it: `--no-loadscope-reorder`)."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: a file's tests keep their order


def arguments(argv: list[str], cores: int) -> list[str]:
    """pytest's arguments: a worker per core and one more, whole files per worker in `order`, unless the caller
    chose."""
    chosen = any(a in ("-n", "--numprocesses", "no:xdist") or a.startswith(("-n", "--numprocesses=")) for a in argv)
    return argv if chosen else ["-n", str(cores + 1), "--dist", "loadfile", "--no-loadscope-reorder", *argv]


MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824", "MALLOC_TOP_PAD_": "268435456"}


def main() -> int:
    # one intra-op thread a process (workers, their servers and benches): as many workers as cores already
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # glibc keeps freed memory for reuse instead of handing each large buffer back to the kernel and faulting it in
    # again: the voice-cloning and TTS parity files' system CPU 6.6 s to 3.2 s, memory about the same
    for name, value in MALLOC.items():
        os.environ.setdefault(name, value)
    return int(pytest.main(arguments(sys.argv[1:], os.cpu_count() or 1)))


if __name__ == "__main__":
    sys.exit(main())
