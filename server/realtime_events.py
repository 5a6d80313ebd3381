"""The OpenAI Realtime event subset duplexd speaks on `/v1/realtime`: client event parsing, server event builders.

Audio is pcm16 little-endian mono at 24 kHz, base64 in JSON, both ways. The model is full duplex: audio flows
both ways all the time, so turn-taking events (`commit`, `response.create`, ...) have nothing to do and are
answered with a non-fatal `unsupported_event` error. Sampling is a duplexd extension of the session object:
`session.sampling = {text_temperature, text_topk, audio_temperature, audio_topk, seed, repetition_penalty,
repetition_penalty_context, pad_mult}`.

Client events are one pydantic union tagged by `type`, validated straight from the JSON text by a `TypeAdapter`
built once: an audio append (12.5 a second per session) costs one pass in pydantic-core and no Python checks.
A validation error is turned back into the error the protocol promises (`_refusal`) on the slow path only.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import json
import uuid
from typing import Annotated, Any, Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from duplexd import wire
from duplexd.engine.config import MAX_REPETITION_CONTEXT, SamplingParams

from .closing import Close, CloseCode

SUBPROTOCOL = "realtime"
SAMPLE_RATE = wire.SAMPLE_RATE
# Client events of the OpenAI API that a duplex model has no use for: answered with a non-fatal error.
UnsupportedType = Literal[
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "output_audio_buffer.clear",
    "response.create",
    "response.cancel",
    "conversation.item.create",
    "conversation.item.delete",
    "conversation.item.retrieve",
    "conversation.item.truncate",
    "transcription_session.update",
]
UNSUPPORTED = frozenset(get_args(UnsupportedType))


class SamplingUpdate(BaseModel):
    """`session.sampling`: the fields given replace the session's; an unknown one is refused, not ignored."""

    model_config = ConfigDict(extra="forbid")

    text_temperature: float | None = Field(None, ge=0)
    text_topk: int | None = Field(None, ge=1)
    audio_temperature: float | None = Field(None, ge=0)
    audio_topk: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)
    repetition_penalty_context: int | None = Field(None, ge=0, le=MAX_REPETITION_CONTEXT)
    pad_mult: float | None = Field(None, allow_inf_nan=False)

    def apply(self, params: SamplingParams) -> SamplingParams:
        return dataclasses.replace(params, **self.model_dump(exclude_none=True))


class AudioFormat(BaseModel):
    """GA `session.audio.*.format`: only what the model speaks (fields the API adds are ignored)."""

    type: Literal["audio/pcm"]
    rate: Literal[24000] = 24000  # wire.SAMPLE_RATE, spelt out: a Literal takes no names


class AudioSide(BaseModel):
    format: AudioFormat | None = None


class SessionAudio(BaseModel):
    input: AudioSide | None = None
    output: AudioSide | None = None


class SessionPatch(BaseModel):
    """The part of a `session.update`'s session duplexd reads; the rest (instructions, voice, ...) is ignored."""

    audio: SessionAudio | None = None
    input_audio_format: Literal["pcm16"] | None = None  # beta names
    output_audio_format: Literal["pcm16"] | None = None
    sampling: SamplingUpdate | None = None


class ClientEvent(BaseModel):
    """What every client event has; other fields the OpenAI API defines are accepted and ignored."""

    event_id: str | None = None


class AudioAppend(ClientEvent):
    type: Literal["input_audio_buffer.append"]
    audio: str  # base64 pcm16, decoded by `decode_audio` (its errors end the connection)


class SessionUpdate(ClientEvent):
    type: Literal["session.update"]
    session: SessionPatch

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """The session's sampling after this update; `RealtimeError` when the engine refuses the values."""
        if self.session.sampling is None:
            return params
        try:
            return self.session.sampling.apply(params)
        except ValueError as e:  # the engine's own rules (ConfigError)
            raise RealtimeError(
                "invalid_value", f"bad session.sampling: {e}", self.event_id, "session.sampling"
            ) from None


class TurnEvent(ClientEvent):
    type: UnsupportedType


ClientEvents = Annotated[AudioAppend | SessionUpdate | TurnEvent, Field(discriminator="type")]
CLIENT_EVENTS: TypeAdapter[AudioAppend | SessionUpdate | TurnEvent] = TypeAdapter(ClientEvents)


class RealtimeError(Exception):
    """A non-fatal problem with one client event: reported as an `error` event, the session goes on."""

    def __init__(self, code: str, message: str, event_id: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.event_id, self.param = code, message, event_id, param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


# Event ids: unique per process without a uuid4 (an os.urandom call) per event, 12.5 or more events a second per
# session: a random prefix drawn once, then a counter (itertools.count is atomic under the GIL).
_EVENT_PREFIX = f"event_{uuid.uuid4().hex[:12]}"
_event_numbers = itertools.count()


def event_id() -> str:
    return f"{_EVENT_PREFIX}{next(_event_numbers):08x}"


def parse_event(text: str) -> AudioAppend | SessionUpdate | TurnEvent:
    """A client event of a type duplexd knows. `Close` when the text is not JSON or not an event (1007), for an
    unknown type (1002) or an append without its audio (1007); `RealtimeError` for a bad `session.update`."""
    try:
        return CLIENT_EVENTS.validate_json(text)
    except ValidationError as e:
        raise _refusal(e, text) from None


def decode_audio(event: AudioAppend) -> np.ndarray:
    """The float32 samples of an `input_audio_buffer.append`; `Close` (1007) for bad base64 or pcm16."""
    try:
        raw = base64.b64decode(event.audio, validate=True)
    except (binascii.Error, ValueError) as e:
        raise Close(CloseCode.INVALID_PAYLOAD, "invalid_base64", f"'audio' is not valid base64: {e}") from None
    if len(raw) % 2:
        raise Close(CloseCode.INVALID_PAYLOAD, "invalid_audio", "pcm16 audio must have an even number of bytes")
    return pcm_from_pcm16(raw)


def pcm_from_pcm16(raw: bytes) -> np.ndarray:
    """pcm16 little-endian as float32 samples in [-1, 1), one array."""
    return wire.pcm_from_pcm16(raw)


def pcm16_bytes(pcm: np.ndarray) -> np.ndarray:
    """Float samples as pcm16 little-endian (clipped, rounded)."""
    return wire.pcm16(pcm)


def encode_audio(pcm: np.ndarray) -> str:
    return wire.pcm16_base64(pcm)


def _refusal(e: ValidationError, text: str) -> Close | RealtimeError:
    """The protocol's answer to a client event that failed validation (the first error says which)."""
    err = e.errors(include_url=False)[0]
    kind, loc = err["type"], err["loc"]
    if kind == "json_invalid":
        return Close(CloseCode.INVALID_PAYLOAD, "invalid_json", f"malformed JSON: {err['ctx']['error']}")
    raw = json.loads(text)  # valid JSON (checked above); only for the type and event_id pydantic could not give
    given = raw.get("type") if isinstance(raw, dict) else None
    if kind == "union_tag_invalid" and isinstance(given, str):
        return Close(CloseCode.PROTOCOL_ERROR, "unknown_event", f"unknown event type {given!r}")
    if not loc or not isinstance(given, str):
        return Close(CloseCode.INVALID_PAYLOAD, "invalid_event", "an event must be a JSON object with a string 'type'")
    path = tuple(str(p) for p in loc[1:])
    if path == ("event_id",):
        return Close(CloseCode.INVALID_PAYLOAD, "invalid_event", "'event_id' must be a string")
    if given == "input_audio_buffer.append":
        return Close(CloseCode.INVALID_PAYLOAD, "invalid_audio", "input_audio_buffer.append needs a base64 'audio'")
    event_id = raw.get("event_id")
    if path == ("session",):
        return RealtimeError("invalid_value", f"{given} needs a 'session' object", event_id, "session")
    if path[:2] == ("session", "audio") and path[3:4] == ("format",):
        return RealtimeError(
            "unsupported_audio_format", f"only audio/pcm at {SAMPLE_RATE} Hz is supported", event_id, ".".join(path[:4])
        )
    if path[1:2] in (("input_audio_format",), ("output_audio_format",)):
        return RealtimeError("unsupported_audio_format", "only pcm16 is supported", event_id, ".".join(path[:2]))
    where, field = ".".join(path[:2]), ".".join(path[2:])
    message = f"bad {where}: {field}: {err['msg']}" if field else f"bad {where}: {err['msg']}"
    return RealtimeError("invalid_value", message, event_id, ".".join(path[:3]))  # e.g. session.sampling.pad_mult


# ----------------------------------------------------------------------------------------------- server events


def _event(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, "event_id": event_id(), **fields}, separators=(",", ":"))


def session_object(session_id: str, model: str, params: SamplingParams, max_seconds: float) -> dict[str, Any]:
    fmt = {"type": "audio/pcm", "rate": SAMPLE_RATE}
    return {
        "id": session_id,
        "object": "realtime.session",
        "type": "realtime",
        "model": model,
        "output_modalities": ["audio"],
        "audio": {"input": {"format": fmt, "turn_detection": None}, "output": {"format": fmt}},
        "sampling": {
            "text_temperature": params.text_temperature,
            "text_topk": params.text_topk,
            "audio_temperature": params.audio_temperature,
            "audio_topk": params.audio_topk,
            "seed": params.seed,
            "repetition_penalty": params.repetition_penalty,
            "repetition_penalty_context": params.repetition_penalty_context,
            "pad_mult": params.pad_mult,
        },
        "max_session_seconds": max_seconds,
    }


def session_created(session: dict[str, Any]) -> str:
    return _event("session.created", session=session)


def session_updated(session: dict[str, Any]) -> str:
    return _event("session.updated", session=session)


def response_created(response_id: str) -> str:
    return _event(
        "response.created",
        response={
            "id": response_id,
            "object": "realtime.response",
            "status": "in_progress",
            "output_modalities": ["audio"],
        },
    )


class AudioDeltas:
    """`response.output_audio.delta` events of one response, built from a template: the per-session fields are
    JSON-encoded once, and base64 needs no escaping, so a frame costs no dict and no JSON pass over its audio."""

    def __init__(self, response_id: str, item_id: str) -> None:
        head = json.dumps({"type": "response.output_audio.delta", "event_id": ""}, separators=(",", ":"))[:-2]
        tail = json.dumps(
            {"response_id": response_id, "item_id": item_id, "output_index": 0, "content_index": 0},
            separators=(",", ":"),
        )[1:-1]
        self._head, self._middle = head, '",' + tail + ',"delta":"'

    def __call__(self, pcm: np.ndarray) -> str:
        return f'{self._head}{event_id()}{self._middle}{encode_audio(pcm)}"}}'


def audio_delta(response_id: str, item_id: str, pcm: np.ndarray) -> str:
    return AudioDeltas(response_id, item_id)(pcm)


def transcript_delta(response_id: str, item_id: str, text: str) -> str:
    return _event(
        "response.output_audio_transcript.delta",
        response_id=response_id,
        item_id=item_id,
        output_index=0,
        content_index=0,
        delta=text,
    )


def error_event(
    code: str,
    message: str,
    *,
    kind: str = "invalid_request_error",
    event_id: str | None = None,
    param: str | None = None,
) -> str:
    return _event("error", error={"type": kind, "code": code, "message": message, "param": param, "event_id": event_id})
