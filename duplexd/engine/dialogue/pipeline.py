"""One frame end to end for a batch of slots: Mimi encode → LM step → Mimi decode (none for a text-only model).

This is the per-frame work of a conversation, shared by offline inference and the serving engine, so a file
run through `duplexd infer` goes through exactly the path a live session does.

The frame itself (`frame`) is device work only: slot indices arrive as device tensors built from host lists,
every row is decoded (a row whose output is not wanted yet decodes in the scratch slot) and masked, and nothing
is read back. So on CUDA the whole frame is captured once per batch bucket (`engine.graphs`) and a step is a
couple of host-to-device copies and one graph launch. What the host needs to know (which rows are valid) it
works out from its own count of each slot's frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..graphs import BucketedCall, default_buckets
from ..kv.paged import PagedKVCache
from ..models.config import ConfigError
from ..models.lm import LMModel, step_part
from ..models.mimi import MimiModel, MimiStreams, Rows
from ..persona.prompt import PersonaPrompt, PromptChunk
from .lm_gen import LMGen
from .sampling import SamplingParams


@dataclass
class FrameOutput:
    """One step's outputs, on the pipeline's device; views that the next step overwrites."""

    pcm: torch.Tensor  # [B, frame_size] model speech, zeros where not valid; [B, 0] for a text-only model
    tokens: torch.Tensor  # [B, 1 + agent_codebooks] text token then audio codes (UNGENERATED where not valid)
    valid: list[bool]  # False while the slot warms up (its first frame)
    pause: torch.Tensor  # [B, extra heads] fp32 class-0 probabilities of the extra heads ([B, 0] without heads)


class Pipeline:
    """Mimi and the LM sharing `num_slots` conversation slots (`kv`: the LM's paged cache, see `LMGen`).

    `buckets`, `graphs`, `pad`: how `step` runs the frame (see `BucketedCall`); by default eagerly at the batch's
    own size. `kv_dtype`: the format of the pool LMGen makes when `kv` is None.
    """

    def __init__(
        self,
        lm: LMModel,
        mimi: MimiModel,
        num_slots: int,
        kv: PagedKVCache | None = None,
        *,
        buckets: Sequence[int] | None = None,
        graphs: bool = False,
        pad: bool = False,
        kv_dtype: str = "bf16",
    ) -> None:
        if mimi.cfg.num_codebooks < lm.cfg.num_user_codebooks or mimi.cfg.card != lm.cfg.card:
            raise ValueError(
                f"Mimi ({mimi.cfg.num_codebooks} codebooks of {mimi.cfg.card}) does not match the LM "
                f"({lm.cfg.num_user_codebooks} user codebooks of {lm.cfg.card})"
            )
        if mimi.cfg.ring_rule != lm.cfg.ring_rule:  # one server ran both, with one ring cache
            raise ConfigError(
                f"Mimi's ring rule ({mimi.cfg.ring_rule}) is not the LM's ({lm.cfg.ring_rule}): build Mimi's config "
                "for the LM it serves (weights.checkpoint.mimi_ring_rule)"
            )
        self.lm_gen = LMGen(lm, num_slots, kv, kv_dtype=kv_dtype)
        self.text_only = lm.cfg.text_only  # no DepFormer, no Mimi decode (and no decoder state)
        self.mimi = MimiStreams(mimi, num_slots, decoder=not self.text_only)
        self.num_slots, self.frame_size = num_slots, mimi.cfg.frame_size
        self.output_samples = 0 if self.text_only else self.frame_size  # samples of speech a step gives per row
        self.device = lm.text_emb.device
        self.scratch = num_slots  # the scratch slot of LMGen, its KV table and Mimi
        self._positions = [0] * num_slots  # frames each slot has stepped since its reset (host copy of LMGen's)
        self._max_delay = lm.cfg.max_delay
        pin = self.device.type == "cuda"
        self._stage_rows = torch.zeros(2, num_slots, dtype=torch.long, pin_memory=pin)  # slots, decode slots
        self._stage_pcm = torch.zeros(num_slots, self.frame_size, pin_memory=pin)
        self._staged = torch.cuda.Event() if pin else None  # the staging buffers' last copy to the device
        scratch = torch.full((1,), self.scratch, dtype=torch.long, device=self.device)
        self._frame = BucketedCall(
            lambda slots, decode_slots, pcm: self.frame(Rows(slots), Rows(decode_slots), pcm),
            (scratch, scratch, torch.zeros(1, self.frame_size, device=self.device)),
            buckets or default_buckets(num_slots),
            graphs=graphs,
            pad=pad,
        )

    def reset(self, slot: int, params: SamplingParams | None = None) -> None:
        self.lm_gen.reset(slot, params)
        self.mimi.reset(slot)
        self._positions[slot] = 0

    def prompt(self, slot: int, prompt: PersonaPrompt, chunk: int = 1) -> None:
        """Run a PersonaPlex prompt in `slot` right after its reset, `chunk` frames per forward (see `LMGen.prompt`);
        its next step is live."""
        self.lm_gen.prompt(slot, prompt, chunk)
        self._positions[slot] = prompt.forwards

    def prefill(self, chunks: Sequence[PromptChunk]) -> None:
        """Prompt frames of several slots in one forward (`LMGen.prefill`); a slot whose prompt ends is live."""
        self.lm_gen.prefill(chunks)
        for c in chunks:
            if c.stop == c.prompt.forwards:
                self._positions[c.slot] = c.prompt.forwards

    def set_sampling(self, slot: int, params: SamplingParams) -> None:
        """Sampling of `slot` from its next step on; its conversation goes on where it is."""
        self.lm_gen.set_sampling(slot, params)

    def seek(self, slot: int, position: int) -> None:
        """Move `slot` to frame `position` as if it had generated zeros so far (benchmarks of long conversations:
        attention then reads a whole window). The slot's Mimi state is untouched."""
        self.lm_gen.offsets[slot] = position
        self.lm_gen.ring[slot] = 0
        self._positions[slot] = position

    def bucket(self, batch: int) -> int:
        """The batch size a step of `batch` rows runs at."""
        return self._frame.bucket(batch) if self._frame.pad else batch

    def capture(self, pool=None) -> None:
        """Capture the frame's CUDA graphs (one per bucket); a no-op without graphs."""
        self._frame.capture("capturing frame graphs", pool)

    def frame(
        self, rows: Rows, decode_rows: Rows, pcm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The device work of one frame: (speech [B, output_samples], tokens [B, 1 + agent_codebooks], pause
        [B, extra heads]).

        `rows` are the slots stepped; `decode_rows` the same slots, or the scratch slot for a row with no output
        yet, whose codes are UNGENERATED: decoding it into its own slot would advance that slot's decoder. A
        text-only model decodes nothing: its speech is [B, 0]."""
        with step_part("mimi_encode"):
            codes = self.mimi.encode_frame(rows, pcm)
        out = self.lm_gen.step(rows.index, codes)
        if self.text_only:
            return pcm.new_empty(len(pcm), 0), out.tokens, out.pause
        with step_part("mimi_decode"):
            speech = self.mimi.decode_frame(decode_rows, out.tokens[:, 1:].clamp(min=0))
        return speech.masked_fill(~out.valid[:, None], 0.0), out.tokens, out.pause

    @torch.no_grad()
    def step(self, slots: Sequence[int], pcm: np.ndarray | torch.Tensor) -> FrameOutput:
        """Advance `slots` (distinct) by one frame of user audio `pcm` [B, frame_size]: a host array (staged
        through pinned memory on CUDA) or a tensor on the pipeline's device."""
        slots = list(slots)
        batch = len(slots)
        if not batch or len(set(slots)) != batch or min(slots) < 0 or max(slots) >= self.num_slots:
            raise ValueError(f"slots must be distinct, in 0..{self.num_slots - 1}, got {slots}")
        if pcm.ndim != 2 or tuple(pcm.shape) != (batch, self.frame_size):
            raise ValueError(f"pcm must be [{batch}, {self.frame_size}], got {list(pcm.shape)}")
        valid = [self._positions[s] >= self._max_delay for s in slots]  # LMGen: position + 1 > max_delay
        decode_slots = [s if v else self.scratch for s, v in zip(slots, valid, strict=True)]
        for s in slots:
            self._positions[s] += 1
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copies out of the staging buffers are done
        stage = self._stage_rows.numpy()
        stage[0, :batch], stage[1, :batch] = slots, decode_slots
        rows = self._stage_rows[:, :batch]
        if isinstance(pcm, np.ndarray):
            self._stage_pcm.numpy()[:batch] = pcm
            pcm = self._stage_pcm[:batch]
        if self._frame.use_graphs:  # copied from the staging buffers straight into the graph's inputs
            speech, tokens, pause = self._frame(rows[0], rows[1], pcm)
        else:
            rows, pcm = rows.to(self.device, non_blocking=True), pcm.to(self.device, non_blocking=True)
            if self._frame.pad:
                speech, tokens, pause = self._frame(rows[0], rows[1], pcm)
            else:
                speech, tokens, pause = self.frame(Rows(rows[0], slots), Rows(rows[1], decode_slots), pcm)
        if self._staged is not None:
            self._staged.record()
        return FrameOutput(speech, tokens, valid, pause)
