"""`POST /v1/audio/transcriptions`: OpenAI's file transcription endpoint, served by the live transcriber.

A multipart form as OpenAI's: `file` (required), `model` (any name: the transcriber `--transcribe` loaded answers,
and says so in the `openai-model` header), `language` and `prompt` (the instruction that follows the audio, as on
`/v1/realtime`: `engine.transcriber.instruction` names the language and appends the prompt as a hint),
`response_format` (`json`, `text`, `verbose_json`, `srt`, `vtt`) and `temperature` (0 to 1, accepted and
ignored: decoding is greedy, and `verbose_json` reports 0.0). Streaming and word timestamps are refused.

The upload is decoded and split at pauses (`engine.file_transcription`) on a worker thread, then its utterances
go to the transcription service's threads, whose future the handler awaits: nothing heavy runs on the event loop,
and the live sessions' transcription shares the same decoder batches. Every refusal is an OpenAI-style error body
`{"error": {"message", "type", "param", "code"}}`: 4xx for the request's fault, 503 when the transcriber is busy or
stopping, 404 when this server transcribes nothing. After a refusal the rest of the body is read (up to
`DRAIN_CAP`) so the client sees the answer instead of a reset connection.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import time
from dataclasses import dataclass

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive

from duplexd.engine.errors import CapacityError
from duplexd.engine.transcription.files import (
    RESPONSE_FORMATS,
    FilePlan,
    FileTranscriptionError,
    json_body,
    plan_file,
    text_body,
    verbose_body,
)
from duplexd.engine.transcription.service import TranscriptionService
from duplexd.engine.transcription.transcriber import instruction
from duplexd.engine.transcription.vad import VAD_RATE, load_silero
from duplexd.server.codec.upload import Decoded, UploadError, decode
from duplexd.server.connection.access import key_ok
from duplexd.server.core.api_error import ApiError
from duplexd.server.core.context import Context, ServerContext

logger = logging.getLogger(__name__)
router = APIRouter()

FIELD_BYTES = 64 << 10  # largest text field of the form
FORM_SLACK = 256 << 10  # multipart framing and text fields, allowed on top of the file's own limit
DRAIN_CAP = 64 << 20  # after a refusal, body bytes read and dropped at most; past this the connection is closed
MAX_PROMPT = 4000  # characters
MAX_LANGUAGE = 32


class _TooLarge(Exception):
    pass


class _Body:
    """The request's receive channel, counting body bytes: `_TooLarge` past `limit`; `drain` reads the rest."""

    def __init__(self, receive: Receive, limit: int) -> None:
        self.receive, self.limit = receive, limit
        self.received, self.done = 0, False

    async def __call__(self) -> Message:
        message = await self.receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.done = not message.get("more_body", False)
            if self.received > self.limit:
                raise _TooLarge
        else:
            self.done = True
        return message

    async def drain(self, cap: int) -> None:
        while not self.done and self.received < cap:
            message = await self.receive()
            self.received += len(message.get("body", b""))
            self.done = message["type"] != "http.request" or not message.get("more_body", False)


class _Uploads:
    """Per app: how many uploads are being transcribed (bounded by `--transcribe-files`) and idle Silero models
    for their VAD (one per worker thread at a time; loaded when none is idle)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.busy = limit, 0
        self.models: queue.SimpleQueue[torch.jit.ScriptModule] = queue.SimpleQueue()

    def prepare(
        self, upload: UploadFile, max_seconds: float, service: TranscriptionService
    ) -> tuple[Decoded, FilePlan]:
        """Decode and segment (a worker thread). One intra-op thread, as every torch thread beside the engine's
        (engine.engine); Silero's 32 ms windows gain nothing from more."""
        torch.set_num_threads(1)
        decoded = decode(upload.file, max_seconds)
        try:
            model = self.models.get_nowait()
        except queue.Empty:
            model = load_silero()
        try:
            return decoded, plan_file(decoded.pcm, VAD_RATE, service.config.vad, model)
        finally:
            self.models.put(model)


def _uploads(request: Request, ctx: ServerContext) -> _Uploads:
    uploads = getattr(request.app.state, "file_transcriptions", None)
    if uploads is None:
        uploads = request.app.state.file_transcriptions = _Uploads(ctx.settings.transcribe_files)
    return uploads


@dataclass(frozen=True)
class _Form:
    upload: UploadFile
    response_format: str
    language: str
    prompt: str


def _field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"`{name}` must be a text field, not a file", "invalid_value", name)
    return value.strip()


def _read_form(form: FormData) -> _Form:
    upload = form.get("file")
    if upload is None:
        raise ApiError(
            400, "the `file` field is missing: send the audio as multipart/form-data", "missing_file", "file"
        )
    if not isinstance(upload, UploadFile):
        raise ApiError(400, "`file` must be an uploaded file (a form part with a filename)", "invalid_value", "file")
    fmt = _field(form, "response_format") or "json"
    if fmt not in RESPONSE_FORMATS:
        raise ApiError(
            400,
            f"response_format {fmt!r} is not supported; use one of {', '.join(RESPONSE_FORMATS)}",
            "invalid_response_format",
            "response_format",
        )
    temperature = _field(form, "temperature")
    if temperature:
        try:
            value = float(temperature)
        except ValueError:
            value = math.nan
        if not 0.0 <= value <= 1.0:
            raise ApiError(
                400, f"temperature {temperature!r}: give a number from 0 to 1", "invalid_value", "temperature"
            )
    if (_field(form, "stream") or "false").lower() not in ("false", "0"):
        raise ApiError(400, "streaming transcription is not supported: leave out `stream`", "invalid_value", "stream")
    for name in ("timestamp_granularities[]", "timestamp_granularities"):
        if "word" in form.getlist(name):
            raise ApiError(400, "word timestamps are not supported, only segments", "invalid_value", name)
    language = _field(form, "language") or ""
    if len(language) > MAX_LANGUAGE:
        raise ApiError(400, f"language: at most {MAX_LANGUAGE} characters", "invalid_value", "language")
    hint = _field(form, "prompt") or ""
    if len(hint) > MAX_PROMPT:
        raise ApiError(400, f"prompt: at most {MAX_PROMPT} characters", "invalid_value", "prompt")
    return _Form(upload, fmt, language or "unknown", instruction(language, hint))


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request, ctx: Context) -> Response:
    limit = int(ctx.settings.max_upload_bytes)
    body = _Body(request.receive, limit + FORM_SLACK)
    try:
        response = await _transcribe(request, ctx, body)
    except ApiError as e:
        ctx.metrics.file_transcriptions.labels(e.code).inc()
        if e.status >= 500:
            logger.warning("transcription refused (%d %s): %s", e.status, e.code, e)
        await body.drain(DRAIN_CAP)
        return e.response()
    except ClientDisconnect:
        ctx.metrics.file_transcriptions.labels("disconnected").inc()
        return Response(status_code=499)  # nobody reads it
    ctx.metrics.file_transcriptions.labels("completed").inc()
    return response


async def _transcribe(request: Request, ctx: ServerContext, body: _Body) -> Response:
    if not key_ok(request, ctx.settings.api_key):
        raise ApiError(401, "missing or wrong API key", "invalid_api_key")
    service = ctx.runtime.transcription
    if service is None:
        raise ApiError(
            404,
            "this server transcribes nothing: start it with --transcribe MODEL (e.g. demo or a Gemma 4 folder)",
            "transcription_not_enabled",
            "model",
        )
    limit = int(ctx.settings.max_upload_bytes)
    too_large = ApiError(
        413, f"the upload is larger than the {limit / 2**20:.3g} MiB this server takes", "file_too_large", "file"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > body.limit:
        raise too_large
    try:
        async with Request(request.scope, body).form(max_files=1, max_fields=32, max_part_size=FIELD_BYTES) as form:
            return await _answer(ctx, service, _read_form(form), limit, too_large, _uploads(request, ctx))
    except _TooLarge:
        raise too_large from None
    except (HTTPException, MultiPartException) as e:
        why = e.detail if isinstance(e, HTTPException) else e.message
        raise ApiError(400, f"not a valid multipart/form-data body: {why}", "invalid_multipart") from None


async def _answer(
    ctx: ServerContext,
    service: TranscriptionService,
    form: _Form,
    limit: int,
    too_large: ApiError,
    uploads: _Uploads,
) -> Response:
    size = form.upload.size or 0
    if size == 0:
        raise ApiError(400, "the file is empty", "empty_file", "file")
    if size > limit:
        raise too_large
    if uploads.busy >= uploads.limit:
        raise ApiError(503, f"all {uploads.limit} upload transcription slots are busy; retry shortly", "overloaded")
    uploads.busy += 1
    started = time.perf_counter()
    try:
        try:
            decoded, plan = await asyncio.to_thread(
                uploads.prepare, form.upload, ctx.settings.max_transcribe_seconds, service
            )
        except UploadError as e:
            raise ApiError(e.status, str(e), e.code, e.param) from None
        try:
            done = await asyncio.wrap_future(service.transcribe(plan.pcm, plan.service_spans, form.prompt))
            result = plan.result(done)
        except CapacityError as e:
            raise ApiError(503, f"the transcriber is not available: {e}", "transcriber_unavailable") from None
        except FileTranscriptionError as e:
            if e.overloaded:
                raise ApiError(503, f"{e}; retry shortly", "overloaded") from None
            raise ApiError(500, str(e), "transcription_failed") from None
    finally:
        uploads.busy -= 1
    logger.info(
        "transcribed upload %r (%s, %d Hz, %d channel(s), %.1f s): %d utterance(s) in %.2f s",
        form.upload.filename,
        decoded.format,
        decoded.rate,
        decoded.channels,
        decoded.duration_s,
        len(result.segments),
        time.perf_counter() - started,
    )
    model = ctx.runtime.info.transcriber or "transcriber"
    headers = {"openai-model": model}
    if form.response_format == "json":
        return JSONResponse(json_body(result), headers=headers)
    if form.response_format == "verbose_json":
        return JSONResponse(verbose_body(result, form.language, model), headers=headers)
    return PlainTextResponse(text_body(result, form.response_format), headers=headers)
