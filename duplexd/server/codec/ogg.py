"""Ogg pages (RFC 3533): a page writer for our own streams and a lenient page reader for what clients send.

The reader accepts what sphn's reader accepts, because Kyutai's clients were written against it: pages split
across or joined within messages, packets continued across pages, no header pages at all, any serial and any
sequence. A wrong CRC is logged and the page used anyway; bytes that are not an Ogg page where one must start are
an `AudioError`, which ends the connection (sphn's reader raises there too and stays broken after).
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import Sequence
from functools import lru_cache

from duplexd.server.codec.errors import AudioError

log = logging.getLogger(__name__)

CAPTURE = b"OggS"
FLAG_CONTINUED, FLAG_BOS, FLAG_EOS = 0x01, 0x02, 0x04
# capture pattern, version, header type, granule position, serial, sequence number, CRC, segment count
HEADER = struct.Struct("<4sBBQIIIB")
CRC_AT = 22  # byte offset of the CRC field in a page
MAX_SEGMENTS = 255
# No Opus packet comes near this (120 ms of 1275-byte frames is under 8 KB): a longer one is an endless
# continuation, refused before it fills memory.
MAX_PACKET = 1 << 18

# Ogg's CRC is CRC-32 with polynomial 0x04c11db7, MSB first, initial value 0 and no final xor. zlib's crc32 is the
# same polynomial LSB first with init and final xor 0xffffffff, so on bit-reversed bytes it gives the bit-reversed
# Ogg CRC once the effect of its initial value (the zlib CRC of as many zero bytes) is xored away. A byte-at-a-time
# table loop in Python costs ~60 us a page, as much as encoding the page at complexity 0; this costs ~2 us.
_BIT_REVERSED = bytes(int(f"{i:08b}"[::-1], 2) for i in range(256))


@lru_cache(maxsize=1024)
def _zlib_crc_of_zeros(length: int) -> int:
    return zlib.crc32(bytes(length))


def crc(data: bytes | bytearray | memoryview) -> int:
    """The Ogg CRC-32 of `data` (a page with its CRC field zeroed)."""
    reflected = zlib.crc32(bytes(data).translate(_BIT_REVERSED)) ^ _zlib_crc_of_zeros(len(data))
    return int.from_bytes(reflected.to_bytes(4, "little").translate(_BIT_REVERSED), "big")


def lacing(packets: Sequence[bytes]) -> bytes:
    """The segment table of a page that ends every one of `packets` (a multiple of 255 ends with a 0)."""
    return b"".join(b"\xff" * (len(p) // 255) + bytes((len(p) % 255,)) for p in packets)


class PageWriter:
    """Whole pages of one logical stream, sequence numbers from 0; every packet given ends on its page."""

    def __init__(self, serial: int) -> None:
        self.serial = serial
        self.sequence = 0

    def page(self, packets: Sequence[bytes], granule: int, *, bos: bool = False) -> bytes:
        segments = lacing(packets)
        if len(segments) > MAX_SEGMENTS:
            raise ValueError(f"{len(segments)} segments do not fit one Ogg page")
        head = HEADER.pack(CAPTURE, 0, FLAG_BOS if bos else 0, granule, self.serial, self.sequence, 0, len(segments))
        page = bytearray(head + segments)
        for packet in packets:
            page += packet
        struct.pack_into("<I", page, CRC_AT, crc(page))
        self.sequence += 1
        return bytes(page)


class PageReader:
    """Packets out of a byte stream of Ogg pages fed in arbitrary pieces."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._partial: bytearray | None = None  # a packet continued onto the next page
        self.crc_errors = 0

    def feed(self, data: bytes) -> list[bytes]:
        """Every packet completed by `data`; AudioError when the bytes are not Ogg."""
        buffer = self._buffer
        buffer += data
        packets: list[bytes] = []
        at = 0
        try:
            while True:
                available = len(buffer) - at
                if buffer[at : at + min(available, 4)] != CAPTURE[: min(available, 4)]:
                    raise AudioError(f"not an Ogg page: {bytes(buffer[at : at + 8])!r}... where a page must start")
                if available < HEADER.size:
                    break
                header_len = HEADER.size + buffer[at + HEADER.size - 1]
                if available < header_len:
                    break
                segments = buffer[at + HEADER.size : at + header_len]
                page_len = header_len + sum(segments)
                if available < page_len:
                    break
                self._page(bytes(buffer[at : at + page_len]), header_len, segments, packets)
                at += page_len
        finally:
            del buffer[:at]
        return packets

    def _page(self, page: bytes, header_len: int, segments: bytearray, packets: list[bytes]) -> None:
        _, version, flags, _, serial, sequence, stored, _ = HEADER.unpack_from(page)
        if version != 0:
            raise AudioError(f"Ogg page of stream version {version} (only version 0 exists)")
        if crc(page[:CRC_AT] + b"\0\0\0\0" + page[CRC_AT + 4 :]) != stored:
            self.crc_errors += 1
            # the first one says so; after that one line per 100, so a client with a broken muxer cannot flood
            if self.crc_errors % 100 == 1:
                log.warning(
                    "Ogg page %d of stream %08x: CRC mismatch (%d so far), decoded anyway",
                    sequence,
                    serial,
                    self.crc_errors,
                )
        body = page[header_len:]
        start = 0
        partial = self._partial
        if partial is not None and not flags & FLAG_CONTINUED:
            log.debug("Ogg page %d: a packet left unfinished by the page before is dropped", sequence)
            partial = None
        skip = partial is None and bool(flags & FLAG_CONTINUED)  # the rest of a packet whose start we never saw
        for value in segments:
            if partial is None:
                partial = bytearray()
            partial += body[start : start + value]
            start += value
            if len(partial) > MAX_PACKET:
                raise AudioError(f"an Ogg packet over {MAX_PACKET} bytes (page {sequence})")
            if value < 255:
                if not skip:
                    packets.append(bytes(partial))
                partial, skip = None, False
        self._partial = None if skip else partial
