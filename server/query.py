"""Session settings from a connection's query string, with the Rust server's parameter names."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping
from typing import Any

from duplexd.engine.config import ConfigError, SamplingParams

FLOATS = ("text_temperature", "audio_temperature", "repetition_penalty", "pad_mult")
INTS = ("text_topk", "audio_topk", "repetition_penalty_context")
SEEDS = ("seed", "audio_seed", "text_seed")  # the engine has one seed per session: the first one given wins


class BadQuery(ValueError):
    """A client's query parameter that duplexd cannot use; the message names it (refused with 1007)."""


def new_seed() -> int:
    """A fresh seed, so that two sessions with the same input do not say the same thing."""
    return secrets.randbits(31)


def sampling_from_query(query: Mapping[str, str], base: SamplingParams | None = None) -> SamplingParams:
    """`SamplingParams` from the Rust server's sampling parameters (temperatures, top-k, repetition penalty,
    pad_mult) and a seed; other parameters are ignored. Raises `BadQuery` naming the bad parameter."""
    base = base or SamplingParams(seed=new_seed())
    values: dict[str, Any] = {}
    for name in FLOATS + INTS:
        if name in query:
            values[name] = _number(name, query[name], float if name in FLOATS else int)
    for name in SEEDS:
        if name in query:
            values["seed"] = _number(name, query[name], int) % 2**63
            break
    try:
        return dataclasses.replace(base, **values)
    except ConfigError as e:  # the engine's rules, said to the client in terms of its own parameters
        raise BadQuery(f"bad query parameter: {e}") from None


def max_frames_from_query(query: Mapping[str, str]) -> int | None:
    """The Rust server's `max_steps` (frames of 80 ms), if given."""
    if "max_steps" not in query:
        return None
    steps = int(_number("max_steps", query["max_steps"], int))
    if steps < 1:
        raise BadQuery("max_steps must be >= 1")
    return steps


def _number(name: str, text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise BadQuery(f"query parameter {name}={text!r} is not a valid {kind.__name__}") from None
    if kind is float and value != value:  # NaN
        raise BadQuery(f"query parameter {name} must be a number")
    return value
