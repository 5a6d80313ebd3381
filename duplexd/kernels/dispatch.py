"""Which implementation runs: the Triton kernel for CUDA tensors, the torch reference elsewhere.

Tests force the Triton path on CPU (under `TRITON_INTERPRET=1`, set before the kernels are imported) with
`force_triton()`. The check is one attribute read and a global, so the CPU path pays nothing measurable for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ._triton import HAS_TRITON

_forced = False


def use_triton(x: torch.Tensor) -> bool:
    """True when the op on `x` should run the Triton kernel."""
    return _forced or (x.is_cuda and HAS_TRITON)


@contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Run the Triton kernels whatever the device (CPU needs the interpreter); restores the previous mode."""
    global _forced
    if enabled and not HAS_TRITON:
        raise RuntimeError("Triton is not installed")
    previous, _forced = _forced, enabled
    try:
        yield
    finally:
        _forced = previous
