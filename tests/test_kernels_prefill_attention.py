"""The CPU prefill attention (one causal call per run of a slot's rows) against the decode reference, one query
per row, over a paged ring cache: several heads, odd sizes, runs that start mid-page, a window shorter than the
run's reach, and pages scattered in the pool."""

from __future__ import annotations

import pytest
import torch

from duplexd.kernels.decode_attention import decode_attention_reference
from duplexd.kernels.prefill_attention import causal_paged_attention_torch


@pytest.mark.parametrize(
    ("first", "rows", "window"),
    [(0, 1, 64), (0, 37, 64), (13, 29, 64), (40, 23, 17), (5, 60, 1000)],
)
def test_matches_one_decode_query_per_row(first, rows, window):
    gen = torch.Generator().manual_seed(first * 100 + rows)
    heads, dim, page_size, max_pages, pool = 3, 24, 8, 12, 20
    k_pages = torch.randn(pool, page_size, heads, dim, generator=gen, dtype=torch.float64)
    v_pages = torch.randn(pool, page_size, heads, dim, generator=gen, dtype=torch.float64)
    table = torch.randperm(pool, generator=gen)[:max_pages].to(torch.int32)
    q = torch.randn(rows, heads, dim, generator=gen, dtype=torch.float64) * 3  # sharp: far from uniform attention
    out = causal_paged_attention_torch(q, k_pages, v_pages, table, first, window)
    lengths = torch.arange(first + 1, first + rows + 1, dtype=torch.int32)
    ref = decode_attention_reference(q, k_pages, v_pages, table.expand(rows, -1), lengths, window)
    assert (out - ref).abs().max() < 1e-10
    # Sensitive: the last position's key and value change the last row's output, and no earlier row's.
    newest = table[(first + rows - 1) // page_size].long(), (first + rows - 1) % page_size
    k_pages[newest] += 1.0
    v_pages[newest] += 1.0
    again = causal_paged_attention_torch(q, k_pages, v_pages, table, first, window)
    assert (again[-1] - out[-1]).abs().max() > 1e-3
    if rows > 1:
        assert torch.equal(again[:-1], out[:-1])
