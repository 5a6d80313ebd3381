"""Text to the words a Kyutai TTS model is fed, and the per-session machine that feeds them.

The model only says when the next word should start: at each step it samples the text token NEW_WORD or PAD.
`WordFeeder.next_token` turns that sample into the token the model actually reads (before the DepFormer uses
it): the next word's tokens one per step, padding while a word's forced pause lasts, a new word when the model
has padded `max_padding` steps in a row, and the word `second_stream_ahead` words later in a second, muxed text
stream (`(second + 1) * card + main`). These are the rules of moshi 0.2.13's `StateMachine` and
`script_to_entries`, which the tests hold this module to.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

NEW_WORD, MAIN, OTHER, PAD, ZERO = 0, 1, 2, 3, -1
BREAK_OR_SPACE = re.compile(r"(?:<break\s+time=\"([0-9]+(?:.[0-9]*)?)s\"\s*/?>)|(?:\s+)")
STREAM_BREAK = re.compile(r"<break\s+time=\"([0-9.]+)s\"\s*/>")  # moshi-server's (the `/` required)
MAX_BREAK_SECONDS = 10.0


@dataclass(frozen=True)
class Word:
    """One word to say: its tokens and text, and the steps of padding forced after it starts. No tokens: a pause
    (`<break time="Xs"/>`) of `padding` steps."""

    tokens: tuple[int, ...]
    text: str
    padding: int = 0


def script_words(
    turns: Sequence[str],
    encode: Callable[[str], list[int]],
    frame_rate: float = 12.5,
    multi_speaker: bool = True,
    padding_between: int = 1,
) -> list[Word]:
    """The words of a script (one string per speaker turn, the main speaker first), tokenized by `encode`.

    ’ becomes ', ':' a space, parentheses go; `<break time="Xs"/>` is a pause of X seconds; a turn's first word
    starts with its speaker's token (MAIN, OTHER) for a multi-speaker model; `padding_between` forces that many
    padding steps after a word, plus one per token beyond its first.
    """
    words: list[Word] = []
    last_speaker: int | None = None
    for turn, line in enumerate(turns):
        first = True
        line = line.replace("’", "'").replace(":", " ").replace("(", "").replace(")", "")

        def add(text: str, turn: int = turn) -> None:
            nonlocal first, last_speaker
            tokens = list(encode(text))
            if first:
                speaker = turn % 2
                if multi_speaker and last_speaker != speaker:
                    last_speaker = speaker
                    tokens.insert(0, (MAIN, OTHER)[speaker])
                first = False
            words.append(Word(tuple(tokens), text, padding_after(tokens, padding_between)))

        while line:
            match = BREAK_OR_SPACE.search(line)
            if match is None:
                break
            text, line = line[: match.start()], line[match.end() :]
            if text:
                add(text)
            if match.group(1):
                words.append(Word((), "", int(round(float(match.group(1)) * frame_rate))))
        if line:
            add(line)
    return words


def padding_after(tokens: Sequence[int], padding_between: int) -> int:
    """The padding steps forced after a word starts: `padding_between`, plus one per token beyond its first."""
    return max(0, padding_between + len(tokens) - 1) if padding_between > 0 else 0


@dataclass
class StreamWords:
    """A stream's text messages split into words as moshi-server splits them (its `tts_preprocess` and worker).

    Each message: `<break time="Xs"/>` is a pause of X seconds (10 at most, one step at least) named by its tag;
    the rest normalised (’ to ', – dropped, ':' a space, parentheses dropped) and split at whitespace, each word
    tokenized alone; the stream's first word starts with `bos` (the main speaker's token). Unlike a script
    (`script_words`), words are cut only by the messages: a word split across two messages is two words."""

    encode: Callable[[str], list[int]]
    bos: int = MAIN
    padding_between: int = 1
    frame_rate: float = 12.5
    started: bool = False

    def split(self, text: str) -> list[Word]:
        words: list[Word] = []
        at = 0
        for match in STREAM_BREAK.finditer(text):
            words.extend(self._words(text[at : match.start()]))
            try:
                seconds = float(match.group(1))
            except ValueError:  # "1.2.3": not a number, so no pause (the tag is dropped)
                seconds = 0.0
            if seconds > 0:
                steps = max(int(min(seconds, MAX_BREAK_SECONDS) * self.frame_rate), 1)
                words.append(Word((), f'<break time="{seconds:.2f}s">', steps))
            at = match.end()
        words.extend(self._words(text[at:]))
        return words

    def _words(self, text: str) -> list[Word]:
        text = text.replace("’", "'").replace("–", "").replace(":", " ").replace("(", "").replace(")", "")
        words = []
        for word in text.split():
            tokens = list(self.encode(word))
            if not self.started:
                self.started = True
                tokens.insert(0, self.bos)
            words.append(Word(tuple(tokens), word, padding_after(tokens, self.padding_between)))
        return words


@dataclass
class WordState:
    """One session's place in its words (`WordFeeder.start`)."""

    words: deque[Word]
    remaining_padding: int
    forced_padding: int
    queued: deque[int] = field(default_factory=deque)
    lookahead: deque[int] = field(default_factory=deque)
    end_step: int | None = None  # the step at which the model asked for a word past the last one
    consumed_at: list[int] = field(default_factory=list)  # the step each word (pauses too) was taken
    transcript: list[tuple[str, int]] = field(default_factory=list)  # (word, step) for words with tokens
    complete: bool = False  # no word will come after those queued (the client's end of text)

    def tokens_ahead(self, ahead: int) -> tuple[int, ...]:
        """The tokens of the `ahead`-th word still to come that has tokens (pauses skipped), or none."""
        for word in self.words:
            if word.tokens:
                ahead -= 1
                if ahead == 0:
                    return word.tokens
        return ()


@dataclass(frozen=True)
class WordFeeder:
    """The rules that turn the model's text samples into the text it reads (see the module docstring)."""

    card: int  # text ids per muxed stream: the text vocabulary plus the initial token
    second_stream_ahead: int = 0
    max_padding: int = 8
    initial_padding: int = 2

    def start(self, words: Sequence[Word]) -> WordState:
        return WordState(deque(words), self.initial_padding, self.initial_padding)

    def ready(self, state: WordState) -> bool:
        """Whether a step may run for a session whose words arrive over time (an LLM streaming its reply): once
        its text is complete, or when the word it might take next is there with the `second_stream_ahead` words
        after it (a pause needs none), so it never asks for a word that has not come. moshi-server's rule."""
        if state.complete:
            return True
        if not state.words:
            return False
        if not self.second_stream_ahead or not state.words[0].tokens:
            return True
        return sum(1 for word in state.words if word.tokens) > self.second_stream_ahead

    def next_token(self, step: int, state: WordState, sampled: int) -> tuple[int, bool]:
        """The text token the model reads for `sampled` at `step`, and whether a word was taken."""
        token = sampled if sampled in (NEW_WORD, PAD) else PAD
        if state.queued or state.forced_padding > 0:
            token = PAD
        elif state.remaining_padding <= 0:
            token = NEW_WORD
        taken = False
        if token == NEW_WORD:
            if state.words:
                word = state.words.popleft()
                state.consumed_at.append(step)
                taken = True
                if word.tokens:
                    state.transcript.append((word.text, step))
                    state.queued.extend(word.tokens)
                    if self.second_stream_ahead:
                        state.lookahead.extend(state.tokens_ahead(self.second_stream_ahead))
                    state.remaining_padding = self.max_padding
                else:
                    token = PAD  # a pause
                state.forced_padding = word.padding
            else:
                token = NEW_WORD if self.second_stream_ahead and state.end_step is None else PAD
                if state.end_step is None:
                    state.end_step = step
        if token == PAD:
            state.remaining_padding = max(0, state.remaining_padding - 1)
            state.forced_padding = max(0, state.forced_padding - 1)
            out = state.queued.popleft() if state.queued else PAD
        else:
            out = NEW_WORD
        if not self.second_stream_ahead:
            return out, taken
        second = ZERO
        if out == NEW_WORD:  # the new-word mark rides the second stream; the main one goes on with the word
            second = NEW_WORD
            out = state.queued.popleft() if state.queued else PAD
        elif state.lookahead:
            second = state.lookahead.popleft()
        return (second + 1) * self.card + out, taken
