"""The OpenAI Realtime subset from the client side: JSON events, base64 pcm16 at 24 kHz both ways.

Accepts both names of the audio and transcript deltas (GA `response.output_audio.*`, beta `response.audio.*`).
"""

from __future__ import annotations

import base64
import binascii
import json

import numpy as np

from .connection import Connection, Event, Refused

AUDIO_DELTAS = {"response.output_audio.delta", "response.audio.delta"}
TEXT_DELTAS = {"response.output_audio_transcript.delta", "response.audio_transcript.delta"}


def encode_pcm16(pcm: np.ndarray) -> str:
    samples = np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0)
    return base64.b64encode((samples * 32767.0).round().astype("<i2").tobytes()).decode("ascii")


def decode_pcm16(data: str) -> np.ndarray:
    """Strict: bad base64 or an odd byte count is a `ValueError` (the load test counts it as an error)."""
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error as e:
        raise ValueError(f"audio delta is not valid base64: {e}") from None
    if len(raw) % 2:
        raise ValueError("audio delta has an odd number of bytes: not pcm16")
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0


def append_event(pcm: np.ndarray) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": encode_pcm16(pcm)})


class RealtimeConnection(Connection):
    def subprotocols(self) -> list:
        return ["realtime"]

    async def handshake(self) -> None:
        assert self.ws is not None
        while True:
            data = await self.ws.recv()
            if isinstance(data, bytes):
                continue
            event = json.loads(data)
            if event.get("type") == "session.created":
                self.info = event.get("session") or {}
                return
            if event.get("type") == "error":
                err = event.get("error") or {}
                message = f"{err.get('code')}: {err.get('message')}"
                try:
                    await self.ws.recv()
                except Exception as e:  # noqa: BLE001 - ConnectionClosed is the expected outcome
                    code = getattr(getattr(e, "rcvd", None), "code", None)
                    raise Refused(message, code) from None
                raise Refused(message)

    def parse(self, message: str | bytes) -> list[Event]:
        if isinstance(message, bytes):
            return [Event("error", text="unexpected binary frame from the server")]
        event = json.loads(message)
        kind = event.get("type")
        if kind in AUDIO_DELTAS:
            return [Event("audio", pcm=decode_pcm16(event.get("delta", "")))]
        if kind in TEXT_DELTAS:
            return [Event("text", text=event.get("delta", ""))]
        if kind == "error":
            err = event.get("error") or {}
            return [Event("error", text=f"{err.get('code')}: {err.get('message')}")]
        return []

    def encode(self, pcm: np.ndarray) -> str:
        return append_event(pcm)


def encode_stream(frames: list[np.ndarray]) -> list[str]:
    return [append_event(f) for f in frames]
