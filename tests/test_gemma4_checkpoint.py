"""Loading the Gemma 4 audio tower from HF-layout checkpoints, and the errors for bad ones."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from duplexd.engine.errors import CheckpointError
from duplexd.engine.weights.gemma4_checkpoint import load_gemma4_audio
from tests.gemma4_ref import needs_transformers
from tests.test_gemma4_audio import TEXT_HIDDEN, hf_state_dict, reference_models, rel_err, waves

pytestmark = needs_transformers


@pytest.fixture(scope="module")
def ref():
    tower, embed = reference_models(seed=1)
    sd = {k: v.contiguous() for k, v in hf_state_dict(tower, embed).items()}
    sd["model.language_model.embed_tokens.weight"] = torch.zeros(8, 4)  # LM tensors are skipped
    config = {
        "model_type": "gemma4",
        "audio_config": tower.config.to_dict(),
        "text_config": {"hidden_size": TEXT_HIDDEN},
    }
    return tower, embed, sd, config


def write(folder, sd, config=None, shards: int = 1):
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(sd)
    if shards == 1:
        save_file(sd, str(folder / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: sd[k] for k in keys[s::shards]}
            save_file(part, str(folder / name))
            weight_map.update({k: name for k in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("shards", [1, 3])
def test_load_matches_reference(ref, tmp_path, shards):
    tower, embed, sd, config = ref
    enc = load_gemma4_audio(write(tmp_path / "ckpt", sd, config, shards))
    assert enc.config.num_hidden_layers == 3 and enc.config.text_hidden_size == TEXT_HIDDEN
    from transformers import Gemma4AudioFeatureExtractor

    inp = Gemma4AudioFeatureExtractor()(waves([30_000]), return_tensors="pt")
    with torch.no_grad():
        r = tower(inp["input_features"], inp["input_features_mask"])
        r_soft = embed(r.last_hidden_state)
    out = enc.encode_features(inp["input_features"], inp["input_features_mask"])
    v = out.mask
    assert rel_err(out.hidden[v], r.last_hidden_state[v]) <= 1e-5
    assert rel_err(out.soft_tokens[v], r_soft[v]) <= 1e-5


def test_load_without_config_infers_embedder(ref, tmp_path):
    tower, _, sd, _ = ref
    from duplexd.engine.models.gemma4_audio import Gemma4AudioConfig

    cfg = Gemma4AudioConfig.from_hf(tower.config, text_hidden_size=TEXT_HIDDEN)
    enc = load_gemma4_audio(write(tmp_path / "c", sd) / "model.safetensors", config=cfg)
    assert enc.embed_audio is not None


def test_missing_file(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="file not found"):
        load_gemma4_audio(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="not found"):
        load_gemma4_audio(tmp_path / "nowhere" / "model.safetensors")


def test_missing_keys(ref, tmp_path):
    _, _, sd, config = ref
    bad = {k: v for k, v in sd.items() if ".layers.2." not in k}
    with pytest.raises(CheckpointError, match=r"missing keys \(\d+\): audio_tower\.layers\.2\."):
        load_gemma4_audio(write(tmp_path / "c", bad, config))


def test_unexpected_key(ref, tmp_path):
    _, _, sd, config = ref
    bad = dict(sd, **{"model.audio_tower.layers.0.bogus.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected key model\.audio_tower\.layers\.0\.bogus\.weight"):
        load_gemma4_audio(write(tmp_path / "c", bad, config))


def test_shape_mismatch(ref, tmp_path):
    _, _, sd, config = ref
    key = "model.audio_tower.output_proj.weight"
    bad = dict(sd, **{key: torch.zeros(7, 64)})
    with pytest.raises(
        CheckpointError,
        match=r"shape mismatch for model\.audio_tower\.output_proj\.weight: "
        r"expected \(48, 64\), got \(7, 64\)",
    ):
        load_gemma4_audio(write(tmp_path / "c", bad, config))


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_gemma4_audio(path)


def test_checkpoint_without_audio_tower(tmp_path):
    folder = write(tmp_path / "c", {"model.language_model.norm.weight": torch.ones(4)})
    with pytest.raises(CheckpointError, match="no audio tensors"):
        load_gemma4_audio(folder)


def test_offline_hub_repo_without_local_copy(monkeypatch, tmp_path):
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError, match="offline"):
        load_gemma4_audio("google/gemma-4-E2B-it")
