"""RMSNorm as the reference computes it: in fp32, weight `alpha` used as is, eps inside the root.

`add_rms_norm` fuses the residual add that precedes every norm of a pre-norm block: one pass reads the update
and the residual, writes the new residual and its normalised copy. The references do exactly what the unfused
torch code does (`residual + update` rounded to the storage dtype, then the norm), so the CPU path is unchanged.
"""

from __future__ import annotations

from typing import overload

import torch

from ._triton import tl, triton
from .dispatch import use_triton


def rms_norm_reference(x: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`x * alpha * rsqrt(mean(x^2) + eps)` over the last dim, computed in fp32, returned in `x.dtype`."""
    x32 = x.float()
    var = x32.pow(2).mean(dim=-1, keepdim=True).add_(eps)
    return (x32 * (alpha.float() * torch.rsqrt(var))).to(x.dtype)


def add_rms_norm_reference(
    update: torch.Tensor, residual: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns `(rms_norm(residual + update), residual + update)`."""
    h = residual + update
    return rms_norm_reference(h, alpha, eps), h


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    alpha_ptr,
    y_ptr,
    h_ptr,
    stride_x,
    stride_r,
    stride_y,
    stride_h,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row; the whole row sits in registers (BLOCK = next power of two of the width)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(h_ptr.dtype.element_ty)  # rounded like the torch add, and normalised as stored
        tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
        x = h.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols + eps
    alpha = tl.load(alpha_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * (alpha * tl.rsqrt(var))
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _num_warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


@overload
def rms_norm_triton(x: torch.Tensor, alpha: torch.Tensor, eps: float = ...) -> torch.Tensor: ...
@overload
def rms_norm_triton(
    x: torch.Tensor, alpha: torch.Tensor, eps: float = ..., *, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm_triton(
    x: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-8, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm of `x` [..., N]; with `residual`, of `residual + x`, returning `(normed, residual + x)`."""
    n = x.shape[-1]
    if alpha.numel() != n:
        raise ValueError(f"alpha has {alpha.numel()} elements, rows have {n}")
    x2 = _rows(x)
    dtype = x.dtype if residual is None else residual.dtype
    y = torch.empty(x2.shape, dtype=dtype, device=x.device)
    if residual is None:
        r2 = h = x2  # unused
    else:
        if residual.shape != x.shape:
            raise ValueError(f"residual {list(residual.shape)} and update {list(x.shape)} differ")
        r2 = _rows(residual)
        h = torch.empty_like(y)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        alpha.reshape(-1),
        y,
        h,
        x2.stride(0),
        r2.stride(0),
        y.stride(0),
        h.stride(0),
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    if residual is None:
        return y.view(x.shape)
    return y.view(x.shape), h.view(x.shape)


def rms_norm(x: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """RMSNorm over the last dim; Triton on CUDA, the torch reference elsewhere."""
    if use_triton(x):
        return rms_norm_triton(x, alpha, eps)
    return rms_norm_reference(x, alpha, eps)


def add_rms_norm(
    update: torch.Tensor, residual: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-8
) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = residual + update`; returns `(rms_norm(h), h)`. Triton on CUDA, the torch reference elsewhere."""
    if use_triton(update):
        return rms_norm_triton(update, alpha, eps, residual=residual)
    return add_rms_norm_reference(update, residual, alpha, eps)
