"""What one speech-to-text stream tells its client after each model step, as moshi-server's batched ASR does.

Per step, in moshi-server's order: `Step` (only for a model with pause heads: each head's pause probability, and
the audio received but not yet stepped), the `Word` and `EndWord` events of the step's text token (`words`), then
every `Marker` now due. A marker is due once the stream has stepped every whole frame received before it, plus
the ASR delay: moshi-server schedules it `asr_delay_in_tokens` steps after the frames it still buffered, so the
words of all the audio sent before it have come out by then (the client keeps sending audio, silence if need be,
for the stream to step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from . import messages
from .words import WordTimer


class AsrStream:
    """One stream's bookkeeping; `received` and `marker` as the client's messages arrive, `answer` per step."""

    def __init__(self, delay: int, decode: Callable[[Sequence[int]], str], frame_size: int) -> None:
        self.words = WordTimer(delay, decode)
        self.delay, self.frame_size = delay, frame_size
        self.samples = 0  # audio samples received
        self.steps = 0  # steps answered
        self._markers: deque[tuple[int, int]] = deque()  # (steps after which it is due, id), due in order

    def received(self, samples: int) -> None:
        self.samples += samples

    def marker(self, marker_id: int) -> None:
        self._markers.append((self.samples // self.frame_size + self.delay, marker_id))

    def answer(self, frame: int, token: int, pause: Sequence[float] | None) -> list[dict]:
        """The messages of step `frame` (0, 1, ...), whose text token is `token` and pause probabilities `pause`
        (None for a model without pause heads)."""
        self.steps = frame + 1
        out: list[dict] = []
        if pause is not None:
            buffered = max(self.samples - self.steps * self.frame_size, 0)
            out.append(messages.step(frame, pause, buffered))
        out.extend(messages.word_event(event) for event in self.words.step(token))
        while self._markers and self.steps >= self._markers[0][0]:
            out.append(messages.marker(self._markers.popleft()[1]))
        return out
