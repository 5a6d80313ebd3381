"""The events of an OpenAI Realtime transcription session (`/v1/realtime?intent=transcription`) on a
speech-to-text model: client event parsing and the session object.

Both dialects of the API are read: GA `session.update` with `session = {type: "transcription", audio: {input:
{format, transcription, turn_detection, noise_reduction}}, include}`, answered by `session.updated`, and beta
`transcription_session.update` with `session = {input_audio_format, input_audio_transcription, turn_detection,
input_audio_noise_reduction, include}`, answered by `transcription_session.updated`. The session object carries
both sets of names, as the conversation's does. The fields given replace the session's; fields the API defines
that mean nothing here (noise reduction, logprobs) are accepted and shown off (`null`).

Audio is `input_audio_buffer.append` (base64 pcm16 at 24 kHz, as in a conversation); `input_audio_buffer.commit`
makes the audio so far one utterance, `.clear` drops what is not committed; `conversation.item.retrieve` gives an
utterance's item. Events that ask for a response have no model to answer them: a non-fatal `unsupported_event`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter

from duplexd.server.stt.turns import TurnDetection

from .audio_formats import BETA_NAME, BETA_NAMES, PCM, Format, format_object
from .events import (
    AudioAppend,
    AudioFormat,
    BetaFormat,
    ClientEvent,
    ItemRetrieve,
    RealtimeError,
    TranscriptionSettings,
    parse_with,
)

INTENT = "transcription"  # the `intent` query parameter that asks for such a session
SEMANTIC_SILENCE_S = {"high": 1.0, "medium": 2.0, "auto": 2.0, "low": 3.0}  # Kyutai's own end of turn: 2 s
UnsupportedType = Literal[
    "response.create",
    "response.cancel",
    "output_audio_buffer.clear",
    "conversation.item.create",
    "conversation.item.delete",
    "conversation.item.truncate",
]


class TurnDetectionSettings(BaseModel):
    """`turn_detection`: `server_vad` (its silence picks the pause head, its threshold is the head's) or
    `semantic_vad` (its eagerness picks the silence); fields the API adds are ignored."""

    type: Literal["server_vad", "semantic_vad"]
    threshold: float | None = Field(default=None, ge=0, le=1)
    prefix_padding_ms: int | None = Field(default=None, ge=0)
    silence_duration_ms: int | None = Field(default=None, ge=0)
    eagerness: Literal["low", "medium", "high", "auto"] | None = None

    def detection(self) -> TurnDetection:
        if self.type == "semantic_vad":
            return TurnDetection(silence_s=SEMANTIC_SILENCE_S[self.eagerness or "auto"], prefix_s=0.0)
        default = TurnDetection()
        return TurnDetection(
            silence_s=default.silence_s if self.silence_duration_ms is None else self.silence_duration_ms / 1000,
            threshold=default.threshold if self.threshold is None else self.threshold,
            prefix_s=default.prefix_s if self.prefix_padding_ms is None else self.prefix_padding_ms / 1000,
        )

    def shown(self) -> dict[str, Any]:
        """As the session object shows it: every value in effect."""
        detection = self.detection()
        if self.type == "semantic_vad":
            return {"type": self.type, "eagerness": self.eagerness or "auto"}
        return {
            "type": self.type,
            "threshold": detection.threshold,
            "prefix_padding_ms": round(detection.prefix_s * 1000),
            "silence_duration_ms": round(detection.silence_s * 1000),
        }


DEFAULT_TURN_DETECTION = TurnDetectionSettings(type="server_vad")


class TranscriptionInput(BaseModel):
    format: AudioFormat | None = None
    transcription: TranscriptionSettings | None = None
    turn_detection: TurnDetectionSettings | None = None  # given as null: turns end only by a commit
    noise_reduction: Any = None


class TranscriptionAudio(BaseModel):
    input: TranscriptionInput | None = None


class Settings(BaseModel):
    """What one update asks for, read from either dialect; a field is set only where the update gives it."""

    transcription: TranscriptionSettings | None = None
    turn_detection: TurnDetectionSettings | None = None
    given: frozenset[str] = frozenset()  # of "transcription", "turn_detection"
    input_format: Format | None = None


class GaSession(BaseModel):
    type: Literal["transcription", "realtime"] | None = None
    audio: TranscriptionAudio | None = None
    include: Any = None

    def settings(self) -> Settings:
        side = self.audio.input if self.audio is not None else None
        if side is None:
            return Settings()
        given = frozenset(side.model_fields_set & {"transcription", "turn_detection"})
        fmt = side.format.type if side.format is not None else None
        return Settings(
            transcription=side.transcription, turn_detection=side.turn_detection, given=given, input_format=fmt
        )


class BetaSession(BaseModel):
    input_audio_format: BetaFormat | None = None
    input_audio_transcription: TranscriptionSettings | None = None
    turn_detection: TurnDetectionSettings | None = None
    input_audio_noise_reduction: Any = None
    include: Any = None

    def settings(self) -> Settings:
        given = {"transcription"} if "input_audio_transcription" in self.model_fields_set else set()
        given |= {"turn_detection"} & self.model_fields_set
        fmt = BETA_NAMES[self.input_audio_format] if self.input_audio_format is not None else None
        return Settings(
            transcription=self.input_audio_transcription,
            turn_detection=self.turn_detection,
            given=frozenset(given),
            input_format=fmt,
        )


class SessionUpdate(ClientEvent):
    type: Literal["session.update"]
    session: GaSession

    def settings(self) -> Settings:
        if self.session.type == "realtime":
            raise RealtimeError(
                "invalid_value",
                "this is a transcription session (intent=transcription) on a speech-to-text model: session.type "
                "must be 'transcription'",
                self.event_id,
                "session.type",
            )
        return self.session.settings()


class TranscriptionSessionUpdate(ClientEvent):
    type: Literal["transcription_session.update"]
    session: BetaSession

    def settings(self) -> Settings:
        return self.session.settings()


class Commit(ClientEvent):
    type: Literal["input_audio_buffer.commit"]


class Clear(ClientEvent):
    type: Literal["input_audio_buffer.clear"]


class Unsupported(ClientEvent):
    type: UnsupportedType


Event = AudioAppend | SessionUpdate | TranscriptionSessionUpdate | Commit | Clear | ItemRetrieve | Unsupported
EVENTS: TypeAdapter[Event] = TypeAdapter(Annotated[Event, Field(discriminator="type")])


def parse_event(text: str) -> Event:
    """A client event of a transcription session; `Close` or `RealtimeError` as in a conversation."""
    return parse_with(EVENTS, text)


def session_object(
    session_id: str,
    model: str,
    transcription: TranscriptionSettings,
    turn_detection: TurnDetectionSettings | None,
    input_format: Format = PCM,
) -> dict[str, Any]:
    """The session as the client sees it, under the GA names and the beta ones."""
    shown = {"model": model, "language": transcription.language, "prompt": transcription.prompt}
    detection = turn_detection.shown() if turn_detection is not None else None
    return {
        "id": session_id,
        "object": "realtime.transcription_session",
        "type": "transcription",
        "audio": {
            "input": {
                "format": format_object(input_format),
                "transcription": shown,
                "turn_detection": detection,
                "noise_reduction": None,
            }
        },
        "include": None,
        "input_audio_format": BETA_NAME[input_format],  # the beta names
        "input_audio_transcription": shown,
        "turn_detection": detection,
        "input_audio_noise_reduction": None,
        "modalities": ["text"],
    }
