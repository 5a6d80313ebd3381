"""The SiLU-gated MLP activation: `silu(gate) * value` where the up-projection's outputs are [gate | value].

This is the reference's layout (`ActivationGating`: the first half of `linear_in`'s outputs is the gate). The
kernel reads both halves once and writes the product in one pass, in fp32 math whatever the storage dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import tl, triton
from .dispatch import use_triton


def silu_gate_reference(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :n]) * x[..., n:]` for `x` [..., 2n]."""
    gate, value = x.chunk(2, dim=-1)
    return F.silu(gate) * value


@triton.jit
def _silu_gate_kernel(x_ptr, o_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    """Program (row, block of output columns)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    value = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * value
    tl.store(o_ptr + row * stride_o + cols, out.to(o_ptr.dtype.element_ty), mask=mask)


def silu_gate_triton(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Triton `silu_gate`; `block` output columns per program (a power of two)."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim holds [gate | value] and must be even, got {x.shape[-1]}")
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    block = min(block, triton.next_power_of_2(n))
    _silu_gate_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, x2.stride(0), out.stride(0), n, BLOCK=block)
    return out.view(*x.shape[:-1], n)


def silu_gate(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * value` of `x` [..., 2n] = [gate | value]; Triton on CUDA, the torch reference elsewhere."""
    if use_triton(x):
        return silu_gate_triton(x)
    return silu_gate_reference(x)
