"""Attention over an 8-bit KV cache equals attention over the dequantized cache (fp32 math, ~1e-5 relative):
the Triton decode kernel (interpreter) and the CPU paths, decode and prefill, rows of sessions at different
positions, past the window and around the ring, with the window of either ring rule (`LMConfig.ring_rule`:
moshi's `context`, PersonaPlex's `context - 1`); and through `PagedKVCache.attend`, which writes and reads.

fp8 codes are decoded exactly by the interpreter, so the fp8 kernel is checked the same way (its codes come from
the torch reference: see tests/test_kernels_kv_quant.py for why not from the kernel).
"""

from __future__ import annotations

import pytest
import torch

from duplexd.engine.kv.paged import PagedKVCache
from duplexd.kernels.decode_attention import decode_attention_reference, decode_attention_torch, decode_attention_triton
from duplexd.kernels.dispatch import force_triton
from duplexd.kernels.kv_quant import dequantize, quantize_reference
from duplexd.kernels.prefill_attention import causal_paged_attention_torch
from duplexd.kernels.testing import poisoned_allocations

CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
CONTEXT, PAGE, HEADS, DIM = 24, 5, 3, 20  # a ring of 5 pages (25 positions) over a 24-frame window
# `PagedKVCache.attend`'s pool: a ring of 2 pages (6 positions) over a 4-frame window, so a few steps run past the
# window and around the ring (the decode kernel's one split and one block of keys, as at the larger size on a CPU)
POOL_CONTEXT, POOL_PAGE, POOL_STEPS, POOL_LAG = 5, 3, 9, 2  # the later session starts POOL_LAG frames late


def _quantized_pool(seed: int, kv_dtype: str, num_pages: int = 17):
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages, PAGE, HEADS, DIM)
    # Keys and values with per-token magnitudes spread over 4 decades, so the scales matter.
    spread = torch.logspace(-2, 2, PAGE * num_pages).view(num_pages, PAGE, 1, 1)
    k_codes, k_scales = quantize_reference(torch.randn(shape, generator=g) * spread, CODES[kv_dtype])
    v_codes, v_scales = quantize_reference(torch.randn(shape, generator=g) * spread.flip(0), CODES[kv_dtype])
    dense = [dequantize(c, s, torch.float64) for c, s in ((k_codes, k_scales), (v_codes, v_scales))]
    table = torch.randperm(num_pages, generator=g)[:15].view(3, 5).to(torch.int32)
    q = torch.randn(3, HEADS, DIM, generator=g) * 0.3
    return q, (k_codes, v_codes, k_scales, v_scales), dense, table


def _relative(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.double() - want).norm() / want.norm())


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("window", [CONTEXT, CONTEXT - 1])  # the moshi and personaplex ring rules
def test_decode_over_codes_equals_attention_over_the_dequantized_cache(kv_dtype, window):
    q, (kc, vc, ks, vs), (k, v), table = _quantized_pool(window, kv_dtype)
    lengths = torch.tensor([57, 1, 24])  # past the window with a wrapped ring; one key; exactly a window
    want = decode_attention_reference(q.double(), k, v, table, lengths, window)
    with poisoned_allocations():
        out = decode_attention_triton(q, kc, vc, table, lengths, window, split_len=7, k_scales=ks, v_scales=vs)
    assert _relative(out, want) < 1e-5
    assert _relative(decode_attention_torch(q, kc, vc, table, lengths, window, None, ks, vs), want) < 1e-5
    # The scales are applied, and each to its own side: swapping them or dropping one is far off (one split each:
    # the splits' scaling is the checked run's).
    wrong = decode_attention_triton(q, kc, vc, table, lengths, window, k_scales=vs, v_scales=ks)
    assert _relative(wrong, want) > 0.1
    dropped = decode_attention_triton(q, kc, vc, table, lengths, window, k_scales=ks, v_scales=torch.ones_like(vs))
    assert _relative(dropped, want) > 0.1


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
# Within the window; from inside the window past it (position 23) and around the 25-position ring (25 to 27);
# past the window with a wrapped ring throughout.
@pytest.mark.parametrize(("first", "rows", "window"), [(0, 9, CONTEXT), (18, 10, CONTEXT - 1), (40, 11, CONTEXT)])
def test_prefill_over_codes_equals_attention_over_the_dequantized_cache(kv_dtype, first, rows, window):
    """The CPU prefill (one causal call per run) and the GPU's (the decode kernel, one query per row)."""
    q, (kc, vc, ks, vs), (k, v), table = _quantized_pool(first + rows, kv_dtype)
    q = torch.randn(rows, HEADS, DIM, generator=torch.Generator().manual_seed(rows))
    row = table[0]
    lengths = torch.arange(first + 1, first + rows + 1, dtype=torch.int32)
    want = decode_attention_reference(q.double(), k, v, row.expand(rows, -1), lengths, window)
    out = causal_paged_attention_torch(q, kc, vc, row, first, window, k_scales=ks, v_scales=vs)
    assert _relative(out, want) < 1e-5
    triton = decode_attention_triton(q, kc, vc, row.expand(rows, -1), lengths, window, k_scales=ks, v_scales=vs)
    assert _relative(triton, want) < 1e-5


def _pool(kv_dtype: str) -> PagedKVCache:
    kv = PagedKVCache(
        num_layers=2,
        num_heads=HEADS,
        head_dim=DIM,
        context=POOL_CONTEXT,
        num_slots=2,
        num_pages=7,
        page_size=POOL_PAGE,
        window=POOL_CONTEXT - 1,
        kv_dtype=kv_dtype,
    )
    for slot in (0, 1):
        kv.allocate(slot)
        kv.upload(slot)
    return kv


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_pool_attend_writes_and_reads_every_layer_with_its_own_scales(kv_dtype):
    """Two layers, two sessions 2 frames apart and a padding row, 9 steps (both sessions past the window, both
    rings wrapping): each step's output equals attention over the pool dequantized, on the CPU path and the Triton
    path; for int8 the Triton path writes its own pool, which stays bit for bit the CPU path's. For fp8 the Triton
    decode reads the pool the CPU path wrote (module docs)."""
    cpu, gpu = _pool(kv_dtype), _pool(kv_dtype)
    assert POOL_STEPS - 1 - POOL_LAG >= cpu.max_pages * POOL_PAGE > cpu.window, "the later session's ring wraps too"
    g = torch.Generator().manual_seed(3)
    slots = torch.tensor([0, 1, 2])
    for t in range(POOL_STEPS):
        positions = torch.tensor([t, max(t - POOL_LAG, 0), 0])
        view = cpu.batch(slots, positions)
        q, k, v = (torch.randn(3, HEADS, DIM, generator=g) * s for s in (0.5, 2.0, 1.0))
        for layer in (0, 1):
            outs = [cpu.attend(layer, view, q, k * (layer + 1), v)]
            with force_triton():
                if kv_dtype == "int8":
                    outs.append(gpu.attend(layer, gpu.batch(slots, positions), q, k * (layer + 1), v))
                else:
                    args = (cpu.keys[layer], cpu.values[layer], view.block_table, view.lengths, cpu.window)
                    outs.append(
                        decode_attention_triton(q, *args, k_scales=cpu.k_scales[layer], v_scales=cpu.v_scales[layer])
                    )
            dense = [
                dequantize(c[layer], s[layer], torch.float64)
                for c, s in ((cpu.keys, cpu.k_scales), (cpu.values, cpu.v_scales))
            ]
            want = decode_attention_reference(q.double(), *dense, view.block_table, view.lengths, cpu.window)
            assert max(_relative(out, want) for out in outs) < 1e-5, (t, layer)
        if kv_dtype == "int8":
            for name in ("keys", "values", "k_scales", "v_scales"):
                assert torch.equal(getattr(gpu, name), getattr(cpu, name)), (t, name)
    assert cpu.k_scales[1].sum() > 1.5 * cpu.k_scales[0].sum()  # layer 1's keys are twice layer 0's: own scales
