"""Batched temperature + top-k sampling with per-row parameters and counter-based randomness.

Each row's noise is a hash of (seed, frame, stream, candidate rank), so a session's tokens depend only on its
own seed and position, never on who shares its batch, and no generator state has to be kept or synchronised.
Sampling is a Gumbel-max race over the top-k logits scaled by 1/temperature, which draws from the same
distribution as the reference's softmax → top-k → exponential race. Temperature 0 is greedy argmax.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), without overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """The `lowbias32` integer hash on int64 tensors holding 32-bit values."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, frames: torch.Tensor, stream: int, width: int) -> torch.Tensor:
    """Uniform (0, 1) draws [B, width] keyed by each row's seed and frame, a stream id and the column."""
    key = hash32(hash32(seeds ^ 0x9E3779B9) ^ frames)
    key = hash32(key ^ stream)
    cols = hash32(torch.arange(width, device=seeds.device, dtype=torch.int64) + 0x632BE5AB)
    bits = hash32(key[:, None] ^ cols[None, :])
    return (bits.double() + 0.5).mul_(1.0 / 2**32).float()


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    frames: torch.Tensor,
    stream: int,
) -> torch.Tensor:
    """Draw one token per row of `logits` [B, V]; per-row `temperature`, `top_k`, `seeds`, `frames` [B]."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    k_max = min(int(top_k.max()), logits.shape[-1])
    values, indices = logits.topk(k_max, dim=-1)
    noise = uniform_noise(seeds, frames, stream, k_max)
    gumbel = -torch.log(-torch.log(noise))
    scores = values / temperature.clamp(min=1e-6)[:, None] + gumbel
    ranks = torch.arange(k_max, device=logits.device)
    scores = scores.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    sampled = indices.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(temperature > 0, sampled, greedy)
