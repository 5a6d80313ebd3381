"""The Kyutai `/api/chat` wire format: one kind byte, then the payload. Standard library only.

Shared by the server and the Python clients, so it knows nothing about audio codecs or the engine.
Handshake and metadata follow the Rust server (9-byte handshake, JSON metadata before it); the reference
web client and the Python client accept both that and the Python server's 1-byte handshake.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import IntEnum

HANDSHAKE_PAYLOAD = bytes(8)  # protocol version u32 = 0, model version u32 = 0 (Rust server)


class Kind(IntEnum):
    HANDSHAKE = 0
    AUDIO = 1
    TEXT = 2
    CONTROL = 3
    METADATA = 4
    ERROR = 5
    PING = 6
    COLORED_TEXT = 7


class Control(IntEnum):
    START = 0
    END_TURN = 1
    PAUSE = 2
    RESTART = 3


class ProtocolError(ValueError):
    """A message that is not valid on the wire (empty, or an unknown kind byte)."""


@dataclass(frozen=True)
class Message:
    kind: Kind
    payload: bytes


def encode(kind: Kind | int, payload: bytes = b"") -> bytes:
    return bytes((int(kind),)) + payload


def decode(data: bytes) -> Message:
    """Split a binary WebSocket message into kind and payload; `ProtocolError` if it has neither."""
    if not data:
        raise ProtocolError("empty message: every message starts with a kind byte")
    try:
        kind = Kind(data[0])
    except ValueError:
        raise ProtocolError(f"unknown message kind {data[0]} (known: 0-7)") from None
    return Message(kind, bytes(data[1:]))


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
