"""The LM wired to the kernels: forcing every Triton kernel (interpreter) reproduces the CPU path's logits and
tokens, with two sessions at different positions, out-of-order slots, sampling, and a ring that wraps."""

from __future__ import annotations

import torch

from duplexd.engine.dialogue.lm_gen import LMGen
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.models.config import LMConfig
from duplexd.engine.weights.demo import random_lm
from duplexd.kernels.dispatch import force_triton

# Small enough for the interpreter: 2 + 2 audio streams, so 2 DepFormer steps per frame.
CFG = LMConfig(
    dim=32,
    text_card=45,
    num_heads=2,
    num_layers=2,
    depformer_dim=16,
    depformer_dim_feedforward=66,
    depformer_num_heads=2,
    depformer_num_layers=2,
    card=61,
    context=3,
    n_q=4,
    dep_q=2,
    delays=(0, 0, 1, 0, 1),
)
PARAMS = SamplingParams(text_temperature=0.9, text_topk=10, audio_temperature=0.8, audio_topk=20, seed=5)


def _run(model, codes, forced):
    gen = LMGen(model, num_slots=3)
    for slot in range(3):
        gen.reset(slot, SamplingParams(**{**PARAMS.__dict__, "seed": slot}))
    outs = []
    with force_triton(forced):
        gen.step(torch.tensor([2]), codes[0, :1])  # slot 2 starts one frame earlier
        for frame in range(1, len(codes)):
            outs.append(gen.step(torch.tensor([2, 0]), codes[frame], return_logits=True))
    return outs


def test_triton_path_matches_cpu_path():
    model = random_lm(CFG, seed=0)
    codes = torch.randint(0, CFG.card, (4, 2, CFG.num_user_codebooks), generator=torch.Generator().manual_seed(1))
    cpu, triton = _run(model, codes, False), _run(model, codes, True)
    for frame, (a, b) in enumerate(zip(cpu, triton, strict=True)):
        torch.testing.assert_close(b.text_logits, a.text_logits, rtol=1e-4, atol=1e-4, msg=f"frame {frame}")
        torch.testing.assert_close(b.audio_logits, a.audio_logits, rtol=1e-4, atol=1e-4, msg=f"frame {frame}")
        assert torch.equal(b.tokens, a.tokens), frame
