"""`x @ w` for weights stored [in, out], with oneDNN-prepacked weights for multi-row fp32 matmuls on CPU.

MKL's fp32 GEMM with a handful of rows (a batch of decode steps, Mimi's two tokens per slot) runs at a third of
its single-row bandwidth on the CPUs measured here, while a oneDNN matmul on a weight packed once for its
blocking keeps ~8.5 GB/s (docs/BENCHMARKS.md). Single rows stay on `x @ w`, which is faster still, and so do
tall inputs (many rows), where MKL is compute-bound and fine, and small weights (under `MIN_PACKED` elements: a
demo model's, a DepFormer's): the oneDNN call costs ~20 us whatever the size, `x @ w` a few (2-core Xeon, 4 rows
of 64 x 192: 4 us against 32 us packed). The packed copy is made on first use, keyed by the weight (a view is
keyed by its base tensor and geometry, so per-step slices of a stacked weight each get one), and remade if the
weight is modified in place; it doubles that weight's memory.
"""

from __future__ import annotations

import functools
import weakref

import torch

# (base id, offset, shape, stride) -> (weak reference to the base, version when packed, packed copy); entries
# leave with their base tensor.
_PACKED: dict[tuple, tuple[weakref.ref, int, torch.Tensor]] = {}
MAX_ROWS = 64  # above this MKL's GEMM is as good
MIN_PACKED = 1 << 18  # elements (1 MiB of fp32): below this a weight sits in cache and `x @ w` wins
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _forget(key: tuple, _ref: weakref.ref) -> None:
    _PACKED.pop(key, None)


def _packed(w: torch.Tensor, rows: int) -> torch.Tensor:
    base = w if w._base is None else w._base
    key = (id(base), w.storage_offset(), tuple(w.shape), w.stride())
    hit = _PACKED.get(key)
    if hit is None or hit[0]() is not base or hit[1] != w._version:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().t().contiguous(), rows)
        hit = (weakref.ref(base, functools.partial(_forget, key)), w._version, packed)
        _PACKED[key] = hit
    return hit[2]


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w` with `w` [in, out]; exact same maths, faster kernel choice on CPU."""
    rows = x.numel() // x.shape[-1]
    if (
        not 1 < rows <= MAX_ROWS
        or w.numel() < MIN_PACKED
        or not _ONEDNN
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or w.dtype != torch.float32
        or w.dim() != 2
        or torch.is_grad_enabled()
    ):
        return x @ w
    return torch.ops.mkldnn._linear_pointwise(x, _packed(w, rows), None, "none", [], "")
