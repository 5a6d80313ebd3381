"""Live: Debian's HAProxy with docker/haproxy.cfg (unchanged, configured by environment variables) in front of two
`duplexd serve` demo replicas of 2 slots each. Sessions spread 2 + 2, a 5th gets the proxy's "all replicas are
full" 503, SIGTERM drains one replica without losing a frame while new sessions go to the other, and a drain that
times out closes its sessions with 1001."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2
import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from duplexd.clients.realtime import AUDIO_DELTAS, append_event

from .live_server import LiveServer, free_port, running_server
from .system_tools import needs

ROOT = Path(__file__).resolve().parent.parent
FRAME, PACE = 1920, 0.08
WINDOW = 4  # frames sent ahead of the answers: a loaded CI machine may step slower than real time
REPLICA_ARGS = ["--max-sessions", "2", "--idle-timeout", "30", "--max-session-seconds", "120"]

pytestmark = needs("haproxy")


def metric(server: LiveServer, name: str) -> float:
    text = httpx2.get(f"{server.url}/metrics", timeout=5).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def active(server: LiveServer) -> int:
    return int(metric(server, "duplexd_sessions_active"))


async def wait_for(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@contextlib.contextmanager
def haproxy(tmp: Path, replicas: list[LiveServer]) -> Iterator[tuple[str, str]]:
    """HAProxy on free ports; yields (front URL, stats URL)."""
    front, stats = free_port(), free_port()
    env = {
        **os.environ,
        "DUPLEXD_FRONT_BIND": f"127.0.0.1:{front}",
        "HAPROXY_STATS_BIND": f"127.0.0.1:{stats}",
        "DUPLEXD_REPLICA_1": f"127.0.0.1:{replicas[0].port}",
        "DUPLEXD_REPLICA_2": f"127.0.0.1:{replicas[1].port}",
        "HAPROXY_CHECK_INTER": "100ms",
        "HAPROXY_CHECK_FALL": "1",
        "HAPROXY_CHECK_RISE": "1",
        "HAPROXY_ERRORS_DIR": str(ROOT / "docker" / "errors"),
    }
    log = tmp / "haproxy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["haproxy", "-db", "-f", str(ROOT / "docker" / "haproxy.cfg")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp,
        )
    try:
        yield f"127.0.0.1:{front}", f"http://127.0.0.1:{stats}"
    finally:
        proc.terminate()
        proc.wait(10)


def backend_status(stats: str) -> dict[str, str]:
    """replica name -> UP / DOWN, from HAProxy's CSV statistics (empty while HAProxy is starting)."""
    try:
        text = httpx2.get(f"{stats}/stats;csv", timeout=5).text.lstrip("# ")
    except httpx2.HTTPError:
        return {}
    rows = csv.DictReader(io.StringIO(text))
    return {r["svname"]: r["status"] for r in rows if r["pxname"] == "duplexd_replicas" and r["svname"].startswith("r")}


class Talker:
    """One Realtime session through the proxy: a tone at real-time pace (at most WINDOW frames ahead of the
    answers), counting the audio answers."""

    def __init__(self, front: str) -> None:
        self.url = f"ws://{front}/v1/realtime"
        self.sent = self.received = 0
        self.talking = True
        self.errors: list[dict] = []
        self.close_code: int | None = None
        self.close_reason = ""

    async def open(self) -> Talker:
        self.ws = await connect(self.url, subprotocols=["realtime"])  # type: ignore[list-item]
        event = json.loads(await self.ws.recv())
        assert event["type"] == "session.created", event
        self.tasks = [asyncio.create_task(self._send()), asyncio.create_task(self._recv())]
        return self

    async def _send(self) -> None:
        t = np.arange(FRAME) / 24000
        frame = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
        with contextlib.suppress(Exception):
            while self.talking:
                if self.sent - self.received >= WINDOW:
                    await asyncio.sleep(0.01)
                    continue
                await self.ws.send(append_event(frame))
                self.sent += 1
                await asyncio.sleep(PACE)

    async def _recv(self) -> None:
        with contextlib.suppress(Exception):
            async for message in self.ws:
                event = json.loads(message)
                if event["type"] in AUDIO_DELTAS:
                    self.received += 1
                elif event["type"] == "error":
                    self.errors.append(event["error"])
        self.close_code, self.close_reason = self.ws.close_code, self.ws.close_reason or ""

    async def finish(self, timeout: float = 20.0) -> None:
        """Stop talking, wait for the answer to every frame sent (the last one has none yet), then hang up."""
        self.talking = False
        await self.tasks[0]
        await wait_for(lambda: self.received >= self.sent - 1, f"all answers ({self.received} of {self.sent})", timeout)
        await self.ws.close()
        await self.tasks[1]


async def scenario(tmp: Path, a: LiveServer, b: LiveServer) -> None:
    with haproxy(tmp, [a, b]) as (front, stats):
        await wait_for(lambda: backend_status(stats) == {"replica1": "UP", "replica2": "UP"}, "both replicas up")
        # 4 sessions, one at a time: leastconn spreads them 2 + 2.
        talkers, home = [], []
        for n in range(1, 5):
            talkers.append(await Talker(front).open())
            await wait_for(lambda n=n: active(a) + active(b) == n, f"{n} sessions active")
            home.append(a if active(a) > sum(h is a for h in home) else b)
        assert await asyncio.to_thread(lambda: (active(a), active(b))) == (2, 2)
        # Both replicas full: /ready 503, HAProxy marks them down and answers with the "all replicas full" page.
        await wait_for(lambda: set(backend_status(stats).values()) == {"DOWN"}, "both replicas down (full)")
        with pytest.raises(InvalidStatus) as refused:
            await connect(f"ws://{front}/v1/realtime", subprotocols=["realtime"])  # type: ignore[list-item]
        assert refused.value.response.status_code == 503
        assert b"all duplexd replicas are full" in refused.value.response.body
        # Free a slot on B, then drain A while its 2 sessions talk.
        on_a = [t for t, h in zip(talkers, home, strict=True) if h is a]
        on_b = [t for t, h in zip(talkers, home, strict=True) if h is b]
        await on_b[0].finish()
        await wait_for(lambda: backend_status(stats)["replica2"] == "UP", "B up again")
        await asyncio.sleep(1.0)  # a second of conversation on A
        sent_before = [t.sent for t in on_a]
        a.proc.send_signal(signal.SIGTERM)
        await wait_for(lambda: httpx2.get(f"{a.url}/ready", timeout=5).json()["draining"], "A draining", 5)
        ready = await asyncio.to_thread(lambda: httpx2.get(f"{a.url}/ready", timeout=5))
        assert ready.status_code == 503 and ready.json()["reason"] == "draining", ready.text
        await wait_for(lambda: backend_status(stats)["replica1"] == "DOWN", "A down (draining)")
        late = await Talker(front).open()  # goes to B, the only replica up
        assert await asyncio.to_thread(lambda: (active(a), active(b))) == (2, 2)
        await asyncio.sleep(1.0)  # A's sessions go on talking during the drain
        for t, before in zip(on_a, sent_before, strict=True):
            await t.finish()
            assert t.sent > before and t.received == t.sent - 1, (t.sent, t.received)  # not a frame lost
            assert t.close_code == 1000 and not t.errors, (t.close_code, t.errors)
        assert await asyncio.to_thread(a.proc.wait, 15) == 0
        # B drains with --drain-timeout 2: its sessions that do not end get 1001 and the reason.
        b.proc.send_signal(signal.SIGTERM)
        for t in (on_b[1], late):
            await asyncio.wait_for(t.tasks[1], 15)
            assert t.close_code == 1001 and "server going away" in t.close_reason, (t.close_code, t.close_reason)
            assert t.errors and t.errors[-1]["code"] == "server_shutdown", t.errors
            t.talking = False
        assert await asyncio.to_thread(b.proc.wait, 15) == 0


def test_haproxy_two_replicas_spread_refuse_and_drain(tmp_path):
    started = time.monotonic()
    env = {"DUPLEXD_CACHE": str(tmp_path / "cache")}
    with (
        running_server(tmp_path / "a.log", *REPLICA_ARGS, "--drain-timeout", "30", env=env) as a,
        running_server(tmp_path / "b.log", *REPLICA_ARGS, "--drain-timeout", "2", env=env) as b,
    ):
        asyncio.run(asyncio.wait_for(scenario(tmp_path, a, b), 90))
    for log in ("a.log", "b.log"):
        text = (tmp_path / log).read_text()
        assert "draining" in text and "Traceback" not in text, text[-3000:]
    assert "drained: no session open" in (tmp_path / "a.log").read_text()
    assert "drain timed out" in (tmp_path / "b.log").read_text()
    print(f"deploy test took {time.monotonic() - started:.1f} s")
