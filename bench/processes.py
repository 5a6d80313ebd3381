"""How a bench that starts processes ends them: on every way out (a return, an exception, SIGINT, SIGTERM) each
process it started, and each of theirs, is stopped before the bench exits, so a failed run leaves no server
holding gigabytes behind it. Standard library only: the benches that use it import no torch."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces): state, ppid, pgrp, session, ..."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, theirs, ...), parents first."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def in_session(sid: int) -> list[int]:
    """Live processes of session `sid` (a bench started with its own session: what it left behind, orphans too)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != sid:
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def stop(pids: list[int], grace: float) -> None:
    """SIGTERM each, then SIGKILL what is still there after `grace` seconds."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def ending_children(grace: float = 10.0) -> Iterator[None]:
    """Run a bench's body; SIGTERM becomes SystemExit (as SIGINT is KeyboardInterrupt), so the bench's own `finally`
    blocks run, and whatever process is still below this one afterwards is stopped."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        left = descendants(os.getpid())
        if left:
            stop(left, grace)


def metric_values(url: str, names: Sequence[str]) -> list[float]:
    """The server's `/metrics` values of the unlabelled series `names` now (0 for one not there yet)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = []
    for name in names:
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        values.append(float(match.group(1)) if match else 0.0)
    return values


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 180.0) -> None:
    """Wait until the server `proc` (its output in `log`) answers 200 on `url`/ready; `RuntimeError` with the log's
    tail if it exits or is not ready within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
                if r.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
