"""Configs: the 7B preset equals the reference's, and reference config.json files are read or refused clearly."""

from __future__ import annotations

import json

import pytest
from moshi.models import loaders

from duplexd.engine.errors import CheckpointError
from duplexd.engine.models.config import DEMO, MOSHI_7B, ConfigError, LMConfig, lm_config_from_dict
from duplexd.engine.weights.checkpoint import read_lm_config


def test_7b_preset_is_the_released_configuration():
    assert lm_config_from_dict(dict(loaders._lm_kwargs)) == MOSHI_7B
    assert MOSHI_7B.hidden == 11264 and MOSHI_7B.depformer_hidden == 2816
    assert MOSHI_7B.head_dim == 128 and MOSHI_7B.depformer_head_dim == 64


def test_reference_json_round_trip(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**DEMO.to_reference_json(), "moshi_name": "model.safetensors"}))
    assert read_lm_config(path) == DEMO


def test_demo_exercises_every_path():
    assert DEMO.num_layers > 1 and DEMO.num_heads > 1 and DEMO.depformer_num_layers > 1
    assert DEMO.n_q == 16 and DEMO.dep_q == 8


@pytest.mark.parametrize(
    "change, message",
    [
        ({"norm": "layer_norm"}, "'norm'='layer_norm' is not supported"),
        ({"depformer_weights_per_step_schedule": [0, 1, 1, 1, 1, 1, 1, 1]}, "is not supported"),
        ({"frobnicate": 1}, "unknown LM config key 'frobnicate'"),
        ({"delays": [0, 1]}, "delays has 2 entries"),
        ({"num_heads": 5}, "divisible"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, change, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MOSHI_7B.to_reference_json(), **change}))
    with pytest.raises(CheckpointError, match=message):
        read_lm_config(path)


def test_unreadable_config(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read it"):
        read_lm_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="JSON object"):
        read_lm_config(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text("{1, 2}")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_lm_config(tmp_path / "bad.json")
    with pytest.raises(ConfigError):
        LMConfig(dep_q=0)
