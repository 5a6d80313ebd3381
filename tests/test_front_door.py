"""The front door (`server/core/front_door.py`): the header timeout and the connection caps.

Unit tests of the bookkeeping, then a real `duplexd serve` (demo model) with a 2 s header timeout and 64
connections per address, flooded while a paced Kyutai session streams: half-open requests (half a request line,
then nothing), WebSocket upgrades that never send a frame, and connections over the per-address cap. The flood comes
from 127.0.0.2 and 127.0.0.3 (Linux routes all of 127/8 to the loopback), the session and the probes from 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import resource
import selectors
import socket
import statistics
import time
from dataclasses import dataclass

import pytest

from duplexd.server.core import front_door
from duplexd.server.core.front_door import FrontDoor

from .live_server import demo_cache, running_server
from .test_server_e2e import Server, healthy_kyutai, kyutai_exchange, kyutai_greeting, kyutai_open, run

HEADER_TIMEOUT = 2.0
PER_ADDRESS = 64
SLOTS = 4
IDLE = 5.0  # as the e2e tests: a loaded CI machine can fall 3 s behind a paced session, which then idles out
MARGIN = 1.5  # for a loaded 2-core CI machine
HALF_OPEN, UPGRADES, HTTP_PROBES, WS_PROBES = 200, 100, 3, 2
SESSION_FRAMES = 75  # 6 s at real time: the flood, its timeouts and the idle timeout of the silent sessions
FLOOD, SILENT, OTHER = "127.0.0.2", "127.0.0.3", "127.0.0.4"


# ----------------------------------------------------------------------------------------------- bookkeeping


def test_caps_per_address_and_in_total():
    door = FrontDoor(header_timeout=1, per_address=2, total=3, waiting_refusals=2)
    assert door.open("a1", "A") is None and door.open("a2", "A") is None
    refusal = door.open("a3", "A")
    assert refusal is not None and refusal.reason == "per_ip" and refusal.answered
    assert "more than 2 connections from A (--max-connections-per-ip)" in refusal.message
    assert door.open("b1", "B") is None  # another address is not affected
    total = door.open("c1", "C")
    assert total is not None and total.reason == "total" and "--max-connections" in total.message
    assert (door.admitted, door.waiting, door.open_connections) == (3, 2, 5)
    dropped = door.open("d1", "D")  # two refusals wait already: closed at accept, not counted
    assert dropped is not None and not dropped.answered and door.open_connections == 5
    assert door.refusal("a3") is refusal and door.refusal("a1") is None and door.refusal("d1") is None

    door.close("a1")
    door.close("a1")  # idempotent
    door.close("d1")  # never counted
    assert door.connections_from("A") == 1 and door.admitted == 2
    door.close("a3")
    door.close("c1")
    assert door.waiting == 0 and door.open("a4", "A") is None  # room again, for A and in total
    for key in ("a2", "a4", "b1"):
        door.close(key)
    assert (door.admitted, door.waiting, door.open_connections, door.connections_from("A")) == (0, 0, 0, 0)


def test_refusal_answers_503_to_http_and_to_a_websocket_handshake():
    door = FrontDoor(header_timeout=1, per_address=1, total=10)
    door.open("a1", "A")
    refusal = door.open("a2", "A")
    assert refusal is not None

    def answer(scope: dict) -> list[dict]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        asyncio.run(refusal(scope, None, send))
        return sent

    start, body = answer({"type": "http"})
    assert start["status"] == 503 and (b"connection", b"close") in start["headers"]
    assert b"too_many_connections" in body["body"] and b"--max-connections-per-ip" in body["body"]
    start, body = answer({"type": "websocket", "extensions": {"websocket.http.response": {}}})
    assert start == {**start, "type": "websocket.http.response.start", "status": 503}
    assert body["type"] == "websocket.http.response.body" and b"--max-connections-per-ip" in body["body"]
    assert answer({"type": "websocket"}) == [{"type": "websocket.close", "code": 1013}]  # no denial responses


def test_fd_limit_is_raised_to_what_the_caps_need_or_warned_about(monkeypatch, caplog):
    limits = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda _: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda _, value: limits.update(now=value))
    FrontDoor(1, 64, 2000).check_fd_limit()
    assert limits["now"] == (2000 + front_door.WAITING_REFUSALS + front_door.FD_RESERVE, 4096)
    assert not caplog.records
    FrontDoor(1, 64, 8000).check_fd_limit()
    assert limits["now"] == (4096, 4096) and "ulimit -n" in caplog.text


# ----------------------------------------------------------------------------------------------- live


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048 <= hard or hard == resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))  # the flood's sockets, and the server's
    elif soft < 2048:
        pytest.skip(f"ulimit -n is {soft} (hard {hard}): the flood needs about 1000 descriptors")
    try:
        with socket.socket() as s:
            s.bind((FLOOD, 0))
    except OSError:
        pytest.skip("connections from 127.0.0.2 need Linux's loopback")
    log = tmp_path_factory.mktemp("server") / "serve.log"
    env = {"DUPLEXD_CACHE": str(demo_cache(tmp_path_factory))}
    args = ["--max-sessions", str(SLOTS), "--idle-timeout", str(IDLE), "--header-timeout", str(HEADER_TIMEOUT)]
    args += ["--max-connections-per-ip", str(PER_ADDRESS), "--max-connections", "1024", "--static", "none"]
    with running_server(log, *args, env=env) as live:
        yield Server(live.port, live.proc, log)
    assert live.proc.returncode == 0, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


def open_fds(server: Server) -> int:
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


def connect(server: Server, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5, source_address=(source, 0))


def request(server: Server, head: bytes, source: str = "127.0.0.1") -> tuple[bytes, float]:
    """Send `head` on a new connection, read until the server closes it; the answer and how long it took."""
    started = time.monotonic()
    with connect(server, source) as s:
        s.sendall(head)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer, time.monotonic() - started


HEALTH = b"GET /health HTTP/1.1\r\nHost: duplexd\r\nConnection: close\r\n\r\n"


def upgrade(path: str = "/api/chat") -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET {path} HTTP/1.1\r\nHost: duplexd\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


def close_code(frames: bytes) -> int | None:
    """The code of the close frame among the server's WebSocket frames (unmasked) in `frames`, once it came."""
    i = 0
    while i + 2 <= len(frames):
        opcode, size, head = frames[i] & 0x0F, frames[i + 1] & 0x7F, 2
        if size >= 126:
            head = 4 if size == 126 else 10
            size = int.from_bytes(frames[i + 2 : i + head], "big")
        if i + head + size > len(frames):
            return None
        if opcode == 8:
            payload = frames[i + head : i + head + size]
            return int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005
        i += head + size
    return None


@dataclass
class Conn:
    """One flood connection: what it is, when it opened, what came back and when the server ended it."""

    sock: socket.socket
    kind: str  # "half" (half a request line) or "upgrade" (a WebSocket handshake, then nothing)
    opened: float
    received: bytes = b""
    ended: float | None = None
    status: int | None = None  # upgrades: the handshake's answer
    code: int | None = None  # upgraded: the server's close code


def flood(server: Server, kind: str, source: str, count: int) -> list[Conn]:
    conns = []
    for _ in range(count):
        s = connect(server, source)
        s.sendall(b"GET /heal" if kind == "half" else upgrade())
        conns.append(Conn(s, kind, time.monotonic()))
    return conns


def read_handshakes(conns: list[Conn]) -> None:
    """Wait for each upgrade's answer (its head, or the end of the connection), all of them still open."""
    for conn in conns:
        while b"\r\n\r\n" not in conn.received:
            try:
                chunk = conn.sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                conn.ended = time.monotonic()
                conn.sock.close()
                break
            conn.received += chunk
        else:
            conn.status = int(conn.received.split()[1])


def watch(conns: list[Conn], timeout: float) -> None:
    """Read every connection until the server ends it: EOF or reset, or a close frame after an upgrade (answered
    by closing the socket, as a client that is done would)."""
    selector = selectors.DefaultSelector()

    def end(conn: Conn) -> None:
        conn.ended = time.monotonic()
        if conn.sock.fileno() in selector.get_map():
            selector.unregister(conn.sock)
        conn.sock.close()

    def closed_by_frame(conn: Conn) -> bool:
        if conn.status == 101:
            conn.code = close_code(conn.received.partition(b"\r\n\r\n")[2])
        return conn.code is not None

    for conn in conns:
        if conn.ended is None:
            conn.sock.setblocking(False)
            selector.register(conn.sock, selectors.EVENT_READ, conn)
            if closed_by_frame(conn):  # came with the handshake's answer
                end(conn)
    deadline = time.monotonic() + timeout
    while selector.get_map() and time.monotonic() < deadline:
        for key, _ in selector.select(0.1):
            conn = key.data
            try:
                chunk = conn.sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            conn.received += chunk
            if not chunk or closed_by_frame(conn):
                end(conn)
    selector.close()


def metric(server: Server, name: str) -> float:
    answer, _ = request(server, b"GET /metrics HTTP/1.1\r\nHost: duplexd\r\nConnection: close\r\n\r\n")
    match = re.search(rf"^{re.escape(name)} (\S+)$", answer.decode(), re.M)
    assert match, name
    return float(match.group(1))


def open_flood(server: Server) -> tuple[list[Conn], list[bytes]]:
    """The half-open requests up to the cap, the over-cap probes (answered at once), the rest of the half-open
    requests, then the silent upgrades; returns the flood and the probes' answers."""
    conns = flood(server, "half", FLOOD, PER_ADDRESS)
    server.wait_for(lambda: metric(server, "duplexd_connections_open") >= PER_ADDRESS + 1, what="the cap reached")
    probes = [request(server, HEALTH, FLOOD)[0] for _ in range(HTTP_PROBES)]
    probes += [request(server, upgrade(), FLOOD)[0] for _ in range(WS_PROBES)]
    conns += flood(server, "half", FLOOD, HALF_OPEN - PER_ADDRESS)
    upgrades = flood(server, "upgrade", SILENT, UPGRADES)
    read_handshakes(upgrades)
    return conns + upgrades, probes


def health_latencies(server: Server, count: int = 10) -> list[float]:
    latencies = []
    for _ in range(count):
        answer, seconds = request(server, HEALTH)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        latencies.append(seconds)
        time.sleep(0.05)
    return latencies


@pytest.mark.realtime
def test_a_flood_of_silent_connections_is_shed_while_a_paced_session_keeps_its_audio(server):
    server.wait_idle()
    run(healthy_kyutai(server))  # whatever the first session opens lazily is in the baseline
    server.wait_idle()
    baseline = open_fds(server)

    async def main():
        async with await kyutai_open(server) as ws:
            await kyutai_greeting(ws)
            session = asyncio.create_task(kyutai_exchange(ws, SESSION_FRAMES, pace=0.08))
            await asyncio.sleep(0.3)
            conns, probes = await asyncio.to_thread(open_flood, server)
            during = open_fds(server)
            _, latencies = await asyncio.gather(
                asyncio.to_thread(watch, conns, HEADER_TIMEOUT + IDLE + 2 * MARGIN),
                asyncio.to_thread(health_latencies, server),
            )
            _, _, messages = await session
            return conns, probes, during, latencies, messages

    conns, probes, during, latencies, messages = run(main())
    assert messages == SESSION_FRAMES - 1  # every frame answered
    assert statistics.median(latencies) <= 0.1 and max(latencies) <= 1.0, latencies
    assert during >= baseline + 2 * PER_ADDRESS  # the flood really held the server's descriptors

    for answer in probes:  # over the cap: HTTP and the WebSocket handshake alike get a 503 naming the limit
        assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections-per-ip" in answer, answer[:300]
    half = [c for c in conns if c.kind == "half"]
    assert all(c.ended is not None for c in half), "half-open requests still open"
    for c in half[:PER_ADDRESS]:  # within the cap: closed by the header timeout
        assert HEADER_TIMEOUT - 0.05 <= c.ended - c.opened <= HEADER_TIMEOUT + MARGIN, c.ended - c.opened
    for c in half[PER_ADDRESS:]:  # over it: closed at accept, or after the short grace for a head
        assert c.ended - c.opened <= min(front_door.REFUSAL_GRACE_SECONDS, HEADER_TIMEOUT) + MARGIN
    upgrades = [c for c in conns if c.kind == "upgrade"]
    assert all(c.ended is not None for c in upgrades), "silent WebSockets still open"
    upgraded = [c for c in upgrades if c.status == 101]
    assert len(upgraded) == PER_ADDRESS  # the rest refused before the upgrade (503, or closed at accept)
    assert all(c.status in (503, None) for c in upgrades if c.status != 101)
    codes = sorted(c.code for c in upgraded)
    # the free slots hold silent sessions until the idle timeout (1000); the others are told "at capacity" (1013)
    assert codes == [1000] * (SLOTS - 1) + [1013] * (PER_ADDRESS - SLOTS + 1), codes
    for c in upgraded:
        if c.code == 1000:
            assert IDLE * 0.8 <= c.ended - c.opened <= IDLE + MARGIN

    refused_before = HALF_OPEN - PER_ADDRESS + UPGRADES - PER_ADDRESS + HTTP_PROBES + WS_PROBES
    assert metric(server, 'duplexd_connections_refused_total{reason="per_ip"}') == refused_before
    assert metric(server, "duplexd_connections_timed_out_total") == PER_ADDRESS
    server.wait_for(lambda: open_fds(server) <= baseline + 3, what=f"descriptors back to {baseline}")
    assert metric(server, "duplexd_connections_open") == 1  # the /metrics request itself
    server.wait_idle()
    run(healthy_kyutai(server))


def test_a_keep_alive_connection_whose_second_request_stalls_is_closed(server):
    with connect(server, OTHER) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: duplexd\r\n\r\n")
        answer = b""
        while b'"status"' not in answer:
            answer += s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /hea")  # the next request starts, and stalls
        started = time.monotonic()
        assert s.recv(65536) == b""
        assert HEADER_TIMEOUT - 0.05 <= time.monotonic() - started <= HEADER_TIMEOUT + MARGIN
