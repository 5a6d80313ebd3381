"""`POST /v1/audio/speech`: OpenAI's text-to-speech endpoint, said by the `--tts` model as the audio is made.

A JSON body as OpenAI's: `model` (any name: the `--tts` model answers, and says so in the `openai-model`
header), `input` (up to 4096 characters), `voice` (one of the server's voice names, as `/v1/models` lists them,
or `{"id": name}`; OpenAI's own names such as `alloy` and any other name get the default voice, as moshi-server
does), `response_format` (`mp3` by default, `opus`, `flac`, `wav`, `pcm`; `aac` is refused: no encoder here),
`stream_format` (`audio`, the default: the file's bytes as they are made; `sse`: `speech.audio.delta` events with
base64 chunks of that format, then `speech.audio.done`). `instructions` and `speed` are accepted and ignored: a
Kyutai TTS model takes neither. The speech streams from its first frame; a client that goes away ends its stream
and frees the slot. Refusals have OpenAI's error shape: 400 for the request, 401 for the key, 503 when every
speech slot is taken.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError, field_validator

from duplexd.engine.errors import CapacityError
from duplexd.server.connection.access import key_ok
from duplexd.server.connection.speech import say, speech_of, spoken
from duplexd.server.core.api_error import ApiError
from duplexd.server.core.context import Context

from .speech_formats import MEDIA_TYPES, REFUSED, audio_writer

logger = logging.getLogger(__name__)
router = APIRouter()

MAX_INPUT = 4096  # characters, as OpenAI


class SpeechRequest(BaseModel):
    model: str
    input: str = Field(max_length=MAX_INPUT)
    voice: str
    response_format: str = "mp3"
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None  # accepted, ignored: the model takes no instructions
    speed: float = Field(1.0, ge=0.25, le=4.0)  # accepted, ignored: the model speaks at its own pace

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_id(cls, value: Any) -> Any:
        return value.get("id") if isinstance(value, dict) else value


def _refusal(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    param = ".".join(str(part) for part in err["loc"]) or None
    message = err["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{param}: {message}" if param else message, "invalid_value", param)


@router.post("/v1/audio/speech")
async def create_speech(request: Request, ctx: Context) -> Response:
    if not key_ok(request, ctx.settings.api_key):
        return ApiError(401, "Incorrect API key provided", "invalid_api_key").response()
    try:
        body = json.loads(await request.body())
        query = SpeechRequest.model_validate(body)
    except ValueError as e:  # json.JSONDecodeError too
        error = _refusal(e) if isinstance(e, ValidationError) else ApiError(400, f"not JSON: {e}", "invalid_json")
        return error.response()
    fmt = query.response_format
    if fmt in REFUSED:
        message = f"response_format {fmt}: {REFUSED[fmt]}"
        return ApiError(400, message, "unsupported_value", "response_format").response()
    if fmt not in MEDIA_TYPES:
        message = f"response_format {fmt!r}: one of {', '.join(MEDIA_TYPES)}"
        return ApiError(400, message, "invalid_value", "response_format").response()
    speech = speech_of(ctx)
    words = speech.words().split(query.input)
    if not any(word.tokens for word in words):
        return ApiError(400, "input: no words to say", "invalid_value", "input").response()
    voice = query.voice if query.voice in speech.voices else None  # OpenAI's names speak in the default voice
    try:
        stream = say(ctx, words, speech.voice(voice))
    except CapacityError as e:
        ctx.metrics.refused.labels("capacity").inc()
        return ApiError(503, f"every speech slot is taken ({e}); retry shortly", "server_busy").response()
    ctx.metrics.sessions.labels("openai_speech").inc()
    writer = audio_writer(fmt, speech.sample_rate)

    async def audio() -> AsyncIterator[bytes]:
        async for pcm in spoken(stream):
            if data := writer.write(pcm):
                yield data
        if tail := writer.finish():
            yield tail

    async def events() -> AsyncIterator[str]:
        frames = 0
        async for data in audio():
            frames += 1
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
        words_in = sum(1 for word in words if word.tokens)
        usage = {"input_tokens": words_in, "output_tokens": frames, "total_tokens": words_in + frames}
        yield _event({"type": "speech.audio.done", "usage": usage})

    headers = {"openai-model": speech.id}
    if query.stream_format == "sse":
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
    return StreamingResponse(audio(), media_type=MEDIA_TYPES[fmt], headers=headers)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
