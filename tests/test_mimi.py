"""Mimi parity with the reference (`moshi`) at the real configuration, and per-slot streaming semantics.

The reference is random-initialised with real codebooks and perturbed norms / layer scales (see
`ref_models.reference_mimi`), and its weights reach duplexd through a checkpoint file, so loading is covered too.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from duplexd.engine.models.config import DEMO_MIMI, MIMI, MimiConfig
from duplexd.engine.models.mimi import MimiModel, MimiStreams
from duplexd.engine.weights.checkpoint import load_mimi

from .ref_models import reference_mimi
from .ring_rules import mimi_transformers, use_fork_rule

FS = MIMI.frame_size
FRAMES = 25


def speech_like(frames: int, seed: int) -> torch.Tensor:
    """Voiced-speech stand-in: harmonics of a gliding pitch, syllable-rate envelope, a little noise."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(frames * FS, dtype=torch.float64) / 24000
    f0 = 110 + 40 * seed % 90 + 30 * torch.sin(2 * math.pi * 0.7 * t)
    phase = 2 * math.pi * torch.cumsum(f0, 0) / 24000
    voiced = sum(torch.sin(h * phase) / h for h in range(1, 12))
    envelope = 0.5 + 0.5 * torch.sin(2 * math.pi * 4.0 * t + seed) ** 2
    x = 0.2 * envelope * voiced + 0.02 * torch.randn(t.shape, generator=gen, dtype=torch.float64)
    return x.float()


def reference_stream(ref, pcm: torch.Tensor, rule: str = "moshi") -> tuple[torch.Tensor, torch.Tensor]:
    """Reference streaming encode then streaming decode of its own codes, frame by frame: ([1, 8, n], [1, N]);
    `rule` "personaplex": its transformers' rings labelled as NVIDIA's fork labels them (`ring_rules`)."""
    codes, out = [], []
    with torch.no_grad(), ref.streaming(1):
        if rule == "personaplex":
            use_fork_rule(*mimi_transformers(ref))
        for f in range(pcm.shape[-1] // FS):
            codes.append(ref.encode(pcm[None, None, f * FS : (f + 1) * FS]))
        for c in codes:
            out.append(ref.decode(c)[:, 0])
    return torch.cat(codes, -1), torch.cat(out, -1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def ref():
    return reference_mimi(seed=3)


@pytest.fixture(scope="module")
def model(ref, tmp_path_factory):
    path = tmp_path_factory.mktemp("mimi") / "mimi.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    return load_mimi(path, MIMI)


@pytest.fixture(scope="module")
def signal():
    return speech_like(FRAMES, seed=1)


@pytest.fixture(scope="module")
def reference_run(ref, signal):
    return reference_stream(ref, signal)


def test_codes_and_pcm_match_the_reference(model, signal, reference_run):
    ref_codes, ref_pcm = reference_run
    assert ref_codes.shape == (1, 8, FRAMES)
    assert len(ref_codes.unique()) > 50, "degenerate reference codes: the parity check would prove nothing"
    streams = MimiStreams(model, num_slots=2)
    slot = torch.tensor([1])
    # Mixed chunking: one frame, then three at once, then the rest frame by frame.
    chunks = [(0, 1), (1, 4)] + [(f, f + 1) for f in range(4, FRAMES)]
    codes = torch.cat([streams.encode(slot, signal[None, a * FS : b * FS]) for a, b in chunks], -1)
    assert codes.dtype == torch.long and codes.shape == (1, 8, FRAMES)
    agreement = (codes == ref_codes).float().mean().item()
    assert agreement >= 0.999, agreement
    pcm = torch.cat([streams.decode(slot, ref_codes[:, :, a:b]) for a, b in chunks], -1)
    assert pcm.shape == (1, FRAMES * FS)
    assert rel(pcm, ref_pcm) <= 1e-4


def test_slots_started_at_different_frames_and_reset_match_single_streams(model, signal):
    """Slots 4, 0, 2 of 5 (not consecutive) start at steps 0, 2, 3; slot 2 resets at step 5 and restarts."""
    steps = 8
    sig = {4: signal, 0: speech_like(steps, seed=2), 2: speech_like(steps, seed=5)}
    start = {4: 0, 0: 2, 2: 3}
    batched = MimiStreams(model, num_slots=5)
    got_codes: dict[int, list] = {s: [] for s in sig}
    got_pcm: dict[int, list] = {s: [] for s in sig}
    for step in range(steps):
        if step == 5:
            batched.reset(2)
            start[2] = 5
            got_codes[2].clear()
            got_pcm[2].clear()
        live = [s for s in (4, 0, 2) if step >= start[s]]
        frames = torch.stack([sig[s][(step - start[s]) * FS : (step - start[s] + 1) * FS] for s in live])
        idx = torch.tensor(live)
        codes = batched.encode(idx, frames)
        pcm = batched.decode(idx, codes)
        for i, s in enumerate(live):
            got_codes[s].append(codes[i])  # [8, 1]
            got_pcm[s].append(pcm[i])
    for s in sig:
        n = len(got_codes[s])
        alone = MimiStreams(model, num_slots=1)
        zero = torch.tensor([0])
        codes = alone.encode(zero, sig[s][None, : n * FS])
        pcm = alone.decode(zero, codes)
        assert (torch.cat(got_codes[s], -1) == codes[0]).float().mean().item() >= 0.99
        assert rel(torch.cat(got_pcm[s]), pcm[0]) <= 1e-5


def test_encode_and_decode_states_are_independent(model, signal, reference_run):
    ref_codes, ref_pcm = reference_run
    streams = MimiStreams(model, num_slots=1)
    slot = torch.tensor([0])
    codes, pcm = [], []
    for f in range(6):  # decode of an unrelated code sequence interleaved with encode
        codes.append(streams.encode(slot, signal[None, f * FS : (f + 1) * FS]))
        pcm.append(streams.decode(slot, ref_codes[:, :, f : f + 1]))
    assert (torch.cat(codes, -1) == ref_codes[:, :, :6]).float().mean().item() >= 0.999
    assert rel(torch.cat(pcm, -1), ref_pcm[:, : 6 * FS]) <= 1e-4


def test_partial_frames_and_bad_input_are_rejected(model):
    streams = MimiStreams(model, num_slots=2)
    slot = torch.tensor([0])
    for n in (0, 1000, FS + 1, 2 * FS - 1):
        with pytest.raises(ValueError, match="multiple of the frame size 1920"):
            streams.encode(slot, torch.zeros(1, n))
    with pytest.raises(ValueError, match="slots must be in"):
        streams.encode(torch.tensor([2]), torch.zeros(1, FS))
    with pytest.raises(ValueError, match="distinct"):
        streams.encode(torch.tensor([1, 1]), torch.zeros(2, FS))
    with pytest.raises(ValueError, match="one entry per batch row"):
        streams.encode(torch.tensor([0, 1]), torch.zeros(1, FS))
    with pytest.raises(ValueError, match=r"codes must be \[batch, 8, frames\]"):
        streams.decode(slot, torch.zeros(1, 7, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="codes must be in"):
        streams.decode(slot, torch.full((1, 8, 1), 2048))
    with pytest.raises(ValueError, match="out of range"):
        streams.reset(2)


def _small(**kw) -> MimiConfig:
    base = dict(
        dimension=32, n_filters=4, num_heads=2, num_layers=2, dim_feedforward=48, codebook_dim=8, n_q=10, card=64
    )
    return MimiConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "cfg",
    [_small(context=3), _small(n_residual_layers=2, ratios=(4, 4, 3, 4, 5))],
    ids=["ring-wraps", "two-residual-layers"],
)
def test_small_configs_match_the_reference(cfg, tmp_path):
    """Cheap configs that exercise the KV ring wrapping (context 3) and deeper SEANet stacks."""
    ref = reference_mimi(seed=11, mimi_config=cfg.to_reference_dict())
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "m.safetensors"))
    model = load_mimi(tmp_path / "m.safetensors", cfg)
    pcm = speech_like(12, seed=4)
    ref_codes, ref_pcm = reference_stream(ref, pcm)
    streams = MimiStreams(model, num_slots=1)
    codes = streams.encode(torch.tensor([0]), pcm[None])
    assert (codes == ref_codes).float().mean().item() >= 0.999
    assert rel(streams.decode(torch.tensor([0]), ref_codes), ref_pcm) <= 1e-4


def test_demo_config_runs_and_resets():
    model = MimiModel(DEMO_MIMI).init_weights_(seed=0).eval()
    streams = MimiStreams(model, num_slots=8)
    slots = torch.arange(8)
    pcm = torch.stack([speech_like(2, seed=s) for s in range(8)])
    codes = streams.encode(slots, pcm)
    assert codes.shape == (8, 8, 2) and len(codes.unique()) > 20
    out = streams.decode(slots, codes)
    assert out.shape == (8, 2 * FS) and torch.isfinite(out).all() and out.abs().max() < 100
    streams.reset(3)
    fresh = MimiStreams(model, num_slots=1)
    assert torch.equal(streams.encode(torch.tensor([3]), pcm[3:4, :FS]), fresh.encode(torch.tensor([0]), pcm[3:4, :FS]))
