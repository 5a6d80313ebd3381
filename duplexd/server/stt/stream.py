"""What one speech-to-text stream tells its client after each model step, as moshi-server's batched ASR does.

Per step, in moshi-server's order: `Step` (only for a model with pause heads: each head's pause probability, and
the audio received but not yet stepped), the `Word` and `EndWord` events of the step's text token (`words`), then
every `Marker` now due. A marker is due once the stream has stepped every whole frame received before it, plus
the ASR delay: moshi-server schedules it `asr_delay_in_tokens` steps after the frames it still buffered, so the
words of all the audio sent before it have come out by then (the client keeps sending audio, silence if need be,
for the stream to step).

`step` gives a step as plain data (`AsrStep`), which each protocol that serves these streams words its own way
(moshi-server's messages: `moshi_server.asr_messages.step_messages`; Realtime transcription sessions).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from duplexd.engine.stt.words import WordEvent, WordTimer
from duplexd.wire import FRAME_RATE


@dataclass(frozen=True)
class AsrStep:
    """One step of a stream: its index, word events, pause probabilities (None without pause heads), audio
    received and not yet stepped, the markers now due, `now`: the stream's clock on the words' timeline (the delay
    taken off: every word that ended before it has come out), and `gathering`: the start of a word not yet out."""

    index: int
    words: list[WordEvent]
    pause: Sequence[float] | None
    buffered: int
    markers: list[int]
    now: float
    gathering: float | None


class AsrStream:
    """One stream's bookkeeping; `received` and `marker` as the client's messages arrive, `step` per model step."""

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

    def step(self, frame: int, token: int, pause: Sequence[float] | None) -> AsrStep:
        """Step `frame` (0, 1, ...), whose text token is `token` and pause probabilities `pause`."""
        self.steps = frame + 1
        words = self.words.step(token)
        due = []
        while self._markers and self.steps >= self._markers[0][0]:
            due.append(self._markers.popleft()[1])
        buffered = max(self.samples - self.steps * self.frame_size, 0)
        now = max(self.steps - self.delay, 0) / FRAME_RATE
        return AsrStep(frame, words, pause, buffered, due, now, self.words.gathering)
