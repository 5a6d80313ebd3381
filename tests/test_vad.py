"""Voice-activity segmentation on real speech: espeak-ng sentences separated by silence and a little noise.

The known boundaries are the synthesised clips' own (trimmed) lengths, so the test needs no labelled data and
nothing is downloaded: espeak-ng is a Debian package (scripts/test.sh installs it), Silero's model is in its wheel.
"""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from duplexd.engine.transcription.vad import (
    VAD_RATE,
    SpeechStarted,
    SpeechStopped,
    VadConfig,
    VadEvent,
    VadSegmenter,
    load_silero,
    segments,
)
from duplexd.wire import FRAME_SIZE, SAMPLE_RATE, split_frames

from .speech import NOISE, TOLERANCE, compose, needs_espeak, speak_all

pytestmark = needs_espeak


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> list[np.ndarray]:
    return speak_all(tmp_path_factory.mktemp("espeak"))


@pytest.fixture(scope="module")
def model():
    return load_silero()


def _stream(seg: VadSegmenter, sessions: dict[int, np.ndarray]) -> dict[int, list[tuple[VadEvent, int]]]:
    """Run sessions side by side (one `step` for all each frame, as the server does); each event with the
    session sample at which it came out."""
    out: dict[int, list[tuple[VadEvent, int]]] = {slot: [] for slot in sessions}
    frames = {slot: split_frames(pcm) for slot, pcm in sessions.items()}
    for slot in sessions:
        seg.open(slot)
    for i in range(max(len(f) for f in frames.values())):
        live = [slot for slot in sessions if i < len(frames[slot])]
        for event in seg.step(live, np.stack([frames[slot][i] for slot in live])):
            out[event.slot].append((event, (i + 1) * FRAME_SIZE))
    for slot in sessions:
        out[slot] += [(event, len(frames[slot]) * FRAME_SIZE) for event in seg.close(slot)]
    return out


def _utterances(events: list[tuple[VadEvent, int]]) -> list[tuple[float, float]]:
    return [(e.start / SAMPLE_RATE, e.t) for e, _ in events if isinstance(e, SpeechStopped)]


def _assert_near(found: list[tuple[float, float]], truth: list[tuple[float, float]], tol: float) -> None:
    assert len(found) == len(truth), (found, truth)
    for (start, end), (true_start, true_end) in zip(found, truth, strict=True):
        assert abs(start - true_start) <= tol and abs(end - true_end) <= tol, (found, truth)


def test_streaming_finds_the_utterances(clips, model):
    pcm, truth = compose([0.6, clips[0], 1.5, clips[1], 1.2, clips[2], 0.8], seed=1)
    events = _stream(VadSegmenter(1, model=model), {0: pcm})[0]
    kinds = [type(e) for e, _ in events]
    assert kinds == [SpeechStarted, SpeechStopped] * 3
    _assert_near(_utterances(events), truth, TOLERANCE)
    assert not any(e.cut for e, _ in events if isinstance(e, SpeechStopped))


def test_offline_segments_agree_with_streaming(clips, model):
    pcm, truth = compose([0.6, clips[0], 1.5, clips[1], 1.2, clips[2], 0.8], seed=2)
    streamed = _utterances(_stream(VadSegmenter(1, model=model), {0: pcm})[0])
    offline = segments(pcm, SAMPLE_RATE, model=model)
    _assert_near(offline, truth, TOLERANCE)
    _assert_near(offline, streamed, 0.033)  # at most a window apart (one resampling against a stream of them)
    # The same file at another rate.
    _assert_near(segments(soxr.resample(pcm, SAMPLE_RATE, 44100), 44100, model=model), truth, TOLERANCE)


def test_sessions_in_one_batch_are_independent(clips, model):
    a, truth_a = compose([0.6, clips[0], 1.5, clips[1], 0.8], seed=3)
    b, truth_b = compose([1.7, clips[2], 1.0, clips[0], 1.1, clips[1], 0.5], seed=4)
    quiet = np.random.default_rng(5).normal(0, NOISE, 4 * SAMPLE_RATE).astype(np.float32)
    together = _stream(VadSegmenter(4, model=model), {0: a, 2: b, 3: quiet})
    _assert_near(_utterances(together[0]), truth_a, TOLERANCE)
    _assert_near(_utterances(together[2]), truth_b, TOLERANCE)
    assert together[3] == []
    alone = _stream(VadSegmenter(1, model=model), {0: b})[0]
    assert [(type(e), e.sample) for e, _ in alone] == [(type(e), e.sample) for e, _ in together[2]]


def test_silence_and_low_noise_give_no_events(model):
    rng = np.random.default_rng(6)
    sessions = {
        0: np.zeros(3 * SAMPLE_RATE, np.float32),
        1: rng.normal(0, NOISE, 3 * SAMPLE_RATE).astype(np.float32),
        2: rng.normal(0, 3 * NOISE, 3 * SAMPLE_RATE).astype(np.float32),
    }
    assert _stream(VadSegmenter(3, model=model), sessions) == {0: [], 1: [], 2: []}
    assert segments(sessions[2], SAMPLE_RATE, model=model) == []


def test_preroll_and_hangover_are_honoured(clips, model):
    config = VadConfig(preroll_s=0.25, hangover_s=0.4)
    # A 0.2 s pause (shorter than the hang-over) does not split an utterance; 1.5 s does.
    pcm, truth = compose([0.8, clips[0], 0.2, clips[1], 1.5, clips[2], 0.8], seed=7)
    events = _stream(VadSegmenter(1, config, model=model), {0: pcm})[0]
    _assert_near(_utterances(events), [(truth[0][0], truth[1][1]), truth[2]], TOLERANCE)
    heard = soxr.resample(pcm, SAMPLE_RATE, VAD_RATE)
    for event, emitted in events:
        if not isinstance(event, SpeechStopped):
            continue
        # Pre-roll: the audio begins 0.25 s before the onset and is the session's own audio.
        assert event.start - event.audio_start == round(0.25 * SAMPLE_RATE)
        first, last = event.audio_start * VAD_RATE // SAMPLE_RATE, event.sample * VAD_RATE // SAMPLE_RATE
        assert len(event.audio) == last - first
        np.testing.assert_allclose(event.audio, heard[first:last], atol=1e-4)
        # Hang-over: the stop comes out only after 0.4 s of silence (plus at most a window and a frame).
        waited = (emitted - event.sample) / SAMPLE_RATE
        assert 0.4 <= waited <= 0.4 + 0.032 + 0.08, waited


def test_a_long_utterance_is_cut_at_the_maximum(clips, model):
    config = VadConfig(max_utterance_s=1.5)
    speech = np.concatenate([clips[0], clips[2]])  # about 5 s with no pause longer than the hang-over
    pcm, truth = compose([0.5, speech, 1.0], seed=8)
    events = [e for e, _ in _stream(VadSegmenter(1, config, model=model), {0: pcm})[0]]
    stops = [e for e in events if isinstance(e, SpeechStopped)]
    assert len(stops) >= 3 and all(len(e.audio) <= 1.5 * VAD_RATE for e in stops)
    assert all(e.cut and len(e.audio) > 1.5 * VAD_RATE - 512 for e in stops[:-1]) and not stops[-1].cut
    # Each cut is followed by a start at the same sample, and the pieces cover the speech.
    starts = [e for e in events if isinstance(e, SpeechStarted)]
    assert [e.sample for e in starts[1:]] == [e.sample for e in stops[:-1]]
    _assert_near([(starts[0].t, stops[-1].t)], truth, TOLERANCE)
