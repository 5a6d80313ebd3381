"""The 8-bit KV write path: the Triton quantize-and-store kernel (interpreter) against the torch reference, bit for
bit, codes and scales, as the pool writes them: rows of slots at different positions, pages handed out out of
order, pages that straddle the window, the ring wrapping several times, padding rows in the scratch slot, zero
vectors and exact ties. And the rule itself: round half to even for int8, the e4m3fn cast (nearest, ties to even,
saturating) for fp8, checked against an exhaustive table of e4m3fn values.

fp8 is not written by the Triton kernel here: Triton 3.9's interpreter encodes fp8 wrongly (carries into the
exponent halve the value, no saturation), so only the GPU can check the kernel's fp8 store
(bench/kv_dtype.py does, in bench/gpu_suite.sh).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from duplexd.engine.kv.paged import PagedKVCache
from duplexd.kernels.kv_quant import (
    QMAX,
    TINY,
    dequantize,
    quantize_reference,
    store_quantized_reference,
    store_quantized_triton,
)

HEADS, DIM = 3, 24  # head dim not a power of two: the kernel's masks are exercised


def _pool(
    kv_dtype: str = "int8", layers: int = 1, context: int = 12, page_size: int = 5, num_pages: int = 9
) -> PagedKVCache:
    """Context 12 in pages of 5 frames: a ring of 3 pages (15 positions), so pages straddle the window edge; pages
    handed out shuffled."""
    kv = PagedKVCache(
        num_layers=layers,
        num_heads=HEADS,
        head_dim=DIM,
        context=context,
        num_slots=3,
        num_pages=num_pages,
        page_size=page_size,
        kv_dtype=kv_dtype,
    )
    random.Random(0).shuffle(kv._free)
    for slot in (0, 2):
        kv.allocate(slot)
        kv.upload(slot)
    return kv


def _rows(gen: torch.Generator, batch: int) -> torch.Tensor:
    """Keys or values [batch, H, D] of mixed sizes, a zero head, a tiny one and one with exact ties."""
    x = torch.randn(batch, HEADS, DIM, generator=gen) * torch.logspace(-3, 3, batch)[:, None, None]
    x[0, 1] = 0.0  # a zero vector: scale 0, codes 0
    x[1, 0] = 1e-35  # below TINY: stored as zero
    ties = torch.tensor([15.875, 0.0625, -0.0625, 0.1875, -0.1875, 0.3125])  # scale 1/8: y = 127, ±0.5, ±1.5, 2.5
    x[2, 2, : len(ties)] = ties
    x[2, 2, len(ties) :] = 0.0
    return x


def test_rounding_rule_and_zero_vectors():
    x = torch.zeros(3, 8)
    x[0, :6] = torch.tensor([15.875, 0.0625, -0.0625, 0.1875, -0.1875, 0.3125])
    x[2, 0] = TINY / 2
    codes, scales = quantize_reference(x, torch.int8)
    assert scales[0] == 0.125 and codes[0, :6].tolist() == [127, 0, 0, 2, -2, 2], "ties to even"
    assert scales[1] == 0 and scales[2] == 0 and not codes[1:].any()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g) * 5
    codes, scales = quantize_reference(x, torch.int8)
    assert (codes.abs().amax(-1) == 127).all() and codes.min() >= -127
    err = (dequantize(codes, scales) - x).abs()
    assert (err <= scales[:, None] / 2 * (1 + 1e-6)).all()  # round to nearest: at most half a step


class _Divisions(TorchDispatchMode):
    """Records each division's divisor."""

    def __init__(self) -> None:
        super().__init__()
        self.divisors: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.div:
            self.divisors.append(args[1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_the_reference_divides_by_tensors(dtype):
    """On CUDA, `tensor / python_float` is a multiply by the float's reciprocal, not the correctly rounded quotient
    the kernel computes: on an H200 the reference's scales differed from the kernel's (360 of 8192 for int8, 4816
    for fp8) while the CPU, which divides, agreed bit for bit. Every division of the rule takes a tensor divisor
    (a 0-dim Python number would be a wrapped scalar)."""
    x = torch.randn(4, 3, 16)
    with _Divisions() as mode:
        codes, scales = quantize_reference(x, dtype)
    assert len(mode.divisors) == 2
    assert all(isinstance(d, torch.Tensor) and d.dim() > 0 for d in mode.divisors), mode.divisors
    amax = x.abs().amax(-1).double()
    assert torch.equal(scales, (amax / QMAX[dtype]).float())  # correctly rounded: fp64 then one rounding to fp32


def _e4m3fn_values() -> torch.Tensor:
    """Every finite e4m3fn value, from its bit pattern (not from torch's cast): sign, 4 exponent bits (bias 7),
    3 mantissa bits; exponent 0 is subnormal; 0x7F/0xFF are NaN."""
    values = []
    for code in range(256):
        sign, exp, man = code >> 7, (code >> 3) & 0xF, code & 0x7
        if exp == 0xF and man == 0x7:
            continue
        magnitude = man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        values.append(-magnitude if sign else magnitude)
    return torch.tensor(sorted(set(values)), dtype=torch.float64)


def test_fp8_encode_is_the_nearest_e4m3fn_value():
    """The reference's fp8 codes are the nearest e4m3fn value to y = x / scale (ties to the even mantissa),
    saturating at 448: checked against the table built from the format's definition."""
    table = _e4m3fn_values()
    assert table.max() == 448 and len(table) == 253  # 254 finite codes, +0 and -0 one value
    g = torch.Generator().manual_seed(1)
    x = (
        torch.randn(256, 64, generator=g, dtype=torch.float64)
        * torch.logspace(-4, 4, 256, dtype=torch.float64)[:, None]
    )
    x = x.float()
    codes, scales = quantize_reference(x, torch.float8_e4m3fn)
    y = torch.where(scales[:, None] > 0, x / torch.where(scales > 0, scales, 1.0)[:, None], 0.0).double()
    distance = (y[..., None] - table).abs()
    nearest = distance.min(-1).values
    got = codes.double()
    assert torch.equal((got - y).abs(), nearest), "a code that is not the nearest e4m3fn value"
    assert got.abs().max() == QMAX[torch.float8_e4m3fn] and scales.dtype == torch.float32
    ties = torch.tensor([[448.0, 1.0625, 1.1875, -12.5, 2.625, 0.0]])  # scale 1: y = x; ties go to the even mantissa
    codes, scales = quantize_reference(ties, torch.float8_e4m3fn)
    assert scales.item() == 1.0 and codes.float().tolist() == [[448.0, 1.0, 1.25, -12.0, 2.5, 0.0]]


def _write(kv: PagedKVCache, slots: torch.Tensor, positions: torch.Tensor, k, v, triton: bool) -> None:
    view = kv.batch(slots, positions)
    store = store_quantized_triton if triton else store_quantized_reference
    assert kv.k_scales is not None and kv.v_scales is not None
    store(k, v, kv.keys[0], kv.values[0], kv.k_scales[0], kv.v_scales[0], view.write_page, view.write_offset)


def test_triton_store_matches_the_reference_bit_for_bit_through_ring_wraps():
    """Slot 0 from position 0, slot 2 seven frames behind, and two padding rows in the scratch slot, for 40 steps
    (the 15-position ring wraps twice); both pools are equal after every step, and each slot's ring holds exactly
    its last 15 positions' codes and scales (a recycled page never keeps an old frame's scale)."""
    triton_kv, ref_kv = _pool(), _pool()
    assert torch.equal(triton_kv.tables, ref_kv.tables)
    gen = torch.Generator().manual_seed(2)
    scratch = triton_kv.scratch_slot
    slots = torch.tensor([0, 2, scratch, scratch])
    history: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for t in range(40):
        positions = torch.tensor([t, max(t - 7, 0), 0, 0])
        k, v = _rows(gen, 4), _rows(gen, 4)
        k[3], v[3] = k[2], v[2]  # padding rows repeat one row: the scratch page gets one value, as in the engine
        k = k[:, :, :] if t % 2 else k.transpose(0, 1).contiguous().transpose(0, 1)  # strided rows too
        for kv, triton in ((triton_kv, True), (ref_kv, False)):
            _write(kv, slots, positions, k, v, triton)
        for a, b in ((triton_kv.keys, ref_kv.keys), (triton_kv.values, ref_kv.values)):
            assert torch.equal(a, b), f"codes differ at step {t}"
        for a, b in ((triton_kv.k_scales, ref_kv.k_scales), (triton_kv.v_scales, ref_kv.v_scales)):
            assert torch.equal(a, b), f"scales differ at step {t}"
        history[(0, t)] = (k[0], v[0])
        history[(2, max(t - 7, 0))] = (k[1], v[1])
    kv = triton_kv
    for slot, last in ((0, 39), (2, 32)):
        for p in range(last - 14, last + 1):
            page, offset = int(kv.tables[slot, (p // 5) % 3]), p % 5
            for x, codes, scales in (
                (history[(slot, p)][0], kv.keys, kv.k_scales),
                (history[(slot, p)][1], kv.values, kv.v_scales),
            ):
                want_codes, want_scales = quantize_reference(x, torch.int8)
                assert torch.equal(codes[0, page, offset], want_codes) and torch.equal(
                    scales[0, page, offset], want_scales
                )
    scratch_page = kv.keys[0, kv.scratch]
    assert scratch_page[0].any() and not scratch_page[1:].any(), "padding rows write the scratch page only"
    live = set(kv.host_tables[[0, 2]].ravel().tolist())
    assert kv.scratch not in live


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_pool_bytes_are_pages_times_page_bytes(kv_dtype):
    kv = _pool(kv_dtype)
    page = PagedKVCache.page_bytes(1, HEADS, DIM, 5, torch.float32, kv_dtype)
    assert page == 2 * 5 * HEADS * (DIM + 4)  # 1-byte codes and an fp32 scale per (token, head), keys and values
    assert kv.nbytes == (kv.num_pages + 1) * page
    assert PagedKVCache.page_bytes(1, HEADS, DIM, 5, torch.bfloat16) == 2 * 5 * HEADS * DIM * 2
