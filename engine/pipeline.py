"""One frame end to end for a batch of slots: Mimi encode → LM step → Mimi decode.

This is the per-frame work of a conversation, shared by offline inference and the serving engine, so a file
run through `duplexd infer` goes through exactly the path a live session does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SamplingParams
from .kv_cache import PagedKVCache
from .lm_gen import LMGen
from .models.lm import LMModel
from .models.mimi import MimiModel, MimiStreams


@dataclass
class FrameOutput:
    pcm: torch.Tensor  # [B, frame_size] model speech; zeros where not valid
    tokens: torch.Tensor  # [B, 1 + dep_q] text token then audio codes (UNGENERATED where not valid)
    valid: torch.Tensor  # [B] bool: False while the slot warms up (its first frame)


class Pipeline:
    """Mimi and the LM sharing `num_slots` conversation slots (`kv`: the LM's paged cache, see `LMGen`)."""

    def __init__(self, lm: LMModel, mimi: MimiModel, num_slots: int, kv: PagedKVCache | None = None) -> None:
        if mimi.cfg.num_codebooks < lm.cfg.num_user_codebooks or mimi.cfg.card != lm.cfg.card:
            raise ValueError(
                f"Mimi ({mimi.cfg.num_codebooks} codebooks of {mimi.cfg.card}) does not match the LM "
                f"({lm.cfg.num_user_codebooks} user codebooks of {lm.cfg.card})"
            )
        self.lm_gen = LMGen(lm, num_slots, kv)
        self.mimi = MimiStreams(mimi, num_slots)
        self.frame_size = mimi.cfg.frame_size

    def reset(self, slot: int, params: SamplingParams | None = None) -> None:
        self.lm_gen.reset(slot, params)
        self.mimi.reset(slot)

    def seek(self, slot: int, position: int) -> None:
        """Move `slot` to frame `position` as if it had generated zeros so far (benchmarks of long conversations:
        attention then reads a whole window). The slot's Mimi state is untouched."""
        self.lm_gen.offsets[slot] = position
        self.lm_gen.ring[slot] = 0

    @torch.no_grad()
    def step(self, slots: torch.Tensor, pcm: torch.Tensor) -> FrameOutput:
        """Advance `slots` [B] by one frame of user audio `pcm` [B, frame_size]."""
        if pcm.dim() != 2 or pcm.shape != (len(slots), self.frame_size):
            raise ValueError(f"pcm must be [{len(slots)}, {self.frame_size}], got {list(pcm.shape)}")
        codes = self.mimi.encode(slots, pcm)[:, :, 0]
        out = self.lm_gen.step(slots, codes)
        speech = pcm.new_zeros(len(slots), self.frame_size)
        if out.valid.any():
            rows = out.valid.nonzero()[:, 0]
            speech[rows] = self.mimi.decode(slots[rows], out.tokens[rows, 1:, None]).to(speech.dtype)
        return FrameOutput(speech, out.tokens, out.valid)
