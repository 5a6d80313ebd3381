"""Batch-size buckets and, on CUDA, one captured graph per bucket.

A `BucketedCall` wraps a function of batch-major tensors (every input and output has the batch on dim 0). A
call with B rows runs at the smallest bucket >= B: rows B.. are filled from a padding row the caller supplies
(inputs that only ever touch scratch state), and the first B rows of each output come back. On CUDA the
function is captured once per bucket at warm-up and replayed by copying the inputs (device tensors, or pinned
host tensors, copied without waiting) into the graph's static buffers, so a step costs a few copies and one graph
launch whatever the number of kernels in it. Outputs are views of the graph's static outputs, overwritten by the
next replay. Without graphs it runs eagerly: padded when `pad` is set (to check on CPU exactly what a graph
sees), else at B rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)

Fn = Callable[..., tuple[torch.Tensor, ...]]


# Past this, buckets grow by this many rows instead of doubling: hundreds of STT streams pad by at most 63 rows.
LINEAR_BUCKETS_FROM = 64


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two up to 64, then every multiple of 64 below `max_batch`, then `max_batch` itself: 1, 2, 4, …,
    64, 128, 192, …, max (the same as powers of two up to 128 sessions)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b = b * 2 if b < LINEAR_BUCKETS_FROM else b + LINEAR_BUCKETS_FROM
    return (*out, max_batch)


class BucketedCall:
    def __init__(
        self,
        fn: Fn,
        pad_row: Sequence[torch.Tensor],
        buckets: Sequence[int],
        *,
        graphs: bool = False,
        pad: bool = False,
    ) -> None:
        self.fn, self.pad_row, self.buckets = fn, tuple(pad_row), tuple(sorted(buckets))
        self.use_graphs, self.pad = graphs, pad or graphs
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}

    def bucket(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"batch {batch} is larger than the largest bucket {self.buckets[-1]}")

    def _padded(self, bucket: int) -> tuple[torch.Tensor, ...]:
        return tuple(p.expand(bucket, *p.shape[1:]).clone() for p in self.pad_row)

    def capture(self, desc: str, pool=None) -> None:
        """Capture one graph per bucket, largest first so the smaller ones reuse its memory pool."""
        if not self.use_graphs:
            return
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        for bucket in tqdm(sorted(self.buckets, reverse=True), desc=desc, unit="graph"):
            static_in = self._padded(bucket)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up off the capture: Triton compiles, allocator settles
                for _ in range(2):
                    self.fn(*static_in)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                static_out = self.fn(*static_in)
            self._graphs[bucket] = (graph, static_in, tuple(static_out))
        torch.cuda.synchronize()

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch = inputs[0].shape[0]
        if not self.pad:
            return self.fn(*inputs)
        bucket = self.bucket(batch)
        if bucket in self._graphs:
            graph, static_in, static_out = self._graphs[bucket]
            for buf, x, p in zip(static_in, inputs, self.pad_row, strict=True):
                buf[:batch].copy_(x, non_blocking=True)
                buf[batch:].copy_(p.expand(bucket - batch, *p.shape[1:]))
            graph.replay()
            return tuple(out[:batch] for out in static_out)
        inputs = tuple(x.to(p.device, non_blocking=True) for x, p in zip(inputs, self.pad_row, strict=True))
        padded = tuple(
            torch.cat([x, p.expand(bucket - batch, *p.shape[1:]).to(x.dtype)]) if bucket > batch else x
            for x, p in zip(inputs, self.pad_row, strict=True)
        )
        return tuple(out[:batch] for out in self.fn(*padded))
