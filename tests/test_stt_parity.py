"""Kyutai STT (dep_q = 0, 32 codebooks in, extra heads) against moshi 0.2.13 on perturbed random weights (fp32, CPU).

The oracle is `LMGen(temp=0, temp_text=0).step_with_extra_heads` fed frame 0 twice, as `moshi.run_inference` and
moshi-server do (`LMConfig.user_lag`); duplexd is fed each frame once. A 16-frame window, so every conversation
runs past it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from duplexd.engine.dialogue.engine import Engine, EngineConfig
from duplexd.engine.dialogue.lm_gen import LMGen
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.models.config import DEMO_MIMI_32, LMConfig
from duplexd.engine.models.mimi import MimiModel
from duplexd.engine.weights.checkpoint import load_lm, load_mimi

from .ref_models import ReferenceStt, fused_state_dict, reference_lm, reference_mimi, sharpen_attention_

GREEDY = SamplingParams(text_temperature=0.0, text_topk=1, audio_temperature=0.0, audio_topk=1)
PAUSE_TOL = 1e-5
LOGIT_TOL = 1e-4
# Several layers and heads, an odd text vocabulary, 32 input codebooks, no DepFormer, 4 heads of 5 classes.
SMALL_STT = LMConfig(
    dim=96,
    text_card=301,
    num_heads=3,
    num_layers=3,
    n_q=32,
    dep_q=0,
    delays=(0,) * 33,
    context=16,
    max_period=100000.0,
    extra_heads_num_heads=4,
    extra_heads_dim=5,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The reference STT and duplexd's model loaded from its fused-naming checkpoint."""
    ref = sharpen_attention_(reference_lm(SMALL_STT, seed=5))
    path = tmp_path_factory.mktemp("stt") / "stt.safetensors"
    save_file(fused_state_dict(ref, SMALL_STT), str(path))
    return ref, load_lm(path, SMALL_STT)


def _codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, SMALL_STT.card, (frames, SMALL_STT.n_q), generator=torch.Generator().manual_seed(seed))


def _check(frame: int, expected, out, row: int) -> None:
    token, text_logits, pause = expected
    assert (out.text_logits[row] - text_logits).abs().max() <= LOGIT_TOL, f"text logits, frame {frame}"
    assert int(out.tokens[row, 0]) == token, f"text token, frame {frame}"
    assert (out.pause[row] - pause).abs().max() <= PAUSE_TOL, f"pause probabilities, frame {frame}"
    assert out.valid[row] and out.tokens.shape[1] == 1  # text only, an answer from the first step


def _run_alone(model, codes: torch.Tensor):
    gen = LMGen(model, num_slots=1)
    gen.reset(0, GREEDY)
    return [gen.step(torch.tensor([0]), codes[f : f + 1], return_logits=True) for f in range(len(codes))]


def test_one_session_matches_the_reference_past_the_window(models):
    ref_lm, model = models
    codes = _codes(37, seed=1)
    ref = ReferenceStt(ref_lm)
    outs = _run_alone(model, codes)
    for frame, out in enumerate(outs):
        _check(frame, ref.step(codes[frame]), out, 0)
    assert len({int(o.tokens[0, 0]) for o in outs}) > 3, "degenerate run: the model should emit varied tokens"
    pauses = torch.cat([o.pause for o in outs])
    assert pauses.shape == (37, 4) and pauses.std() > 0.05, "the heads should move with the audio"


def test_changing_one_frame_changes_the_answers_from_the_next_step_on(models):
    """Step t reads user frame t - 1: a change to frame 6 shows first at step 7 (and matches the reference)."""
    ref_lm, model = models
    codes = _codes(20, seed=2)
    changed = codes.clone()
    changed[6] = (changed[6] + 1 + torch.arange(SMALL_STT.n_q)) % SMALL_STT.card
    base, other = _run_alone(model, codes), _run_alone(model, changed)
    ref = ReferenceStt(ref_lm)
    for frame, out in enumerate(other):
        _check(frame, ref.step(changed[frame]), out, 0)
    for frame in range(7):
        assert torch.equal(base[frame].tokens, other[frame].tokens), frame
        assert torch.equal(base[frame].pause, other[frame].pause), frame
    assert not torch.allclose(base[7].pause, other[7].pause, atol=1e-3)
    assert any(int(b.tokens[0, 0]) != int(o.tokens[0, 0]) for b, o in zip(base[7:], other[7:], strict=True))


def test_sessions_batched_at_different_positions_equal_their_runs_alone(models):
    """Three sessions join at frames 0, 5 and 11, step in varying subsets and orders, and one slot is reused."""
    ref_lm, model = models
    gen = LMGen(model, num_slots=3)
    frames = 53
    codes = torch.stack([_codes(frames, seed=10 + c) for c in range(4)])
    # conversation -> (slot, first frame, end frame); conversation 3 reuses slot 0 after 0 leaves
    plan = {0: (0, 0, 25), 1: (1, 5, frames), 2: (2, 11, frames), 3: (0, 27, frames)}
    refs: dict[int, ReferenceStt] = {}
    steps = dict.fromkeys(plan, 0)
    for frame in range(frames):
        active = [c for c, (_, start, end) in plan.items() if start <= frame < end and (frame + c) % 4 != 0]
        for c in active:
            if c not in refs:
                refs[c] = ReferenceStt(ref_lm)
                gen.reset(plan[c][0], GREEDY)
        active.sort(key=lambda c: -plan[c][0] if frame % 2 else plan[c][0])
        if not active:
            continue
        slots = torch.tensor([plan[c][0] for c in active])
        out = gen.step(slots, torch.stack([codes[c, steps[c]] for c in active]), return_logits=True)
        for row, c in enumerate(active):
            _check(frame, refs[c].step(codes[c, steps[c]]), out, row)
            steps[c] += 1
    assert min(steps.values()) > SMALL_STT.context  # every conversation outlives its window


def test_the_engine_serves_stt_from_audio_as_the_reference(models, tmp_path):
    """Audio in, through Mimi's 32 codebooks and the batched engine: text tokens, text pieces and pause
    probabilities of two sessions equal the reference's Mimi encode then LM; no speech comes out."""
    ref_lm, model = models
    ref_mimi = reference_mimi(seed=4, mimi_config=DEMO_MIMI_32.to_reference_dict())
    ref_mimi.set_num_codebooks(32)
    path = tmp_path / "mimi.safetensors"
    save_file({k: v.contiguous() for k, v in ref_mimi.state_dict().items()}, str(path))
    mimi: MimiModel = load_mimi(path, DEMO_MIMI_32)
    fs, frames = DEMO_MIMI_32.frame_size, 9
    audio = [0.1 * torch.randn(frames * fs, generator=torch.Generator().manual_seed(20 + s)) for s in range(2)]
    expected = []
    for pcm in audio:
        with torch.no_grad(), ref_mimi.streaming(1):
            codes = [ref_mimi.encode(pcm[None, None, f * fs : (f + 1) * fs])[0, :, 0] for f in range(frames)]
        assert codes[0].shape == (32,)
        ref = ReferenceStt(ref_lm)
        expected.append([ref.step(c) for c in codes])
    engine = Engine(model, mimi, config=EngineConfig(max_sessions=3, pad_batches=True, threads=1))
    engine.start()
    try:
        sessions = [engine.open_session(GREEDY) for _ in audio]
        for session, pcm in zip(sessions, audio, strict=True):
            session.push(pcm.numpy())
        for session, want in zip(sessions, expected, strict=True):
            for frame, (token, _, pause) in enumerate(want):
                out = session.get(timeout=60)
                assert out is not None and out.frame == frame
                assert out.text_token == token, f"frame {frame}"
                assert out.pause is not None and np.abs(np.array(out.pause) - pause.numpy()).max() <= PAUSE_TOL
                assert out.pcm.shape == (0,) and out.audio_tokens == ()
    finally:
        engine.stop()
