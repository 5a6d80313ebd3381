"""A speech-to-text stream cut into utterances (`server.asr.turns`), driven by scripted text tokens through the
stream's own word timing (`AsrStream`): deltas per word, the end of an utterance by silence, by the pause heads
(the head `silence_s` picks, not another), by a commit (words split by their start time), and a clear."""

from __future__ import annotations

import pytest

from duplexd.engine.transcription.service import SpeechBegan, SpeechEnded, TranscriptDelta, TranscriptDone
from duplexd.server.realtime.transcription_events import TurnDetectionSettings
from duplexd.server.stt.stream import AsrStream
from duplexd.server.stt.turns import TurnDetection, Turns

DELAY, FRAME = 2, 1920
W, P = 0, 3  # word start, padding
STEP_S = 0.08


def letters(ids) -> str:
    return "".join(chr(ord("a") + i - 10) for i in ids)


def run(tokens, detection, pause=None, actions=None):
    """Events per step; `actions[step] = ("commit" | "clear", at_s)` happens before that step's answer."""
    stream, turns = AsrStream(DELAY, letters, FRAME), Turns(detection)
    events = []
    for i, token in enumerate(tokens):
        kind, at = (actions or {}).get(i, (None, 0.0))
        if kind == "commit":
            events.append(("commit", turns.commit(at)))
        elif kind == "clear":
            turns.clear(at)
        events += turns.step(stream.step(i, token, pause[i] if pause is not None else None))
    return events


# "ab cd" then a long silence, then "ef": with the delay of 2, word k's start is (its 0's step + 1 - 2) * 0.08
TOKENS = [P, P, W, 10, 11, W, 12, 13, P, P, P, P, P, P, P, P, P, W, 14, 15, P, P, P, P, P, P, P, P, P]


def test_words_stream_and_silence_ends_the_utterance():
    events = run(TOKENS, TurnDetection(silence_s=0.5, prefix_s=0.05))
    assert events[0] == SpeechBegan(0, pytest.approx(1 * STEP_S - 0.05))
    assert [e.text for e in events if isinstance(e, TranscriptDelta)] == ["ab", " cd", "ef"]
    ended = [e for e in events if isinstance(e, SpeechEnded)]
    done = [e for e in events if isinstance(e, TranscriptDone)]
    # "cd" comes out at step 8 (the padding after it): its end is that step's clock, (9 - 2) * 0.08
    assert ended[0] == SpeechEnded(0, pytest.approx(7 * STEP_S))
    assert (done[0].item, done[0].text) == (0, "ab cd")
    assert done[0].start_s == pytest.approx(1 * STEP_S) and done[0].end_s == pytest.approx(7 * STEP_S)
    assert events.index(ended[0]) < events.index(done[0])
    # the end came 0.5 s of clock after the last word, not before: 7 steps (0.56 s) later
    step_of_end = next(
        i
        for i in range(len(TOKENS))
        if any(isinstance(e, SpeechEnded) for e in run(TOKENS[: i + 1], TurnDetection(silence_s=0.5)))
    )
    assert step_of_end == 8 + 7
    assert done[1].item == 1 and done[1].text == "ef" and events[-1] == done[1]


def test_a_longer_silence_keeps_one_utterance():
    events = run(TOKENS + [P] * 8, TurnDetection(silence_s=1.0))
    done = [e for e in events if isinstance(e, TranscriptDone)]
    assert [d.text for d in done] == ["ab cd ef"]  # the 9-step gap (0.72 s) is under 1 s; the last, 16 steps, not


def test_the_pause_head_that_silence_picks_ends_the_utterance():
    pause = [[0.0, 0.0, 0.0, 0.0] for _ in TOKENS]
    for i in range(10, 12):
        pause[i][2] = 0.9  # the 2 s head says "pause" at steps 10 and 11; the others never do
    two_seconds = run(TOKENS, TurnDetection(silence_s=2.0), pause)
    assert [e.text for e in two_seconds if isinstance(e, TranscriptDone)] == ["ab cd"]
    assert next(i for i, e in enumerate(two_seconds) if isinstance(e, SpeechEnded)) > 0
    half_second = run(TOKENS, TurnDetection(silence_s=0.5), pause)  # head 0: never above the threshold
    assert not [e for e in half_second if isinstance(e, TranscriptDone)]
    high = run(TOKENS, TurnDetection(silence_s=2.0, threshold=0.95), pause)
    assert not [e for e in high if isinstance(e, TranscriptDone)]


@pytest.mark.parametrize(("silence", "head"), [(0.2, 0), (0.5, 0), (0.8, 1), (1.6, 2), (2.4, 2), (9.0, 3)])
def test_silence_picks_the_nearest_head(silence, head):
    assert TurnDetection(silence_s=silence).head(4) == head
    assert TurnDetection(silence_s=silence).head(1) == 0


def test_a_commit_splits_the_words_by_their_start():
    # the commit at 0.3 s of audio comes while "ab" is spoken (start 0.08) and before "cd" starts (0.32)
    events = run(TOKENS, None, actions={4: ("commit", 0.3)})
    assert not [e for e in events if isinstance(e, SpeechBegan | SpeechEnded)]  # no turn detection
    assert ("commit", 0) in events
    done = [e for e in events if isinstance(e, TranscriptDone)]
    assert [(d.item, d.text) for d in done] == [(0, "ab")]  # "cd" and "ef" wait for the next commit
    deltas = [(e.item, e.text) for e in events if isinstance(e, TranscriptDelta)]
    assert deltas == [(0, "ab"), (1, "cd"), (1, " ef")]


def test_a_commit_completes_once_the_clock_passes_it():
    events = run(TOKENS[:6], None, actions={3: ("commit", 0.16)})
    # clock after step i is (i + 1 - 2) * 0.08: it reaches 0.16 at step 3, and "ab" started before 0.16
    assert [e.text for e in events if isinstance(e, TranscriptDone)] == ["ab"]
    empty = run([P] * 6, None, actions={1: ("commit", 0.08)})
    assert [(e.item, e.text) for e in empty if isinstance(e, TranscriptDone)] == [(0, "")]


def test_clear_drops_the_open_utterance_and_its_words():
    events = run(TOKENS, TurnDetection(silence_s=0.5), actions={6: ("clear", 0.5)})
    done = [e.text for e in events if isinstance(e, TranscriptDone)]
    assert done == ["ef"]  # "ab" was open (cleared); "cd" began before 0.5 s and comes out after: dropped


def test_semantic_eagerness_picks_the_silence():
    silences = {
        e: TurnDetectionSettings(type="semantic_vad", eagerness=e).detection().silence_s
        for e in ("high", "auto", "low")
    }
    assert silences["high"] < silences["auto"] < silences["low"]
    server = TurnDetectionSettings(type="server_vad", silence_duration_ms=800, threshold=0.7).detection()
    assert (server.silence_s, server.threshold, server.prefix_s) == (0.8, 0.7, 0.3)
