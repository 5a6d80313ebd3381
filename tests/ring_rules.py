"""The two ring KV cache rules, stated in plain Python, and NVIDIA's fork's rule put into the reference `moshi`.

A ring of `capacity` entries holds a slot's keys: the key of step p is written at index p % capacity. After a
call that wrote `steps` keys, `end_offset` keys have been written in all, and the cache gives each index the
position the attention mask reads (-1: never written); a query at position q attends an index whose position
pos has 0 <= q - pos < context.

- moshi 0.2.13 (`RingKVCache.complete`): `last = end_offset - 1` is the newest position, at index
  `last % capacity`; index i holds `last + delta` when `delta = i - last % capacity <= 0`, else
  `last + delta - capacity`. Every entry gets the position it holds: a full ring attends `capacity` keys.
- NVIDIA's PersonaPlex fork (moshi's older `RingKVCache`): the same with `end_offset` in place of `last`. Index
  `end_offset % capacity` holds the oldest entry (end_offset - capacity) but gets the position end_offset, in the
  future, so the mask drops it: a full ring attends `capacity - 1` keys. A call of several steps (Mimi's: two a
  frame) drops it for every one of its queries, so each attends only the ring's newest `capacity - 1` positions.
"""

from __future__ import annotations

import torch
from moshi.modules.transformer import KVCacheResult


def moshi_positions(end_offset: int, capacity: int) -> list[int]:
    last = end_offset - 1
    out = []
    for i in range(capacity):
        delta = i - last % capacity
        out.append(-1 if i >= end_offset else (last + delta if delta <= 0 else last + delta - capacity))
    return out


def fork_positions(end_offset: int, capacity: int) -> list[int]:
    out = []
    for i in range(capacity):
        delta = i - end_offset % capacity
        out.append(-1 if i >= end_offset else (end_offset + delta if delta <= 0 else end_offset + delta - capacity))
    return out


RULES = {"moshi": moshi_positions, "personaplex": fork_positions}


def held(end_offset: int, capacity: int) -> list[int]:
    """The position each index really holds: the newest p < end_offset with p = i (mod capacity), or -1."""
    return [i + (end_offset - 1 - i) // capacity * capacity if i < end_offset else -1 for i in range(capacity)]


def attended(rule: str, query: int, end_offset: int, capacity: int, context: int) -> list[int]:
    """The ring indices a query at `query` attends under `rule` after `end_offset` keys were written."""
    labels = RULES[rule](end_offset, capacity)
    return [i for i, pos in enumerate(labels) if pos >= 0 and 0 <= query - pos < context]


def use_fork_rule(*transformers) -> None:
    """Make streaming reference transformers label their rings as NVIDIA's fork does: an LM's temporal transformer
    (`lm.transformer`; its DepFormer is left alone), Mimi's two (`mimi_transformers`). Call inside
    `streaming(...)`: the caches exist then."""
    for layer in (layer for transformer in transformers for layer in transformer.layers):
        cache = layer.self_attn._streaming_state.kv_cache
        upstream = cache.complete

        def complete(k, v, exec_mask, cache=cache, upstream=upstream):
            keys, values, positions = upstream(k, v, exec_mask)  # writes, advances end_offset
            labels = [fork_positions(int(e), cache.capacity) for e in cache.end_offset.view(-1).tolist()]
            fork = torch.tensor(labels, dtype=positions.dtype, device=positions.device).expand_as(positions)
            return KVCacheResult(keys, values, fork)

        cache.complete = complete


def mimi_transformers(mimi) -> tuple:
    """A reference Mimi's encoder and decoder transformers (the modules with rings), for `use_fork_rule`."""
    return mimi.encoder_transformer.transformer, mimi.decoder_transformer.transformer
