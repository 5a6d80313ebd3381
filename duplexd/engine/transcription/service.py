"""Live transcription of what each user says: voice activity, a streamed audio tower, batched decoding.

Sessions push their 24 kHz input into a `TranscriptStream` (non-blocking, from any thread) and receive
`TranscriptEvent`s. Two threads of their own do the work, so the conversation's engine never waits on them:

* the **stream thread** runs every session's audio through the batched VAD (`VadSegmenter`, one call per 32 ms
  round for all sessions) and, while an utterance is being spoken, feeds the part of it that is sure to belong to
  it to the Gemma 4 audio tower (`Transcriber.feed_many`: one tower call per round for all speakers). When speech
  stops only the held-back tail remains to encode;
* the **decode thread** takes finished utterances and decodes those that ended close together (within
  `batch_window_s`) as one batch.

Overload never reaches the conversation: a stream whose audio the stream thread has not taken within
`max_pending_frames` drops it (the running utterance then fails, `audio dropped`), and utterances beyond
`max_queued` waiting for the decoder fail at once (`transcriber overloaded`). A failing decode fails its batch's
utterances with the error's text; the threads go on.

Whole files (`transcribe`) take the same path in pieces of `FILE_PIECE` samples per round, so a long upload never
stalls the live sessions' segmentation for long.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from duplexd.wire import FRAME_SIZE, SAMPLE_RATE

from ..errors import CapacityError
from ..listeners import Listeners
from ..mailbox import Mailbox
from .transcriber import DEFAULT_PROMPT, MAX_SAMPLES, Transcriber
from .vad import VAD_RATE, SpeechStarted, SpeechStopped, VadConfig, VadSegmenter

logger = logging.getLogger(__name__)

FILE_PIECE = 5 * VAD_RATE  # samples of a file fed per round of the stream thread


@dataclass(frozen=True)
class TranscriptionConfig:
    max_streams: int = 16  # live sessions transcribed at once
    max_queued: int = 32  # finished utterances waiting for the decoder; more fail at once
    max_batch: int = 8  # utterances per decoder batch
    batch_window_s: float = 0.02  # once one utterance is ready, wait this long for others to join its batch
    max_pending_frames: int = 50  # 80 ms frames a stream may hold for the stream thread (4 s); more are dropped
    vad: VadConfig = field(default_factory=VadConfig)


# ----------------------------------------------------------------------------------------------------- events
# Times are seconds of the session's audio (since its first pushed sample); `item` numbers the utterances of a
# stream from 0. A `TranscriptFailed` for the next item, one that never began, says the transcriber itself failed.


@dataclass(frozen=True)
class SpeechBegan:
    item: int
    start_s: float


@dataclass(frozen=True)
class SpeechEnded:
    item: int
    end_s: float


@dataclass(frozen=True)
class TranscriptDelta:
    item: int
    text: str


@dataclass(frozen=True)
class TranscriptDone:
    item: int
    text: str
    tokens: tuple[int, ...]
    start_s: float
    end_s: float


@dataclass(frozen=True)
class TranscriptFailed:
    item: int
    reason: str


TranscriptEvent = SpeechBegan | SpeechEnded | TranscriptDelta | TranscriptDone | TranscriptFailed


@dataclass(frozen=True)
class FileSegment:
    """One utterance of a file: its span in seconds of the file and its transcript (or why it failed)."""

    start_s: float
    end_s: float
    text: str
    tokens: tuple[int, ...]
    error: str | None = None


@dataclass(frozen=True)
class TranscriptionStats:
    streams: int
    max_streams: int
    queued: int  # utterances waiting for the decoder
    speaking: int  # streams in an utterance now


class TranscriptStream:
    """One session's side of the service. `push` from any thread; events by `await recv()` (bound to the loop
    that opened the stream, or first waits) or `get()` from a thread. `close` ends it; idempotent."""

    def __init__(self, service: TranscriptionService, slot: int, prompt: str) -> None:
        self.slot, self.prompt = slot, prompt
        self._service = service
        self._lock = service.lock
        self._partial: npt.NDArray[np.float32] = np.zeros(0, np.float32)
        self._inbox: deque[np.ndarray] = deque()
        self._mailbox: Mailbox[TranscriptEvent] = Mailbox(self._lock, lambda: self.closed)
        self.closed = False
        self.dropped_frames = 0
        # Stream-thread state (read and written only there).
        self.heard = 0  # 24 kHz samples given to the VAD
        self.skipped = 0  # 24 kHz samples dropped before the VAD (added to event times)
        self.items = 0
        self.utterance: _Utterance | None = None

    def push(self, pcm: np.ndarray) -> None:
        """Queue 24 kHz mono float audio (any length). Never blocks; frames over the bound are dropped."""
        samples = np.array(pcm, dtype=np.float32).reshape(-1)  # a copy: callers reuse their buffers
        if not np.isfinite(samples).all():
            np.nan_to_num(samples, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
        with self._lock:
            if self.closed:
                return
            data = np.concatenate([self._partial, samples]) if len(self._partial) else samples
            whole = len(data) // FRAME_SIZE
            self._partial = data[whole * FRAME_SIZE :].copy()
            for i in range(whole):
                if len(self._inbox) >= self._service.config.max_pending_frames:
                    self._inbox.popleft()
                    self.dropped_frames += 1
                self._inbox.append(data[i * FRAME_SIZE : (i + 1) * FRAME_SIZE])
            if whole:
                self._service.wake()

    async def recv(self) -> TranscriptEvent | None:
        """The next event, or None once the stream is closed and its events are all received."""
        return await self._mailbox.recv()

    def get(self, timeout: float | None = None) -> TranscriptEvent | None:
        """Blocking `recv` for threads; `TimeoutError` when nothing arrives within `timeout` seconds."""
        return self._mailbox.get(timeout, "transcription event")

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._inbox.clear()
            self._mailbox.wake()
        self._service.closing(self)

    # -- service side (lock held)
    @property
    def has_input(self) -> bool:
        """Frames or a drop count wait for the stream thread."""
        return bool(self._inbox) or self.dropped_frames > 0

    def take_frames(self) -> tuple[list[np.ndarray], int]:
        frames, dropped = list(self._inbox), self.dropped_frames
        self._inbox.clear()
        self.dropped_frames = 0
        return frames, dropped

    def deliver(self, event: TranscriptEvent) -> None:
        if not self.closed:
            self._mailbox.items.append(event)
            self._mailbox.wake()


@dataclass
class _Utterance:
    """A finished or running utterance on its way to the decoder."""

    owner: TranscriptStream | _FileJob
    item: int
    start_s: float
    slot: int | None  # the transcriber slot while its audio is being encoded
    fed: int = 0  # 16 kHz samples of it given to the tower
    end_s: float = 0.0
    soft: torch.Tensor | None = None
    prompt: str = DEFAULT_PROMPT
    stopped_at: float = 0.0  # time.monotonic() when speech stopped


@dataclass
class _FileJob:
    pcm: np.ndarray  # 16 kHz
    spans: list[tuple[int, int]]  # 16 kHz sample spans of its utterances
    prompt: str
    future: concurrent.futures.Future[list[FileSegment]]
    results: dict[int, FileSegment] = field(default_factory=dict)
    next_span: int = 0
    current: _Utterance | None = None


class TranscriptionService:
    """The transcriber's two threads and the streams they serve."""

    def __init__(
        self, transcriber: Transcriber, config: TranscriptionConfig | None = None, vad: VadSegmenter | None = None
    ) -> None:
        self.config = config or TranscriptionConfig()
        need = self.config.max_streams + 1  # one utterance per stream, and one for files
        if transcriber.state.max_slots < need:
            raise ValueError(f"the transcriber has {transcriber.state.max_slots} slots; {need} are needed")
        self.transcriber = transcriber
        self.vad = vad or VadSegmenter(self.config.max_streams, self.config.vad)
        self.lock = threading.Lock()
        self._work = threading.Condition(self.lock)
        self._decode_ready = threading.Condition(self.lock)
        self._streams: dict[int, TranscriptStream] = {}
        self._opened: list[TranscriptStream] = []  # not yet seen by the stream thread
        self._closed: list[TranscriptStream] = []
        self._files: deque[_FileJob] = deque()
        self._queue: deque[_Utterance] = deque()
        self._stopping = False
        self.failed: str | None = None  # why a thread died, if one did
        self._threads: list[threading.Thread] = []
        self._report: Listeners[[str, float]] = Listeners("transcript")  # (outcome, seconds to transcript)

    # -- lifecycle
    def start(self) -> None:
        if self._threads:
            return
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._guard, args=(self._stream_loop,), name="duplexd-transcribe", daemon=True),
            threading.Thread(target=self._guard, args=(self._decode_loop,), name="duplexd-decode", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
            self._work.notify_all()
            self._decode_ready.notify_all()
            streams = list(self._streams.values())
            jobs, self._files = list(self._files), deque()
        for thread in self._threads:
            thread.join()
        self._threads = []
        for stream in streams:
            stream.close()
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(CapacityError("the transcriber stopped"))

    def on_transcript(self, callback: Callable[[str, float], None]) -> Callable[[], None]:
        """Call `callback(outcome, seconds)` for every utterance ended ("completed" or "failed"), with the time
        from the end of speech to the result; on the service's threads. Returns a function that stops it."""
        return self._report.add(callback)

    # -- streams and files
    def open_stream(self, prompt: str = DEFAULT_PROMPT) -> TranscriptStream:
        """A stream for one session, or `CapacityError` when all `max_streams` are in use. Non-blocking."""
        with self.lock:
            if self._stopping:
                raise CapacityError(self.failed or "the transcriber is stopping")
            free = next((s for s in range(self.config.max_streams) if s not in self._streams), None)
            if free is None:
                raise CapacityError(f"all {self.config.max_streams} transcription streams are in use")
            stream = TranscriptStream(self, free, prompt)
            self._streams[free] = stream
            self._opened.append(stream)
            self._work.notify_all()
            return stream

    def transcribe(
        self, pcm: np.ndarray, spans: Sequence[tuple[int, int]], prompt: str = DEFAULT_PROMPT
    ) -> concurrent.futures.Future[list[FileSegment]]:
        """Transcribe the `spans` (16 kHz sample ranges, each at most 30 s) of a 16 kHz file; a future of one
        `FileSegment` per span, in order."""
        future: concurrent.futures.Future[list[FileSegment]] = concurrent.futures.Future()
        spans = [(int(a), int(b)) for a, b in spans]
        if any(b <= a or b - a > MAX_SAMPLES for a, b in spans):
            raise ValueError("each span must be non-empty and at most 30 s")
        job = _FileJob(np.asarray(pcm, dtype=np.float32), spans, prompt, future)
        if not spans:
            future.set_result([])
            return future
        with self.lock:
            if self._stopping:
                raise CapacityError(self.failed or "the transcriber is stopping")
            self._files.append(job)
            self._work.notify_all()
        return future

    def stats(self) -> TranscriptionStats:
        with self.lock:
            speaking = sum(1 for s in self._streams.values() if s.utterance is not None)
            return TranscriptionStats(len(self._streams), self.config.max_streams, len(self._queue), speaking)

    def wake(self) -> None:
        """A stream has frames (lock held)."""
        self._work.notify_all()

    def closing(self, stream: TranscriptStream) -> None:
        with self.lock:
            self._closed.append(stream)
            self._work.notify_all()

    # -- stream thread
    def _guard(self, loop: Callable[[], None]) -> None:
        torch.set_num_threads(1)  # the conversation's engine owns the cores (see engine.engine)
        torch.set_grad_enabled(False)
        try:
            loop()
        except Exception as e:
            logger.exception("transcriber thread failed; transcription stops, the conversations go on")
            self._fail_all(f"the transcriber failed: {type(e).__name__}: {e}")

    def _fail_all(self, reason: str) -> None:
        """After a thread died: every utterance in flight fails, every file job too, and no stream opens again."""
        with self.lock:
            self.failed, self._stopping = reason, True
            self._work.notify_all()
            self._decode_ready.notify_all()
            pending = [u for u in self._queue if isinstance(u.owner, TranscriptStream)]
            self._queue.clear()
            running = [s.utterance for s in self._streams.values() if s.utterance is not None]
            jobs, self._files = list(self._files), deque()
            for u in pending + running:
                assert isinstance(u.owner, TranscriptStream)
                u.owner.deliver(TranscriptFailed(u.item, reason))
            for stream in self._streams.values():  # an item that never began: the transcriber itself has failed
                stream.deliver(TranscriptFailed(stream.items, reason))
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(CapacityError(reason))

    def _stream_loop(self) -> None:
        while True:
            with self.lock:
                self._work.wait_for(self._has_work)
                if self._stopping:
                    return
                opened, self._opened = self._opened, []
                closed, self._closed = self._closed, []
                taken = {s: s.take_frames() for s in self._streams.values() if s.has_input}
                job = self._files[0] if self._files else None
            for stream in opened:
                self.vad.open(stream.slot)
            for stream in closed:
                self._end_stream(stream)
            self._segment({s: t for s, t in taken.items() if not s.closed})
            if job is not None:
                self._file_round(job)

    def _has_work(self) -> bool:
        if self._stopping or self._opened or self._closed or self._files:
            return True
        return any(s.has_input for s in self._streams.values())

    def _end_stream(self, stream: TranscriptStream) -> None:
        self.vad.close(stream.slot)  # its events would go to nobody
        if stream.utterance is not None and stream.utterance.slot is not None:
            self.transcriber.close(stream.utterance.slot)
        stream.utterance = None
        with self.lock:
            self._streams.pop(stream.slot, None)

    def _segment(self, taken: dict[TranscriptStream, tuple[list[np.ndarray], int]]) -> None:
        """VAD rounds over the streams' frames (the i-th frame of each in one batched call), then the committed
        audio of every running utterance to the tower in one call."""
        for stream, (_, dropped) in taken.items():
            if dropped:
                stream.skipped += dropped * FRAME_SIZE
                self._fail_running(stream, f"audio dropped: the transcriber fell {dropped} frames behind")
        rounds = max((len(frames) for frames, _ in taken.values()), default=0)
        for i in range(rounds):
            live = [s for s, (frames, _) in taken.items() if i < len(frames)]
            events = self.vad.step([s.slot for s in live], np.stack([taken[s][0][i] for s in live]))
            for s in live:
                s.heard += FRAME_SIZE
            for event in events:
                stream = self._streams[event.slot]
                if isinstance(event, SpeechStarted):
                    self._began(stream, event)
                else:
                    self._ended(stream, event)
        feeds = []
        for stream in taken:
            u = stream.utterance
            if u is not None and u.slot is not None:
                audio = self.vad.committed(stream.slot, u.fed)
                if audio.size:
                    feeds.append((u, audio))
        self._feed(feeds)

    def _time(self, stream: TranscriptStream, sample: int) -> float:
        return (sample + stream.skipped) / SAMPLE_RATE

    def _began(self, stream: TranscriptStream, event: SpeechStarted) -> None:
        item, stream.items = stream.items, stream.items + 1
        slot = self.transcriber.open_stream()
        stream.utterance = _Utterance(stream, item, self._time(stream, event.sample), slot, prompt=stream.prompt)
        with self.lock:
            stream.deliver(SpeechBegan(item, stream.utterance.start_s))

    def _ended(self, stream: TranscriptStream, event: SpeechStopped) -> None:
        u = stream.utterance
        if u is None:  # its start was lost with dropped audio
            return
        u.end_s = self._time(stream, event.sample)
        u.stopped_at = time.monotonic()
        with self.lock:
            stream.deliver(SpeechEnded(u.item, u.end_s))
        if u.slot is not None:  # not failed already
            self._feed([(u, event.audio[u.fed :])])
            self._finish_encoding(u)
        stream.utterance = None  # only now: until it is queued, a dying thread must still find it

    def _fail_running(self, stream: TranscriptStream, reason: str) -> None:
        u = stream.utterance
        if u is not None and u.slot is not None:
            self.transcriber.close(u.slot)
            u.slot = None
            self._report("failed", 0.0)
            with self.lock:
                stream.deliver(TranscriptFailed(u.item, reason))

    def _feed(self, feeds: list[tuple[_Utterance, np.ndarray]]) -> None:
        feeds = [(u, a) for u, a in feeds if a.size and u.slot is not None]
        if not feeds:
            return
        self.transcriber.feed_many([(u.slot, audio) for u, audio in feeds if u.slot is not None])
        for u, audio in feeds:
            u.fed += audio.size

    def _finish_encoding(self, u: _Utterance) -> None:
        """Encode the tail, free the tower slot, and queue the utterance for the decoder (or fail it)."""
        assert u.slot is not None
        try:
            u.soft = self.transcriber.flush(u.slot)
        finally:
            self.transcriber.close(u.slot)
            u.slot = None
        with self.lock:
            if len(self._queue) >= self.config.max_queued:
                overloaded = True
            else:
                overloaded = False
                self._queue.append(u)
                self._decode_ready.notify_all()
        if overloaded:
            self._complete(
                u, None, f"transcriber overloaded: {self.config.max_queued} utterances are waiting to be decoded"
            )

    def _file_round(self, job: _FileJob) -> None:
        """Feed one piece of the job's current span; start the next span when one ends."""
        if job.current is None:
            index = job.next_span
            start, end = job.spans[index]
            job.next_span += 1
            job.current = _Utterance(job, index, start / VAD_RATE, self.transcriber.open_stream(), prompt=job.prompt)
            job.current.end_s = end / VAD_RATE
        u = job.current
        start, end = job.spans[u.item]
        piece = job.pcm[start + u.fed : min(start + u.fed + FILE_PIECE, end)]
        self._feed([(u, piece)])
        if start + u.fed >= end:
            job.current = None
            u.stopped_at = time.monotonic()
            if job.next_span == len(job.spans):
                with self.lock:
                    self._files.popleft()
            self._finish_encoding(u)

    # -- decode thread
    def _decode_loop(self) -> None:
        cfg = self.config
        while True:
            with self.lock:
                self._decode_ready.wait_for(lambda: self._stopping or bool(self._queue))
                if self._stopping:
                    return
                first = self._queue[0].stopped_at
            wait = first + cfg.batch_window_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with self.lock:
                batch = [self._queue.popleft() for _ in range(min(cfg.max_batch, len(self._queue)))]
            try:
                tokens = self.transcriber.decode(
                    [u.soft for u in batch if u.soft is not None], [u.prompt for u in batch]
                )
            except Exception as e:
                logger.exception("transcript decoding failed for %d utterances", len(batch))
                for u in batch:
                    self._complete(u, None, f"decoding failed: {type(e).__name__}: {e}")
                continue
            for u, row in zip(batch, tokens, strict=True):
                self._complete(u, row, None)

    def _complete(self, u: _Utterance, tokens: list[int] | None, error: str | None) -> None:
        seconds = time.monotonic() - u.stopped_at
        self._report("failed" if tokens is None else "completed", seconds)
        text = self.transcriber.text(tokens) if tokens is not None else ""
        owner = u.owner
        if isinstance(owner, _FileJob):
            owner.results[u.item] = FileSegment(u.start_s, u.end_s, text, tuple(tokens or ()), error)
            if len(owner.results) == len(owner.spans) and not owner.future.done():
                owner.future.set_result([owner.results[i] for i in range(len(owner.spans))])
            return
        with self.lock:
            if tokens is None:
                assert error is not None
                owner.deliver(TranscriptFailed(u.item, error))
            else:
                if text:
                    owner.deliver(TranscriptDelta(u.item, text))
                owner.deliver(TranscriptDone(u.item, text, tuple(tokens), u.start_s, u.end_s))
