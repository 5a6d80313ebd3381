"""Checkpoint loading: both reference namings, every source form, and a clear error for every bad file."""

from __future__ import annotations

import json

import pytest
import torch
from moshi.models.lm import LMModel as RefLMModel
from safetensors.torch import load_file, save_file

from duplexd.engine.errors import CheckpointError
from duplexd.engine.models.config import MOSHI_7B, LMConfig
from duplexd.engine.weights.checkpoint import build_lm, key_map, load_lm, save_lm_weights

from .ref_models import fused_state_dict, reference_kwargs, reference_lm

CFG = LMConfig(
    dim=32,
    text_card=67,
    num_heads=2,
    num_layers=2,
    depformer_dim=16,
    depformer_dim_feedforward=66,
    depformer_num_heads=2,
    depformer_num_layers=2,
)


@pytest.fixture(scope="module")
def ref():
    return reference_lm(CFG, seed=5)


@pytest.fixture()
def good_file(ref, tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(fused_state_dict(ref, CFG), str(path))
    return path


def _same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_7b_key_map_matches_the_reference_module_state_dict():
    ref = RefLMModel(device=torch.device("meta"), dtype=torch.bfloat16, **reference_kwargs(MOSHI_7B))
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    ours = {row.key: row.shape for row in key_map(MOSHI_7B, "module")}
    assert ours == ref_shapes
    assert len(key_map(MOSHI_7B, "fused")) == 355


def test_7b_parameter_count():
    with torch.device("meta"):
        model = build_lm(MOSHI_7B, device="meta")
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 3) == 7.688


@pytest.mark.parametrize("naming", ["module", "fused"])
def test_both_namings_load_the_same_weights(ref, tmp_path, naming):
    tensors = (
        {k: v.contiguous() for k, v in ref.state_dict().items()} if naming == "module" else fused_state_dict(ref, CFG)
    )
    save_file(tensors, str(tmp_path / "m.safetensors"))
    model = load_lm(tmp_path / "m.safetensors", CFG)
    assert torch.equal(model.dep_layers[1].wqkv[5].t(), ref.depformer.layers[1].self_attn.in_projs[5].weight)
    assert torch.equal(model.layers[1].attn_norm, ref.transformer.layers[1].norm1.alpha.flatten())
    assert torch.equal(model.audio_emb[15], ref.emb[15].weight)


@pytest.mark.parametrize("naming", ["module", "fused"])
def test_saved_checkpoint_loads_strictly_into_the_reference(ref, good_file, tmp_path, naming):
    model = load_lm(good_file, CFG)
    out = tmp_path / "saved.safetensors"
    save_lm_weights(model, out, naming=naming)
    fresh = RefLMModel(device="cpu", dtype=torch.float32, **reference_kwargs(CFG))
    fresh.load_state_dict(load_file(str(out)), strict=True)
    for k, v in ref.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert _same_weights(load_lm(out, CFG), model)


def test_config_json_beside_the_weights_and_dtype_cast(ref, good_file):
    (good_file.parent / "config.json").write_text(json.dumps(CFG.to_reference_json()))
    model = load_lm(good_file.parent, dtype=torch.bfloat16)  # a folder: model.safetensors + config.json
    assert model.cfg == CFG
    assert model.text_head.dtype == torch.bfloat16
    assert torch.equal(model.text_head.t(), ref.text_linear.weight.to(torch.bfloat16))


def test_file_url_form(good_file):
    assert load_lm(f"file://{good_file}", CFG).cfg == CFG


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="file not found"):
        load_lm(tmp_path / "nope.safetensors", CFG)


def test_text_file_is_not_a_safetensors_file(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("these are not weights\n" * 10)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_lm(path, CFG)


def test_truncated_file(good_file):
    data = good_file.read_bytes()
    good_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated|not a readable safetensors"):
        load_lm(good_file, CFG)


def test_missing_keys_are_listed(ref, tmp_path):
    tensors = fused_state_dict(ref, CFG)
    del tensors["linears.3.weight"], tensors["transformer.layers.1.gating.linear_in.weight"]
    save_file(tensors, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"2 missing key\(s\).*linears\.3\.weight") as info:
        load_lm(tmp_path / "m.safetensors", CFG)
    assert "transformer.layers.1.gating.linear_in.weight" in str(info.value)


def test_unexpected_key(ref, tmp_path):
    tensors = fused_state_dict(ref, CFG)
    tensors["transformer.layers.7.norm1.alpha"] = torch.ones(1, 1, CFG.dim)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected key\(s\): transformer\.layers\.7\.norm1\.alpha"):
        load_lm(tmp_path / "m.safetensors", CFG)


def test_shape_mismatch_names_key_and_shapes(ref, tmp_path):
    save_file(fused_state_dict(ref, CFG), str(tmp_path / "m.safetensors"))
    wider = LMConfig(**{**CFG.__dict__, "text_card": 68})
    message = r"shape mismatch for text_emb\.weight: expected \[69, 32\], got \[68, 32\]"
    with pytest.raises(CheckpointError, match=message):
        load_lm(tmp_path / "m.safetensors", wider)


def test_hub_reference_offline_without_local_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for ref in ("hf://kyutai/moshiko-pytorch-bf16/model.safetensors", "kyutai/moshiko-pytorch-bf16"):
        with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
            load_lm(ref, CFG)


def test_bad_config_json(good_file):
    cfg_path = good_file.parent / "config.json"
    cfg_path.write_text(json.dumps({**CFG.to_reference_json(), "gating": "gelu"}))
    with pytest.raises(CheckpointError, match="'gating'='gelu' is not supported"):
        load_lm(good_file)
    cfg_path.write_text("{ not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_lm(good_file)


def test_hub_repo_id_and_hf_url_from_the_local_cache(good_file, tmp_path, monkeypatch):
    """Offline, a repo already in the Hugging Face cache loads by repo id (config.json included) and hf:// URL."""
    import huggingface_hub.constants as constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hf" / "hub" / "models--acme--tiny-moshi"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    (snapshot / "model.safetensors").write_bytes(good_file.read_bytes())
    (snapshot / "config.json").write_text(json.dumps(CFG.to_reference_json()))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    by_id = load_lm("acme/tiny-moshi")
    assert by_id.cfg == CFG
    by_url = load_lm("hf://acme/tiny-moshi/model.safetensors")
    assert _same_weights(by_id, by_url)
