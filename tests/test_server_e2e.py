"""End to end: a real `duplexd serve` (demo model, CPU, 4 slots) on a free local port, driven over the wire.

One server for the whole module. Covers both protocols' round trips, 4 concurrent sessions, capacity refusal,
every kind of bad input (each followed by a healthy session), the overload policies, a killed client's slot
coming back, and the reference `moshi` package's own client code talking to the server.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx2
import numpy as np
import pytest
import sphn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from .live_server import children, demo_cache, running_server

RATE, FRAME = 24000, 1920
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://allowed.example"
MAX_MESSAGE = 65536
# Long enough that a loaded machine never idles out a test session by accident: a client that has sent its frames
# waits for the answers without a message of its own (3 s did, twice; 5 s did with two suites on 2 cores).
IDLE = 10.0
SERVER_ARGS = [
    "--max-sessions",
    "4",
    "--api-key",
    KEY,
    "--allowed-origins",
    ORIGIN,
    "--idle-timeout",
    str(IDLE),
    "--max-message-bytes",
    str(MAX_MESSAGE),
    "--ws-ping-interval",
    "1",
    "--ws-ping-timeout",
    "1.5",
    "--send-timeout",
    "2",
    "--max-session-seconds",
    "60",
    # Kyutai audio in two codec worker processes (the other servers of the suite run the default codec thread)
    "--codec-processes",
    "2",
]


class Server:
    def __init__(self, port: int, proc: subprocess.Popen, log: Path) -> None:
        self.port, self.proc, self.log = port, proc, log
        self.http = f"http://127.0.0.1:{port}"

    def ws(self, path: str) -> str:
        return f"ws://127.0.0.1:{self.port}{path}"

    def get(self, path: str, **kw) -> httpx2.Response:
        return httpx2.get(self.http + path, timeout=10, **kw)

    def metric(self, name: str, labels: str = "") -> float:
        text = self.get("/metrics").text
        match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
        assert match, f"{name}{labels} not in /metrics"
        return float(match.group(1))

    def wait_for(self, check, timeout: float = 10.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def wait_idle(self) -> None:
        """No session holds a slot (the previous test's sessions are gone)."""
        self.wait_for(
            lambda: self.metric("duplexd_sessions_active") == 0 and self.metric("duplexd_kv_pages_used") == 0,
            what="all slots free",
        )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "serve.log"
    env = {"DUPLEXD_CACHE": str(demo_cache(tmp_path_factory))}
    with running_server(log, *SERVER_ARGS, env=env) as live:
        yield Server(live.port, live.proc, log)
    proc = live.proc
    assert proc.returncode == 0, log.read_text()[-3000:]  # SIGINT: drained (no session open), a clean exit
    assert "Finished server process" in log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def tone(frames: int, freq: float = 220.0) -> np.ndarray:
    t = np.arange(frames * FRAME) / RATE
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


# ----------------------------------------------------------------------------------------------- Kyutai client


async def kyutai_open(server: Server, query: str = "", headers: dict | None = None, **kw):
    return await connect(server.ws(f"/api/chat?{query}"), additional_headers=AUTH if headers is None else headers, **kw)


BUILD_INFO_KEYS = (
    "build_timestamp",
    "build_date",
    "git_branch",
    "git_timestamp",
    "git_date",
    "git_hash",
    "git_describe",
    "rustc_host_triple",
    "rustc_version",
    "cargo_target_triple",
)


async def kyutai_greeting(ws) -> dict:
    meta = await ws.recv()
    assert meta[0] == 4, meta[:20]
    info = json.loads(meta[1:].decode())
    assert await ws.recv() == b"\x00" + bytes(8)  # handshake after metadata, Rust style
    return info


async def kyutai_exchange(ws, frames: int, pace: float = 0.0) -> tuple[np.ndarray, list[str], int]:
    """Send `frames` frames of Opus; return the decoded answer, its text pieces and the audio message count."""
    writer, reader = sphn.OpusStreamWriter(RATE), sphn.OpusStreamReader(RATE)
    audio = tone(frames)

    async def send():
        for i in range(frames):
            ogg = writer.append_pcm(audio[i * FRAME : (i + 1) * FRAME])
            if ogg:
                await ws.send(b"\x01" + ogg)
            await asyncio.sleep(pace)

    sender = asyncio.create_task(send())
    pcm, texts, messages = [], [], 0
    while messages < frames - 1:
        msg = await asyncio.wait_for(ws.recv(), 20)
        assert isinstance(msg, bytes)
        if msg[0] == 1:
            messages += 1
            pcm.append(reader.append_bytes(msg[1:]))
        elif msg[0] == 2:
            texts.append(msg[1:].decode("utf-8"))
        else:
            raise AssertionError(f"unexpected kind {msg[0]}: {msg[1:200]!r}")
    await sender
    return np.concatenate(pcm), texts, messages


async def healthy_kyutai(server: Server, frames: int = 4) -> None:
    async with await kyutai_open(server) as ws:
        await kyutai_greeting(ws)
        pcm, _, messages = await kyutai_exchange(ws, frames)
        assert messages == frames - 1 and len(pcm) > 0


async def closed_with(ws, timeout: float = 15) -> tuple[int, list]:
    """Read until the server closes; return its close code and what it sent before."""
    received = []
    try:
        while True:
            received.append(await asyncio.wait_for(ws.recv(), timeout))
    except ConnectionClosed as e:
        assert e.rcvd is not None, "the connection dropped without a close frame"
        return e.rcvd.code, received


# ----------------------------------------------------------------------------------------------- Realtime client


async def realtime_open(server: Server, query: str = "", headers: dict | None = None, **kw):
    return await connect(
        server.ws(f"/v1/realtime?{query}"),
        subprotocols=["realtime"],
        additional_headers=AUTH if headers is None else headers,
        **kw,
    )


def append_event(pcm: np.ndarray) -> str:
    data = (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(data).decode()})


async def realtime_exchange(ws, frames: int, pace: float = 0.0) -> tuple[np.ndarray, list[str], list[dict]]:
    audio = tone(frames, 330.0)

    async def send():
        for i in range(frames):
            await ws.send(append_event(audio[i * FRAME : (i + 1) * FRAME]))
            await asyncio.sleep(pace)

    sender = asyncio.create_task(send())
    pcm, texts, others = [], [], []
    while len(pcm) < frames - 1:
        event = json.loads(await asyncio.wait_for(ws.recv(), 20))
        if event["type"] == "response.output_audio.delta":
            pcm.append(np.frombuffer(base64.b64decode(event["delta"]), "<i2"))
        elif event["type"] == "response.output_audio_transcript.delta":
            texts.append(event["delta"])
        else:
            others.append(event)
    await sender
    return np.concatenate(pcm), texts, others


# ----------------------------------------------------------------------------------------------- tests


def test_http_endpoints(server):
    health = server.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    ready = server.get("/ready").json()
    assert ready["ready"] and ready["admissible_sessions"] == 4 and ready["capacity"] == 4
    assert server.get("/v1/models").status_code == 401  # the API key guards the client API
    models = server.get("/v1/models", headers=AUTH).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "duplexd-demo" and models["data"][0]["demo"]
    text = server.get("/metrics").text
    for name in (
        "duplexd_sessions_active",
        "duplexd_sessions_capacity 4.0",
        "duplexd_sessions_refused_total",
        "duplexd_step_duration_seconds_bucket",
        "duplexd_step_batch_size_bucket",
        "duplexd_frames_in_total",
        "duplexd_frames_out_total",
        "duplexd_frames_late_total",
        "duplexd_frames_dropped_total",
        "duplexd_kv_pages_used",
        "duplexd_frame_latency_seconds_bucket",
        "process_resident_memory_bytes",
    ):
        assert name in text, name
    log = server.log.read_text()
    lines = log.splitlines()  # what is served is said before the port is announced (a cold cache writes the demo first)
    served = next(i for i, line in enumerate(lines) if "duplexd serve: " in line)
    assert "DEMO model" in lines[served] and served < next(i for i, line in enumerate(lines) if "listening on" in line)


def test_kyutai_round_trip(server):
    async def main():
        query = (
            "text_temperature=0.5&text_topk=10&audio_temperature=0.6&audio_topk=50&text_seed=7&pad_mult=0.5"
            "&repetition_penalty=1.3&repetition_penalty_context=32"
        )
        async with await kyutai_open(server, query) as ws:
            info = await kyutai_greeting(ws)
            assert (
                info["text_temperature"],
                info["text_topk"],
                info["audio_temperature"],
                info["audio_topk"],
                info["seed"],
            ) == (0.5, 10, 0.6, 50, 7)
            assert (info["pad_mult"], info["repetition_penalty"], info["repetition_penalty_context"]) == (0.5, 1.3, 32)
            build = info["build_info"]  # what Kyutai's web client checks: the Rust server's ten strings
            for key in BUILD_INFO_KEYS:
                assert isinstance(build[key], str) and build[key], key
            assert build["server"] == "duplexd" and build["rustc_version"].startswith("python ")
            pcm, texts, messages = await kyutai_exchange(ws, 12, pace=0.02)
            return pcm, texts, messages

    pcm, texts, messages = run(main())
    assert messages == 11  # N frames in, N - 1 out
    assert 9 * FRAME <= len(pcm) <= 11 * FRAME and np.isfinite(pcm).all() and np.abs(pcm).max() > 0
    assert texts and all("\u2581" not in t for t in texts)
    before = server.metric("duplexd_frames_out_total")
    assert before >= 11


def test_kyutai_max_steps_ends_the_session(server):
    async def main():
        async with await kyutai_open(server, "max_steps=3") as ws:
            info = await kyutai_greeting(ws)
            assert info["max_steps"] == 3
            writer = sphn.OpusStreamWriter(RATE)
            for _ in range(6):
                await ws.send(b"\x01" + writer.append_pcm(tone(1)))
            return await closed_with(ws)

    code, received = run(main())
    assert code == 1000
    assert sum(m[0] == 1 for m in received) == 2  # 3 frames stepped, the first one produces nothing
    assert received[-1] == b"\x05" + b"maximum session length reached"


def test_realtime_round_trip(server):
    async def main():
        async with await realtime_open(server) as ws:
            assert ws.subprotocol == "realtime"
            created = json.loads(await ws.recv())
            assert created["type"] == "session.created"
            assert created["session"]["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
            sampling = {
                "text_temperature": 0.0,
                "text_topk": 1,
                "audio_temperature": 0.5,
                "audio_topk": 20,
                "seed": 3,
                "repetition_penalty": 1.2,
                "repetition_penalty_context": 16,
                "pad_mult": 0.5,
            }
            await ws.send(json.dumps({"type": "session.update", "session": {"sampling": sampling}}))
            updated = json.loads(await ws.recv())
            assert updated["type"] == "session.updated" and updated["session"]["sampling"] == sampling
            await ws.send(json.dumps({"type": "response.create", "event_id": "evt1"}))
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and error["error"]["code"] == "unsupported_event"
            assert error["error"]["event_id"] == "evt1"
            pcm, texts, others = await realtime_exchange(ws, 10, pace=0.02)
            await ws.send(json.dumps({"type": "session.update", "session": {"sampling": {"seed": 4}}}))
            late = json.loads(await ws.recv())
            while late["type"] != "session.updated":  # the last frame's transcript may still be on its way
                late = json.loads(await ws.recv())
            assert late["session"]["sampling"] == {**sampling, "seed": 4}  # changed mid-conversation
            return pcm, texts, others, late

    pcm, texts, others, late = run(main())
    assert len(pcm) == 9 * FRAME  # pcm16, 3840 bytes per frame
    assert [e["type"] for e in others] == ["response.created"]
    assert texts and late["type"] == "session.updated"


def test_realtime_events_openai_sdks_send_by_default_get_no_error(server):
    """The model's item retrieved (with its text so far) and truncated (acknowledged), `response.cancel` accepted
    with no answer; an item the session never announced is not found, and `output_audio_buffer.clear` (a WebRTC
    call's) is unsupported on a WebSocket."""

    async def main():
        async with await realtime_open(server) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            audio = tone(6)
            for i in range(6):
                await ws.send(append_event(audio[i * FRAME : (i + 1) * FRAME]))
            while (first := json.loads(await ws.recv()))["type"] != "response.output_audio.delta":
                pass
            item_id = first["item_id"]
            for event in (
                {"type": "conversation.item.retrieve", "item_id": item_id},
                {"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0, "audio_end_ms": 80},
                {"type": "response.cancel", "event_id": "c1"},
                {"type": "conversation.item.retrieve", "event_id": "r2", "item_id": "item_never"},
                {"type": "output_audio_buffer.clear", "event_id": "o1"},
                {"type": "session.update", "session": {"sampling": {"seed": 2}}},
            ):
                await ws.send(json.dumps(event))
            said, said_before, others = [], None, []
            while not others or others[-1]["type"] != "session.updated":
                event = json.loads(await asyncio.wait_for(ws.recv(), 20))
                if event["type"] == "response.output_audio_transcript.delta":
                    said.append(event["delta"])
                elif event["type"] != "response.output_audio.delta":
                    said_before = "".join(said) if said_before is None else said_before
                    others.append(event)
            return item_id, said_before, others

    item_id, said_before, others = run(main())
    assert [e["type"] for e in others] == [
        "conversation.item.retrieved",
        "conversation.item.truncated",
        "error",
        "error",
        "session.updated",
    ]
    retrieved, truncated, not_found, clear, _ = others
    item = retrieved["item"]
    assert item["id"] == item_id and item["role"] == "assistant" and item["status"] == "in_progress"
    assert item["content"][0]["type"] == "output_audio" and item["content"][0]["transcript"].startswith(said_before)
    assert (truncated["item_id"], truncated["content_index"], truncated["audio_end_ms"]) == (item_id, 0, 80)
    assert (not_found["error"]["code"], not_found["error"]["event_id"]) == ("item_not_found", "r2")
    assert (clear["error"]["code"], clear["error"]["event_id"]) == ("unsupported_event", "o1")


def test_realtime_text_penalties_from_the_query_and_refused_values(server):
    """The Kyutai query parameters set a Realtime session's penalties; a bad value in a `session.update` is a
    non-fatal error naming the parameter, one in the query string refuses the connection (1007) the same way."""

    async def main():
        query = "repetition_penalty=1.5&repetition_penalty_context=8&pad_mult=-1&seed=9"
        async with await realtime_open(server, query) as ws:
            created = json.loads(await ws.recv())
            bad = {"type": "session.update", "event_id": "u1", "session": {"sampling": {"pad_mult": "loud"}}}
            await ws.send(json.dumps(bad))
            error = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "session.update", "session": {"sampling": {"repetition_penalty": 1}}}))
            updated = json.loads(await ws.recv())
        async with await realtime_open(server, "repetition_penalty_context=1000") as ws:
            code, received = await closed_with(ws)
        return created, error, updated, code, json.loads(received[-1])

    created, error, updated, code, refused = run(main())
    assert created["session"]["sampling"]["seed"] == 9
    assert {
        k: created["session"]["sampling"][k] for k in ("repetition_penalty", "repetition_penalty_context", "pad_mult")
    } == {"repetition_penalty": 1.5, "repetition_penalty_context": 8, "pad_mult": -1.0}
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["code"] == "invalid_value" and error["error"]["param"] == "session.sampling.pad_mult"
    assert error["error"]["event_id"] == "u1" and "pad_mult" in error["error"]["message"]
    assert updated["type"] == "session.updated" and updated["session"]["sampling"]["repetition_penalty"] == 1.0
    assert updated["session"]["sampling"]["pad_mult"] == -1.0  # the rest of the session's sampling is kept
    assert code == 1007 and refused["error"]["type"] == "invalid_request_error"
    assert refused["error"]["code"] == "invalid_parameter"
    assert "repetition_penalty_context" in refused["error"]["message"]


def test_four_concurrent_sessions_then_capacity_refusal(server):
    server.wait_idle()

    async def main():
        kyutai = [await kyutai_open(server) for _ in range(2)]
        realtime = [await realtime_open(server) for _ in range(2)]
        for ws in kyutai:
            await kyutai_greeting(ws)
        for ws in realtime:
            assert json.loads(await ws.recv())["type"] == "session.created"
        assert server.metric("duplexd_sessions_active") == 4
        ready = await asyncio.to_thread(server.get, "/ready")
        assert ready.status_code == 503 and ready.json()["reason"] == "at capacity"
        # full: both protocols refuse at once, with an error and 1013
        async with await kyutai_open(server) as ws:
            code, received = await closed_with(ws, timeout=5)
            assert code == 1013 and received[-1][0] == 5 and b"capacity" in received[-1]
        async with await realtime_open(server) as ws:
            code, received = await closed_with(ws, timeout=5)
            error = json.loads(received[-1])
            assert code == 1013 and error["type"] == "error" and error["error"]["code"] == "resource_exhausted"
        # all at once (each well inside --max-pending-frames): frames queued in every session when a step starts,
        # so the engine batches them; paced, a fast step can take each arrival alone
        results = await asyncio.gather(
            *(kyutai_exchange(ws, 10) for ws in kyutai),
            *(realtime_exchange(ws, 10) for ws in realtime),
        )
        for ws in kyutai + realtime:
            await ws.close()
        return results

    results = run(main())
    for pcm, _, _ in results:
        assert len(pcm) >= 8 * FRAME
    assert server.metric("duplexd_sessions_refused_total", '{reason="capacity"}') >= 2
    server.wait_idle()
    text = server.get("/metrics").text
    batch = re.search(r'^duplexd_step_batch_size_bucket\{le="2.0"\} (\S+)$', text, re.M)
    total = re.search(r"^duplexd_step_batch_size_count (\S+)$", text, re.M)
    assert float(batch.group(1)) < float(total.group(1))  # some steps batched more than 2 sessions


def _ogg() -> bytes:
    return sphn.OpusStreamWriter(RATE).append_pcm(tone(1))


# (name, protocol, headers, query, message to send or None, expected close code)
BAD_INPUTS = [
    ("kyutai-unknown-kind", "kyutai", AUTH, "", b"\x09hello", 1002),
    ("kyutai-empty-message", "kyutai", AUTH, "", b"", 1002),
    ("kyutai-text-frame", "kyutai", AUTH, "", "hello", 1003),
    ("kyutai-malformed-ogg", "kyutai", AUTH, "", b"\x01" + b"not an ogg stream" * 4, 1007),
    ("kyutai-corrupt-opus", "kyutai", AUTH, "", b"\x01" + _ogg()[:40] + b"\xff" * 200, 1007),
    ("kyutai-oversize", "kyutai", AUTH, "", b"\x01" + bytes(MAX_MESSAGE + 10), 1009),
    ("kyutai-bad-query", "kyutai", AUTH, "text_temperature=hot", None, 1007),
    ("kyutai-negative-topk", "kyutai", AUTH, "audio_topk=0", None, 1007),
    ("kyutai-zero-penalty", "kyutai", AUTH, "repetition_penalty=0", None, 1007),
    ("kyutai-long-penalty-context", "kyutai", AUTH, "repetition_penalty_context=100000", None, 1007),
    ("kyutai-bad-pad-mult", "kyutai", AUTH, "pad_mult=inf", None, 1007),
    ("kyutai-wrong-key", "kyutai", {"Authorization": "Bearer nope"}, "", None, 1008),
    ("kyutai-no-key", "kyutai", {}, "", None, 1008),
    ("kyutai-bad-origin", "kyutai", {**AUTH, "Origin": "http://evil.example"}, "", None, 1008),
    ("realtime-malformed-json", "realtime", AUTH, "", '{"type": "input_audio_buffer.append", ', 1007),
    ("realtime-not-an-event", "realtime", AUTH, "", "[1, 2, 3]", 1007),
    ("realtime-bad-base64", "realtime", AUTH, "", '{"type": "input_audio_buffer.append", "audio": "@@@"}', 1007),
    ("realtime-odd-pcm16", "realtime", AUTH, "", '{"type": "input_audio_buffer.append", "audio": "AAAA"}', 1007),
    ("realtime-unknown-event", "realtime", AUTH, "", '{"type": "dance.start"}', 1002),
    ("realtime-zero-penalty", "realtime", AUTH, "repetition_penalty=0", None, 1007),
    ("realtime-nan-pad-mult", "realtime", AUTH, "pad_mult=nan", None, 1007),
    ("realtime-event-id-not-a-string", "realtime", AUTH, "", '{"type": "response.create", "event_id": 1}', 1007),
    ("realtime-binary-frame", "realtime", AUTH, "", b"\x01\x02", 1003),
    (
        "realtime-oversize",
        "realtime",
        AUTH,
        "",
        json.dumps({"type": "input_audio_buffer.append", "audio": "A" * MAX_MESSAGE}),
        1009,
    ),
    ("realtime-wrong-key", "realtime", {"Authorization": "Bearer nope"}, "", None, 1008),
    ("realtime-bad-origin", "realtime", {**AUTH, "Origin": "http://evil.example"}, "", None, 1008),
    ("realtime-transcription-session-of-a-conversation-model", "realtime", AUTH, "intent=transcription", None, 1008),
]


@pytest.mark.parametrize("name,proto,headers,query,message,code", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_refused_and_the_server_keeps_serving(server, name, proto, headers, query, message, code):
    async def main():
        opener = kyutai_open if proto == "kyutai" else realtime_open
        async with await opener(server, query, headers, max_size=None) as ws:
            if message is not None:  # bad input inside an admitted session
                if proto == "kyutai":
                    await kyutai_greeting(ws)
                else:
                    assert json.loads(await ws.recv())["type"] == "session.created"
                await ws.send(message)
            got, received = await closed_with(ws)
        await healthy_kyutai(server)
        return got, received

    got, received = run(main())
    assert got == code
    last = received[-1]
    if proto == "kyutai":
        assert isinstance(last, bytes) and last[0] == 5 and len(last) > 10  # error kind + a readable message
    else:
        error = json.loads(last)
        assert error["type"] == "error" and error["error"]["code"] and error["error"]["message"]


def test_allowed_origin_and_query_key_are_accepted(server):
    async def main():
        async with await kyutai_open(server, f"api_key={KEY}", {"Origin": ORIGIN}) as ws:
            await kyutai_greeting(ws)
            _, _, messages = await kyutai_exchange(ws, 3)
            return messages

    assert run(main()) == 2


def test_silent_client_is_closed_after_the_idle_timeout(server):
    async def main():
        async with await realtime_open(server) as ws:
            await ws.recv()  # session.created
            started = time.monotonic()
            code, received = await closed_with(ws)
            return code, json.loads(received[-1]), time.monotonic() - started

    code, error, elapsed = run(main())
    assert code == 1000 and error["error"]["code"] == "idle_timeout"
    assert IDLE * 0.8 < elapsed < IDLE + 3


@pytest.mark.realtime
def test_flooding_and_stalled_clients_do_not_hurt_a_paced_session(server):
    """One client sends 3 s of audio at once (input beyond the inbox is dropped and counted), another stops
    reading (closed by the keep-alive), while a paced client gets every frame it is owed."""
    server.wait_idle()
    dropped_before = server.metric("duplexd_frames_dropped_total", '{direction="in"}')

    async def flood():
        async with await kyutai_open(server) as ws:
            await kyutai_greeting(ws)
            writer = sphn.OpusStreamWriter(RATE)
            burst = b"".join(writer.append_pcm(tone(1)) for _ in range(40))
            await ws.send(b"\x01" + burst)
            await asyncio.sleep(1.0)

    async def stall():
        ws = await kyutai_open(server, max_queue=1, ping_interval=None)
        await kyutai_greeting(ws)
        writer = sphn.OpusStreamWriter(RATE)
        started = time.monotonic()
        try:
            while time.monotonic() - started < 15:
                await ws.send(b"\x01" + writer.append_pcm(tone(1)))
                await asyncio.sleep(0.08)
        except ConnectionClosed:
            return time.monotonic() - started
        finally:
            await ws.close()
        return None

    async def paced():
        async with await kyutai_open(server) as ws:
            await kyutai_greeting(ws)
            _, _, messages = await kyutai_exchange(ws, 40, pace=0.08)
            return messages

    async def main():
        return await asyncio.gather(flood(), stall(), paced())

    _, stalled_for, messages = run(main())
    assert messages == 39
    assert stalled_for is not None and stalled_for < 12  # the server closed the stalled reader
    assert server.metric("duplexd_frames_dropped_total", '{direction="in"}') >= dropped_before + 10
    server.wait_idle()


CLIENT = """
import asyncio, sys, numpy as np, sphn
from websockets.asyncio.client import connect

async def main():
    async with connect(sys.argv[1], additional_headers={"Authorization": "Bearer " + sys.argv[2]}) as ws:
        await ws.recv(); await ws.recv()
        writer = sphn.OpusStreamWriter(24000)
        frame = (0.3 * np.sin(np.arange(1920) / 10)).astype(np.float32)
        got = 0
        while True:
            await ws.send(b"\\x01" + writer.append_pcm(frame))
            while True:
                try:
                    msg = await asyncio.wait_for(ws.recv(), 0.02)
                except asyncio.TimeoutError:
                    break
                if msg[0] == 1:
                    got += 1
                    if got == 5:
                        print("streaming", flush=True)
            await asyncio.sleep(0.06)

asyncio.run(main())
"""


def test_killed_client_frees_its_slot(server):
    server.wait_idle()
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, server.ws("/api/chat"), KEY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "streaming", proc.stderr.read()
        assert server.metric("duplexd_sessions_active") == 1
        assert server.metric("duplexd_kv_pages_used") > 0
        proc.kill()  # SIGKILL mid-stream: no close frame, the kernel resets the connection
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    server.wait_idle()
    assert server.get("/ready").json()["admissible_sessions"] == 4


async def _stream_until_end(ws, frames: int) -> tuple[int, str | None, int | None]:
    """Send `frames` frames of Opus at 20 ms a frame; (audio messages received, error message, close code)."""
    writer, audio = sphn.OpusStreamWriter(RATE), tone(frames)

    async def send():
        with contextlib.suppress(ConnectionClosed):
            for i in range(frames):
                ogg = writer.append_pcm(audio[i * FRAME : (i + 1) * FRAME])
                if ogg:
                    await ws.send(b"\x01" + ogg)
                await asyncio.sleep(0.02)

    sender, received, error = asyncio.create_task(send()), 0, None
    try:
        while received < frames - 1:
            msg = await asyncio.wait_for(ws.recv(), 20)
            if msg[0] == 1:
                received += 1
            elif msg[0] == 5:
                error = msg[1:].decode()
    except ConnectionClosed as e:
        return received, error, e.rcvd.code if e.rcvd else None
    finally:
        await sender
    return received, error, None


def test_a_dead_codec_worker_ends_only_its_sessions_and_is_replaced(server):
    """Two sessions on the two codec workers (a session's streams share one); one worker is killed mid-stream: its
    session gets an error message and close 1011, the other keeps its audio, and a new session works."""
    server.wait_idle()
    workers = children(server.proc.pid)
    assert len(workers) == 2, workers

    async def main():
        async with await kyutai_open(server) as a, await kyutai_open(server) as b:
            for ws in (a, b):
                await kyutai_greeting(ws)
            await asyncio.gather(kyutai_exchange(a, 4), kyutai_exchange(b, 4))
            os.kill(workers[0], signal.SIGKILL)
            outcomes = await asyncio.gather(_stream_until_end(a, 12), _stream_until_end(b, 12))
        async with await kyutai_open(server) as c:
            await kyutai_greeting(c)
            fresh = await kyutai_exchange(c, 4)
        return outcomes, fresh

    outcomes, (_, _, fresh_messages) = run(main())
    ended = [o for o in outcomes if o[2] is not None]
    kept = [o for o in outcomes if o[2] is None]
    assert len(ended) == 1 and len(kept) == 1, outcomes
    assert ended[0][2] == 1011 and "codec worker exited" in (ended[0][1] or ""), ended
    assert kept[0] == (11, None, None)
    assert fresh_messages == 3
    replaced = children(server.proc.pid)
    assert len(replaced) == 2 and workers[0] not in replaced and workers[1] in replaced
    assert "codec worker 0" in server.log.read_text() or "codec worker 1" in server.log.read_text()


class _Printer:
    """What moshi.client's printers do, recorded."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.logs: list[tuple[str, str]] = []

    def print_token(self, token: str) -> None:
        self.tokens.append(token)

    def log(self, level: str, msg: str) -> None:
        self.logs.append((level, msg))

    def print_header(self) -> None: ...
    def print_pending(self) -> None: ...
    def print_lag(self) -> None: ...


class _Stream:
    def __init__(self, **kw) -> None: ...
    def __enter__(self):
        return self

    def __exit__(self, *a) -> None: ...


def test_reference_moshi_client_talks_to_the_server(server, monkeypatch):
    """The installed reference client (`moshi.client.Connection`, aiohttp, its sphn Opus streams, its kind-byte
    parsing) connects as it would to `python -m moshi.server`, streams microphone frames and plays the answer."""
    aiohttp = pytest.importorskip("aiohttp")
    monkeypatch.setitem(sys.modules, "sounddevice", types.SimpleNamespace(InputStream=_Stream, OutputStream=_Stream))
    client = pytest.importorskip("moshi.client")
    frames = 12

    async def main():
        printer = _Printer()
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(server.ws(f"/api/chat?api_key={KEY}")) as ws:
                conn = client.Connection(printer, ws, event_loop=asyncio.get_running_loop())
                receiver = asyncio.create_task(conn._recv_loop())
                audio = tone(frames)
                for i in range(frames):  # what the sounddevice input callback does for each 80 ms block
                    conn._on_audio_input(audio[i * FRAME : (i + 1) * FRAME, None], FRAME, None, None)
                    await asyncio.sleep(0.03)
                # The answer to all but the frames Ogg and the LM's delay hold back: waited for as long as it takes (a
                # loaded machine is slow, not wrong); `run` bounds the whole conversation.
                while conn._output_queue.qsize() < frames - 3:
                    await asyncio.sleep(0.05)
                await ws.close()
                await receiver
        return printer, conn

    printer, conn = run(main(), timeout=300)
    played = [conn._output_queue.get() for _ in range(conn._output_queue.qsize())]
    assert len(played) >= frames - 3 and all(p.shape == (FRAME,) for p in played)
    assert printer.tokens  # text messages decoded by the reference client
    # the reference client ignores (logs) the metadata and handshake kinds, as it does with its own server
    assert ("warning", "unknown message kind 4") in printer.logs
    assert not [entry for entry in printer.logs if entry[0] == "error"]


def _g711_session(server: Server, fmt: str, chunks: list[bytes]) -> tuple[list[bytes], dict]:
    """One session through the official `openai` SDK: `fmt` in and out, `chunks` (bytes of `fmt`) appended at a
    steady pace; returns the raw audio deltas and the session object of `session.updated`."""
    import openai  # noqa: PLC0415 - the test extra's SDK, as in the transcription tests

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.http}/v1", api_key=KEY, websocket_base_url=server.ws("/v1"))
        async with client.realtime.connect(model="duplexd") as conn:
            assert (await conn.recv()).type == "session.created"
            audio = {"format": {"type": fmt}} if fmt != "audio/pcm" else {"format": {"type": fmt, "rate": RATE}}
            await conn.session.update(
                session={"type": "realtime", "audio": {"input": audio, "output": audio}, "sampling": {"seed": 5}}
            )
            updated = json.loads(await conn.recv_bytes())
            assert updated["type"] == "session.updated", updated
            deltas: list[bytes] = []

            async def send():
                for chunk in chunks:
                    await conn.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())
                    await asyncio.sleep(0.03)

            sender = asyncio.create_task(send())
            while len(deltas) < len(chunks) - 2:
                event = json.loads(await asyncio.wait_for(conn.recv_bytes(), 20))
                if event["type"] == "response.output_audio.delta":
                    deltas.append(base64.b64decode(event["delta"]))
                assert event["type"] != "error", event
            await sender
            return deltas, updated["session"]

    return run(main())


def test_openai_sdk_telephone_audio_matches_pcm16_of_the_same_call(server):
    """G.711 mu-law in and out (`audio/pcmu`) through the official SDK, against a pcm16 session of the same seed
    fed what a reference decoder (libsndfile) and soxr make of the same bytes: the model hears the same samples
    (its answer is the same, frame for frame), and the mu-law it sends back is that answer at 8 kHz."""
    import soundfile as sf  # noqa: PLC0415
    import soxr  # noqa: PLC0415

    frames = 10
    speech = tone(frames, 300.0)[::3] * np.linspace(0.2, 1.0, frames * FRAME // 3, dtype=np.float32)  # 8 kHz
    raw = io.BytesIO()
    sf.write(raw, speech, 8000, format="RAW", subtype="ULAW")
    ulaw = raw.getvalue()
    heard = sf.read(io.BytesIO(ulaw), samplerate=8000, channels=1, format="RAW", subtype="ULAW", dtype="float32")[0]
    model_rate = soxr.ResampleStream(8000, RATE, 1, dtype="float32").resample_chunk(heard)
    pcm16 = (np.clip(model_rate, -1, 1) * 32768).round().clip(-32768, 32767).astype("<i2").tobytes()
    telephone, session = _g711_session(server, "audio/pcmu", [ulaw[i : i + 640] for i in range(0, len(ulaw), 640)])
    assert session["audio"]["input"]["format"] == {"type": "audio/pcmu", "rate": 8000}
    assert session["audio"]["output"]["format"] == {"type": "audio/pcmu", "rate": 8000}
    plain, _ = _g711_session(server, "audio/pcm", [pcm16[i : i + 2 * FRAME] for i in range(0, len(pcm16), 2 * FRAME)])
    answer = np.frombuffer(b"".join(plain), "<i2").astype(np.float32) / 32768
    ours = sf.read(io.BytesIO(b"".join(telephone)), samplerate=8000, channels=1, format="RAW", subtype="ULAW")[0]
    expected = soxr.ResampleStream(RATE, 8000, 1, dtype="float32").resample_chunk(answer)
    n = min(len(ours), len(expected))
    assert n >= (frames - 3) * FRAME // 3 and np.abs(expected).max() > 0.01
    # mu-law's steps are 1/16 of a segment: within 6 % of the sample (8 LSB in the first segment) of the answer
    assert np.all(np.abs(ours[:n] - expected[:n]) <= 0.06 * np.abs(expected[:n]) + 8 / 32768)
    # sensitive: one 80 ms frame of silence in the call changes what the model answers after it
    muted = ulaw[:1280] + b"\xff" * 640 + ulaw[1920:]
    changed, _ = _g711_session(server, "audio/pcmu", [muted[i : i + 640] for i in range(0, len(muted), 640)])
    assert telephone[:2] == changed[:2] and telephone[3 : frames - 3] != changed[3 : frames - 3]
