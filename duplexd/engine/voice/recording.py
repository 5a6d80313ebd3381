"""A recording read for voice cloning as moshi-server reads the body of `POST /api/voice`: any format libsndfile
decodes, its first channel, resampled to 24 kHz. Only the start that is used is decoded (the first 10 s and a
margin for the resampler's filter), so a long file costs no more than a short one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import BinaryIO

import numpy as np
import soundfile as sf
import soxr

from .maker import SAMPLE_RATE, SECONDS, VoiceRefused

MIN_RATE, MAX_RATE = 1_000, 384_000  # sample rates taken (as the server's uploads)
MARGIN_SECONDS = 0.1  # decoded past the 10 s, so the resampler's filter sees what follows the cut


def read_recording(source: str | Path | BinaryIO) -> np.ndarray:
    """The first channel of the recording's first `SECONDS` at 24 kHz (float32, shorter when the recording is);
    `VoiceRefused` saying why it cannot be read."""
    if isinstance(source, (str, Path)) and not Path(source).is_file():
        raise VoiceRefused("no such file")
    try:
        with sf.SoundFile(source) as snd:
            rate = int(snd.samplerate)
            if not MIN_RATE <= rate <= MAX_RATE:
                raise VoiceRefused(f"sample rate {rate} Hz: {MIN_RATE}-{MAX_RATE} Hz is supported")
            pcm = snd.read(math.ceil((SECONDS + MARGIN_SECONDS) * rate), dtype="float32", always_2d=True)[:, 0]
    except (RuntimeError, OSError) as e:  # libsndfile's errors, a missing file
        why = getattr(e, "error_string", None) or " ".join(str(e).split())
        raise VoiceRefused(f"cannot read the recording as audio: {why}") from None
    pcm = np.nan_to_num(pcm, nan=0.0, posinf=0.0, neginf=0.0)
    if rate != SAMPLE_RATE and len(pcm):
        pcm = soxr.resample(pcm, rate, SAMPLE_RATE).astype(np.float32)
    return pcm[: SAMPLE_RATE * SECONDS]
