"""The KV pool's element formats (`--kv-dtype`): the model's own dtype, or 8-bit codes with an fp32 scale per
(token, head) (`kernels.kv_quant`: int8 everywhere; fp8 e4m3fn on GPUs of compute capability 8.9 and up, and on
the CPU through torch).

"bf16" names the model's dtype (what a CUDA server runs; float32 on a CPU), so the default is today's pool.
"""

from __future__ import annotations

import torch

KV_DTYPES = ("bf16", "int8", "fp8")
_CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return kv_dtype


def quantized(kv_dtype: str) -> bool:
    return check_kv_dtype(kv_dtype) in _CODES


def storage_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the K/V pages: 8-bit codes, or the model's dtype."""
    return _CODES.get(check_kv_dtype(kv_dtype), model_dtype)


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
