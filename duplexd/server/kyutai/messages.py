"""The messages the server sends on the Kyutai `/api/chat` protocol; the framing itself is `duplexd.wire`.

Handshake and metadata follow the Rust server (9-byte handshake, JSON metadata before it); the reference
web client and the Python client accept both that and the Python server's 1-byte handshake.

With `?transcribe=1` the session also gets JSON events about the user's speech on `USER_EVENTS` (the ping kind,
which Kyutai's own clients ignore: see `duplexd.wire`); their names follow the Realtime protocol's.
"""

from __future__ import annotations

import json

from duplexd.engine.transcription.service import (
    SpeechBegan,
    SpeechEnded,
    TranscriptDelta,
    TranscriptDone,
    TranscriptEvent,
    TranscriptFailed,
)
from duplexd.wire import USER_EVENTS, Kind, Message, ProtocolError, decode, encode

__all__ = [
    "Kind",
    "Message",
    "ProtocolError",
    "audio",
    "decode",
    "encode",
    "error",
    "handshake",
    "metadata",
    "text",
    "transcript",
    "transcript_event",
    "transcription_unavailable",
]

HANDSHAKE_PAYLOAD = bytes(8)  # protocol version u32 = 0, model version u32 = 0 (Rust server)


def handshake() -> bytes:
    return encode(Kind.HANDSHAKE, HANDSHAKE_PAYLOAD)


def audio(ogg: bytes) -> bytes:
    return encode(Kind.AUDIO, ogg)


def text(piece: str) -> bytes:
    return encode(Kind.TEXT, piece.encode("utf-8"))


def error(message: str) -> bytes:
    return encode(Kind.ERROR, message.encode("utf-8"))


def metadata(info: dict) -> bytes:
    return encode(Kind.METADATA, _json(info))


def transcript_event(event: TranscriptEvent) -> dict:
    """The JSON of one transcription event. Times are seconds of the session's input audio (since its first
    decoded sample); `item` numbers the user's utterances from 0."""
    if isinstance(event, SpeechBegan):
        return {"type": "speech_started", "item": event.item, "start_s": event.start_s}
    if isinstance(event, SpeechEnded):
        return {"type": "speech_stopped", "item": event.item, "end_s": event.end_s}
    if isinstance(event, TranscriptDelta):
        return {"type": "transcript_delta", "item": event.item, "text": event.text}
    if isinstance(event, TranscriptDone):
        return {
            "type": "transcript_completed",
            "item": event.item,
            "text": event.text,
            "start_s": event.start_s,
            "end_s": event.end_s,
        }
    if isinstance(event, TranscriptFailed):
        return {"type": "transcript_failed", "item": event.item, "reason": event.reason}
    raise TypeError(f"not a transcription event: {event!r}")


def transcript(event: TranscriptEvent) -> bytes:
    return encode(USER_EVENTS, _json(transcript_event(event)))


def transcription_unavailable(message: str) -> bytes:
    """The one notice a session that asked for transcription gets when it cannot have it; it goes on without."""
    return encode(USER_EVENTS, _json({"type": "transcription_unavailable", "message": message}))


def _json(data: dict) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode("utf-8")
