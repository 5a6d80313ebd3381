"""The paged KV cache: page accounting, and the reference's window semantics on a fragmented pool of small pages."""

from __future__ import annotations

import random

import pytest
import torch

from duplexd.engine.dialogue.lm_gen import LMGen
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.errors import CapacityError
from duplexd.engine.kv.paged import PagedKVCache
from duplexd.engine.models.config import LMConfig

from .ref_models import reference_lm
from .test_lm_parity import SMALL, ReferenceRun, _write

GREEDY = SamplingParams(text_temperature=0.0, text_topk=1, audio_temperature=0.0, audio_topk=1)


def _pool(num_pages=10, page_size=8, context=24, slots=4) -> PagedKVCache:
    return PagedKVCache(
        num_layers=2,
        num_heads=2,
        head_dim=4,
        context=context,
        num_slots=slots,
        num_pages=num_pages,
        page_size=page_size,
    )


def test_allocation_accounting():
    kv = _pool()
    assert kv.max_pages == 3 and kv.pages_needed() == 3 and kv.pages_needed(5) == 1 and kv.pages_needed(100) == 3
    kv.allocate(0)
    kv.allocate(1, frames=9)
    assert kv.pages_used == 5 and kv.sessions_fit() == 1 and kv.sessions_fit(8) == 5
    tables = kv.host_tables
    owned = set(tables[0].tolist()) | set(tables[1, :2].tolist())
    assert len(owned) == 5 and kv.scratch not in owned, "pages are distinct and never the scratch page"
    assert tables[1, 2] == kv.scratch and (tables[2:] == kv.scratch).all(), "the scratch slot's row included"
    assert (kv.tables == kv.scratch).all(), "admission is host bookkeeping: the device table waits for upload"
    kv.upload(1)
    assert kv.tables[1].tolist() == tables[1].tolist() and (kv.tables[0] == kv.scratch).all()
    kv.allocate(2)
    with pytest.raises(CapacityError, match="3 pages of 8 frames, 2 of 10 are free"):
        kv.allocate(3)
    with pytest.raises(ValueError, match="already holds pages"):
        kv.allocate(2)
    kv.free(0)
    kv.free(0)  # idempotent
    assert kv.pages_used == 5 and (kv.host_tables[0] == kv.scratch).all()
    with pytest.raises(ValueError, match="out of range"):
        kv.allocate(kv.scratch_slot)
    kv.allocate(3)
    for slot in (1, 2, 3):
        kv.free(slot)
    assert kv.pages_free == kv.num_pages


def test_batch_view_writes_where_the_table_says():
    kv = _pool()
    kv.allocate(2)
    kv.upload(2)
    slots, positions = torch.tensor([2, 0]), torch.tensor([17, 5])  # slot 0 holds no pages: scratch
    view = kv.batch(slots, positions)
    assert view.write_page.tolist() == [int(kv.tables[2, 2]), kv.scratch]
    assert view.write_offset.tolist() == [1, 5] and view.lengths.tolist() == [18, 6]
    later = kv.batch(torch.tensor([2]), torch.tensor([17 + 24]))  # one window later: the same page, recycled
    assert later.write_page.tolist() == view.write_page[:1].tolist()


def test_reference_greedy_tokens_past_the_window_on_fragmented_pages(tmp_path):
    """Context 24 in pages of 5 frames (so pages straddle the window edge), two sessions at different positions
    on a pool whose pages were handed out out of order, run for 3x the context: the reference's greedy tokens."""
    from duplexd.engine.weights.checkpoint import load_lm

    cfg = LMConfig(**SMALL, context=24)
    ref_lm = reference_lm(cfg, seed=5)
    model = load_lm(_write(ref_lm, cfg, tmp_path, "fused"), cfg)
    kv = model.new_kv_cache(num_slots=3, num_pages=13, page_size=5)
    random.Random(0).shuffle(kv._free)  # pages handed out in no particular order, interleaved between slots
    kv.allocate(2)
    kv.allocate(1)
    assert sorted(kv.host_tables[1].tolist()) != kv.host_tables[1].tolist()
    gen = LMGen(model, num_slots=3, kv=kv)
    for slot in (1, 2):
        gen.reset(slot, GREEDY)
    frames = 3 * cfg.context + 3
    codes = torch.randint(0, cfg.card, (2, frames, cfg.num_user_codebooks), generator=torch.Generator().manual_seed(6))
    refs = [ReferenceRun(ref_lm), ReferenceRun(ref_lm)]
    starts = {0: 0, 1: 7}  # session 1 joins 7 frames later
    texts = set()
    for t in range(frames + 7):
        rows = [s for s in (0, 1) if starts[s] <= t < starts[s] + frames]
        slots = torch.tensor([1 + s for s in rows])
        batch = torch.stack([codes[s, t - starts[s]] for s in rows])
        out = gen.step(slots, batch)
        for row, s in enumerate(rows):
            expected, _, _ = refs[s].step(codes[s, t - starts[s]])
            if expected is None:
                assert not out.valid[row]
                continue
            assert torch.equal(out.tokens[row], expected[0, :, 0]), f"session {s}, frame {t - starts[s]}"
            texts.add(int(out.tokens[row, 0]))
    assert len(texts) > 3
