"""Appending keys and values to an 8-bit paged KV cache: symmetric quantization per (token, head), fused into the
store.

An 8-bit pool holds codes (int8, or fp8 e4m3fn) in the K/V pages and one fp32 scale per (token, head) in scale
pages parallel to them (`[num_pages, page_size, H]`), written together, so a page recycled by the ring never
shows a stale scale. The rule, in fp32, per head of D values x (the torch reference and the kernel compute it
with the same IEEE operations, so they agree bit for bit):

- `amax = max |x|`; a head with `amax < TINY` (a zero vector, in practice) stores scale 0 and codes 0;
- `scale = amax / QMAX` (127 for int8, 448 for e4m3fn), `y = x / scale` (both correctly rounded divisions);
- int8: `y` rounded to nearest, ties to even, clamped to ±127; fp8: the cast's rounding (to nearest even,
  saturating at ±448; torch does the same on CPU, and the GPU's `cvt.rn.satfinite`).

A code dequantizes to `code * scale`; attention applies the scales to the scores and the probabilities instead
(`decode_attention`), so the pages are never dequantized in memory.

Why divisions and a hand-made round: `x * (1 / scale)` lets the GPU compiler contract the multiply into the
rounding's add (an FMA rounds once, the CPU twice), and libdevice's `rint` does not run in Triton's interpreter;
`floor` and correctly rounded division (`div_rn`) are exact on both. On the Triton path the engine does not launch
this store on its own: `rope_kv_store` fuses it into RoPE (the rotated key, rounded to the model's dtype in
registers as `rope_qk` would write it, is quantized without a trip through memory), reusing `head_scales` and
`encode_codes`; `store_quantized` stays for callers with keys already rotated, and as the rule's reference kernel.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .dispatch import use_triton

TINY = 2.0**-100
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_reference(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] → (codes [..., D] in `dtype`, scales [...] fp32), by the rule above."""
    qmax = QMAX[dtype]
    x = x.float()
    amax = x.abs().amax(dim=-1)
    live = amax >= TINY
    # Over a tensor, not the Python float: CUDA turns `tensor / scalar` into a multiply by the scalar's reciprocal,
    # which is not the correctly rounded quotient the kernel computes (an H200 run: 360 int8 and 4816 fp8 scales
    # of 8192 differed).
    scale = torch.where(live, amax / torch.full_like(amax, qmax), 0.0)
    y = torch.where(live[..., None], x / torch.where(live, scale, 1.0)[..., None], 0.0)
    if dtype == torch.int8:
        return torch.round(y).clamp_(-qmax, qmax).to(torch.int8), scale
    return y.to(dtype), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., D] and scales [...] → values [..., D] in `dtype` (the product in fp32)."""
    return (codes.float() * scales[..., None]).to(dtype)


def store_quantized_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    page: torch.Tensor,
    offset: torch.Tensor,
) -> None:
    """Quantize k, v [B, H, D] and write row b at (page[b], offset[b]) of the pages [P, S, H, D] and scale pages
    [P, S, H]."""
    for x, pages, scales in ((k, k_pages, k_scales), (v, v_pages, v_scales)):
        codes, scale = quantize_reference(x, pages.dtype)
        pages[page, offset] = codes
        scales[page, offset] = scale


@triton.jit
def head_scales(amax, QMAX: tl.constexpr, TINY: tl.constexpr):
    """Per head: (live, scale) from `amax = max |x|` [H], by the rule above."""
    live = amax >= TINY
    scale = tl.where(live, tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), 0.0)
    return live, scale


@triton.jit
def encode_codes(x, live, scale, c_ptr, QMAX: tl.constexpr, INT8: tl.constexpr):
    """Codes (in `c_ptr`'s element type) of x [H, N] fp32 under the per-head (live, scale) [H]."""
    y = tl.math.div_rn(x, tl.where(live, scale, 1.0)[:, None])
    y = tl.where(live[:, None], y, 0.0)
    if INT8:
        r = tl.floor(y)
        frac = y - r  # exact
        odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
        r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)
        code = tl.minimum(tl.maximum(r, -QMAX), QMAX).to(c_ptr.dtype.element_ty)
    else:
        code = y.to(c_ptr.dtype.element_ty)
    return code


@triton.jit
def quantize_store(
    x_ptr,
    sx_b,
    sx_h,
    c_ptr,
    sc_p,
    sc_s,
    sc_h,
    s_ptr,
    ss_p,
    ss_s,
    b,
    page,
    offset,
    heads,
    dims,
    mask,
    hmask,
    QMAX: tl.constexpr,
    TINY: tl.constexpr,
    INT8: tl.constexpr,
):
    x = tl.load(x_ptr + b * sx_b + heads[:, None] * sx_h + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    live, scale = head_scales(tl.max(tl.abs(x), axis=1), QMAX, TINY)
    code = encode_codes(x, live, scale, c_ptr, QMAX, INT8)
    tl.store(c_ptr + page * sc_p + offset * sc_s + heads[:, None] * sc_h + dims[None, :], code, mask=mask)
    tl.store(s_ptr + page * ss_p + offset * ss_s + heads, scale, mask=hmask)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    page_ptr,
    offset_ptr,
    sk_b,
    sk_h,
    sv_b,
    sv_h,
    sc_p,
    sc_s,
    sc_h,
    ss_p,
    ss_s,
    n_heads,
    head_dim,
    QMAX: tl.constexpr,
    TINY: tl.constexpr,
    INT8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per row: every head of its key and value, quantized and stored with their scales."""
    b = tl.program_id(0).to(tl.int64)
    page = tl.load(page_ptr + b).to(tl.int64)
    offset = tl.load(offset_ptr + b).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    hmask = heads < n_heads
    mask = hmask[:, None] & (dims < head_dim)[None, :]
    quantize_store(
        k_ptr, sk_b, sk_h, kc_ptr, sc_p, sc_s, sc_h, ks_ptr, ss_p, ss_s, b, page, offset, heads, dims, mask, hmask,
        QMAX, TINY, INT8,
    )  # fmt: skip
    quantize_store(
        v_ptr, sv_b, sv_h, vc_ptr, sc_p, sc_s, sc_h, vs_ptr, ss_p, ss_s, b, page, offset, heads, dims, mask, hmask,
        QMAX, TINY, INT8,
    )  # fmt: skip


def check_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
) -> None:
    """The shapes, layouts and formats a Triton store of k, v [B, H, D] into these pools needs (ValueError)."""
    heads, head_dim = k.shape[1:]
    if v.shape != k.shape or k_pages.shape[2:] != (heads, head_dim) or v_pages.shape != k_pages.shape:
        raise ValueError(f"k {list(k.shape)}, v {list(v.shape)}, pages {list(k_pages.shape)}")
    if v_pages.stride() != k_pages.stride() or v_scales.stride() != k_scales.stride() or k_scales.stride(-1) != 1:
        raise ValueError("the K and V pools (and their scale pools) need one layout, scales contiguous by head")
    if k_pages.dtype not in QMAX or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"pages of {k_pages.dtype}: not an 8-bit format ({', '.join(map(str, QMAX))})")


def store_quantized_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    page: torch.Tensor,
    offset: torch.Tensor,
) -> None:
    """Triton `store_quantized`: one launch for k and v; k and v may be strided views with a contiguous last dim;
    the pools share one layout (as `PagedKVCache` makes them)."""
    batch, heads, head_dim = k.shape
    check_store(k, v, k_pages, v_pages, k_scales, v_scales)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _store_kv_kernel[(batch,)](
        k,
        v,
        k_pages,
        v_pages,
        k_scales,
        v_scales,
        page,
        offset,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_pages.stride(0),
        k_pages.stride(1),
        k_pages.stride(2),
        k_scales.stride(0),
        k_scales.stride(1),
        heads,
        head_dim,
        QMAX=QMAX[k_pages.dtype],
        TINY=TINY,
        INT8=k_pages.dtype == torch.int8,
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def store_quantized(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    page: torch.Tensor,
    offset: torch.Tensor,
) -> None:
    """Quantize and append this step's k, v [B, H, D] to 8-bit pages; Triton on CUDA, the torch reference
    elsewhere."""
    if use_triton(k):
        store_quantized_triton(k, v, k_pages, v_pages, k_scales, v_scales, page, offset)
    else:
        store_quantized_reference(k, v, k_pages, v_pages, k_scales, v_scales, page, offset)
