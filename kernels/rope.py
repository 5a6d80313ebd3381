"""Rotary position embedding in the reference's convention: interleaved pairs (x[2i], x[2i+1]), fp32 math.

Each row carries its own absolute position, so sessions at different points of their conversation share a batch.
"""

from __future__ import annotations

import math

import torch


def rope_angles(positions: torch.Tensor, head_dim: int, max_period: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of `position * max_period^(-2i/D)`, shape [*positions.shape, D/2], fp32."""
    ds = torch.arange(head_dim // 2, device=positions.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / head_dim))
    theta = positions.float().unsqueeze(-1) * freqs
    return torch.cos(theta), torch.sin(theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [..., H, D] by angles [..., D/2] (broadcast over heads); result in `x.dtype`."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)
