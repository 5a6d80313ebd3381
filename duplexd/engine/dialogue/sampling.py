"""A session's sampling parameters, checked when they are made (a bad value never reaches a step)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..models.config import ConfigError

# Text tokens a session's repetition penalty can look back over: the size of LMGen's per-slot history.
MAX_REPETITION_CONTEXT = 256


@dataclass(frozen=True)
class SamplingParams:
    """Per-session sampling; reference web-client defaults. Temperature 0 means greedy."""

    text_temperature: float = 0.7
    text_topk: int = 25
    audio_temperature: float = 0.8
    audio_topk: int = 250
    seed: int = field(default=0)
    # Text-only knobs of the Rust server (its web client sends them): 1.0 and 0.0 are off.
    repetition_penalty: float = 1.0
    repetition_penalty_context: int = 64
    pad_mult: float = 0.0

    def __post_init__(self) -> None:
        if self.text_temperature < 0 or self.audio_temperature < 0:
            raise ConfigError("temperatures must be >= 0")
        if self.text_topk < 1 or self.audio_topk < 1:
            raise ConfigError("top-k values must be >= 1")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ConfigError("repetition_penalty must be a finite number > 0")
        if not 0 <= self.repetition_penalty_context <= MAX_REPETITION_CONTEXT:
            raise ConfigError(f"repetition_penalty_context must be in 0..{MAX_REPETITION_CONTEXT}")
        if not math.isfinite(self.pad_mult):
            raise ConfigError("pad_mult must be a finite number")
