"""A reference `config.json` read as `moshi` reads it: what moshi drops or renames is dropped or renamed here,
what duplexd implements becomes an `LMConfig`, and what would build another model is refused in one line that
names the key, its value and the model family that uses it.

moshi's `CheckpointInfo.from_hf_repo` pops the keys that name files and generation defaults, then
`get_moshi_lm` drops `depformer_causal` (deprecated; published configs and older releases' defaults hold it),
renames `demux_second_stream` to `demux_second_text_stream` and pops the LoRA keys; everything else goes to
`LMModel`, which refuses a key it does not know.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..models.config import REFERENCE_FIXED, ConfigError, LMConfig

# Accepted with these values (the reference defaults); anything else builds a model duplexd does not run.
REFERENCE_DEFAULTS: dict[str, Any] = {
    "kv_repeat": 1,
    "norm_emb": False,
    "bias_proj": False,
    "depformer_norm": None,
    "depformer_weights_per_step_schedule": None,
    "depformer_low_rank_embeddings": None,
    "demux_second_text_stream": False,
    "extra_heads_num_heads": 0,
    "cross_attention": False,
    "conditioners": None,
    "fuser": None,
    "lora": False,
    "text_card_out": None,
}
# Dropped as the reference drops them: files, generation defaults and metadata (`from_hf_repo`), `depformer_causal`
# and the LoRA sizes (`get_moshi_lm`), `depformer_context` (the reference overrides it with None), the extra heads'
# width when there are none, and training-only switches. `quantize` (Kyutai's q8 files say true) is read from the
# weights themselves: the loader finds their int8 codes and `_scb` scales.
IGNORED = frozenset(
    {
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
        "depformer_causal",
        "lora_rank",
        "lora_scaling",
        "depformer_context",
        "depformer_kv_repeat",
        "extra_heads_dim",
        "gradient_checkpointing",
        "quantize",
    }
)
RENAMED = {"demux_second_stream": "demux_second_text_stream"}

# The family of published checkpoints that a non-default value of a key belongs to.
_FAMILY_OF_KEY = {
    "extra_heads_num_heads": "Kyutai STT",
    "demux_second_text_stream": "Kyutai TTS",
    "cross_attention": "Kyutai TTS",
    "depformer_low_rank_embeddings": "Kyutai TTS",
    "depformer_weights_per_step_schedule": "Kyutai TTS or Hibiki",
    "conditioners": "Kyutai TTS or Hibiki",
    "fuser": "Kyutai TTS or Hibiki",
    "kv_repeat": "Hibiki-Zero",
    "positional_embedding": "Hibiki-Zero",
    "lora": "LoRA fine-tunes (fuse the adapter into the weights first)",
}
_FAMILY_OF_TYPE = {"stt": "Kyutai STT", "tts": "Kyutai TTS"}


def model_family(raw: dict[str, Any], key: str) -> str:
    """The family a config's `key` points to: its own `model_type` (or `stt_config`/`tts_config`) when it states
    one, else what its conditioners condition on, else the key's own family ("" when none is known)."""
    for name, family in _FAMILY_OF_TYPE.items():
        if raw.get("model_type") == name or f"{name}_config" in raw:
            return family
    conditioners = raw.get("conditioners")
    if isinstance(conditioners, dict) and key in ("conditioners", "fuser", "depformer_weights_per_step_schedule"):
        if "speaker_wavs" in conditioners:
            return "Kyutai TTS"
        if "description" in conditioners:
            return "Hibiki"
    if key == "dep_q":
        return "Kyutai STT"
    return _FAMILY_OF_KEY.get(key, "")


def _refuse(raw: dict[str, Any], written: str, key: str, value: Any, implemented: Any) -> ConfigError:
    """The refusal of `key` (spelt `written` in the file) = `value`."""
    shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
    family = model_family(raw, key)
    if not family:
        return ConfigError(f"config key {written!r}={shown} is not supported (duplexd implements {implemented!r})")
    return ConfigError(
        f"config key {written!r}={shown} belongs to {family} models, which duplexd does not run (it implements "
        f"{written}={implemented!r}: Moshi and PersonaPlex)"
    )


def lm_config_from_dict(raw: dict[str, Any]) -> LMConfig:
    """An `LMConfig` from the reference's LM kwargs (a parsed `config.json`); `ConfigError` naming the key as the
    file spells it."""
    named = {RENAMED.get(k, k): k for k in raw}  # the reference's name -> the file's
    raw = {RENAMED.get(k, k): v for k, v in raw.items()}
    fields = {f.name for f in dataclasses.fields(LMConfig)} - {"ring_rule"}  # ring_rule is not a reference key
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key in fields:
            kwargs[key] = value
        elif key in REFERENCE_FIXED or key in REFERENCE_DEFAULTS:
            allowed = REFERENCE_FIXED.get(key, REFERENCE_DEFAULTS.get(key))
            if value != allowed and not (key == "text_card_out" and value == raw.get("text_card")):
                raise _refuse(raw, named[key], key, value, allowed)
        elif key not in IGNORED:
            raise ConfigError(f"unknown LM config key {key!r} (the reference `moshi` does not take it either)")
    if kwargs.get("dep_q") == 0:
        raise _refuse(raw, "dep_q", "dep_q", 0, "1..n_q, a DepFormer that speaks")
    if "depformer_dim_feedforward" not in kwargs and "depformer_dim" in kwargs:
        kwargs["depformer_dim_feedforward"] = int(kwargs.get("hidden_scale", 4.125) * kwargs["depformer_dim"])
    try:
        return LMConfig(**kwargs)
    except TypeError as e:
        raise ConfigError(str(e)) from None
