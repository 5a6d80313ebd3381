"""The messages of `/api/asr-streaming`, as moshi-server writes and reads them: MessagePack maps tagged by `type`.

moshi-server serialises its Rust enums with rmp_serde as struct maps (`#[serde(tag = "type")]`): the tag first,
then the fields in their declared order; integers in their shortest form, `f64` times as float 64 and the
`f32` pause probabilities as float 32, which is what `pack` writes. Client messages are read as leniently as serde
reads them (unknown fields ignored, integers taken as floats) and refused, with a sentence saying why, for
anything else: not MessagePack, not a map, an unknown `type`, a missing or mistyped field.

Client: `Audio{pcm}` (24 kHz mono float samples, any count), `OggOpus{data}` (Ogg/Opus bytes), `Marker{id}`.
Server: `Word{text, start_time}`, `EndWord{stop_time}`, `Step{step_idx, prs, buffered_pcm}`, `Marker{id}`;
`Ready` and `Error{message}`, which every moshi-server stream sends, are `stream`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from duplexd.engine.stt.words import EndWord, Word, WordEvent
from duplexd.server.stt.stream import AsrStep

I64 = (-(2**63), 2**63 - 1)  # the range of moshi-server's marker ids
CLIENT_TYPES = ("Audio", "OggOpus", "Marker")


class MessageError(ValueError):
    """A client message that cannot be used; the text says why (it is sent back as `Error.message`)."""


@dataclass(frozen=True)
class Audio:
    pcm: np.ndarray  # float32, 1-D, 24 kHz


@dataclass(frozen=True)
class OggOpus:
    data: bytes


@dataclass(frozen=True)
class Marker:
    id: int


ClientMessage = Audio | OggOpus | Marker


def unpack_map(data: bytes) -> dict:
    """A client's MessagePack map (tagged by `type`); `MessageError` for anything else."""
    try:
        value = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise MessageError(f"not a MessagePack message ({e})") from None
    if not isinstance(value, dict):
        raise MessageError(f"expected a MessagePack map with a `type`, got {kind_of(value)}")
    return value


def decode(data: bytes) -> ClientMessage:
    """One client message from a binary WebSocket frame; `MessageError` naming what is wrong."""
    value = unpack_map(data)
    kind = value.get("type")
    if kind == "Audio":
        return Audio(_pcm(_field(value, "Audio", "pcm")))
    if kind == "OggOpus":
        return OggOpus(_bytes(_field(value, "OggOpus", "data")))
    if kind == "Marker":
        marker = _field(value, "Marker", "id")
        if type(marker) is not int or not I64[0] <= marker <= I64[1]:
            raise MessageError(f"Marker: `id` must be a 64-bit integer, got {kind_of(marker)}")
        return Marker(marker)
    if kind is None:
        raise MessageError(f"the message has no `type`; send one of {', '.join(CLIENT_TYPES)}")
    raise MessageError(f"unknown message type {str(kind)[:40]!r}; send one of {', '.join(CLIENT_TYPES)}")


def _field(message: dict, kind: str, name: str) -> Any:
    if name not in message:
        raise MessageError(f"{kind}: the `{name}` field is missing")
    return message[name]


def _pcm(value: Any) -> np.ndarray:
    """Samples as float32; serde takes any number as an f32, nothing else."""
    if not isinstance(value, list):
        raise MessageError(f"Audio: `pcm` must be an array of float samples, got {kind_of(value)}")
    wrong = MessageError("Audio: `pcm` must be an array of numbers (24 kHz mono float samples)")
    try:
        samples = np.asarray(value)
    except (ValueError, TypeError, OverflowError):  # ragged nesting and the like
        raise wrong from None
    if samples.size and (samples.ndim != 1 or samples.dtype.kind not in "fiu"):
        raise wrong
    return samples.astype(np.float32).reshape(-1)


def _bytes(value: Any) -> bytes:
    """MessagePack bin, or an array of byte values (what serde writes for a `Vec<u8>` by default)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, list) and all(type(b) is int for b in value):
        try:
            return bytes(value)
        except ValueError:
            pass
    raise MessageError(f"OggOpus: `data` must be binary (Ogg/Opus bytes), got {kind_of(value)}")


def kind_of(value: Any) -> str:
    names = {dict: "a map", list: "an array", str: "a string", bytes: "binary", bool: "a boolean", type(None): "nil"}
    return names.get(type(value), f"a {type(value).__name__}")


# ------------------------------------------------------------------------------------------- server → client

_DOUBLE = msgpack.Packer()  # rmp_serde writes an f64 as float 64
_SINGLE = msgpack.Packer(use_single_float=True)  # ... and an f32 (Step's probabilities) as float 32


def marker(marker_id: int) -> dict:
    return {"type": "Marker", "id": marker_id}


def step(step_idx: int, prs: Sequence[float], buffered_pcm: int) -> dict:
    return {"type": "Step", "step_idx": step_idx, "prs": [float(p) for p in prs], "buffered_pcm": buffered_pcm}


def word_event(event: WordEvent) -> dict:
    if isinstance(event, Word):
        return {"type": "Word", "text": event.text, "start_time": event.start_time}
    if isinstance(event, EndWord):
        return {"type": "EndWord", "stop_time": event.stop_time}
    raise TypeError(f"not a word event: {event!r}")


def step_messages(stepped: AsrStep) -> list[dict]:
    """moshi-server's messages for one step of a stream, in its order: `Step` (a model with pause heads only), the
    step's word events, then the markers now due."""
    out: list[dict] = []
    if stepped.pause is not None:
        out.append(step(stepped.index, stepped.pause, stepped.buffered))
    out.extend(word_event(event) for event in stepped.words)
    out.extend(marker(marker_id) for marker_id in stepped.markers)
    return out


def pack(message: dict) -> bytes:
    """A server message as moshi-server's bytes (its only float 32 fields are Step's `prs`)."""
    return (_SINGLE if message["type"] == "Step" else _DOUBLE).pack(message)
