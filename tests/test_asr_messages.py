"""`/api/asr-streaming` messages (`server.asr.messages`): moshi-server's bytes out, Kyutai's clients' bytes in.

The expected bytes are spelled out from the MessagePack format as rmp_serde writes a struct map (a map of the
`type` tag then the fields in order, shortest integers, f64 as float 64, f32 as float 32), not by the packer under
test; the client messages are packed as DSM's scripts and Unmute pack them.
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest

from duplexd.engine.stt.words import EndWord, Word
from duplexd.server.moshi_server import asr_messages as messages
from duplexd.server.moshi_server import stream


def fixstr(text: str) -> bytes:
    data = text.encode()
    assert len(data) < 32
    return bytes([0xA0 | len(data)]) + data


def fixmap(*pairs: tuple[str, bytes]) -> bytes:
    return bytes([0x80 | len(pairs)]) + b"".join(fixstr(key) + value for key, value in pairs)


def f64(x: float) -> bytes:
    return b"\xcb" + struct.pack(">d", x)


def f32(x: float) -> bytes:
    return b"\xca" + struct.pack(">f", x)


def test_server_bytes_as_rmp_serde() -> None:
    assert stream.pack(stream.ready()) == fixmap(("type", fixstr("Ready")))
    word = messages.word_event(Word("héllo", 1.36))
    assert messages.pack(word) == fixmap(("type", fixstr("Word")), ("text", fixstr("héllo")), ("start_time", f64(1.36)))
    end = messages.word_event(EndWord(2.0))
    assert messages.pack(end) == fixmap(("type", fixstr("EndWord")), ("stop_time", f64(2.0)))
    step = messages.step(300, [0.25, 0.5, 0.125, 1.0], 1920)
    prs = b"\x94" + b"".join(f32(p) for p in (0.25, 0.5, 0.125, 1.0))
    assert messages.pack(step) == fixmap(
        ("type", fixstr("Step")), ("step_idx", b"\xcd\x01\x2c"), ("prs", prs), ("buffered_pcm", b"\xcd\x07\x80")
    )
    assert messages.pack(messages.marker(5)) == fixmap(("type", fixstr("Marker")), ("id", b"\x05"))
    assert messages.pack(messages.marker(-1)) == fixmap(("type", fixstr("Marker")), ("id", b"\xff"))
    error = stream.pack(stream.error("no free channels"))
    assert error == fixmap(("type", fixstr("Error")), ("message", fixstr("no free channels")))


def test_clients_messages() -> None:
    pcm = np.linspace(-1, 1, 1920, dtype=np.float32)
    dsm = msgpack.packb({"type": "Audio", "pcm": [float(x) for x in pcm]}, use_single_float=True)
    unmute = msgpack.packb({"type": "Audio", "pcm": pcm.tolist()}, use_bin_type=True, use_single_float=True)
    for data in (dsm, unmute, msgpack.packb({"type": "Audio", "pcm": pcm.tolist()})):
        got = messages.decode(data)
        assert isinstance(got, messages.Audio) and got.pcm.dtype == np.float32
        np.testing.assert_array_equal(got.pcm, pcm)
    assert messages.decode(msgpack.packb({"type": "Audio", "pcm": [0, 1, -1]})).pcm.tolist() == [0.0, 1.0, -1.0]
    assert len(messages.decode(msgpack.packb({"type": "Audio", "pcm": []})).pcm) == 0
    assert messages.decode(msgpack.packb({"type": "Marker", "id": 0}, use_single_float=True)) == messages.Marker(0)
    assert messages.decode(msgpack.packb({"type": "Marker", "id": -(2**63)})) == messages.Marker(-(2**63))
    ogg = b"OggS\x00\x02"
    assert messages.decode(msgpack.packb({"type": "OggOpus", "data": ogg})) == messages.OggOpus(ogg)
    assert messages.decode(msgpack.packb({"type": "OggOpus", "data": list(ogg)})) == messages.OggOpus(ogg)
    # unknown fields are ignored, as serde does
    assert messages.decode(msgpack.packb({"type": "Marker", "id": 3, "extra": [1]})) == messages.Marker(3)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"\xc1", "not a MessagePack message"),
        (b"", "not a MessagePack message"),
        (msgpack.packb({"type": "Marker", "id": 1})[:-1], "not a MessagePack message"),
        (msgpack.packb({"type": "Marker", "id": 1}) + b"\x00", "not a MessagePack message"),
        (msgpack.packb({1: 2}), "not a MessagePack message"),
        (msgpack.packb([1, 2]), "expected a MessagePack map"),
        (msgpack.packb("Audio"), "expected a MessagePack map"),
        (msgpack.packb({"pcm": [0.0]}), "no `type`"),
        (msgpack.packb({"type": "Init"}), "unknown message type 'Init'"),
        (msgpack.packb({"type": "Text", "text": "hi"}), "unknown message type"),
        (msgpack.packb({"type": "Audio"}), "`pcm` field is missing"),
        (msgpack.packb({"type": "Audio", "pcm": b"\x00\x00\x80\x3f"}), "`pcm` must be an array"),
        (msgpack.packb({"type": "Audio", "pcm": ["0.5"]}), "`pcm` must be an array of numbers"),
        (msgpack.packb({"type": "Audio", "pcm": [[0.5, 0.1]]}), "`pcm` must be an array of numbers"),
        (msgpack.packb({"type": "Audio", "pcm": [[0.5], 0.1]}), "`pcm` must be an array of numbers"),
        (msgpack.packb({"type": "Audio", "pcm": [0.5, None]}), "`pcm` must be an array of numbers"),
        (msgpack.packb({"type": "Audio", "pcm": [True]}), "`pcm` must be an array of numbers"),
        (msgpack.packb({"type": "Marker"}), "`id` field is missing"),
        (msgpack.packb({"type": "Marker", "id": 1.5}), "`id` must be a 64-bit integer, got a float"),
        (msgpack.packb({"type": "Marker", "id": True}), "`id` must be a 64-bit integer, got a boolean"),
        (msgpack.packb({"type": "Marker", "id": 2**63}), "`id` must be a 64-bit integer"),
        (msgpack.packb({"type": "OggOpus", "data": "OggS"}), "`data` must be binary"),
        (msgpack.packb({"type": "OggOpus", "data": [256]}), "`data` must be binary"),
    ],
)
def test_bad_client_messages(data: bytes, says: str) -> None:
    with pytest.raises(messages.MessageError, match=says.replace("(", r"\(").replace("[", r"\[")):
        messages.decode(data)
