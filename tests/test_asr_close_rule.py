"""moshi-server's close rule on `/api/asr-streaming`: `Error` only before `Ready`; after it, every end the server
decides is the close frame alone, whose code and reason say why.

Unmute's `SpeechToText` raises on any message type but Ready, Word, EndWord, Step and Marker, and its handler
catches only the connection closing; `test_asr_e2e.unmute_until_closed` is that loop. Each way a stream can end is
run against it on a real server (the demo STT model, one codec worker process, a session length cap): the length
cap, a dead codec worker, the drain on SIGTERM; the idle timeout and every bad message are in `test_asr_e2e` on its
server. An engine failure cannot be caused from outside a server, so the rule itself is also run over every close
the server makes (the engine's among them), before and after `Ready`, through the code that sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import msgpack
import pytest
import sphn
from starlette.websockets import WebSocketState
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplexd.server.codec.batches import codec_close
from duplexd.server.codec.errors import AudioError
from duplexd.server.codec.workers import CodecWorkerError
from duplexd.server.connection.closing import Close, CloseCode, close_for_session_end
from duplexd.server.connection.pump import close_connection
from duplexd.server.moshi_server.stream import StreamAdapter

from .live_server import children, running_server
from .test_asr_e2e import FRAME, HEADERS, KEY, RATE, audio_message, pack, speech, unmute_until_closed, words_model

MAX_SECONDS = 8.0  # a session's cap: long enough for the other ways to end a stream to come first


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    files = words_model(tmp_path_factory.mktemp("asr-close"))
    log = tmp_path_factory.mktemp("asr-close-server") / "serve.log"
    args = [
        "--hf-repo", str(files.root), "--max-sessions", "2", "--api-key", KEY, "--codec-processes", "1",
        "--max-session-seconds", str(MAX_SECONDS),
    ]  # fmt: skip
    with running_server(log, *args, env={"DUPLEXD_DRAIN_TIMEOUT": "1"}) as live:
        yield live
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


def url(live) -> str:
    return f"ws://127.0.0.1:{live.port}/api/asr-streaming"


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def talk(ws, ogg: bool = False) -> None:
    """Stream speech at real time until the connection closes: samples, or Ogg/Opus pages as sphn writes them."""
    audio, writer = speech(30.0, seed=3), sphn.OpusStreamWriter(RATE)
    with contextlib.suppress(ConnectionClosed):
        for i in range(0, len(audio), FRAME):
            pcm = audio[i : i + FRAME]
            if not ogg:
                await ws.send(audio_message(pcm))
            elif page := writer.append_pcm(pcm):
                await ws.send(pack({"type": "OggOpus", "data": page}))
            await asyncio.sleep(0.08)


async def stream_until_closed(address: str, ogg: bool = False, during=None) -> tuple[int | None, str]:
    """One stream talking, read as Unmute reads it; `during(ws)` runs first. (close code, reason)."""
    async with connect(address, additional_headers=HEADERS) as ws:
        sender = asyncio.create_task(talk(ws, ogg))
        if during is not None:
            await during(ws)
        try:
            return await unmute_until_closed(ws)
        finally:
            sender.cancel()


async def answered(ws, steps: int = 3) -> None:
    """Wait until `steps` Step messages came (Unmute's types only)."""
    seen = 0
    while seen < steps:
        message = msgpack.unpackb(await ws.recv())
        assert message["type"] in ("Ready", "Word", "EndWord", "Step", "Marker"), message
        seen += message["type"] == "Step"


def test_the_length_cap_ends_a_stream_with_the_close_frame_alone(server):
    closed = run(stream_until_closed(url(server)))
    assert closed[0] == 1000 and "maximum session length" in closed[1], closed


def test_a_dead_codec_worker_ends_a_stream_with_the_close_frame_alone(server):
    async def kill_the_worker(ws) -> None:
        await answered(ws)
        (worker,) = children(server.proc.pid)
        os.kill(worker, signal.SIGKILL)

    closed = run(stream_until_closed(url(server), ogg=True, during=kill_the_worker))
    assert closed[0] == 1011 and "codec worker" in closed[1], closed


def test_the_drain_ends_a_stream_with_the_close_frame_alone(server):
    """Last in the module: SIGTERM stops the server. A stream still open when the drain runs out is told to go
    (1001), by the close frame alone, and the server exits cleanly."""

    async def terminate(ws) -> None:
        assert msgpack.unpackb(await ws.recv()) == {"type": "Ready"}
        server.proc.send_signal(signal.SIGTERM)

    closed = run(stream_until_closed(url(server), during=terminate))
    assert closed[0] == 1001 and "server going away" in closed[1], closed
    assert server.proc.wait(20) == 0


class RecordingSocket:
    """What `close_connection` sends on a connected WebSocket, in order."""

    client_state = application_state = WebSocketState.CONNECTED

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(("bytes", msgpack.unpackb(data)))

    async def close(self, code: int, reason: str) -> None:
        self.sent.append(("close", (code, reason)))


class Stream(StreamAdapter):
    name = "test"

    async def on_message(self, message: dict) -> None:
        return None

    async def send_output(self, out) -> None:
        pass


SERVER_CLOSES = {
    "engine failure": close_for_session_end("engine_error"),
    "engine stopped": close_for_session_end("engine_stopped"),
    "frame cap": close_for_session_end("max_frames"),
    "dead codec worker": codec_close(CodecWorkerError("codec worker exited")),
    "undecodable audio": codec_close(AudioError("not an Ogg page")),
    "idle": Close(CloseCode.NORMAL, "idle_timeout", "idle timeout: no message for 120 s"),
    "drain": Close(CloseCode.GOING_AWAY, "server_shutdown", "server going away: reconnect to another replica"),
    "bad message": Close(CloseCode.INVALID_PAYLOAD, "invalid_message", "not a MessagePack message"),
}


@pytest.mark.parametrize("why", SERVER_CLOSES)
def test_after_ready_every_close_is_the_close_frame_alone(why):
    close = SERVER_CLOSES[why]

    async def ended(ready: bool) -> list:
        ws = RecordingSocket()
        stream = Stream(ws)
        if ready:
            await stream.send_ready()
        await close_connection(stream, close, 1.0)
        return ws.sent

    assert asyncio.run(ended(True)) == [("bytes", {"type": "Ready"}), ("close", (close.code, close.reason))]
    before = asyncio.run(ended(False))  # a refusal before Ready: Error, then the close
    assert before == [("bytes", {"type": "Error", "message": close.message}), ("close", (close.code, close.reason))]


def test_before_ready_capacity_is_no_free_channels():
    async def refused() -> list:
        ws = RecordingSocket()
        await close_connection(Stream(ws), Close(CloseCode.TRY_AGAIN_LATER, "capacity", "server at capacity"), 1.0)
        return ws.sent

    assert asyncio.run(refused())[0] == ("bytes", {"type": "Error", "message": "no free channels"})
