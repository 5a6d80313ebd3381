"""Streaming generation with sampling: a session's output depends on its seed, not on its batch companions."""

from __future__ import annotations

import pytest
import torch

from duplexd.engine.dialogue.lm_gen import UNGENERATED, LMGen
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.models.config import LMConfig
from duplexd.engine.weights.demo import random_lm
from duplexd.kernels.sampling import sample

CFG = LMConfig(
    dim=48,
    text_card=91,
    num_heads=3,
    num_layers=2,
    depformer_dim=32,
    depformer_dim_feedforward=132,
    depformer_num_heads=2,
    depformer_num_layers=2,
    context=12,
)
PARAMS = SamplingParams(text_temperature=1.0, text_topk=20, audio_temperature=1.0, audio_topk=100, seed=7)


@pytest.fixture(scope="module")
def model():
    return random_lm(CFG, seed=0)


def _codes(n, seed):
    return torch.randint(0, CFG.card, (n, CFG.num_user_codebooks), generator=torch.Generator().manual_seed(seed))


def test_same_seed_same_conversation_whatever_the_batch(model):
    frames = 20
    mine = _codes(frames, 1)
    alone = LMGen(model, num_slots=1)
    alone.reset(0, PARAMS)
    solo = [alone.step(torch.tensor([0]), mine[t : t + 1]).tokens[0] for t in range(frames)]

    shared = LMGen(model, num_slots=3)
    shared.reset(2, PARAMS)
    shared.reset(0, SamplingParams(seed=99))
    other = _codes(frames + 5, 2)
    for t in range(5):  # a companion that started earlier
        shared.step(torch.tensor([0]), other[t : t + 1])
    together = []
    for t in range(frames):
        slots = torch.tensor([0, 2] if t % 3 else [2])
        codes = torch.stack([other[t + 5], mine[t]]) if t % 3 else mine[t : t + 1]
        together.append(shared.step(slots, codes).tokens[-1])
    assert torch.equal(torch.stack(solo), torch.stack(together))
    assert len({tuple(r.tolist()) for r in solo}) > frames // 2, "sampling should vary between frames"


def test_different_seeds_differ(model):
    gen = LMGen(model, num_slots=2)
    gen.reset(0, PARAMS)
    gen.reset(1, SamplingParams(**{**PARAMS.__dict__, "seed": 8}))
    codes = _codes(10, 3)
    outs = [gen.step(torch.tensor([0, 1]), torch.stack([codes[t], codes[t]])).tokens for t in range(10)]
    assert any(not torch.equal(o[0], o[1]) for o in outs[1:])


def test_warm_up_frame_is_marked_invalid(model):
    gen = LMGen(model, num_slots=1)
    first = gen.step(torch.tensor([0]), _codes(1, 4))
    assert not first.valid[0] and (first.tokens == UNGENERATED).all()
    second = gen.step(torch.tensor([0]), _codes(1, 5))
    assert second.valid[0] and (second.tokens >= 0).all()


def test_bad_user_codes_shape(model):
    gen = LMGen(model, num_slots=2)
    with pytest.raises(ValueError, match="user_codes must be"):
        gen.step(torch.tensor([0, 1]), torch.zeros(2, 3, dtype=torch.long))


def _text(gen: LMGen, slots: list[int], codes: torch.Tensor, frames: int) -> list[list[int]]:
    """Each slot's non-special text tokens over `frames` steps, all slots stepped together."""
    out: list[list[int]] = [[] for _ in slots]
    for t in range(frames):
        step = gen.step(torch.tensor(slots), codes[t].expand(len(slots), -1))
        for i, token in enumerate(step.tokens[:, 0].tolist()):
            if step.valid[i] and token not in CFG.silent_text_ids:
                out[i].append(token)
    return out


def test_repetition_penalty_stops_repeats_within_its_context(model):
    greedy = SamplingParams(text_temperature=0.0, text_topk=1, audio_temperature=0.0, audio_topk=1)
    penalised = SamplingParams(**{**greedy.__dict__, "repetition_penalty": 1e6, "repetition_penalty_context": 6})
    codes, frames = _codes(40, 5), 40

    def repeats(tokens: list[int], context: int) -> int:
        return sum(tokens[i] in tokens[max(0, i - context) : i] for i in range(len(tokens)))

    gen = LMGen(model, num_slots=3)
    gen.reset(0, greedy)
    gen.reset(2, penalised)
    plain, strict = _text(gen, [0, 2], codes, frames)
    assert repeats(plain, 6) > 0 and repeats(strict, 6) == 0, (plain, strict)
    assert len(strict) > 12

    alone = LMGen(model, num_slots=1)  # rows of one batch stay independent
    alone.reset(0, penalised)
    assert _text(alone, [0], codes, frames)[0] == strict
    alone.reset(0, greedy)
    assert _text(alone, [0], codes, frames)[0] == plain


class _NoPenalties(LMGen):
    """Text sampling as it was before the repetition penalty and pad_mult."""

    def sample_text(self, slots, logits, temperature, top_k, seeds, positions):
        return sample(logits, temperature, top_k, seeds, positions, 0)


def test_defaults_leave_tokens_unchanged(model):
    """Penalty 1 and pad_mult 0 sample exactly the tokens of the penalty-free text sampling."""
    codes = _codes(16, 6)
    runs = []
    for kind in (LMGen, _NoPenalties):
        gen = kind(model, num_slots=2)
        gen.reset(0, PARAMS)
        gen.reset(1, SamplingParams(text_temperature=0.0, seed=3))
        runs.append(torch.stack([gen.step(torch.tensor([0, 1]), codes[t].expand(2, -1)).tokens for t in range(16)]))
    assert torch.equal(*runs)


def test_rows_sharing_one_top_k_draw_as_the_per_row_sampler(model, monkeypatch):
    """On the CPU, a frame whose rows all have one audio top-k samples the DepFormer through `FrameSampler` (the
    rows read once a frame); a frame with mixed top-ks through `sample`, row by row. Both draw the same tokens."""
    import duplexd.engine.dialogue.lm_gen as lm_gen

    real, made = lm_gen.FrameSampler, []

    def spy(*args):
        made.append(args)
        return real(*args)

    monkeypatch.setattr(lm_gen, "FrameSampler", spy)
    uniform, mixed = LMGen(model, num_slots=2), LMGen(model, num_slots=3)
    for gen in (uniform, mixed):
        gen.reset(0, PARAMS)
        gen.reset(1, SamplingParams(audio_temperature=0.9, audio_topk=100, seed=3))
    mixed.reset(2, SamplingParams(audio_topk=5, seed=5))
    frames, codes = 8, _codes(8 * 3, 4).view(8, 3, -1)
    for t in range(frames):
        one = uniform.step(torch.tensor([0, 1]), codes[t, :2]).tokens
        calls = len(made)
        both = mixed.step(torch.tensor([0, 1, 2]), codes[t]).tokens
        assert len(made) == calls, "mixed top-ks take the per-row sampler"
        assert torch.equal(one, both[:2])
    assert len(made) == frames
