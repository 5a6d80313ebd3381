"""Paged single-query decode attention: both Triton kernels (interpreter) against the fp64 torch reference and a
naive loop.

One shared pool serves all rows, pages are handed out in random order, rows have ragged lengths (one of a single
key, one longer than the window), the block table may wrap (a ring of pages), and every split-K program's
partial output is poisoned before the call. The "paged" kernel's own edges: lengths at and around its page and
split boundaries, a window whose first and last pages share a ring column, pages of several tiles, 8-bit codes.
"""

from __future__ import annotations

import pytest
import torch

from duplexd.kernels import decode_attention as da
from duplexd.kernels.decode_attention import (
    BLOCK_N,
    MAX_SPLIT_LEN,
    PAGED_SPLIT_KEYS,
    decode_attention,
    decode_attention_paged,
    decode_attention_reference,
    decode_attention_torch,
    decode_attention_triton,
)
from duplexd.kernels.dispatch import force_triton
from duplexd.kernels.kv_quant import dequantize, quantize_reference
from duplexd.kernels.testing import poisoned_allocations


def _case(seed, batch=3, heads=3, head_dim=24, page_size=5, max_pages=5, num_pages=17, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    k_pages = torch.randn(num_pages, page_size, heads, head_dim, generator=g).to(dtype)
    v_pages = torch.randn(num_pages, page_size, heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(num_pages, generator=g)[: batch * max_pages].view(batch, max_pages).to(torch.int32)
    return q, k_pages, v_pages, table


def _naive(q, k_pages, v_pages, table, lengths, window):
    """Row by row, key by key, in fp64: the definition the kernel and the reference implement."""
    page_size, max_pages = k_pages.shape[1], table.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, length in enumerate(lengths.tolist()):
        positions = range(max(0, length - window), length)
        if not positions:
            continue
        keys = torch.stack([k_pages[table[b, (p // page_size) % max_pages], p % page_size] for p in positions])
        values = torch.stack([v_pages[table[b, (p // page_size) % max_pages], p % page_size] for p in positions])
        scores = torch.einsum("hd,shd->hs", q[b].double(), keys.double()) * q.shape[-1] ** -0.5
        out[b] = torch.einsum("hs,shd->hd", scores.softmax(-1), values.double())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, split_len", [(11, 4), (25, 64), (1000, 7)])
def test_matches_reference_on_a_shared_out_of_order_pool(window, split_len, dtype):
    q, k_pages, v_pages, table = _case(seed=window, dtype=dtype)
    lengths = torch.tensor([17, 1, 23])  # ragged; 17 and 23 exceed the window of 11
    with poisoned_allocations():
        out = decode_attention_triton(q, k_pages, v_pages, table, lengths, window, split_len=split_len)
    want = decode_attention_reference(q.double(), k_pages.double(), v_pages.double(), table, lengths, window)
    torch.testing.assert_close(want, _naive(q, k_pages, v_pages, table, lengths, window), rtol=1e-12, atol=1e-12)
    assert out.dtype == dtype and torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.double() - want).abs().max() <= tol


def test_ring_of_pages_and_an_empty_row():
    """A 3-page table is a ring of 15 positions: a window of 12 over 40 cached frames wraps around it."""
    q, k_pages, v_pages, table = _case(seed=5, batch=4, heads=2, head_dim=7, max_pages=3, num_pages=12)
    lengths = torch.tensor([40, 0, 13, 2])
    with poisoned_allocations():
        out = decode_attention_triton(q, k_pages, v_pages, table, lengths, 12, split_len=5)
    want = _naive(q, k_pages, v_pages, table, lengths, 12)
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    assert (out.double() - want).abs().max() <= 1e-5
    ref = decode_attention_reference(q.double(), k_pages.double(), v_pages.double(), table, lengths, 12)
    torch.testing.assert_close(ref, want)


def test_default_split_and_strided_pool_views():
    """Pools given as strided views (a ring cache [slots, H, context, D] seen as [slots, context, H, D])."""
    q, _, _, _ = _case(seed=6, batch=2, heads=3, head_dim=16)
    g = torch.Generator().manual_seed(7)
    ring_k, ring_v = torch.randn(4, 3, 30, 16, generator=g), torch.randn(4, 3, 30, 16, generator=g)
    k_pages, v_pages = ring_k.transpose(1, 2), ring_v.transpose(1, 2)
    table = torch.tensor([[3], [1]], dtype=torch.int32)
    lengths = torch.tensor([75, 9])  # row 0 has wrapped around its ring of 30
    with poisoned_allocations():
        out = decode_attention_triton(q, k_pages, v_pages, table, lengths, 30)
    want = _naive(q, k_pages, v_pages, table, lengths, 30)
    assert (out.double() - want).abs().max() <= 1e-5
    with force_triton():
        torch.testing.assert_close(decode_attention(q, k_pages, v_pages, table, lengths, 30), out)
    torch.testing.assert_close(decode_attention(q, k_pages, v_pages, table, lengths, 30), want.float())


@pytest.mark.parametrize("sms", [None, 132])
def test_default_splits_with_short_rows_and_rows_past_the_window(sms, monkeypatch):
    """The heuristic's own split count (one per 256 keys on CPU, one per 64 with an H200's SMs): a row of 5 keys
    (shorter than a split, the other splits empty), one just past a split, one past the window whose ring of
    pages wrapped, and an empty row."""
    monkeypatch.setattr(da, "multiprocessor_count", lambda device: sms)
    window, page_size, max_pages = 600, 16, 40
    q, k_pages, v_pages, table = _case(
        seed=8, batch=4, heads=2, head_dim=16, page_size=page_size, max_pages=max_pages, num_pages=4 * max_pages + 3
    )
    split_len = da._default_split_len(4, 2, window, sms)
    assert -(-window // split_len) == (3 if sms is None else 10)
    lengths = torch.tensor([5, split_len + 4, 0, 900])
    with poisoned_allocations():
        out = decode_attention_triton(q, k_pages, v_pages, table, lengths, window)
    want = _naive(q, k_pages, v_pages, table, lengths, window)
    assert torch.isfinite(out).all() and (out[2] == 0).all()
    assert (out.double() - want).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "batch, split_len, splits", [(1, 192, 16), (8, 256, 12), (32, 256, 12), (64, 256, 12), (128, 256, 12)]
)
def test_split_heuristic_on_an_h200(batch, split_len, splits):
    """Moshi 7B (32 heads, a 3000-frame window) on 132 SMs: 16 splits of 192 keys (512 programs, 4 per SM) for one
    row, then never more than 256 keys per split, so a batch of 32 is 12288 programs, not 1024 whole windows."""
    got = da._default_split_len(batch, 32, 3000, 132)
    assert (got, -(-3000 // got)) == (split_len, splits)


def test_split_heuristic_bounds():
    for sms in (None, 1, 132):
        for batch in (1, 2, 3, 8, 17, 64, 256):
            for span in (1, 63, 64, 65, 700, 3000, 10_000):
                split_len = da._default_split_len(batch, 32, span, sms)
                splits = -(-span // split_len)
                assert split_len % BLOCK_N == 0 and BLOCK_N <= split_len <= MAX_SPLIT_LEN
                if sms:  # 4 programs per SM (or a split per BLOCK_N keys), less at most half by whole-tile rounding
                    assert 2 * batch * 32 * splits >= min(4 * sms, batch * 32 * -(-span // BLOCK_N))


@pytest.mark.parametrize("window", [1, 11, 12, 15, 1000])
def test_cpu_path_matches_the_definition(window):
    """The CPU path (whole-page gather + SDPA): ragged rows, an empty row, rows that wrapped their ring of
    pages, windows shorter than, equal to and longer than the ring; twice, as its gather buffer is reused."""
    q, k_pages, v_pages, table = _case(seed=window, batch=5, heads=2, head_dim=7, max_pages=3, num_pages=16)
    for lengths in (torch.tensor([40, 0, 13, 2, 15]), torch.tensor([3, 1, 1, 16, 5])):
        out = decode_attention_torch(q, k_pages, v_pages, table, lengths, window)
        want = _naive(q, k_pages, v_pages, table, lengths, min(window, 15))
        assert (out.double() - want).abs().max() <= 1e-5, lengths
    q, ring_k = torch.randn(2, 3, 7), torch.randn(4, 3, 30, 7)
    strided = ring_k.transpose(1, 2)  # a pool given as a strided view
    lengths, table = torch.tensor([75, 9]), torch.tensor([[3], [1]], dtype=torch.int32)
    out = decode_attention_torch(q, strided, strided, table, lengths, 30)
    want = _naive(q, strided, strided, table, lengths, 30)
    assert (out.double() - want).abs().max() <= 1e-5


def _paged(q, k_pages, v_pages, table, lengths, window, **kwargs):
    """`decode_attention_paged` with every partial output poisoned, checked against the naive loop (fp32 or bf16
    tolerance by q's dtype); its output."""
    with poisoned_allocations():
        out = decode_attention_paged(q, k_pages, v_pages, table, lengths, window, **kwargs)
    want = _naive(q, k_pages, v_pages, table, lengths, min(window, k_pages.shape[1] * table.shape[1]))
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert (out.double() - want).abs().max() <= (1e-5 if q.dtype == torch.float32 else 2e-2)
    assert (out[lengths == 0] == 0).all()
    return out


def test_paged_kernel_at_page_and_split_edges():
    """Pages of 4 in a ring of 5 (20 positions), a window of 14 (its first key inside a page) and splits of 2 pages:
    lengths at, before and after a page boundary (4, 5), a split boundary (8, 9), the window (14, 15) and the ring
    (20, 21), and far past it, in one batch with an empty row."""
    lengths = torch.tensor([0, 1, 4, 5, 8, 9, 14, 15, 20, 21, 45])
    q, k_pages, v_pages, table = _case(
        seed=11, batch=len(lengths), heads=2, head_dim=16, page_size=4, max_pages=5, num_pages=59
    )
    _paged(q, k_pages, v_pages, table, lengths, 14, split_len=8)


def test_paged_kernel_window_of_the_whole_ring_and_default_splits(monkeypatch):
    """A window as long as the ring: its first and last pages are partial and in one table column. The default split
    on an H200's 132 SMs (one page per split, this batch being small); bf16."""
    monkeypatch.setattr(da, "multiprocessor_count", lambda device: 132)
    lengths = torch.tensor([21, 0, 47])
    q, k_pages, v_pages, table = _case(
        seed=12, batch=3, heads=2, head_dim=16, page_size=4, max_pages=5, num_pages=17, dtype=torch.bfloat16
    )
    _paged(q, k_pages, v_pages, table, lengths, 25)


def test_paged_kernel_with_pages_of_several_tiles(monkeypatch):
    """Pages of 6 keys in tiles of 4 (a page's second tile is half masked), splits of one page (rounded up from 5
    keys)."""
    monkeypatch.setattr(da, "PAGED_BLOCK_N", 4)
    lengths = torch.tensor([5, 13, 30])
    q, k_pages, v_pages, table = _case(seed=13, batch=3, heads=2, head_dim=16, page_size=6, max_pages=4, num_pages=14)
    _paged(q, k_pages, v_pages, table, lengths, 17, split_len=5)


@pytest.mark.parametrize("codes", [torch.int8, torch.float8_e4m3fn])
def test_paged_kernel_over_8bit_codes(codes):
    """Codes with a scale per (key, head), magnitudes spread over 4 decades (the other way round for values, so
    scales applied to the wrong side are far off): equal to attention over the dequantized pool."""
    lengths = torch.tensor([23, 0, 9])
    q, k_pages, v_pages, table = _case(seed=14, heads=2, head_dim=16, page_size=4, max_pages=5, num_pages=17)
    spread = torch.logspace(-2, 2, 17 * 4).view(17, 4, 1, 1)
    (kc, ks), (vc, vs) = (
        quantize_reference(k_pages * spread, codes),
        quantize_reference(v_pages * spread.flip(0), codes),
    )
    keys, values = dequantize(kc, ks, torch.float64), dequantize(vc, vs, torch.float64)
    with poisoned_allocations():
        out = decode_attention_paged(q, kc, vc, table, lengths, 18, split_len=8, k_scales=ks, v_scales=vs)
    want = decode_attention_reference(q.double(), keys, values, table, lengths, 18)
    assert float((out.double() - want).norm() / want.norm()) < 1e-5 and (out[1] == 0).all()
    swapped = (dequantize(kc, vs, torch.float64), dequantize(vc, ks, torch.float64))
    wrong = decode_attention_reference(q.double(), *swapped, table, lengths, 18)
    assert float((wrong - want).norm() / want.norm()) > 0.1


def test_paged_kernel_on_strided_views_through_the_dispatch():
    """A ring cache [slots, H, context, D] seen as pages of 30 (tiles of 32, masked), row 0 wrapped around its
    ring; `decode_attention(kernel="paged")` runs it, and a kernel not in ATTENTION_KERNELS is refused."""
    q, _, _, _ = _case(seed=15, batch=2, heads=3, head_dim=16)
    g = torch.Generator().manual_seed(16)
    k_pages = torch.randn(4, 3, 30, 16, generator=g).transpose(1, 2)
    v_pages = torch.randn(4, 3, 30, 16, generator=g).transpose(1, 2)
    table, lengths = torch.tensor([[3], [1]], dtype=torch.int32), torch.tensor([75, 9])
    out = _paged(q, k_pages, v_pages, table, lengths, 30)
    with force_triton():
        assert torch.equal(decode_attention(q, k_pages, v_pages, table, lengths, 30, kernel="paged"), out)
        with pytest.raises(ValueError, match="not one of split, paged"):
            decode_attention(q, k_pages, v_pages, table, lengths, 30, kernel="tiles")


@pytest.mark.parametrize("batch, split_pages, splits", [(1, 3, 16), (4, 8, 6), (8, 8, 6), (32, 8, 6), (128, 8, 6)])
def test_paged_split_heuristic_on_an_h200(batch, split_pages, splits):
    """Moshi 7B (32 heads, a 3000-frame window over 64-frame pages: 48 pages a window may touch) on 132 SMs: 16
    splits of 3 pages (512 programs) for one row; from 4 rows on, splits of PAGED_SPLIT_KEYS keys."""
    got = da._paged_split_pages(batch, 32, 48, 64, 132)
    assert (got, -(-48 // got)) == (split_pages, splits)
    assert 8 * 64 == PAGED_SPLIT_KEYS


def test_paged_split_heuristic_bounds():
    for sms in (None, 1, 132):
        for batch in (1, 3, 8, 64, 256):
            for page_size in (1, 5, 64, 1024):
                for pages in (1, 2, 7, 48, 300):
                    split_pages = da._paged_split_pages(batch, 32, pages, page_size, sms)
                    splits = -(-pages // split_pages)
                    assert 1 <= split_pages <= max(PAGED_SPLIT_KEYS // page_size, 1)
                    if sms:  # 4 programs per SM (or a split per page), less at most half by whole-page rounding
                        assert 2 * batch * 32 * splits >= min(4 * sms, batch * 32 * pages)
