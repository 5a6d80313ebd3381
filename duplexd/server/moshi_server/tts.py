"""`/api/tts_streaming`: moshi-server's streaming text to speech, for Kyutai's clients (Unmute, DSM's scripts).

WebSocket. The upgrade is refused with HTTP 401 without the API key (`kyutai-api-key` or `auth_id`, as
moshi-server) and 400 for a `format` it does not know; other query parameters (`cfg_alpha`, `seed`...) are
accepted and ignored, as moshi-server's Python module ignores them. A stream takes a slot at once and says `Ready`
(MessagePack formats), or `Error{"no free channels"}` and the close when there is none. Its text comes as text
frames or `Text` messages, split into words as moshi-server splits them (`StreamWords`); a `Voice` before the first
text replaces the query's `voice`, and an unknown voice name falls back to the default voice. `Eos` (or `\\0`) ends
the text; the audio follows, 80 ms a message, each word as a `Text` message timed as moshi-server times it (word
j, taken at step c_j, runs from (c_j + 1) / 12.5 s to (c_{j+1} + 1) / 12.5 s; the last to the stream's step count),
and the close frame once all is said. After `Ready`, every end is the close frame alone (`stream.StreamAdapter`'s
rule): 1007 for a message it cannot read or a voice it cannot use, 1000 for a client silent for
`--tts-idle-timeout` (30 s) before its end of text, 1008 for one that stopped reading (a send blocked for
`--send-timeout`), 1001 on shutdown.

POST with a JSON body `{text, voice}` answers a streaming 16-bit WAV (its sizes unknown, so 0xFFFFFFFF), as
moshi-server does; a full server answers 503 at once rather than holding the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from duplexd.engine.errors import CapacityError, SessionClosed
from duplexd.engine.tts.generate import Voice
from duplexd.engine.tts.service import SpeechChunk, SpeechEnd, SpeechStream, WordTaken
from duplexd.server.codec.batches import Encoder
from duplexd.server.codec.wav import pcm16, wav_header
from duplexd.server.connection.access import key_ok
from duplexd.server.connection.closing import Close, CloseCode, Disconnected, slow_reader
from duplexd.server.connection.pump import check_size, close_socket, count_end, receive
from duplexd.server.connection.speech import open_speech, say, speech_of, spoken
from duplexd.server.core.context import Context, ServerContext
from duplexd.server.core.speech import VoiceRefused
from duplexd.wire import FRAME_RATE

from . import tts_messages as messages
from .asr_messages import MessageError
from .stream import NO_FREE_CHANNELS, refuse_upgrade

logger = logging.getLogger(__name__)
router = APIRouter()

PATH = "/api/tts_streaming"


@dataclass
class WordTimes:
    """moshi-server's `Text` timing: a word is told when the next one starts, or at the end of the stream."""

    pending: tuple[str, int] | None = None  # the last word taken, and the step count it started at

    def taken(self, event: WordTaken) -> tuple[str, float, float] | None:
        told = self._tell(event.step + 1)
        self.pending = (event.text, event.step + 1)
        return told

    def end(self, steps: int) -> tuple[str, float, float] | None:
        told = self._tell(steps)
        self.pending = None
        return told

    def _tell(self, steps: int) -> tuple[str, float, float] | None:
        if self.pending is None or not self.pending[0]:
            return None
        text, start = self.pending
        return text, start / FRAME_RATE, steps / FRAME_RATE


class TtsConnection:
    """One `/api/tts_streaming` socket from `Ready` to its close: a reader (text in), a writer (speech out)."""

    def __init__(self, ws: WebSocket, ctx: ServerContext, stream: SpeechStream, fmt: str, voice: str | None) -> None:
        self.ws, self.ctx, self.stream, self.format = ws, ctx, stream, fmt
        self.speech = speech_of(ctx)
        self.voice_name = voice
        self.custom_voice: Voice | None = None
        self.words = self.speech.words()
        self.begun = self.finished = False
        self.last_message = time.monotonic()
        self.encoder: Encoder | None = None
        self._ended = asyncio.Event()
        self._end_close: Close | None = None

    def end(self, close: Close) -> None:
        """End from outside (the drain timed out)."""
        self._end_close = close
        self._ended.set()

    async def send(self, data: bytes) -> None:
        """One message to the client, as the pump sends: blocked for `--send-timeout`, the client is not reading
        (`slow_reader`); failed, the transport is gone (`Disconnected`, counted `lost`: `pump.count_end`)."""
        timeout = self.ctx.settings.send_timeout
        try:
            await asyncio.wait_for(self.ws.send_bytes(data), timeout)
        except asyncio.TimeoutError:
            raise slow_reader(timeout) from None
        except Exception as e:  # noqa: BLE001 - any failure of the transport means the same
            raise Disconnected(f"send failed: {e!r}") from None

    # ------------------------------------------------------------------------------------------- client → model

    async def read(self) -> None:
        limit = self.ctx.settings.max_message_bytes
        while True:
            message = await receive(self.ws)
            self.last_message = time.monotonic()
            check_size(message, limit)
            try:
                self.on_message(messages.decode(message))
            except (MessageError, VoiceRefused) as e:
                raise Close(CloseCode.INVALID_PAYLOAD, "invalid_message", str(e)) from None
            except SessionClosed:  # the stream ended under the text: the writer sees the end and says why
                pass

    def on_message(self, msg: messages.ClientMessage) -> None:
        if isinstance(msg, messages.VoiceMessage):
            if self.begun:
                logger.info("tts stream %d: a Voice after the first text is ignored", self.stream.slot)
            else:
                self.custom_voice = self.speech.custom_voice(msg.embeddings, msg.shape)
            return
        if self.finished:
            return  # after the end of the text nothing more is said
        if isinstance(msg, messages.Eos):
            self.finished = True
            if not self.begun:  # no word at all: the stream ends with nothing to say, as moshi-server's
                raise Close(CloseCode.NORMAL, "no_text", "the text was empty")
            self.stream.finish()
            return
        words = self.words.split(msg.text)
        if not words:
            return
        if not self.begun:
            self.begun = True
            self.speech.begin(self.stream, self.custom_voice or self.speech.voice(self.voice_name))
        self.stream.push(words)

    # ------------------------------------------------------------------------------------------- model → client

    async def write(self) -> None:
        times = WordTimes()
        while (event := await self.stream.recv()) is not None:
            if isinstance(event, WordTaken):
                await self.send_word(times.taken(event))
            elif isinstance(event, SpeechChunk):
                await self.send_audio(event.pcm)
            elif isinstance(event, SpeechEnd):
                await self.send_word(times.end(event.steps))
                raise Close(CloseCode.NORMAL, "end_of_speech", "all the text was said")
        raise Close(CloseCode.INTERNAL_ERROR, "engine_error", "the model failed on this stream; please retry")

    async def send_word(self, word: tuple[str, float, float] | None) -> None:
        if word is not None and messages.packed(self.format):
            await self.send(messages.word(*word))

    async def send_audio(self, pcm: np.ndarray) -> None:
        if self.format == "Pcm":
            await self.send(messages.raw_pcm(pcm))
        elif self.format == "PcmMessagePack":
            await self.send(messages.audio(pcm))
        else:
            codec = self.ctx.codec
            if self.encoder is None:
                self.encoder = codec.streams(self.ctx.settings.opus_profile, self.speech.sample_rate)[1]
            pages = await codec.encode(self.encoder, pcm)
            await self.send(pages if self.format == "OggOpus" else messages.ogg_opus(pages))

    async def watch(self) -> None:
        """What ends a stream from outside its socket: `end` (the drain timed out), or the idle timeout, which closes
        a stream waiting for text that sends nothing for `--tts-idle-timeout` (once its text has ended, the speech
        it waits for may take longer). It wakes at each idle deadline (a message since moves it later) and at `end`,
        and after the end of the text at `end` alone."""
        timeout = self.ctx.settings.tts_idle_timeout
        while not self._ended.is_set():
            wait = None if self.finished else self.last_message + timeout - time.monotonic()
            if wait is not None and wait <= 0:
                raise Close(CloseCode.NORMAL, "idle_timeout", f"idle timeout: no message for {timeout:g} s")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._ended.wait(), wait)
        assert self._end_close is not None
        raise self._end_close

    async def run(self) -> None:
        tasks = [asyncio.create_task(job()) for job in (self.read, self.write, self.watch)]
        outcome: BaseException | None = None
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            outcome = (tasks[1] if tasks[1] in done else next(iter(done))).exception()
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            self.stream.close()
            if self.encoder is not None:
                self.ctx.codec.release(self.encoder)
        end = count_end(outcome, self.ctx.metrics, "tts", f"tts stream {self.stream.slot}")
        if isinstance(end, Close):
            await close_socket(self.ws, end, self.ctx.settings.send_timeout)


def stream_format(ws: WebSocket) -> str | None:
    fmt = ws.query_params.get("format", messages.DEFAULT_FORMAT)
    return fmt if fmt in messages.FORMATS else None


@router.websocket(PATH)
async def tts_streaming(ws: WebSocket, ctx: Context) -> None:
    if await refuse_upgrade(ws, ctx):
        return
    fmt = stream_format(ws)
    if fmt is None:
        await refuse_format(ws, ctx)
        return
    await ws.accept()
    try:
        stream = open_speech(ctx)
    except CapacityError as e:
        ctx.metrics.refused.labels("capacity").inc()
        logger.info("tts stream refused: %s", e)
        if messages.packed(fmt):
            with contextlib.suppress(Exception):
                await ws.send_bytes(messages.error(NO_FREE_CHANNELS))
        await close_socket(ws, Close(CloseCode.TRY_AGAIN_LATER, "capacity", str(e)), ctx.settings.send_timeout)
        return
    ctx.metrics.sessions.labels("tts").inc()
    connection = TtsConnection(ws, ctx, stream, fmt, ws.query_params.get("voice"))
    ctx.drain.add(connection)
    try:
        if messages.packed(fmt):
            try:
                await connection.send(messages.ready())
            except Exception:  # noqa: BLE001 - the client left during the greeting
                stream.close()
                ctx.metrics.closed.labels("lost").inc()
                return
        await connection.run()
    finally:
        ctx.drain.discard(connection)


async def refuse_format(ws: WebSocket, ctx: ServerContext) -> None:
    """400 before the upgrade, as moshi-server's query parsing; a server without the denial extension accepts and
    closes with 1007 naming the formats."""
    message = f"unknown format {ws.query_params.get('format')!r}: one of {', '.join(messages.FORMATS)}"
    ctx.metrics.refused.labels("invalid_parameter").inc()
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        body = {"error": "invalid_parameter", "message": message}
        await ws.send_denial_response(JSONResponse(body, status_code=400))
        return
    await ws.accept()
    await close_socket(ws, Close(CloseCode.INVALID_PAYLOAD, "invalid_parameter", message), ctx.settings.send_timeout)


# ------------------------------------------------------------------------------------------- POST


class TtsQuery(BaseModel):
    text: str
    voice: str | None = None


@router.post(PATH)
async def tts_post(request: Request, ctx: Context) -> Response:
    if not key_ok(request, ctx.settings.api_key):
        return JSONResponse({"error": "invalid_api_key", "message": "missing or wrong API key"}, status_code=401)
    try:
        query = TtsQuery.model_validate_json(await request.body())
    except ValidationError as e:
        message = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()[:3])
        return JSONResponse({"error": "invalid_request", "message": message}, status_code=422)
    speech = speech_of(ctx)
    words = speech.words().split(query.text)
    if not any(word.tokens for word in words):
        return JSONResponse({"error": "invalid_request", "message": "no words to say"}, status_code=422)
    try:
        stream = say(ctx, words, speech.voice(query.voice))
    except CapacityError as e:
        ctx.metrics.refused.labels("capacity").inc()
        return JSONResponse({"error": "capacity", "message": f"{NO_FREE_CHANNELS}: {e}"}, status_code=503)
    except SessionClosed:
        return JSONResponse({"error": "engine_error", "message": "the model failed"}, status_code=500)
    ctx.metrics.sessions.labels("tts_post").inc()

    async def body() -> AsyncIterator[bytes]:
        yield wav_header(speech.sample_rate)
        async for pcm in spoken(stream):
            yield pcm16(pcm)

    return StreamingResponse(body(), media_type="audio/wav")
