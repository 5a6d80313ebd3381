"""Kyutai TTS conditioning: the voice a session cross-attends to and the vector summed into its every step.

Both are computed once when a session starts, in fp32 as the reference keeps its conditioners:
- the cross source: up to `max_speakers` voice embeddings ([speaker_dim, frames] each, as `kyutai/tts-voices`
  stores them under `speaker_wavs`) side by side, projected to the model's width, the empty speaker places
  filled with a learnt padding row, plus a sinusoidal position embedding (`fuser.cross_attention_pos_emb`);
- the sum vector: each lookup table's row for its value (`cfg`: the distilled model's CFG coefficient; `control`:
  "ok"), projected and summed in the config's order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .config import TTSConfig


def sin_embedding(length: int, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """[length, dim] fp32: cos then sin of position / max_period ** (i / (dim / 2 - 1)), i < dim / 2."""
    half = dim // 2
    positions = torch.arange(length, dtype=torch.float32)[:, None]
    scale = torch.full([], max_period, dtype=torch.float32) ** (torch.arange(half, dtype=torch.float32) / (half - 1))
    phase = positions / scale
    return torch.cat([torch.cos(phase), torch.sin(phase)], dim=-1)


class Conditioner(nn.Module):
    """The conditioners' weights ([in, out] projections, fp32) and the two per-session computations."""

    def __init__(self, cfg: TTSConfig, dim: int) -> None:
        super().__init__()
        self.cfg, self.dim = cfg, dim

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape), requires_grad=False)

        self.speaker_proj = param(cfg.speaker_dim, dim)
        self.speaker_padding = param(dim)
        self.tables = nn.ParameterDict({name: param(t.n_bins + 1, t.dim) for name, t in cfg.tables.items()})
        self.table_proj = nn.ParameterDict({name: param(t.dim, dim) for name, t in cfg.tables.items()})
        self.table_padding = nn.ParameterDict({name: param(dim) for name in cfg.tables})

    @torch.no_grad()
    def sum_vector(self, values: dict[str, str | None]) -> torch.Tensor:
        """[dim] fp32: the summed rows of the tables for `values` (a missing name takes its padding row)."""
        out = torch.zeros(self.dim)
        for k, name in enumerate(self.cfg.sum):
            value = values.get(name)
            if value is None:
                row = self.table_padding[name]
            else:
                row = self.tables[name][self.cfg.tables[name].index(value)] @ self.table_proj[name]
            out = row.clone() if k == 0 else out + row
        return out

    @torch.no_grad()
    def cross_source(self, voices: Sequence[torch.Tensor]) -> torch.Tensor:
        """[max_speakers * frames, dim] fp32 from voice embeddings [speaker_dim, frames] (1 to max_speakers)."""
        cfg = self.cfg
        if not 1 <= len(voices) <= cfg.max_speakers:
            raise ValueError(f"{len(voices)} voices: a TTS session takes 1 to {cfg.max_speakers}")
        frames = cfg.speaker_frames
        places = torch.zeros(cfg.max_speakers, frames, cfg.speaker_dim)
        filled = torch.zeros(cfg.max_speakers, frames, dtype=torch.bool)
        for k, voice in enumerate(voices):
            if voice.shape != (cfg.speaker_dim, frames):
                raise ValueError(
                    f"a voice embedding must be [{cfg.speaker_dim}, {frames}] ([1, {cfg.speaker_dim}, {frames}] in its "
                    f"file), got {list(voice.shape)}"
                )
            places[k] = voice.float().t()
            filled[k] = True
        source = places.flatten(0, 1) @ self.speaker_proj
        source = torch.where(filled.flatten()[:, None], source, self.speaker_padding)
        if cfg.cross_pos_emb:
            source = source + cfg.cross_pos_emb_scale * sin_embedding(len(source), self.dim)
        return source
