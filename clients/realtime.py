"""The OpenAI Realtime subset from the client side: JSON events, base64 pcm16 at 24 kHz both ways.

Accepts both names of the audio and transcript deltas (GA `response.output_audio.*`, beta `response.audio.*`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from duplexd.wire import pcm16_base64, pcm_from_base64

from .connection import Connection, Event

AUDIO_DELTAS = {"response.output_audio.delta", "response.audio.delta"}
TEXT_DELTAS = {"response.output_audio_transcript.delta", "response.audio_transcript.delta"}


def append_event(pcm: np.ndarray) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_base64(pcm)})


def _error_text(event: dict[str, Any]) -> str:
    err = event.get("error") or {}
    return f"{err.get('code')}: {err.get('message')}"


class RealtimeConnection(Connection):
    def subprotocols(self) -> list:
        return ["realtime"]

    async def greeting(self, message: str | bytes) -> bool:
        if isinstance(message, bytes):
            return False
        event = json.loads(message)
        if event.get("type") == "error":
            await self.refuse(_error_text(event))
        if event.get("type") != "session.created":
            return False
        self.info = event.get("session") or {}
        return True

    def parse(self, message: str | bytes) -> list[Event]:
        """Strict: an audio delta with bad base64 or an odd byte count is a `ValueError` (the load test counts it
        as an error)."""
        if isinstance(message, bytes):
            return [Event("error", text="unexpected binary frame from the server")]
        event = json.loads(message)
        kind = event.get("type")
        if kind in AUDIO_DELTAS:
            return [Event("audio", pcm=pcm_from_base64(event.get("delta", "")))]
        if kind in TEXT_DELTAS:
            return [Event("text", text=event.get("delta", ""))]
        if kind == "error":
            return [Event("error", text=_error_text(event))]
        return []

    def encode(self, pcm: np.ndarray) -> str:
        return append_event(pcm)


def encode_stream(frames: Iterable[np.ndarray]) -> list[str]:
    return [append_event(f) for f in frames]
