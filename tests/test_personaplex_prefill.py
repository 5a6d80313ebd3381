"""The persona prompt prefilled: many prompt frames of one or several sessions in one temporal forward leave the
same state and give the same live tokens as the reference's one frame per forward (`LMGen.prompt`, itself checked
against the reference's rules in test_personaplex_prompt), greedy, on a random-weight PersonaPlex checkpoint
(perturbed). Then the engine: a persona session prefilled in chunks beside a live session, both equal to offline
runs; its refusals; and the prefill makes no host sync."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from duplexd.engine.dialogue import lm_gen
from duplexd.engine.dialogue.engine import Engine, EngineConfig
from duplexd.engine.dialogue.lm_gen import LMGen
from duplexd.engine.dialogue.pipeline import Pipeline
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.errors import CapacityError
from duplexd.engine.kv import paged
from duplexd.engine.models.config import DEMO_MIMI, PERSONAPLEX_7B
from duplexd.engine.models.lm import LMModel
from duplexd.engine.models.mimi import MimiModel
from duplexd.engine.persona.prompt import SILENCE_CODES, TEXT_PAD, PersonaPrompt, PromptChunk, Voice, build_prompt
from duplexd.engine.persona.voices import load_preset
from duplexd.engine.weights.checkpoint import build_lm, load_lm, mimi_ring_rule
from duplexd.engine.weights.demo import random_lm
from duplexd.kernels.dispatch import force_triton

from .host_sync import ROOT, HostWork
from .personaplex_files import PP_SMALL, write_personaplex
from .personaplex_ref import preset_from_codes
from .test_infer import speech_like

CFG = PP_SMALL
GREEDY = SamplingParams(text_temperature=0.0, text_topk=1, audio_temperature=0.0, audio_topk=1)
TEXT_A, TEXT_B = [21, 42, 99, 7, 250, 13], [5, 77, 123, 9, 31, 200, 64, 11, 3]
LIVE = 8
TOL = 1e-4


def _codes(n: int, seed: int) -> list[list[int]]:
    return torch.randint(0, CFG.card, (n, 8), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_prefill")
    path, ref = write_personaplex(root, CFG, seed=6)
    model = load_lm(path)
    state = preset_from_codes(CFG, ref, _codes(9, 4))
    torch.save(state, root / "v.pt")
    return model, load_preset(root / "v.pt", CFG)


def _audio_voice(frames: int, seed: int) -> Voice:
    return Voice("a", None, frames, codes=torch.tensor(_codes(frames, seed)))  # type: ignore[arg-type]


def _live(gen: LMGen, slots: list[int], seed: int, same: bool = False):
    """LIVE steps of `slots` together with random user codes (`same` for every slot): their tokens [LIVE, B, 9]
    and text logits."""
    users = torch.randint(
        0, CFG.card, (LIVE, 1 if same else len(slots), 8), generator=torch.Generator().manual_seed(seed)
    )
    users = users.expand(LIVE, len(slots), 8)
    outs = [gen.step(torch.tensor(slots), users[u], return_logits=True) for u in range(LIVE)]
    return torch.stack([o.tokens for o in outs]), torch.stack([o.text_logits for o in outs])


def _slot_state(gen: LMGen, slot: int, prompt: PersonaPrompt):
    table = gen.kv.tables[slot].long()
    pos = torch.arange(prompt.forwards)
    pages = table[pos // gen.kv.page_size]
    keys = gen.kv.keys[:, pages, pos % gen.kv.page_size]
    return gen.ring[slot].clone(), gen.forced[slot].clone(), int(gen.offsets[slot]), keys


@pytest.mark.parametrize("voice_kind", ["audio", "preset"])
@pytest.mark.parametrize("chunk", [4, 1000])
def test_prefill_leaves_what_frame_by_frame_leaves(models, voice_kind, chunk):
    """Chunks of 4 cross the preset's stored rows into token rows mid-chunk; 1000 is the whole prompt at once."""
    model, preset = models
    voice = preset if voice_kind == "preset" else _audio_voice(7, 1)
    prompt = build_prompt(CFG, voice, TEXT_A)
    gen = LMGen(model, num_slots=3)
    for slot in (0, 2):
        gen.reset(slot, GREEDY)
    gen.prompt(0, prompt)  # one forward per frame, as the reference
    gen.prompt(2, prompt, chunk=chunk)
    ring0, forced0, offset0, keys0 = _slot_state(gen, 0, prompt)
    ring2, forced2, offset2, keys2 = _slot_state(gen, 2, prompt)
    assert torch.equal(ring0, ring2) and torch.equal(forced0, forced2) and offset0 == offset2 == prompt.forwards
    assert (keys0 - keys2).abs().max() <= TOL
    tokens, logits = _live(gen, [0, 2], seed=3, same=True)
    assert torch.equal(tokens[:, 0], tokens[:, 1])
    assert (logits[:, 0] - logits[:, 1]).abs().max() <= TOL
    assert len(set(tokens[1:, 0, 0].tolist()) | set(tokens[1:, 0, 1].tolist())) > 3, "degenerate run"


def test_several_prompts_in_one_forward_beside_a_live_session(models):
    """Two prompts of different lengths (an audio voice and a preset) prefilled together in two uneven forwards,
    while a third session at another position steps between them: each equals its own run alone, and one changed
    prompt word changes only its own session's logits."""
    model, preset = models

    def run(text_b):
        gen = LMGen(model, num_slots=4)
        for slot in (0, 1, 3):
            gen.reset(slot, GREEDY)
        a, b = build_prompt(CFG, _audio_voice(7, 1), TEXT_A), build_prompt(CFG, preset, text_b)
        before, _ = _live(gen, [0], seed=5)  # slot 0 is 8 frames into its conversation
        gen.prefill([PromptChunk(1, a, 0, 5), PromptChunk(3, b, 0, 11)])
        between, _ = _live(gen, [0], seed=6)
        gen.prefill([PromptChunk(3, b, 11, b.forwards), PromptChunk(1, a, 5, a.forwards)])
        tokens, logits = _live(gen, [3, 0, 1], seed=7)
        return torch.cat([before, between])[:, 0], tokens, logits

    def alone(text_b):
        gen = LMGen(model, num_slots=4)
        for slot in (0, 1, 3):
            gen.reset(slot, GREEDY)
        gen.prompt(1, build_prompt(CFG, _audio_voice(7, 1), TEXT_A))
        gen.prompt(3, build_prompt(CFG, preset, text_b))
        first, _ = _live(gen, [0], seed=5)
        second, _ = _live(gen, [0], seed=6)
        tokens, logits = _live(gen, [3, 0, 1], seed=7)
        return torch.cat([first, second])[:, 0], tokens, logits

    early, tokens, logits = run(TEXT_B)
    early_ref, tokens_ref, logits_ref = alone(TEXT_B)
    assert torch.equal(early, early_ref) and torch.equal(tokens, tokens_ref)
    assert (logits - logits_ref).abs().max() <= TOL
    changed = list(TEXT_B)
    changed[4] = 250
    _, _, logits_changed = run(changed)
    differs = [(logits_changed[:, row] - logits[:, row]).abs().max().item() > TOL for row in range(3)]
    assert differs == [True, False, False], differs


# ---------------------------------------------------------------------------------------------------- the engine


def _small_window(model: LMModel, context: int) -> LMModel:
    small = LMModel(dataclasses.replace(model.cfg, context=context))
    small.load_state_dict(model.state_dict())
    return small


def _offline(model, mimi, pcm: np.ndarray, prompt: PersonaPrompt | None):
    """The session run alone through the offline pipeline (frame-by-frame prompt): its output tokens per frame."""
    pipeline = Pipeline(model, mimi, num_slots=1)
    pipeline.reset(0, GREEDY)
    if prompt is not None:
        pipeline.prompt(0, prompt)
    size = pipeline.frame_size
    out = []
    for f in range(len(pcm) // size):
        step = pipeline.step([0], pcm[None, f * size : (f + 1) * size])
        if step.valid[0]:
            out.append(step.tokens[0].tolist())
    return out


def _outputs(session, count: int) -> list[list[int]]:
    outs = []
    while len(outs) < count:
        out = session.get(timeout=60)
        assert out is not None, session.close_reason
        outs.append([out.text_token, *out.audio_tokens])
    return outs


@pytest.fixture(scope="module")
def mimi():
    return MimiModel(mimi_ring_rule(DEMO_MIMI, CFG)).init_weights_(11)  # the LM's rule, as the server builds it


def test_engine_prefills_in_chunks_beside_a_live_session(models, mimi):
    model, preset = models
    prompt = build_prompt(CFG, preset, TEXT_B)
    frames = 6
    size = mimi.cfg.frame_size
    live_pcm, persona_pcm = (
        speech_like(frames * size / mimi.cfg.sample_rate, mimi.cfg.sample_rate, s)[:, 0] for s in (1, 2)
    )
    engine = Engine(model, mimi, config=EngineConfig(max_sessions=3, prefill_rows=4, threads=1))
    chunks: list[int] = []
    run = engine.runner.prefill
    engine.runner.prefill = lambda plan: chunks.extend(c.stop - c.start for c in plan) or run(plan)  # type: ignore[method-assign]
    engine.start()
    try:
        live = engine.open_session(GREEDY)
        live.push(live_pcm[: 2 * size])
        live_out = _outputs(live, 1)  # live before the persona session opens: its prompt goes 4 frames a step
        persona = engine.open_session(GREEDY, prompt=prompt)
        assert persona.prompting
        persona.push(persona_pcm)  # waits in the inbox until the prompt is in
        live.push(live_pcm[2 * size :])
        assert asyncio.run(asyncio.wait_for(persona.until_live(), 30)) and not persona.prompting
        assert persona.prompt_seconds is not None and persona.prompt_seconds > 0
        persona_out = _outputs(persona, frames)
        live_out += _outputs(live, frames - 2)
        assert not persona.prompting and persona.prompted == prompt.forwards
        assert engine.scheduler.prompt_rows == prompt.forwards
        assert sum(chunks) == prompt.forwards and max(chunks) == 4  # a session was live throughout
    finally:
        engine.stop()
    assert persona_out == _offline(model, mimi, persona_pcm, prompt)
    assert live_out == _offline(model, mimi, live_pcm, None)
    assert persona_out[0] == [TEXT_PAD, *SILENCE_CODES]


def test_engine_refusals_leave_the_others_alone(models, mimi):
    model, preset = models
    small = _small_window(model, context=40)
    long_text = build_prompt(CFG, preset, list(range(5, 40)))  # 9 + 12 + 35 frames > 40
    engine = Engine(small, mimi, config=EngineConfig(max_sessions=2, prefill_rows=8, page_size=8, threads=1))
    engine.start()
    try:
        other = engine.open_session(GREEDY)
        with pytest.raises(ValueError, match="longer than the model's window of 40"):
            engine.open_session(GREEDY, prompt=long_text)
        assert engine.stats().active_sessions == 1  # the refused session's slot is free again
        other.push(np.zeros(2 * engine.frame_size, np.float32))
        assert other.get(timeout=30) is not None
        with pytest.raises(ValueError, match="before the conversation starts"):
            other.start_prompt(build_prompt(CFG, preset, TEXT_A))
        fine = engine.open_session(GREEDY, prompt=build_prompt(CFG, preset, TEXT_A))
        fine.push(np.zeros(engine.frame_size, np.float32))
        assert fine.get(timeout=30) is not None
    finally:
        engine.stop()
    moshi = Engine(random_lm(dataclasses.replace(PP_SMALL, dep_q=8), seed=1), mimi, config=EngineConfig(max_sessions=1))
    moshi.start()
    try:
        with pytest.raises(ValueError, match="needs a PersonaPlex model"):
            moshi.open_session(GREEDY, prompt=build_prompt(CFG, preset, TEXT_A))
        assert moshi.stats().active_sessions == 0
    finally:
        moshi.stop()


def test_a_capped_session_reserves_its_prompt_pages_too(models, mimi):
    model, preset = models
    prompt = build_prompt(CFG, preset, TEXT_A)  # 8 + 12 + 6 - 1 = 26 forwards
    engine = Engine(
        model, mimi, config=EngineConfig(max_sessions=2, page_size=8, kv_memory=None, max_session_frames=8, threads=1)
    )
    engine.start()
    try:
        rows = engine.scheduler.prefill_rows  # sized at warm-up: a power of two within the window
        assert 1 <= rows <= engine.kv.context - 2 and rows & (rows - 1) == 0
        pages = engine.kv.pages_needed(8)
        session = engine.open_session(GREEDY, prompt=prompt)
        assert engine.kv.pages_used == engine.kv.pages_needed(8 + prompt.forwards) > pages
        session.close()
        assert not asyncio.run(session.until_live())  # ended before its prompt was in
        engine.scheduler.release()
        engine.kv.allocate(1, 8 * (engine.kv.pages_free - 1))  # all but one page taken (slot 1 stays free)
        with pytest.raises(CapacityError, match="persona prompt"):
            engine.open_session(GREEDY, prompt=prompt)
    finally:
        engine.stop()


def test_prefill_makes_no_host_sync(monkeypatch):
    """PersonaPlex 7B on `meta` with Triton forced (launches as no-ops): two sessions' prompt rows, one of them
    finishing its prompt, go to the device with no read-back. The only host tensors are the rows' index and the
    new session's KV table row, each copied from pinned memory on CUDA."""
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, **kwargs: None)
    lm = build_lm(PERSONAPLEX_7B, device="meta", dtype=torch.bfloat16)
    gen = LMGen(lm, num_slots=3)
    voice = Voice("v", None, 50, embeddings=torch.zeros(49, PERSONAPLEX_7B.dim), cache=torch.zeros(17, 4).long())
    long = build_prompt(PERSONAPLEX_7B, voice, list(range(100, 260)))
    short = build_prompt(PERSONAPLEX_7B, _audio_voice(30, 2), list(range(100, 140)))
    with force_triton(), HostWork() as host:
        gen.prefill([PromptChunk(0, long, 0, 120), PromptChunk(2, short, 40, short.forwards)])
    syncs = [op for op in host.ops if op.kind == "sync"]
    assert not syncs, "\n".join(map(str, syncs))
    made = {op.where.split(" ")[0] for op in host.ops}
    assert made == {
        _line_of(lm_gen, "rows = self._upload(torch.tensor("),
        _line_of(paged, "row = torch.from_numpy("),
    }, host.ops


def _line_of(module, text: str) -> str:
    with open(module.__file__, encoding="utf-8") as f:
        number = next(i for i, line in enumerate(f, 1) if text in line)
    return f"{Path(module.__file__).resolve().relative_to(ROOT).as_posix()}:{number}"
