"""Server pieces without a model: framing, query parsing, settings, Realtime events, access
checks, and the HTTP routes of an app whose engine is still warming up or failed."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from types import SimpleNamespace
from unittest.mock import MagicMock

import numpy as np
import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request
from starlette.websockets import WebSocketDisconnect, WebSocketState

from duplexd.engine.dialogue.engine import EngineStats
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.server.app import create_app
from duplexd.server.connection.access import access_denied, presented_key
from duplexd.server.connection.closing import Close, CloseCode, close_for_session_end
from duplexd.server.connection.pump import Adapter, Limits, Pump
from duplexd.server.connection.query import BadQuery, max_frames_from_query, sampling_from_query
from duplexd.server.core.runtime import ModelInfo, Runtime
from duplexd.server.core.settings import ServerSettings
from duplexd.server.kyutai import messages as protocol
from duplexd.server.realtime import events as ev


def test_protocol_framing():
    assert protocol.handshake() == b"\x00" + bytes(8)
    assert protocol.audio(b"ogg") == b"\x01ogg"
    assert protocol.text(" héllo") == b"\x02" + " héllo".encode()
    assert protocol.error("full") == b"\x05full"
    assert json.loads(protocol.metadata({"a": 1})[1:]) == {"a": 1}
    msg = protocol.decode(b"\x03\x01")
    assert msg.kind == protocol.Kind.CONTROL and msg.payload == b"\x01"
    for bad in (b"", b"\x08", b"\xff abc"):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(bad)


def test_sampling_from_query_uses_the_rust_server_names():
    params = sampling_from_query(
        {
            "text_temperature": "0.5",
            "text_topk": "10",
            "audio_temperature": "0",
            "audio_topk": "5",
            "text_seed": "7",
            "pad_mult": "1.5",
            "repetition_penalty": "1.2",
            "repetition_penalty_context": "32",
            "email": "x",
        }
    )
    assert params == SamplingParams(
        0.5, 10, 0.0, 5, 7, repetition_penalty=1.2, repetition_penalty_context=32, pad_mult=1.5
    )
    assert sampling_from_query({"audio_seed": "3", "text_seed": "7"}).seed == 3
    defaults = sampling_from_query({})
    assert (defaults.text_temperature, defaults.text_topk, defaults.audio_temperature, defaults.audio_topk) == (
        0.7,
        25,
        0.8,
        250,
    )
    assert len({sampling_from_query({}).seed for _ in range(3)}) > 1  # a fresh seed per session by default
    assert (defaults.repetition_penalty, defaults.repetition_penalty_context, defaults.pad_mult) == (1.0, 64, 0.0)
    for bad in (
        {"text_topk": "1.5"},
        {"text_temperature": "nan"},
        {"audio_topk": "0"},
        {"seed": "x"},
        {"repetition_penalty": "0"},
        {"repetition_penalty": "-1"},
        {"repetition_penalty": "inf"},
        {"repetition_penalty_context": "-1"},
        {"repetition_penalty_context": "257"},
        {"repetition_penalty_context": "1.5"},
        {"pad_mult": "inf"},
        {"pad_mult": "nan"},
    ):
        with pytest.raises(BadQuery):
            sampling_from_query(bad)
    assert max_frames_from_query({"max_steps": "100"}) == 100 and max_frames_from_query({}) is None
    with pytest.raises(BadQuery):
        max_frames_from_query({"max_steps": "0"})


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("DUPLEXD_PORT", "9000")
    monkeypatch.setenv("DUPLEXD_DEVICES", "cuda:0, cuda:1")
    monkeypatch.setenv("DUPLEXD_KV_MEMORY", "1.5GiB")
    monkeypatch.setenv("DUPLEXD_ALLOWED_ORIGINS", "https://a.example,https://b.example")
    monkeypatch.setenv("DUPLEXD_LOG_LEVEL", "DEBUG")
    s = ServerSettings(port=9100)  # flags (init values) win over the environment
    assert s.port == 9100 and s.devices == ["cuda:0", "cuda:1"] and s.kv_memory == int(1.5 * 2**30)
    assert s.allowed_origins == ["https://a.example", "https://b.example"] and s.log_level == "debug"
    assert s.demo and s.session_frames(speech_to_text=False) == 4500
    assert s.session_frames(speech_to_text=True) is None  # moshi-server caps no ASR stream
    explicit = ServerSettings(max_session_seconds=60)
    assert explicit.session_frames(True) == explicit.session_frames(False) == 750
    assert ServerSettings(kv_memory="500MB").kv_memory == 500 * 10**6 and ServerSettings(kv_memory=123).kv_memory == 123
    assert ServerSettings(max_message_bytes="2MiB").max_message_bytes == 2 << 20
    for bad in ({"kv_memory": "lots"}, {"kv_memory": 0}, {"max_message_bytes": "1KB"}):
        with pytest.raises(ValueError):
            ServerSettings(**bad)
    with pytest.raises(ValueError):
        ServerSettings(ssl_certfile="cert.pem")  # a certificate without its key


def _append(audio: str) -> ev.AudioAppend:
    return ev.AudioAppend(type="input_audio_buffer.append", audio=audio)


def _refused(text: str) -> Close | ev.RealtimeError:
    with pytest.raises((Close, ev.RealtimeError)) as info:
        ev.parse_event(text)
    return info.value


def test_realtime_audio_and_events():
    pcm = np.linspace(-1, 1, 1920, dtype=np.float32)
    event = ev.parse_event(json.dumps({"type": "input_audio_buffer.append", "audio": ev.encode_audio(pcm)}))
    decoded = ev.decode_audio(event)
    assert decoded.dtype == np.float32 and np.abs(decoded - pcm).max() < 1e-4
    for bad, error in (("!!", "invalid_base64"), (base64.b64encode(b"abc").decode(), "invalid_audio")):
        with pytest.raises(Close) as info:
            ev.decode_audio(_append(bad))
        assert info.value.code == CloseCode.INVALID_PAYLOAD and info.value.error == error
    for text, code, error in (
        ("{", CloseCode.INVALID_PAYLOAD, "invalid_json"),
        ('{"no": "type"}', CloseCode.INVALID_PAYLOAD, "invalid_event"),
        ('{"type": 5}', CloseCode.INVALID_PAYLOAD, "invalid_event"),
        ("[1, 2]", CloseCode.INVALID_PAYLOAD, "invalid_event"),
        ('{"type": "response.create", "event_id": 3}', CloseCode.INVALID_PAYLOAD, "invalid_event"),
        ('{"type": "input_audio_buffer.append"}', CloseCode.INVALID_PAYLOAD, "invalid_audio"),
        ('{"type": "input_audio_buffer.append", "audio": 1}', CloseCode.INVALID_PAYLOAD, "invalid_audio"),
        ('{"type": "dance.start"}', CloseCode.PROTOCOL_ERROR, "unknown_event"),
    ):
        refusal = _refused(text)
        assert isinstance(refusal, Close) and (refusal.code, refusal.error) == (code, error), text
    turn = ev.parse_event('{"type": "response.create", "event_id": "e1", "response": {}}')
    assert isinstance(turn, ev.TurnEvent) and turn.event_id == "e1"
    assert {type(ev.parse_event(json.dumps({"type": t}))) for t in ev.UNSUPPORTED} == {ev.TurnEvent}
    update = ev.parse_event(
        json.dumps({"type": "session.update", "session": {"sampling": {"audio_topk": 7}, "instructions": "ignored"}})
    )
    assert isinstance(update, ev.SessionUpdate)
    assert update.sampling(SamplingParams(seed=1)) == SamplingParams(audio_topk=7, seed=1)
    for session, code, param in (
        ({"sampling": {"audio_topk": 0}}, "invalid_value", "session.sampling.audio_topk"),
        ({"sampling": {"pitch": 1}}, "invalid_value", "session.sampling.pitch"),
        ({"sampling": 7}, "invalid_value", "session.sampling"),
        ("nope", "invalid_value", "session"),
        (
            {"audio": {"input": {"format": {"type": "audio/opus"}}}},
            "unsupported_audio_format",
            "session.audio.input.format",
        ),
        (
            {"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            "unsupported_audio_format",
            "session.audio.output.format",
        ),
        ({"input_audio_format": "g722"}, "unsupported_audio_format", "session.input_audio_format"),
    ):
        refusal = _refused(json.dumps({"type": "session.update", "event_id": "u1", "session": session}))
        assert isinstance(refusal, ev.RealtimeError), session
        assert (refusal.code, refusal.param, refusal.event_id) == (code, param, "u1")
    delta = json.loads(ev.audio_delta("r", "i", pcm))
    assert delta["type"] == "response.output_audio.delta" and len(base64.b64decode(delta["delta"])) == 3840
    error = json.loads(ev.error_event("capacity", "full", kind="server_error"))
    assert error["type"] == "error" and error["error"]["code"] == "capacity" and error["event_id"]


def test_realtime_text_penalties_in_session_update_query_and_session_object():
    knobs = {"repetition_penalty": 1.3, "repetition_penalty_context": 32, "pad_mult": -0.5}
    update = ev.parse_event(json.dumps({"type": "session.update", "session": {"sampling": knobs}}))
    assert isinstance(update, ev.SessionUpdate)
    params = update.sampling(SamplingParams(seed=2))
    assert params == SamplingParams(seed=2, **knobs)
    assert sampling_from_query({k: str(v) for k, v in knobs.items()}, SamplingParams(seed=2)) == params
    echoed = ev.session_object("sess", "model", params, 60.0)["sampling"]
    assert {k: echoed[k] for k in knobs} == knobs
    for bad in (
        {"repetition_penalty": 0},
        {"repetition_penalty": -1.0},
        {"repetition_penalty": "1e999"},
        {"repetition_penalty_context": -1},
        {"repetition_penalty_context": 257},
        {"repetition_penalty_context": 1.5},
        {"pad_mult": "NaN"},
        {"pad_mult": "fast"},
    ):
        refusal = _refused(json.dumps({"type": "session.update", "session": {"sampling": bad}}))
        name = next(iter(bad))
        assert isinstance(refusal, ev.RealtimeError) and refusal.code == "invalid_value", bad
        assert refusal.param == f"session.sampling.{name}" and name in refusal.message
        with pytest.raises(BadQuery, match=name):
            sampling_from_query({name: str(bad[name])})


def test_close_reasons():
    assert close_for_session_end("max_frames").code == CloseCode.NORMAL
    assert close_for_session_end("engine_stopped").code == CloseCode.GOING_AWAY
    assert close_for_session_end("engine_error").code == CloseCode.INTERNAL_ERROR
    assert len(Close(CloseCode.NORMAL, "x", "é" * 100).reason.encode()) <= 123


def _conn(headers: dict[str, str], query: str = "") -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "headers": raw, "query_string": query.encode(), "path": "/"})


def test_access_checks():
    assert access_denied(_conn({}), None, []) is None
    for headers, query in (
        ({"Authorization": "Bearer k"}, ""),
        ({"kyutai-api-key": "k"}, ""),
        ({}, "api_key=k"),
        ({"Sec-WebSocket-Protocol": "realtime, openai-insecure-api-key.k"}, ""),
    ):
        assert presented_key(_conn(headers, query)) == "k"
        assert access_denied(_conn(headers, query), "k", []) is None
    assert access_denied(_conn({"Authorization": "Bearer x"}), "k", [])[0] == "invalid_api_key"
    assert access_denied(_conn({}), "k", [])[0] == "invalid_api_key"
    allowed = ["https://ok.example"]
    assert access_denied(_conn({"Origin": "https://ok.example"}), None, allowed) is None
    assert access_denied(_conn({}), None, allowed) is None  # not a browser
    assert access_denied(_conn({"Origin": "https://evil.example"}), None, allowed)[0] == "origin_not_allowed"


class _FakeEngine:
    """What the server uses of an engine, with a warm-up that waits until the test lets it finish."""

    def __init__(self, fail: bool = False) -> None:
        self.ready, self.fail, self.release = False, fail, threading.Event()
        self.config = SimpleNamespace(max_sessions=2)
        self.device = "cpu"

    def start(self) -> None:
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("out of memory")
        self.ready = True

    def stop(self) -> None:
        self.ready = False

    def on_step(self, callback):
        return lambda: None

    def on_dropped(self, callback):
        return lambda: None

    def on_prompted(self, callback):
        return lambda: None

    def stats(self) -> EngineStats:
        return EngineStats(2, 0, 2, 10, 0, 0, 0, 0, 0, "cpu")


def _app(engine: _FakeEngine):
    info = ModelInfo("m", "lm", "mimi", "tok", True, 24000, 1920, ("cpu",))
    return create_app(ServerSettings(api_key="k"), Runtime([engine], info))


def test_ready_only_once_warm():
    engine = _FakeEngine()
    with TestClient(_app(engine)) as client:
        assert client.get("/health").json()["status"] == "ok"
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["reason"] == "warming up"
        assert "duplexd_ready 0.0" in client.get("/metrics").text
        with client.websocket_connect("/api/chat", headers={"kyutai-api-key": "k"}) as ws:
            assert ws.receive_bytes().startswith(b"\x05")  # refused while warming, never a hang
        engine.release.set()
        for _ in range(200):
            if client.get("/ready").status_code == 200:
                break
            threading.Event().wait(0.01)
        assert client.get("/ready").json() == {
            "ready": True,
            "warm": True,
            "admissible_sessions": 2,
            "capacity": 2,
            "draining": False,
            "open_sessions": 0,
            "models": [{"id": "m", "task": "dialogue", "admissible": 2, "capacity": 2}],
        }
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "m"


def test_failed_warm_up_shows_in_health():
    engine = _FakeEngine(fail=True)
    engine.release.set()
    with TestClient(_app(engine)) as client:
        for _ in range(200):
            if client.get("/health").status_code == 503:
                break
            threading.Event().wait(0.01)
        health = client.get("/health")
        assert health.status_code == 503 and "out of memory" in health.json()["error"]
        assert client.get("/ready").status_code == 503


def test_static_web_client_after_the_api(tmp_path):
    (tmp_path / "index.html").write_text("<h1>duplexd</h1>")
    engine = _FakeEngine()
    engine.release.set()
    info = ModelInfo("m", "lm", "mimi", "tok", True, 24000, 1920, ("cpu",))
    app = create_app(ServerSettings(static=str(tmp_path)), Runtime([engine], info))
    with TestClient(app) as client:
        assert client.get("/").text == "<h1>duplexd</h1>"
        assert client.get("/health").json()["status"] == "ok"  # the API wins over the files
        assert client.get("/nothing.js").status_code == 404
        with pytest.raises(WebSocketDisconnect):  # a WebSocket to an unknown path is refused, not crashed
            with client.websocket_connect("/nowhere"):
                pass
    none = create_app(ServerSettings(static="none"), Runtime([_FakeEngine()], info))
    assert not [r for r in none.routes if getattr(r, "name", "") == "web"]


def test_runtime_admits_on_the_engine_with_most_room():
    from duplexd.engine.errors import CapacityError

    class Engine(_FakeEngine):
        def __init__(self, room: int, full: bool = False) -> None:
            super().__init__()
            self.ready, self.room, self.full, self.opened = True, room, full, 0

        def stats(self) -> EngineStats:
            return EngineStats(2, 2 - self.room, self.room, 10, 0, 0, 0, 0, 0, "cpu")

        def open_session(self, params, max_frames=None, prompt=None):
            if self.full:
                raise CapacityError("no KV pages")
            self.opened += 1
            return "session"

    info = ModelInfo("m", "lm", "mimi", "tok", True, 24000, 1920, ("cuda:0", "cuda:1"))
    a, b = Engine(room=1), Engine(room=2)
    runtime = Runtime([a, b], info)
    assert runtime.open_session(SamplingParams()) == "session" and (a.opened, b.opened) == (0, 1)
    assert runtime.admissible() == 3 and runtime.capacity() == 4
    b.full = True  # stats say there is room, admission says no: the next engine is tried
    assert runtime.open_session(SamplingParams()) == "session" and a.opened == 1
    a.full = True
    with pytest.raises(CapacityError, match="KV pages"):
        runtime.open_session(SamplingParams())


def test_a_waiting_admission_counts_one_refusal():
    """`admit_waiting` (moshi-server's POST): a slot freed during the wait is taken and nothing is counted; a server
    full for the whole wait is one refusal, counted once; a draining server refuses at once."""
    from prometheus_client import CollectorRegistry, Counter

    from duplexd.engine.errors import CapacityError
    from duplexd.server.connection.admission import Refusal, admit_waiting

    class Runtime:
        def __init__(self, full_tries: int) -> None:
            self.full_tries, self.tries = full_tries, 0

        def open_session(self, params, max_frames=None, prompt=None):
            self.tries += 1
            if self.tries <= self.full_tries:
                raise CapacityError("no free slot")
            return "session"

    def context(full_tries: int, draining: bool = False) -> SimpleNamespace:
        registry = CollectorRegistry()
        refused = Counter("refused", "sessions refused", ["reason"], registry=registry)
        metrics = SimpleNamespace(refused=refused, registry=registry)
        return SimpleNamespace(runtime=Runtime(full_tries), drain=SimpleNamespace(draining=draining), metrics=metrics)

    def refused(ctx: SimpleNamespace) -> dict[str, float]:
        samples = ctx.metrics.registry.collect()
        return {s.labels["reason"]: s.value for m in samples for s in m.samples if s.name == "refused_total"}

    def admitted(ctx: SimpleNamespace, seconds: float) -> str:
        return asyncio.run(admit_waiting(ctx, "asr_post", SamplingParams(), seconds, retry=0.01))  # type: ignore[arg-type]

    freed = context(full_tries=3)
    assert admitted(freed, seconds=5.0) == "session" and freed.runtime.tries == 4 and refused(freed) == {}
    full = context(full_tries=1000)
    with pytest.raises(Refusal, match="no free slot") as refusal:
        admitted(full, seconds=0.1)
    assert refusal.value.busy and full.runtime.tries > 3 and refused(full) == {"capacity": 1.0}
    draining = context(full_tries=0, draining=True)
    with pytest.raises(Refusal, match="draining"):
        admitted(draining, seconds=5.0)
    assert draining.runtime.tries == 0 and refused(draining) == {"draining": 1.0}


def _tts_connection(idle: float, send_bytes=None):
    """A `/api/tts_streaming` connection on stand-ins: its watch and its sends need only the settings and a socket."""
    from duplexd.server.moshi_server.tts import TtsConnection

    ctx = SimpleNamespace(
        runtime=SimpleNamespace(speech=SimpleNamespace(words=lambda: None)),
        settings=SimpleNamespace(tts_idle_timeout=idle, send_timeout=0.05),
    )
    return TtsConnection(SimpleNamespace(send_bytes=send_bytes), ctx, SimpleNamespace(slot=0), "Pcm", None)  # type: ignore[arg-type]


def test_the_tts_watch_sleeps_once_the_text_has_ended(monkeypatch):
    """No polling: once the text has ended the watch reads no clock and waits for `end` (the drain) alone, which
    ends the stream at once; before, it closes a stream idle for `--tts-idle-timeout`."""
    from duplexd.server.moshi_server import tts

    reads: list[float] = []  # each read of the module's clock: a wake-up of the watch

    def monotonic() -> float:
        reads.append(now := time.monotonic())
        return now

    async def go() -> None:
        ended = _tts_connection(idle=0.05)
        ended.finished = True
        monkeypatch.setattr(tts, "time", SimpleNamespace(monotonic=monotonic))
        watch = asyncio.create_task(ended.watch())
        await asyncio.sleep(0.6)
        assert not watch.done() and reads == []
        ended.end(Close(CloseCode.GOING_AWAY, "server_shutdown"))
        with pytest.raises(Close, match="server_shutdown"):
            await asyncio.wait_for(watch, 1.0)
        started = time.monotonic()
        with pytest.raises(Close, match="idle timeout") as idle:
            await asyncio.wait_for(_tts_connection(idle=0.05).watch(), 1.0)
        assert idle.value.error == "idle_timeout" and time.monotonic() - started < 0.5

    asyncio.run(go())


def test_a_failed_send_is_the_client_lost_and_any_other_failure_ours(caplog):
    """The ending bookkeeping the pump and a TTS stream share (`count_end`): a send that fails is `Disconnected`,
    `lost` (the transport is gone), one that stalls is `slow_reader`, and any other failure `internal_error`, logged."""
    from prometheus_client import CollectorRegistry, Counter

    from duplexd.server.connection.closing import Disconnected
    from duplexd.server.connection.pump import count_end

    async def broken(data: bytes) -> None:
        raise RuntimeError("Unexpected ASGI message 'websocket.send', after sending 'websocket.close'")

    async def stalled(data: bytes) -> None:
        await asyncio.Event().wait()

    ends: list[BaseException] = []
    for send_bytes in (broken, stalled):
        with pytest.raises((Disconnected, Close)) as failed:
            asyncio.run(_tts_connection(1.0, send_bytes).send(b"audio"))
        ends.append(failed.value)
    registry = CollectorRegistry()
    metrics = SimpleNamespace(
        closed=Counter("closed", "", ["reason"], registry=registry),
        protocol_errors=Counter("errors", "", ["protocol", "error"], registry=registry),
    )
    with caplog.at_level("ERROR"):
        got = [count_end(e, metrics, "tts", "tts stream 0") for e in (*ends, KeyError("a bug of ours"))]  # type: ignore[arg-type]
    assert [type(e).__name__ for e in got] == ["Disconnected", "Close", "Close"]
    counted = {s.labels["reason"]: s.value for m in registry.collect() for s in m.samples if s.name == "closed_total"}
    assert counted == {"lost": 1.0, "slow_reader": 1.0, "internal_error": 1.0}
    assert [r.getMessage() for r in caplog.records] == ["tts stream 0 failed"]


def test_realtime_pcm16_and_audio_delta_template():
    rng = np.random.default_rng(0)
    pcm = np.concatenate([rng.standard_normal(1914).astype(np.float32), np.float32([1.5, -1.5, 0.5, -0.5, 1e-5, 0])])
    reference = (np.clip(pcm, -1, 1) * 32767.0).round().astype("<i2").tobytes()  # the plain formula, kept here
    assert base64.b64decode(ev.encode_audio(pcm)) == reference
    raw = base64.b64encode(np.int16([-32768, -1, 0, 1, 32767]).astype("<i2").tobytes()).decode()
    assert ev.decode_audio(_append(raw)).tolist() == [-1.0, -1 / 32768, 0.0, 1 / 32768, 32767 / 32768]
    deltas = ev.AudioDeltas('resp_"quoted"', "item\\1")
    first, second = json.loads(deltas(ev.encode_audio(pcm))), json.loads(deltas(ev.encode_audio(pcm[:960])))
    assert first == {
        "type": "response.output_audio.delta",
        "event_id": first["event_id"],
        "response_id": 'resp_"quoted"',
        "item_id": "item\\1",
        "output_index": 0,
        "content_index": 0,
        "delta": ev.encode_audio(pcm),
    }
    assert len(base64.b64decode(second["delta"])) == 1920
    ids = {first["event_id"], second["event_id"], *(ev.event_id() for _ in range(1000))}
    assert len(ids) == 1002 and all(i.startswith("event_") for i in ids)


def test_idle_after_answers_keeps_a_waiting_client():
    """`Limits.idle_after_answers` (speech to text): a client that sends nothing while it is still being answered
    (it sent audio ahead) is not idle; once the answers stop it is closed `idle_timeout` later. A conversation's
    pump counts the client's messages only."""
    idle, answers, every = 0.25, 12, 0.05

    class Silent(Adapter):
        name = "test"

        async def on_message(self, message):
            return None

        async def send_output(self, out):
            pass

        async def send_error(self, close):
            pass

    class Answering:
        """A session that answers `answers` frames already received, one every `every` s, then nothing."""

        id, close_reason = "s", None

        def __init__(self) -> None:
            self.left = answers

        async def recv(self):
            if not self.left:
                await asyncio.Event().wait()
            self.left -= 1
            await asyncio.sleep(every)
            return SimpleNamespace(arrival=time.monotonic())

        def close(self, reason):
            pass

    async def closed_after(after_answers: bool) -> tuple[float, str]:
        ws = SimpleNamespace(receive=asyncio.Event().wait, client_state=WebSocketState.DISCONNECTED)
        limits = Limits(idle, 10.0, float("inf"), 1 << 20, 0.08, idle_after_answers=after_answers)
        started = time.monotonic()
        close = await Pump(Silent(ws), Answering(), limits, MagicMock()).run()  # type: ignore[arg-type]
        return time.monotonic() - started, close.error

    waited, error = asyncio.run(closed_after(True))
    assert error == "idle_timeout" and answers * every + idle - 0.05 <= waited <= answers * every + idle + 0.5
    waited, error = asyncio.run(closed_after(False))
    assert error == "idle_timeout" and idle - 0.05 <= waited < answers * every


def test_webrtc_calls_without_the_extra_or_turned_off_say_so(monkeypatch):
    """Without aiortc the calls route names the extra (501); with --no-webrtc it says calls are off (404); /v1/models
    lists the calls route only where a call can be made (the built-in page picks its transport from it)."""
    from duplexd.server.realtime.webrtc import stack  # noqa: PLC0415

    def warm() -> Runtime:
        engine = _FakeEngine()
        engine.release.set()
        return Runtime([engine], ModelInfo("m", "lm", "mimi", "tok", True, 24000, 1920, ("cpu",)))

    offer = {"content": b"v=0\r\n", "headers": {"Content-Type": "application/sdp"}}

    def protocols(client):
        return client.get("/v1/models").json()["data"][0]["protocols"]

    monkeypatch.setattr(stack, "available", lambda: False)
    with TestClient(create_app(ServerSettings(), warm())) as client:
        missing = client.post("/v1/realtime/calls", **offer)
        assert "/v1/realtime/calls" not in protocols(client)
    assert missing.status_code == 501
    assert (
        missing.json()["error"]["code"] == "webrtc_unavailable"
        and "duplexd[webrtc]" in missing.json()["error"]["message"]
    )
    monkeypatch.setattr(stack, "available", lambda: True)
    with TestClient(create_app(ServerSettings(), warm())) as client:
        assert "/v1/realtime/calls" in protocols(client)
    with TestClient(create_app(ServerSettings(webrtc=False), warm())) as client:
        off = client.post("/v1/realtime/calls", **offer)
        assert "/v1/realtime/calls" not in protocols(client)
    assert off.status_code == 404 and off.json()["error"]["code"] == "webrtc_off"
