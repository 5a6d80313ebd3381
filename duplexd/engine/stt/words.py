"""Word timing of a speech-to-text stream: its text tokens, step by step, as moshi-server's Word and EndWord events.

Kyutai's STT writes one text token a step (80 ms): 0 ends a run of padding and so starts a word, 3 is padding,
anything else is a piece of the current word. The text lags the audio by the model's delay, so moshi-server
(`asr.rs`, `State::step_tokens`) ignores a stream's first tokens and subtracts that delay from every time. Its
rules, per stream, with `step` the 1-based count of the stream's steps so far and `delay` the server's
`asr_delay_in_tokens` (6 for stt-1b, 32 for stt-2.6b):

- while `step < delay` the token is ignored;
- padding (3) or a word start (0) completes the pieces gathered so far, if any: `Word(text, start_time)` with the
  time of the last word start, and the word is left open; any other token is gathered;
- a word start (0) also ends the open word, `EndWord((step - delay) / 12.5)`, and that time becomes the next
  word's start.

A word's text is its pieces decoded together (sentencepiece: "▁" is a space, the leading one dropped), as
moshi-server's `decode_piece_ids`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from duplexd.wire import FRAME_RATE

END_OF_PADDING = 0  # the text token that starts a word
PADDING = 3  # the text token of a step without text


@dataclass(frozen=True)
class Word:
    """A word, complete: its text and when it began (seconds of the stream's audio)."""

    text: str
    start_time: float


@dataclass(frozen=True)
class EndWord:
    """The open word ended at `stop_time` (seconds of the stream's audio)."""

    stop_time: float


WordEvent = Word | EndWord


class WordTimer:
    """One stream's word timing: `step(token)` per model step, in order; returns the events that step makes."""

    def __init__(self, delay: int, decode: Callable[[Sequence[int]], str]) -> None:
        if delay < 0:
            raise ValueError(f"the ASR delay must be >= 0 tokens, not {delay}")
        self.delay, self.decode = delay, decode
        self.steps = 0  # steps seen, the ignored ones included
        self._pieces: list[int] = []
        self._open = False  # a word was sent and its EndWord not yet
        self._last_start = 0.0
        self._started = False  # a word start (0) came and its word is not out yet

    @property
    def gathering(self) -> float | None:
        """The start time of the word begun and not yet out (its start token came, or its pieces are being
        gathered), None between words."""
        return self._last_start if self._pieces or self._started else None

    def step(self, token: int) -> list[WordEvent]:
        self.steps += 1
        if self.steps < self.delay:
            return []
        events: list[WordEvent] = []
        if token in (PADDING, END_OF_PADDING):
            if self._pieces:
                events.append(Word(self.decode(self._pieces), self._last_start))
                self._pieces = []
                self._open = True
                self._started = False
        else:
            self._pieces.append(token)
        if token == END_OF_PADDING:
            stop = (self.steps - self.delay) / FRAME_RATE
            if self._open:
                events.append(EndWord(stop))
                self._open = False
            self._last_start = stop
            self._started = True
        return events
