"""The messages the server sends on the Kyutai `/api/chat` protocol; the framing itself is `duplexd.wire`.

Handshake and metadata follow the Rust server (9-byte handshake, JSON metadata before it); the reference
web client and the Python client accept both that and the Python server's 1-byte handshake.
"""

from __future__ import annotations

import json

from duplexd.wire import Kind, Message, ProtocolError, decode, encode

__all__ = ["Kind", "Message", "ProtocolError", "audio", "decode", "encode", "error", "handshake", "metadata", "text"]

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
    return encode(Kind.METADATA, json.dumps(info, separators=(",", ":")).encode("utf-8"))
