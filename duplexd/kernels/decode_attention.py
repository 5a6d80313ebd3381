"""Single-query decode attention over a paged KV cache, split across programs and combined (flash-decoding).

Layout: one page pool per layer for keys and one for values, `[num_pages, page_size, H, D]` (any strides with a
contiguous last dim, so a ring cache's `[slots, H, context, D]` viewed as pages also fits). Row b's logical
position p lives in page `block_table[b, (p // page_size) % max_pages]` at slot `p % page_size`: the row's pages
form a ring of `max_pages * page_size` positions, so a cache may recycle the pages that leave the window (a table
with a column for every page of the history simply never wraps). Row b holds `lengths[b]` positions (this step's
key included) and attends to the last `window` of them, as the reference's ring KV cache does.

Four implementations with one signature: `decode_attention_reference` (per-position gather, the oracle),
`decode_attention_torch` (whole-page gather + fused SDPA, the CPU path) and two Triton kernels (CUDA, chosen by
`decode_attention(kernel=...)`, one of `ATTENTION_KERNELS`). Pages may hold 8-bit codes (int8, fp8 e4m3fn) with an
fp32 scale per (key, head) in parallel scale pools (`kernels.kv_quant`): the kernels load the codes as fp32 and
multiply the scores by the key scales and the probabilities by the value scales, one multiply per key; the torch
paths dequantize what they gather.

Both kernels cut a row's keys into splits, one program per (row, head, split); each writes its normalised
partial output and log-sum-exp, and `_combine_kernel` weighs the splits. A row with 3000 cached frames is
therefore served by many programs, and the number of splits depends only on static sizes (window, pool
geometry, batch, SM count), never on the lengths, so the launch can be captured in a CUDA graph.

"split" (`decode_attention_triton`): splits of `split_len` keys from the window's first key, tiles of BLOCK_N
keys wherever they fall, so each key looks up its own page in the block table.

"paged" (`decode_attention_paged`), for more of the copy bandwidth at large batches:
- Splits of whole pages, and tiles inside one page (the engine's 64-key page is one tile; BLOCK_N is the page size
  rounded up to a power of two, at most PAGED_BLOCK_N): one block-table load per tile, and a tile is BLOCK_N rows of
  one head in one page, at one stride from a single base, so the compiler proves 16-byte alignment and issues
  vector loads. The window's first and last pages are partial (masked).
- Loads in flight: `tl.range(num_stages=PAGED_STAGES)` makes Triton copy the next tiles' K, V (and scales) into
  shared memory asynchronously while this tile's math runs, so a program keeps two tiles (32 KiB at head dim 128,
  bf16) in flight beside its arithmetic instead of waiting on each load in turn.
- An online softmax per key lane: lane j keeps its own running max, sum and [BLOCK_D] accumulator for keys j,
  j + BLOCK_N, ... of the split, so a tile needs no reduction across keys (only each key's dot product across
  its head dim, within a warp); the lanes merge once at the end. It costs one more exp2 per key, far from the
  memory bound.
- num_warps so a thread holds 32 elements of a tile (8 warps for 64 keys × 128 dims): the per-lane accumulator,
  the tile and the pipeline's addresses fit without spills (tests/sm90_compile.py).
- Up to PAGED_SPLIT_KEYS keys per split, fewer only while the grid would have under 4 programs per SM: long
  splits amortise each program's start (length, table and q loads before the first tile, the pipeline's fill)
  and its partial output. Heads are the grid's fastest axis, so programs that run together read neighbouring
  rows of the same pages (and the same 32-byte sectors of an 8-bit pool's scales).
- The combine stays a second small kernel: it reads `splits × head_dim` fp32 per (row, head), under 1 % of the
  window's bytes.
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
PAGED_BLOCK_N = 64  # keys per tile of the paged kernel (fewer for a smaller page)
PAGED_SPLIT_KEYS = 512  # the paged kernel's longest split: 6 programs per head over a 3000-key window of 64-key pages
PAGED_STAGES = 3  # the paged kernel's software pipeline: two tiles in flight while one is used


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


@triton.jit
def _paged_kernel(
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
    max_pages,
    split_pages,
    qk_scale,
    head_dim,
    SCALED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Program (head, row, split): the split's `split_pages` pages of the row's window, a tile of BLOCK_N slots of
    one page per iteration (tile t: page t // TILES, slots from (t % TILES) * BLOCK_N), with an online softmax per
    key lane in the log2 domain, the lanes merged at the end. SCALED as in `_split_kernel`."""
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    TILES: tl.constexpr = (PAGE_SIZE + BLOCK_N - 1) // BLOCK_N  # tiles per page
    length = tl.load(len_ptr + b)
    first = tl.maximum(length - window, 0)
    last = length - 1
    lo = (first // PAGE_SIZE + split * split_pages) * TILES
    end = tl.where(length > 0, last // PAGE_SIZE * TILES + last % PAGE_SIZE // BLOCK_N + 1, 0)
    hi = tl.minimum(lo + split_pages * TILES, end)

    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    q = tl.load(q_ptr + b * sq_b + h * sq_h + dims, mask=dmask, other=0.0).to(tl.float32) * qk_scale
    m_i = tl.full([BLOCK_N], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    table = bt_ptr + b * sbt_b
    for t in tl.range(lo, hi, num_stages=STAGES):
        page = tl.load(table + t // TILES % max_pages).to(tl.int64)
        slot = t % TILES * BLOCK_N + tl.arange(0, BLOCK_N)
        pos = t // TILES * PAGE_SIZE + slot
        live = (pos >= first) & (pos < length)
        if PAGE_SIZE % BLOCK_N != 0:
            live &= slot < PAGE_SIZE
        tile = live[:, None] & dmask[None, :]
        k = tl.load(k_ptr + page * sk_p + h * sk_h + slot[:, None] * sk_s + dims[None, :], mask=tile, other=0.0)
        v = tl.load(v_ptr + page * sv_p + h * sv_h + slot[:, None] * sv_s + dims[None, :], mask=tile, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
        if SCALED:
            s *= tl.load(ks_ptr + page * ss_p + slot * ss_s + h, mask=live, other=0.0)
        s = tl.where(live, s, -float("inf"))
        m_new = tl.maximum(m_i, s)
        base = tl.where(m_new > -float("inf"), m_new, 0.0)  # a lane without a key yet keeps l = acc = 0
        alpha = tl.exp2(m_i - base)
        p = tl.exp2(s - base)
        l_i = l_i * alpha + p
        if SCALED:
            p *= tl.load(vs_ptr + page * ss_p + slot * ss_s + h, mask=live, other=0.0)
        acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
        m_i = m_new

    m = tl.max(m_i, axis=0)
    w = tl.exp2(m_i - tl.where(m > -float("inf"), m, 0.0))
    l_sum = tl.sum(l_i * w, axis=0)
    nonempty = l_sum > 0
    out = (b * tl.num_programs(0) + h) * tl.num_programs(2) + split
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(nonempty, l_sum, 1.0)
    tl.store(po_ptr + out * head_dim + dims, o, mask=dmask)
    tl.store(plse_ptr + out, tl.where(nonempty, m + tl.log2(tl.where(nonempty, l_sum, 1.0)), -float("inf")))


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


def _checked(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """The Triton kernels' argument checks; (SCALED, the key and value scale pools, or the pages themselves, unread,
    when not SCALED)."""
    batch, heads, head_dim = q.shape
    _, _, k_heads, k_dim = k_pages.shape
    if (k_heads, k_dim) != (heads, head_dim) or v_pages.shape != k_pages.shape:
        raise ValueError(f"q {list(q.shape)}, k_pages {list(k_pages.shape)}, v_pages {list(v_pages.shape)}")
    if block_table.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"block_table {list(block_table.shape)} and lengths {list(lengths.shape)} for {batch} rows")
    if q.stride(-1) != 1 or k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError("q, k_pages and v_pages need a contiguous last dim")
    if k_scales is None or v_scales is None:
        return False, k_pages, v_pages
    if k_scales.shape != k_pages.shape[:3] or v_scales.stride() != k_scales.stride() or k_scales.stride(-1) != 1:
        raise ValueError(
            f"scale pools {list(k_scales.shape)}, {list(v_scales.shape)} (contiguous by head) for the pool's pages"
        )
    return True, k_scales, v_scales


def _split_args(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    partial: torch.Tensor,
    lse: torch.Tensor,
    scaled: bool,
) -> tuple:
    """The arguments both split kernels take first: the tensors (`ks`, `vs` the pages themselves, unread, when not
    `scaled`) and the strides of q, the pools, the scale pools and the table."""
    scale_strides = (ks.stride(0), ks.stride(1)) if scaled else (0, 0)
    return (
        *(q, k_pages, v_pages, ks, vs, block_table, lengths, partial, lse),
        *(q.stride(0), q.stride(1), *k_pages.stride()[:3], *v_pages.stride()[:3], *scale_strides),
        block_table.stride(0),
    )


def _combine(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`_combine_kernel` over the splits' `partial` [B, H, splits, D] and `lse` [B, H, splits] into `out`."""
    batch, heads, n_splits, head_dim = partial.shape
    _combine_kernel[(batch, heads)](
        partial,
        lse,
        out,
        out.stride(0),
        out.stride(1),
        n_splits,
        head_dim,
        BLOCK_S=triton.next_power_of_2(n_splits),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out


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
    """Triton `decode_attention` ("split"); `split_len` keys per program (default: sized to fill the GPU)."""
    batch, heads, head_dim = q.shape
    page_size, max_pages = k_pages.shape[1], block_table.shape[1]
    scaled, ks, vs = _checked(q, k_pages, v_pages, block_table, lengths, k_scales, v_scales)
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
        *_split_args(q, k_pages, v_pages, ks, vs, block_table, lengths, partial, lse, scaled),
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
    return _combine(partial, lse, out)


def _paged_split_pages(batch: int, heads: int, pages: int, page_size: int, sms: int | None) -> int:
    """Pages per split of the paged kernel: up to PAGED_SPLIT_KEYS keys, fewer where the grid would otherwise have
    under 4 programs per SM. Static sizes only, never the lengths: a CUDA graph replays the grid."""
    target = 4 * sms if sms else 1
    fill = min(triton.cdiv(target, max(batch * heads, 1)), pages)
    splits = max(triton.cdiv(pages, max(PAGED_SPLIT_KEYS // page_size, 1)), fill, 1)
    return triton.cdiv(pages, splits)


def decode_attention_paged(
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
    """Triton `decode_attention` ("paged"); `split_len` keys per program, rounded up to whole pages (default:
    sized to fill the GPU)."""
    batch, heads, head_dim = q.shape
    page_size, max_pages = k_pages.shape[1], block_table.shape[1]
    scaled, ks, vs = _checked(q, k_pages, v_pages, block_table, lengths, k_scales, v_scales)
    window = _window(window, page_size, max_pages)
    pages = triton.cdiv(max(window - 1, 0), page_size) + 1  # the most pages a window's keys touch
    sms = multiprocessor_count(q.device)
    split_pages = (
        triton.cdiv(split_len, page_size) if split_len else _paged_split_pages(batch, heads, pages, page_size, sms)
    )
    n_splits = triton.cdiv(pages, split_pages)
    block_table = block_table.to(torch.int32)
    lengths = lengths.to(torch.int32)
    partial = torch.empty((batch, heads, n_splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, heads, n_splits), dtype=torch.float32, device=q.device)
    scale = head_dim**-0.5 if scale is None else scale
    block_n = min(PAGED_BLOCK_N, triton.next_power_of_2(page_size))
    block_d = triton.next_power_of_2(head_dim)
    _paged_kernel[(heads, batch, n_splits)](
        *_split_args(q, k_pages, v_pages, ks, vs, block_table, lengths, partial, lse, scaled),
        window,
        max_pages,
        split_pages,
        scale * math.log2(math.e),
        head_dim,
        SCALED=scaled,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        STAGES=PAGED_STAGES,
        num_warps=max(1, min(8, block_n * block_d // 1024)),  # 32 elements of a tile per thread
    )
    return _combine(partial, lse, torch.empty_like(q))


# The Triton kernels a caller may choose (`decode_attention(kernel=...)`, `duplexd serve --attention-kernel`): each new
# one lands beside the one it would replace, and the default changes only on a measured result (bench/gpu_kernels.py).
_LAUNCHERS = {"split": decode_attention_triton, "paged": decode_attention_paged}
ATTENTION_KERNELS = tuple(_LAUNCHERS)


def check_attention_kernel(kernel: str) -> None:
    """ValueError naming the choices unless `kernel` is one of `ATTENTION_KERNELS`."""
    if kernel not in _LAUNCHERS:
        raise ValueError(f"attention kernel {kernel!r} is not one of {', '.join(ATTENTION_KERNELS)}")


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
    kernel: str = "split",
) -> torch.Tensor:
    """Paged single-query attention, [B, H, D] out; Triton on CUDA (`kernel`: one of `ATTENTION_KERNELS`),
    `decode_attention_torch` elsewhere. An 8-bit pool (`kernels.kv_quant`) passes its scale pools
    [num_pages, page_size, H] as `k_scales`, `v_scales`."""
    if use_triton(q):
        check_attention_kernel(kernel)
        launch = _LAUNCHERS[kernel]
        return launch(q, k_pages, v_pages, block_table, lengths, window, scale, k_scales=k_scales, v_scales=v_scales)
    return decode_attention_torch(q, k_pages, v_pages, block_table, lengths, window, scale, k_scales, v_scales)
