"""The codec's batches: a step's encodes and a window's decodes cross to the codec threads in one executor call per
thread (or to the worker processes in one message per worker), each session gets exactly what its own stream
makes, and a bad stream fails only itself; a worker process that dies fails only the streams it held."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections import Counter

import numpy as np
import pytest

from duplexd.clients.audio import speech_like
from duplexd.server.codec.batches import UPLINK_WINDOW_S, CodecBatches
from duplexd.server.codec.errors import AudioError
from duplexd.server.codec.streams import OggOpusDecoder, OggOpusEncoder
from duplexd.server.codec.workers import CodecWorkerError
from duplexd.wire import FRAME_SIZE, split_frames

SESSIONS, FRAMES = 12, 6
WIDE_WINDOW_S = 0.2  # the spread-arrivals test's uplink window, 20x the default


class Recording(OggOpusEncoder):
    """A real encoder that notes which thread ran it."""

    threads: set[str] = set()

    def encode(self, pcm: np.ndarray) -> bytes:
        Recording.threads.add(threading.current_thread().name)
        return super().encode(pcm)


def _speech(session: int) -> list[np.ndarray]:
    return split_frames(speech_like(FRAMES * FRAME_SIZE / 24000 + 0.1, seed=session)[: FRAMES * FRAME_SIZE], FRAME_SIZE)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_step_of_encodes_is_one_call_per_thread_and_each_stream_gets_its_own_bytes(threads):
    audio = [_speech(s) for s in range(SESSIONS)]

    async def run() -> tuple[list[list[bytes]], int]:
        codec = CodecBatches(threads)
        try:
            encoders = [Recording("fast") for _ in range(SESSIONS)]
            pages: list[list[bytes]] = [[] for _ in range(SESSIONS)]
            for frame in range(FRAMES):  # one engine step: every session's writer asks at once
                out = await asyncio.gather(*(codec.encode(e, audio[s][frame]) for s, e in enumerate(encoders)))
                for s, ogg in enumerate(out):
                    pages[s].append(ogg)
            return pages, codec.downlink.calls
        finally:
            codec.shutdown()

    Recording.threads = set()
    pages, calls = asyncio.run(run())
    assert calls == FRAMES * threads  # not FRAMES * SESSIONS
    assert Recording.threads and all(name.startswith("duplexd-codec") for name in Recording.threads)
    for s in range(SESSIONS):  # what the stream alone makes, in order
        alone = OggOpusEncoder("fast")
        assert pages[s] == [alone.encode(frame) for frame in audio[s]], f"session {s}"
    assert len({b"".join(p) for p in pages}) == SESSIONS  # the sessions' audio differs, so do their bytes


def test_worker_processes_encode_a_step_in_one_message_each_and_each_stream_gets_its_own_bytes():
    audio = [_speech(s) for s in range(SESSIONS)]

    async def run() -> tuple[list[list[bytes]], int, list[int], list[int]]:
        codec = CodecBatches(processes=2)
        try:
            encoders = [codec.streams("fast", 24000)[1] for _ in range(SESSIONS)]
            pages: list[list[bytes]] = [[] for _ in range(SESSIONS)]
            for frame in range(FRAMES):
                out = await asyncio.gather(*(codec.encode(e, audio[s][frame]) for s, e in enumerate(encoders)))
                for s, ogg in enumerate(out):
                    pages[s].append(ogg)
            placed = sorted(Counter(id(e.worker) for e in encoders).values())  # type: ignore[union-attr]
            return pages, codec.downlink.calls, placed, codec.worker_pids
        finally:
            codec.shutdown()

    pages, calls, placed, pids = asyncio.run(run())
    assert placed == [SESSIONS // 2, SESSIONS // 2]  # new streams go to the emptier worker
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert calls == FRAMES * 2  # one message per worker per step, not one per session
    for s in range(SESSIONS):
        alone = OggOpusEncoder("fast")
        assert pages[s] == [alone.encode(frame) for frame in audio[s]], f"session {s}"


@pytest.mark.parametrize("processes", [0, 2])
def test_decodes_within_the_window_share_a_call_and_a_bad_stream_fails_alone(processes):
    streams = []
    for s in range(SESSIONS):
        encoder = OggOpusEncoder("fast")
        streams.append([encoder.encode(frame) for frame in _speech(s)])

    async def run():
        # a window far wider than the spread: a loaded box's late timers still land inside it
        codec = CodecBatches(processes=processes, uplink_window=WIDE_WINDOW_S)
        try:
            decoders = [codec.streams("fast", 24000)[0] for _ in range(SESSIONS)]
            bad = SESSIONS - 1

            async def one(s: int, frame: int, delay: float):
                await asyncio.sleep(delay)
                data = b"not an ogg page at all" if s == bad and frame == 2 else streams[s][frame]
                return await codec.decode(decoders[s], data)

            results = []
            for frame in range(FRAMES):  # the sessions' messages arrive spread over part of the window
                spread = [one(s, frame, UPLINK_WINDOW_S * s / SESSIONS) for s in range(SESSIONS)]
                results.append(await asyncio.gather(*spread, return_exceptions=True))
            return results, codec.uplink.calls
        finally:
            codec.shutdown()

    results, calls = asyncio.run(run())
    assert calls == FRAMES * max(processes, 1)
    for s in range(SESSIONS - 1):
        pcm = np.concatenate([results[f][s] for f in range(FRAMES)])
        direct = OggOpusDecoder()
        assert np.array_equal(pcm, np.concatenate([direct.decode(d) for d in streams[s]])), f"session {s}"
        assert len(pcm) == FRAMES * FRAME_SIZE
    assert isinstance(results[2][SESSIONS - 1], AudioError)
    assert not isinstance(results[1][SESSIONS - 1], BaseException)


def test_a_request_whose_session_left_is_dropped_without_harm():
    async def run() -> bytes:
        codec = CodecBatches(1)
        try:
            gone, kept = OggOpusEncoder("fast"), OggOpusEncoder("fast")
            frame = _speech(0)[0]
            lost = asyncio.ensure_future(codec.encode(gone, frame))
            wanted = asyncio.ensure_future(codec.encode(kept, frame))
            await asyncio.sleep(0)
            lost.cancel()  # its session ended while the batch was in flight
            return await wanted
        finally:
            codec.shutdown()

    assert asyncio.run(run()) == OggOpusEncoder("fast").encode(_speech(0)[0])


def test_a_worker_that_dies_fails_only_its_streams_and_is_replaced():
    frame = _speech(0)[0]

    async def run():
        codec = CodecBatches(processes=2)
        try:
            (up, first), (_, second) = codec.streams("fast", 24000), codec.streams("fast", 24000)
            assert first.worker is not second.worker and up.worker is first.worker  # type: ignore[union-attr]
            await asyncio.gather(codec.encode(first, frame), codec.encode(second, frame))
            victim = first.worker.pid  # type: ignore[union-attr]
            os.kill(victim, signal.SIGKILL)
            died, survived = await asyncio.gather(
                codec.encode(first, frame), codec.encode(second, frame), return_exceptions=True
            )
            again = await asyncio.gather(codec.encode(first, frame), return_exceptions=True)
            fresh = codec.streams("fast", 24000)[1]  # goes to the replacement, which is empty
            new_bytes = await codec.encode(fresh, frame)
            return died, survived, again[0], new_bytes, victim, codec.worker_pids
        finally:
            codec.shutdown()

    died, survived, again, new_bytes, victim, pids = asyncio.run(run())
    assert isinstance(died, CodecWorkerError) and isinstance(again, CodecWorkerError)
    alone = OggOpusEncoder("fast")
    alone.encode(frame)
    assert survived == alone.encode(frame)  # the other worker's stream went on, its second frame
    assert new_bytes == OggOpusEncoder("fast").encode(frame)  # a new stream starts from its headers
    assert victim not in pids and len(pids) == 2
