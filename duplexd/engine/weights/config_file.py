"""A reference `config.json` read as `moshi` reads it: what moshi drops or renames is dropped or renamed here,
what duplexd implements becomes an `LMConfig`, and what would build another model is refused in one line that
names the key, its value and the model family that uses it. A Kyutai STT config (`model_type` "stt", dep_q 0) is an
`LMConfig` too; what its server needs beside the LM (the text's lag, the leading silence, greedy decoding) is read
by `stt_settings_from_dict`.

moshi's `CheckpointInfo.from_hf_repo` pops the keys that name files and generation defaults, then
`get_moshi_lm` drops `depformer_causal` (deprecated; published configs and older releases' defaults hold it),
renames `demux_second_stream` to `demux_second_text_stream` and pops the LoRA keys; everything else goes to
`LMModel`, which refuses a key it does not know.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..models.config import REFERENCE_FIXED, ConfigError, LMConfig

# Accepted with these values (the reference defaults); anything else builds a model duplexd does not run.
REFERENCE_DEFAULTS: dict[str, Any] = {
    "kv_repeat": 1,
    "norm_emb": False,
    "bias_proj": False,
    "depformer_norm": None,
    "conditioners": None,
    "fuser": None,
    "lora": False,
    "text_card_out": None,
}
# Dropped as the reference drops them: files, generation defaults and metadata (`from_hf_repo`), `depformer_causal`
# and the LoRA sizes (`get_moshi_lm`), `depformer_context` (the reference overrides it with None), and
# training-only switches. `quantize` (Kyutai's q8 files say true) is read from the
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
        "gradient_checkpointing",
        "quantize",
    }
)
RENAMED = {"demux_second_stream": "demux_second_text_stream"}

# The family of published checkpoints that a non-default value of a key belongs to.
_FAMILY_OF_KEY = {
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
_FAMILY_OF_TYPE = {"tts": "Kyutai TTS"}


def model_family(raw: dict[str, Any], key: str) -> str:
    """The family a config's `key` points to: its own `model_type` (or `tts_config`) when it states
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
    return _FAMILY_OF_KEY.get(key, "")


def _refuse(raw: dict[str, Any], written: str, key: str, value: Any, implemented: Any) -> ConfigError:
    """The refusal of `key` (spelt `written` in the file) = `value`."""
    shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
    family = model_family(raw, key)
    if not family:
        return ConfigError(f"config key {written!r}={shown} is not supported (duplexd implements {implemented!r})")
    return ConfigError(
        f"config key {written!r}={shown} belongs to {family} models, which duplexd does not run (it implements "
        f"{written}={implemented!r}: Moshi, PersonaPlex and Kyutai STT)"
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
        elif key in ("conditioners", "fuser") and model_family(raw, key) == "Kyutai TTS":
            continue  # the TTS model's conditioning, read by `engine.tts.config`
        elif key in REFERENCE_FIXED or key in REFERENCE_DEFAULTS:
            allowed = REFERENCE_FIXED.get(key, REFERENCE_DEFAULTS.get(key))
            if value != allowed and not (key == "text_card_out" and value == raw.get("text_card")):
                raise _refuse(raw, named[key], key, value, allowed)
        elif key not in IGNORED:
            raise ConfigError(f"unknown LM config key {key!r} (the reference `moshi` does not take it either)")
    if "depformer_dim_feedforward" not in kwargs and "depformer_dim" in kwargs:
        kwargs["depformer_dim_feedforward"] = int(kwargs.get("hidden_scale", 4.125) * kwargs["depformer_dim"])
    try:
        return LMConfig(**kwargs)
    except TypeError as e:
        raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class SttSettings:
    """A Kyutai STT config's serving settings beside the LM kwargs (`stt_config`, `lm_gen_config`).

    The text lags the audio by `audio_delay_seconds` (0.5 s for the 1B, 2.5 s for the 2.6B: a word's timestamp is
    its step's time less this); the 2.6B wants `audio_silence_prefix_seconds` of silence before the first audio.
    """

    audio_delay_seconds: float = 0.0
    audio_silence_prefix_seconds: float = 0.0
    text_temperature: float = 0.0
    text_topk: int = 50


def stt_settings_from_dict(raw: dict[str, Any]) -> SttSettings | None:
    """The `SttSettings` of a parsed `config.json`, or None for a config that is not an STT model's."""
    if raw.get("model_type") != "stt" and "stt_config" not in raw:
        return None
    stt, gen = raw.get("stt_config") or {}, raw.get("lm_gen_config") or {}
    if not isinstance(stt, dict) or not isinstance(gen, dict):
        raise ConfigError("stt_config and lm_gen_config must be JSON objects")
    default = SttSettings()
    try:
        return SttSettings(
            float(stt.get("audio_delay_seconds", default.audio_delay_seconds)),
            float(stt.get("audio_silence_prefix_seconds", default.audio_silence_prefix_seconds)),
            float(gen.get("temp_text", default.text_temperature)),
            int(gen.get("top_k_text", default.text_topk)),
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"stt_config or lm_gen_config: {e}") from None
