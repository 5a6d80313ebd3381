"""Real speech for tests: espeak-ng sentences (a Debian package, scripts/test.sh installs it) laid out with silences.

The utterance boundaries are known without labelled data: they are the synthesised clips' own trimmed lengths.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from duplexd.wire import SAMPLE_RATE

from .system_tools import needs

needs_espeak = needs("espeak-ng")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back tomorrow morning.",
    "Seven bright kites were flying above the river.",
]
TOLERANCE = 0.15  # s: Silero decides per 32 ms window, and its recurrent state lags the audio a little
NOISE = 0.003  # RMS of the background noise (about -50 dBFS)


def speak(text: str, tmp: Path) -> np.ndarray:
    """One sentence at 24 kHz, trimmed to where it is audible: its length is the known utterance."""
    path = tmp / "s.wav"
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
    pcm, rate = sf.read(path, dtype="float32")
    pcm = soxr.resample(pcm, rate, SAMPLE_RATE).astype(np.float32)
    loud = np.nonzero(np.abs(pcm) > 0.01)[0]
    return pcm[loud[0] : loud[-1] + 1]


def speak_all(tmp: Path) -> list[np.ndarray]:
    """Each of `SENTENCES`, spoken."""
    return [speak(text, tmp) for text in SENTENCES]


def compose(parts: list[np.ndarray | float], seed: int) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Clips and silences (floats, in seconds) end to end, plus noise; and the clips' (start_s, end_s)."""
    pieces, truth, at = [], [], 0
    for part in parts:
        if isinstance(part, float):
            piece = np.zeros(round(part * SAMPLE_RATE), np.float32)
        else:
            piece = part
            truth.append((at / SAMPLE_RATE, (at + len(piece)) / SAMPLE_RATE))
        pieces.append(piece)
        at += len(piece)
    pcm = np.concatenate(pieces)
    pcm += np.random.default_rng(seed).normal(0, NOISE, len(pcm)).astype(np.float32)
    return pcm, truth
