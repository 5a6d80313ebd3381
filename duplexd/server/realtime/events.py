"""The OpenAI Realtime event subset duplexd speaks on `/v1/realtime`: client event parsing, server event builders.

Audio is pcm16 little-endian mono at 24 kHz, base64 in JSON, both ways. The model is full duplex: audio flows
both ways all the time, so turn-taking events (`commit`, `response.create`, ...) have nothing to do and are
answered with a non-fatal `unsupported_event` error; those OpenAI's SDKs send in their default session (an item's
retrieval, the truncation of the model's item, `response.cancel` when the user cuts in) are served instead, so
that they see no error. Sampling is a duplexd extension of the session object:
`session.sampling = {text_temperature, text_topk, audio_temperature, audio_topk, seed, repetition_penalty,
repetition_penalty_context, pad_mult}`.

A PersonaPlex persona: `session.instructions` (the role text) and `session.voice` (GA `session.audio.output.voice`),
shown in the session object only where one applies (`server.realtime` fixes it at the first audio).

Transcription of the user's speech (`server.realtime` runs it): `session.input_audio_transcription` (beta) or
`session.audio.input.transcription` (GA) = `{model, language, prompt}` turns it on, `null` off. Its events are
those of OpenAI's server VAD mode (speech started/stopped, the committed user item, the transcript), built below.

Client events are one pydantic union tagged by `type`, validated straight from the JSON text by a `TypeAdapter`
built once: an audio append (12.5 a second per session) costs one pass in pydantic-core and no Python checks.
A validation error is turned back into the error the protocol promises (`refusal`) on the slow path only.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import json
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from duplexd import wire
from duplexd.engine.dialogue.sampling import MAX_REPETITION_CONTEXT, SamplingParams
from duplexd.engine.transcription.transcriber import instruction
from duplexd.server.connection.closing import Close, CloseCode

from .audio_formats import BETA_NAMES, PCM, Format, InputAudio, format_object

T = TypeVar("T")
SUBPROTOCOL = "realtime"
SAMPLE_RATE = wire.SAMPLE_RATE
TRANSCRIPTION_PARAM = "session.audio.input.transcription"
BETA_TRANSCRIPTION_PARAM = "session.input_audio_transcription"
INSTRUCTIONS_PARAM = "session.instructions"  # a PersonaPlex model's role text
VOICE_PARAM = "session.voice"  # and its voice (a file name from /v1/models)
GA_VOICE_PARAM = "session.audio.output.voice"
MAX_TRANSCRIPTION_PROMPT = 500  # characters: the prompt is decoder input for every utterance
# Client events of the OpenAI API that a duplex model has no use for: answered with a non-fatal error.
UnsupportedType = Literal[
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "response.create",
    "conversation.item.create",
    "conversation.item.delete",
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


class PcmFormat(BaseModel):
    """GA `session.audio.*.format` of the model's own audio (fields the API adds are ignored)."""

    type: Literal["audio/pcm"]
    rate: Literal[24000] = 24000  # wire.SAMPLE_RATE, spelt out: a Literal takes no names


class TelephoneFormat(BaseModel):
    """G.711 at 8 kHz (`audio_formats` resamples it)."""

    type: Literal["audio/pcmu", "audio/pcma"]


AudioFormat = Annotated[PcmFormat | TelephoneFormat, Field(discriminator="type")]
BetaFormat = Literal["pcm16", "g711_ulaw", "g711_alaw"]


class TranscriptionSettings(BaseModel):
    """`input_audio_transcription`: what shapes the instruction given to the transcriber (`transcription_prompt`).
    `model` is accepted and ignored: the server transcribes with the one it has, and says which."""

    model: str | None = None
    language: str | None = Field(default=None, pattern=r"^[A-Za-z]{2}$")  # ISO-639-1
    prompt: str | None = Field(default=None, max_length=MAX_TRANSCRIPTION_PROMPT)


class AudioSide(BaseModel):
    format: AudioFormat | None = None


class AudioOutput(AudioSide):
    voice: Any = None  # GA place of `session.voice`; checked only where a persona applies (`SessionUpdate.persona`)


class AudioInput(AudioSide):
    transcription: TranscriptionSettings | None = None  # given as null: off (see `SessionUpdate.transcription`)


class SessionAudio(BaseModel):
    input: AudioInput | None = None
    output: AudioOutput | None = None


class SessionPatch(BaseModel):
    """The part of a `session.update`'s session duplexd reads; the rest is ignored. `instructions` and `voice` are
    a PersonaPlex model's persona; any value is accepted (and ignored) by a model that takes none, as before."""

    audio: SessionAudio | None = None
    instructions: Any = None
    voice: Any = None
    input_audio_format: BetaFormat | None = None  # beta names
    output_audio_format: BetaFormat | None = None
    sampling: SamplingUpdate | None = None
    input_audio_transcription: TranscriptionSettings | None = None  # beta name of audio.input.transcription


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

    def formats(self) -> tuple[Format | None, Format | None]:
        """The input and output audio formats this update sets (None: left as they are); the GA place wins."""
        patch = self.session
        sides: tuple[AudioSide | None, AudioSide | None] = (
            (patch.audio.input, patch.audio.output) if patch.audio is not None else (None, None)
        )
        chosen: list[Format | None] = []
        for side, beta in zip(sides, (patch.input_audio_format, patch.output_audio_format), strict=True):
            if side is not None and side.format is not None:
                chosen.append(side.format.type)
            else:
                chosen.append(BETA_NAMES[beta] if beta is not None else None)
        return chosen[0], chosen[1]

    def transcription(self) -> tuple[str, TranscriptionSettings | None] | None:
        """The transcription this update asks for, with the param it was given as: settings, or None to turn it
        off; None when the update leaves it as it is. The GA place wins when both are given."""
        side = self.session.audio.input if self.session.audio is not None else None
        if side is not None and "transcription" in side.model_fields_set:
            return TRANSCRIPTION_PARAM, side.transcription
        if "input_audio_transcription" in self.session.model_fields_set:
            return BETA_TRANSCRIPTION_PARAM, self.session.input_audio_transcription
        return None

    def persona(self) -> tuple[str | None, tuple[str, str] | None]:
        """The role text and the voice this update gives (None: left as they are), the voice with the param it
        came as (GA `session.audio.output.voice` wins over `session.voice`). `RealtimeError` for a value that is
        not a string."""
        patch = self.session
        text = patch.instructions
        if text is not None and not isinstance(text, str):
            raise RealtimeError(
                "invalid_value", f"{INSTRUCTIONS_PARAM} must be a string", self.event_id, INSTRUCTIONS_PARAM
            )
        output = patch.audio.output if patch.audio is not None else None
        param, voice = (
            (GA_VOICE_PARAM, output.voice)
            if output is not None and output.voice is not None
            else (VOICE_PARAM, patch.voice)
        )
        if voice is not None and not isinstance(voice, str):
            raise RealtimeError("invalid_value", f"{param} must be a voice's name (a string)", self.event_id, param)
        return text, (voice, param) if voice is not None else None


class ItemRetrieve(ClientEvent):
    """`conversation.item.retrieve`: any item the session has announced (OpenAI's SDKs rebuild their history by it)."""

    type: Literal["conversation.item.retrieve"]
    item_id: str


class ItemTruncate(ClientEvent):
    """`conversation.item.truncate`: the client stopped playing the assistant's audio at `audio_end_ms` (SDKs send
    it when the user starts speaking)."""

    type: Literal["conversation.item.truncate"]
    item_id: str
    content_index: int = Field(0, ge=0)
    audio_end_ms: int = Field(ge=0)


class OutputClear(ClientEvent):
    """`output_audio_buffer.clear`: a WebRTC call's (the server holds the audio not yet played)."""

    type: Literal["output_audio_buffer.clear"]


class ResponseCancel(ClientEvent):
    """`response.cancel`: accepted with no effect (`server.realtime`): the duplex response cannot end."""

    type: Literal["response.cancel"]


class TurnEvent(ClientEvent):
    type: UnsupportedType


Event = AudioAppend | SessionUpdate | ItemRetrieve | ItemTruncate | OutputClear | ResponseCancel | TurnEvent
CLIENT_EVENTS: TypeAdapter[Event] = TypeAdapter(Annotated[Event, Field(discriminator="type")])


class RealtimeError(Exception):
    """A non-fatal problem with one client event: reported as an `error` event, the session goes on."""

    def __init__(self, code: str, message: str, event_id: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.event_id, self.param = code, message, event_id, param

    def event(self) -> str:
        """The `error` event that reports it."""
        return error_event(self.code, self.message, event_id=self.event_id, param=self.param)


def transcription_prompt(settings: TranscriptionSettings) -> str:
    """The instruction Gemma gets after each utterance (`instruction`: language and hint)."""
    return instruction(settings.language, settings.prompt)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


# Event ids: unique per process without a uuid4 (an os.urandom call) per event, 12.5 or more events a second per
# session: a random prefix drawn once, then a counter (itertools.count is atomic under the GIL).
_EVENT_PREFIX = f"event_{uuid.uuid4().hex[:12]}"
_event_numbers = itertools.count()


def event_id() -> str:
    return f"{_EVENT_PREFIX}{next(_event_numbers):08x}"


def parse_event(text: str) -> Event:
    """A client event of a type duplexd knows. `Close` when the text is not JSON or not an event (1007), for an
    unknown type (1002) or an append without its audio (1007); `RealtimeError` for a bad `session.update`."""
    return parse_with(CLIENT_EVENTS, text)


def parse_with(events: TypeAdapter[T], text: str) -> T:
    """A client event of the union `events` (each kind of session has its own), refused as `parse_event` says."""
    try:
        return events.validate_json(text)
    except ValidationError as e:
        raise refusal(e, text) from None


U = TypeVar("U")


def session_update(parse: Callable[[str], object], kind: type[U], session: dict[str, Any]) -> U:
    """A configuration given outside an event (an ephemeral key's, a call's) as the `session.update` of `kind`
    that `parse` makes of it; `RealtimeError` naming what is wrong in it."""
    try:
        event = parse(json.dumps({"type": "session.update", "session": session}))
    except Close as e:
        raise RealtimeError("invalid_value", e.message, None, "session") from None
    assert isinstance(event, kind)
    return event


def parse_session(session: dict[str, Any]) -> SessionUpdate:
    """A conversation's configuration given outside an event, as its `session.update` (`session_update`)."""
    return session_update(parse_event, SessionUpdate, session)


def decode_audio(event: AudioAppend, audio: InputAudio | None = None) -> np.ndarray:
    """The float32 samples at the model's rate of an `input_audio_buffer.append` in the session's input format
    (`audio`; pcm16 when None); `Close` (1007) for bad base64 or pcm16."""
    try:
        raw = base64.b64decode(event.audio, validate=True)
    except (binascii.Error, ValueError) as e:
        raise Close(CloseCode.INVALID_PAYLOAD, "invalid_base64", f"'audio' is not valid base64: {e}") from None
    return (audio or InputAudio()).decode(raw)


def encode_audio(pcm: np.ndarray) -> str:
    return wire.pcm16_base64(pcm)


def refusal(e: ValidationError, text: str) -> Close | RealtimeError:
    """The protocol's answer to a client event that failed validation (the first error says which)."""
    err = e.errors(include_url=False)[0]
    kind, loc = err["type"], err["loc"]
    if kind == "json_invalid":
        return Close(CloseCode.INVALID_PAYLOAD, "invalid_json", f"malformed JSON: {err['ctx']['error']}")
    raw = json.loads(text)  # valid JSON (checked above); only for the type and event_id pydantic could not give
    given = raw.get("type") if isinstance(raw, dict) else None
    if kind == "union_tag_invalid" and not loc and isinstance(given, str):
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
            "unsupported_audio_format",
            f"the formats are audio/pcm at {SAMPLE_RATE} Hz, audio/pcmu and audio/pcma",
            event_id,
            ".".join(path[:4]),
        )
    if path[1:2] in (("input_audio_format",), ("output_audio_format",)):
        return RealtimeError(
            "unsupported_audio_format", "the formats are pcm16, g711_ulaw and g711_alaw", event_id, ".".join(path[:2])
        )
    if path[:4] == ("session", "audio", "input", "transcription"):  # GA: name the field, as for sampling
        where, field = TRANSCRIPTION_PARAM, ".".join(path[4:])
        message = f"bad {where}: {field}: {err['msg']}" if field else f"bad {where}: {err['msg']}"
        return RealtimeError("invalid_value", message, event_id, ".".join(path[:5]))
    where, field = ".".join(path[:2]), ".".join(path[2:])
    message = f"bad {where}: {field}: {err['msg']}" if field else f"bad {where}: {err['msg']}"
    return RealtimeError("invalid_value", message, event_id, ".".join(path[:3]))  # e.g. session.sampling.pad_mult


# ----------------------------------------------------------------------------------------------- server events


def server_event(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, "event_id": event_id(), **fields}, separators=(",", ":"))


def transcription_object(model: str, settings: TranscriptionSettings) -> dict[str, Any]:
    """The session's `audio.input.transcription` while it is on: the model that transcribes, and the client's
    language and prompt."""
    return {"model": model, "language": settings.language, "prompt": settings.prompt}


def session_object(
    session_id: str,
    model: str,
    params: SamplingParams,
    max_seconds: float,
    transcription: dict[str, Any] | None = None,
    persona: tuple[str, str] | None = None,
    formats: tuple[Format, Format] = (PCM, PCM),
) -> dict[str, Any]:
    """The session as the client sees it; `persona` (role text, voice) only where one applies (a PersonaPlex
    model with voices): a model that takes none shows no `instructions` or `voice`."""
    output: dict[str, Any] = {"format": format_object(formats[1])}
    extra: dict[str, Any] = {}
    if persona is not None:
        extra = {"instructions": persona[0], "voice": persona[1]}
        output["voice"] = persona[1]
    return {
        "id": session_id,
        "object": "realtime.session",
        "type": "realtime",
        "model": model,
        "output_modalities": ["audio"],
        "audio": {
            "input": {"format": format_object(formats[0]), "turn_detection": None, "transcription": transcription},
            "output": output,
        },
        **extra,
        "input_audio_transcription": transcription,  # the beta name
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
    return server_event("session.created", session=session)


def session_updated(session: dict[str, Any]) -> str:
    return server_event("session.updated", session=session)


def response_created(response_id: str) -> str:
    return server_event(
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

    def __call__(self, audio: str) -> str:
        """The event carrying `audio` (base64 in the session's output format)."""
        return f'{self._head}{event_id()}{self._middle}{audio}"}}'


def audio_delta(response_id: str, item_id: str, pcm: np.ndarray) -> str:
    return AudioDeltas(response_id, item_id)(encode_audio(pcm))


def transcript_delta(response_id: str, item_id: str, text: str) -> str:
    return server_event(
        "response.output_audio_transcript.delta",
        response_id=response_id,
        item_id=item_id,
        output_index=0,
        content_index=0,
        delta=text,
    )


# Transcription of the user's speech: the events of OpenAI's server VAD mode. Each utterance is one user item
# (`item_...`), announced by speech_started, created (committed, added, done) when speech stops, then transcribed.


def speech_started(item_id: str, audio_start_ms: int) -> str:
    return server_event("input_audio_buffer.speech_started", audio_start_ms=audio_start_ms, item_id=item_id)


def speech_stopped(item_id: str, audio_end_ms: int) -> str:
    return server_event("input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms, item_id=item_id)


def user_audio_item(item_id: str, transcript: str | None = None) -> dict[str, Any]:
    """The user message item of one utterance: its audio is not sent back, its transcript comes by its own
    events (`transcript: null` until then, as OpenAI does)."""
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "user",
        "status": "completed",
        "content": [{"type": "input_audio", "transcript": transcript}],
    }


def assistant_audio_item(item_id: str, transcript: str) -> dict[str, Any]:
    """The model's one item, in progress for the whole session, with its text so far."""
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "assistant",
        "status": "in_progress",
        "content": [{"type": "output_audio", "transcript": transcript}],
    }


def item_retrieved(item: dict[str, Any]) -> str:
    return server_event("conversation.item.retrieved", item=item)


def item_not_found(event: ItemRetrieve | ItemTruncate) -> RealtimeError:
    return RealtimeError("item_not_found", f"no item {event.item_id!r} in this session", event.event_id, "item_id")


def item_truncated(item_id: str, content_index: int, audio_end_ms: int) -> str:
    return server_event(
        "conversation.item.truncated", item_id=item_id, content_index=content_index, audio_end_ms=audio_end_ms
    )


def item_committed(item_id: str, previous_item_id: str | None) -> list[str]:
    """Speech stopped: the audio buffer is committed into a new user item (`input_audio_buffer.committed`, then
    the GA `conversation.item.added` and `conversation.item.done`)."""
    item = user_audio_item(item_id)
    return [
        server_event("input_audio_buffer.committed", previous_item_id=previous_item_id, item_id=item_id),
        server_event("conversation.item.added", previous_item_id=previous_item_id, item=item),
        server_event("conversation.item.done", previous_item_id=previous_item_id, item=item),
    ]


def input_transcript_delta(item_id: str, delta: str) -> str:
    return server_event(
        "conversation.item.input_audio_transcription.delta", item_id=item_id, content_index=0, delta=delta
    )


def input_transcript_completed(item_id: str, transcript: str, seconds: float) -> str:
    return server_event(
        "conversation.item.input_audio_transcription.completed",
        item_id=item_id,
        content_index=0,
        transcript=transcript,
        usage={"type": "duration", "seconds": round(seconds, 3)},  # of the utterance's audio
    )


def input_transcript_failed(item_id: str, reason: str) -> str:
    return server_event(
        "conversation.item.input_audio_transcription.failed",
        item_id=item_id,
        content_index=0,
        error={"type": "transcription_error", "code": failure_code(reason), "message": reason, "param": None},
    )


def failure_code(reason: str) -> str:
    """A stable code for the transcription service's failure reasons (the message keeps the details)."""
    for prefix, code in (
        ("audio dropped", "audio_dropped"),
        ("transcriber overloaded", "transcriber_overloaded"),
        ("decoding failed", "decoding_failed"),
    ):
        if reason.startswith(prefix):
            return code
    return "transcription_failed"


def error_event(
    code: str,
    message: str,
    *,
    kind: str = "invalid_request_error",
    event_id: str | None = None,
    param: str | None = None,
) -> str:
    return server_event(
        "error", error={"type": kind, "code": code, "message": message, "param": param, "event_id": event_id}
    )


def close_error(close: Close) -> str:
    """The `error` event that tells a client why its connection is about to close (`resource_exhausted` at
    capacity, as OpenAI says it)."""
    server_side = (CloseCode.INTERNAL_ERROR, CloseCode.TRY_AGAIN_LATER, CloseCode.GOING_AWAY)
    kind = "server_error" if close.code in server_side else "invalid_request_error"
    code = "resource_exhausted" if close.error == "capacity" else close.error
    return error_event(code, close.message, kind=kind)
