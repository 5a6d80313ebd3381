"""The live transcription service on real speech (espeak-ng) with the tiny random Gemma 4 and the real Silero VAD.

Reference for each utterance: a VAD run of its own over the same frames gives the span (`SpeechStopped.audio`,
the 16 kHz audio from the pre-roll to the stop), and `Gemma4ForConditionalGeneration.generate` (greedy) on that
span gives the tokens; the service, which encoded most of it while it was spoken, must produce the same.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from duplexd.engine.transcription.service import (
    SpeechBegan,
    SpeechEnded,
    TranscriptDelta,
    TranscriptDone,
    TranscriptFailed,
    TranscriptionConfig,
    TranscriptionService,
)
from duplexd.engine.transcription.transcriber import Transcriber
from duplexd.engine.transcription.vad import VAD_RATE, SpeechStopped, VadSegmenter, load_silero, segments
from duplexd.wire import FRAME_SIZE, SAMPLE_RATE, split_frames

from .gemma4_ref import generate, needs_transformers
from .speech import TOLERANCE, compose, needs_espeak, speak_all

pytestmark = [needs_espeak, needs_transformers]
MAX_NEW = 12


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return speak_all(tmp_path_factory.mktemp("espeak"))


@pytest.fixture(scope="module")
def silero():
    return load_silero()


def make_service(folder, silero, transcriber_cls=Transcriber, **config) -> TranscriptionService:
    """A started service; tests push faster than real time, so the inbox bound is lifted unless given."""
    cfg = TranscriptionConfig(**{"max_pending_frames": 100_000, **config})
    tr = transcriber_cls.from_pretrained(folder, max_slots=cfg.max_streams + 1, max_new_tokens=MAX_NEW)
    service = TranscriptionService(tr, cfg, VadSegmenter(cfg.max_streams, cfg.vad, model=silero))
    service.start()
    return service


def reference_stops(silero, pcm: np.ndarray) -> list[SpeechStopped]:
    """The utterances a VAD of its own finds in `pcm`, fed as the service feeds it."""
    vad = VadSegmenter(1, model=silero)
    vad.open(0)
    events = []
    for frame in split_frames(pcm):
        events += vad.step([0], frame[None])
    events += vad.close(0)
    return [e for e in events if isinstance(e, SpeechStopped)]


def collect(stream, utterances: int, timeout: float = 60.0) -> list:
    """Events until `utterances` utterances have a result (done or failed)."""
    events, results = [], 0
    while results < utterances:
        try:
            event = stream.get(timeout)
        except TimeoutError:
            raise AssertionError(f"{results} of {utterances} results after {events}") from None
        assert event is not None, events
        events.append(event)
        results += isinstance(event, TranscriptDone | TranscriptFailed)
    return events


def feed(streams_and_audio: list) -> None:
    """Push each stream's audio 80 ms at a time, the streams in lockstep (as live sessions arrive)."""
    frames = [(stream, split_frames(pcm)) for stream, pcm in streams_and_audio]
    for i in range(max(len(f) for _, f in frames)):
        for stream, f in frames:
            if i < len(f):
                stream.push(f[i])


def done(events) -> list[TranscriptDone]:
    return [e for e in events if isinstance(e, TranscriptDone)]


def test_each_utterance_equals_generate_on_its_span(gemma4_folder, gemma4_hf, clips, silero):
    pcm, truth = compose([0.7, clips[0], 1.2, clips[1], 1.0, clips[2], 0.9], seed=11)
    service = make_service(gemma4_folder, silero)
    try:
        stream = service.open_stream()
        feed([(stream, pcm)])
        events = collect(stream, 3)
        stream.close()
    finally:
        service.stop()
    stops = reference_stops(silero, pcm)
    assert len(stops) == 3
    results = done(events)
    assert [r.tokens for r in results] == [tuple(generate(gemma4_hf, s.audio, MAX_NEW)) for s in stops]
    assert len({r.tokens for r in results}) == 3 and all(len(r.tokens) >= 3 for r in results)
    # Events in order per utterance, with times on the session's audio timeline.
    kinds = [(type(e).__name__, e.item) for e in events]
    for item in range(3):
        mine = [k for k, i in kinds if i == item]
        assert mine[0] == "SpeechBegan" and mine[1] == "SpeechEnded" and mine[-1] == "TranscriptDone", kinds
    for r, (start, end), stop in zip(results, truth, stops, strict=True):
        assert abs(r.start_s - start) <= TOLERANCE and abs(r.end_s - end) <= TOLERANCE
        assert r.start_s == stop.start / SAMPLE_RATE and r.end_s == stop.t
        assert r.text == service.transcriber.text(list(r.tokens))
    deltas = [e for e in events if isinstance(e, TranscriptDelta)]
    assert [d.text for d in deltas] == [r.text for r in results if r.text]


def test_one_changed_frame_changes_that_utterance(gemma4_folder, gemma4_hf, clips, silero):
    pcm, _ = compose([0.7, clips[0], 1.2, clips[1], 0.9], seed=12)
    changed = pcm.copy()
    at = round((0.7 + len(clips[0]) / SAMPLE_RATE + 1.2 + 0.5) * SAMPLE_RATE)  # 0.5 s into the second clip
    changed[at : at + FRAME_SIZE] *= -0.5
    service = make_service(gemma4_folder, silero)
    try:
        outs = []
        for audio in (pcm, changed):
            stream = service.open_stream()
            feed([(stream, audio)])
            outs.append(done(collect(stream, 2)))
            stream.close()
    finally:
        service.stop()
    assert outs[0][0].tokens == outs[1][0].tokens
    assert outs[0][1].tokens != outs[1][1].tokens
    assert list(outs[1][1].tokens) == generate(gemma4_hf, reference_stops(silero, changed)[1].audio, MAX_NEW)


class SpyTranscriber(Transcriber):
    """Records decode batch sizes; can hold decoding (`hold`) or fail it (`fail_next`)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.batches: list[int] = []
        self.hold = threading.Event()
        self.hold.set()
        self.fail_next = 0
        self.feeding = threading.Event()
        self.feeding.set()

    def decode(self, softs, prompts):
        self.hold.wait(60)
        self.batches.append(len(softs))
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("decoder exploded")
        return super().decode(softs, prompts)

    def feed_many(self, chunks):
        self.feeding.wait(60)
        return super().feed_many(chunks)


def test_sessions_share_tower_and_decoder_batches(gemma4_folder, gemma4_hf, clips, silero):
    """Two sessions whose utterances end together: one decoder batch, each transcript as if alone."""
    lead = 0.7 + (len(clips[0]) - len(clips[1])) / SAMPLE_RATE
    a, _ = compose([0.7, clips[0], 1.0], seed=13)
    b, _ = compose([lead, clips[1], 1.0], seed=14)
    service = make_service(gemma4_folder, silero, SpyTranscriber, max_streams=2, batch_window_s=0.5)
    try:
        sa, sb = service.open_stream(), service.open_stream()
        feed([(sa, a), (sb, b)])
        ra, rb = done(collect(sa, 1)), done(collect(sb, 1))
    finally:
        service.stop()
    assert 2 in service.transcriber.batches
    assert list(ra[0].tokens) == generate(gemma4_hf, reference_stops(silero, a)[0].audio, MAX_NEW)
    assert list(rb[0].tokens) == generate(gemma4_hf, reference_stops(silero, b)[0].audio, MAX_NEW)
    assert ra[0].tokens != rb[0].tokens


def test_a_file_is_transcribed_span_by_span(gemma4_folder, gemma4_hf, clips, silero):
    pcm, _ = compose([0.5, clips[2], 1.0, clips[0], 0.6], seed=15)
    audio16 = np.asarray(__import__("soxr").resample(pcm, SAMPLE_RATE, VAD_RATE), dtype=np.float32)
    spans = [(round(s * VAD_RATE), round(e * VAD_RATE)) for s, e in segments(audio16, VAD_RATE, model=silero)]
    assert len(spans) == 2
    service = make_service(gemma4_folder, silero, max_streams=1)
    try:
        result = service.transcribe(audio16, spans).result(120)
    finally:
        service.stop()
    assert [list(r.tokens) for r in result] == [generate(gemma4_hf, audio16[a:b], MAX_NEW) for a, b in spans]
    assert [(r.start_s, r.end_s) for r in result] == [(a / VAD_RATE, b / VAD_RATE) for a, b in spans]
    assert all(r.error is None for r in result)


def test_decoder_failure_and_overload_fail_only_their_utterances(gemma4_folder, clips, silero):
    pcm, _ = compose([0.5, clips[0], 0.8, clips[1], 0.8, clips[2], 0.8, clips[1], 0.8], seed=16)
    service = make_service(gemma4_folder, silero, SpyTranscriber, max_queued=1, batch_window_s=0.0)
    tr = service.transcriber
    try:
        tr.hold.clear()  # decoding waits: the first utterance is taken, the second queued, the third refused
        tr.fail_next = 1  # and the first one's decoding then fails
        stream = service.open_stream()
        feed([(stream, pcm)])
        first = collect(stream, 1)
        tr.hold.set()
        rest = collect(stream, 3)
    finally:
        service.stop()
    results = {e.item: e for e in first + rest if isinstance(e, TranscriptDone | TranscriptFailed)}
    assert isinstance(results[2], TranscriptFailed) and "overloaded" in results[2].reason
    assert isinstance(results[0], TranscriptFailed) and "decoder exploded" in results[0].reason
    assert isinstance(results[1], TranscriptDone) and isinstance(results[3], TranscriptDone)
    assert sorted(results) == [0, 1, 2, 3]


def test_audio_the_thread_cannot_take_is_dropped_and_fails_the_utterance(gemma4_folder, clips, silero):
    pcm, _ = compose([0.5, clips[0], 3.0, clips[1], 0.8], seed=17)
    service = make_service(gemma4_folder, silero, SpyTranscriber, max_pending_frames=5)
    tr = service.transcriber
    try:
        stream = service.open_stream()
        frames = split_frames(pcm)
        middle = round((0.5 + len(clips[0]) / SAMPLE_RATE / 2) * SAMPLE_RATE) // FRAME_SIZE
        for frame in frames[:middle]:  # at real time, which the thread keeps up with even on a loaded box
            stream.push(frame)
            time.sleep(FRAME_SIZE / SAMPLE_RATE)
        assert isinstance(stream.get(60), SpeechBegan)
        tr.feeding.clear()  # the stream thread stalls in the tower
        for frame in frames[middle : middle + 20]:
            stream.push(frame)
        tr.feeding.set()
        events = collect(stream, 1)
        for frame in frames[middle + 20 :]:
            stream.push(frame)
            time.sleep(FRAME_SIZE / SAMPLE_RATE)
        events += collect(stream, 1)
    finally:
        service.stop()
    failed = [e for e in events if isinstance(e, TranscriptFailed)]
    assert len(failed) == 1 and failed[0].item == 0 and "audio dropped" in failed[0].reason
    assert [e.item for e in done(events)] == [1]
    assert any(isinstance(e, SpeechEnded) and e.item == 1 for e in events)


def test_streams_run_out_and_closing_gives_them_back(gemma4_folder, silero):
    from duplexd.engine.errors import CapacityError

    service = make_service(gemma4_folder, silero, max_streams=2)
    try:
        a, b = service.open_stream(), service.open_stream()
        with pytest.raises(CapacityError, match="2 transcription streams"):
            service.open_stream()
        a.close()
        assert a.get(1) is None
        for _ in range(100):
            try:
                c = service.open_stream()
                break
            except CapacityError:
                threading.Event().wait(0.02)
        assert c.slot == a.slot
        assert service.stats().streams == 2
        b.close()
        c.close()
    finally:
        service.stop()


class BrokenTranscriber(SpyTranscriber):
    def feed_many(self, chunks):
        raise RuntimeError("tower on fire")


def test_a_dead_thread_fails_what_is_in_flight_and_refuses_new_work(gemma4_folder, clips, silero):
    from duplexd.engine.errors import CapacityError

    pcm, _ = compose([0.5, clips[0], 0.8], seed=18)
    service = make_service(gemma4_folder, silero, BrokenTranscriber)
    try:
        stream = service.open_stream()
        feed([(stream, pcm)])
        events = []
        while not events or (type(events[-1]), events[-1].item) != (TranscriptFailed, 1):
            events.append(stream.get(60))
        kinds = [(type(e), e.item) for e in events]
        # The utterance in flight fails, then one that never began (the transcriber itself failed). Its
        # speech_stopped comes first only when the thread took the whole utterance in one round, before any audio
        # reached the tower: how the frames were taken depends on the machine's speed.
        assert kinds[0] == (SpeechBegan, 0) and kinds[-2:] == [(TranscriptFailed, 0), (TranscriptFailed, 1)], kinds
        assert kinds[1:-2] in ([], [(SpeechEnded, 0)]), kinds
        assert all("tower on fire" in e.reason for e in events[-2:])
        with pytest.raises(CapacityError, match="tower on fire"):
            service.open_stream()
        with pytest.raises(CapacityError, match="tower on fire"):
            service.transcribe(np.zeros(16_000, np.float32), [(0, 16_000)])
    finally:
        service.stop()
