"""The OpenAI Realtime event subset duplexd speaks on `/v1/realtime`: client event parsing, server event builders.

Audio is pcm16 little-endian mono at 24 kHz, base64 in JSON, both ways. The model is full duplex: audio flows
both ways all the time, so turn-taking events (`commit`, `response.create`, ...) have nothing to do and are
answered with a non-fatal `unsupported_event` error. Sampling is a duplexd extension of the session object:
`session.sampling = {text_temperature, text_topk, audio_temperature, audio_topk, seed}`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import json
import uuid
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from duplexd import wire
from duplexd.engine.config import SamplingParams

from .closing import Close, CloseCode

SUBPROTOCOL = "realtime"
SAMPLE_RATE = wire.SAMPLE_RATE
# Client events of the OpenAI API that a duplex model has no use for: answered with a non-fatal error.
UNSUPPORTED = frozenset({
    "input_audio_buffer.commit", "input_audio_buffer.clear", "output_audio_buffer.clear", "response.create",
    "response.cancel", "conversation.item.create", "conversation.item.delete", "conversation.item.retrieve",
    "conversation.item.truncate", "transcription_session.update",
})


class SamplingUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text_temperature: float | None = Field(None, ge=0)
    text_topk: int | None = Field(None, ge=1)
    audio_temperature: float | None = Field(None, ge=0)
    audio_topk: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0)

    def apply(self, params: SamplingParams) -> SamplingParams:
        return dataclasses.replace(params, **self.model_dump(exclude_none=True))


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


def parse_event(text: str) -> dict[str, Any]:
    """A client event as a dict with a string `type`; `Close` (1007) when it is not even that."""
    try:
        event = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise Close(CloseCode.INVALID_PAYLOAD, "invalid_json", f"malformed JSON: {e}") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise Close(CloseCode.INVALID_PAYLOAD, "invalid_event", "an event must be a JSON object with a string 'type'")
    return event


def decode_audio(event: dict[str, Any]) -> np.ndarray:
    """The float32 samples of an `input_audio_buffer.append`; `Close` (1007) for bad base64 or pcm16."""
    audio = event.get("audio")
    if not isinstance(audio, str):
        raise Close(CloseCode.INVALID_PAYLOAD, "invalid_audio", "input_audio_buffer.append needs a base64 'audio'")
    try:
        raw = base64.b64decode(audio, validate=True)
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


def sampling_update(event: dict[str, Any], params: SamplingParams) -> SamplingParams:
    """The session's sampling after a `session.update`; `RealtimeError` when it asks for what we cannot do."""
    session = event.get("session")
    event_id = event.get("event_id")
    if not isinstance(session, dict):
        raise RealtimeError("invalid_value", "session.update needs a 'session' object", event_id, "session")
    _check_formats(session, event_id)
    sampling = session.get("sampling")
    if sampling is None:
        return params
    try:
        return SamplingUpdate.model_validate(sampling).apply(params)
    except (ValidationError, ValueError) as e:
        raise RealtimeError("invalid_value", f"bad session.sampling: {_first_error(e)}", event_id,
                            "session.sampling") from None


def _check_formats(session: dict[str, Any], event_id: str | None) -> None:
    audio = session.get("audio") or {}
    for side in ("input", "output"):
        fmt = (audio.get(side) or {}).get("format") if isinstance(audio, dict) else None
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "audio/pcm"
                                or fmt.get("rate", SAMPLE_RATE) != SAMPLE_RATE):
            raise RealtimeError("unsupported_audio_format", f"only audio/pcm at {SAMPLE_RATE} Hz is supported",
                                event_id, f"session.audio.{side}.format")
    for key in ("input_audio_format", "output_audio_format"):  # beta names
        if session.get(key) not in (None, "pcm16"):
            raise RealtimeError("unsupported_audio_format", "only pcm16 is supported", event_id, f"session.{key}")


def _first_error(e: Exception) -> str:
    if isinstance(e, ValidationError) and e.errors():
        err = e.errors()[0]
        return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
    return str(e)


# ----------------------------------------------------------------------------------------------- server events


def _event(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, "event_id": event_id(), **fields}, separators=(",", ":"))


def session_object(session_id: str, model: str, params: SamplingParams, max_seconds: float) -> dict[str, Any]:
    fmt = {"type": "audio/pcm", "rate": SAMPLE_RATE}
    return {
        "id": session_id, "object": "realtime.session", "type": "realtime", "model": model,
        "output_modalities": ["audio"],
        "audio": {"input": {"format": fmt, "turn_detection": None}, "output": {"format": fmt}},
        "sampling": {"text_temperature": params.text_temperature, "text_topk": params.text_topk,
                     "audio_temperature": params.audio_temperature, "audio_topk": params.audio_topk,
                     "seed": params.seed},
        "max_session_seconds": max_seconds,
    }


def session_created(session: dict[str, Any]) -> str:
    return _event("session.created", session=session)


def session_updated(session: dict[str, Any]) -> str:
    return _event("session.updated", session=session)


def response_created(response_id: str) -> str:
    return _event("response.created", response={"id": response_id, "object": "realtime.response",
                                                 "status": "in_progress", "output_modalities": ["audio"]})


class AudioDeltas:
    """`response.output_audio.delta` events of one response, built from a template: the per-session fields are
    JSON-encoded once, and base64 needs no escaping, so a frame costs no dict and no JSON pass over its audio."""

    def __init__(self, response_id: str, item_id: str) -> None:
        head = json.dumps({"type": "response.output_audio.delta", "event_id": ""}, separators=(",", ":"))[:-2]
        tail = json.dumps({"response_id": response_id, "item_id": item_id, "output_index": 0, "content_index": 0},
                          separators=(",", ":"))[1:-1]
        self._head, self._middle = head, '",' + tail + ',"delta":"'

    def __call__(self, pcm: np.ndarray) -> str:
        return f'{self._head}{event_id()}{self._middle}{encode_audio(pcm)}"}}'


def audio_delta(response_id: str, item_id: str, pcm: np.ndarray) -> str:
    return AudioDeltas(response_id, item_id)(pcm)


def transcript_delta(response_id: str, item_id: str, text: str) -> str:
    return _event("response.output_audio_transcript.delta", response_id=response_id, item_id=item_id,
                  output_index=0, content_index=0, delta=text)


def error_event(code: str, message: str, *, kind: str = "invalid_request_error", event_id: str | None = None,
                param: str | None = None) -> str:
    return _event("error", error={"type": kind, "code": code, "message": message, "param": param,
                                  "event_id": event_id})
