"""Kyutai STT checkpoints and configs: both of the reference's key namings with the extra heads, no DepFormer, clear
errors for a head that is missing, the presets' sizes, the STT config.json, and the demo STT model."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from moshi.models import loaders
from moshi.models.lm import LMModel as RefLMModel
from safetensors.torch import load_file, save_file

from duplexd.commands.transcribe_stt import SttFiles, stt_files
from duplexd.engine.errors import CheckpointError
from duplexd.engine.models.config import DEMO_STT, MIMI_PRESETS, STT_1B, STT_2_6B, LMConfig
from duplexd.engine.models.lm import LMModel
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.weights.checkpoint import (
    load_lm,
    load_mimi,
    mimi_preset_of,
    read_lm_config,
    read_stt_settings,
    save_lm_weights,
)
from duplexd.engine.weights.config_file import SttSettings
from duplexd.engine.weights.demo import ensure_demo_stt
from duplexd.engine.weights.model_files import check_mimi_preset, model_files

from .ref_models import fused_state_dict, reference_kwargs, reference_lm

TINY_STT = LMConfig(
    dim=64, text_card=97, num_heads=2, num_layers=2, n_q=32, dep_q=0, delays=(0,) * 33, extra_heads_num_heads=3
)


@pytest.fixture(scope="module")
def ref():
    return reference_lm(TINY_STT, seed=7)


def _write(tensors: dict[str, torch.Tensor], path) -> str:
    save_file(tensors, str(path))
    return str(path)


@pytest.mark.parametrize("naming", ["module", "fused"])
def test_both_namings_load_with_the_heads_and_no_depformer(ref, tmp_path, naming):
    tensors = {k: v.contiguous() for k, v in ref.state_dict().items()}
    if naming == "fused":
        tensors = fused_state_dict(ref, TINY_STT)
    assert any(k.endswith("in_proj_weight") for k in tensors) == (naming == "fused")
    model = load_lm(_write(tensors, tmp_path / "lm.safetensors"), TINY_STT)
    for k in range(3):
        assert torch.equal(model.extra_heads[k].t(), ref.extra_heads[k].weight)
    assert torch.equal(model.layers[1].wqkv.t(), ref.transformer.layers[1].self_attn.in_projs[0].weight)
    assert not [n for n, _ in model.named_parameters() if n.startswith("dep_")]
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())


def test_written_stt_checkpoints_load_strictly_into_the_reference(ref, tmp_path):
    model = load_lm(_write(fused_state_dict(ref, TINY_STT), tmp_path / "in.safetensors"), TINY_STT)
    for naming in ("module", "fused"):
        path = tmp_path / f"{naming}.safetensors"
        save_lm_weights(model, path, naming=naming)
        again = RefLMModel(device="cpu", dtype=torch.float32, **reference_kwargs(TINY_STT))
        again.load_state_dict(load_file(str(path)), strict=True)  # the reference's hook takes the fused naming
        assert torch.equal(again.extra_heads[2].weight, ref.extra_heads[2].weight)


def test_a_missing_head_is_named(ref, tmp_path):
    tensors = fused_state_dict(ref, TINY_STT)
    one_gone = {k: v for k, v in tensors.items() if k != "extra_heads.1.weight"}
    with pytest.raises(CheckpointError, match=r"missing key.*extra_heads\.1\.weight"):
        load_lm(_write(one_gone, tmp_path / "one.safetensors"), TINY_STT)
    last_gone = {k: v for k, v in tensors.items() if k != "extra_heads.2.weight"}
    with pytest.raises(CheckpointError, match="holds 2 extra heads.*extra_heads_num_heads=3"):
        load_lm(_write(last_gone, tmp_path / "last.safetensors"), TINY_STT)
    none = {k: v for k, v in tensors.items() if not k.startswith("extra_heads.")}
    with pytest.raises(CheckpointError, match="holds 0 extra heads.*-candle"):
        load_lm(_write(none, tmp_path / "none.safetensors"), TINY_STT)


@pytest.mark.parametrize(("cfg", "params"), [(STT_1B, 0.989e9), (STT_2_6B, 2.617e9)])
def test_presets_have_the_released_sizes(cfg, params):
    with torch.device("meta"):
        ours = sum(p.numel() for p in LMModel(cfg).parameters())
    theirs = loaders.get_moshi_lm(None, lm_kwargs=reference_kwargs(cfg), device="meta")
    assert ours == sum(p.numel() for p in theirs.parameters())
    assert abs(ours - params) < 0.001e9
    assert cfg.text_only and cfg.user_lag == 1 and cfg.num_user_codebooks == 32


def test_stt_config_json_is_read_with_its_settings(tmp_path):
    raw = {
        **STT_1B.to_reference_json(),
        "model_type": "stt",
        "stt_config": {"audio_delay_seconds": 0.5, "audio_silence_prefix_seconds": 1.0},
        "lm_gen_config": {"temp": 0, "temp_text": 0.25, "top_k": 250, "top_k_text": 50},
        "mimi_name": "mimi-pytorch-e351c8d8@125.safetensors",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    assert read_lm_config(path) == STT_1B
    assert read_stt_settings(path) == SttSettings(0.5, 1.0, 0.25, 50)
    path.write_text(json.dumps({**raw, "stt_config": [0.5]}))
    with pytest.raises(CheckpointError, match="stt_config and lm_gen_config must be JSON objects"):
        read_stt_settings(path)
    moshi = tmp_path / "moshi.json"
    moshi.write_text(json.dumps({**loaders._lm_kwargs, "model_type": "moshi"}))
    assert read_stt_settings(moshi) is None


def test_demo_stt_files(tmp_path):
    files = ensure_demo_stt(tmp_path)
    assert ensure_demo_stt(tmp_path).lm.stat().st_mtime_ns == files.lm.stat().st_mtime_ns  # written once
    model = load_lm(files.root)
    cfg = model.cfg
    assert cfg == dataclasses.replace(DEMO_STT, text_card=TextTokenizer(files.tokenizer).vocab_size)
    assert cfg.text_only and cfg.extra_heads_num_heads == 4 and cfg.num_layers > 1 and cfg.num_heads > 1
    assert read_stt_settings(files.config) == SttSettings(0.5, 0.0, 0.0, 50)
    ref = RefLMModel(device="cpu", dtype=torch.float32, **reference_kwargs(cfg))
    ref.load_state_dict(load_file(str(files.lm)), strict=True)
    mimi = load_mimi(files.mimi, MIMI_PRESETS[files.mimi_preset])
    assert mimi.cfg.num_codebooks == 32 and mimi.cfg.frame_size == 1920


def _kyutai_stt_folder(root, demo):
    """The demo STT's config.json with Kyutai's STT file names (the files themselves are not read here)."""
    config = json.loads(demo.config.read_text())
    config.update(mimi_name="mimi-pytorch-e351c8d8@125.safetensors", tokenizer_name="tokenizer_en_fr_audio_8000.model")
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_a_stt_repo_names_its_files_and_takes_mimi_32(tmp_path, monkeypatch):
    """`--hf-repo` with a Kyutai STT repo (from the hub's cache, offline) or a local folder: the files its
    config.json names, Mimi with all 32 codebooks unless a preset is given; a Moshi repo keeps 8."""
    import huggingface_hub.constants as constants

    demo = ensure_demo_stt(tmp_path / "demo")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = tmp_path / "hub" / "models--kyutai--stt-tiny"
    _kyutai_stt_folder(repo_dir / "snapshots" / commit, demo)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub = model_files(hf_repo="kyutai/stt-tiny")
    assert (hub.moshi, hub.mimi, hub.tokenizer, hub.mimi_preset) == (
        "hf://kyutai/stt-tiny/model.safetensors",
        "hf://kyutai/stt-tiny/mimi-pytorch-e351c8d8@125.safetensors",
        "hf://kyutai/stt-tiny/tokenizer_en_fr_audio_8000.model",
        "mimi-32",
    )
    folder = _kyutai_stt_folder(tmp_path / "local", demo)
    local = model_files(hf_repo=str(folder))
    assert (local.mimi, local.config, local.mimi_preset) == (
        f"{folder}/mimi-pytorch-e351c8d8@125.safetensors",
        str(folder / "config.json"),
        "mimi-32",
    )
    assert model_files(hf_repo=str(folder), mimi_preset="demo-32").mimi_preset == "demo-32"
    explicit = model_files(moshi_weight="m", mimi_weight="x", tokenizer="t", config=str(folder / "config.json"))
    assert explicit.mimi_preset == "mimi-32"  # the config says speech to text
    moshi = tmp_path / "moshi"
    moshi.mkdir()
    (moshi / "config.json").write_text(json.dumps({"dim": 4096}))
    assert model_files(hf_repo=str(moshi)).mimi_preset == "mimi"
    assert model_files(hf_repo=str(moshi)).tokenizer.endswith("/tokenizer_spm_32k_3.model")


def test_the_mimi_preset_follows_a_local_mimi_file_and_must_give_the_lm_its_codebooks(tmp_path):
    """No preset given: a local folder holding the demo's tiny Mimi reads it as `demo-32` (the file's header says
    so; Kyutai's full-size file is `mimi-32`); an explicit preset short of the LM's 32 codebooks is refused."""
    demo = ensure_demo_stt(tmp_path / "demo")
    folder = _kyutai_stt_folder(tmp_path / "local", demo)
    shutil.copy(demo.mimi, folder / "mimi-pytorch-e351c8d8@125.safetensors")
    assert model_files(hf_repo=str(folder)).mimi_preset == "demo-32"
    shutil.copy(demo.lm, folder / "model.safetensors")
    shutil.copy(demo.tokenizer, folder / "tokenizer_en_fr_audio_8000.model")
    files = stt_files(str(folder))  # `duplexd transcribe --model FOLDER` reads the folder as the server does
    assert files == SttFiles(
        folder / "model.safetensors",
        folder / "mimi-pytorch-e351c8d8@125.safetensors",
        folder / "tokenizer_en_fr_audio_8000.model",
        folder / "config.json",
        "demo-32",
    )
    assert mimi_preset_of(demo.mimi, ("mimi-32", "demo")) is None  # 32 codebooks of the demo's size: neither
    assert mimi_preset_of(tmp_path / "none.safetensors", ("demo-32",)) is None
    cfg = read_lm_config(demo.config)
    check_mimi_preset("demo-32", cfg)
    with pytest.raises(CheckpointError, match=r"^demo: Mimi with 8 codebooks of 2048, and the LM reads 32 of 2048 \("):
        check_mimi_preset("demo", cfg)
