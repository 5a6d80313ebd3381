"""What goes over the wire between duplexd's server and its clients, written once for both: numpy only.

The clients talk to a server over the network and nothing else, so this module imports nothing of duplexd: a
client never loads the engine, and the two sides cannot drift apart on framing, rates or sample encoding.

* Audio: mono at 24 kHz, in 80 ms frames of 1920 samples (one Mimi frame; 12.5 frames a second).
* Kyutai `/api/chat`: one kind byte, then the payload (Ogg/Opus audio, UTF-8 text or JSON).
* OpenAI Realtime `/v1/realtime`: pcm16 little-endian samples, base64 in JSON.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

SAMPLE_RATE = 24000  # Hz, both directions
FRAME_RATE = 12.5  # frames a second: the model steps once a frame
FRAME_SIZE = round(SAMPLE_RATE / FRAME_RATE)  # 1920 samples
FRAME_SECONDS = 1 / FRAME_RATE  # 0.08

# ------------------------------------------------------------------------------------------------------ frames


def split_frames(pcm: np.ndarray, frame_size: int = FRAME_SIZE) -> np.ndarray:
    """Whole frames of float32 `pcm` along its last axis, `[..., n, frame_size]`, the last one zero-padded (at
    least one): the model only steps on whole frames, and dropping a partial one would lose the end of the input."""
    pcm = np.asarray(pcm, dtype=np.float32)
    count = max(1, -(-pcm.shape[-1] // frame_size))
    pad = count * frame_size - pcm.shape[-1]
    if pad:
        pcm = np.pad(pcm, [(0, 0)] * (pcm.ndim - 1) + [(0, pad)])
    return pcm.reshape(*pcm.shape[:-1], count, frame_size)


# ---------------------------------------------------------------------------------------------- Kyutai framing


class Kind(IntEnum):
    HANDSHAKE = 0
    AUDIO = 1
    TEXT = 2
    CONTROL = 3
    METADATA = 4
    ERROR = 5
    PING = 6
    COLORED_TEXT = 7


# duplexd's opt-in JSON events about the user's speech (`/api/chat?transcribe=1`) ride on the ping kind, which
# every Kyutai client ignores without harm: its web client decodes a ping without reading the payload and nothing
# consumes it (a new kind byte would make its decoder throw); its Python and Rust clients log an unknown kind and
# go on, as they do for the metadata every server sends. docs/CLIENTS.md has the survey.
USER_EVENTS = Kind.PING


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


# ----------------------------------------------------------------------------------------------- pcm16, base64


def pcm16(pcm: np.ndarray) -> np.ndarray:
    """Float samples as pcm16 little-endian (clipped, rounded): one scratch array, no intermediate copies, as the
    server encodes every output frame of every session with it."""
    scaled = np.multiply(pcm, 32767.0, dtype=np.float32)
    np.clip(scaled, -32767.0, 32767.0, out=scaled)
    np.rint(scaled, out=scaled)
    return scaled.astype("<i2")


def pcm_from_pcm16(raw: bytes) -> np.ndarray:
    """pcm16 little-endian as float32 samples in [-1, 1), one array."""
    return np.multiply(np.frombuffer(raw, dtype="<i2"), 1.0 / 32768.0, dtype=np.float32)


def pcm16_base64(pcm: np.ndarray) -> str:
    """Float samples as the base64 pcm16 of a Realtime audio event (no newline: it goes into JSON as is)."""
    return base64_text(pcm16(pcm).data)


def base64_text(data: bytes | memoryview) -> str:
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def pcm_from_base64(data: str) -> np.ndarray:
    """The float32 samples of a base64 pcm16 string; `ValueError` for bad base64 or an odd byte count."""
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error as e:
        raise ValueError(f"audio is not valid base64: {e}") from None
    if len(raw) % 2:
        raise ValueError("audio has an odd number of bytes: not pcm16")
    return pcm_from_pcm16(raw)
