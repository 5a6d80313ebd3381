"""Parity of duplexd's Gemma 4 audio front end and tower with `transformers` (random weights, fp32, CPU).

The reference model gets non-default per_dim_scale, norm weights and clip bounds: HF's init leaves them at values
(0, 1, +-inf) that would hide a dropped or misplaced parameter.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from duplexd.engine.models.gemma4_audio import Gemma4AudioConfig, Gemma4AudioEncoder
from duplexd.engine.models.log_mel import LogMel

from .gemma4_ref import needs_transformers

if TYPE_CHECKING:
    from transformers import Gemma4AudioConfig as HFAudioConfig
    from transformers import Gemma4AudioModel
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

pytestmark = needs_transformers
TEXT_HIDDEN = 40
CHUNK = 1280  # 80 ms at 16 kHz


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def tiny_hf_config(**kw) -> HFAudioConfig:
    from transformers import Gemma4AudioConfig as HFAudioConfig

    base = dict(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        subsampling_conv_channels=[128, 8],
        output_proj_dims=48,
    )
    base.update(kw)
    return HFAudioConfig(**base)


@torch.no_grad()
def perturb_(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-default per_dim_scale, norm weights and clip bounds (bounds tight enough that some values clip)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("per_dim_scale"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        r = float(torch.rand((), generator=gen))
        if name.endswith("input_min") or name.endswith("output_min"):
            b.fill_(-1.5 - r)
        elif name.endswith("input_max") or name.endswith("output_max"):
            b.fill_(1.5 + r)


def reference_models(seed: int = 0, **kw) -> tuple[Gemma4AudioModel, Gemma4MultimodalEmbedder]:
    from transformers import Gemma4AudioModel, Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

    torch.manual_seed(seed)
    hc = tiny_hf_config(**kw)
    tower = Gemma4AudioModel(hc).eval()
    embed = Gemma4MultimodalEmbedder(hc, Gemma4TextConfig(hidden_size=TEXT_HIDDEN)).eval()
    perturb_(tower, seed)
    return tower, embed


def hf_state_dict(tower: torch.nn.Module, embed: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The two modules' tensors under the keys of a full Gemma 4 checkpoint."""
    sd = {f"model.audio_tower.{k}": v for k, v in tower.state_dict().items()}
    sd.update({f"model.embed_audio.{k}": v for k, v in embed.state_dict().items()})
    return sd


def native_from(tower: Gemma4AudioModel, embed: Gemma4MultimodalEmbedder, pack: bool = True) -> Gemma4AudioEncoder:
    enc = Gemma4AudioEncoder(Gemma4AudioConfig.from_hf(tower.config, text_hidden_size=TEXT_HIDDEN)).eval()
    sd = {k.removeprefix("model."): v for k, v in hf_state_dict(tower, embed).items()}
    enc.load_state_dict(sd)
    return enc.prepare(pack)


def waves(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    """Speech-like test signals: noise under a slow envelope plus a chirp, float32 in [-1, 1]."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        t = np.arange(n) / 16000
        env = 0.5 + 0.5 * np.sin(2 * np.pi * 1.3 * t + rng.uniform(0, 6))
        chirp = np.sin(2 * np.pi * (200 + 900 * t) * t)
        out.append((0.2 * env * (rng.standard_normal(n) * 0.5 + chirp)).astype(np.float32))
    return out


@pytest.fixture(scope="module")
def models():
    tower, embed = reference_models(seed=0)
    return tower, embed, native_from(tower, embed)


@pytest.fixture(scope="module")
def fe():
    from transformers import Gemma4AudioFeatureExtractor

    return Gemma4AudioFeatureExtractor()


# ---------------------------------------------------------------------------------------------- front end


def test_mel_matches_reference(fe):
    ws = waves([16000, 25000, 37913, 700])
    ref = fe(ws, return_tensors="pt")
    feats, mask = LogMel()([torch.from_numpy(w) for w in ws])
    assert feats.shape == ref["input_features"].shape
    assert torch.equal(mask, ref["input_features_mask"])
    assert rel_err(feats, ref["input_features"]) <= 1e-5


def test_mel_truncates_like_reference(fe):
    (w,) = waves([481_000])
    ref = fe([w], return_tensors="pt")
    feats, mask = LogMel()([torch.from_numpy(w)])
    assert feats.shape == ref["input_features"].shape == (1, 2999, 128)
    assert torch.equal(mask, ref["input_features_mask"])
    assert rel_err(feats, ref["input_features"]) <= 1e-5


def test_streaming_mel_equals_whole_file():
    (w,) = waves([CHUNK * 9])
    lm = LogMel()
    full, mask = lm(torch.from_numpy(w))
    tail, parts = torch.zeros(1, lm.tail_length), []
    for i in range(9):
        mel, tail = lm.stream(tail, torch.from_numpy(w[None, i * CHUNK : (i + 1) * CHUNK]))
        parts.append(mel)
    stream = torch.cat(parts, dim=1)
    n = int(mask.sum())
    assert stream.shape[1] == 9 * 8 and n == 9 * 8 - 1  # the reference marks the last frame invalid
    assert rel_err(stream[:, :n], full[:, :n]) <= 1e-6


# ---------------------------------------------------------------------------------------------- whole files


@pytest.mark.parametrize("pack", [True, False], ids=["onednn", "plain"])
def test_tower_and_soft_tokens_match_reference(models, fe, pack):
    tower, embed, _ = models
    enc = native_from(tower, embed, pack=pack)
    ws = waves([41_000, 23_456])
    inp = fe(ws, return_tensors="pt")
    with torch.no_grad():
        ref = tower(inp["input_features"], inp["input_features_mask"])
        ref_soft = embed(ref.last_hidden_state)
    out = enc.encode_features(inp["input_features"], inp["input_features_mask"])
    assert torch.equal(out.mask, ref.attention_mask)
    v = out.mask
    assert rel_err(out.hidden[v], ref.last_hidden_state[v]) <= 1e-5
    assert rel_err(out.soft_tokens[v], ref_soft[v]) <= 1e-5
    # The same from raw audio, through duplexd's own front end.
    out2 = enc.encode([torch.from_numpy(w) for w in ws])
    assert torch.equal(out2.mask, ref.attention_mask)
    assert rel_err(out2.soft_tokens[v], ref_soft[v]) <= 1e-5


def test_clip_bounds_and_scales_matter(models, fe):
    """Guards the test itself: dropping the perturbed parameters must break parity."""
    tower, embed, enc = models
    inp = fe(waves([20_000]), return_tensors="pt")
    with torch.no_grad():
        ref = tower(inp["input_features"], inp["input_features_mask"]).last_hidden_state
    for name in ("input_max", "per_dim_scale", "norm_out.weight"):
        sd = {k: v.clone() for k, v in enc.state_dict().items()}
        for k in sd:
            if k.endswith(name):
                sd[k].fill_(float("inf") if name == "input_max" else (0.0 if "scale" in name else 1.0))
        other = Gemma4AudioEncoder(enc.config).eval()
        other.load_state_dict(sd)
        assert rel_err(other.encode_features(inp["input_features"], inp["input_features_mask"]).hidden, ref) > 1e-3


def test_attention_window_is_a_parameter(models, fe):
    tower, embed, enc = models
    inp = fe(waves([30_000]), return_tensors="pt")
    cfg = dataclasses.replace(enc.config, attention_window=13)  # Gemma 3n's window: distances 0 .. 12
    wide = Gemma4AudioEncoder(cfg).eval()
    wide.load_state_dict(enc.state_dict())
    a = enc.encode_features(inp["input_features"]).hidden
    b = wide.encode_features(inp["input_features"]).hidden
    assert rel_err(a[:, :12], b[:, :12]) <= 1e-6  # fewer than 13 tokens of history: no difference yet
    assert rel_err(a, b) > 1e-4


def test_padded_batch_equals_single_items(models):
    _, _, enc = models
    ws = [torch.from_numpy(w) for w in waves([12_345, 40_000, 26_000], seed=3)]
    batch = enc.encode(ws)
    for i, w in enumerate(ws):
        one = enc.encode([w])
        n = int(one.mask.sum())
        assert int(batch.mask[i].sum()) == n
        assert rel_err(batch.hidden[i, :n], one.hidden[0, :n]) <= 1e-6
        assert rel_err(batch.soft_tokens[i, :n], one.soft_tokens[0, :n]) <= 1e-6


# ---------------------------------------------------------------------------------------------- streaming


def stream_alone(enc: Gemma4AudioEncoder, w: np.ndarray) -> torch.Tensor:
    state = enc.new_stream_state(1)
    steps = len(w) // CHUNK
    return torch.cat(
        [
            enc.encode_step(state, [0], torch.from_numpy(w[None, i * CHUNK : (i + 1) * CHUNK])).soft_tokens
            for i in range(steps)
        ],
        dim=1,
    )


def test_streaming_equals_whole_file(models, fe):
    tower, embed, enc = models
    (w,) = waves([CHUNK * 20], seed=5)
    state = enc.new_stream_state(2)
    hidden, soft = [], []
    for i in range(20):
        out = enc.encode_step(state, [1], torch.from_numpy(w[None, i * CHUNK : (i + 1) * CHUNK]))
        assert out.hidden.shape[1] == 2
        hidden.append(out.hidden)
        soft.append(out.soft_tokens)
    hidden, soft = torch.cat(hidden, 1), torch.cat(soft, 1)
    full = enc.encode([torch.from_numpy(w)])
    assert full.hidden.shape[1] == hidden.shape[1] == 40 and bool(full.mask.all())
    # Documented end-of-file difference: the reference pads the last token's final mel frame, a stream does not.
    assert rel_err(hidden[:, :-1], full.hidden[:, :-1]) <= 1e-5
    assert rel_err(soft[:, :-1], full.soft_tokens[:, :-1]) <= 1e-5
    assert rel_err(hidden[:, -1:], full.hidden[:, -1:]) > 1e-4
    # And against transformers directly, on the same features.
    inp = fe([w], return_tensors="pt")
    with torch.no_grad():
        ref = tower(inp["input_features"], inp["input_features_mask"]).last_hidden_state
    assert rel_err(hidden[:, :-1], ref[:, :-1]) <= 1e-5
    assert int(state.tokens[1]) == 40 and int(state.tokens[0]) == 0


def test_slots_started_at_different_times_equal_streams_alone(models):
    _, _, enc = models
    ws = waves([CHUNK * 10, CHUNK * 7, CHUNK * 9], seed=7)
    alone = [stream_alone(enc, w) for w in ws]
    state = enc.new_stream_state(5)
    slot_of = [3, 0, 4]
    start = [0, 2, 4]  # steps at which each stream joins
    done = [0, 0, 0]
    got: list[list[torch.Tensor]] = [[], [], []]
    # A leftover stream in slot 0 that must be reset before stream 1 takes it over.
    (junk,) = waves([CHUNK], seed=9)
    enc.encode_step(state, [0], torch.from_numpy(junk[None]))
    step = 0
    while any(done[i] < len(ws[i]) // CHUNK for i in range(3)):
        active = [i for i in range(3) if step >= start[i] and done[i] < len(ws[i]) // CHUNK]
        if step % 3 == 2 and len(active) > 1:
            active = active[1:]  # some streams sit out a step: their state must not move
        for i in active:
            if done[i] == 0 and slot_of[i] == 0:
                state.reset([0])
        if active:
            pcm = torch.stack([torch.from_numpy(ws[i][done[i] * CHUNK : (done[i] + 1) * CHUNK]) for i in active])
            out = enc.encode_step(state, [slot_of[i] for i in active], pcm)
            for row, i in enumerate(active):
                got[i].append(out.soft_tokens[row : row + 1])
                done[i] += 1
        step += 1
    for i in range(3):
        assert rel_err(torch.cat(got[i], dim=1), alone[i]) <= 1e-6


def test_encode_step_rejects_bad_input(models):
    _, _, enc = models
    state = enc.new_stream_state(2)
    with pytest.raises(ValueError):
        enc.encode_step(state, [0], torch.zeros(1, 1000))
    with pytest.raises(ValueError):
        enc.encode_step(state, [0, 0], torch.zeros(2, CHUNK))
