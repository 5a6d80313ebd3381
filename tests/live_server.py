"""A real `duplexd serve` subprocess on a free local port, for the tests that talk to one over the wire."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a server's codec workers), from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            text = stat.read_text()
            if int(text[text.rindex(")") + 2 :].split()[1]) == pid:
                out.append(int(stat.parent.name))
    return sorted(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    port: int
    proc: subprocess.Popen
    log: Path


@contextlib.contextmanager
def running_server(
    log: Path, *args: str, env: dict[str, str] | None = None, ready_timeout: float = 120
) -> Iterator[LiveServer]:
    """`duplexd serve --port P *args` with its output in `log`, ready (warm) when this yields; stopped with SIGINT
    (a drain of at most 5 s unless set, then a clean shutdown: exit 0) on exit, so the caller can check
    `proc.returncode` and the log afterwards."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "duplexd", "serve", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={"DUPLEXD_DRAIN_TIMEOUT": "5", **os.environ, **(env or {})},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            assert proc.poll() is None, f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
            with contextlib.suppress(httpx2.HTTPError):
                if httpx2.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"server not ready:\n{log.read_text()[-3000:]}"
            time.sleep(0.1)
        yield LiveServer(url, port, proc, log)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
