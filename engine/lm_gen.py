"""Streaming generation over slots: the token ring buffer with delays, the per-frame step, and realignment.

Semantics follow the reference's `LMGen` with out-of-sync support: every slot has its own position, a step
advances only the slots given to it, and a slot resets alone. Position n of a slot reads column n of its ring
(initial tokens wherever n <= the stream's delay), the user codes for frame n are written at n + delay, and the
returned tokens are realigned so that text and the semantic codebook (sampled at the previous step) come out
with the acoustic codebooks sampled now.

A step is three parts: host-free bookkeeping on the ring (eager), the temporal step (`run_temporal`) and the
text sampling + DepFormer loop (`run_depformer`). The last two take and return batch-major tensors only, so the
engine can swap in bucketed CUDA graphs of them (`engine.graphs`) without changing anything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from duplexd.kernels.sampling import sample

from .config import SamplingParams
from .kv_cache import PagedBatch, PagedKVCache, window_pages
from .models.lm import LMModel

UNGENERATED = -2


@dataclass
class StepOutput:
    tokens: torch.Tensor  # [B, 1 + dep_q]: text, then audio codebooks; UNGENERATED where not valid
    valid: torch.Tensor  # [B] bool: False while the slot is still warming up its delays
    text_logits: torch.Tensor | None = None  # [B, text_card], for the raw (unaligned) step
    audio_logits: torch.Tensor | None = None  # [B, dep_q, card]


class LMGen:
    """Per-slot streaming state for `num_slots` conversations sharing one `LMModel`.

    `kv` is the paged cache the slots attend through; without one, LMGen makes a pool holding a whole window for
    every slot and assigns each slot its pages now (offline use). The engine passes its own pool and assigns
    pages at admission.
    """

    def __init__(self, model: LMModel, num_slots: int, kv: PagedKVCache | None = None, page_size: int = 64) -> None:
        cfg = model.cfg
        device = model.text_emb.device
        self.model, self.cfg, self.num_slots = model, cfg, num_slots
        self.ring_size = cfg.max_delay + 2
        self.ring = torch.full((num_slots, cfg.num_codebooks, self.ring_size), UNGENERATED, device=device)
        self.offsets = torch.zeros(num_slots, dtype=torch.long, device=device)
        if kv is None:
            kv = model.new_kv_cache(num_slots, num_slots * window_pages(cfg.context, page_size), page_size)
            for slot in range(num_slots):
                kv.allocate(slot)
        if kv.num_slots != num_slots:
            raise ValueError(f"the KV cache has {kv.num_slots} slots, LMGen {num_slots}")
        self.kv = kv
        self.run_temporal = self.temporal
        self.run_depformer = self.depformer
        self.delays = torch.tensor(cfg.delays, device=device)
        self.initial = torch.tensor(
            [cfg.text_initial_token_id] + [cfg.initial_token_id] * cfg.n_q, device=device
        )
        self.text_temperature = torch.zeros(num_slots, device=device)
        self.audio_temperature = torch.zeros(num_slots, device=device)
        self.text_topk = torch.ones(num_slots, dtype=torch.long, device=device)
        self.audio_topk = torch.ones(num_slots, dtype=torch.long, device=device)
        self.seeds = torch.zeros(num_slots, dtype=torch.long, device=device)
        for slot in range(num_slots):
            self.reset(slot)

    def reset(self, slot: int, params: SamplingParams | None = None) -> None:
        """Start a new conversation in `slot`; other slots are untouched."""
        self.ring[slot] = UNGENERATED
        self.offsets[slot] = 0
        self.set_sampling(slot, params or SamplingParams())

    def set_sampling(self, slot: int, params: SamplingParams) -> None:
        """Sampling of `slot` from its next step on; its conversation goes on where it is."""
        self.text_temperature[slot] = params.text_temperature
        self.audio_temperature[slot] = params.audio_temperature
        self.text_topk[slot] = params.text_topk
        self.audio_topk[slot] = params.audio_topk
        self.seeds[slot] = params.seed

    def temporal(self, tokens: torch.Tensor, positions: torch.Tensor, *view: torch.Tensor):
        """The temporal step: (hidden [B, dim], text logits [B, text_card]); `view` is a `PagedBatch`'s tensors."""
        return self.model.forward_text(tokens, positions, self.kv, PagedBatch(*view))

    def depformer(self, hidden, text_logits, text_temp, text_topk, audio_temp, audio_topk, seeds, positions):
        """Sample the text token, then run the DepFormer sampling each codebook: (text [B], audio [B, dep_q])."""
        text, out = self._depformer(hidden, text_logits, text_temp, text_topk, audio_temp, audio_topk, seeds,
                                    positions)
        return text, out.tokens

    def _depformer(self, hidden, text_logits, text_temp, text_topk, audio_temp, audio_topk, seeds, positions,
                   want_logits: bool = False):
        text = sample(text_logits, text_temp, text_topk, seeds, positions, 0)
        out = self.model.forward_depformer(
            hidden, text, lambda step, logits: sample(logits, audio_temp, audio_topk, seeds, positions, 1 + step),
            want_logits=want_logits,
        )
        return text, out

    def padding_rows(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """One row of inputs for `temporal` and for `depformer` that a bucket pads with: initial tokens at
        position 0 writing to the scratch page, greedy sampling. Nothing a live slot owns is read or written."""
        cfg, device, kv = self.cfg, self.offsets.device, self.kv
        zero = torch.zeros(1, dtype=torch.long, device=device)
        scratch_row = torch.full((1, kv.max_pages), kv.scratch, dtype=torch.int32, device=device)
        temporal = (self.initial[None].clone(), zero, scratch_row, torch.ones(1, dtype=torch.int32, device=device),
                    torch.full((1,), kv.scratch, dtype=torch.long, device=device), zero)
        dtype = self.model.text_emb.dtype
        depformer = (torch.zeros(1, cfg.dim, dtype=dtype, device=device),
                     torch.zeros(1, cfg.text_card, dtype=dtype, device=device),
                     torch.zeros(1, device=device), torch.ones(1, dtype=torch.long, device=device),
                     torch.zeros(1, device=device), torch.ones(1, dtype=torch.long, device=device), zero, zero)
        return temporal, depformer

    @torch.no_grad()
    def step(self, slots: torch.Tensor, user_codes: torch.Tensor, return_logits: bool = False) -> StepOutput:
        """Advance `slots` [B] (distinct) by one frame given the user's codes [B, >= n_q - dep_q]."""
        cfg, ring, ct = self.cfg, self.ring, self.ring_size
        n_user = cfg.num_user_codebooks
        if user_codes.dim() != 2 or user_codes.shape[0] != len(slots) or user_codes.shape[1] < n_user:
            raise ValueError(f"user_codes must be [{len(slots)}, >= {n_user}], got {list(user_codes.shape)}")
        slots = slots.to(self.offsets.device)
        offsets = self.offsets[slots]
        rows = slots[:, None]

        user_streams = torch.arange(cfg.dep_q + 1, cfg.num_codebooks, device=slots.device)
        write_at = (offsets[:, None] + self.delays[user_streams]) % ct
        ring[rows, user_streams[None, :], write_at] = user_codes[:, :n_user].to(ring.dtype)

        column = ring[slots, :, :].gather(2, (offsets % ct)[:, None, None].expand(-1, cfg.num_codebooks, 1))[..., 0]
        is_initial = offsets[:, None] <= self.delays[None, :]
        tokens_in = torch.where(is_initial, self.initial[None, :], column)

        view = self.kv.batch(slots, offsets)
        sampling = (self.text_temperature[slots], self.text_topk[slots], self.audio_temperature[slots],
                    self.audio_topk[slots], self.seeds[slots], offsets)
        text_logits = audio_logits = None
        if return_logits:  # eager, keeping every DepFormer step's logits
            hidden, text_logits = self.temporal(tokens_in, offsets, *view.tensors())
            text, depformer = self._depformer(hidden, text_logits, *sampling, want_logits=True)
            audio, audio_logits = depformer.tokens, depformer.logits
        else:
            hidden, logits = self.run_temporal(tokens_in, offsets, *view.tensors())
            text, audio = self.run_depformer(hidden, logits, *sampling)

        offsets = offsets + 1
        self.offsets[slots] = offsets
        generated = torch.cat([text[:, None], audio], dim=1)
        gen_streams = torch.arange(cfg.dep_q + 1, device=slots.device)
        ring[rows, gen_streams[None, :], (offsets % ct)[:, None]] = generated

        read_at = (offsets[:, None] - cfg.max_delay + self.delays[gen_streams][None, :]) % ct
        out = ring[rows, gen_streams[None, :], read_at]
        valid = offsets > cfg.max_delay
        out = out.masked_fill(~valid[:, None], UNGENERATED)
        return StepOutput(out, valid, text_logits, audio_logits)
