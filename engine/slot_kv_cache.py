"""A per-slot ring-buffer KV cache for the temporal transformer.

Each slot owns `context` positions per layer; position p lives at ring index p % context, so the ring always
holds exactly the window the reference attends to (keys p - context + 1 … p). Attention order does not matter
(RoPE is applied before caching), so the ring is never rotated. Rows attend only over the filled prefix of the
ring, which keeps early frames cheap. The paged pool of the batched engine replaces this with the same interface.

Seen as pages, the ring is a pool with one page of `context` positions per slot (`pages`, `block_table`): the
paged decode-attention kernel reads it in place on CUDA.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_heads: int,
        context: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_slots, num_heads, context, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.context = context

    def store(
        self, layer: int, slots: torch.Tensor | None, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write this step's k, v [B, H, D] at each row's ring index; `slots` None means slots 0..B-1."""
        ring = positions % self.context
        rows = torch.arange(len(positions), device=positions.device) if slots is None else slots
        self.keys[layer][rows, :, ring] = k
        self.values[layer][rows, :, ring] = v

    def pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values as page pools [num_slots, context, H, D] (strided views, no copy)."""
        return self.keys[layer].transpose(1, 2), self.values[layer].transpose(1, 2)

    def block_table(self, slots: torch.Tensor | None, batch: int) -> torch.Tensor:
        """[B, 1] int32: row b's only page is its slot's ring."""
        device = self.keys.device
        rows = torch.arange(batch, device=device) if slots is None else slots
        return rows.to(torch.int32)[:, None]

    def attend_window(
        self, layer: int, slots: torch.Tensor | None, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store this step's k, v [B, H, D] and return the keys, values [B, H, L, D] and validity [B, L].

        `slots` None means the batch is slots 0..B-1 in order, which lets the cache hand out views.
        """
        self.store(layer, slots, positions, k, v)
        length = min(int(positions.max()) + 1, self.context)
        keys, values = self.keys[layer], self.values[layer]
        if slots is None:
            window_k, window_v = keys[: len(positions), :, :length], values[: len(positions), :, :length]
        else:
            window_k, window_v = keys[slots, :, :length], values[slots, :, :length]
        valid = torch.arange(length, device=positions.device) <= positions[:, None]
        return window_k, window_v, valid
