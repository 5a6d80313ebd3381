"""PersonaPlex's prompt and streaming rules, stated in plain Python as the reference's LMGen applies them.

This is the test oracle for duplexd's persona prompt. It keeps the reference's 17-stream ring (`max_delay + 3`
columns, a `provided` mask per entry) and its call order, independent of duplexd's engine:

- a call at offset o writes the tokens it is given at column o + delay of their stream, and the initial tokens
  in column o of every stream whose delay is >= o;
- the first call (o = 0) makes column 0 all initial tokens and runs no forward; every later call feeds column
  o - 1 to the model and fills column o: with what was given where given, else with what was sampled (the
  DepFormer is fed a given token in place of the one it sampled);
- from o > max_delay on, a call returns column o - max_delay + delay of the text and the 16 audio streams.

A session first runs the prompt: the voice (agent: its codes, user: the tone; a preset instead replays its stored
input rows and then puts its ring back), 6 silent frames, the role text one token a frame, 6 silent frames (text:
padding, agent: SILENCE, user: the tone). Then each live call gives only the user's 8 codes.

`Oracle` runs the model for it: the reference `moshi` LM (built with dep_q = 16, as PersonaPlex's), greedy, with
its temporal rings labelled by moshi's rule or by NVIDIA's fork's (`ring_rules`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from duplexd.engine.models.config import LMConfig
from duplexd.engine.persona.prompt import REFERENCE_RING, SILENCE_CODES, SILENCE_FRAMES, SINE_CODES, TEXT_PAD

from .ring_rules import use_fork_rule

UNGENERATED = -2
AGENT = 8  # PersonaPlex's audio codebooks per speaker


@dataclass
class Call:
    """What one call did: the model's input (a column of 17 tokens, or the index of a preset's stored row; None
    for the first call) and what it returned (17 tokens, or None while the delays warm up)."""

    offset: int
    input: list[int] | int | None
    output: list[int] | None = None
    text_logits: torch.Tensor | None = None  # with an oracle


class Oracle:
    """The reference LM at batch 1, greedy: the temporal transformer streams over the calls' inputs and the
    DepFormer runs all its steps, fed the given tokens where the ring has them."""

    def __init__(self, lm, ring_rule: str = "moshi") -> None:
        self.lm = lm
        self._ctx = lm.streaming(1)
        self._ctx.__enter__()
        if ring_rule == "personaplex":
            use_fork_rule(lm.transformer)  # the temporal transformer's rings as NVIDIA's server labels them

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)

    def embed(self, column: Sequence[int]) -> torch.Tensor:
        """The summed input embedding of one column [1, 1, dim]: the 16 audio streams, then text (the reference's
        order)."""
        lm = self.lm
        x = None
        for k in range(lm.n_q):
            e = lm.emb[k](torch.tensor([[column[1 + k]]]))
            x = e if x is None else x + e
        return x + lm.text_emb(torch.tensor([[column[0]]]))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, given: list[int | None]) -> tuple[int, list[int], torch.Tensor]:
        """One temporal step on x [1, 1, dim], then the DepFormer: (text, 16 audio tokens sampled, text logits).
        `given`: the target column's given tokens (None where the model samples)."""
        lm = self.lm
        out = lm.transformer(x)
        if lm.out_norm:
            out = lm.out_norm(out)
        logits = lm.text_linear(out)[0, 0]
        text = int(logits.argmax())
        prev = given[0] if given[0] is not None else text
        audio = []
        with lm.depformer.streaming(1):
            for k in range(lm.dep_q):
                dep_logits = lm.forward_depformer(k, torch.tensor([[[prev]]]), out)
                token = int(dep_logits[0, 0, 0].argmax())
                audio.append(token)
                prev = given[1 + k] if given[1 + k] is not None else token
        return text, audio, logits


@dataclass
class ReferenceSession:
    """One conversation under the reference's rules; `calls` records every call."""

    cfg: LMConfig
    oracle: Oracle | None = None
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.width = cfg.max_delay + REFERENCE_RING
        self.cache = [[UNGENERATED] * self.width for _ in range(cfg.num_codebooks)]
        self.provided = [[False] * self.width for _ in range(cfg.num_codebooks)]
        self.initial = [cfg.text_initial_token_id] + [cfg.initial_token_id] * cfg.n_q
        self.offset = 0
        self.embeddings: list[torch.Tensor] = []  # the inputs' embeddings, when `keep_embeddings`
        self.keep_embeddings = False

    # The reference's `prepare_step_input`: writes, initial tokens, and the input/target columns.
    def _prepare(self, text: int | None, agent: Sequence[int] | None, user: Sequence[int] | None):
        cfg, w, o = self.cfg, self.width, self.offset
        given = {}
        if user is not None:
            given.update({1 + AGENT + q: c for q, c in enumerate(user)})
        if agent is not None:
            given.update({1 + q: c for q, c in enumerate(agent)})
        if text is not None:
            given[0] = text
        for k, token in given.items():
            col = (o + cfg.delays[k]) % w
            self.cache[k][col], self.provided[k][col] = int(token), True
        for k, delay in enumerate(cfg.delays):
            if o <= delay:
                self.cache[k][o % w], self.provided[k][o % w] = self.initial[k], True
        if o == 0:
            for k in range(cfg.num_codebooks):
                self.cache[k][0] = self.initial[k]
            self.offset += 1
            return None
        src, dst = (o - 1) % w, o % w
        column = [self.cache[k][src] for k in range(cfg.num_codebooks)]
        target = [self.cache[k][dst] if self.provided[k][dst] else None for k in range(cfg.num_codebooks)]
        return column, target, src, dst

    # The reference's `process_transformer_output`: fill the target column, clear the input's marks, output.
    def _finish(self, text: int, audio: list[int], src: int, dst: int) -> list[int] | None:
        cfg = self.cfg
        for k in range(cfg.num_codebooks):
            self.provided[k][src] = False
        sampled = [text, *audio]
        for k in range(1 + cfg.dep_q):
            if not self.provided[k][dst]:
                self.cache[k][dst] = sampled[k]
        out = None
        if self.offset > cfg.max_delay:
            out = [self.cache[k][(self.offset - cfg.max_delay + d) % self.width] for k, d in enumerate(cfg.delays)]
        self.offset += 1
        return out

    def _forward(self, call: Call, x: torch.Tensor | None, target: list[int | None]) -> tuple[int, list[int]]:
        if self.oracle is None:  # rules only: no model, the sampled values are placeholders that are never read
            return -7, [-7] * self.cfg.dep_q
        text, audio, call.text_logits = self.oracle.forward(x, target)
        return text, audio

    def step(self, text: int | None, agent: Sequence[int] | None, user: Sequence[int] | None) -> Call:
        """One call given (some of) the streams' tokens."""
        call = Call(self.offset, None)
        prepared = self._prepare(text, agent, user)
        if prepared is not None:
            column, target, src, dst = prepared
            call.input = column
            x = None
            if self.oracle is not None:
                x = self.oracle.embed(column)
                if self.keep_embeddings:
                    self.embeddings.append(x.detach().clone())
            call.output = self._finish(*self._forward(call, x, target), src, dst)
        self.calls.append(call)
        return call

    def step_embedding(self, index: int, x: torch.Tensor | None) -> Call:
        """A preset's stored row replayed (the reference's `step_embeddings`): the ring is given initial tokens
        (text: padding) until a call reaches the model, which is fed the stored row."""
        init = self.initial
        while True:
            call = Call(self.offset, None)
            prepared = self._prepare(TEXT_PAD, init[1 : 1 + AGENT], init[1 + AGENT :])
            if prepared is not None:
                break
            self.calls.append(call)
        _, target, src, dst = prepared
        call.input = index
        call.output = self._finish(*self._forward(call, x, target), src, dst)
        self.calls.append(call)
        return call

    # Phases.
    def voice_codes(self, codes: Sequence[Sequence[int]]) -> None:
        for frame in codes:
            self.step(TEXT_PAD, frame, SINE_CODES)

    def voice_preset(self, embeddings: torch.Tensor | None, frames: int, cache: list[list[int]]) -> None:
        for i in range(frames - 1):
            self.step_embedding(i, None if embeddings is None else embeddings[i].view(1, 1, -1))
        self.cache = [list(row) for row in cache]

    def silence(self) -> None:
        for _ in range(SILENCE_FRAMES):
            self.step(TEXT_PAD, SILENCE_CODES, SINE_CODES)

    def text(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.step(token, SILENCE_CODES, SINE_CODES)

    def prompt(self, text_tokens: Sequence[int], codes=None, preset=None) -> None:
        """The whole prompt: a voice (`codes` [V][8], or `preset` = (embeddings [V-1, dim] | None, V, cache)),
        silence, the text, silence."""
        if preset is not None:
            self.voice_preset(*preset)
        else:
            self.voice_codes(codes)
        self.silence()
        self.text(text_tokens)
        self.silence()

    def live(self, user: Sequence[int]) -> Call:
        return self.step(None, None, user)


def preset_from_codes(cfg: LMConfig, lm, codes: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """A `.pt` voice preset as the reference saves one: the voice phase run on `codes`, keeping each forward's
    input embedding (`embeddings` [V-1, 1, 1, dim]) and the ring it leaves (`cache` [1, 17, max_delay + 3])."""
    oracle = Oracle(lm)
    try:
        session = ReferenceSession(cfg, oracle)
        session.keep_embeddings = True
        session.voice_codes(codes)
    finally:
        oracle.close()
    return {
        "embeddings": torch.stack(session.embeddings, dim=0).detach(),
        "cache": torch.tensor(session.cache, dtype=torch.long)[None],
    }
