"""A Kyutai TTS `config.json` beyond its LM kwargs: the conditioning (`conditioners`, `fuser`), the text/audio
timing (`tts_config`), the voice files' suffix (`model_id`) and the generation defaults (`lm_gen_config`).

Read as moshi 0.2.13 reads them (`loaders.get_conditioner_provider`, `get_condition_fuser`,
`TTSModel.from_checkpoint_info`); anything duplexd cannot run is refused in one line naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..models.config import ConfigError

FRAME_RATE = 12.5  # Mimi frames per second: what the audio delay in seconds is counted in


@dataclass(frozen=True)
class LookupTable:
    """A lookup-table conditioner (`type: "lut"`): a value, one of `values`, picks a row of an [n_bins + 1, dim]
    table (the last row when the value is absent), projected to the model's width."""

    n_bins: int
    dim: int
    values: tuple[str, ...]

    def index(self, value: str | None) -> int:
        if value is None:
            return self.n_bins
        if value not in self.values:
            raise ValueError(f"{value!r} is not one of {', '.join(self.values)}")
        return self.values.index(value)


@dataclass(frozen=True)
class TTSConfig:
    """What a Kyutai TTS model needs beside its LM: conditioners, how they are fused, and its timing."""

    tables: dict[str, LookupTable]  # summed into every step's input (`fuser.sum`, in that order)
    sum: tuple[str, ...]
    speaker_dim: int  # a voice embedding's width (`speaker_wavs`, 512), cross-attended (`fuser.cross`)
    cross_pos_emb: bool
    cross_pos_emb_scale: float
    audio_delay: float  # seconds the audio runs behind the text
    second_stream_ahead: int  # words the lookahead text stream runs ahead of the main one
    voice_suffix: str  # `<voice>` + this names a voice's embedding file (`.<sig>@<epoch>.safetensors`)
    temperature: float = 0.6
    max_speakers: int = 5
    speaker_frames: int = 125  # a voice embedding's length: `max_speakers` of them make the cross source

    @property
    def delay_steps(self) -> int:
        """The audio delay in frames, as moshi's `TTSModel` counts it (`int(audio_delay * frame_rate)`)."""
        return int(self.audio_delay * FRAME_RATE)

    @property
    def cfg_values(self) -> tuple[str, ...]:
        """The CFG coefficients the distilled model takes through its `cfg` table ("1.0" ... "4.0")."""
        table = self.tables.get("cfg")
        return table.values if table else ()


def _table(name: str, spec: dict[str, Any]) -> LookupTable:
    lut = spec.get("lut") or {}
    if lut.get("tokenizer", "noop") != "noop":
        raise ConfigError(f"conditioners.{name}: tokenizer {lut.get('tokenizer')!r} is not supported (noop only)")
    values = lut.get("possible_values")
    if values is None:
        raise ConfigError(f"conditioners.{name}: a table without possible_values (hashed values) is not supported")
    return LookupTable(int(lut["n_bins"]), int(lut["dim"]), tuple(str(v) for v in values))


def tts_config_from_dict(raw: dict[str, Any]) -> TTSConfig | None:
    """The `TTSConfig` of a parsed `config.json`, or None for a model that is not a TTS model."""
    if raw.get("model_type") != "tts" and "tts_config" not in raw:
        return None
    conditioners, fuser = raw.get("conditioners") or {}, raw.get("fuser") or {}
    timing, model_id, gen = raw.get("tts_config") or {}, raw.get("model_id") or {}, raw.get("lm_gen_config") or {}
    try:
        tables, speaker_dim = {}, 0
        for name, spec in conditioners.items():
            kind = spec.get("type")
            if kind == "lut":
                tables[name] = _table(name, spec)
            elif kind == "tensor" and name == "speaker_wavs":
                speaker_dim = int(spec["tensor"]["dim"])
            else:
                raise ConfigError(f"conditioners.{name}: type {kind!r} is not supported (lut, or tensor speaker_wavs)")
        if fuser.get("prepend"):
            raise ConfigError(f"fuser.prepend={fuser['prepend']!r} is not supported (moshi refuses it too)")
        cross = tuple(fuser.get("cross", ()))
        if cross not in ((), ("speaker_wavs",)):
            raise ConfigError(f"fuser.cross={list(cross)!r} is not supported (only speaker_wavs)")
        summed = tuple(fuser.get("sum", ()))
        for name in summed:
            if name not in tables:
                raise ConfigError(f"fuser.sum names {name!r}, which is not a lookup-table conditioner")
        if cross and not speaker_dim:
            raise ConfigError("fuser.cross names speaker_wavs, which conditioners does not define")
        suffix = f".{model_id['sig']}@{model_id['epoch']}.safetensors" if model_id else ".safetensors"
        return TTSConfig(
            tables={name: tables[name] for name in summed},
            sum=summed,
            speaker_dim=speaker_dim,
            cross_pos_emb=bool(fuser.get("cross_attention_pos_emb", False)),
            cross_pos_emb_scale=float(fuser.get("cross_attention_pos_emb_scale", 1.0)),
            audio_delay=float(timing.get("audio_delay", 0.0)),
            second_stream_ahead=int(timing.get("second_stream_ahead", 0)),
            voice_suffix=suffix,
            temperature=float(gen.get("temp", 0.6)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"TTS config (conditioners, fuser, tts_config, model_id): {e!r}") from None
