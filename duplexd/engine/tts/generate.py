"""Kyutai TTS generation over slots: each slot says its own words in its own voice, at its own position.

A step is split in two around the host: the temporal step and the text sample run on the device, the sampled
tokens come back (one small copy per step), each slot's `WordFeeder` turns its sample into the text the model reads,
and that text goes up for the DepFormer, which samples the slot's audio codebooks: `n_q` of them, all the model's
or fewer, as moshi's `TTSModel(n_q=...)` sets `lm.dep_q = n_q` (the temporal transformer then reads the zero token
for the codebooks not said). The audio of a slot's first `delay + delay_steps` steps (its codebook's delay plus the
audio delay) is forced to the zero token, as moshi's `TTSModel` does. Outputs are realigned as moshi's `LMGen`
returns them: row n, given at step n + max_delay, holds the text read at step n and the audio of the same frame
(`TTSResult.frames`).

With `pad` (and on CUDA `graphs`) each half runs at its batch bucket (`BucketedCall`): the padding rows run as the
scratch slot (one row past the last slot, the KV cache's scratch slot), every row is sampled (temperature 0 is the
argmax) and the DepFormer runs for every row, the audio of a slot inside its delay masked after it, so the shapes
depend on the bucket alone and each half is one captured graph a bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from duplexd.kernels.dispatch import use_triton
from duplexd.kernels.sampling import FrameSampler, sample

from ..graphs import BucketedCall, default_buckets
from ..kv.paged import window_pages
from ..models.lm import LMModel
from .conditioning import Conditioner
from .config import TTSConfig
from .words import Word, WordFeeder, WordState

UNGENERATED = -2
TEXT_TOP_K, AUDIO_TOP_K = 25, 250  # moshi's LMGen defaults, which its TTSModel keeps


@dataclass(frozen=True)
class Voice:
    """A session's conditioning: 1 to 5 voice embeddings [speaker_dim, frames] and its table values (the distilled
    CFG coefficient as the `cfg` table spells it, "2.0" by default)."""

    embeddings: tuple[torch.Tensor, ...]
    values: tuple[tuple[str, str | None], ...] = (("control", "ok"), ("cfg", "2.0"))


@dataclass
class TTSResult:
    """What `generate` returns for one slot, as moshi's `TTSResult` holds it for one batch item."""

    frames: list[list[int]] = field(default_factory=list)  # [1 + n_q] a row: muxed text, then audio (-1 early)
    end_step: int | None = None
    consumed_at: list[int] = field(default_factory=list)
    transcript: list[tuple[str, int]] = field(default_factory=list)


class TTSGen:
    """Per-slot state of `num_slots` TTS sessions sharing one model (offline: every slot owns a whole window)."""

    def __init__(
        self,
        model: LMModel,
        conditioner: Conditioner,
        tts: TTSConfig,
        num_slots: int,
        page_size: int = 16,
        max_padding: int = 8,
        initial_padding: int = 2,
        final_padding: int = 4,
        *,
        buckets: Sequence[int] | None = None,
        graphs: bool = False,
        pad: bool = False,
        n_q: int | None = None,
    ) -> None:
        cfg = model.cfg
        if not cfg.speaks_text:
            raise ValueError("TTSGen needs a text-to-speech model (cross-attention, muxed text)")
        self.n_q = cfg.dep_q if n_q is None else n_q
        if not 1 <= self.n_q <= cfg.dep_q:
            raise ValueError(f"n_q={self.n_q}: the model says 1 to {cfg.dep_q} codebooks")
        device = model.text_emb.device
        self.model, self.cfg, self.tts, self.conditioner = model, cfg, tts, conditioner
        self.feeder = WordFeeder(cfg.text_in_card, tts.second_stream_ahead, max_padding, initial_padding)
        self.ring_size = cfg.max_delay + 2
        self.scratch = num_slots  # padding rows of a bucket run here; the KV cache's scratch slot too
        rows = num_slots + 1
        self.ring = torch.full((rows, cfg.num_codebooks, self.ring_size), UNGENERATED, device=device)
        self.offsets = torch.zeros(rows, dtype=torch.long, device=device)
        self.kv = model.new_kv_cache(num_slots, num_slots * window_pages(cfg.context, page_size), page_size)
        for slot in range(num_slots):
            self.kv.allocate(slot)
        sources = tts.max_speakers * tts.speaker_frames
        self.voices = torch.zeros(
            cfg.num_layers, 2, rows, cfg.num_heads, sources, cfg.head_dim, dtype=model.text_emb.dtype, device=device
        )
        self.sums = torch.zeros(rows, cfg.dim, dtype=model.text_emb.dtype, device=device)
        self.delays = torch.tensor(cfg.delays, device=device)
        self.initial = torch.tensor([cfg.text_initial_token_id] + [cfg.initial_token_id] * cfg.n_q, device=device)
        self.temperature = torch.zeros(rows, device=device)
        self.seeds = torch.zeros(rows, dtype=torch.long, device=device)
        self.states: list[WordState | None] = [None] * num_slots
        self.greedy = [True] * num_slots  # host copies of `temperature == 0`: an all-greedy step takes argmaxes
        self.steps = [0] * num_slots  # host copies of the slots' offsets: the steps each session has taken
        self.final_padding = final_padding
        scratch = torch.full((1,), self.scratch, dtype=torch.long, device=device)
        buckets = buckets or default_buckets(num_slots)
        self.bucketed_listen = BucketedCall(
            lambda index: self.listen(index, False), (scratch,), buckets, graphs=graphs, pad=pad
        )
        self.bucketed_speak = BucketedCall(
            lambda index, text, hidden: self.speak(index, text, hidden, False),
            (
                scratch,
                torch.zeros(1, dtype=torch.long, device=device),
                torch.zeros(1, cfg.dim, dtype=self.sums.dtype, device=device),
            ),
            buckets,
            graphs=graphs,
            pad=pad,
        )

    def capture(self, pool=None) -> None:
        """Capture both halves' CUDA graphs (one per bucket each, in one memory pool); a no-op without graphs."""
        if not self.bucketed_listen.use_graphs:
            return
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self.bucketed_listen.capture("capturing TTS listen graphs", pool)
        self.bucketed_speak.capture("capturing TTS speak graphs", pool)

    def start(self, slot: int, words: Sequence[Word], voice: Voice, temperature: float = 0.0, seed: int = 0) -> None:
        """A new session in `slot`: its words, its voice's keys and values and its sum vector, from position 0."""
        model = self.model
        dtype, device = model.text_emb.dtype, model.text_emb.device
        source = self.conditioner.cross_source(list(voice.embeddings)).to(device, dtype)
        self.voices[:, :, slot] = model.voice_keys_values(source)
        self.sums[slot] = self.conditioner.sum_vector(dict(voice.values)).to(device, dtype)
        self.ring[slot] = UNGENERATED
        self.offsets[slot] = 0
        self.kv.upload(slot)
        self.temperature[slot] = temperature
        self.seeds[slot] = seed
        self.greedy[slot] = temperature == 0
        self.steps[slot] = 0
        self.states[slot] = self.feeder.start(words)

    def push(self, slot: int, words: Sequence[Word]) -> None:
        """More words for `slot`'s session, after those it has."""
        self._state(slot).words.extend(words)

    def finish(self, slot: int) -> None:
        """`slot`'s text is complete: it may take its last words without waiting for lookahead ones."""
        self._state(slot).complete = True

    def ready(self, slot: int) -> bool:
        """Whether `slot` may step now (`WordFeeder.ready`); a slot that may not is left out of the step and waits
        without holding up the others."""
        return self.feeder.ready(self._state(slot))

    def done(self, slot: int) -> bool:
        """Whether `slot` has said its text: `final_padding` steps past its last word and the audio delay behind it
        (moshi's `TTSModel.generate` ends a batch when every item is)."""
        end = self._state(slot).end_step
        return end is not None and self.steps[slot] >= end + self.tts.delay_steps + self.final_padding

    def _state(self, slot: int) -> WordState:
        state = self.states[slot]
        if state is None:
            raise ValueError(f"slot {slot} has no session")
        return state

    @torch.no_grad()
    def step(
        self, slots: Sequence[int], turn: Callable[[], AbstractContextManager[object]] = nullcontext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance `slots` one frame: rows [B, 1 + n_q] (UNGENERATED until a slot's delays have passed), valid [B].

        `listen` and `speak` are device work only (`tests/test_tts_host_sync.py`), each run in a `turn` of the
        device (`engine.turns`); between them the host reads the samples and the slots' offsets (one copy back) and
        sends up the text the words decide (one copy)."""
        device = self.offsets.device
        index = torch.tensor(list(slots), dtype=torch.long, device=device)
        bucketed = self.bucketed_listen.pad
        greedy = all(self.greedy[slot] for slot in slots)  # sampling's noise and top-k are a quarter of a CPU step
        with turn():
            hidden, sampled, offsets = (
                self.bucketed_listen(index) if bucketed else self.listen(index, greedy, self._voices_of(slots))
            )
            sampled_list, positions = sampled.tolist(), offsets.tolist()
        read = []  # the host's part of the step: each slot's words decide the text the model reads
        for slot, offset, token in zip(slots, positions, sampled_list, strict=True):
            read.append(self.feeder.next_token(offset, self._state(slot), token)[0])
            self.steps[slot] = offset + 1
        text = torch.tensor(read, device=device)
        if bucketed:  # every row through the DepFormer, those inside their audio delay masked after it
            with turn():
                out, valid = self.bucketed_speak(index, text, hidden)
                return out, valid
        # A slot still inside its audio delay speaks no codebook (each is forced to the zero token): the DepFormer
        # runs for the others only, as moshi's generate skips it while the whole batch is in the delay.
        speaking = [row for row, offset in enumerate(positions) if offset >= self.tts.delay_steps]
        rows = None if len(speaking) == len(slots) else torch.tensor(speaking, dtype=torch.long, device=device)
        with turn():
            return self.speak(index, text, hidden, greedy, rows)

    def _pick(self, index: torch.Tensor, greedy: bool, logits: torch.Tensor, top_k: int, stream: int) -> torch.Tensor:
        if greedy:
            return logits.argmax(dim=-1)
        at = self.offsets[index]
        return sample(logits, self.temperature[index], torch.full_like(at, top_k), self.seeds[index], at, stream)

    def _voices_of(self, slots: Sequence[int]) -> torch.Tensor | None:
        """The voices of `slots` as a view when they are consecutive (the usual batch: slots are taken from 0), so
        that the step does not copy every layer's voice keys and values; None (a gather) otherwise."""
        first = slots[0] if slots else 0
        if list(slots) != list(range(first, first + len(slots))):
            return None
        return self.voices[:, :, first : first + len(slots)]

    def listen(
        self, index: torch.Tensor, greedy: bool, voices: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The temporal step of the slots `index` [B] and their text samples: (hidden [B, dim], sampled [B], the
        slots' offsets [B]), device tensors. `voices`: the slots' voices when the caller has them as a view."""
        cfg, ring, ct, model = self.cfg, self.ring, self.ring_size, self.model
        offsets = self.offsets[index]
        column = ring[index, :, :].gather(2, (offsets % ct)[:, None, None].expand(-1, cfg.num_codebooks, 1))[..., 0]
        tokens_in = torch.where(offsets[:, None] <= self.delays[None, :], self.initial[None, :], column)
        x = model.embed(tokens_in) + self.sums[index]
        hidden, logits = model.forward_embeddings(
            x, offsets, self.kv, self.kv.batch(index, offsets), self.voices[:, :, index] if voices is None else voices
        )
        return hidden, self._pick(index, greedy, logits, TEXT_TOP_K, 0), offsets

    def speak(
        self,
        index: torch.Tensor,
        text: torch.Tensor,
        hidden: torch.Tensor,
        greedy: bool,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The DepFormer for the slots `index` [B] given the text they read [B] (for `rows` of them only, all when
        None; a shape, not a value, says when there are none), then their ring and offsets one step on: (rows out,
        valid), device tensors."""
        cfg, ring, ct, model = self.cfg, self.ring, self.ring_size, self.model
        offsets = self.offsets[index]
        audio = torch.full((len(index), self.n_q), -1, dtype=torch.long, device=index.device)
        if rows is None or len(rows):
            at = index if rows is None else index[rows]
            pick = lambda step, lg: self._pick(at, greedy, lg, AUDIO_TOP_K, 1 + step)  # noqa: E731
            if not greedy and hidden.device.type == "cpu" and not use_triton(hidden):  # rows read once a frame
                sampler = FrameSampler(
                    self.temperature[at], AUDIO_TOP_K, self.seeds[at], self.offsets[at], range(1, 1 + self.n_q)
                )
                pick = lambda step, lg: sampler(1 + step, lg)  # noqa: E731
            spoken = model.forward_depformer(
                hidden if rows is None else hidden[rows], text if rows is None else text[rows], pick, steps=self.n_q
            ).tokens
            audio = spoken if rows is None else audio.index_copy(0, rows, spoken)
        silent = offsets[:, None] < self.delays[None, 1 : 1 + self.n_q] + self.tts.delay_steps
        audio = audio.masked_fill(silent, -1)
        if self.n_q < cfg.dep_q:  # the codebooks not said are read as the zero token, as moshi feeds them
            audio = torch.cat([audio, audio.new_full((len(index), cfg.dep_q - self.n_q), -1)], dim=1)
        offsets = offsets + 1
        self.offsets[index] = offsets
        at_column = (offsets % ct)[:, None, None]
        ring[index, :, :] = ring[index, :, :].scatter(
            2, at_column.expand(-1, cfg.num_codebooks, 1), torch.cat([text[:, None], audio], dim=1)[..., None]
        )
        read_at = (offsets[:, None] - cfg.max_delay + self.delays[None, : 1 + self.n_q]) % ct
        out = ring[index, : 1 + self.n_q, :].gather(2, read_at[..., None])[..., 0]
        valid = offsets > cfg.max_delay
        return out.masked_fill(~valid[:, None], UNGENERATED), valid


def generate(
    gen: TTSGen,
    scripts: Sequence[Sequence[Word]],
    voices: Sequence[Voice],
    temperature: float = 0.0,
    seed: int = 0,
    max_steps: int = 30000,
) -> list[TTSResult]:
    """Say each script in its voice, one slot each, stepping them together until all are `done`, as moshi's
    `TTSModel.generate` does (its frames, end steps, consumption steps and transcript per script)."""
    slots = list(range(len(scripts)))
    for slot, (words, voice) in enumerate(zip(scripts, voices, strict=True)):
        gen.start(slot, words, voice, temperature, seed)
    results = [TTSResult() for _ in slots]
    for _ in range(max_steps):
        if all(gen.done(slot) for slot in slots):
            break
        out, valid = gen.step(slots)
        for result, row, ok in zip(results, out.tolist(), valid.tolist(), strict=True):
            if ok:
                result.frames.append(row)
    for result, state in zip(results, (gen.states[slot] for slot in slots), strict=True):
        assert state is not None
        result.end_step, result.consumed_at, result.transcript = state.end_step, state.consumed_at, state.transcript
    return results
