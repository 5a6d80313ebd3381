"""`x @ W.T` for int8 weight-only quantized weights (W8A16): codes [N, K] int8, one fp32 scale per output channel.

A decode step is bound by the weight bytes it reads; int8 codes halve them against bf16. The eager torchao /
gpt-fast path (`F.linear(x, codes.to(x.dtype)) * scale`) writes a dequantized bf16 copy of the weight to memory on
every call and reads it back, which loses the saving and then some. The kernel here loads the int8 tiles and
converts them to x's dtype in registers, accumulates the dot in fp32, and multiplies by the per-channel scale
(absmax / 127, Kyutai q8 / bitsandbytes layout) once, in the epilogue. The reference does the same maths in torch
(an fp32 GEMM on the integer codes, then the scale), and is also the CPU path.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .dispatch import use_triton

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
    those launches are latency-bound either way (split-K would be the next step if they show up in a profile).
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


def _launch(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    x2 = x.reshape(-1, k)  # a view where the leading dims allow it: rows keep their stride
    if k > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
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


def int8_matmul_triton(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The Triton kernel on x [..., K] (bf16, fp16 or fp32), codes int8 [N, K], scale fp32 [N]: [..., N]."""
    _check(x, codes, scale)
    return _launch(x, codes, scale)


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`(x @ codes.T) * scale` in `x.dtype`, accumulated in fp32; Triton on CUDA, the torch reference elsewhere."""
    _check(x, codes, scale)
    if use_triton(x):
        return _launch(x, codes, scale)
    return int8_matmul_reference(x, codes, scale)
