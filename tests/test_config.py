"""Configs: the 7B preset equals the reference's, and reference config.json files are read or refused clearly."""

from __future__ import annotations

import dataclasses
import json

import pytest
from moshi.models import loaders

from duplexd.engine.errors import CheckpointError
from duplexd.engine.models.config import (
    DEMO,
    MOSHI_7B,
    PERSONAPLEX_7B,
    STT_1B,
    STT_2_6B,
    TTS_1_6B,
    ConfigError,
    LMConfig,
)
from duplexd.engine.weights.checkpoint import checkpoint_ring_rule, read_lm_config
from duplexd.engine.weights.config_file import lm_config_from_dict


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
        (
            {"conditioners": {"description": {"type": "lut", "lut": {"n_bins": 3, "dim": 4}}}},
            "belongs to Hibiki models",
        ),
        ({"depformer_weights_per_step_schedule": [0, 1, 1]}, "has 3 entries, expected dep_q = 8"),
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
        LMConfig(dep_q=17)


# config.json shapes of published checkpoints (sizes and keys as Kyutai's and NVIDIA's configs state them).
_MOSHI_FILES = {
    "moshi_name": "model.safetensors",
    "mimi_name": "tokenizer-e351c8d8-checkpoint125.safetensors",
    "tokenizer_name": "tokenizer_spm_32k_3.model",
}
CFG_VALUES = [f"{x / 2:.1f}" for x in range(2, 9)]  # the distilled CFG coefficients, "1.0" ... "4.0"
# Older releases' defaults, as published config files and NVIDIA's fork still hold them.
_OLDER_MOSHI = {**loaders._lm_kwargs, "depformer_causal": True, "depformer_context": 8}
_STT_COMMON = {
    "card": 2048,
    "n_q": 32,
    "dep_q": 0,
    "delays": [0] * 33,
    "dim": 2048,
    "hidden_scale": 4.125,
    "max_period": 100000,
    "existing_text_padding_id": 3,
    "causal": True,
    "layer_scale": None,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "fuser": None,
    "model_type": "stt",
    "lm_gen_config": {"temp": 0, "temp_text": 0, "top_k": 250, "top_k_text": 50},
    "mimi_name": "mimi-pytorch-e351c8d8@125.safetensors",
}
PUBLISHED = {
    "moshi-7b": {**_OLDER_MOSHI, **_MOSHI_FILES, "model_type": "moshi", "lm_gen_config": {"temp": 0.8}},
    "moshi-7b-lora": {**loaders._lm_kwargs, "lora": False, "lora_rank": 128, "lora_scaling": 2.0, "lora_name": None},
    "moshi-7b-demux-off": {**loaders._lm_kwargs, "demux_second_stream": False},
    "personaplex-7b": {},  # NVIDIA's config.json is empty: the loader reads dep_q from the checkpoint
    "personaplex-7b-fork-defaults": {**_OLDER_MOSHI, "dep_q": 16},
    "stt-1b-en_fr": {
        **_STT_COMMON,
        "text_card": 8000,
        "num_heads": 16,
        "num_layers": 16,
        "context": 750,
        "extra_heads_num_heads": 4,
        "extra_heads_dim": 6,
        "stt_config": {"audio_delay_seconds": 0.5, "audio_silence_prefix_seconds": 0.0},
        "tokenizer_name": "tokenizer_en_fr_audio_8000.model",
    },
    "stt-2.6b-en": {
        **_STT_COMMON,
        "text_card": 4000,
        "num_heads": 32,
        "num_layers": 48,
        "context": 375,
        "stt_config": {"audio_delay_seconds": 2.5, "audio_silence_prefix_seconds": 1.0},
        "tokenizer_name": "tokenizer_en_audio_4000.model",
    },
    "tts-1.6b-en_fr": {
        "card": 2048,
        "n_q": 32,
        "dep_q": 32,
        "delays": [0, 0] + [2] * 31,
        "dim": 2048,
        "text_card": 8000,
        "existing_text_padding_id": 3,
        "num_heads": 16,
        "num_layers": 16,
        "hidden_scale": 4.125,
        "causal": True,
        "layer_scale": None,
        "context": 500,
        "max_period": 10000,
        "gating": "silu",
        "norm": "rms_norm_f32",
        "positional_embedding": "rope",
        "depformer_dim": 1024,
        "depformer_num_heads": 16,
        "depformer_num_layers": 4,
        "depformer_dim_feedforward": 3072,
        "depformer_multi_linear": True,
        "depformer_pos_emb": "none",
        "depformer_weights_per_step": True,
        "depformer_low_rank_embeddings": 128,
        "demux_second_stream": True,
        "cross_attention": True,
        "conditioners": {
            "speaker_wavs": {"type": "tensor", "tensor": {"dim": 512}},
            "cfg": {
                "type": "lut",
                "lut": {
                    "n_bins": 7,
                    "dim": 16,
                    "tokenizer": "noop",
                    "possible_values": [f"{x / 2:.1f}" for x in range(2, 9)],
                },
            },
            "control": {
                "type": "lut",
                "lut": {"n_bins": 1, "dim": 2048, "tokenizer": "noop", "possible_values": ["ok"]},
            },
        },
        "fuser": {
            "cross_attention_pos_emb": True,
            "cross_attention_pos_emb_scale": 1,
            "sum": ["control", "cfg"],
            "prepend": [],
            "cross": ["speaker_wavs"],
        },
        "tts_config": {"audio_delay": 1.28, "second_stream_ahead": 2},
        "depformer_weights_per_step_schedule": list(range(8)) + [8] * 8 + [9] * 8 + [10] * 8,
        "model_type": "tts",
        "model_id": {"sig": "1e68beda", "epoch": 240},
    },
    "hibiki-1b": {
        **loaders._lm_kwargs,
        "dim": 2048,
        "num_heads": 16,
        "num_layers": 16,
        "max_period": 100000,
        "text_card": 48000,
        "delays": [0] + [0, 2, 2, 2, 2, 2, 2, 2] * 2,
        "conditioners": {"description": {"type": "lut", "lut": {"n_bins": 31, "dim": 16}}},
        "fuser": {"sum": ["description"]},
    },
    "hibiki-zero-3b": {
        **loaders._lm_kwargs,
        "dim": 2048,
        "num_heads": 16,
        "num_layers": 28,
        "hidden_scale": 6,
        "max_period": 20000,
        "positional_embedding": "rope_concat",
        "kv_repeat": 2,
        "text_card": 48000,
        "n_q": 32,
        "dep_q": 16,
        "delays": [0] + [0] + [2] * 31,
        "depformer_weights_per_step_schedule": list(range(9)) + [8] * 7,
    },
}
# Accepted: the config it reads as (a PersonaPlex checkpoint's rule comes from the loader). Refused: the key named,
# as the file spells it, and the family.
ACCEPTED = {
    "moshi-7b": MOSHI_7B,
    "moshi-7b-lora": MOSHI_7B,
    "moshi-7b-demux-off": MOSHI_7B,
    "personaplex-7b": MOSHI_7B,
    "personaplex-7b-fork-defaults": dataclasses.replace(PERSONAPLEX_7B, ring_rule="moshi"),
    "stt-1b-en_fr": STT_1B,
    "stt-2.6b-en": STT_2_6B,
    "tts-1.6b-en_fr": TTS_1_6B,
}
REFUSED = {
    "hibiki-1b": ("'conditioners'={'description'", "Hibiki"),
    "hibiki-zero-3b": ("'positional_embedding'='rope_concat'", "Hibiki-Zero"),
}


# What moshi's `CheckpointInfo.from_hf_repo` pops before the LM kwargs reach `get_moshi_lm`.
REFERENCE_POPS = {
    "moshi_name",
    "mimi_name",
    "mimi_config_name",
    "tokenizer_name",
    "lora_name",
    "model_type",
    "lm_gen_config",
    "tts_config",
    "stt_config",
    "model_id",
}


def test_every_published_shape_is_in_the_table():
    assert set(PUBLISHED) == set(ACCEPTED) | set(REFUSED)


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_published_configs_duplexd_runs_are_read_as_the_reference_reads_them(name, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PUBLISHED[name]))
    assert read_lm_config(path) == ACCEPTED[name]
    # The reference takes the same file: its loader pops the file and generation keys, then builds the LM.
    kwargs = {k: v for k, v in PUBLISHED[name].items() if k not in REFERENCE_POPS} or None
    loaders.get_moshi_lm(None, lm_kwargs=kwargs, device="meta")
    assert checkpoint_ring_rule(read_lm_config(path)).ring_rule == ("personaplex" if "fork" in name else "moshi")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_published_configs_of_other_families_are_refused_by_name(name, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PUBLISHED[name]))
    key, family = REFUSED[name]
    with pytest.raises(CheckpointError) as e:
        read_lm_config(path)
    message = str(e.value)
    assert f"config key {key}" in message and f"belongs to {family} models" in message, message
    assert "\n" not in message and "unknown" not in message


def test_the_renamed_demux_key_is_read_under_its_new_name(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**MOSHI_7B.to_reference_json(), "demux_second_stream": True}))
    assert read_lm_config(path).demux_second_text_stream
