"""RoPE fused with the 8-bit KV store: one kernel reads a step's raw q, k, v rows, writes the rotated q out for
attention and stores the rotated k and the v as codes and scales in the pages (`kv_quant`'s rule and layout).

The reference is the composition the unfused path runs, `rope_qk_reference` then `store_quantized_reference`,
and the kernel computes exactly it: the rotation is `rope`'s (`rotated_pairs`, fp32 math), the rotated key is rounded to
the model's dtype in registers, as `rope_qk` would write it to memory and the store read it back, and the codes and
scales come from `kv_quant`'s `head_scales` and `encode_codes`. So the pages, the scales and q are bit for bit what
`rope_qk_triton` followed by `store_quantized_triton` write; the fusion saves the rotated key's round trip through
memory and one launch per layer.

The key is quantized in its interleaved pair form: `max |x|` over a head is the max over its even and its odd
elements, and the codes of the even and odd elements are stored at 2i and 2i + 1.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .dispatch import use_triton
from .kv_quant import QMAX, TINY, check_store, encode_codes, head_scales, quantize_store, store_quantized_reference
from .rope import rope_qk_reference, rotate_store, rotated_pairs


def rope_store_quantized_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    page: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """Rotate q, k [B, H, D] by the per-row angles cos, sin [B, D/2], store the rotated k and v quantized at row b's
    (page[b], offset[b]) of the pages [P, S, H, D] and scale pages [P, S, H]; returns the rotated q."""
    q, k = rope_qk_reference(q, k, cos, sin)
    store_quantized_reference(k, v, k_pages, v_pages, k_scales, v_scales, page, offset)
    return q


@triton.jit
def _rope_kv_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    qo_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    page_ptr,
    offset_ptr,
    sq_b,
    sq_h,
    sk_b,
    sk_h,
    sv_b,
    sv_h,
    sqo_b,
    sqo_h,
    scs_b,
    sc_p,
    sc_s,
    sc_h,
    ss_p,
    ss_s,
    n_heads,
    n_pairs,
    QMAX: tl.constexpr,
    TINY: tl.constexpr,
    INT8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per row: every head of q rotated and written out, of k rotated, quantized and stored, of v
    quantized and stored; the row's angles and write position loaded once."""
    b = tl.program_id(0).to(tl.int64)
    page = tl.load(page_ptr + b).to(tl.int64)
    offset = tl.load(offset_ptr + b).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_P)
    hmask = heads < n_heads
    pmask = pairs < n_pairs
    mask = hmask[:, None] & pmask[None, :]
    c = tl.load(cos_ptr + b * scs_b + pairs, mask=pmask, other=0.0)[None, :]
    s = tl.load(sin_ptr + b * scs_b + pairs, mask=pmask, other=0.0)[None, :]
    rotate_store(q_ptr, qo_ptr, sq_b, sq_h, sqo_b, sqo_h, b, heads[:, None], pairs[None, :], c, s, mask)
    even, odd = rotated_pairs(k_ptr, sk_b, sk_h, b, heads[:, None], pairs[None, :], c, s, mask)
    # The unfused path stores the rotated key in the model's dtype and the store reads it back: round the same way.
    even = even.to(k_ptr.dtype.element_ty).to(tl.float32)
    odd = odd.to(k_ptr.dtype.element_ty).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1))
    live, scale = head_scales(amax, QMAX, TINY)
    k_off = page * sc_p + offset * sc_s + heads[:, None] * sc_h + 2 * pairs[None, :]
    tl.store(kc_ptr + k_off, encode_codes(even, live, scale, kc_ptr, QMAX, INT8), mask=mask)
    tl.store(kc_ptr + k_off + 1, encode_codes(odd, live, scale, kc_ptr, QMAX, INT8), mask=mask)
    tl.store(ks_ptr + page * ss_p + offset * ss_s + heads, scale, mask=hmask)
    dims = tl.arange(0, BLOCK_D)
    vmask = hmask[:, None] & (dims < 2 * n_pairs)[None, :]
    quantize_store(
        v_ptr, sv_b, sv_h, vc_ptr, sc_p, sc_s, sc_h, vs_ptr, ss_p, ss_s, b, page, offset, heads, dims, vmask, hmask,
        QMAX, TINY, INT8,
    )  # fmt: skip


def rope_store_quantized_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    page: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """Triton `rope_store_quantized`: one launch; q, k, v may be strided views (of a fused qkv) with a contiguous
    last dim; the pools share one layout (as `PagedKVCache` makes them)."""
    batch, heads, head_dim = q.shape
    if k.shape != q.shape or head_dim % 2 or cos.shape != (batch, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}, cos {list(cos.shape)}, sin {list(sin.shape)}")
    check_store(k, v, k_pages, v_pages, k_scales, v_scales)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _rope_kv_store_kernel[(batch,)](
        q,
        k,
        v,
        cos,
        sin,
        q_out,
        k_pages,
        v_pages,
        k_scales,
        v_scales,
        page,
        offset,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        cos.stride(0),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        k_scales.stride(0),
        k_scales.stride(1),
        heads,
        head_dim // 2,
        QMAX=QMAX[k_pages.dtype],
        TINY=TINY,
        INT8=k_pages.dtype == torch.int8,
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_P=triton.next_power_of_2(head_dim // 2),
        BLOCK_D=2 * triton.next_power_of_2(head_dim // 2),
    )
    return q_out


def rope_store_quantized(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    page: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """Rotate this step's q, k [B, H, D], append the rotated k and v to 8-bit pages, return the rotated q; Triton
    on CUDA (one kernel), the torch reference (`rope_qk` then `store_quantized`, unfused) elsewhere."""
    args = (q, k, v, cos, sin, k_pages, v_pages, k_scales, v_scales, page, offset)
    if use_triton(q):
        return rope_store_quantized_triton(*args)
    return rope_store_quantized_reference(*args)
