"""The Kyutai `/api/chat` protocol from the client side: kind-byte messages, Ogg/Opus both ways via sphn.

Accepts both handshakes (1 byte from the Python server, 9 from Rust/duplexd) and a metadata message before it,
as a client compatible with both reference servers must.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import sphn

from duplexd.server import protocol

from .audio import SAMPLE_RATE
from .connection import Connection, ConnectOptions, Event, Refused

logger = logging.getLogger(__name__)


class KyutaiConnection(Connection):
    def __init__(self, options: ConnectOptions) -> None:
        super().__init__(options)
        self._writer = sphn.OpusStreamWriter(SAMPLE_RATE)
        self._reader = sphn.OpusStreamReader(SAMPLE_RATE)

    async def handshake(self) -> None:
        assert self.ws is not None
        while True:
            data = await self.ws.recv()
            if isinstance(data, str):
                continue
            msg = protocol.decode(data)
            if msg.kind == protocol.Kind.HANDSHAKE:
                return
            if msg.kind == protocol.Kind.METADATA:
                self.info = json.loads(msg.payload.decode("utf-8"))
            elif msg.kind == protocol.Kind.ERROR:
                message = msg.payload.decode("utf-8", "replace")
                try:
                    await self.ws.recv()  # the close frame that follows carries the code
                except Exception as e:  # noqa: BLE001 - ConnectionClosed is the expected outcome
                    code = getattr(getattr(e, "rcvd", None), "code", None)
                    raise Refused(message, code) from None
                raise Refused(message)

    def parse(self, message: str | bytes) -> list[Event]:
        if isinstance(message, str):
            return []
        msg = protocol.decode(message)
        if msg.kind == protocol.Kind.AUDIO:
            return [Event("audio", pcm=self._reader.append_bytes(msg.payload))]
        if msg.kind == protocol.Kind.TEXT:
            return [Event("text", text=msg.payload.decode("utf-8", "replace"))]
        if msg.kind == protocol.Kind.ERROR:
            return [Event("error", text=msg.payload.decode("utf-8", "replace"))]
        return []

    def encode(self, pcm: np.ndarray) -> bytes:
        return protocol.audio(self._writer.append_pcm(np.ascontiguousarray(pcm, dtype=np.float32)))


def encode_stream(frames: list[np.ndarray]) -> list[bytes]:
    """The messages of one whole input stream (the first carries the Ogg headers): encode once, send often.

    A frame whose pages the writer still holds back gives an empty audio message, harmless to the server."""
    writer = sphn.OpusStreamWriter(SAMPLE_RATE)
    return [protocol.audio(writer.append_pcm(np.ascontiguousarray(f, dtype=np.float32))) for f in frames]
