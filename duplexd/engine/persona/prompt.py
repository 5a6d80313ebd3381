"""PersonaPlex's conversation prompt: the fixed codes and frame counts its sessions open with.

A PersonaPlex conversation opens with forced frames before the user is heard: the voice (the agent's codes of a
voice sample, or a preset's stored input rows), half a second of silence, the role text one token per frame,
and half a second of silence again. The user's stream holds a 440 Hz tone throughout. These constants are the
model's own (fixed Mimi codes of one frame of silence and of the tone); they are never re-encoded at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputRefused
from ..models.config import LMConfig

SILENCE_CODES = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)  # one frame of silence, 8 Mimi codebooks
SINE_CODES = (430, 1268, 381, 1611, 1095, 1495, 56, 472)  # one frame of a 440 Hz tone at half amplitude
SILENCE_FRAMES = 6  # after the voice and after the text (0.5 s each)
TEXT_PAD = 3  # the text stream's value while the voice and silences are forced
REFERENCE_RING = 3  # PersonaPlex's LMGen keeps max_delay + 3 columns; a preset's cache is that wide
TARGET_LUFS = -24.0  # an audio voice is normalised to this loudness before it is encoded
UNGENERATED_TOKEN = -2  # a ring entry not written yet
SYSTEM_TAG = "<system>"  # wraps the role text; plain text to the tokenizer (not a special token)


@dataclass(frozen=True)
class Voice:
    """One voice, ready for a prompt. Exactly one of `codes` (an audio voice) and `embeddings` + `cache` (a preset)
    is set."""

    name: str
    source: Path
    frames: int  # V: the voice phase's frames
    codes: torch.Tensor | None = None  # [V, agent_codebooks] long
    embeddings: torch.Tensor | None = None  # [V - 1, dim]: the input rows of the voice phase's forwards
    cache: torch.Tensor | None = None  # [num_codebooks, max_delay + REFERENCE_RING] long: the ring after it

    @property
    def is_preset(self) -> bool:
        return self.embeddings is not None


def wrap_role_text(text: str) -> str:
    """The role text as PersonaPlex tokenizes it: `<system> text <system>`, unless already so wrapped."""
    text = text.strip()
    if text.startswith(SYSTEM_TAG) and text.endswith(SYSTEM_TAG):
        return text
    return f"{SYSTEM_TAG} {text} {SYSTEM_TAG}"


def prompt_calls(voice_frames: int, text_tokens: int) -> int:
    """P: the forced frames of a prompt (the model runs P - 1 forwards over them: the first frame has none)."""
    return voice_frames + 2 * SILENCE_FRAMES + text_tokens


@dataclass(frozen=True)
class PersonaPrompt:
    """A session's prompt as the model reads it: the input of each of its P - 1 forwards, and the ring it leaves.

    Row j is what the reference feeds its forward j (its call j + 1): the first `len(embeddings)` rows are a
    preset's stored input embeddings, the rest token columns (text, 8 agent, 8 user codes). `tail` holds ring
    columns P - 1 (the live phase's first input) and P, where only the delayed streams are written yet (UNGENERATED
    elsewhere); the agent's delayed codebooks there are forced (SILENCE), so the first live output is padding and
    silence, as the reference's.
    """

    embeddings: torch.Tensor | None  # [E, dim]: rows 0..E-1 (a preset), else None
    columns: torch.Tensor  # [P - 1 - E, num_codebooks] long: rows E..P-2
    tail: torch.Tensor  # [2, num_codebooks] long: ring columns P - 1 and P

    @property
    def calls(self) -> int:
        """P: the prompt's frames."""
        return self.forwards + 1

    @property
    def forwards(self) -> int:
        return (0 if self.embeddings is None else len(self.embeddings)) + len(self.columns)


@dataclass(frozen=True)
class PromptChunk:
    """What one prefill does for one session: forwards `start`..`stop - 1` of `slot`'s persona prompt (row j
    reads at position j)."""

    slot: int
    prompt: PersonaPrompt
    start: int
    stop: int


def build_prompt(cfg: LMConfig, voice: Voice, text_tokens: Sequence[int]) -> PersonaPrompt:
    """The forced frames of a PersonaPlex session, laid out as the reference's ring lays them out.

    Frame f forces text, agent and user codes; stream k of frame f lands in column f + delay[k], and a column
    c <= delay[k] holds stream k's initial token. The forward reading column c runs at position c. A preset
    stands for its voice phase: its embeddings are rows 0..V-2 and its ring gives columns V-1 and V.
    """
    if not cfg.predicts_user_audio:
        raise ValueError("a persona prompt needs a PersonaPlex model (dep_q = n_q)")
    if not text_tokens:
        raise ValueError("the role text is empty")
    agent, k_all = cfg.agent_codebooks, cfg.num_codebooks
    v = voice.frames
    calls = prompt_calls(v, len(text_tokens))
    silence, sine = list(SILENCE_CODES[:agent]), list(SINE_CODES[: cfg.num_user_codebooks])
    # Frame f's forced values per stream (None: a preset's voice frame, whose codes are not known).
    frames: list[list[int] | None] = []
    for f in range(calls):
        if f < v:
            codes = None if voice.codes is None else [int(c) for c in voice.codes[f]]
            frames.append(None if codes is None else [TEXT_PAD, *codes, *sine])
        elif v + SILENCE_FRAMES <= f < v + SILENCE_FRAMES + len(text_tokens):
            frames.append([int(text_tokens[f - v - SILENCE_FRAMES]), *silence, *sine])
        else:
            frames.append([TEXT_PAD, *silence, *sine])
    initial = [cfg.text_initial_token_id] + [cfg.initial_token_id] * cfg.n_q
    width = cfg.max_delay + REFERENCE_RING
    grid = torch.full((calls + 1, k_all), UNGENERATED_TOKEN, dtype=torch.long)
    for c in range(calls + 1):
        for k, delay in enumerate(cfg.delays):
            f = c - delay
            if c <= delay:
                grid[c, k] = initial[k]
            elif f < calls and (row := frames[f]) is not None:
                grid[c, k] = row[k]
            elif f < calls and voice.cache is not None and c >= v - 1:  # written during the preset's voice phase
                grid[c, k] = int(voice.cache[k, c % width])
    embeddings = None
    first = 0
    if voice.embeddings is not None:
        embeddings, first = voice.embeddings, v - 1
    return PersonaPrompt(embeddings, grid[first : calls - 1].clone(), grid[calls - 1 :].clone())


def check_persona_model(cfg: LMConfig) -> None:
    """`InputRefused` (option `text_prompt`) unless the model takes a persona prompt (PersonaPlex)."""
    if not cfg.predicts_user_audio:
        raise InputRefused(
            "needs a PersonaPlex model (one predicting the user's audio too); this model takes no prompt", "text_prompt"
        )


def role_prompt(cfg: LMConfig, voice: Voice, text: str, encode: Callable[[str], list[int]]) -> PersonaPrompt:
    """The prompt of a role text in `voice`, or `InputRefused` (option `text_prompt`) saying why it cannot be run:
    the model is not PersonaPlex, the text is empty, or the prompt would not fit the model's window (the live
    frames need room after it). Every front end (`duplexd infer`, the server's protocols) refuses the same way;
    each message reads after the name of the parameter that carried the text."""
    check_persona_model(cfg)
    if not text.strip():
        raise InputRefused("is empty", "text_prompt")
    tokens = encode(wrap_role_text(text))
    if max(tokens) >= cfg.text_card:  # a tokenizer larger than the LM's vocabulary: the text could not be embedded
        raise InputRefused(
            f"has text the model cannot read: token {max(tokens)} is beyond its {cfg.text_card} text tokens",
            "text_prompt",
        )
    calls = prompt_calls(voice.frames, len(tokens))
    if calls >= cfg.context:
        raise InputRefused(
            f"makes a prompt of {calls} frames ({voice.frames} of voice {voice.name}, {len(tokens)} text tokens, "
            f"{2 * SILENCE_FRAMES} of silence) but the model's context is {cfg.context} frames: the prompt must be "
            f"at most {cfg.context - 1}",
            "text_prompt",
        )
    return build_prompt(cfg, voice, tokens)
