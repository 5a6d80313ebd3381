"""The CPU matmul dispatcher: same result as `x @ w`, repacked after in-place updates, cache freed with w."""

from __future__ import annotations

import gc

import pytest
import torch

from duplexd.kernels import cpu_matmul
from duplexd.kernels.cpu_matmul import matmul


@pytest.mark.usefixtures("packs_small")
@pytest.mark.parametrize("shape", [(1, 67), (4, 67), (3, 5, 67)])
def test_matches_plain_matmul(shape):
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(67, 131, generator=gen), torch.randn(*shape, generator=gen)
    with torch.no_grad():
        out = matmul(x, w)
    assert out.shape == (*shape[:-1], 131)
    torch.testing.assert_close(out, x @ w, rtol=1e-5, atol=1e-5)


@pytest.fixture
def packs_small(monkeypatch):
    """Small weights take the oneDNN path too (the cache tests' weights are small)."""
    monkeypatch.setattr(cpu_matmul, "MIN_PACKED", 0)


def test_small_weights_are_not_packed():
    w, x = torch.randn(64, 192), torch.randn(4, 64)
    with torch.no_grad():
        torch.testing.assert_close(matmul(x, w), x @ w, rtol=0, atol=0)
    assert not [k for k in cpu_matmul._PACKED if k[0] == id(w)]


@pytest.mark.usefixtures("packs_small")
def test_in_place_update_is_seen_and_cache_is_released():
    w, x = torch.randn(32, 48), torch.randn(4, 32)
    with torch.no_grad():
        matmul(x, w)
        w.mul_(-2.0)
        torch.testing.assert_close(matmul(x, w), x @ w, rtol=1e-5, atol=1e-5)
    if cpu_matmul._ONEDNN:
        keys = [k for k in cpu_matmul._PACKED if k[0] == id(w)]
        assert len(keys) == 1
        del w
        gc.collect()
        assert keys[0] not in cpu_matmul._PACKED


@pytest.mark.usefixtures("packs_small")
def test_slices_of_a_stacked_weight_are_packed_apart():
    stacked, x = torch.randn(3, 40, 24), torch.randn(5, 40)
    with torch.no_grad():
        for step in (0, 2, 1, 2):
            torch.testing.assert_close(matmul(x, stacked[step]), x @ stacked[step], rtol=1e-5, atol=1e-5)
        view = stacked.view(3 * 40, 24)[40:80]
        torch.testing.assert_close(matmul(x, view), x @ stacked[1], rtol=1e-5, atol=1e-5)
