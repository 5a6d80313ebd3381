"""RoPE on q and k together (interleaved pairs, per-row positions): Triton (interpreter) against fp64 torch."""

from __future__ import annotations

import pytest
import torch

from duplexd.kernels.dispatch import force_triton
from duplexd.kernels.rope import apply_rope, rope_angles, rope_qk, rope_qk_reference, rope_qk_triton
from duplexd.kernels.testing import poisoned_allocations


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, heads, head_dim", [(3, 3, 10), (2, 5, 128)])
def test_rope_qk_matches_reference(batch, heads, head_dim, dtype):
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(batch, 3, heads, head_dim, generator=g).to(dtype)  # q, k are strided views, as in the LM
    positions = torch.tensor([0, 7, 123_456][:batch])  # ragged: rows sit at different absolute positions
    cos, sin = rope_angles(positions, head_dim, 10_000.0)
    with poisoned_allocations():
        q, k = rope_qk_triton(qkv[:, 0], qkv[:, 1], cos, sin)
    for got, x in ((q, qkv[:, 0]), (k, qkv[:, 1])):
        want = apply_rope(x.double(), cos.double(), sin.double())
        assert got.dtype == dtype and torch.isfinite(got).all()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (got.double() - want).abs().max() <= tol * want.abs().max()


def test_rope_is_a_rotation_of_adjacent_pairs():
    """Position p rotates pair (x[2i], x[2i+1]) by p * 10000^(-2i/D): check one pair by hand."""
    x = torch.zeros(1, 1, 4)
    x[0, 0, 2] = 1.0  # pair 1 = (1, 0)
    cos, sin = rope_angles(torch.tensor([3]), 4, 10_000.0)
    with force_triton():
        q, _ = rope_qk(x, x, cos, sin)
    angle = torch.tensor(3 * 10_000.0 ** (-2 / 4))
    torch.testing.assert_close(q[0, 0], torch.stack([torch.tensor(0.0), torch.tensor(0.0), angle.cos(), angle.sin()]))


def test_dispatcher_uses_the_reference_on_cpu():
    q, k = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    cos, sin = rope_angles(torch.tensor([1, 9]), 8, 10_000.0)
    got, want = rope_qk(q, k, cos, sin), rope_qk_reference(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
