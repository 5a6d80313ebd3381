"""The temporal transformer's paged KV cache: one preallocated page pool, a block table and a ring per slot.

One pool per layer holds `num_pages` pages of `page_size` frames ([layers, pages + 1, page_size, H, D] for keys
and for values; the extra last page is scratch). A slot owns the pages listed in its block-table row; logical
position p of the slot lives in page `table[(p // page_size) % max_pages]` at offset `p % page_size`, where
`max_pages = ceil(context / page_size)`. So a slot's pages form a ring of at least `context` positions: a page
whose frames leave the reference's window (the last `context` positions) is recycled in place for the next
frames, without copies or host work (vLLM's block tables, with the window of Moshi's ring cache).

Admission reserves every page a session can ever need up front (a whole window, or fewer when the session's
length is capped below the window), so an admitted conversation can never run out of pages mid-sentence.
Unassigned table entries point at the scratch page, and so does the whole row of the scratch slot (row
`num_slots` of the table): padding rows of a bucketed batch run as that slot, write there and never touch a live
session's pages.

With an 8-bit `kv_dtype` (`dtypes.py`) the pages hold codes and two more pools parallel to them hold an fp32
scale per (token, head) for keys and for values ([layers, pages + 1, page_size, H]); a step's key and value are
quantized as they are written (`kernels.kv_quant`), codes and scales together, so a recycled page's scales are
always its new frames', and attention applies the scales as it reads (`kernels.decode_attention`). The model hands
its keys unrotated (`attend_rotary`), so that on the Triton path RoPE and the quantized store are one kernel
(`kernels.rope_kv_store`).

Admission is host bookkeeping only (`allocate` and `free` change `host_tables`), so it never waits for a step in
flight; the engine's loop thread copies a slot's row to the device (`upload`) when the slot starts a
conversation, between two steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from duplexd.kernels.decode_attention import check_attention_kernel, decode_attention
from duplexd.kernels.dispatch import use_triton
from duplexd.kernels.kv_quant import store_quantized
from duplexd.kernels.prefill_attention import causal_paged_attention_torch
from duplexd.kernels.rope import rope_qk
from duplexd.kernels.rope_kv_store import rope_store_quantized

from ..errors import CapacityError
from .dtypes import element_bytes, quantized, storage_dtype

logger = logging.getLogger(__name__)


def pages_for(frames: int, page_size: int) -> int:
    return -(-frames // page_size)


def window_pages(context: int, page_size: int, frames: int | None = None) -> int:
    """Pages a session of `frames` frames (None: unbounded) reserves: never more than one window."""
    window = context if frames is None else min(frames, context)
    return pages_for(max(window, 1), page_size)


@dataclass
class PagedBatch:
    """One step's view of the pool for a batch of rows (built by `PagedKVCache.batch`)."""

    block_table: torch.Tensor  # [B, max_pages] int32
    lengths: torch.Tensor  # [B] int32: positions + 1 (this step's key included)
    write_page: torch.Tensor  # [B] long: page of this step's key
    write_offset: torch.Tensor  # [B] long: its offset in the page
    # Prefill only: (first row, end row, first position) of each run of consecutive positions of one slot, so that
    # on CPU a run attends in one causal call instead of one decode query per row. None for a step.
    runs: tuple[tuple[int, int, int], ...] | None = None


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        context: int,
        num_slots: int,
        num_pages: int,
        page_size: int = 64,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        window: int | None = None,
        kv_dtype: str = "bf16",
        attention_kernel: str = "split",
    ) -> None:
        """`window`: keys a query attends (default `context`; `LMConfig.attention_window`); the ring holds
        `context` positions either way. `dtype`: the model's; `kv_dtype`: the pages' format (`dtypes.py`);
        `attention_kernel`: the Triton decode attention a step runs (`kernels.decode_attention.ATTENTION_KERNELS`)."""
        window = context if window is None else window
        check_attention_kernel(attention_kernel)
        self.attention_kernel = attention_kernel
        if page_size < 1 or num_pages < 0 or num_slots < 1 or not 0 < window <= context:
            raise ValueError(
                f"bad pool geometry: page_size {page_size}, num_pages {num_pages}, slots {num_slots}, "
                f"window {window} of context {context}"
            )
        self.context, self.page_size, self.num_pages, self.num_slots = context, page_size, num_pages, num_slots
        self.window = window
        self.max_pages = pages_for(context, page_size)
        self.scratch = num_pages
        self.scratch_slot = num_slots
        shape = (num_layers, num_pages + 1, page_size, num_heads, head_dim)
        self.kv_dtype = kv_dtype
        self.keys = torch.zeros(shape, dtype=storage_dtype(kv_dtype, dtype), device=device)
        self.values = torch.zeros(shape, dtype=self.keys.dtype, device=device)
        # An 8-bit pool's scales: [layers, pages + 1, page_size, H] fp32 each; None for the model's dtype.
        self.k_scales = torch.zeros(shape[:-1], device=device) if quantized(kv_dtype) else None
        self.v_scales = torch.zeros(shape[:-1], device=device) if quantized(kv_dtype) else None
        self.host_tables = np.full((num_slots + 1, self.max_pages), self.scratch, dtype=np.int32)
        self.tables = torch.from_numpy(self.host_tables).to(device, copy=True)  # what steps read
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: recently freed pages are reused first
        self._owned: dict[int, list[int]] = {}

    @staticmethod
    def page_bytes(
        num_layers: int, num_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, kv_dtype: str = "bf16"
    ) -> int:
        """Bytes of one page across all layers, keys and values (and their scales), for a model of `dtype`."""
        per_head = head_dim * element_bytes(storage_dtype(kv_dtype, dtype)) + (4 if quantized(kv_dtype) else 0)
        return 2 * num_layers * page_size * num_heads * per_head

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (the scratch page included)."""
        pools = (self.keys, self.values, self.k_scales, self.v_scales)
        return sum(t.nbytes for t in pools if t is not None)

    # ---------------------------------------------------------------------------------------- host bookkeeping

    @property
    def pages_free(self) -> int:
        return len(self._free)

    @property
    def pages_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_needed(self, frames: int | None = None) -> int:
        return window_pages(self.context, self.page_size, frames)

    def sessions_fit(self, frames: int | None = None) -> int:
        """How many more sessions of `frames` frames the free pages can hold."""
        return self.pages_free // self.pages_needed(frames)

    def allocate(self, slot: int, frames: int | None = None) -> None:
        """Reserve the pages of a session of `frames` frames in `slot`; `CapacityError` when they are not free."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        if slot in self._owned:
            raise ValueError(f"slot {slot} already holds pages")
        need = self.pages_needed(frames)
        if need > len(self._free):
            raise CapacityError(
                f"not enough KV cache: a session needs {need} pages of {self.page_size} frames, "
                f"{len(self._free)} of {self.num_pages} are free"
            )
        pages = [self._free.pop() for _ in range(need)]
        self._owned[slot] = pages
        self.host_tables[slot] = self.scratch
        self.host_tables[slot, :need] = pages

    def reserve(self, slot: int, frames: int | None) -> None:
        """Grow `slot`'s reservation to a session of `frames` frames (a persona prompt's frames come first); it
        never shrinks. `CapacityError` when the extra pages are not free. The device row follows at `upload`."""
        pages = self._owned.get(slot)
        if pages is None:
            raise ValueError(f"slot {slot} holds no pages")
        need = self.pages_needed(frames) - len(pages)
        if need <= 0:
            return
        if need > len(self._free):
            raise CapacityError(
                f"not enough KV cache for the persona prompt: {need} more pages of {self.page_size} frames, "
                f"{len(self._free)} of {self.num_pages} are free"
            )
        more = [self._free.pop() for _ in range(need)]
        self.host_tables[slot, len(pages) : len(pages) + need] = more
        pages.extend(more)

    def free(self, slot: int) -> None:
        """Give `slot`'s pages back; its host row points at scratch again. Idempotent."""
        pages = self._owned.pop(slot, None)
        if pages is None:
            return
        self.host_tables[slot] = self.scratch
        self._free.extend(reversed(pages))

    def upload(self, slot: int) -> None:
        """Copy `slot`'s host row to the device table; called between steps, before the slot's first step. On CUDA
        from a pinned copy, without waiting for the device."""
        row = torch.from_numpy(self.host_tables[slot])
        if self.tables.is_cuda:
            row = row.pin_memory()
        self.tables[slot].copy_(row, non_blocking=self.tables.is_cuda)

    # ---------------------------------------------------------------------------------------- device side

    def batch(
        self, slots: torch.Tensor, positions: torch.Tensor, runs: tuple[tuple[int, int, int], ...] | None = None
    ) -> PagedBatch:
        """The view for rows `slots` [B] (`scratch_slot` for padding) at `positions` [B] (device tensors; no host
        synchronisation); `runs` as in `PagedBatch`, from the host's own account of the rows."""
        table = self.tables[slots]
        ring = ((positions // self.page_size) % self.max_pages)[:, None]
        write_page = table.gather(1, ring)[:, 0].long()
        return PagedBatch(table, (positions + 1).to(torch.int32), write_page, positions % self.page_size, runs)

    def attend(self, layer: int, view: PagedBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's k, v [B, H, D] and attend q [B, H, D] to each row's last `window` positions."""
        keys, values = self.keys[layer], self.values[layer]
        ks = vs = None
        if self.k_scales is None or self.v_scales is None:
            keys[view.write_page, view.write_offset] = k
            values[view.write_page, view.write_offset] = v
        else:
            ks, vs = self.k_scales[layer], self.v_scales[layer]
            store_quantized(k, v, keys, values, ks, vs, view.write_page, view.write_offset)
        return self._read(layer, view, q, ks, vs)

    def attend_rotary(
        self,
        layer: int,
        view: PagedBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """`attend` of q, k [B, H, D] before RoPE, rotated here by the per-row angles cos, sin [B, D/2]
        (`kernels.rope`). An 8-bit pool rotates and stores in one op (`kernels.rope_kv_store`: on the Triton path one
        kernel, the rotated key quantized in registers; elsewhere `rope_qk` then the store, as `attend`)."""
        if self.k_scales is None or self.v_scales is None:
            q, k = rope_qk(q, k, cos, sin)
            return self.attend(layer, view, q, k, v)
        keys, values = self.keys[layer], self.values[layer]
        ks, vs = self.k_scales[layer], self.v_scales[layer]
        q = rope_store_quantized(q, k, v, cos, sin, keys, values, ks, vs, view.write_page, view.write_offset)
        return self._read(layer, view, q, ks, vs)

    def _read(
        self, layer: int, view: PagedBatch, q: torch.Tensor, ks: torch.Tensor | None, vs: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of q [B, H, D] over the layer's pages, this step's keys already stored."""
        keys, values = self.keys[layer], self.values[layer]
        if view.runs is not None and not use_triton(q):
            return torch.cat(
                [
                    causal_paged_attention_torch(
                        q[a:b], keys, values, view.block_table[a], first, self.window, k_scales=ks, v_scales=vs
                    )
                    for a, b, first in view.runs
                ]
            )
        return decode_attention(
            q,
            keys,
            values,
            view.block_table,
            view.lengths,
            self.window,
            k_scales=ks,
            v_scales=vs,
            kernel=self.attention_kernel,
        )
