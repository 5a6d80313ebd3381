"""Rotary position embedding in the reference's convention: interleaved pairs (x[2i], x[2i+1]), fp32 math.

Each row carries its own absolute position, so sessions at different points of their conversation share a batch.
The angles depend only on the positions, so a step computes them once (`rope_angles`) and every layer rotates
its q and k with `rope_qk` (or, on an 8-bit KV pool's Triton path, `rope_kv_store`, which stores the rotated key
quantized as it goes).
"""

from __future__ import annotations

import math

import torch

from ._triton import tl, triton
from .dispatch import use_triton


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


def rope_qk_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k [B, H, D] by the per-row angles cos, sin [B, D/2]."""
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


@triton.jit
def rotated_pairs(x_ptr, stride_b, stride_h, b, heads, pairs, c, s, mask):
    """Row b's pairs [heads, pairs] of x rotated by (c, s): (even, odd) elements in fp32, masked ones 0."""
    x_off = b * stride_b + heads * stride_h + 2 * pairs
    re = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    im = tl.load(x_ptr + x_off + 1, mask=mask, other=0.0).to(tl.float32)
    return re * c - im * s, re * s + im * c


@triton.jit
def rotate_store(x_ptr, o_ptr, stride_b, stride_h, ostride_b, ostride_h, b, heads, pairs, c, s, mask):
    even, odd = rotated_pairs(x_ptr, stride_b, stride_h, b, heads, pairs, c, s, mask)
    o_off = b * ostride_b + heads * ostride_h + 2 * pairs
    tl.store(o_ptr + o_off, even.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + o_off + 1, odd.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_qk_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    qo_ptr,
    ko_ptr,
    sq_b,
    sq_h,
    sk_b,
    sk_h,
    sqo_b,
    sqo_h,
    sko_b,
    sko_h,
    sc_b,
    n_heads,
    n_pairs,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One program per row: all heads of q and k, the row's angles loaded once."""
    b = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    pairs = tl.arange(0, BLOCK_P)[None, :]
    mask = (heads < n_heads) & (pairs < n_pairs)
    c = tl.load(cos_ptr + b * sc_b + pairs, mask=pairs < n_pairs, other=0.0)
    s = tl.load(sin_ptr + b * sc_b + pairs, mask=pairs < n_pairs, other=0.0)
    rotate_store(q_ptr, qo_ptr, sq_b, sq_h, sqo_b, sqo_h, b, heads, pairs, c, s, mask)
    rotate_store(k_ptr, ko_ptr, sk_b, sk_h, sko_b, sko_h, b, heads, pairs, c, s, mask)


def rope_qk_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `rope_qk`; q and k may be strided views (e.g. of a fused qkv) with a contiguous last dim."""
    b, h, d = q.shape
    if k.shape != q.shape or cos.shape != (b, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}, cos {list(cos.shape)}, sin {list(sin.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    q_out, k_out = (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
    )
    _rope_qk_kernel[(b,)](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos.stride(0),
        h,
        d // 2,
        BLOCK_H=triton.next_power_of_2(h),
        BLOCK_P=triton.next_power_of_2(d // 2),
    )
    return q_out, k_out


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k [B, H, D] by per-row angles [B, D/2]; Triton on CUDA, the torch reference elsewhere."""
    if use_triton(q):
        return rope_qk_triton(q, k, cos, sin)
    return rope_qk_reference(q, k, cos, sin)
