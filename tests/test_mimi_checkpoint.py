"""Mimi checkpoints: both reference namings, the old codebook names, every source form, and clear errors."""

from __future__ import annotations

import pytest
import torch
from moshi.models import loaders
from safetensors.torch import load_file, save_file

from duplexd.engine.errors import CheckpointError
from duplexd.engine.models.config import MIMI, MimiConfig
from duplexd.engine.models.mimi import MimiModel
from duplexd.engine.weights.checkpoint import MIMI_NAME, load_mimi, mimi_key_map, save_mimi_weights

from .ref_models import reference_mimi

CFG = MimiConfig(
    dimension=16, n_filters=2, num_heads=2, num_layers=2, dim_feedforward=24, codebook_dim=8, n_q=9, card=32
)


@pytest.fixture(scope="module")
def ref():
    return reference_mimi(seed=7, mimi_config=CFG.to_reference_dict())


@pytest.fixture(scope="module")
def module_sd(ref):
    return {k: v.contiguous() for k, v in ref.state_dict().items()}


def fused(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        k = k.replace("self_attn.in_projs.0.weight", "self_attn.in_proj_weight")
        out[k.replace("self_attn.out_projs.0.weight", "self_attn.out_proj.weight")] = v
    return out


def old_codebook_names(sd: dict[str, torch.Tensor], embedding: str) -> dict[str, torch.Tensor]:
    names = {"_initialized": "inited", "cluster_usage": "cluster_size", "embedding_sum": embedding}
    out = {}
    for k, v in sd.items():
        prefix, leaf = k.rsplit(".", 1)
        out[f"{prefix}.{names.get(leaf, leaf)}" if "._codebook." in k else k] = v
    return out


def _same(model: MimiModel, ref) -> None:
    tr = ref.decoder_transformer.transformer.layers[1]
    assert torch.equal(model.decoder_transformer.layers[1].wqkv.t(), tr.self_attn.in_projs[0].weight)
    assert torch.equal(model.decoder_transformer.layers[1].layer_scale_2, tr.layer_scale_2.scale)
    assert torch.equal(model.encoder.model[1].block[1].weight, ref.encoder.model[1].block[1].conv.conv.weight)
    assert torch.equal(model.upsample.weight, ref.upsample.convtr.convtr.convtr.weight)
    cb = ref.quantizer.rvq_rest.vq.layers[3]._codebook
    ours = model.quantizer.rvq_rest.vq.layers[3]._codebook
    assert torch.equal(ours.embedding_sum, cb.embedding_sum) and torch.equal(ours.cluster_usage, cb.cluster_usage)
    assert torch.equal(model.quantizer.rvq_first.input_proj.t(), ref.quantizer.rvq_first.input_proj.weight[..., 0])


def test_real_config_key_map_matches_the_reference_module_state_dict():
    torch.manual_seed(0)
    ref_shapes = {k: tuple(v.shape) for k, v in loaders.get_mimi(None, device="cpu").state_dict().items()}
    with torch.device("meta"):
        model = MimiModel(MIMI)
    assert {row.key: row.shape for row in mimi_key_map(model, "module")} == ref_shapes
    assert len(mimi_key_map(model, "fused")) == 318
    params = sum(p.numel() for p in model.parameters())
    assert round(params / 1e6, 1) == 79.3


@pytest.mark.parametrize("variant", ["module", "fused", "embed_avg", "embed_sum"])
def test_namings_and_old_codebook_names_load_the_same_weights(ref, module_sd, tmp_path, variant):
    sd = {"module": module_sd, "fused": fused(module_sd)}.get(variant) or old_codebook_names(module_sd, variant)
    save_file(sd, str(tmp_path / "m.safetensors"))
    _same(load_mimi(tmp_path / "m.safetensors", CFG), ref)


def test_saved_weights_load_strictly_into_the_reference(ref, module_sd, tmp_path):
    model = load_mimi(_write(module_sd, tmp_path / "a.safetensors"), CFG)
    save_mimi_weights(model, tmp_path / "b.safetensors")
    fresh = loaders.get_mimi(None, mimi_config=CFG.to_reference_dict(), device="cpu")
    fresh.load_state_dict(load_file(str(tmp_path / "b.safetensors")), strict=True)
    _same(model, fresh)
    save_mimi_weights(model, tmp_path / "c.safetensors", naming="fused")
    assert "decoder_transformer.transformer.layers.0.self_attn.in_proj_weight" in load_file(
        str(tmp_path / "c.safetensors")
    )


def _write(sd: dict[str, torch.Tensor], path):
    save_file(sd, str(path))
    return path


def test_sources_directory_and_file_url(ref, module_sd, tmp_path):
    _write(module_sd, tmp_path / MIMI_NAME)
    _same(load_mimi(tmp_path, CFG), ref)
    _same(load_mimi(f"file://{tmp_path / MIMI_NAME}", CFG), ref)
    with pytest.raises(CheckpointError, match="file not found"):
        load_mimi(tmp_path / "nope.safetensors", CFG)


def test_bad_files_give_clear_errors(module_sd, tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_mimi(junk, CFG)

    good = _write(module_sd, tmp_path / "good.safetensors")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size - 100])
    with pytest.raises(CheckpointError, match="truncated|not a readable"):
        load_mimi(cut, CFG)

    missing = dict(module_sd)
    del missing["decoder.model.0.conv.conv.bias"]
    with pytest.raises(CheckpointError, match=r"1 missing Mimi key\(s\).*decoder\.model\.0\.conv\.conv\.bias"):
        load_mimi(_write(missing, tmp_path / "missing.safetensors"), CFG)

    extra = {**module_sd, "decoder.extra.weight": torch.zeros(2)}
    with pytest.raises(CheckpointError, match=r"unexpected Mimi key\(s\): decoder\.extra\.weight"):
        load_mimi(_write(extra, tmp_path / "extra.safetensors"), CFG)

    key = "encoder_transformer.transformer.layers.0.linear1.weight"
    wrong = {**module_sd, key: torch.zeros(5, 16)}
    with pytest.raises(CheckpointError, match=rf"shape mismatch for {key}: expected \[24, 16\], got \[5, 16\]"):
        load_mimi(_write(wrong, tmp_path / "wrong.safetensors"), CFG)

    with pytest.raises(CheckpointError, match="missing Mimi key"):
        load_mimi(good, MIMI)  # small checkpoint against the released config
