"""Single-query decode attention over a paged KV cache, split across programs and combined (flash-decoding).

Layout: one page pool per layer for keys and one for values, `[num_pages, page_size, H, D]` (any strides with a
contiguous last dim, so a ring cache's `[slots, H, context, D]` viewed as pages also fits). Row b's logical
position p lives in page `block_table[b, (p // page_size) % max_pages]` at slot `p % page_size`: the row's pages
form a ring of `max_pages * page_size` positions, so a cache may recycle the pages that leave the window (a table
with a column for every page of the history simply never wraps). Row b holds `lengths[b]` positions (this step's
key included) and attends to the last `window` of them, as the reference's ring KV cache does.

Three implementations with one signature: `decode_attention_reference` (per-position gather, the oracle),
`decode_attention_torch` (whole-page gather + fused SDPA, the CPU path) and the Triton kernel (CUDA). Pages may
hold 8-bit codes (int8, fp8 e4m3fn) with an fp32 scale per (key, head) in parallel scale pools
(`kernels.kv_quant`): the kernel loads the codes as fp32 and multiplies the scores by the key scales and the
probabilities by the value scales, one multiply per key; the torch paths dequantize what they gather.

The key range of a row is cut into splits of `split_len` keys, one program per (row, head, split); each writes
its normalised partial output and log-sum-exp, and a second kernel combines the splits. A row with 3000 cached
frames is therefore served by many programs, and the number of splits depends only on static sizes (window,
pool geometry, batch), never on the lengths, so the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from ._triton import tl, triton
from .dispatch import use_triton

BLOCK_N = 64  # keys per inner iteration
# At most 256 keys per split: 128 KiB of bf16 keys and values per program at head dim 128 amortise its setup and its
# 0.5 KiB partial output (< 1% extra traffic), and a 3000-key window becomes 12 programs per head, so any batch
# from 8 rows up fills several waves of an H200 and rows of ragged lengths spread evenly over the SMs.
MAX_SPLIT_LEN = 256


def _window(window: int, page_size: int, max_pages: int) -> int:
    return max(min(window, page_size * max_pages), 0)


def decode_attention_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    window: int,
    scale: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, H, D] over each row's last `min(lengths[b], window)` keys; rows without keys give 0.

    Math in `q`'s dtype promoted to at least fp32 (pass fp64 tensors for an fp64 reference); an 8-bit pool's
    codes are dequantized with `k_scales`, `v_scales` [num_pages, page_size, H] first.
    """
    batch, _, head_dim = q.shape
    page_size, max_pages = k_pages.shape[1], block_table.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    span = min(_window(window, page_size, max_pages), int(lengths.max()) if batch else 0)
    pos = lengths.long()[:, None] - 1 - torch.arange(max(span, 1), device=q.device)  # newest first
    valid = (pos >= 0) & (span > 0)
    pos = pos.clamp(min=0)
    pages = block_table.long().gather(1, (pos // page_size) % max_pages)
    keys, values = k_pages[pages, pos % page_size], v_pages[pages, pos % page_size]  # [B, span, H, D]
    ct = torch.promote_types(q.dtype, torch.float32)
    if k_scales is not None and v_scales is not None:
        keys = keys.to(ct) * k_scales[pages, pos % page_size].to(ct)[..., None]
        values = values.to(ct) * v_scales[pages, pos % page_size].to(ct)[..., None]
    scores = torch.einsum("bhd,bshd->bhs", q.to(ct), keys.to(ct)) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhs,bshd->bhd", probs, values.to(ct)).to(q.dtype)


_workspace = threading.local()


def _gather_pages(pages: torch.Tensor, index: torch.Tensor, name: str) -> torch.Tensor:
    """`pages[index]` into a per-thread buffer reused across calls: a fresh tensor of this size (tens of MB)
    is a fresh mmap whose page faults cost 8x the copy itself. The result is overwritten by the next call."""
    bufs = _workspace.__dict__.setdefault("bufs", {})
    need = index.numel() * pages[0].numel()
    key = (name, pages.dtype, pages.device)
    buf = bufs.get(key)
    if buf is None or buf.numel() < need:
        buf = bufs[key] = torch.empty(need, dtype=pages.dtype, device=pages.device)
    return torch.index_select(pages, 0, index, out=buf[:need].view(index.numel(), *pages.shape[1:]))


def _gather_dequantized(
    pages: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor, dtype: torch.dtype, name: str
) -> torch.Tensor:
    """`_gather_pages`, and for an 8-bit pool its codes times their scales, in `dtype`, in a buffer of its own."""
    codes = _gather_pages(pages, index, name)
    if scales is None:
        return codes
    bufs = _workspace.__dict__.setdefault("bufs", {})
    key = (name + "-dequantized", dtype, pages.device)
    buf = bufs.get(key)
    if buf is None or buf.numel() < codes.numel():
        buf = bufs[key] = torch.empty(codes.numel(), dtype=dtype, device=pages.device)
    out = buf[: codes.numel()].view(codes.shape).copy_(codes)
    return out.mul_(_gather_pages(scales, index, name + "-scales")[..., None])


def decode_attention_torch(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    window: int,
    scale: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_attention` for CPU: gather each row's pages whole (the table columns any row has reached), mask
    every ring entry by the position it holds, and run one fused SDPA. Several times faster than the reference
    at 8 rows over 3000 keys (docs/BENCHMARKS.md). An 8-bit pool's gathered pages are dequantized first (the
    fused SDPA takes no per-key scales).
    """
    batch, heads, head_dim = q.shape
    page_size, max_pages = k_pages.shape[1], block_table.shape[1]
    window = _window(window, page_size, max_pages)
    if batch == 0 or window == 0:
        return torch.zeros_like(q)
    columns = min(max_pages, max(1, -(-int(lengths.max()) // page_size)))
    index = block_table[:, :columns].reshape(-1).long()
    span = columns * page_size
    keys = _gather_dequantized(k_pages, k_scales, index, q.dtype, "k")
    values = _gather_dequantized(v_pages, v_scales, index, q.dtype, "v")
    keys = keys.view(batch, span, heads, head_dim).transpose(1, 2)  # [B, H, span, D]
    values = values.view(batch, span, heads, head_dim).transpose(1, 2)
    # Ring entry r holds the newest position p < length with p = r (mod ring size), if p >= 0.
    ring, last = max_pages * page_size, lengths.long()[:, None] - 1
    held = last - (last - torch.arange(span, device=q.device)) % ring
    valid = (held >= 0) & (held > last - window)
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=valid[:, None, None, :], scale=scale)[
        :, :, 0
    ]
    return out.masked_fill((lengths <= 0)[:, None, None], 0.0)


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    len_ptr,
    po_ptr,
    plse_ptr,
    sq_b,
    sq_h,
    sk_p,
    sk_s,
    sk_h,
    sv_p,
    sv_s,
    sv_h,
    ss_p,
    ss_s,
    sbt_b,
    window,
    page_size,
    max_pages,
    split_len,
    qk_scale,
    head_dim,
    SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (row, head, split): online softmax over the split's keys, in the log2 domain. SCALED: 8-bit codes
    with a scale per (key, head): k's on the scores, v's on the probabilities (fp32 throughout)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    n_heads = tl.num_programs(1)
    n_splits = tl.num_programs(2)
    length = tl.load(len_ptr + b)
    start = tl.maximum(length - window, 0) + split * split_len
    end = tl.minimum(start + split_len, length)

    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    q = tl.load(q_ptr + b * sq_b + h * sq_h + dims, mask=dmask, other=0.0).to(tl.float32) * qk_scale
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        kmask = pos < end
        page = tl.load(bt_ptr + b * sbt_b + (pos // page_size) % max_pages, mask=kmask, other=0).to(tl.int64)
        slot = (pos % page_size).to(tl.int64)
        tile_mask = kmask[:, None] & dmask[None, :]
        k = tl.load(
            k_ptr + page[:, None] * sk_p + slot[:, None] * sk_s + h * sk_h + dims[None, :], mask=tile_mask, other=0.0
        ).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1)
        if SCALED:
            s = s * tl.load(ks_ptr + page * ss_p + slot * ss_s + h, mask=kmask, other=0.0)
        s = tl.where(kmask, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        v = tl.load(
            v_ptr + page[:, None] * sv_p + slot[:, None] * sv_s + h * sv_h + dims[None, :], mask=tile_mask, other=0.0
        ).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        pv = p
        if SCALED:
            pv = p * tl.load(vs_ptr + page * ss_p + slot * ss_s + h, mask=kmask, other=0.0)
        acc = acc * alpha + tl.sum(pv[:, None] * v, axis=0)
        m_i = m_new

    out = (b * n_heads + h) * n_splits + split
    nonempty = l_i > 0
    tl.store(po_ptr + out * head_dim + dims, acc / tl.where(nonempty, l_i, 1.0), mask=dmask)
    tl.store(plse_ptr + out, tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), -float("inf")))


@triton.jit
def _combine_kernel(
    po_ptr,
    plse_ptr,
    o_ptr,
    so_b,
    so_h,
    n_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (row, head): weight each split's output by its share of the softmax mass."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (b * tl.num_programs(1) + h) * n_splits
    splits = tl.arange(0, BLOCK_S)
    smask = splits < n_splits
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    lse = tl.load(plse_ptr + base + splits, mask=smask, other=-float("inf"))
    top = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(top > -float("inf"), top, 0.0))  # empty splits (lse = -inf) weigh 0
    total = tl.sum(w, axis=0)
    parts = tl.load(
        po_ptr + (base + splits[:, None]) * head_dim + dims[None, :], mask=smask[:, None] & dmask[None, :], other=0.0
    )
    out = tl.sum(w[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * so_b + h * so_h + dims, out.to(o_ptr.dtype.element_ty), mask=dmask)


def multiprocessor_count(device: torch.device) -> int | None:
    """SMs of a CUDA device, None elsewhere. A module function so a test can give a `meta` launch an H200's 132
    and compile the grid the GPU would get."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def _default_split_len(batch: int, heads: int, span: int, sms: int | None) -> int:
    """Keys per split: at most MAX_SPLIT_LEN, fewer where the grid would otherwise have under 4 programs per SM,
    never under BLOCK_N (a multiple of it). Static sizes only, never the lengths: a CUDA graph replays the grid."""
    target = 4 * sms if sms else 1
    fill = min(triton.cdiv(target, max(batch * heads, 1)), triton.cdiv(span, BLOCK_N))
    splits = max(triton.cdiv(span, MAX_SPLIT_LEN), fill, 1)
    return triton.cdiv(triton.cdiv(span, splits), BLOCK_N) * BLOCK_N


def decode_attention_triton(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    window: int,
    scale: float | None = None,
    split_len: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton `decode_attention`; `split_len` keys per program (default: sized to fill the GPU)."""
    batch, heads, head_dim = q.shape
    _, page_size, k_heads, k_dim = k_pages.shape
    if (k_heads, k_dim) != (heads, head_dim) or v_pages.shape != k_pages.shape:
        raise ValueError(f"q {list(q.shape)}, k_pages {list(k_pages.shape)}, v_pages {list(v_pages.shape)}")
    if block_table.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"block_table {list(block_table.shape)} and lengths {list(lengths.shape)} for {batch} rows")
    if q.stride(-1) != 1 or k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError("q, k_pages and v_pages need a contiguous last dim")
    scaled = k_scales is not None and v_scales is not None
    ks, vs = (k_scales, v_scales) if k_scales is not None and v_scales is not None else (k_pages, v_pages)
    if scaled and (ks.shape != k_pages.shape[:3] or vs.stride() != ks.stride() or ks.stride(-1) != 1):
        raise ValueError(f"scale pools {list(ks.shape)}, {list(vs.shape)} (contiguous by head) for the pool's pages")
    max_pages = block_table.shape[1]
    window = _window(window, page_size, max_pages)
    span = max(window, 1)
    split_len = split_len or _default_split_len(batch, heads, span, multiprocessor_count(q.device))
    n_splits = triton.cdiv(span, split_len)
    block_table = block_table.to(torch.int32)
    lengths = lengths.to(torch.int32)
    partial = torch.empty((batch, heads, n_splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, heads, n_splits), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    scale = head_dim**-0.5 if scale is None else scale
    block_d = triton.next_power_of_2(head_dim)
    _split_kernel[(batch, heads, n_splits)](
        q,
        k_pages,
        v_pages,
        ks,  # the pages themselves, unread, when not SCALED
        vs,
        block_table,
        lengths,
        partial,
        lse,
        q.stride(0),
        q.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        v_pages.stride(0),
        v_pages.stride(1),
        v_pages.stride(2),
        ks.stride(0) if scaled else 0,
        ks.stride(1) if scaled else 0,
        block_table.stride(0),
        window,
        page_size,
        max_pages,
        split_len,
        scale * math.log2(math.e),
        head_dim,
        SCALED=scaled,
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
    )
    _combine_kernel[(batch, heads)](
        partial,
        lse,
        out,
        out.stride(0),
        out.stride(1),
        n_splits,
        head_dim,
        BLOCK_S=triton.next_power_of_2(n_splits),
        BLOCK_D=block_d,
    )
    return out


def decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    window: int,
    scale: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged single-query attention, [B, H, D] out; Triton on CUDA, `decode_attention_torch` elsewhere. An 8-bit
    pool (`kernels.kv_quant`) passes its scale pools [num_pages, page_size, H] as `k_scales`, `v_scales`."""
    if use_triton(q):
        return decode_attention_triton(
            q, k_pages, v_pages, block_table, lengths, window, scale, k_scales=k_scales, v_scales=v_scales
        )
    return decode_attention_torch(q, k_pages, v_pages, block_table, lengths, window, scale, k_scales, v_scales)
