"""Ogg/Opus at 24 kHz through sphn, one encoder and one decoder per connection and direction.

Decoding errors are sticky in sphn (a reader that saw garbage stays broken), so they surface as `AudioError`
and end the connection rather than being skipped.
"""

from __future__ import annotations

import numpy as np
import sphn


class AudioError(ValueError):
    """Incoming audio that cannot be decoded."""


class OpusDecoder:
    def __init__(self, sample_rate: int) -> None:
        self._reader = sphn.OpusStreamReader(sample_rate)

    def decode(self, ogg: bytes) -> np.ndarray:
        """Float32 PCM of every complete Ogg page so far (empty until a page is complete)."""
        try:
            return self._reader.append_bytes(ogg)
        except ValueError as e:
            raise AudioError(f"malformed Ogg/Opus audio: {e}") from None


class OpusEncoder:
    def __init__(self, sample_rate: int) -> None:
        self._writer = sphn.OpusStreamWriter(sample_rate)

    def encode(self, pcm: np.ndarray) -> bytes:
        """Ogg pages for `pcm`; the first call's pages also carry the stream headers, so none may be dropped."""
        return self._writer.append_pcm(np.ascontiguousarray(pcm, dtype=np.float32))
