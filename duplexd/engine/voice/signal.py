"""The signal work of voice cloning around the denoiser: the band split and its resampling, and the loudness.

Band split (moshi-server's `voice.py`): the 24 kHz recording's band below 8 kHz (a windowed-sinc low-pass at 8/24 of
the rate, julius's `LowPassFilter`) is what the 16 kHz denoiser hears, resampled 24k → 16k and back by julius's
`ResampleFrac`; the band above it (the recording less its low band) is added back untouched.

Loudness: ITU-R BS.1770-4 as torchaudio's `Loudness` measures it (torchaudio 2.9, `functional.loudness`): the
K-weighting as two biquads designed by the Audio EQ Cookbook's formulas (a +4 dB shelf at 1500 Hz, Q 1/√2, then a
38 Hz high-pass, Q 0.5), each output clamped to ±1 as torchaudio's `lfilter` clamps it; mean squares over 400 ms
blocks every 100 ms, an absolute gate at -70 LUFS and a relative one 10 LU under the gated mean. `normalize_loudness`
is `voice.py`'s: mean removed, left as it is below an RMS of 2e-3 or when shorter than one block, else scaled to
-18 LUFS.
"""

from __future__ import annotations

import math

import julius
import numpy as np
import torch
from torch import nn

GATE_SECONDS = 0.4  # a block
GATE_STEP = 0.25  # blocks start every quarter block (75 % overlap)
ABSOLUTE_GATE = -70.0  # LUFS
RELATIVE_GATE = -10.0  # LU under the mean of the blocks past the absolute gate
K_BIAS = -0.691  # dB: the K-weighting's gain at 1 kHz taken back

TARGET_LOUDNESS = -18.0  # LUFS (voice.py's 18 dB of headroom)
ENERGY_FLOOR = 2e-3  # RMS under which voice.py does not rescale


class LoudnessError(ValueError):
    """A signal whose loudness cannot be measured: no block passes the gates."""


class BandSplit(nn.Module):
    """24 kHz audio → its band under 8 kHz at 16 kHz and its band above at 24 kHz; and back."""

    def __init__(self, rate: int = 24_000, low_rate: int = 16_000) -> None:
        super().__init__()
        self.rate, self.low_rate = rate, low_rate
        self.lowpass = julius.lowpass.LowPassFilter(low_rate / 2 / rate)
        self.down = julius.resample.ResampleFrac(rate // 1000, low_rate // 1000)
        self.up = julius.resample.ResampleFrac(low_rate // 1000, rate // 1000)

    def split(self, wav: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, 1, T] at `rate` → (low band [B, 1, ~T * 2/3] at `low_rate`, high band [B, 1, T] at `rate`)."""
        low = self.lowpass(wav)
        return self.down(low, full=True), wav - low

    def join(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """The low band at `low_rate` back at `rate`, as long as `high`, plus `high`."""
        return self.up(low, output_length=high.shape[-1]) + high


def _treble_shelf(rate: int, gain_db: float = 4.0, freq: float = 1500.0, q: float = 1 / math.sqrt(2)):
    w0 = 2 * math.pi * freq / rate
    alpha = math.sin(w0) / 2 / q
    a = 10 ** (gain_db / 40)
    root, cos = 2 * math.sqrt(a) * alpha, math.cos(w0)
    b = [a * ((a + 1) + (a - 1) * cos + root), -2 * a * ((a - 1) + (a + 1) * cos), a * ((a + 1) + (a - 1) * cos - root)]
    den = [(a + 1) - (a - 1) * cos + root, 2 * ((a - 1) - (a + 1) * cos), (a + 1) - (a - 1) * cos - root]
    return np.array(b), np.array(den)


def _high_pass(rate: int, freq: float = 38.0, q: float = 0.5):
    w0 = 2 * math.pi * freq / rate
    alpha, cos = math.sin(w0) / 2 / q, math.cos(w0)
    return np.array([(1 + cos) / 2, -1 - cos, (1 + cos) / 2]), np.array([1 + alpha, -2 * cos, 1 - alpha])


def k_weighted(wav: np.ndarray, rate: int) -> np.ndarray:
    """The K-weighted signal (float64), each biquad's output clamped to ±1 as torchaudio's `lfilter` clamps it."""
    from scipy.signal import lfilter  # ~1.5 s to import: paid by the first voice made, not by each importer

    x = np.asarray(wav, dtype=np.float64)
    for b, a in (_treble_shelf(rate), _high_pass(rate)):
        x = np.clip(lfilter(b / a[0], a / a[0], x), -1.0, 1.0)
    return x


def block_count(samples: int, rate: int) -> int:
    """The 400 ms blocks in `samples` (0 when shorter than one)."""
    gate = round(GATE_SECONDS * rate)
    step = round(gate * GATE_STEP)
    return 0 if samples < gate else (samples - gate) // step + 1


def loudness(wav: np.ndarray, rate: int) -> float:
    """The integrated loudness in LUFS of mono `wav` (at least one 400 ms block long); NaN when no block passes the
    gates, -inf for digital silence past them (as torchaudio)."""
    gate = round(GATE_SECONDS * rate)
    step = round(gate * GATE_STEP)
    blocks = block_count(len(wav), rate)
    if not blocks:
        raise ValueError(f"{len(wav)} samples: shorter than one {GATE_SECONDS * 1000:g} ms block")
    power = np.concatenate([[0.0], np.cumsum(np.square(k_weighted(wav, rate)))])
    starts = np.arange(blocks) * step
    energy = (power[starts + gate] - power[starts]) / gate
    with np.errstate(divide="ignore", invalid="ignore"):
        block_loudness = K_BIAS + 10 * np.log10(energy)
        gated = block_loudness > ABSOLUTE_GATE
        relative = K_BIAS + 10 * np.log10(energy[gated].mean() if gated.any() else np.nan) + RELATIVE_GATE
        gated &= block_loudness > relative
        return float(K_BIAS + 10 * np.log10(energy[gated].mean() if gated.any() else np.nan))


def normalize_loudness(wav: torch.Tensor, rate: int, target: float = TARGET_LOUDNESS) -> torch.Tensor:
    """`wav` [1, 1, T] less its mean, scaled to `target` LUFS; unscaled when its RMS is under `ENERGY_FLOOR` or it
    is shorter than a block. `LoudnessError` when no block of it passes the gates."""
    wav = wav - wav.mean(dim=-1, keepdim=True)
    if wav.std() < ENERGY_FLOOR or not block_count(wav.shape[-1], rate):
        return wav
    measured = loudness(wav.reshape(-1).double().cpu().numpy(), rate)
    if not math.isfinite(measured):
        raise LoudnessError(f"no {GATE_SECONDS * 1000:g} ms block is louder than {ABSOLUTE_GATE:g} LUFS")
    return wav * 10 ** ((target - measured) / 20)
