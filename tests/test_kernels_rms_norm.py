"""RMSNorm and the fused residual add + RMSNorm: Triton (interpreter) against the fp64 torch reference."""

from __future__ import annotations

import pytest
import torch

from duplexd.kernels.dispatch import force_triton
from duplexd.kernels.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
    rms_norm_triton,
)
from duplexd.kernels.testing import poisoned_allocations

TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}  # relative to the output's scale; bf16 is one ulp


def _inputs(shape, dtype, seed, stride_pad=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = (torch.randn(*shape[:-1], n + stride_pad, generator=g) * 3)[..., :n].to(dtype)
    alpha = (torch.rand(n, generator=g) + 0.5).to(dtype)
    return x, alpha


def _close(got, want, dtype):
    scale = want.abs().max().clamp(min=1.0)
    assert torch.isfinite(got).all(), "unwritten (poisoned) or non-finite element"
    assert ((got.double() - want).abs().max() / scale) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, pad", [((3, 97), 0), ((2, 3, 1000), 5), ((1, 4096), 0)])
def test_rms_norm_matches_reference(shape, pad, dtype):
    x, alpha = _inputs(shape, dtype, seed=sum(shape), stride_pad=pad)
    with poisoned_allocations():
        y = rms_norm_triton(x, alpha, 1e-8)
    assert y.shape == x.shape and y.dtype == dtype
    _close(y, rms_norm_reference(x.double(), alpha.double(), 1e-8), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 97), (2, 3, 130)])
def test_fused_residual_add(shape, dtype):
    update, alpha = _inputs(shape, dtype, seed=1)
    residual, _ = _inputs(shape, dtype, seed=2)
    with poisoned_allocations():
        y, h = rms_norm_triton(update, alpha, 1e-8, residual=residual)
    exact = residual.double() + update.double()
    if dtype == torch.float32:
        assert torch.equal(h, residual + update), "the new residual must be the fp32 sum, bit for bit"
    else:  # one rounding to bf16 (the interpreter truncates where a GPU rounds to nearest): within one ulp
        assert ((h.double() - exact).abs() <= exact.abs() * 2.0**-7).all()
    _close(y, rms_norm_reference(h.double(), alpha.double(), 1e-8), dtype)


def test_dispatchers_pick_the_reference_on_cpu_and_triton_when_forced():
    x, alpha = _inputs((3, 50), torch.float32, seed=3)
    r, _ = _inputs((3, 50), torch.float32, seed=4)
    assert torch.equal(rms_norm(x, alpha), rms_norm_reference(x, alpha))
    ref_y, ref_h = add_rms_norm_reference(x, r, alpha)
    y, h = add_rms_norm(x, r, alpha)
    assert torch.equal(y, ref_y) and torch.equal(h, ref_h)
    with force_triton():
        y, h = add_rms_norm(x, r, alpha)
        assert torch.equal(rms_norm(x, alpha), rms_norm_triton(x, alpha))
    torch.testing.assert_close(y, ref_y, rtol=1e-6, atol=1e-6)
    assert torch.equal(h, ref_h)
