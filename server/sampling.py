"""Sampling settings from a query string, with the Rust server's parameter names."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping

from duplexd.engine.config import ConfigError, SamplingParams

FLOATS = ("text_temperature", "audio_temperature")
INTS = ("text_topk", "audio_topk")
SEEDS = ("seed", "audio_seed", "text_seed")  # the engine has one seed per session: the first one given wins


def new_seed() -> int:
    """A fresh seed, so that two sessions with the same input do not say the same thing."""
    return secrets.randbits(31)


def sampling_from_query(query: Mapping[str, str], base: SamplingParams | None = None) -> SamplingParams:
    """`SamplingParams` from `text_temperature`, `text_topk`, `audio_temperature`, `audio_topk` and a seed;
    unknown parameters (e.g. the web client's `pad_mult`, `repetition_penalty`) are ignored. Raises
    `ConfigError` naming the bad parameter."""
    base = base or SamplingParams(seed=new_seed())
    values: dict[str, float | int] = {}
    for name in FLOATS + INTS:
        if name in query:
            values[name] = _number(name, query[name], float if name in FLOATS else int)
    for name in SEEDS:
        if name in query:
            values["seed"] = _number(name, query[name], int) % 2**63
            break
    return dataclasses.replace(base, **values)


def max_frames_from_query(query: Mapping[str, str]) -> int | None:
    """The Rust server's `max_steps` (frames of 80 ms), if given."""
    if "max_steps" not in query:
        return None
    steps = _number("max_steps", query["max_steps"], int)
    if steps < 1:
        raise ConfigError("max_steps must be >= 1")
    return steps


def _number(name: str, text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise ConfigError(f"query parameter {name}={text!r} is not a valid {kind.__name__}") from None
    if kind is float and value != value:  # NaN
        raise ConfigError(f"query parameter {name} must be a number")
    return value
