"""RoPE fused with the 8-bit KV store: the one kernel (interpreter) writes bit for bit what the unfused Triton path
(`rope_qk_triton` then `store_quantized_triton`) writes, pages, scales and the returned q, and what the torch
reference (`rope_qk_reference` then `store_quantized_reference`) writes; through the pool's `attend_rotary`,
decode and prefill; and the whole LM with an int8 pool gives the unfused path's logits and tokens, launching the
fused kernel once per layer and the standalone store never.

Rows of slots at different absolute positions (their own angles), several heads, a head dim that is not a power of
two, pages handed out out of order, the ring wrapping, padding rows in the scratch slot; fp32 and bf16 inputs.

Two interpreter limits (Triton 3.9) shape the comparisons with the torch reference, never the one with the unfused
Triton path: its fp32 → bf16 cast truncates instead of rounding to nearest even (the GPU's `cvt.rn` rounds), so
for bf16 inputs the reference is fed the rotated key the interpreter rounded (the quantization is then compared
bit for bit) and q is compared within a bf16 step; and it encodes fp8 wrongly (tests/test_kernels_kv_quant.py), so
fp8 codes are compared only between the fused and unfused kernels (the same cast in both), the scales with the
reference too.
"""

from __future__ import annotations

import pytest
import torch

from duplexd.engine.dialogue import lm_gen
from duplexd.engine.dialogue.lm_gen import LMGen
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.kv.paged import PagedBatch, PagedKVCache
from duplexd.engine.weights.demo import random_lm
from duplexd.kernels.dispatch import force_triton
from duplexd.kernels.kv_quant import store_quantized_reference, store_quantized_triton
from duplexd.kernels.rope import rope_angles, rope_qk, rope_qk_reference, rope_qk_triton
from duplexd.kernels.rope_kv_store import (
    rope_store_quantized,
    rope_store_quantized_reference,
    rope_store_quantized_triton,
)
from duplexd.kernels.sampling import sample_reference
from duplexd.kernels.testing import poisoned_allocations

from .test_kernels_kv_quant import DIM, HEADS, _pool  # D = 24: 12 pairs in a block of 16, the masks exercised
from .test_kernels_lm import CFG, PARAMS

POOLS = ("keys", "values", "k_scales", "v_scales")
LM_PAGE = 2  # the LM test's pages


def _qkv(gen: torch.Generator, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """A fused qkv [batch, 3, H, D] as the LM's projection gives it: magnitudes over decades, a zero key head, a
    tiny value head and a key with exact int8 ties (row 2 sits at position 0, where RoPE is the identity)."""
    x = torch.randn(batch, 3, HEADS, DIM, generator=gen) * torch.logspace(-2, 2, batch)[:, None, None, None]
    x[0, 1, 1] = 0.0  # a zero key: scale 0, codes 0
    x[1, 2, 0] = 1e-35  # below TINY: stored as zero
    ties = torch.tensor([15.875, 0.0625, -0.0625, 0.1875, -0.1875, 0.3125])  # scale 1/8: y = 127, ±0.5, ±1.5, 2.5
    x[2, 1, 2] = 0.0
    x[2, 1, 2, : len(ties)] = ties
    return x.to(dtype)


def _pages(kv: PagedKVCache) -> tuple[torch.Tensor, ...]:
    assert kv.k_scales is not None and kv.v_scales is not None
    return kv.keys[0], kv.values[0], kv.k_scales[0], kv.v_scales[0]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_writes_what_the_unfused_path_writes_through_ring_wraps(dtype, kv_dtype):
    """Slot 0 far into a conversation, slot 2 from position 0 and two padding rows in the scratch slot, 9 steps
    (context 3 in pages of 2: the 4-position ring wraps twice, pages straddle the window edge): after every step
    the three pools and the three q agree (module docs)."""
    fused, unfused, ref = (_pool(kv_dtype, context=3, page_size=2, num_pages=6) for _ in range(3))
    gen = torch.Generator().manual_seed(7)
    scratch = fused.scratch_slot
    slots = torch.tensor([0, 2, scratch, scratch])
    steps = 9
    assert steps > 2 * fused.max_pages * fused.page_size and 123_456 % (fused.max_pages * fused.page_size) == 0
    for t in range(steps):
        positions = torch.tensor([123_456 + t, t, 0, 0])
        view = fused.batch(slots, positions)
        cos, sin = rope_angles(positions, DIM, 10_000.0)
        qkv = _qkv(gen, 4, dtype)
        qkv[3] = qkv[2]  # padding rows repeat one row: the scratch page gets one value, as in the engine
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        where = (view.write_page, view.write_offset)
        with poisoned_allocations():
            q_fused = rope_store_quantized_triton(q, k, v, cos, sin, *_pages(fused), *where)
            q_unfused, k_rot = rope_qk_triton(q, k, cos, sin)
            store_quantized_triton(k_rot, v, *_pages(unfused), *where)
        assert q_fused.dtype == dtype and torch.equal(q_fused, q_unfused), t
        if dtype == torch.float32:
            assert torch.equal(rope_store_quantized_reference(q, k, v, cos, sin, *_pages(ref), *where), q_fused), t
        else:  # the interpreter truncates to bf16: the reference quantizes the key the interpreter rotated
            q_ref, _ = rope_qk_reference(q, k, cos, sin)
            torch.testing.assert_close(q_fused, q_ref, rtol=2**-7, atol=0.0)
            store_quantized_reference(k_rot, v, *_pages(ref), *where)
        for name in POOLS:
            assert torch.equal(getattr(fused, name), getattr(unfused, name)), (t, name)
            if kv_dtype == "int8" or name.endswith("scales"):  # the interpreter's fp8 codes are wrong (docs)
                assert torch.equal(getattr(fused, name), getattr(ref, name)), (t, name)
    assert fused.k_scales is not None and (fused.k_scales[0, fused.scratch, 1:] == 0).all(), "scratch: one row"
    owned = torch.from_numpy(fused.host_tables[[0, 2]]).ravel().long()
    assert (fused.k_scales[0, owned].amax(-1) > 0).all(), "every frame of both rings written"


def test_head_dim_two_and_a_single_head():
    """The smallest geometry (one pair, one head: BLOCK_H = BLOCK_P = 1) against the reference."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, 3, 1, 2, generator=gen)
    cos, sin = rope_angles(torch.tensor([3, 0, 99]), 2, 10_000.0)
    pools = [[torch.zeros(2, 2, 1, 2, dtype=torch.int8) for _ in range(2)] + [torch.zeros(2, 2, 1) for _ in range(2)]]
    pools.append([p.clone() for p in pools[0]])
    where = (torch.tensor([0, 1, 1]), torch.tensor([1, 0, 1]))
    with poisoned_allocations():
        q = rope_store_quantized_triton(qkv[:, 0], qkv[:, 1], qkv[:, 2], cos, sin, *pools[0], *where)
    assert torch.equal(q, rope_store_quantized_reference(qkv[:, 0], qkv[:, 1], qkv[:, 2], cos, sin, *pools[1], *where))
    assert all(torch.equal(a, b) for a, b in zip(*pools, strict=True))


def test_bad_arguments_are_refused():
    kv = _pool()
    q = torch.randn(2, HEADS, DIM)
    cos, sin = rope_angles(torch.tensor([0, 1]), DIM, 10_000.0)
    where = (torch.tensor([0, 1]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="cos"):
        rope_store_quantized_triton(q, q, q, cos[:, :3], sin[:, :3], *_pages(kv), *where)
    with pytest.raises(ValueError, match="pages"):
        rope_store_quantized_triton(q[:, :2], q[:, :2], q[:, :2], cos, sin, *_pages(kv), *where)
    bf16 = _pool("bf16")
    with pytest.raises(ValueError, match="not an 8-bit format"):
        rope_store_quantized_triton(q, q, q, cos, sin, bf16.keys[0], bf16.values[0], *_pages(kv)[2:], *where)


def test_dispatcher_runs_the_unfused_reference_on_cpu():
    gen = torch.Generator().manual_seed(2)
    qkv = _qkv(gen, 3, torch.float32)
    cos, sin = rope_angles(torch.tensor([5, 0, 40]), DIM, 10_000.0)
    a, b = _pool(), _pool()
    view = a.batch(torch.tensor([0, 2, a.scratch_slot]), torch.tensor([5, 0, 0]))
    where = (view.write_page, view.write_offset)
    got = rope_store_quantized(qkv[:, 0], qkv[:, 1], qkv[:, 2], cos, sin, *_pages(a), *where)
    q, k = rope_qk_reference(qkv[:, 0], qkv[:, 1], cos, sin)
    store_quantized_reference(k, qkv[:, 2], *_pages(b), *where)
    assert torch.equal(got, q) and all(torch.equal(getattr(a, n), getattr(b, n)) for n in POOLS)


def _unfused_attend_rotary(self, layer, view, q, k, v, cos, sin):
    """What `LMModel.temporal` did before the fusion: `rope_qk`, then `attend` (the standalone store)."""
    q, k = rope_qk(q, k, cos, sin)
    return self.attend(layer, view, q, k, v)


@pytest.mark.parametrize("kv_dtype", ["int8", "bf16"])
def test_pool_attend_rotary_is_rope_then_attend(kv_dtype):
    """Two layers, two decode steps (each reading what the one before wrote) and a prefill view continuing slot 2
    (a run of consecutive positions), on the CPU path and the Triton path: outputs and pools bit for bit those of
    `rope_qk` then `attend`."""
    gen = torch.Generator().manual_seed(3)
    for triton in (False, True):
        pools = _pool(kv_dtype, layers=2), _pool(kv_dtype, layers=2)
        rows = torch.tensor([0, 2, pools[0].scratch_slot])
        steps: list[PagedBatch] = [pools[0].batch(rows, torch.tensor([t + 3, t, 0])) for t in range(2)]
        prefill = pools[0].batch(torch.tensor([2] * 4), torch.arange(2, 6), runs=((0, 4, 2),))  # after the steps
        for view in [*steps, prefill]:
            qkv = _qkv(gen, len(view.lengths), torch.float32)
            cos, sin = rope_angles(view.lengths.long() - 1, DIM, 10_000.0)
            for layer in (0, 1):
                args = (layer, view, qkv[:, 0], qkv[:, 1] * (layer + 1), qkv[:, 2], cos, sin)
                with force_triton(triton):
                    got = pools[0].attend_rotary(*args)
                    want = _unfused_attend_rotary(pools[1], *args)
                assert torch.equal(got, want), (triton, layer)
        for name in ("keys", "values") + (POOLS[2:] if kv_dtype == "int8" else ()):
            assert torch.equal(getattr(pools[0], name), getattr(pools[1], name)), (triton, name)


def _run_lm(model, codes, launched: list[str]) -> list:
    gen = LMGen(model, num_slots=3, page_size=LM_PAGE, kv_dtype="int8")
    # Context 3 in pages of 2: a ring of 4 positions, which both sessions wrap (slot 2 to position 5, slot 0 to 4).
    assert gen.kv.max_pages * LM_PAGE < len(codes) - 1
    for slot in range(3):
        gen.reset(slot, SamplingParams(**{**PARAMS.__dict__, "seed": slot}))
    launched.clear()
    outs = []
    with force_triton():
        gen.step(torch.tensor([2]), codes[0, :1])  # slot 2 starts one frame earlier
        for frame in range(1, len(codes)):
            outs.append(gen.step(torch.tensor([2, 0]), codes[frame], return_logits=True))
    return outs


def test_lm_steps_with_an_int8_pool_match_the_unfused_path(monkeypatch):
    """`LMGen` on the Triton path with an int8 pool (context 3 in pages of 2: the window slides and the ring
    wraps), fused and with `attend_rotary` put back to `rope_qk` then `attend`: the same logits and tokens bit for
    bit; the fused path launches its kernel once per layer per step and never the standalone store or `rope_qk`'s
    kernel. The tokens are drawn by the torch sampler, a function of the logits compared here (the Triton sampler,
    two thirds of the interpreter's time here, is checked against it in tests/test_kernels_lm.py and
    tests/test_kernels_sampling.py)."""
    from triton.runtime.interpreter import InterpretedFunction

    launched: list[str] = []
    run = InterpretedFunction.run

    def counting(self, *args, **kwargs):
        launched.append(self.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counting)
    monkeypatch.setattr(lm_gen, "sample", sample_reference)
    model = random_lm(CFG, seed=0)
    codes = torch.randint(0, CFG.card, (6, 2, CFG.num_user_codebooks), generator=torch.Generator().manual_seed(1))
    fused = _run_lm(model, codes, launched)
    steps = len(codes)
    assert launched.count("_rope_kv_store_kernel") == steps * CFG.num_layers and "_sample_kernel" not in launched
    assert "_store_kv_kernel" not in launched and "_rope_qk_kernel" not in launched
    with monkeypatch.context() as m:
        m.setattr(PagedKVCache, "attend_rotary", _unfused_attend_rotary)
        unfused = _run_lm(model, codes, launched)
    assert launched.count("_store_kv_kernel") == launched.count("_rope_qk_kernel") == steps * CFG.num_layers
    for frame, (a, b) in enumerate(zip(unfused, fused, strict=True)):
        assert torch.equal(a.text_logits, b.text_logits) and torch.equal(a.audio_logits, b.audio_logits), frame
        assert torch.equal(a.tokens, b.tokens), frame
