"""Executes step plans on the device: resets and sampling updates, then the batch's frame, its outputs copied back.

Runs on the engine's loop thread only, which does all of the engine's torch work (warm-up, graph capture, steps).
A step's outputs come back in one copy each into pinned buffers and one wait (CUDA), and text tokens are turned
into text here, outside the scheduler's lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from ..kv.paged import PagedKVCache
from ..models.tokenizer import TextTokenizer
from ..persona.prompt import PersonaPrompt, PromptChunk
from .pipeline import Pipeline
from .plan import PrefillResult, StepPlan, StepResult

logger = logging.getLogger(__name__)

# A prompt beside live sessions advances at least this many frames a step, however busy the step (a 200-frame
# prompt then takes 25 steps, 2 s, at worst).
MIN_PREFILL_ROWS = 8


class Runner:
    def __init__(self, pipeline: Pipeline, kv: PagedKVCache, tokenizer: TextTokenizer | None, silent: set[int]) -> None:
        self.pipeline, self.kv, self.tokenizer, self.silent = pipeline, kv, tokenizer, silent
        device = pipeline.device
        pin = device.type == "cuda"
        rows, cfg = pipeline.num_slots, pipeline.lm_gen.cfg
        self._host_pcm = torch.zeros(rows, pipeline.output_samples, pin_memory=pin)
        self._host_tokens = torch.zeros(rows, 1 + cfg.agent_codebooks, dtype=torch.long, pin_memory=pin)
        self._heads = cfg.extra_heads_num_heads
        self._host_pause = torch.zeros(rows, self._heads, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None

    def warm_up(self, slots: Sequence[int], graphs: bool) -> float:
        """Two throw-away steps (the second decodes) at every batch size a step can run at (the buckets when
        padding, else 1..len(slots)) in the free `slots`, so first-use costs (kernel selection and compilation,
        oneDNN primitives and packed weights, allocator growth) are paid before the first session rather than in
        its first frames; then, with `graphs`, the CUDA graph capture. Returns a step's seconds at the largest size:
        the least of its last three steps (eager: an upper bound where graphs replay it)."""
        pipeline = self.pipeline
        sizes = sorted({pipeline.bucket(n) for n in range(1, len(slots) + 1)})
        seconds: list[float] = []
        for size in sizes:
            steps = 4 if size == sizes[-1] else 2
            batch = list(slots[: min(size, self.kv.pages_free)])
            for slot in batch:
                self.kv.allocate(slot, steps)
                pipeline.reset(slot)  # back to position 0: its frames stay inside the pages just reserved
            try:
                for _ in range(steps):
                    started = time.perf_counter()
                    pipeline.step(batch, np.zeros((len(batch), pipeline.frame_size), np.float32))
                    self._wait()
                    seconds.append(time.perf_counter() - started)
            finally:
                for slot in batch:
                    self.kv.free(slot)
        if graphs:
            pipeline.capture(torch.cuda.graph_pool_handle())
        return min(seconds[-3:])

    def _wait(self) -> None:
        """Wait for the device (timing at warm-up only; steps never wait but for their outputs)."""
        if self._copied is not None:
            torch.cuda.synchronize()

    def size_prefill(self, budget: float, most: int) -> int:
        """The most prompt frames (a power of two from `MIN_PREFILL_ROWS`, at most `most`) one prefill runs within
        `budget` seconds, timed on throw-away rows in the scratch slot (whose pages nobody reads): the least of two
        runs after a first that pays first-use costs (noise on a busy host only ever adds time)."""
        lm_gen, scratch = self.pipeline.lm_gen, self.pipeline.scratch
        cfg = lm_gen.cfg
        chosen = rows = min(MIN_PREFILL_ROWS, most)
        while rows <= most:
            prompt = PersonaPrompt(None, torch.zeros(rows + 1, cfg.num_codebooks, dtype=torch.long), torch.zeros(2, 1))
            seconds = []
            for _ in range(3):
                started = time.perf_counter()
                lm_gen.prefill([PromptChunk(scratch, prompt, 0, rows)])
                self._wait()
                seconds.append(time.perf_counter() - started)
            if min(seconds[1:]) > budget:
                break
            chosen, rows = rows, rows * 2
        logger.info("prefill: up to %d prompt frames per step beside live sessions (%.1f ms)", chosen, budget * 1e3)
        return chosen

    def prefill(self, chunks: Sequence[PromptChunk]) -> PrefillResult:
        """Run prompt frames (`Pipeline.prefill`); a failure comes back as `PrefillResult.error`, never raised."""
        rows = sum(c.stop - c.start for c in chunks)
        started = time.perf_counter()
        try:
            self.pipeline.prefill(chunks)
        except Exception as e:  # noqa: BLE001 - handed to the scheduler, which ends the prompts' sessions
            return PrefillResult(rows, error=e)
        return PrefillResult(rows, time.perf_counter() - started)

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply `plan`; a failure of the batch comes back as `StepResult.error`, never raised."""
        for slot, params in plan.resets:
            self.pipeline.reset(slot, params)
        for slot, params in plan.retunes:
            self.pipeline.set_sampling(slot, params)
        if not plan.slots:
            return StepResult()
        started = time.perf_counter()
        try:
            out = self.pipeline.step(plan.slots, np.stack(plan.frames))
            pcm, tokens, pause = self._to_host(out.pcm, out.tokens, out.pause)
            texts = [self._text(row[0]) for row in tokens]
        except Exception as e:  # noqa: BLE001 - handed to the scheduler, which ends the batch's sessions
            return StepResult(error=e)
        return StepResult(
            pcm,
            tokens,
            texts,
            out.valid,
            pause if self._heads else None,
            self.pipeline.bucket(len(plan.slots)),
            time.perf_counter() - started,
        )

    def _to_host(
        self, pcm: torch.Tensor, tokens: torch.Tensor, pause: torch.Tensor
    ) -> tuple[np.ndarray, list[list[int]], np.ndarray]:
        """The step's outputs on the host: one copy each (pinned, not waiting) and one wait on CUDA."""
        if self._copied is None:
            return pcm.float().numpy().copy(), tokens.tolist(), pause.float().numpy().copy()
        batch = pcm.shape[0]
        self._host_pcm[:batch].copy_(pcm, non_blocking=True)
        self._host_tokens[:batch].copy_(tokens, non_blocking=True)
        self._host_pause[:batch].copy_(pause, non_blocking=True)
        self._copied.record()
        self._copied.synchronize()
        return (
            self._host_pcm[:batch].numpy().copy(),
            self._host_tokens[:batch].tolist(),
            self._host_pause[:batch].numpy().copy(),
        )

    def _text(self, token: int) -> str:
        if token in self.silent or self.tokenizer is None or token < 0:
            return ""
        return self.tokenizer.piece(token)
