"""The Kyutai `/api/chat` protocol from the client side: kind-byte messages, Ogg/Opus both ways via sphn.

Accepts both handshakes (1 byte from the Python server, 9 from Rust/duplexd) and a metadata message before it,
as a client compatible with both reference servers must. With `transcribe`, duplexd's JSON events about the
user's speech come on the ping kind (`USER_EVENTS`); a ping without JSON is ignored, as Kyutai's clients do.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

import numpy as np
import sphn

from duplexd.wire import SAMPLE_RATE, USER_EVENTS, Kind, decode, encode

from .connection import Connection, ConnectOptions, Event

logger = logging.getLogger(__name__)


class KyutaiConnection(Connection):
    def __init__(self, options: ConnectOptions) -> None:
        super().__init__(options)
        self._writer = sphn.OpusStreamWriter(SAMPLE_RATE)
        self._reader = sphn.OpusStreamReader(SAMPLE_RATE)

    async def greeting(self, message: str | bytes) -> bool:
        if isinstance(message, str):
            return False
        msg = decode(message)
        if msg.kind == Kind.METADATA:
            self.info = json.loads(msg.payload.decode("utf-8"))
        elif msg.kind == Kind.ERROR:
            await self.refuse(msg.payload.decode("utf-8", "replace"))
        return msg.kind == Kind.HANDSHAKE

    def parse(self, message: str | bytes) -> list[Event]:
        if isinstance(message, str):
            return []
        msg = decode(message)
        if msg.kind == Kind.AUDIO:
            return [Event("audio", pcm=self._reader.append_bytes(msg.payload))]
        if msg.kind == Kind.TEXT:
            return [Event("text", text=msg.payload.decode("utf-8", "replace"))]
        if msg.kind == Kind.ERROR:
            return [Event("error", text=msg.payload.decode("utf-8", "replace"))]
        if msg.kind == USER_EVENTS and msg.payload:
            return _user_event(msg.payload)
        return []

    def encode(self, pcm: np.ndarray) -> bytes:
        return _audio(self._writer, pcm)


def _user_event(payload: bytes) -> list[Event]:
    try:
        data = json.loads(payload.decode("utf-8"))
    except ValueError:
        logger.debug("ignoring a ping that is not a JSON event")
        return []
    return [Event("transcript", data=data)] if isinstance(data, dict) else []


def _audio(writer: sphn.OpusStreamWriter, pcm: np.ndarray) -> bytes:
    """One audio message: the Ogg pages `writer` gives for `pcm` (possibly none yet)."""
    return encode(Kind.AUDIO, writer.append_pcm(np.ascontiguousarray(pcm, dtype=np.float32)))


def encode_stream(frames: Iterable[np.ndarray]) -> list[bytes]:
    """The messages of one whole input stream (the first carries the Ogg headers): encode once, send often.

    A frame whose pages the writer still holds back gives an empty audio message, harmless to the server."""
    writer = sphn.OpusStreamWriter(SAMPLE_RATE)
    return [_audio(writer, f) for f in frames]
