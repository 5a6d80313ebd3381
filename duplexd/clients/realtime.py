"""The OpenAI Realtime subset from the client side: JSON events, base64 pcm16 at 24 kHz both ways.

Accepts both names of the audio and transcript deltas (GA `response.output_audio.*`, beta `response.audio.*`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from duplexd.wire import pcm16_base64, pcm_from_base64

from .connection import Connection, Event, Refused

AUDIO_DELTAS = {"response.output_audio.delta", "response.audio.delta"}
TEXT_DELTAS = {"response.output_audio_transcript.delta", "response.audio_transcript.delta"}


def append_event(pcm: np.ndarray) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": pcm16_base64(pcm)})


def _error_text(event: dict[str, Any]) -> str:
    err = event.get("error") or {}
    return f"{err.get('code')}: {err.get('message')}"


def persona_update(text: str | None, voice: str | None) -> str:
    """The `session.update` that gives a PersonaPlex server's session its persona (before any audio)."""
    session = {k: v for k, v in (("instructions", text), ("voice", voice)) if v is not None}
    return json.dumps({"type": "session.update", "session": session})


class RealtimeConnection(Connection):
    def subprotocols(self) -> list:
        return ["realtime"]

    async def handshake(self) -> None:
        """Admitted (`session.created`), then the persona when one is asked for: sent before any audio, and its
        refusal (unknown voice, a model that takes none, ...) is the connection's (`Refused`)."""
        await super().handshake()
        text, voice = self.options.text_prompt, self.options.voice_prompt
        if text is None and voice is None:
            return
        assert self.ws is not None
        await self.ws.send(persona_update(text, voice))
        while True:
            event = json.loads(await self.ws.recv())
            if event.get("type") == "error":
                await self.close()
                raise Refused(f"persona refused: {_error_text(event)}")
            if event.get("type") == "session.updated":
                self.info = event.get("session") or {}
                if "voice" not in self.info:  # shown only where a persona applies
                    await self.close()
                    raise Refused("persona refused: the server's model takes no persona (it is not PersonaPlex)")
                return

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
