"""Streaming generation over slots: the token ring buffer with delays, the per-frame step, and realignment.

Semantics follow the reference's `LMGen` with out-of-sync support: every slot has its own position, a step
advances only the slots given to it, and a slot resets alone. Position n of a slot reads column n of its ring
(initial tokens wherever n <= the stream's delay), the user codes for frame n are written at n + delay, and the
returned tokens are realigned so that text and the semantic codebook (sampled at the previous step) come out
with the acoustic codebooks sampled now.

A step is host-free: ring bookkeeping, the temporal step and the text sampling + DepFormer loop are device ops
on device tensors only, so the engine captures it (with Mimi around it) in one CUDA graph per batch bucket.
Padding rows of a bucket run as the scratch slot (`scratch_slot`, one past the last real slot), whose ring,
position and KV pages nobody else reads.

Text sampling applies each session's repetition penalty and pad_mult (the Rust server's knobs). Every slot keeps
the last `MAX_REPETITION_CONTEXT` text tokens it sampled that were not special (padding, end of padding, text
start), newest first, on the device: a step shifts the new token in with a `where`, no host look at its value.

A PersonaPlex model (`LMConfig.predicts_user_audio`) follows its reference's rules: a session opens with a
persona prompt (forced frames, nothing sampled: `prompt` one forward per frame as the reference, or `prefill`
many frames of several slots in one forward), and the user's codes for frame n go
to column n + 1 + delay, so the model reads them one frame later than Moshi does. A forced mark on a ring entry
keeps its value in place of the sampled one (the agent's delayed codebooks right after the prompt).

A text-only model (Kyutai STT, `LMConfig.text_only`) samples the text token alone, reads the user's codes one
frame later as PersonaPlex does (`LMConfig.user_lag`: step n reads user frame n - 1, step 0 the initial tokens,
moshi-server's convention), and its step also gives its extra heads' pause probabilities (`StepOutput.pause`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from duplexd.kernels.dispatch import use_triton
from duplexd.kernels.sampling import FrameSampler, sample
from duplexd.kernels.text_penalties import repetition_penalty

from ..kv.paged import PagedKVCache, window_pages
from ..models.config import ConfigError
from ..models.lm import DepformerOutput, LMModel
from ..persona.prompt import PersonaPrompt, PromptChunk
from .sampling import MAX_REPETITION_CONTEXT, SamplingParams

UNGENERATED = -2


@dataclass
class StepOutput:
    tokens: torch.Tensor  # [B, 1 + agent_codebooks]: text, then audio codebooks; UNGENERATED where not valid
    valid: torch.Tensor  # [B] bool: False while the slot is still warming up its delays
    pause: torch.Tensor  # [B, extra heads] fp32: each extra head's class-0 probability ([B, 0] without heads)
    text_logits: torch.Tensor | None = None  # [B, text_card], for the raw (unaligned) step
    audio_logits: torch.Tensor | None = None  # [B, agent_codebooks, card]


class LMGen:
    """Per-slot streaming state for `num_slots` conversations sharing one `LMModel`.

    `kv` is the paged cache the slots attend through; without one, LMGen makes a pool (in `kv_dtype`) holding a
    whole window for every slot and assigns each slot its pages now (offline use). The engine passes its own pool
    and assigns pages at admission. Every per-slot tensor has one extra row for the scratch slot.
    """

    def __init__(
        self,
        model: LMModel,
        num_slots: int,
        kv: PagedKVCache | None = None,
        page_size: int = 64,
        kv_dtype: str = "bf16",
    ) -> None:
        cfg = model.cfg
        if cfg.speaks_text:
            raise ConfigError("a text-to-speech model (Kyutai TTS) runs in engine.tts, not as a dialogue or STT model")
        device = model.text_emb.device
        self.model, self.cfg, self.num_slots = model, cfg, num_slots
        # PersonaPlex and STT read the user's audio one frame later than Moshi: its codes for frame n go to column
        # n + 1 + delay (`LMConfig.user_lag`).
        self.user_lag = cfg.user_lag
        self.ring_size = cfg.max_delay + 2 + self.user_lag
        self.scratch_slot = rows = num_slots
        rows += 1
        self.ring = torch.full((rows, cfg.num_codebooks, self.ring_size), UNGENERATED, device=device)
        self.offsets = torch.zeros(rows, dtype=torch.long, device=device)
        # Generated streams whose value in a ring column is given rather than sampled (a prompt's last frame).
        self.forced = torch.zeros(rows, cfg.agent_codebooks + 1, self.ring_size, dtype=torch.bool, device=device)
        if kv is None:
            kv = model.new_kv_cache(num_slots, num_slots * window_pages(cfg.context, page_size), page_size, kv_dtype)
            for slot in range(num_slots):
                kv.allocate(slot)
        if kv.num_slots != num_slots:
            raise ValueError(f"the KV cache has {kv.num_slots} slots, LMGen {num_slots}")
        self.kv = kv
        self._pin = device.type == "cuda"  # prompt rows go up from pinned memory without a wait
        self.delays = torch.tensor(cfg.delays, device=device)
        self.initial = torch.tensor([cfg.text_initial_token_id] + [cfg.initial_token_id] * cfg.n_q, device=device)
        self.text_temperature = torch.zeros(rows, device=device)
        self.audio_temperature = torch.zeros(rows, device=device)
        self.text_topk = torch.ones(rows, dtype=torch.long, device=device)
        self.audio_topk = torch.ones(rows, dtype=torch.long, device=device)
        self.seeds = torch.zeros(rows, dtype=torch.long, device=device)
        self.repetition_penalty = torch.ones(rows, device=device)
        self.repetition_context = torch.zeros(rows, dtype=torch.long, device=device)
        self.pad_mult = torch.zeros(rows, device=device)
        self.text_skip = (cfg.text_padding_token_id, cfg.end_of_text_padding_id, cfg.text_initial_token_id)
        self.text_history = torch.full((rows, MAX_REPETITION_CONTEXT), -1, dtype=torch.long, device=device)
        for slot in range(num_slots):
            self.reset(slot)
        self.set_sampling(self.scratch_slot, SamplingParams(0.0, 1, 0.0, 1))  # padding rows: greedy, cheap

    def reset(self, slot: int, params: SamplingParams | None = None) -> None:
        """Start a new conversation in `slot` (its KV table row goes to the device now); other slots are
        untouched."""
        self.ring[slot] = UNGENERATED
        self.forced[slot] = False
        self.offsets[slot] = 0
        self.text_history[slot] = -1
        self.kv.upload(slot)
        self.set_sampling(slot, params or SamplingParams())

    def set_sampling(self, slot: int, params: SamplingParams) -> None:
        """Sampling of `slot` from its next step on; its conversation goes on where it is."""
        self.text_temperature[slot] = params.text_temperature
        self.audio_temperature[slot] = params.audio_temperature
        self.text_topk[slot] = params.text_topk
        self.audio_topk[slot] = params.audio_topk
        self.seeds[slot] = params.seed
        self.repetition_penalty[slot] = params.repetition_penalty
        self.repetition_context[slot] = params.repetition_penalty_context
        self.pad_mult[slot] = params.pad_mult

    def sample_text(
        self,
        slots: torch.Tensor,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        seeds: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """The text token of `slots` [B] from `logits` [B, text_card], penalised by each slot's history, which
        then takes the token in (unless it is special)."""
        history = self.text_history[slots]
        penalised = repetition_penalty(
            logits, history, self.repetition_penalty[slots], self.repetition_context[slots], self.text_skip
        )
        text = sample(
            penalised, temperature, top_k, seeds, positions, 0, self.cfg.text_padding_token_id, self.pad_mult[slots]
        )
        said = torch.ones_like(text, dtype=torch.bool)
        for token in self.text_skip:
            said &= text != token
        shifted = torch.cat([text[:, None], history[:, :-1]], dim=1)
        self.text_history[slots] = torch.where(said[:, None], shifted, history)
        return text

    def depformer(
        self,
        slots,
        hidden,
        text_logits,
        text_temp,
        text_topk,
        audio_temp,
        audio_topk,
        seeds,
        positions,
        want_logits: bool = False,
    ):
        """Sample the text token, then run the DepFormer sampling each codebook: (text [B], DepformerOutput). A
        text-only model has no DepFormer: no audio tokens."""
        text = self.sample_text(slots, text_logits, text_temp, text_topk, seeds, positions)
        if self.cfg.text_only:
            return text, DepformerOutput(text.new_empty(len(text), 0), None)
        pick = lambda step, logits: sample(logits, audio_temp, audio_topk, seeds, positions, 1 + step)  # noqa: E731
        if hidden.device.type == "cpu" and not use_triton(hidden):
            top_k = audio_topk.unique()  # host data on the CPU: no sync to avoid
            if len(top_k) == 1:  # every row's top-k the same (the default): the rows read once a frame
                sampler = FrameSampler(audio_temp, int(top_k), seeds, positions, range(1, 1 + self.cfg.agent_codebooks))
                pick = lambda step, logits: sampler(1 + step, logits)  # noqa: E731
        out = self.model.forward_depformer(hidden, text, pick, want_logits=want_logits)
        return text, out

    @torch.no_grad()
    def step(self, slots: torch.Tensor, user_codes: torch.Tensor, return_logits: bool = False) -> StepOutput:
        """Advance `slots` [B] (distinct) by one frame given the user's codes [B, >= num_user_codebooks]."""
        cfg, ring, ct = self.cfg, self.ring, self.ring_size
        n_user = cfg.num_user_codebooks
        if user_codes.dim() != 2 or user_codes.shape[0] != len(slots) or user_codes.shape[1] < n_user:
            raise ValueError(f"user_codes must be [{len(slots)}, >= {n_user}], got {list(user_codes.shape)}")
        slots = slots.to(self.offsets.device)
        offsets = self.offsets[slots]
        rows = slots[:, None]

        user_streams = torch.arange(cfg.agent_codebooks + 1, cfg.num_codebooks, device=slots.device)
        write_at = (offsets[:, None] + self.user_lag + self.delays[user_streams]) % ct
        ring[rows, user_streams[None, :], write_at] = user_codes[:, :n_user].to(ring.dtype)

        column = ring[slots, :, :].gather(2, (offsets % ct)[:, None, None].expand(-1, cfg.num_codebooks, 1))[..., 0]
        is_initial = offsets[:, None] <= self.delays[None, :]
        tokens_in = torch.where(is_initial, self.initial[None, :], column)

        view = self.kv.batch(slots, offsets)
        sampling = (
            self.text_temperature[slots],
            self.text_topk[slots],
            self.audio_temperature[slots],
            self.audio_topk[slots],
            self.seeds[slots],
            offsets,
        )
        text_logits = audio_logits = None
        hidden, logits = self.model.forward_text(tokens_in, offsets, self.kv, view)
        pause = self.model.pause_probabilities(hidden)
        text, depformer = self.depformer(slots, hidden, logits, *sampling, want_logits=return_logits)
        audio = depformer.tokens
        if return_logits:
            text_logits, audio_logits = logits, depformer.logits

        offsets = offsets + 1
        self.offsets[slots] = offsets
        generated = torch.cat([text[:, None], audio], dim=1)
        gen_streams = torch.arange(cfg.agent_codebooks + 1, device=slots.device)
        target = (offsets % ct)[:, None]
        forced = self.forced[rows, gen_streams[None, :], target]
        generated = torch.where(forced, ring[rows, gen_streams[None, :], target], generated)
        # A device tensor, not `= False`: index_put copies a host value to the device, which a graph cannot capture.
        self.forced[rows, gen_streams[None, :], target] = torch.zeros_like(forced)
        ring[rows, gen_streams[None, :], target] = generated

        read_at = (offsets[:, None] - cfg.max_delay + self.delays[gen_streams][None, :]) % ct
        out = ring[rows, gen_streams[None, :], read_at]
        valid = offsets > cfg.max_delay
        out = out.masked_fill(~valid[:, None], UNGENERATED)
        return StepOutput(out, valid, pause, text_logits, audio_logits)

    def prompt_rows(self, prompt: PersonaPrompt, start: int, stop: int) -> torch.Tensor:
        """The summed input embeddings [stop - start, dim] of the prompt's forwards start..stop-1."""
        dtype = self.model.text_emb.dtype
        stored = 0 if prompt.embeddings is None else len(prompt.embeddings)
        parts = []
        if prompt.embeddings is not None and start < stored:
            parts.append(self._upload(prompt.embeddings[start : min(stop, stored)]).to(dtype))
        if stop > stored:
            parts.append(self.model.embed(self._upload(prompt.columns[max(start, stored) - stored : stop - stored])))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, copied from pinned memory on CUDA so that the host never waits."""
        if self._pin:
            host = host.pin_memory()
        return host.to(self.offsets.device, non_blocking=True)

    @torch.no_grad()
    def prefill(self, chunks: Sequence[PromptChunk]) -> None:
        """Run the prompt forwards of `chunks` (distinct slots, each reset and prefilled up to its `start`) as one
        temporal forward, one row per frame, no DepFormer: every token of a prompt frame is given.

        All rows' keys and values are written before any row attends, and row p of a slot attends to its slot's
        positions up to p: causal attention within the chunk over the slot's paged KV, by the decode kernel's
        per-row lengths. A slot whose chunk ends its prompt is left as `end_prompt` describes.
        """
        if not chunks:
            return
        if not self.cfg.predicts_user_audio:
            raise ValueError("a persona prompt needs a PersonaPlex model (dep_q = n_q)")
        for c in chunks:
            if not 0 <= c.start < c.stop <= c.prompt.forwards:
                raise ValueError(f"prompt rows {c.start}..{c.stop} out of 0..{c.prompt.forwards}")
            if c.prompt.calls > self.kv.context:
                raise ValueError(f"a prompt of {c.prompt.calls} frames is longer than the window ({self.kv.context})")
        for c in chunks:
            if c.start == 0:  # its table row may have grown since its reset (`PagedKVCache.reserve`)
                self.kv.upload(c.slot)
        x = torch.cat([self.prompt_rows(c.prompt, c.start, c.stop) for c in chunks])
        rows = self._upload(torch.tensor([[c.slot, p] for c in chunks for p in range(c.start, c.stop)]))
        slots, positions = rows[:, 0], rows[:, 1]
        # Each chunk is a run of consecutive positions of one slot (one causal call on CPU); rows of one frame each
        # are plain decode queries, so `prompt(chunk=1)` stays the reference's path, the prefill's oracle.
        ends = list(itertools.accumulate(c.stop - c.start for c in chunks))
        runs: tuple[tuple[int, int, int], ...] | None = tuple(
            (end - (c.stop - c.start), end, c.start) for c, end in zip(chunks, ends, strict=True)
        )
        if len(chunks) == ends[-1]:
            runs = None
        self.model.temporal(x, positions, self.kv, self.kv.batch(slots, positions, runs))
        for c in chunks:
            if c.stop == c.prompt.forwards:
                self.end_prompt(c.slot, c.prompt)

    def end_prompt(self, slot: int, prompt: PersonaPrompt) -> None:
        """Leave `slot` where the reference's LMGen is after a prompt: P - 1 forwards done (the first prompt frame
        has none), the ring holding the prompt's last columns with the agent's delayed codebooks of the next column
        forced. The next `step` is the first live frame; its output is padding and silence, as the reference's."""
        cfg, ct = self.cfg, self.ring_size
        last = prompt.forwards  # column P - 1: the first live input
        self.ring[slot] = UNGENERATED
        tail = self._upload(prompt.tail)
        self.ring[slot, :, last % ct] = tail[0]
        self.ring[slot, :, (last + 1) % ct] = tail[1]
        delayed = self.delays[: cfg.agent_codebooks + 1] > 0
        self.forced[slot] = False
        self.forced[slot, :, (last + 1) % ct] = delayed
        self.offsets[slot] = last

    @torch.no_grad()
    def prompt(self, slot: int, prompt: PersonaPrompt, chunk: int = 1) -> None:
        """Run a PersonaPlex prompt in `slot` (just reset), `chunk` frames per forward: one, as the reference does
        it, or more (`prefill`); the slot ends the same either way. Nothing is sampled and no output is sent."""
        if chunk < 1:
            raise ValueError("chunk must be >= 1")
        for start in range(0, prompt.forwards, chunk):
            self.prefill([PromptChunk(slot, prompt, start, min(start + chunk, prompt.forwards))])
