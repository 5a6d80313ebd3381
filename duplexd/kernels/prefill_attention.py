"""Causal attention of a run of consecutive positions of one slot over its paged KV cache (a prompt's prefill).

A persona prompt's rows are positions first..first+k-1 of one slot, whose keys and values are all in the pages
already. Each row could be a decode query of its own (`decode_attention`, which the GPU runs: one program per row
reading the pages in place), but on CPU that gathers the slot's pages once per row. Here the run gathers its key
span once and runs one SDPA with a causal, windowed mask: row i sees positions max(0, p - window + 1)..p, with
p = first + i, exactly as `decode_attention_reference` with lengths p + 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_quant import dequantize


def causal_paged_attention_torch(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    first: int,
    window: int,
    scale: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [k, H, D] for positions first..first+k-1 of the slot whose block-table row is `table` [max_pages]
    (its pages a ring, as in `decode_attention`); out [k, H, D]. An 8-bit pool's codes are dequantized with their
    scale pools `k_scales`, `v_scales` [num_pages, page_size, H] as they are gathered."""
    rows, _, head_dim = q.shape
    page_size, max_pages = k_pages.shape[1], table.shape[0]
    window = max(min(window, page_size * max_pages), 1)
    last = first + rows - 1
    low = max(0, first - window + 1)
    positions = torch.arange(low, last + 1, device=q.device)
    pages = table.long()[(positions // page_size) % max_pages]
    slots = positions % page_size
    keys, values = k_pages[pages, slots], v_pages[pages, slots]  # [n, H, D]
    if k_scales is not None and v_scales is not None:
        keys, values = (
            dequantize(keys, k_scales[pages, slots], q.dtype),
            dequantize(values, v_scales[pages, slots], q.dtype),
        )
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [H, n, D]
    query = positions[None, :] <= torch.arange(first, last + 1, device=q.device)[:, None]
    visible = query & (positions[None, :] > torch.arange(first, last + 1, device=q.device)[:, None] - window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=visible, scale=scale)
    return out.transpose(0, 1)
