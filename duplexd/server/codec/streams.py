"""Ogg/Opus streams of the Kyutai `/api/chat` protocol (24 kHz mono, one 1920-sample frame per 80 ms tick each way)
on libopus through ctypes, which releases the GIL while libopus runs, so codec threads scale over cores.

Downlink profiles (`OggOpusEncoder`):

* "fast" (default): libopus RESTRICTED_LOWDELAY (CELT only), complexity 0, 48 kb/s, the whole 80 ms frame as one
  packet on one page (granule +3840 a tick): about a twelfth of sphn's CPU, at nearly its quality. Every Kyutai
  client decodes it (sphn's reader, the browser's opus-recorder decoder).
* "kyutai": byte for byte what sphn's `OpusStreamWriter` sends (VOIP, default complexity and bitrate, two 40 ms
  packets a frame, each on its own page), for whoever compares bytes with the reference server.

Uplink (`OggOpusDecoder`) takes whatever Kyutai's clients send, as sphn's reader does (`ogg.PageReader`).

Without a loadable libopus both fall back to sphn (the server's behaviour before this package), logged once.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
from typing import Any

import numpy as np

from duplexd.server.codec import libopus
from duplexd.server.codec.errors import AudioError
from duplexd.server.codec.ogg import PageReader, PageWriter

__all__ = ["OPUS_PROFILES", "AudioError", "OggOpusDecoder", "OggOpusEncoder", "backend"]

log = logging.getLogger(__name__)

OPUS_PROFILES = ("fast", "kyutai")
SERIAL = 42  # sphn's serial; clients ignore it
OPUS_RATE = 48000  # granule positions and pre-skip count 48 kHz samples whatever the coded rate
SPHN_PRE_SKIP = 3840  # what sphn writes (80 ms at 48 kHz, more than VOIP's 6.5 ms lookahead)
VENDOR = b"KyutaiMoshi"  # sphn's OpusTags vendor string
FAST_BITRATE = 48000
FAST_COMPLEXITY = 0

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "lib" (the CDLL or None) once loaded, "warned" once the fast profile fell back


def library() -> ctypes.CDLL | None:
    """libopus, or None (sphn then): loaded once per process, the fallback logged once."""
    with _lock:
        if "lib" not in _state:
            lib = libopus.load()
            _state["lib"] = lib
            if lib is None:
                log.warning(
                    "libopus cannot be loaded (tried %s): Ogg/Opus runs in sphn, which holds the GIL and costs ~12x "
                    "the CPU; install libopus for the fast path (Debian/Ubuntu: apt-get install libopus0)",
                    ", ".join(libopus.LIBRARY_NAMES),
                )
        return _state["lib"]


def backend() -> str:
    """What codes the audio, for start-up logs and /health: "libopus 1.3.1 (ctypes)" or "sphn (libopus not
    found)"."""
    lib = library()
    return "sphn (libopus not found)" if lib is None else f"{libopus.version(lib)} (ctypes)"


def opus_head(pre_skip: int) -> bytes:
    """The identification header (RFC 7845 5.1): version 1, mono, pre-skip, input rate 48000 as sphn writes it,
    gain 0, mapping family 0."""
    return b"OpusHead" + struct.pack("<BBHIhB", 1, 1, pre_skip, OPUS_RATE, 0, 0)


def opus_tags() -> bytes:
    """The comment header: sphn's vendor string and no comments."""
    return b"OpusTags" + struct.pack("<I", len(VENDOR)) + VENDOR + struct.pack("<I", 0)


class OggOpusEncoder:
    """PCM frames → Ogg pages of one mono stream; the first call's bytes start with the two header pages, and
    every call returns whole pages (each may go out as its own WebSocket message)."""

    def __init__(self, profile: str = "fast", sample_rate: int = 24000) -> None:
        self._encoder: libopus.Encoder | None = None
        self._sphn: Any = None
        self.check_profile(profile)
        self.profile = profile
        lib = library()
        if lib is None:
            import sphn

            with _lock:
                if profile == "fast" and not _state.get("warned"):
                    _state["warned"] = True
                    log.warning("Opus profile 'fast' cannot apply without libopus: sphn's own encoding is sent")
            self._sphn = sphn.OpusStreamWriter(sample_rate)
            return
        if profile == "fast":
            encoder = libopus.Encoder(
                lib,
                sample_rate,
                libopus.OPUS_APPLICATION_RESTRICTED_LOWDELAY,
                complexity=FAST_COMPLEXITY,
                bitrate=FAST_BITRATE,
            )
            self._packet = sample_rate * 80 // 1000
            # Pre-skip is the encoder's real lookahead (2.5 ms, 120 at 48 kHz), as RFC 7845 asks: a player that
            # honours it trims only the codec's delay. sphn's 3840 would cut 80 ms of speech there; Kyutai's
            # clients (sphn's reader, opus-recorder) ignore pre-skip either way.
            pre_skip = encoder.lookahead() * OPUS_RATE // sample_rate
        else:
            encoder = libopus.Encoder(lib, sample_rate, libopus.OPUS_APPLICATION_VOIP)  # no ctl: sphn's defaults
            self._packet = sample_rate * 40 // 1000
            pre_skip = SPHN_PRE_SKIP
        self._encoder = encoder
        self._granule_step = self._packet * OPUS_RATE // sample_rate
        self._granule = 0
        self._pages = PageWriter(SERIAL)
        self._headers: bytes | None = self._pages.page([opus_head(pre_skip)], 0, bos=True) + self._pages.page(
            [opus_tags()], 0
        )

    @staticmethod
    def check_profile(profile: str) -> None:
        """ValueError for a profile name that is not one of `OPUS_PROFILES`."""
        if profile not in OPUS_PROFILES:
            raise ValueError(f"unknown Opus profile {profile!r}: one of {', '.join(OPUS_PROFILES)}")

    def encode(self, pcm: np.ndarray) -> bytes:
        """Whole Ogg pages for `pcm`, float32 mono, a whole number of packets (one 80 ms frame, 1920 samples at
        24 kHz, in the protocol)."""
        pcm = np.ascontiguousarray(pcm, dtype=np.float32).reshape(-1)
        if self._sphn is not None:
            return self._sphn.append_pcm(pcm)
        encoder = self._encoder
        if encoder is None:
            raise ValueError("encoder is closed")
        if not len(pcm) or len(pcm) % self._packet:
            raise ValueError(f"{len(pcm)} samples: the {self.profile!r} profile codes multiples of {self._packet}")
        out = []
        if self._headers is not None:
            out.append(self._headers)
            self._headers = None
        for at in range(0, len(pcm), self._packet):
            packet = encoder.encode(pcm[at : at + self._packet])
            self._granule += self._granule_step
            out.append(self._pages.page([packet], self._granule))
        return b"".join(out)

    def close(self) -> None:
        """Free libopus's state; idempotent."""
        encoder, self._encoder = self._encoder, None
        if encoder is not None:
            encoder.close()
        self._sphn = None

    def __del__(self) -> None:
        self.close()


class OggOpusDecoder:
    """Ogg/Opus bytes in arbitrary pieces → float32 PCM of every complete packet. An error is sticky, as in sphn:
    once the stream was not Ogg or a packet not Opus, every later call raises too."""

    def __init__(self, sample_rate: int = 24000) -> None:
        self._decoder: libopus.Decoder | None = None
        self._sphn: Any = None
        self._error: str | None = None
        lib = library()
        if lib is None:
            import sphn

            self._sphn = sphn.OpusStreamReader(sample_rate)
            return
        self._decoder = libopus.Decoder(lib, sample_rate)
        self._pages = PageReader()

    def decode(self, data: bytes) -> np.ndarray:
        """Float32 PCM of every packet that `data` completes (maybe empty); AudioError on malformed input."""
        if self._error is not None:
            raise AudioError(self._error)
        if self._sphn is not None:
            try:
                return self._sphn.append_bytes(data)
            except ValueError as e:
                self._error = f"malformed Ogg/Opus audio: {e}"
                raise AudioError(self._error) from None
        decoder = self._decoder
        if decoder is None:
            raise ValueError("decoder is closed")
        try:
            packets = self._pages.feed(data)
        except AudioError as e:
            self._error = str(e)
            raise
        # Header packets are skipped wherever they come, and never required (sphn does not require them). An empty
        # packet is skipped too: sphn conceals 5 s of audio for one, libopus 120 ms; no client sends them.
        audio = [p for p in packets if p and not p.startswith((b"OpusHead", b"OpusTags"))]
        if not audio:
            return np.zeros(0, np.float32)
        out = np.empty(len(audio) * decoder.max_samples, np.float32)
        base, at = out.ctypes.data, 0
        for packet in audio:
            n = decoder.decode_into(packet, base + 4 * at)
            if n < 0:
                self._error = f"malformed Opus packet ({len(packet)} bytes): {decoder.strerror(n)}"
                raise AudioError(self._error)
            at += n
        return out[:at].copy()

    def close(self) -> None:
        """Free libopus's state; idempotent."""
        decoder, self._decoder = self._decoder, None
        if decoder is not None:
            decoder.close()
        self._sphn = None

    def __del__(self) -> None:
        self.close()
