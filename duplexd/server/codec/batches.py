"""Every session's Ogg/Opus work off the event loop, in one call per direction per tick.

At 128 Kyutai sessions the codec is most of the server's host CPU; in libopus (through ctypes) it runs without
the GIL, so a codec thread does it while the event loop goes on. What it must not do is cross threads once per
session per frame: an executor round trip costs 13-35 us of CPU, as much as encoding the frame. So requests are
gathered and handed over in batches:

* downlink: the engine's step wakes every session's writer in the same loop iteration; the first `encode` of an
  iteration schedules the flush for the next one, so one executor call encodes the whole step's outputs;
* uplink: clients' messages arrive spread over the 80 ms tick (a browser sends one every 40 ms); the first
  `decode` starts a short window (`UPLINK_WINDOW_S`) that gathers what arrives before it closes.

Where the streams live (`CodecBatches`):

* codec threads (`threads`, the default): the streams are in this process and each batch is split over the
  threads, one call per thread. Short libopus calls hand the GIL over and back, so two threads code about 1.3x
  what one does;
* codec worker processes (`processes` > 0, `codec/workers.py`): each stream lives in one worker, each batch goes
  to each worker holding part of it as one message, sent and awaited by a courier thread (blocked in the pipe,
  without the GIL). Workers scale with the cores; each costs a process and a pickled copy of the audio.

A session awaits its own request, so no stream is ever in two batches at once, and a bad stream fails only its own
request. Streams free their state when the last reference goes, so one whose session ended mid-batch lives until
its batch is done.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import numpy as np

from duplexd.server.connection.closing import Close, CloseCode

from .errors import AudioError
from .streams import OggOpusDecoder, OggOpusEncoder
from .workers import CodecWorker, CodecWorkerError, CodecWorkers, RemoteStream

logger = logging.getLogger(__name__)

UPLINK_WINDOW_S = 0.01  # at most 100 uplink batches a second, whatever the number of sessions; +<=10 ms latency

R = TypeVar("R")
Encoder = OggOpusEncoder | RemoteStream
Decoder = OggOpusDecoder | RemoteStream
Results = list[tuple[bool, Any]]  # per request: (True, result) or (False, the exception for its caller)


def _run_here(method: str, work: Sequence[tuple[Any, Any]]) -> Results:
    """One batch on a codec thread: each stream's `method` on its payload."""
    out: Results = []
    for stream, payload in work:
        try:
            out.append((True, getattr(stream, method)(payload)))
        except Exception as e:  # noqa: BLE001 - handed back to the one request that made it
            out.append((False, e))
    return out


class _Batch(Generic[R]):
    """Requests gathered on the event loop until `flush` hands them over, a part per codec thread or worker."""

    def __init__(self, pool: ThreadPoolExecutor, split: Callable[[list], list[tuple[Callable, list]]], delay) -> None:
        self._pool, self._split, self._delay = pool, split, delay
        self._pending: list[tuple[Any, Any, asyncio.Future[R]]] = []
        self.calls = 0  # executor calls made (for the bench and the tests)

    def submit(self, stream: Any, payload: Any) -> asyncio.Future[R]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        if not self._pending:
            if self._delay is None:
                loop.call_soon(self._flush)
            else:
                loop.call_later(self._delay, self._flush)
        self._pending.append((stream, payload, future))
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        live = [item for item in batch if not item[2].cancelled()]
        if not live:
            return
        loop = asyncio.get_running_loop()
        for run, part in self._split(live):
            self.calls += 1
            job = loop.run_in_executor(self._pool, run, [(stream, payload) for stream, payload, _ in part])
            job.add_done_callback(functools.partial(self._deliver, part))

    @staticmethod
    def _deliver(part: list, done: asyncio.Future) -> None:
        error = done.exception()
        results = [(False, error)] * len(part) if error is not None else done.result()
        for (_, _, future), (ok, value) in zip(part, results, strict=True):
            if future.done():  # its session went away meanwhile
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)


class CodecBatches:
    """The server's codec threads or worker processes and the two batches that feed them; `encoder`/`decoder` make
    a session's streams where the work runs, `encode`/`decode` are called from the event loop."""

    def __init__(self, threads: int = 1, processes: int = 0, uplink_window: float = UPLINK_WINDOW_S) -> None:
        self._workers = CodecWorkers(processes) if processes else None
        # with workers, a courier thread per worker and direction, each blocked in its pipe while the worker codes
        self._pool = ThreadPoolExecutor(2 * processes or threads, thread_name_prefix="duplexd-codec")
        self.downlink: _Batch[bytes] = _Batch(self._pool, self._splitter("encode", threads), None)
        self.uplink: _Batch[np.ndarray] = _Batch(self._pool, self._splitter("decode", threads), uplink_window)

    def _splitter(self, method: str, threads: int) -> Callable[[list], list[tuple[Callable, list]]]:
        if self._workers is not None:
            return _by_worker
        run = functools.partial(_run_here, method)

        def even(items: list) -> list[tuple[Callable, list]]:
            size = -(-len(items) // threads)
            return [(run, items[at : at + size]) for at in range(0, len(items), size)]

        return even

    @property
    def worker_pids(self) -> list[int]:
        """The codec worker processes (none with codec threads), for CPU accounting."""
        return [] if self._workers is None else self._workers.pids()

    def streams(self, profile: str, sample_rate: int) -> tuple[Decoder, Encoder]:
        """A session's uplink and downlink streams (see `OggOpusDecoder`, `OggOpusEncoder`), made where the codec
        runs: both in one worker, so a worker that dies ends the fewest sessions."""
        if self._workers is None:
            return OggOpusDecoder(sample_rate), OggOpusEncoder(profile, sample_rate)
        OggOpusEncoder.check_profile(profile)
        worker = self._workers.emptiest()
        return worker.open(sample_rate, None), worker.open(sample_rate, profile)

    @staticmethod
    def release(*streams: Decoder | Encoder) -> None:
        """A session's streams are no longer wanted: a worker's are freed now. Streams of this process are left to
        go with their last reference: one may still be in a codec thread's batch."""
        for stream in streams:
            if isinstance(stream, RemoteStream):
                stream.close()

    async def encode(self, encoder: Encoder, pcm: np.ndarray) -> bytes:
        """Ogg pages of one output frame, encoded with the rest of this step's frames."""
        return await self.downlink.submit(encoder, pcm)

    async def decode(self, decoder: Decoder, data: bytes) -> np.ndarray:
        """PCM of a client's Ogg bytes (`AudioError` when malformed), decoded with the others' recent messages."""
        return await self.uplink.submit(decoder, data)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        if self._workers is not None:
            self._workers.close()


def codec_close(e: AudioError) -> Close:
    """How a codec failure ends a connection: a dead worker is the server's fault (1011 `codec_failed`), audio that
    does not decode the client's (1007 `invalid_audio`)."""
    if isinstance(e, CodecWorkerError):
        return Close(CloseCode.INTERNAL_ERROR, "codec_failed", str(e))
    return Close(CloseCode.INVALID_PAYLOAD, "invalid_audio", str(e))


def _by_worker(items: list) -> list[tuple[Callable, list]]:
    """A batch's requests grouped by the worker holding their stream: one message to each."""
    groups: dict[CodecWorker, list] = defaultdict(list)
    for item in items:
        groups[item[0].worker].append(item)
    return [(worker.run, part) for worker, part in groups.items()]
