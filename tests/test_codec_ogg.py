"""The Ogg layer of duplexd.server.codec: CRC, page writing, the lenient page reader, and both downlink profiles
through a strict Ogg/Opus validator (which is shown to fail on a bad CRC, so its passes mean something)."""

from __future__ import annotations

import logging
import random
import struct

import pytest

from duplexd.server.codec import ogg, streams
from duplexd.server.codec.errors import AudioError

from .opus_fixtures import frames, needs_libopus, reference_crc, speech_pcm, split_pages, validate
from .speech import needs_espeak


def raw_page(lacing: list[int], body: bytes, *, flags: int = 0, sequence: int = 0, granule: int = 0) -> bytes:
    """A page laid out by hand (any lacing, any flags), with a valid CRC from the reference implementation."""
    page = bytearray(struct.pack("<4sBBqIIIB", b"OggS", 0, flags, granule, 7, sequence, 0, len(lacing)))
    page += bytes(lacing) + body
    struct.pack_into("<I", page, 22, reference_crc(bytes(page)))
    return bytes(page)


def test_crc_matches_its_definition():
    rng = random.Random(0)
    for length in (0, 1, 3, 27, 255, 256, 1000, 4027, 65307):
        data = rng.randbytes(length)
        assert ogg.crc(data) == reference_crc(data), length
    assert ogg.crc(bytearray(b"\x00" * 10)) == 0  # init 0, no final xor: zeros stay zero


def test_page_writer_laces_packets_and_numbers_pages():
    writer = ogg.PageWriter(serial=42)
    packets = [b"", b"a" * 254, b"b" * 255, b"c" * 510, b"d" * 600]
    page = writer.page(packets, 1234, bos=True)
    capture, version, flags, granule, serial, sequence, stored, nseg = struct.unpack_from("<4sBBqIIIB", page)
    assert (capture, version, flags, granule, serial, sequence) == (b"OggS", 0, 2, 1234, 42, 0)
    assert list(page[27 : 27 + nseg]) == [0, 254, 255, 0, 255, 255, 0, 255, 255, 90]
    zeroed = page[:22] + bytes(4) + page[26:]
    assert stored == reference_crc(zeroed)
    assert ogg.PageReader().feed(page) == packets
    assert struct.unpack_from("<I", writer.page([b"x"], 0), 18)[0] == 1  # sequence numbers go up
    with pytest.raises(ValueError, match="segments"):
        writer.page([b"x" * 255 * 255], 0)


def test_reader_takes_pages_split_across_and_joined_within_messages():
    writer = ogg.PageWriter(serial=1)
    rng = random.Random(1)
    packets = [rng.randbytes(rng.randrange(1, 700)) for _ in range(40)]
    data = b"".join(writer.page(packets[i : i + 2], i) for i in range(0, 40, 2))
    assert ogg.PageReader().feed(data) == packets
    reader = ogg.PageReader()
    assert [p for i in range(len(data)) for p in reader.feed(data[i : i + 1])] == packets  # byte by byte
    cuts = sorted(rng.sample(range(1, len(data)), 30))
    reader = ogg.PageReader()
    got = [p for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True) for p in reader.feed(data[a:b])]
    assert got == packets


def test_reader_joins_a_packet_continued_across_pages_and_drops_a_headless_fragment():
    big = bytes(range(256)) * 3  # 768 bytes: 255, 255 on the first page, 255, 3 on the second
    first = raw_page([255, 255], big[:510], sequence=0, granule=-1)
    second = raw_page([255, 3, 5], big[510:] + b"after", flags=ogg.FLAG_CONTINUED, sequence=1)
    assert ogg.PageReader().feed(first + second) == [big, b"after"]
    reader = ogg.PageReader()
    assert reader.feed(first) == []
    assert reader.feed(second) == [big, b"after"]
    # a stream that starts mid-packet: the fragment whose start never came is dropped, the rest decodes
    assert ogg.PageReader().feed(second) == [b"after"]
    # an unfinished packet followed by a page that does not continue it is dropped
    fresh = raw_page([4], b"next", sequence=2)
    assert ogg.PageReader().feed(first + fresh) == [b"next"]


def test_reader_logs_a_crc_mismatch_and_uses_the_page(caplog):
    page = bytearray(raw_page([5], b"hello", sequence=3))
    page[22] ^= 0xFF
    reader = ogg.PageReader()
    with caplog.at_level(logging.WARNING, logger="duplexd.server.codec.ogg"):
        assert reader.feed(bytes(page)) == [b"hello"]
        assert reader.feed(bytes(page)) == [b"hello"]
    assert reader.crc_errors == 2
    assert len([r for r in caplog.records if "CRC mismatch" in r.getMessage()]) == 1  # once, not per page


def test_reader_refuses_what_is_not_ogg():
    with pytest.raises(AudioError, match="not an Ogg page"):
        ogg.PageReader().feed(b"hello, this is not Ogg at all")
    with pytest.raises(AudioError, match="not an Ogg page"):
        ogg.PageReader().feed(b"Ogx")  # known to be wrong before a whole header arrives
    reader = ogg.PageReader()
    assert reader.feed(b"Og") == []  # could still be a page: wait
    assert reader.feed(raw_page([2], b"ok")[2:]) == [b"ok"]
    good = raw_page([2], b"ok")
    with pytest.raises(AudioError, match="not an Ogg page"):
        ogg.PageReader().feed(good + b"\x00" * 40)  # garbage where the next page must start
    endless = ogg.PageReader()
    with pytest.raises(AudioError, match="packet over"):
        for sequence in range(ogg.MAX_PACKET // (255 * 255) + 2):  # pages of 255 x 255 bytes, never ending a packet
            endless.feed(raw_page([255] * 255, bytes(255 * 255), flags=ogg.FLAG_CONTINUED * (sequence > 0)))
    version_1 = bytearray(good)
    version_1[4] = 1
    with pytest.raises(AudioError, match="version 1"):
        ogg.PageReader().feed(bytes(version_1))


# ------------------------------------------------------------------------------------------- the strict validator

PROFILES = {  # granule step a page, packet duration, OpusHead pre-skip
    "fast": (3840, 80, 120),
    "kyutai": (1920, 40, 3840),
}


def encoded(profile: str) -> list[bytes]:
    encoder = streams.OggOpusEncoder(profile)
    try:
        return [encoder.encode(f) for f in frames(speech_pcm())]
    finally:
        encoder.close()


@needs_libopus
@needs_espeak
@pytest.mark.parametrize("profile", streams.OPUS_PROFILES)
def test_each_profile_is_a_strict_ogg_opus_stream(profile):
    messages = encoded(profile)
    step, ms, pre_skip = PROFILES[profile]
    assert validate(messages, step, ms, pre_skip) == len(messages) * (1 if profile == "fast" else 2)
    for index, message in enumerate(messages):  # every tick is whole pages of its own
        audio_pages = 1 if profile == "fast" else 2
        assert len(split_pages(message)) == audio_pages + (2 if index == 0 else 0)


@needs_libopus
@needs_espeak
def test_the_validator_fails_on_what_is_wrong():
    messages = encoded("fast")
    step, ms, pre_skip = PROFILES["fast"]
    bad_crc = list(messages)
    corrupt = bytearray(bad_crc[3])
    corrupt[22] ^= 0x01
    bad_crc[3] = bytes(corrupt)
    with pytest.raises(AssertionError, match="CRC mismatch"):
        validate(bad_crc, step, ms, pre_skip)
    joined = b"".join(messages)
    with pytest.raises(AssertionError, match="split across messages"):
        validate([joined[:100], joined[100:]], step, ms, pre_skip)
    with pytest.raises(AssertionError, match="granule"):
        validate(messages, 1920, ms, pre_skip)
    with pytest.raises(AssertionError, match="ms packet"):
        validate(messages, step, 40, pre_skip)
    with pytest.raises(AssertionError, match="sequence number"):
        validate(messages[:3] + messages[4:], step, ms, pre_skip)
    with pytest.raises(AssertionError, match="OpusHead"):
        validate(messages, step, ms, 3840)


@needs_espeak
def test_the_validator_accepts_the_reference_servers_stream():
    from .opus_fixtures import sphn_stream

    messages = sphn_stream(speech_pcm())
    assert validate(messages, 1920, 40, 3840) == 2 * len(messages)


def test_granule_positions_are_in_48_khz_units():
    assert streams.OPUS_RATE == 48000
    head = streams.opus_head(120)
    assert head.hex() == "4f707573486561640101" + "7800" + "80bb0000" + "0000" + "00"
    assert streams.opus_head(3840).hex() == "4f707573486561640101000f80bb0000000000"  # sphn's, byte for byte
