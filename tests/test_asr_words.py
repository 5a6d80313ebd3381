"""Word timing (`server.asr.words`, `server.asr.stream`) against moshi-server's rules stated here in plain Python.

`RustAsr` is a transliteration of moshi-server's `moshi-core/src/asr.rs` (`State::step_tokens` and `ItemState`):
a batch of items, each with its step count, gathered word tokens, open-word flag and last stop time; per model
step, active items (the mask) take one text token each and the step's messages come out in batch order, Word
carrying its tokens. duplexd's `WordTimer` runs one stream at a time; every stream of the batch must get exactly
the events its item got, the words decoded by the same function.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from duplexd.engine.stt.words import EndWord, Word, WordTimer
from duplexd.server.moshi_server.asr_messages import step_messages
from duplexd.server.stt.stream import AsrStream


def decode(tokens) -> str:
    return "·".join(str(t) for t in tokens)


@dataclass
class Item:
    step_idx: int = 0
    text_token: int = 0
    word_tokens: list[int] = field(default_factory=list)
    unended_word: bool = False
    last_stop_time: float = 0.0


class RustAsr:
    """asr.rs's text-token handling for a batch; `step` returns [(batch_idx, message)] as it pushes them."""

    def __init__(self, batch_size: int, asr_delay_in_tokens: int) -> None:
        self.asr_delay_in_tokens = asr_delay_in_tokens
        self.batch = [Item() for _ in range(batch_size)]

    def step(self, text_tokens: list[int], mask: list[bool]) -> list[tuple[int, tuple]]:
        words = []
        for batch_idx, (text_token, item) in enumerate(zip(text_tokens, self.batch, strict=True)):
            if not mask[batch_idx]:
                continue
            item.text_token = text_token
            item.step_idx += 1
            if item.step_idx >= self.asr_delay_in_tokens:
                if text_token == 3 or text_token == 0:
                    if item.word_tokens:
                        tokens, item.word_tokens = item.word_tokens, []
                        words.append((batch_idx, ("Word", tuple(tokens), item.last_stop_time)))
                        item.unended_word = True
                else:
                    item.word_tokens.append(item.text_token)
                if item.text_token == 0:
                    stop_time = (item.step_idx - self.asr_delay_in_tokens) / 12.5
                    if item.unended_word:
                        item.unended_word = False
                        words.append((batch_idx, ("EndWord", stop_time)))
                    item.last_stop_time = stop_time
        return words


def as_tuple(event) -> tuple:
    if isinstance(event, Word):
        return ("Word", event.text, event.start_time)
    assert isinstance(event, EndWord)
    return ("EndWord", event.stop_time)


def oracle_tuple(message: tuple) -> tuple:
    return ("Word", decode(message[1]), message[2]) if message[0] == "Word" else message


def check(streams: list[list[int]], delay: int, seed: int = 0) -> list[list[tuple]]:
    """Run `streams` through the oracle as one batch with random masks (each stream stepping at its own times)
    and through one `WordTimer` each; returns the events, checked equal."""
    rng = random.Random(seed)
    oracle = RustAsr(len(streams), delay)
    timers = [WordTimer(delay, decode) for _ in streams]
    at = [0] * len(streams)
    expected: list[list[tuple]] = [[] for _ in streams]
    got: list[list[tuple]] = [[] for _ in streams]
    while any(a < len(s) for a, s in zip(at, streams, strict=True)):
        mask = [a < len(s) and rng.random() < 0.7 for a, s in zip(at, streams, strict=True)]
        tokens = [s[a] if m else rng.randrange(5) for s, a, m in zip(streams, at, mask, strict=True)]
        for batch_idx, message in oracle.step(tokens, mask):
            expected[batch_idx].append(oracle_tuple(message))
        for i, active in enumerate(mask):
            if active:
                got[i].extend(as_tuple(e) for e in timers[i].step(tokens[i]))
                at[i] += 1
    assert got == expected
    return got


SCRIPTED = {
    # word start, two pieces, padding: the word at the padding, ended at the next start
    "one word": [0, 11, 12, 3, 3, 0, 3],
    # a start right after the pieces: Word and EndWord at the same step
    "back to back": [0, 11, 0, 12, 13, 0, 14, 3],
    # pieces before any word start: the first word starts at 0.0
    "no leading start": [21, 22, 3, 0, 3, 3],
    # padding only, then a word that is never ended
    "unended": [3, 3, 3, 0, 31, 3, 3, 3],
    # starts without pieces: no event, but each moves the next word's start time
    "empty starts": [0, 0, 0, 41, 3, 0],
}


@pytest.mark.parametrize("delay", [0, 1, 2, 6])
@pytest.mark.parametrize("name", list(SCRIPTED))
def test_scripted(name: str, delay: int) -> None:
    prefix = [5 + i for i in range(max(delay - 1, 0))]  # pieces that the delay must hide
    check([prefix + SCRIPTED[name]], delay)


def test_scripted_sequences_make_words() -> None:
    """The scripted cases do exercise the rules: words, ends, and start times past the delay's shift."""
    events = check([[9, *SCRIPTED["back to back"]]], 2)[0]  # the delay hides its first delay - 1 tokens
    kinds = [e[0] for e in events]
    assert kinds.count("Word") == 3 and kinds.count("EndWord") == 2
    assert events[0] == ("Word", "11", 0.0)
    assert ("Word", "12·13", 2 / 12.5) in events


def test_tokens_before_the_delay_are_ignored() -> None:
    rng = random.Random(1)
    tail = [rng.choice([0, 3, 3, 7, 8, 9]) for _ in range(200)]
    runs = []
    for head in ([7, 8, 9, 0, 9], [0, 0, 3, 3, 3]):
        timer = WordTimer(6, decode)
        runs.append([as_tuple(e) for t in head + tail for e in timer.step(t)])
    assert runs[0] == runs[1] and runs[0]


@pytest.mark.parametrize("delay", [0, 6, 32])
def test_random_batches(delay: int) -> None:
    """Many streams of random tokens (padding-heavy, as the model writes), stepping at random times."""
    rng = random.Random(delay)
    streams = [
        [rng.choices([0, 3, 100, 101, 102, 7999], weights=[2, 6, 1, 1, 1, 1])[0] for _ in range(rng.randrange(300))]
        for _ in range(12)
    ]
    events = check(streams, delay, seed=delay)
    assert sum(len(e) for e in events) > 50


def test_bad_delay() -> None:
    with pytest.raises(ValueError, match="delay"):
        WordTimer(-1, decode)


# ------------------------------------------------------------------------------------------------ the stream


def test_stream_messages_in_order() -> None:
    """Per step: Step (with heads), then the words, then the markers now due (all audio before them stepped, plus
    the delay), as moshi-server's post-processing sends them."""
    delay, size = 2, 4
    stream = AsrStream(delay, decode, size)
    stream.received(3 * size + 1)  # 3 whole frames and a bit
    stream.marker(7)  # due after 3 + 2 steps
    stream.received(size)
    stream.marker(8)  # due after 4 + 2 steps (the partial frame is not counted until whole)
    tokens = [3, 3, 0, 11, 3, 0, 3]
    timer = WordTimer(delay, decode)
    for frame, token in enumerate(tokens):
        out = step_messages(stream.step(frame, token, (0.1, 0.2, 0.3, 0.4)))
        buffered = max(0, 4 * size + 1 - (frame + 1) * size)
        assert out[0] == {"type": "Step", "step_idx": frame, "prs": [0.1, 0.2, 0.3, 0.4], "buffered_pcm": buffered}
        words = [as_message(e) for e in timer.step(token)]
        assert out[1 : 1 + len(words)] == words
        markers = [m["id"] for m in out[1 + len(words) :]]
        assert markers == {4: [7], 5: [8]}.get(frame, []), frame


def as_message(event) -> dict:
    if isinstance(event, Word):
        return {"type": "Word", "text": event.text, "start_time": event.start_time}
    return {"type": "EndWord", "stop_time": event.stop_time}


def test_stream_without_heads_sends_no_step() -> None:
    stream = AsrStream(0, decode, 4)
    assert step_messages(stream.step(0, 3, None)) == []
    assert step_messages(stream.step(1, 0, None)) == []
