"""Log-mel front end of the Gemma 4 audio tower (16 kHz, 128 bins), batched and streaming.

Matches `transformers`' `Gemma4AudioFeatureExtractor` (the parity target) but runs in torch, so it can sit on the
same device as the encoder and keep per-stream state between calls:

* frames of 320 samples (20 ms, periodic Hann) every 160 samples, semicausal: 160 zeros are prepended, so mel
  frame ``i`` covers samples ``[160 i - 160, 160 i + 159]``;
* ``|rfft(frame, n=512)|`` (magnitude, not power) times an HTK mel matrix (0-8 kHz, no norm), then
  ``log(mel + 1e-3)``.

Streaming needs only the last 160 samples of the previous chunk, so a chunk of ``n`` samples (a multiple of
160) yields exactly ``n / 160`` frames, identical to the whole-file frames.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class LogMelConfig:
    """Feature-extractor constants; defaults are those of Gemma 4 E2B/E4B."""

    sampling_rate: int = 16_000
    num_mel_bins: int = 128
    frame_length: int = 320
    hop_length: int = 160
    fft_length: int = 512
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    mel_floor: float = 1e-3
    pad_to_multiple_of: int = 128
    max_length: int | None = 480_000  # the reference truncates files to 30 s by default


def htk_mel_filters(cfg: LogMelConfig) -> np.ndarray:
    """Triangular HTK mel filters, float64, shape [fft_length // 2 + 1, num_mel_bins] (no area norm)."""
    n_freq = cfg.fft_length // 2 + 1

    def to_mel(f: np.ndarray | float) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + np.asarray(f, dtype=np.float64) / 700.0)

    mels = np.linspace(to_mel(cfg.min_frequency), to_mel(cfg.max_frequency), cfg.num_mel_bins + 2)
    edges = 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    fft_freqs = np.linspace(0, cfg.sampling_rate // 2, n_freq)
    widths = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    return np.maximum(0.0, np.minimum(down, up))


class LogMel(nn.Module):
    """Torch log-mel front end. `forward` does whole files; `stream` continues a stream from its sample tail."""

    window: torch.Tensor
    mel_filters: torch.Tensor

    def __init__(self, cfg: LogMelConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or LogMelConfig()
        n = self.cfg.frame_length
        # Periodic Hann in float32, as the reference builds it.
        hann = 0.5 - 0.5 * np.cos(2.0 * math.pi * np.arange(n) / n)
        self.window = nn.Buffer(torch.from_numpy(hann.astype(np.float32)), persistent=False)
        # The reference multiplies the float32 magnitude by a float64 matrix; fp64 here keeps that rounding.
        self.mel_filters = nn.Buffer(torch.from_numpy(htk_mel_filters(self.cfg)), persistent=False)

    @property
    def tail_length(self) -> int:
        """Samples a stream must carry between chunks (the left half of a window)."""
        return self.cfg.frame_length - self.cfg.hop_length

    def frames_to_mel(self, signal: torch.Tensor, num_frames: int) -> torch.Tensor:
        """Log-mel of `num_frames` frames of `signal` [B, N] starting at sample 0, float32 [B, T, bins]."""
        cfg = self.cfg
        frames = signal.float().unfold(-1, cfg.frame_length, cfg.hop_length)[:, :num_frames]
        spec = torch.fft.rfft(frames * self.window, n=cfg.fft_length).abs()
        mel = spec.to(self.mel_filters.dtype) @ self.mel_filters
        return torch.log(mel + cfg.mel_floor).float()

    def forward(
        self, waves: torch.Tensor | Sequence[torch.Tensor], lengths: torch.Tensor | Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole-file features like the reference (padding, truncation and frame mask included).

        `waves` is a list of 1-D tensors or a right-padded [B, N] tensor with `lengths`. Returns
        `features` [B, T, bins] (invalid frames zeroed) and `mask` [B, T] (True = valid frame).
        """
        cfg = self.cfg
        if isinstance(waves, torch.Tensor):
            if waves.dim() == 1:
                waves = waves[None]
            batch = waves
            if lengths is None:
                lengths = [batch.shape[-1]] * batch.shape[0]
            lens = torch.as_tensor(lengths, dtype=torch.long, device=batch.device)
        else:
            lens = torch.tensor([int(w.shape[-1]) for w in waves], dtype=torch.long)
            batch = torch.zeros(len(waves), int(lens.max()), dtype=waves[0].dtype, device=waves[0].device)
            for i, w in enumerate(waves):
                batch[i, : w.shape[-1]] = w
            lens = lens.to(batch.device)
        n = int(lens.max())
        if cfg.max_length is not None and n > cfg.max_length:
            n = cfg.max_length
            lens = lens.clamp(max=n)
        if cfg.pad_to_multiple_of:
            n = -(-n // cfg.pad_to_multiple_of) * cfg.pad_to_multiple_of
        batch = batch[:, :n]
        batch = torch.nn.functional.pad(batch, (self.tail_length, n - batch.shape[-1]))
        # The reference unfolds 321-sample windows (and drops the last sample), hence the `+ 1`.
        num_frames = max((batch.shape[-1] - cfg.frame_length - 1) // cfg.hop_length + 1, 0)
        feats = self.frames_to_mel(batch, num_frames)
        # A frame is valid iff the sample just after its window (index 160 i + 160) is real audio.
        last = torch.arange(num_frames, device=batch.device) * cfg.hop_length + cfg.hop_length
        mask = last[None, :] < lens[:, None]
        return feats * mask[..., None], mask

    def stream(self, tail: torch.Tensor, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Frames of `chunk` [B, n] (n a multiple of the hop) given each stream's `tail` [B, 160].

        Returns `(mel [B, n / hop, bins], new_tail)`. A new stream starts with a zero tail.
        """
        hop = self.cfg.hop_length
        if chunk.shape[-1] % hop:
            raise ValueError(f"chunk length {chunk.shape[-1]} is not a multiple of {hop} samples")
        signal = torch.cat([tail.to(chunk.dtype), chunk], dim=-1)
        mel = self.frames_to_mel(signal, chunk.shape[-1] // hop)
        return mel, signal[:, -self.tail_length :]
