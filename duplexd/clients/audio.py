"""Audio files in and out, at the model's rate (24 kHz mono float32), and a synthetic talker.

The generated audio is "speech-like" (voiced syllables with a moving pitch, formant-ish harmonics, pauses) so a
load test exercises the codec and the model the way a talker does, without shipping a recording.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from duplexd.wire import SAMPLE_RATE


class InputError(ValueError):
    """The input audio cannot be used; the message says why."""


def read_audio(path: str | Path, sample_rate: int = SAMPLE_RATE, min_samples: int = 1) -> np.ndarray:
    """Mono float32 at `sample_rate` from any file soundfile reads (stereo is averaged, other rates resampled);
    `InputError` when it cannot be read or holds fewer than `min_samples` samples."""
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, OSError) as e:
        raise InputError(f"cannot read audio from {path}: {e}") from None
    if data.size == 0:
        raise InputError(f"{path} contains no audio")
    mono = data.mean(axis=1)
    if rate != sample_rate:
        mono = soxr.resample(mono, rate, sample_rate)
    if len(mono) < min_samples:
        raise InputError(
            f"{path} is too short: {len(mono) / sample_rate * 1000:.0f} ms, "
            f"at least {min_samples / sample_rate * 1000:.0f} ms (one frame) is needed"
        )
    return np.ascontiguousarray(mono, dtype=np.float32)


def write_wav(path: str | Path, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
    sf.write(str(path), np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0), sample_rate, subtype="PCM_16")


def speech_like(seconds: float, seed: int = 0, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Syllables of 120-300 ms with a gliding pitch (90-220 Hz), three resonances, and pauses between phrases."""
    rng = np.random.default_rng(seed)
    total = int(seconds * sample_rate)
    out = np.zeros(total, dtype=np.float32)
    pos = int(rng.uniform(0.05, 0.2) * sample_rate)
    while pos < total:
        phrase = int(rng.integers(3, 9))
        for _ in range(phrase):
            n = int(rng.uniform(0.12, 0.30) * sample_rate)
            if pos + n > total:
                n = total - pos
            if n <= 0:
                break
            t = np.arange(n) / sample_rate
            f0 = rng.uniform(90, 220) * (1 + rng.uniform(-0.15, 0.15) * t / max(t[-1], 1e-3))
            phase = 2 * np.pi * np.cumsum(f0) / sample_rate
            formants = rng.uniform([300, 900, 2200], [800, 1800, 3000])
            voice = sum(np.sin(k * phase) / k * _resonance(k * f0, formants) for k in range(1, 25))
            envelope = np.sin(np.pi * np.arange(n) / n) ** 0.6
            out[pos : pos + n] = 0.8 * envelope * voice / 3
            pos += n + int(rng.uniform(0.01, 0.06) * sample_rate)
        pos += int(rng.uniform(0.25, 0.7) * sample_rate)
    noise = rng.normal(0, 0.002, total).astype(np.float32)
    return np.clip(out + noise, -1, 1).astype(np.float32)


def _resonance(freq: np.ndarray, formants: np.ndarray) -> np.ndarray:
    return sum(1.0 / (1.0 + ((freq - f) / 120.0) ** 2) for f in formants)


def level_db(pcm: np.ndarray) -> float:
    """RMS level in dBFS (-120 for silence), used to tell voiced frames from silent ones."""
    rms = float(np.sqrt(np.mean(np.square(pcm, dtype=np.float64)))) if len(pcm) else 0.0
    return float(20 * np.log10(max(rms, 1e-6)))
