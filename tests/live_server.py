"""A real `duplexd serve` subprocess on a free local port, for the tests that talk to one over the wire."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from .warm_server import WarmProcess, spawn


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a server's codec workers), from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            text = stat.read_text()
            if int(text[text.rindex(")") + 2 :].split()[1]) == pid:
                out.append(int(stat.parent.name))
    return sorted(out)


def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This worker's duplexd cache (the demo models are written there): conftest points `DUPLEXD_CACHE` at it for
    every test; a module or session fixture, set up before that, and a server's environment name it here."""
    return tmp_path_factory.getbasetemp() / "duplexd-cache"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    port: int
    proc: WarmProcess  # the server, forked from this test process's warm interpreter (`warm_server`)
    log: Path


@contextlib.contextmanager
def running_server(
    log: Path, *args: str, env: dict[str, str] | None = None, ready_timeout: float = 120
) -> Iterator[LiveServer]:
    """`duplexd serve --port P *args` with its output in `log`, ready (warm) when this yields; stopped with SIGINT
    (a drain of at most 5 s unless set, then a clean shutdown: exit 0) on exit, so the caller can check
    `proc.returncode` and the log afterwards."""
    port = free_port()
    proc = spawn(
        ["serve", "--port", str(port), *args], {"DUPLEXD_DRAIN_TIMEOUT": "5", **os.environ, **(env or {})}, log
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


@contextlib.contextmanager
def running_side_by_side(*servers: contextlib.AbstractContextManager[LiveServer]) -> Iterator[list[LiveServer]]:
    """Several `running_server`s started at once (each start is mostly waiting on its imports), all stopped on the
    way out, even when one failed to start; then no log may hold a traceback."""
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(len(servers)) as pool:
            futures = [pool.submit(server.__enter__) for server in servers]
        for server, future in zip(servers, futures, strict=True):
            if future.exception() is None:
                stack.push(server.__exit__)
        lives = [future.result() for future in futures]
        yield lives
    for live in lives:
        assert "Traceback" not in live.log.read_text(), live.log.read_text()[-5000:]


@pytest.fixture(scope="session")
def _shared_demo_server(tmp_path_factory) -> Iterator[LiveServer]:
    """`duplexd serve --max-sessions 1` on the demo model (no transcriber, TTS, voices or persona), started once per
    worker process (a session fixture is per xdist worker) for the modules that only ask a server without those
    something a fresh and a used server answer alike; checked like a module's own at the end of the run."""
    from duplexd.engine.weights.demo import ensure_demo

    cache = demo_cache(tmp_path_factory)
    ensure_demo(cache)  # written before the server looks, so no test writing it at the same time races it
    log = tmp_path_factory.mktemp("demo-server") / "serve.log"
    with running_server(log, "--max-sessions", "1", env={"DUPLEXD_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}) as live:
        yield live
    assert live.proc.returncode == 0, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


@pytest.fixture
def demo_server(_shared_demo_server: LiveServer) -> LiveServer:
    """The shared demo server once its one slot is free again (an earlier test's session given back)."""
    deadline = time.monotonic() + 15
    while True:
        metrics = httpx2.get(f"{_shared_demo_server.url}/metrics", timeout=5).text
        active = [line for line in metrics.splitlines() if line.startswith("duplexd_sessions_active ")]
        if active and float(active[0].split()[1]) == 0:
            return _shared_demo_server
        assert time.monotonic() < deadline, f"the shared demo server's slot is still taken: {active}"
        time.sleep(0.05)
