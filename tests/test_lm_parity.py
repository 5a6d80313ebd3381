"""Numeric parity of the LM with the reference `moshi` package on perturbed random weights (fp32, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from moshi.models.lm import LMGen as RefLMGen
from safetensors.torch import save_file

from duplexd.engine.dialogue.lm_gen import LMGen
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.models.config import LMConfig
from duplexd.engine.weights.checkpoint import load_lm

from .ref_models import fused_state_dict, reference_lm

GREEDY = SamplingParams(text_temperature=0.0, text_topk=1, audio_temperature=0.0, audio_topk=1)
TOL = 1e-4
# Several layers and heads, odd text vocabulary, all 16 streams and 8 DepFormer steps.
SMALL = dict(
    dim=96,
    text_card=301,
    num_heads=3,
    num_layers=3,
    depformer_dim=48,
    depformer_dim_feedforward=int(4.125 * 48),
    depformer_num_heads=2,
    depformer_num_layers=2,
)


class ReferenceRun:
    """One reference conversation at batch 1, recording text and every DepFormer step's logits per frame."""

    def __init__(self, lm) -> None:
        self.lm = copy.deepcopy(lm)  # a reference model streams one conversation at a time
        self.gen = RefLMGen(self.lm, use_sampling=False)
        self.text_logits: list[torch.Tensor] = []
        self.gen.on_text_logits_hook = self.text_logits.append
        self.gen.streaming_forever(1)

    def step(self, codes: torch.Tensor):
        self.text_logits.clear()
        dep_logits = []
        original = self.lm.forward_depformer

        def record(*args, **kwargs):
            out = original(*args, **kwargs)
            dep_logits.append(out[:, 0, 0])
            return out

        self.lm.forward_depformer = record
        try:
            tokens = self.gen.step(codes[None, :, None])
        finally:
            self.lm.forward_depformer = original
        return tokens, self.text_logits[0][:, 0, 0], torch.stack(dep_logits, 1)


def _write(lm, cfg, tmp_path, naming):
    path = tmp_path / f"{naming}.safetensors"
    tensors = (
        {k: v.contiguous() for k, v in lm.state_dict().items()} if naming == "module" else fused_state_dict(lm, cfg)
    )
    save_file(tensors, str(path))
    return path


def _compare(frame, ref, out, row):
    tokens, text_logits, audio_logits = ref
    assert (out.text_logits[row] - text_logits[0]).abs().max() <= TOL, f"text logits, frame {frame}"
    assert (out.audio_logits[row] - audio_logits[0]).abs().max() <= TOL, f"audio logits, frame {frame}"
    if tokens is None:
        assert not out.valid[row], f"frame {frame} should still be warming up"
    else:
        assert out.valid[row]
        assert torch.equal(out.tokens[row], tokens[0, :, 0]), f"tokens differ at frame {frame}"


@pytest.mark.parametrize("naming", ["module", "fused"])
@pytest.mark.parametrize("context", [3000, 16])
def test_single_session_matches_reference(tmp_path, naming, context):
    cfg = LMConfig(**SMALL, context=context)
    lm = reference_lm(cfg, seed=1)
    model = load_lm(_write(lm, cfg, tmp_path, naming), cfg)
    gen = LMGen(model, num_slots=1)
    gen.reset(0, GREEDY)
    ref = ReferenceRun(lm)
    codes = torch.randint(0, cfg.card, (41, cfg.num_user_codebooks), generator=torch.Generator().manual_seed(2))
    texts = set()
    for frame in range(len(codes)):
        out = gen.step(torch.tensor([0]), codes[frame : frame + 1], return_logits=True)
        _compare(frame, ref.step(codes[frame]), out, 0)
        texts.add(int(out.tokens[0, 0]))
    assert len(texts) > 3, "degenerate run: the model should emit varied tokens"


def test_batch_of_three_started_at_different_frames(tmp_path):
    """Slots join at frames 0, 4 and 9, step in varying subsets and orders, and one slot is reused."""
    cfg = LMConfig(**SMALL, context=16)
    lm = reference_lm(cfg, seed=3)
    model = load_lm(_write(lm, cfg, tmp_path, "fused"), cfg)
    gen = LMGen(model, num_slots=3)
    frames = 50
    gen_codes = torch.Generator().manual_seed(4)
    codes = torch.randint(0, cfg.card, (4, frames, cfg.num_user_codebooks), generator=gen_codes)
    # conversation -> (slot, start frame, end frame); conversation 3 reuses slot 0 after 0 leaves.
    plan = {0: (0, 0, 24), 1: (1, 4, frames), 2: (2, 9, frames), 3: (0, 26, frames)}
    refs, steps = {}, {c: 0 for c in plan}
    for frame in range(frames):
        active = [c for c, (_, start, end) in plan.items() if start <= frame < end and (frame + c) % 5 != 0]
        for c in active:
            if c not in refs:
                refs[c] = ReferenceRun(lm)
                gen.reset(plan[c][0], GREEDY)
        active.sort(key=lambda c: -plan[c][0] if frame % 2 else plan[c][0])  # mix slot orders
        if not active:
            continue
        slots = torch.tensor([plan[c][0] for c in active])
        batch_codes = torch.stack([codes[c, steps[c]] for c in active])
        out = gen.step(slots, batch_codes, return_logits=True)
        for row, c in enumerate(active):
            _compare(frame, refs[c].step(codes[c, steps[c]]), out, row)
            steps[c] += 1
    assert min(steps.values()) > cfg.context  # every conversation outlives its window
