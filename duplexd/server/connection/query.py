"""Session settings from a connection's query string, with the Rust server's parameter names (and duplexd's own
`transcribe` / `transcribe_language`)."""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Mapping
from typing import Any

from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.models.config import ConfigError
from duplexd.engine.transcription.transcriber import DEFAULT_PROMPT, instruction

FLOATS = ("text_temperature", "audio_temperature", "repetition_penalty", "pad_mult")
INTS = ("text_topk", "audio_topk", "repetition_penalty_context")
SEEDS = ("seed", "audio_seed", "text_seed")  # the engine has one seed per session: the first one given wins
YES, NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
MAX_LANGUAGE = 40  # characters: a language's name, not a prompt
LANGUAGE = re.compile(r"[^\W\d_]+(?:[ '-][^\W\d_]+)*")  # letters, words joined by a space, hyphen or apostrophe


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


def transcription_from_query(query: Mapping[str, str]) -> str | None:
    """The prompt to transcribe this session's user with, or None when not asked for: `transcribe=1` (also
    true/yes/on; 0/false/no/off is off), and optionally `transcribe_language=NAME` (e.g. `French`) to name the
    language instead of letting the model find it. Raises `BadQuery` naming the bad parameter."""
    on = _flag("transcribe", query["transcribe"]) if "transcribe" in query else False
    language = query.get("transcribe_language")
    if language is None:
        return DEFAULT_PROMPT if on else None
    if not on:
        raise BadQuery("query parameter transcribe_language needs transcribe=1")
    language = language.strip()
    if len(language) > MAX_LANGUAGE or not LANGUAGE.fullmatch(language):
        raise BadQuery(
            f"query parameter transcribe_language={language[:MAX_LANGUAGE]!r} is not a language name "
            f"(letters, at most {MAX_LANGUAGE})"
        )
    return instruction(language)


def _flag(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value not in YES + NO:
        raise BadQuery(f"query parameter {name}={text!r} is not a boolean (1 or 0)")
    return value in YES


def _number(name: str, text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise BadQuery(f"query parameter {name}={text!r} is not a valid {kind.__name__}") from None
    if kind is float and value != value:  # NaN
        raise BadQuery(f"query parameter {name} must be a number")
    return value
