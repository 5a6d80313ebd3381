"""Every session's Ogg/Opus work off the event loop, in one call per direction per tick.

At 128 Kyutai sessions the codec is most of the server's host CPU; in libopus (through ctypes) it runs without
the GIL, so a codec thread does it while the event loop goes on. What it must not do is cross threads once per
session per frame: an executor round trip costs 13-35 us of CPU, as much as encoding the frame. So requests are
gathered and handed over in batches:

* downlink: the engine's step wakes every session's writer in the same loop iteration; the first `encode` of an
  iteration schedules the flush for the next one, so one executor call encodes the whole step's outputs;
* uplink: clients' messages arrive spread over the 80 ms tick (a browser sends one every 40 ms); the first
  `decode` starts a short window (`UPLINK_WINDOW_S`) that gathers what arrives before it closes.

Each batch is split over the codec threads (one call per thread). A session awaits its own request, so no stream
is ever in two batches at once, and a bad stream fails only its own request. Streams free their libopus state when
the last reference goes, so one whose session ended mid-batch lives until its batch is done.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import numpy as np

from .codec.streams import OggOpusDecoder, OggOpusEncoder

logger = logging.getLogger(__name__)

UPLINK_WINDOW_S = 0.01  # at most 100 uplink batches a second, whatever the number of sessions; +<=10 ms latency

R = TypeVar("R")


def _run(work: Sequence[tuple[Callable[[Any], R], Any]]) -> list[tuple[bool, R | BaseException]]:
    """One batch on a codec thread: each call's result, or the exception it raised (for its caller alone)."""
    out: list[tuple[bool, R | BaseException]] = []
    for call, arg in work:
        try:
            out.append((True, call(arg)))
        except Exception as e:  # noqa: BLE001 - handed back to the one request that made it
            out.append((False, e))
    return out


class _Batch(Generic[R]):
    """Requests gathered on the event loop until `flush` hands them to the codec threads."""

    def __init__(self, pool: ThreadPoolExecutor, threads: int, delay: float | None) -> None:
        self._pool, self._threads, self._delay = pool, threads, delay
        self._pending: list[tuple[Callable[[Any], R], Any, asyncio.Future[R]]] = []
        self.calls = 0  # executor calls made (for the bench and the tests)

    def submit(self, call: Callable[[Any], R], arg: Any) -> asyncio.Future[R]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        if not self._pending:
            if self._delay is None:
                loop.call_soon(self._flush)
            else:
                loop.call_later(self._delay, self._flush)
        self._pending.append((call, arg, future))
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        live = [item for item in batch if not item[2].cancelled()]
        if not live:
            return
        loop = asyncio.get_running_loop()
        size = -(-len(live) // self._threads)
        for start in range(0, len(live), size):
            part = live[start : start + size]
            self.calls += 1
            job = loop.run_in_executor(self._pool, _run, [(call, arg) for call, arg, _ in part])
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
    """The server's codec threads and the two batches that feed them. `encode`/`decode` from the event loop."""

    def __init__(self, threads: int = 1) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="duplexd-codec")
        self.downlink: _Batch[bytes] = _Batch(self._pool, threads, None)
        self.uplink: _Batch[np.ndarray] = _Batch(self._pool, threads, UPLINK_WINDOW_S)

    async def encode(self, encoder: OggOpusEncoder, pcm: np.ndarray) -> bytes:
        """Ogg pages of one output frame, encoded with the rest of this step's frames."""
        return await self.downlink.submit(encoder.encode, pcm)

    async def decode(self, decoder: OggOpusDecoder, data: bytes) -> np.ndarray:
        """PCM of a client's Ogg bytes (`AudioError` when malformed), decoded with the others' recent messages."""
        return await self.uplink.submit(decoder.decode, data)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
