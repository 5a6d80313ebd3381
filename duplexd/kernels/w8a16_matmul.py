"""`x @ W.T` for int8 weight-only quantized weights (W8A16): codes [N, K] int8, one fp32 scale per output channel.

A decode step is bound by the weight bytes it reads; int8 codes halve them against bf16. The eager torchao /
gpt-fast path (`F.linear(x, codes.to(x.dtype)) * scale`) writes a dequantized bf16 copy of the weight to memory on
every call and reads it back, which loses the saving and then some. The kernels here load the int8 codes and
convert them in registers, accumulate in fp32, and multiply by the per-channel scale (absmax / 127, Kyutai q8 /
bitsandbytes layout) once, in the epilogue. The reference does the same maths in torch
(an fp32 GEMM on the integer codes, then the scale), and is also the CPU path.

Two Triton kernels multiply (`W8A16_KERNELS`): "tiles" (`tl.dot` on [16+, 32+] output tiles, every row count) and
"gemv" (rows up to `GEMV_ROWS` on the CUDA cores, no `tl.dot`, split along K where the columns alone give too few
programs; more rows run "tiles"). A decode batch of a few rows fills a sixteenth to a half of a 16-row MMA tile,
and what bounds it is how fast the codes stream in: the GEMV has wide code loads and few instructions per code.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .dispatch import use_triton

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The Triton kernels a caller may choose (`int8_matmul(kernel=...)`, `duplexd serve --w8a16-kernel`): each new one
# lands beside the one it would replace, and the default changes only on a measured result (bench/weights_dtype.py).
W8A16_KERNELS = ("tiles", "gemv")
GEMV_ROWS = 8  # the most rows "gemv" runs on the CUDA cores: each code costs a multiply-add per row
GEMV_BLOCK_N = 8  # output channels per GEMV program (each thread holds a code vector of every one)
GEMV_WARPS = 4  # side by side along K with the 32 lanes: a program reads 32 * 4 code vectors of each channel per step
# Programs whose code loads together cover an H200's bandwidth x memory latency (about 4 MiB in flight: 8 KiB a
# program and step): fewer columns split K to reach it.
GEMV_PROGRAMS = 512


def int8_matmul_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`(x @ codes.T) * scale` in fp32, returned in `x.dtype`: x [..., K], codes int8 [N, K], scale fp32 [N]."""
    y = torch.nn.functional.linear(x.float(), codes.float())  # x.float() is x itself for fp32
    return y.mul_(scale).to(x.dtype)


@triton.jit
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One program per [BLOCK_M, BLOCK_N] output tile; the int8 weight tile becomes x's dtype in registers only."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    # int64 offsets: row index x row stride can pass 2^31 (a 32000 x 4096 head is 2^27 codes; wider views more)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0)
        # exact (|code| <= 128). Through fp32 for the interpreter, whose int8 -> bf16 is wrong; for sm_90 Triton
        # emits the same PTX either way (prmt + sub.bf16x2, no cvt per element)
        w = w.to(tl.float32).to(x.dtype)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(s_ptr + cols, mask=col_ok, other=0.0)
    y = acc * scale[None, :]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _fma_chain(acc, w, x, VEC: tl.constexpr):
    """`acc + sum(w * x, axis=-1)` over a last dim of VEC (a power of two >= 2) that each thread holds, as one
    multiply-add after another: `tl.sum` adds the products as a tree, one multiply more per two codes, and from 4
    rows up the GEMV is bound by the instructions it issues."""
    if VEC == 2:
        w0, w1 = tl.split(w)
        x0, x1 = tl.split(x)
        return acc + w0 * x0 + w1 * x1
    else:  # even and odd elements, each half a chain
        w0, w1 = tl.split(tl.reshape(w, acc.shape + (VEC // 2, 2)))
        x0, x1 = tl.split(tl.reshape(x, acc.shape + (VEC // 2, 2)))
        return _fma_chain(_fma_chain(acc, w0, x0, VEC // 2), w1, x1, VEC // 2)


@triton.jit
def _w8a16_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    K_SPLIT,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LANES: tl.constexpr,
    VEC: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """One program per BLOCK_N output channels and K range (`K_SPLIT` codes, program_id 1), every row of x.

    The 16-byte vector of x a thread loads (VEC elements) sets the VEC codes it loads beside it (8 bytes for 16-bit
    x, an LDG.64 per channel: 256 contiguous bytes a warp), so x and the codes share one register layout and meet
    with no shared-memory shuffle; lanes and warps run along K ([ROWS, BLOCK_N, LANES, VEC] tiles, LANES = 32 *
    warps), so only the end of a program reduces across threads. Both load as 2-D [rows or channels, BLOCK_K]
    tiles whose K runs are declared VEC long (`max_contiguous`): Triton's coalescing then gives each thread VEC
    elements and every thread a place along K, with none left for the other dim, whatever order it breaks ties
    between dims of equal contiguity in (Triton 3.6 and 3.9 break them oppositely; 4-D loads put 8 threads across
    the channels under 3.6, and its loop then moved x and the codes through shared memory 7 times a step). The
    reshape to [.., LANES, VEC] moves no data. Codes become fp32 by integer adds on the bits of
    1.5 * 2^23 (whose ulp is 1): exact, and full-rate where `.to(tl.float32)` is a quarter-rate I2F per code.
    Without SPLIT y is the output, scaled; with it, the fp32 partial sums [splits, M, N] that
    `_w8a16_split_sum_kernel` adds in split order (deterministic, no atomics)."""
    BLOCK_K: tl.constexpr = LANES * VEC
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rows = tl.arange(0, ROWS)
    ks = tl.max_contiguous(tl.arange(0, BLOCK_K), VEC)
    col_ok = cols < N
    row_ok = rows < M
    k0 = split * K_SPLIT
    k_end = tl.minimum(K, k0 + K_SPLIT)
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + (k0 + ks)[None, :]
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + (k0 + ks)[None, :]
    tile: tl.constexpr = (ROWS, BLOCK_N, LANES, VEC)
    acc = tl.zeros((ROWS, BLOCK_N, LANES), dtype=tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        k_ok = (ks < k_end - k)[None, :]
        codes = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok, other=0)
        w = (codes.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok, other=0.0).to(tl.float32)
        w = tl.broadcast_to(tl.reshape(w, (1, BLOCK_N, LANES, VEC)), tile)
        x = tl.broadcast_to(tl.reshape(x, (ROWS, 1, LANES, VEC)), tile)
        acc = _fma_chain(acc, w, x, VEC)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)
    out_ok = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        tl.store(y_ptr + (split * M + rows[:, None]) * N + cols[None, :], y, mask=out_ok)
    else:
        y = y * tl.load(s_ptr + cols, mask=col_ok, other=0.0)[None, :]
        y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def _w8a16_split_sum_kernel(p_ptr, s_ptr, y_ptr, M, N, stride_ym, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """y[row, cols] = scale * the sum of the GEMV's partial sums [SPLITS, M, N] over its splits, in split order;
    SPLITS unrolled, so every load is in flight at once."""
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(p_ptr + (s * M + row) * N + cols, mask=ok, other=0.0)
    y = acc * tl.load(s_ptr + cols, mask=ok, other=0.0)
    tl.store(y_ptr + row.to(tl.int64) * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def _blocks(m: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by row bucket: three variants per x dtype.

    Up to 16 rows (decode batches) the kernel streams the weight once and is bound by its bytes: BLOCK_N = 32
    gives N / 32 programs (128 for N = 4096, 1000 for the 32000-row text head: about one or more per SM of an H200's
    132), and BLOCK_K = 256 with 4 stages keeps ~32 KiB of codes in flight per SM whatever N, which is what the
    bandwidth needs. A wider BLOCK_N would leave SMs idle at N = 4096; a narrower one would re-read x from L2 more
    often than the weight itself (x traffic / weight traffic = 2 * rows / BLOCK_N for 16-bit x). Up to 32 rows:
    32 x 64 tiles, BLOCK_K = 128. Above (large decode buckets, prompt prefill): 64 x 64 tiles, BLOCK_K = 128, a
    tile shape the tensor cores fill (wgmma on sm_90) and still N / 64 column programs per row tile. tl.dot needs
    every tile dim >= 16. The DepFormer's N = 1024 gives only 32 programs at small M; its weights are 1-6 MB, so
    those launches are latency-bound either way (the "gemv" kernel splits K for them).
    fp32 x: the "ieee" dot runs on FMA units with both operand tiles in registers, so BLOCK_K = 16 (and 8 warps
    for 64-row tiles) keeps every bucket free of spills (a correctness path: fp32 models serve on the CPU).
    """
    if m <= 16:
        block_m, block_n, block_k, stages = 16, 32, 256, 4
    elif m <= 32:
        block_m, block_n, block_k, stages = 32, 64, 128, 4
    else:
        block_m, block_n, block_k, stages = 64, 64, 128, 3
    warps = 4
    if dtype == torch.float32:
        block_k, warps = 16, 8 if block_m == 64 else 4
    return block_m, block_n, block_k, warps, stages


def _check(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Shapes, dtypes and devices only: attribute reads, no tensor data (safe under CUDA-graph capture)."""
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"codes must be a 2-D int8 tensor [N, K], got {codes.dtype} {list(codes.shape)}")
    n, k = codes.shape
    if k > 1 and codes.stride(1) != 1:
        raise ValueError(f"codes must be contiguous along K (stride {codes.stride()})")
    if scale.dtype != torch.float32 or scale.shape != (n,) or (n > 1 and scale.stride(0) != 1):
        raise ValueError(f"scale must be a contiguous float32 tensor [{n}], got {scale.dtype} {list(scale.shape)}")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x's last dim must be K = {k} (codes {list(codes.shape)}), got x {list(x.shape)}")
    if codes.device != x.device or scale.device != x.device:
        raise ValueError(f"x, codes and scale must be on one device, got {x.device}, {codes.device}, {scale.device}")


def gemv_splits(n: int, k: int, dtype: torch.dtype, splits: int | None = None) -> tuple[int, int]:
    """(K_SPLIT, splits) of the GEMV on codes [N, K] and x of `dtype`, from these static sizes alone (a CUDA graph
    replays the grid). By default K splits until `GEMV_PROGRAMS` programs run, never below one program step of K
    each (N = 4096 or more: no split; the DepFormer's N = 1024 with K = 4096: 4); `splits` forces a count. Each
    split is a multiple of 16 codes, which keeps the loads aligned."""
    block_k = 32 * GEMV_WARPS * (16 // dtype.itemsize)
    if splits is None:
        fill = triton.cdiv(GEMV_PROGRAMS, triton.cdiv(n, GEMV_BLOCK_N))
        splits = min(fill, triton.cdiv(k, block_k))
    k_split = triton.cdiv(triton.cdiv(k, max(splits, 1)), 16) * 16 or 16
    return k_split, max(triton.cdiv(k, k_split), 1)


def _launch_gemv(x2: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, splits: int | None):
    m, k = x2.shape
    n = codes.shape[0]
    k_split, splits = gemv_splits(n, k, x2.dtype, splits)
    out = y if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=y.device)
    _w8a16_gemv_kernel[(triton.cdiv(n, GEMV_BLOCK_N), splits)](
        x2,
        codes,
        scale,
        out,
        m,
        n,
        k,
        x2.stride(0),
        codes.stride(0),
        y.stride(0),
        k_split,
        ROWS=triton.next_power_of_2(m),
        BLOCK_N=GEMV_BLOCK_N,
        LANES=32 * GEMV_WARPS,
        VEC=16 // x2.element_size(),
        SPLIT=splits > 1,
        num_warps=GEMV_WARPS,
    )
    if splits > 1:
        block = 256
        _w8a16_split_sum_kernel[(triton.cdiv(n, block), m)](
            out, scale, y, m, n, y.stride(0), SPLITS=splits, BLOCK=block, num_warps=2
        )


def check_w8a16_kernel(kernel: str) -> None:
    """ValueError naming the choices unless `kernel` is one of `W8A16_KERNELS`."""
    if kernel not in W8A16_KERNELS:
        raise ValueError(f"W8A16 kernel {kernel!r} is not one of {', '.join(W8A16_KERNELS)}")


def _launch(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, kernel: str = "tiles", splits: int | None = None
) -> torch.Tensor:
    check_w8a16_kernel(kernel)
    n, k = codes.shape
    # a view where the leading dims allow it: rows keep their stride (no K: reshape cannot infer the rows)
    x2 = x.reshape(-1, k) if k else x.new_empty(x.shape[:-1].numel(), 0)
    if k > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n and not k:
        y.zero_()  # an empty sum
    elif m and n and kernel == "gemv" and m <= GEMV_ROWS:
        _launch_gemv(x2, codes, scale, y, splits)
    elif m and n:
        block_m, block_n, block_k, warps, stages = _blocks(m, x.dtype)
        _w8a16_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            x2,
            codes,
            scale,
            y,
            m,
            n,
            k,
            x2.stride(0),
            codes.stride(0),
            y.stride(0),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            IEEE=x.dtype == torch.float32,
            num_warps=warps,
            num_stages=stages,
        )
    return y.view(*x.shape[:-1], n)


def int8_matmul_triton(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, kernel: str = "tiles", splits: int | None = None
) -> torch.Tensor:
    """A Triton kernel (`kernel`: one of `W8A16_KERNELS`; "gemv" on up to `GEMV_ROWS` rows, "tiles" above) on x
    [..., K] (bf16, fp16 or fp32), codes int8 [N, K], scale fp32 [N]: [..., N]. `splits`: the GEMV's K splits
    (default: `gemv_splits`' choice)."""
    _check(x, codes, scale)
    return _launch(x, codes, scale, kernel, splits)


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, kernel: str = "tiles") -> torch.Tensor:
    """`(x @ codes.T) * scale` in `x.dtype`, accumulated in fp32; Triton on CUDA (`kernel`: one of
    `W8A16_KERNELS`; "gemv" runs the GEMV up to `GEMV_ROWS` rows and the tiles above), the torch reference
    elsewhere."""
    _check(x, codes, scale)
    if use_triton(x):
        return _launch(x, codes, scale, kernel)
    return int8_matmul_reference(x, codes, scale)
