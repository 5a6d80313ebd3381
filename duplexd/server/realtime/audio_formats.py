"""A Realtime session's audio formats: the model's own pcm16 at 24 kHz, or G.711 telephone audio at 8 kHz
(`audio/pcmu`, `audio/pcma`; beta `g711_ulaw`, `g711_alaw`), resampled to and from the model's rate.

Each direction of a session keeps one streaming soxr resampler, so audio split into events of any length
resamples as one continuous signal (no edge effects at event boundaries).
"""

from __future__ import annotations

from typing import Any, Literal, cast

import numpy as np
import soxr

from duplexd import wire
from duplexd.server.codec import g711
from duplexd.server.connection.closing import Close, CloseCode

Format = Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
PCM: Format = "audio/pcm"
BETA_NAMES: dict[str, Format] = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
BETA_NAME: dict[Format, str] = {fmt: beta for beta, fmt in BETA_NAMES.items()}
RATE = wire.SAMPLE_RATE


def format_object(fmt: Format) -> dict[str, Any]:
    """A format as the session object shows it (GA)."""
    return {"type": fmt, "rate": RATE if fmt == PCM else g711.RATE}


def _law(fmt: Format) -> g711.Law:
    return cast(g711.Law, fmt.removeprefix("audio/"))


class InputAudio:
    """Client bytes in `fmt` → float32 samples at the model's rate."""

    def __init__(self, fmt: Format = PCM) -> None:
        self.format = fmt
        self._resampler = None if fmt == PCM else soxr.ResampleStream(g711.RATE, RATE, 1, dtype="float32")

    def to(self, fmt: Format | None) -> InputAudio:
        """This decoder, or a new one when an update asks for another format (its resampler starts afresh)."""
        return self if fmt is None or fmt == self.format else InputAudio(fmt)

    def decode(self, raw: bytes) -> np.ndarray:
        """`Close` (1007) for pcm16 of an odd byte count."""
        if self._resampler is None:
            if len(raw) % 2:
                raise Close(CloseCode.INVALID_PAYLOAD, "invalid_audio", "pcm16 audio must have an even number of bytes")
            return wire.pcm_from_pcm16(raw)
        samples = g711.decode(_law(self.format), raw)
        pcm = self._resampler.resample_chunk(np.multiply(samples, 1.0 / 32768.0, dtype=np.float32))
        # on the pcm16 grid, as every client's audio: a call sounds to the model as the same audio sent as pcm16
        np.rint(np.multiply(pcm, 32768.0, out=pcm), out=pcm)
        np.clip(pcm, -32768.0, 32767.0, out=pcm)
        return np.multiply(pcm, 1.0 / 32768.0, out=pcm)


class OutputAudio:
    """Float32 samples at the model's rate → base64 of the client's `fmt`."""

    def __init__(self, fmt: Format = PCM) -> None:
        self.format = fmt
        self._resampler = None if fmt == PCM else soxr.ResampleStream(RATE, g711.RATE, 1, dtype="float32")

    def to(self, fmt: Format | None) -> OutputAudio:
        """This encoder, or a new one when an update asks for another format."""
        return self if fmt is None or fmt == self.format else OutputAudio(fmt)

    def base64(self, pcm: np.ndarray) -> str:
        if self._resampler is None:
            return wire.pcm16_base64(pcm)
        telephone = self._resampler.resample_chunk(np.clip(pcm, -1.0, 1.0))  # clipped as pcm16 clips it
        return wire.base64_text(g711.encode(_law(self.format), wire.pcm16(telephone)))
