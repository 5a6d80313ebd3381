"""Real audio and real client streams for the codec tests: espeak-ng speech, the Ogg/Opus that each Kyutai client
sends (the browser's opus-recorder, moshi's Python client through sphn), and a strict Ogg/Opus validator.

The validator is written from RFC 3533 / RFC 7845 / RFC 6716 and what the Rust `ogg` crate enforces, independently
of `duplexd.server.codec.ogg` (its own table-driven CRC), so it can catch that module's mistakes.
"""

from __future__ import annotations

import functools
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from duplexd.server.codec import libopus, streams
from duplexd.server.codec.ogg import PageWriter

from .speech import speak
from .system_tools import needs

FRAME = 1920  # one 80 ms tick at 24 kHz
NOISE = 1e-3
TEXT = (
    "The quick brown fox jumps over the lazy dog. Please call me back tomorrow morning. "
    "Seven bright kites were flying above the river."
)

needs_libopus = needs("libopus")


@functools.cache
def speech_pcm(text: str = TEXT, seconds: float = 6.0) -> np.ndarray:
    """espeak-ng speech at 24 kHz plus Gaussian noise (σ 1e-3), cut to whole ticks (at most `seconds`)."""
    with tempfile.TemporaryDirectory() as tmp:
        pcm = speak(text, Path(tmp))
    pcm = pcm + np.random.default_rng(0).normal(0, NOISE, len(pcm)).astype(np.float32)
    ticks = min(len(pcm), int(seconds * 24000)) // FRAME
    return np.ascontiguousarray(pcm[: ticks * FRAME], dtype=np.float32)


def frames(pcm: np.ndarray) -> list[np.ndarray]:
    return [pcm[i : i + FRAME] for i in range(0, len(pcm) - FRAME + 1, FRAME)]


def browser_stream(pcm: np.ndarray, serial: int = 0x1D2C3B4A) -> list[bytes]:
    """What opus-recorder (Kyutai's web client) sends: OpusHead and OpusTags each as their own message, then one
    page per 40 ms holding two 20 ms packets (libopus AUDIO, default complexity), granule +960 a packet."""
    lib = libopus.load()
    assert lib is not None
    encoder = libopus.Encoder(lib, 24000, libopus.OPUS_APPLICATION_AUDIO)
    pre_skip = encoder.lookahead() * 2
    writer = PageWriter(serial)
    head = b"OpusHead" + struct.pack("<BBHIhB", 1, 1, pre_skip, 24000, 0, 0)
    tags = b"OpusTags" + struct.pack("<I", 13) + b"opus-recorder" + struct.pack("<I", 0)
    messages = [writer.page([head], 0, bos=True), writer.page([tags], 0)]
    granule = 0
    for at in range(0, len(pcm) - 959, 960):
        packets = [encoder.encode(pcm[at : at + 480]), encoder.encode(pcm[at + 480 : at + 960])]
        granule += 2 * 960
        messages.append(writer.page(packets, granule))
    encoder.close()
    return messages


def sphn_stream(pcm: np.ndarray) -> list[bytes]:
    """What moshi's Python client sends: sphn's writer, one message a 1920-sample frame."""
    import sphn

    writer = sphn.OpusStreamWriter(24000)
    return [writer.append_pcm(f) for f in frames(pcm)]


def split_pages(data: bytes) -> list[bytes]:
    """A concatenation of whole, well-formed pages, page by page."""
    out, at = [], 0
    while at < len(data):
        n = data[at + 26]
        length = 27 + n + sum(data[at + 27 : at + 27 + n])
        out.append(data[at : at + length])
        at += length
    return out


def our_decode(messages: list[bytes]) -> np.ndarray:
    decoder = streams.OggOpusDecoder(24000)
    try:
        return np.concatenate([np.zeros(0, np.float32), *(decoder.decode(m) for m in messages)])
    finally:
        decoder.close()


# ------------------------------------------------------------------------------------------- the strict validator


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else r << 1
        table.append(r & 0xFFFFFFFF)
    return table


_TABLE = _crc_table()


def reference_crc(data: bytes) -> int:
    """Ogg's CRC, byte at a time from its definition (poly 0x04c11db7, MSB first, init 0, no final xor)."""
    c = 0
    for b in data:
        c = ((c << 8) & 0xFFFFFFFF) ^ _TABLE[(c >> 24) ^ b]
    return c


def packet_ms(packet: bytes) -> float:
    """An Opus packet's duration from its TOC (RFC 6716 3.1); AssertionError when the TOC is malformed."""
    assert packet, "empty Opus packet"
    toc = packet[0]
    config, code = toc >> 3, toc & 3
    if config < 12:
        frame_ms = (10, 20, 40, 60)[config % 4]
    elif config < 16:
        frame_ms = (10, 20)[config % 2]
    else:
        frame_ms = (2.5, 5, 10, 20)[config % 4]
    assert not toc & 0x04, "stereo packet in a mono stream"
    if code == 0:
        count = 1
    elif code == 1:
        assert (len(packet) - 1) % 2 == 0, "code 1 packet with frames of unequal size"
        count = 2
    elif code == 2:
        assert len(packet) >= 2, "code 2 packet without its frame length"
        count = 2
    else:
        assert len(packet) >= 2, "code 3 packet without its frame count"
        count = packet[1] & 0x3F
        assert count >= 1, "code 3 packet of 0 frames"
    duration = frame_ms * count
    assert duration <= 120, f"packet of {duration} ms (Opus allows 120)"
    return duration


@dataclass
class Page:
    flags: int
    granule: int
    serial: int
    sequence: int
    packets: list[bytes]


def validate(messages: list[bytes], granule_step: int, packet_duration_ms: float, pre_skip: int | None = None) -> int:
    """Raise AssertionError unless `messages` are a strict, complete mono Ogg Opus stream as our encoder must send
    it: every message whole pages; page 0 the BOS OpusHead (1 channel), page 1 OpusTags, audio from page 2;
    consecutive sequence numbers, one serial, valid CRCs, no second BOS and no EOS, every packet ending on its page
    (lacing), granule +`granule_step` a page, valid TOCs of `packet_duration_ms`, at most 4000 bytes a packet.
    Returns the number of audio pages."""
    pages: list[Page] = []
    for index, message in enumerate(messages):
        at = 0
        while at < len(message):
            assert len(message) - at >= 27, f"message {index}: a partial page header"
            capture, version, flags, granule, serial, sequence, stored, nseg = struct.unpack_from(
                "<4sBBqIIIB", message, at
            )
            assert capture == b"OggS", f"message {index}: no capture pattern at {at}"
            assert version == 0, f"page {sequence}: stream structure version {version}"
            assert flags & ~0x07 == 0, f"page {sequence}: unknown header flags {flags:#x}"
            lacing = message[at + 27 : at + 27 + nseg]
            assert len(lacing) == nseg, f"message {index}: a partial segment table"
            end = at + 27 + nseg + sum(lacing)
            assert end <= len(message), f"message {index}: page {sequence} is split across messages"
            page = bytearray(message[at:end])
            page[22:26] = bytes(4)
            assert reference_crc(bytes(page)) == stored, f"page {sequence}: CRC mismatch"
            assert not flags & 0x01, f"page {sequence}: a packet continued from the page before"
            assert nseg > 0 and lacing[-1] < 255, f"page {sequence}: its last packet continues onto the next page"
            packets, body = [], at + 27 + nseg
            current = 0
            for value in lacing:
                current += value
                if value < 255:
                    packets.append(message[body : body + current])
                    body += current
                    current = 0
            pages.append(Page(flags, granule, serial, sequence, packets))
            at = end
    assert len(pages) >= 2, "no header pages"
    head, tags = pages[0], pages[1]
    assert head.flags == 0x02 and head.granule == 0 and len(head.packets) == 1, "page 0 is not a lone BOS OpusHead"
    opus_head = head.packets[0]
    assert len(opus_head) == 19 and opus_head[:8] == b"OpusHead", "page 0 does not hold a 19-byte OpusHead"
    version, channels, skip, _rate, _gain, mapping = struct.unpack("<BBHIhB", opus_head[8:])
    assert version == 1 and channels == 1 and mapping == 0, "OpusHead: not version 1, mono, mapping family 0"
    if pre_skip is not None:
        assert skip == pre_skip, f"OpusHead pre-skip {skip}, expected {pre_skip}"
    assert tags.flags == 0 and tags.granule == 0 and len(tags.packets) == 1, "page 1 is not a lone OpusTags"
    opus_tags = tags.packets[0]
    assert opus_tags[:8] == b"OpusTags", "page 1 does not hold OpusTags"
    (vendor_len,) = struct.unpack_from("<I", opus_tags, 8)
    (count,) = struct.unpack_from("<I", opus_tags, 12 + vendor_len)
    assert count == 0 and len(opus_tags) == 16 + vendor_len, "OpusTags: malformed comment list"
    granule = 0
    for expected, page in enumerate(pages):
        assert page.sequence == expected, f"page {expected} has sequence number {page.sequence}"
        assert page.serial == pages[0].serial, f"page {expected}: a second serial"
        assert expected == 0 or not page.flags & 0x02, f"page {expected}: a second BOS"
        assert not page.flags & 0x04, f"page {expected}: EOS mid-stream"
        if expected < 2:
            continue
        assert page.packets, f"page {expected}: no audio packet"
        for packet in page.packets:
            assert len(packet) <= 4000, f"page {expected}: a packet of {len(packet)} bytes"
            assert not packet.startswith((b"OpusHead", b"OpusTags")), f"page {expected}: a header packet"
            assert packet_ms(packet) == packet_duration_ms, f"page {expected}: a {packet_ms(packet)} ms packet"
        granule += granule_step
        assert page.granule == granule, f"page {expected}: granule {page.granule}, expected {granule}"
    return len(pages) - 2
