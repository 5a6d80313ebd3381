"""Test helpers for the kernels: poisoned allocations, so an output element a kernel forgot to write fails."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

INT_POISON = -77777


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype != torch.bool:
        return t.fill_(INT_POISON)
    return t


@contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Within the block, `torch.empty` and `torch.empty_like` return tensors filled with NaN (or INT_POISON)."""
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *args, **kwargs: _poison(empty(*args, **kwargs))
    torch.empty_like = lambda *args, **kwargs: _poison(empty_like(*args, **kwargs))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like
