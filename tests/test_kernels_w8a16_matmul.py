"""The W8A16 matmul: the Triton kernels (interpreter) and the torch reference against an fp64 product with the
dequantized weight, over the tiles kernel's row buckets and ragged tails in M, N and K; views (stacked and sliced
codes, row-strided x, leading dims); which outputs one code, one scale or one row of x reaches; input validation.
The GEMV ("gemv", up to 8 rows): every row count, with and without its split along K, each x dtype, views, and the
tiles kernel past 8 rows; on few programs each (the interpreter's cost is per program, not per element).

Triton 3.9's interpreter multiplies bf16 `tl.dot` operands as the uint16 bit patterns it stores them in (only fp8
is decoded first), so the fixture below decodes bf16 operands to fp32 before its matmul: the exact products a
GPU's bf16 MMA forms, accumulated in fp32. (Its int8 -> bf16 cast is wrong too; the kernel converts through fp32,
for which Triton emits the same sm_90 PTX as for the direct cast.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duplexd.kernels._triton import tl
from duplexd.kernels.dispatch import force_triton
from duplexd.kernels.testing import poisoned_allocations
from duplexd.kernels.w8a16_matmul import (
    GEMV_ROWS,
    gemv_splits,
    int8_matmul,
    int8_matmul_reference,
    int8_matmul_triton,
)


@pytest.fixture(autouse=True)
def _bf16_dot_decoded(monkeypatch):
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def decoded(h):
        if h.dtype != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def patched(self, a, b, d, *args):
        return create_dot(self, decoded(a), decoded(b), d, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", patched)


ROWS = (1, 2, 3, 8, 16, 17, 64, 128, 200)  # every row bucket, each side of its edges
SHAPES = ((100, 77), (257, 130), (256, 128))  # (K, N): ragged tails, then whole tiles


def _weights(n: int, k: int, seed: int, steps: int = 0, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] int8 over the full range (-128 included) and a positive fp32 scale per output channel; with
    `steps`, one step (the last) of a contiguous [steps, N, K] stack; with `pad`, a slice of [N, K + pad]."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(-128, 128, (max(steps, 1), n, k + pad), generator=g, dtype=torch.int8)
    codes = full[-1, :, :k]
    scale = torch.rand(n, generator=g) * 0.02 + 1e-3
    return codes, scale


def _x(rows: tuple[int, ...], k: int, dtype: torch.dtype, seed: int, pad: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*rows, k + pad, generator=g).to(dtype)[..., :k]


def _exact(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.double() @ (codes.double() * scale.double()[:, None]).T


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(got).all(), "unwritten (poisoned) or non-finite element"
    err = (got.double() - want).abs()
    if dtype == torch.float32:  # fp32 accumulation over K <= 257 terms
        assert (err <= 1e-5 * want.abs().max()).all(), err.max()
    else:  # one rounding to bf16 (the interpreter truncates): under one ulp, plus the fp32 accumulation
        assert (err <= want.abs() * 2.0**-7 + 1e-5 * want.abs().max()).all(), (err / want.abs()).max()


def _kernel(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    with force_triton(), poisoned_allocations():
        return int8_matmul(x, codes, scale)


def _gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """The "gemv" kernel, its outputs and split-K partial sums allocated poisoned (NaN): one left unwritten fails."""
    with force_triton(), poisoned_allocations():
        return int8_matmul_triton(x, codes, scale, "gemv", splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_kernel_matches_fp64(m, k, n, dtype):
    codes, scale = _weights(n, k, seed=k + n)
    x = _x((m,), k, dtype, seed=m)
    y = _kernel(x, codes, scale)
    assert y.shape == (m, n) and y.dtype == dtype
    _close(y, _exact(x, codes, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_views_and_leading_dims(dtype):
    """codes: one step of a stacked [3, N, K] tensor and a column slice of a wider one; x: [B, T, K] whose rows
    are a slice of wider rows (a view the kernel reads in place, with its row stride)."""
    k, n = 130, 45
    for codes, scale in (_weights(n, k, seed=1, steps=3), _weights(n, k, seed=2, pad=6)):
        assert codes.storage_offset() > 0 or codes.stride(0) != k  # not the start of a plain [N, K] tensor
        x = _x((2, 5), k, dtype, seed=3, pad=9)
        assert x.stride(-2) == k + 9
        y = _kernel(x, codes, scale)
        assert y.shape == (2, 5, n) and y.dtype == dtype
        _close(y, _exact(x, codes, scale), dtype)
    assert _kernel(x[:, :0], codes, scale).shape == (2, 0, n), "no rows: no launch, an empty result"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", [(1, 100, 77), (17, 257, 130), (3, 1024, 64)])
def test_reference_matches_fp64(m, k, n, dtype):
    codes, scale = _weights(n, k, seed=k, steps=2)
    x = _x((m,), k, dtype, seed=n, pad=3)
    y = int8_matmul_reference(x, codes, scale)
    assert y.dtype == dtype
    _close(y, _exact(x, codes, scale), dtype)
    assert torch.equal(int8_matmul(x, codes, scale), y), "the CPU dispatch must be the reference"


def test_each_input_reaches_only_its_outputs():
    """A code at (n, k) changes column n only, a scale column n only, a row of x its output row only; picked in
    the tails (last partial tile of M, N and K), every row or column of the product moves."""
    m, k, n = 17, 257, 130
    codes, scale = _weights(n, k, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(m, k, generator=g).sign() * (torch.rand(m, k, generator=g) + 0.5)  # |x| >= 0.5: no zeros
    base = _kernel(x, codes, scale)

    def changed(y: torch.Tensor) -> torch.Tensor:
        return (y != base).nonzero()

    for r, c in ((n - 1, k - 1), (40, 3), (0, 0)):
        codes2 = codes.clone()
        codes2[r, c] = -128 if codes[r, c] >= 0 else 127
        hit = changed(_kernel(x, codes2, scale))
        assert set(hit[:, 1].tolist()) == {r} and len(hit) == m
    for r in (n - 1, 64):
        scale2 = scale.clone()
        scale2[r] *= 1.5
        hit = changed(_kernel(x, codes, scale2))
        assert set(hit[:, 1].tolist()) == {r} and len(hit) == m
    for r in (m - 1, 0):
        x2 = x.clone()
        x2[r] = -x2[r]
        hit = changed(_kernel(x2, codes, scale))
        assert set(hit[:, 0].tolist()) == {r} and len(hit) == n


def test_gemv_splits_k_by_static_sizes_only():
    """Moshi 7B's temporal projections have columns enough (no split); the DepFormer's 1024 columns split its
    longer K (dep_in 4096, w_out 2816) but not K = 1024, one program step; a forced count splits in 16-code units."""
    bf16 = torch.bfloat16
    assert [gemv_splits(n, 4096, bf16)[1] for n in (4096, 12288, 22528, 32000)] == [1, 1, 1, 1]
    assert gemv_splits(4096, 11264, bf16)[1] == 1
    assert gemv_splits(1024, 4096, bf16) == (1024, 4)
    assert gemv_splits(1024, 2816, bf16) == (944, 3)
    assert gemv_splits(1024, 1024, bf16)[1] == gemv_splits(3072, 1024, bf16)[1] == 1
    assert gemv_splits(20, 300, bf16, splits=3) == (112, 3) and gemv_splits(20, 300, bf16) == (304, 1)
    assert gemv_splits(20, 40, torch.float32, splits=8) == (16, 3)  # never an empty split


@pytest.mark.parametrize("m", range(1, GEMV_ROWS + 1))
def test_gemv_matches_fp64_at_every_row_count(m):
    """1 to 8 rows (the kernel's row buckets 1, 2, 4, 8, and padded rows in 3, 5, 6, 7), bf16 x, no split;
    ragged K (not a multiple of a code vector) and N (3 programs, the last partial)."""
    k, n = 300, 20
    codes, scale = _weights(n, k, seed=m)
    x = _x((m,), k, torch.bfloat16, seed=m)
    assert gemv_splits(n, k, x.dtype)[1] == 1
    y = _gemv(x, codes, scale)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _close(y, _exact(x, codes, scale), torch.bfloat16)


@pytest.mark.parametrize(("m", "dtype"), [(1, torch.float32), (3, torch.float16), (8, torch.bfloat16)])
def test_gemv_split_k_matches_fp64(m, dtype):
    """Three K splits (the last ragged) summed by the second launch, for each x dtype."""
    k, n = 300, 12
    codes, scale = _weights(n, k, seed=m + 10)
    x = _x((m,), k, dtype, seed=m + 10)
    y = _gemv(x, codes, scale, splits=3)
    assert y.shape == (m, n) and y.dtype == dtype
    _close(y, _exact(x, codes, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_views_and_leading_dims(dtype):
    """codes: one step of a stacked [3, N, K] tensor, then a column slice of a wider one; x: [2, 3, K] (6 rows)
    whose rows are a slice of wider rows, read in place; without and with a split."""
    k, n = 130, 10
    x = _x((2, 3), k, dtype, seed=4, pad=9)
    assert x.stride(-2) == k + 9
    for (codes, scale), splits in ((_weights(n, k, seed=5, steps=3), None), (_weights(n, k, seed=6, pad=6), 2)):
        y = _gemv(x, codes, scale, splits)
        assert y.shape == (2, 3, n) and y.dtype == dtype
        _close(y, _exact(x, codes, scale), dtype)


def test_gemv_kernel_past_its_rows_runs_the_tiles():
    """More than 8 rows with kernel="gemv": the tiles kernel, the same bits as kernel="tiles"."""
    k, n = 100, 40
    codes, scale = _weights(n, k, seed=7)
    x = _x((GEMV_ROWS + 1,), k, torch.bfloat16, seed=7)
    with force_triton():
        tiles = int8_matmul(x, codes, scale, "tiles")
        assert torch.equal(int8_matmul(x, codes, scale, "gemv"), tiles)
        with pytest.raises(ValueError, match="'wide' is not one of tiles, gemv"):
            int8_matmul(x, codes, scale, "wide")
    _close(tiles, _exact(x, codes, scale), torch.bfloat16)


@pytest.mark.parametrize("triton_path", [False, True])
def test_invalid_inputs_raise(triton_path):
    codes, scale = _weights(6, 32, seed=7)
    x = _x((2,), 32, torch.float32, seed=8)
    cases = [
        ((x, codes.float(), scale), "int8"),
        ((x, codes[0], scale), "2-D"),
        ((x, codes, scale.bfloat16()), "float32"),
        ((x, codes, scale[:5]), r"scale must be .*\[6\]"),
        ((x, codes, torch.rand(12)[::2]), "contiguous"),
        ((x[:, :31], codes, scale), "K = 32"),
        ((x.double(), codes, scale), "x must be"),
        ((x, codes.t().contiguous().t(), scale), "contiguous along K"),
    ]
    with force_triton(triton_path):
        for args, message in cases:
            with pytest.raises(ValueError, match=message):
                int8_matmul(*args)
            if triton_path:
                with pytest.raises(ValueError, match=message):
                    int8_matmul_triton(*args)


@pytest.mark.parametrize("kernel", ["tiles", "gemv"])
def test_no_inputs_give_zeros(kernel):
    """K = 0 (a layer with no inputs): every output is the empty sum, on both paths and with leading dims."""
    codes, scale = torch.zeros(5, 0, dtype=torch.int8), torch.rand(5)
    x = torch.randn(2, 3, 0, dtype=torch.bfloat16)
    with force_triton():
        got = int8_matmul(x, codes, scale, kernel)
    assert got.shape == (2, 3, 5) and got.dtype == torch.bfloat16 and not got.any()
    assert torch.equal(got, int8_matmul_reference(x, codes, scale))
