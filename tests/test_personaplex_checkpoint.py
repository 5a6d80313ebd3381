"""PersonaPlex checkpoints: detected from the file, both DepFormer layouts loaded, inconsistent files refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from duplexd.engine.dialogue.lm_gen import LMGen
from duplexd.engine.errors import CheckpointError
from duplexd.engine.models.config import MOSHI_7B, PERSONAPLEX_7B, ConfigError, LMConfig
from duplexd.engine.weights.checkpoint import depformer_sets, lm_config_for, load_lm

from .personaplex_files import PP_SMALL, personaplex_state_dict, write_personaplex
from .ref_models import reference_lm


@pytest.fixture(scope="module")
def ref():
    return reference_lm(PP_SMALL, seed=11)


def _agent_weights_equal(model, ref) -> None:
    """Every tensor duplexd holds equals the reference's agent steps (0..7)."""
    for k in range(PP_SMALL.agent_codebooks):
        assert torch.equal(model.dep_in[k].t(), ref.depformer_in[k].weight)
        assert torch.equal(model.dep_heads[k].t(), ref.linears[k].weight)
        layer = ref.depformer.layers[1]
        assert torch.equal(model.dep_layers[1].wqkv[k].t(), layer.self_attn.in_projs[k].weight)
        assert torch.equal(model.dep_layers[1].wo[k].t(), layer.self_attn.out_projs[k].weight)
        assert torch.equal(model.dep_layers[1].w_in[k].t(), layer.gating[k].linear_in.weight)
    for k in range(PP_SMALL.agent_codebooks - 1):
        assert torch.equal(model.dep_audio_emb[k], ref.depformer_emb[k].weight)
    assert torch.equal(model.audio_emb[15], ref.emb[15].weight)
    assert torch.equal(model.dep_layers[0].attn_norm, ref.depformer.layers[0].norm1.alpha.flatten())


def test_config_properties():
    assert PP_SMALL.predicts_user_audio and PP_SMALL.agent_codebooks == 8 and PP_SMALL.num_user_codebooks == 8
    assert not MOSHI_7B.predicts_user_audio and MOSHI_7B.agent_codebooks == 8
    assert PERSONAPLEX_7B == dataclasses.replace(MOSHI_7B, dep_q=16, ring_rule="personaplex")
    with pytest.raises(ConfigError, match="even n_q"):
        LMConfig(n_q=15, dep_q=15, delays=(0,) * 16)


@pytest.mark.parametrize("naming", ["module", "fused"])
@pytest.mark.parametrize("sets", [16, 8])
def test_detected_and_loaded(ref, tmp_path, naming, sets):
    """dep_q comes from the checkpoint when config.json does not state it (16 sets); an 8-set file loads under a
    dep_q = 16 config (the reference copies sets 0..7 into 8..15, which only predict the user and are not run)."""
    path, _ = write_personaplex(tmp_path, PP_SMALL, sets=sets, naming=naming, lm=ref)
    if sets == 8:  # 8 sets alone say Moshi: the config must say PersonaPlex
        (tmp_path / "config.json").write_text(json.dumps(PP_SMALL.to_reference_json()))
    model = load_lm(tmp_path)
    assert model.cfg == PP_SMALL
    assert model.dep_in.shape[0] == 8 and model.dep_audio_emb.shape[0] == 7
    _agent_weights_equal(model, ref)


def test_sixteen_and_eight_sets_give_the_same_model(ref, tmp_path):
    full = load_lm(write_personaplex(tmp_path / "a", PP_SMALL, sets=16, naming="fused", lm=ref)[0])
    part = load_lm(write_personaplex(tmp_path / "b", PP_SMALL, sets=8, lm=ref)[0], PP_SMALL)
    for (name, a), (_, b) in zip(full.named_parameters(), part.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    gen = LMGen(full, num_slots=1)  # and it runs: 8 agent codebooks out
    gen.step(torch.tensor([0]), torch.zeros(1, 8, dtype=torch.long))
    out = gen.step(torch.tensor([0]), torch.zeros(1, 8, dtype=torch.long))
    assert out.tokens.shape == (1, 9) and bool(out.valid[0])


def _header_only(path, sets: int) -> None:
    save_file({f"linears.{k}.weight": torch.zeros(1) for k in range(sets)}, str(path))


@pytest.mark.parametrize("sets, expected", [(16, PERSONAPLEX_7B), (8, MOSHI_7B)])
def test_empty_hf_config_json(tmp_path, sets, expected):
    """PersonaPlex's HF config.json is `{}`: the released 7B settings, dep_q from the checkpoint's sets."""
    weights = tmp_path / "model.safetensors"
    _header_only(weights, sets)
    (tmp_path / "config.json").write_text("{}")
    assert lm_config_for(weights, None, str(weights)) == expected
    (tmp_path / "config.json").unlink()  # no config at all: the same
    assert lm_config_for(weights, None, str(weights)) == expected
    assert depformer_sets({f"depformer_in.{k}.weight" for k in range(sets)}) == sets


def test_sixteen_sets_with_a_moshi_config_is_refused(ref, tmp_path):
    write_personaplex(tmp_path, PP_SMALL, lm=ref)
    (tmp_path / "config.json").write_text(json.dumps({**PP_SMALL.to_reference_json(), "dep_q": 8}))
    with pytest.raises(CheckpointError, match=r"16 DepFormer weight sets \(a PersonaPlex checkpoint\).*dep_q=8"):
        load_lm(tmp_path)


def test_other_set_counts_are_refused(ref, tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(personaplex_state_dict(ref, PP_SMALL, sets=12), str(path))
    with pytest.raises(CheckpointError, match="holds 12 DepFormer weight sets.*expects 16 or 8"):
        load_lm(path, PP_SMALL)


@pytest.mark.parametrize("naming", ["module", "fused"])
def test_a_missing_user_step_tensor_is_named(ref, tmp_path, naming):
    """Sets 8..15 partly present: the missing tensors are listed (nothing is copied behind the user's back)."""
    tensors = personaplex_state_dict(ref, PP_SMALL, sets=16, naming=naming)
    del tensors["depformer.layers.1.gating.11.linear_out.weight"], tensors["depformer_emb.9.weight"]
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"2 missing key\(s\).*depformer\.layers\.1\.gating\.11") as info:
        load_lm(path, PP_SMALL)
    assert "depformer_emb.9.weight" in str(info.value)


def test_a_user_step_of_the_wrong_shape_is_refused(ref, tmp_path):
    tensors = personaplex_state_dict(ref, PP_SMALL, sets=16, naming="fused")
    tensors["depformer.layers.0.self_attn.in_proj_weight"] = tensors["depformer.layers.0.self_attn.in_proj_weight"][
        :-1
    ].contiguous()
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"shape mismatch for depformer\.layers\.0\.self_attn\.in_proj_weight"):
        load_lm(path, PP_SMALL)
