"""The messages of `/api/tts_streaming`, as moshi-server reads and writes them, and its four output formats.

Client: a text frame (the text itself), the byte `\\0` (the end of the text), or a MessagePack map tagged by
`type`: `Text{text}`, `Voice{embeddings, shape}` (a custom voice, before the first text), `Eos`. Server, by the
stream's `format` (`OggOpus` by default): `Pcm` sends raw little-endian f32 samples, `OggOpus` raw Ogg pages;
`PcmMessagePack` sends `Ready`, `Audio{pcm}` (f32 samples) and `Text{text, start_s, stop_s}` (f64 seconds);
`OggOpusMessagePack` the same with `OggOpus{data}` for the audio. The raw formats send no `Ready`, `Text` or
`Error`: moshi-server's encoder has no bytes for them. Maps are written as rmp_serde writes moshi-server's structs:
the tag first, then the fields in order; a `Vec<u8>` as an array of byte values.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np

from .asr_messages import MessageError, kind_of, unpack_map

FORMATS = ("OggOpus", "Pcm", "PcmMessagePack", "OggOpusMessagePack")
DEFAULT_FORMAT = "OggOpus"
END_OF_TEXT = b"\0"
CLIENT_TYPES = ("Text", "Voice", "Eos")

_DOUBLE = msgpack.Packer()
_SINGLE = msgpack.Packer(use_single_float=True)


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class VoiceMessage:
    embeddings: list[float]
    shape: list[int]


@dataclass(frozen=True)
class Eos:
    pass


ClientMessage = Text | VoiceMessage | Eos


def decode(message: dict) -> ClientMessage:
    """One client message from an ASGI `websocket.receive`; `MessageError` naming what is wrong."""
    text = message.get("text")
    if text is not None:
        return Text(text)
    data = message.get("bytes") or b""
    if data == END_OF_TEXT:
        return Eos()
    value = unpack_map(data)
    kind = value.get("type")
    if kind == "Text":
        text = value.get("text")
        if not isinstance(text, str):
            raise MessageError(f"Text: `text` must be a string, got {kind_of(text)}")
        return Text(text)
    if kind == "Voice":
        embeddings, shape = value.get("embeddings"), value.get("shape")
        if not isinstance(embeddings, list) or not all(isinstance(x, (int, float)) for x in embeddings):
            raise MessageError(f"Voice: `embeddings` must be an array of numbers, got {kind_of(embeddings)}")
        if not isinstance(shape, list) or not all(type(x) is int and x >= 0 for x in shape):
            raise MessageError(f"Voice: `shape` must be an array of sizes, got {kind_of(shape)}")
        return VoiceMessage(embeddings, shape)
    if kind == "Eos":
        return Eos()
    if kind is None:
        raise MessageError(f"the message has no `type`; send one of {', '.join(CLIENT_TYPES)}")
    raise MessageError(f"unknown message type {str(kind)[:40]!r}; send one of {', '.join(CLIENT_TYPES)}")


def packed(fmt: str) -> bool:
    """Whether the format speaks MessagePack (`Ready`, `Text`, `Error`) or sends audio bytes alone."""
    return fmt.endswith("MessagePack")


def ready() -> bytes:
    return _DOUBLE.pack({"type": "Ready"})


def error(message: str) -> bytes:
    return _DOUBLE.pack({"type": "Error", "message": message})


def word(text: str, start_s: float, stop_s: float) -> bytes:
    return _DOUBLE.pack({"type": "Text", "text": text, "start_s": float(start_s), "stop_s": float(stop_s)})


def audio(pcm: np.ndarray) -> bytes:
    return _SINGLE.pack({"type": "Audio", "pcm": np.asarray(pcm, dtype=np.float32).tolist()})


def ogg_opus(data: bytes) -> bytes:
    return _DOUBLE.pack({"type": "OggOpus", "data": list(data)})


def raw_pcm(pcm: np.ndarray) -> bytes:
    return np.asarray(pcm, dtype="<f4").tobytes()
