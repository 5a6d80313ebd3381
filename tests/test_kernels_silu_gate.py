"""SiLU-gated activation in the [gate | value] layout: Triton (interpreter) against the fp64 torch reference."""

from __future__ import annotations

import pytest
import torch

from duplexd.kernels.dispatch import force_triton
from duplexd.kernels.silu_gate import silu_gate, silu_gate_reference, silu_gate_triton
from duplexd.kernels.testing import poisoned_allocations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, block", [((3, 2 * 37), 16), ((2, 3, 2 * 1000), 256), ((1, 2 * 5), 1024)])
def test_silu_gate_matches_reference(shape, block, dtype):
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1])) * 4).to(dtype)
    with poisoned_allocations():
        out = silu_gate_triton(x, block=block)
    want = silu_gate_reference(x.double())
    assert out.shape == want.shape and out.dtype == dtype and torch.isfinite(out).all()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert ((out.double() - want).abs() <= tol * want.abs().clamp(min=1.0)).all()


def test_gate_is_the_first_half():
    x = torch.tensor([[1.0, -2.0, 3.0, 5.0]])  # gate (1, -2), value (3, 5)
    with force_triton():
        out = silu_gate(x)
    torch.testing.assert_close(out, torch.nn.functional.silu(x[:, :2]) * x[:, 2:])
    assert torch.equal(silu_gate(x), silu_gate_reference(x))
