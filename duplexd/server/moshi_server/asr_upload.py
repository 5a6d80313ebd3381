"""`POST /api/asr-streaming`: a whole audio file in the body, its words back as moshi-server's JSON list.

moshi-server decodes the file (its first channel, resampled to 24 kHz), streams it through a slot followed by a
`Marker` and 10 s of silence, and answers the `Word` and `EndWord` messages that came before the marker's echo:
`[{"type": "Word", "text": ..., "start_time": ...}, {"type": "EndWord", "stop_time": ...}, ...]`. So does this,
through the same stream bookkeeping as the WebSocket, in one engine session at the engine's pace. The key is
checked as on every route (moshi-server reads only its `kyutai-api-key` header here); at capacity it waits for a
slot as moshi-server does (up to `SLOT_WAIT_SECONDS`), then answers 503. Refusals are JSON `{"error", "message"}`.
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
import time

import numpy as np
import soundfile as sf
import soxr
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from duplexd.engine.dialogue.session import Session
from duplexd.server.codec.upload import MAX_RATE, MIN_RATE, UploadError, sniff
from duplexd.server.connection.access import key_ok
from duplexd.server.connection.admission import Refusal, admit_waiting
from duplexd.server.core.context import Context, ServerContext
from duplexd.server.stt.session import GREEDY, new_feeder, new_stream

from . import asr_messages as messages
from .asr import PATH

logger = logging.getLogger(__name__)
router = APIRouter()

RATE = 24_000
TRAILING_SILENCE = 240_000  # samples after the marker, as moshi-server
SLOT_WAIT_SECONDS = 100.0  # moshi-server: 1000 tries 100 ms apart
SLOT_RETRY_SECONDS = 0.1


class Refused(Exception):  # noqa: N818 - an answer, not a failure
    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(message)
        self.status, self.error = status, error

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.error, "message": str(self)}, status_code=self.status)


def decode_24k(data: bytes, max_seconds: float) -> np.ndarray:
    """The file's first channel at 24 kHz, float32 (blocking: run it off the event loop); `UploadError`."""
    if not data:
        raise UploadError("the body is empty: send an audio file", "empty_file")
    kind = sniff(data[:16])
    try:
        with sf.SoundFile(io.BytesIO(data)) as snd:
            rate = int(snd.samplerate)
            if not MIN_RATE <= rate <= MAX_RATE:
                raise UploadError(f"sample rate {rate} Hz: {MIN_RATE}-{MAX_RATE} Hz is supported", "invalid_audio")
            if snd.frames > max_seconds * rate:
                raise UploadError(f"the audio is longer than the {max_seconds:g} s this server takes", "audio_too_long")
            pcm = snd.read(dtype="float32", always_2d=True)[:, 0]
    except RuntimeError as e:  # libsndfile's errors
        why = getattr(e, "error_string", None) or str(e)
        raise UploadError(f"cannot decode the file as {kind}: {why}", "invalid_audio") from None
    if not len(pcm):
        raise UploadError("the file holds no audio frames", "no_audio")
    pcm = np.nan_to_num(pcm, nan=0.0, posinf=0.0, neginf=0.0)
    return pcm if rate == RATE else soxr.resample(pcm, rate, RATE).astype(np.float32)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or `Refused` 413 once it passes `limit` bytes (declared or sent)."""
    declared = request.headers.get("content-length", "")
    too_large = Refused(413, "file_too_large", f"the body is larger than the {limit} bytes this server takes")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def transcribe(ctx: ServerContext, session: Session, pcm: np.ndarray) -> list[dict]:
    """The Word and EndWord messages of `pcm` streamed through `session`, up to its marker's echo."""
    stream = new_stream(ctx)
    feeder = new_feeder(ctx, session, backlog_seconds=0)  # the whole file is here: pushed as answers come
    stream.received(len(pcm))
    stream.marker(0)
    feeder.add(pcm)
    feeder.add(np.zeros(TRAILING_SILENCE, dtype=np.float32))
    words: list[dict] = []
    while True:
        if feeder.answered == feeder.pushed:  # all stepped and the marker still not due (a delay past the silence)
            return words
        out = await session.recv()
        if out is None:
            why = f"the session ended before the end of the file ({session.close_reason})"
            raise Refused(503, "session_ended", why)
        feeder.answer(out.frame + 1)
        for message in messages.step_messages(stream.step(out.frame, out.text_token, out.pause)):
            if message["type"] == "Marker":
                return words
            if message["type"] in ("Word", "EndWord"):
                words.append(message)


@router.post(PATH)
async def transcribe_file(request: Request, ctx: Context) -> Response:
    try:
        if not key_ok(request, ctx.settings.api_key):
            raise Refused(401, "invalid_api_key", "missing or wrong API key")
        settings = ctx.settings
        data = await read_body(request, int(settings.max_upload_bytes))
        seconds = min(settings.max_transcribe_seconds, settings.session_seconds(True) or math.inf)
        try:
            pcm = await asyncio.to_thread(decode_24k, data, seconds)
        except UploadError as e:
            raise Refused(e.status, e.code, str(e)) from None
        session = await admit_waiting(ctx, "asr_post", GREEDY, SLOT_WAIT_SECONDS, SLOT_RETRY_SECONDS)
        started = time.perf_counter()
        try:
            words = await transcribe(ctx, session, pcm)
        finally:
            session.close("client")
    except Refused as e:
        ctx.metrics.refused.labels(e.error).inc()
        return e.response()
    except Refusal as r:  # draining, or still full after the wait: `admit` counted it
        return JSONResponse({"error": r.error, "message": str(r)}, status_code=503)
    logger.info("asr file of %.1f s: %d messages in %.2f s", len(pcm) / RATE, len(words), time.perf_counter() - started)
    return JSONResponse(words)
