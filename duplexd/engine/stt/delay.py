"""How many steps moshi-server lets a speech-to-text model's text lag its audio (`asr_delay_in_tokens`).

Kyutai's configs state the lag in seconds (`stt_config.audio_delay_seconds`) for the Python reference and in
steps for moshi-server, and the two do not follow one rounding: 0.5 s is 6 steps (stt-1b-en_fr), 2.5 s is 32
(stt-2.6b-en). Those are taken as Kyutai gives them; any other lag rounds to the nearest step.
"""

from __future__ import annotations

from duplexd.wire import FRAME_RATE

KYUTAI_DELAYS = {0.5: 6, 2.5: 32}  # audio_delay_seconds -> asr_delay_in_tokens, from moshi-server's configs


def delay_tokens(audio_delay_seconds: float) -> int:
    return KYUTAI_DELAYS.get(audio_delay_seconds, round(audio_delay_seconds * FRAME_RATE))
