"""PersonaPlex's conversation prompt: the fixed codes and frame counts its sessions open with.

A PersonaPlex conversation opens with forced frames before the user is heard: the voice (the agent's codes of a
voice sample, or a preset's stored input rows), half a second of silence, the role text one token per frame,
and half a second of silence again. The user's stream holds a 440 Hz tone throughout. These constants are the
model's own (fixed Mimi codes of one frame of silence and of the tone); they are never re-encoded at run time.
"""

from __future__ import annotations

SILENCE_CODES = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)  # one frame of silence, 8 Mimi codebooks
SINE_CODES = (430, 1268, 381, 1611, 1095, 1495, 56, 472)  # one frame of a 440 Hz tone at half amplitude
SILENCE_FRAMES = 6  # after the voice and after the text (0.5 s each)
TEXT_PAD = 3  # the text stream's value while the voice and silences are forced
REFERENCE_RING = 3  # PersonaPlex's LMGen keeps max_delay + 3 columns; a preset's cache is that wide
TARGET_LUFS = -24.0  # an audio voice is normalised to this loudness before it is encoded
SYSTEM_TAG = "<system>"  # wraps the role text; plain text to the tokenizer (not a special token)


def wrap_role_text(text: str) -> str:
    """The role text as PersonaPlex tokenizes it: `<system> text <system>`, unless already so wrapped."""
    text = text.strip()
    if text.startswith(SYSTEM_TAG) and text.endswith(SYSTEM_TAG):
        return text
    return f"{SYSTEM_TAG} {text} {SYSTEM_TAG}"


def prompt_calls(voice_frames: int, text_tokens: int) -> int:
    """P: the forced frames of a prompt (the model runs P - 1 forwards over them: the first frame has none)."""
    return voice_frames + 2 * SILENCE_FRAMES + text_tokens
