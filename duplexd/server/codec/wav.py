"""Streamed 16-bit WAV: a header whose sizes are unknown (0xFFFFFFFF, as moshi-server writes it before the audio
is made) and samples as its writer has them (clamped, times 32767, truncated)."""

from __future__ import annotations

import struct

import numpy as np

UNKNOWN_SIZE = 0xFFFFFFFF


def wav_header(sample_rate: int) -> bytes:
    return (
        b"RIFF"
        + struct.pack("<I", UNKNOWN_SIZE)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", UNKNOWN_SIZE)
    )


def pcm16(pcm: np.ndarray) -> bytes:
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
