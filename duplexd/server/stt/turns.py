"""A speech-to-text stream cut into utterances, for clients that want turns (Realtime transcription sessions).

Words stream as they come (`TranscriptDelta`, one per word, a space before all but an utterance's first); an
utterance ends, and its whole text is given (`TranscriptDone`), in one of two ways:

- turn detection (OpenAI's `server_vad` / `semantic_vad`): after a word, the user pauses. With the model's pause
  heads (stt-1b: the probability of a pause of 0.5, 1, 2 and 3 s), the head whose horizon is nearest the wanted
  silence says so above `threshold`; without them, no word has come for `silence_s` of the stream's audio. The
  utterance is announced by `SpeechBegan` at its first word (back-dated by `prefix_s`) and ends by `SpeechEnded`
  at its last word's end, then its text.
- a commit (`input_audio_buffer.commit`, the only way without turn detection): the audio received so far is one
  utterance. It is complete once the stream's clock (which runs the ASR delay behind the audio) has passed the
  commit's time and no word that began before it is still coming out; a word that starts after the commit's time
  belongs to the next utterance. `clear` drops the open utterance and the words still to come of its audio.

Times are seconds of the stream's audio, as the words'.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from duplexd.engine.stt.words import Word
from duplexd.engine.transcription.service import (
    SpeechBegan,
    SpeechEnded,
    TranscriptDelta,
    TranscriptDone,
    TranscriptEvent,
)

from .stream import AsrStep

PAUSE_HORIZONS = (0.5, 1.0, 2.0, 3.0)  # seconds of pause predicted by each of Kyutai's pause heads, in order


@dataclass(frozen=True)
class TurnDetection:
    silence_s: float = 0.5
    threshold: float = 0.5  # of the pause head's probability
    prefix_s: float = 0.3

    def head(self, heads: int) -> int:
        """The pause head whose horizon is nearest `silence_s`, among the model's `heads`."""
        horizons = PAUSE_HORIZONS[:heads]
        return min(range(len(horizons)), key=lambda i: abs(horizons[i] - self.silence_s))


@dataclass
class Utterance:
    words: list[str] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float = 0.0  # of its last word so far


class Turns:
    """One stream's utterances: `step` per model step, `commit` when the client commits; both return the events."""

    def __init__(self, detection: TurnDetection | None) -> None:
        self.detection = detection  # None: utterances end only by a commit
        self._numbers = itertools.count()
        self._open: int | None = None  # the utterance words go to, once past every pending commit
        # (commit time, clock by which it completes even with a word still coming out, utterance), in order
        self._committed: list[tuple[float, float, int]] = []
        self._utterances: dict[int, Utterance] = {}
        self._cleared_s = 0.0  # words that start before this were cleared (and not committed) are dropped

    def commit(self, at_s: float, deadline_s: float = float("inf")) -> int:
        """The audio up to `at_s` is one utterance: the open one, or a new empty one. Returns its number. It is
        complete by the clock `deadline_s` even if a word that began before `at_s` is still coming out then (that
        word goes to the next one)."""
        number = self._open if self._open is not None else self._new(at_s)
        self._open = None
        self._committed.append((at_s, deadline_s, number))
        return number

    def clear(self, at_s: float) -> None:
        """The audio up to `at_s` not committed is dropped: the open utterance ends without a text, and the words
        still to come from that audio are not given."""
        if self._open is not None:
            del self._utterances[self._open]
            self._open = None
        self._cleared_s = at_s

    def step(self, step: AsrStep) -> list[TranscriptEvent]:
        events: list[TranscriptEvent] = []
        for word in step.words:
            if not isinstance(word, Word):
                continue  # an utterance's end is the end of its last word's text, not the next word's start
            events += self._complete(word.start_time, None)
            events += self._add(word, step.now)
        # the clock has passed a commit once every word that began before it is out, or by its deadline
        events += self._complete(step.now, step.gathering)
        if self._open is not None and step.gathering is None and self._pause(step, self._utterances[self._open]):
            number, self._open = self._open, None
            utterance = self._utterances.pop(number)
            events.append(SpeechEnded(number, utterance.end_s))
            events.append(self._done(number, utterance))
        return events

    def _new(self, start_s: float) -> int:
        number = next(self._numbers)
        self._utterances[number] = Utterance(start_s=start_s, end_s=start_s)
        return number

    def _add(self, word: Word, now: float) -> list[TranscriptEvent]:
        """`word` joins its utterance (a committed one it began before the commit of, else the open one)."""
        events: list[TranscriptEvent] = []
        number = next((n for at, _, n in self._committed if word.start_time < at), self._open)
        if number is None and word.start_time < self._cleared_s:
            return events
        if number is None:
            number = self._open = self._new(word.start_time)
            if self.detection is not None:
                events.append(SpeechBegan(number, max(word.start_time - self.detection.prefix_s, 0.0)))
        utterance = self._utterances[number]
        if not utterance.words:
            utterance.start_s = word.start_time
        events.append(TranscriptDelta(number, f" {word.text}" if utterance.words else word.text))
        utterance.words.append(word.text)
        utterance.end_s = now  # a word comes out as its text ends
        return events

    def _complete(self, now: float, gathering: float | None) -> list[TranscriptEvent]:
        """The committed utterances whose commit time the clock `now` has passed, unless a word that began
        before it (at `gathering`) is not out yet and the deadline is still to come."""
        events: list[TranscriptEvent] = []
        while self._committed:
            at, deadline, number = self._committed[0]
            if at > now or (gathering is not None and gathering < at and now < deadline):
                break  # a word that starts at the commit's time is the next utterance's
            self._committed.pop(0)
            events.append(self._done(number, self._utterances.pop(number)))
        return events

    def _pause(self, step: AsrStep, utterance: Utterance) -> bool:
        detection = self.detection
        if detection is None:
            return False
        if step.pause is not None and len(step.pause) > 0:
            return step.pause[detection.head(len(step.pause))] > detection.threshold
        return step.now - utterance.end_s >= detection.silence_s

    @staticmethod
    def _done(number: int, utterance: Utterance) -> TranscriptDone:
        return TranscriptDone(number, " ".join(utterance.words), (), utterance.start_s, utterance.end_s)
