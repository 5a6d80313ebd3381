"""A call's audio: the model's speech paced onto the outgoing track, and the caller's track turned into the
model's input (mono at its rate).

The outgoing track is a clock: aiortc pulls a 20 ms frame from `recv`, which waits until that frame is due and
hands over the next 20 ms of speech, or silence while there is none (RTP keeps flowing, as browsers expect from a
peer). The engine's speech comes in 80 ms frames; the track's queue holds what has not gone out yet, which is
what `output_audio_buffer.clear` drops and what a barge-in truncates to.

On an Opus call the track hands aiortc packets it encoded itself (`encode_with`: the server's libopus, mono at
the model's 24 kHz and 32 kb/s) instead of frames: aiortc would resample each frame to 48 kHz stereo and encode it
at 96 kb/s on an executor thread, and measure its level in a Python loop.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections import deque
from collections.abc import Callable

import av
import numpy as np
import soxr
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from duplexd import wire

RATE = wire.SAMPLE_RATE
FRAME = RATE // 50  # 20 ms
TIME_BASE = fractions.Fraction(1, RATE)


class SpeechTrack(MediaStreamTrack):
    """The model's speech, paced in real time onto the call."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[np.ndarray] = deque()
        self._queued = 0  # samples in the queue
        self._head = 0  # samples of the queue's first array already sent
        self._start: float | None = None
        self._pts = 0
        self._encode: Callable[[np.ndarray], bytes] | None = None
        self.played = 0  # samples of speech sent (silence not counted)

    def encode_with(self, encode: Callable[[np.ndarray], bytes]) -> None:
        """Send Opus packets of `encode` (20 ms of float32 at the model's rate → one packet) instead of frames."""
        self._encode = encode

    @property
    def queued(self) -> int:
        """Samples of speech not sent yet."""
        return self._queued

    def play(self, pcm: np.ndarray) -> None:
        if len(pcm):
            self._queue.append(pcm)
            self._queued += len(pcm)

    def clear(self) -> int:
        """Drop the speech not sent yet; returns how many samples that was."""
        dropped = self._queued
        self._queue.clear()
        self._queued = self._head = 0
        return dropped

    def _take(self, n: int) -> np.ndarray:
        out = np.zeros(n, np.float32)
        filled = 0
        while filled < n and self._queue:
            first = self._queue[0]
            part = first[self._head : self._head + n - filled]
            out[filled : filled + len(part)] = part
            filled += len(part)
            self._head += len(part)
            if self._head == len(first):
                self._queue.popleft()
                self._head = 0
        self._queued -= filled
        self.played += filled
        return out

    async def recv(self) -> av.AudioFrame | av.Packet:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._start is None:
            self._start = now
        else:
            wait = self._start + self._pts / RATE - now
            if wait > 0:
                await asyncio.sleep(wait)
        pcm = self._take(FRAME)
        if self._encode is not None:
            packet = av.Packet(self._encode(pcm))
            packet.pts, packet.time_base = self._pts, TIME_BASE
            self._pts += FRAME
            return packet
        frame = av.AudioFrame.from_ndarray(wire.pcm16(pcm).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = RATE, self._pts, TIME_BASE
        self._pts += FRAME
        return frame


class HeardAudio:
    """The caller's frames (Opus: 48 kHz stereo s16; PCMU/PCMA: 8 kHz mono) as mono float32 at the model's rate."""

    def __init__(self) -> None:
        self._resampler: soxr.ResampleStream | None = None
        self._rate = RATE

    def __call__(self, frame: av.AudioFrame) -> np.ndarray:
        channels = len(frame.layout.channels)
        data = frame.to_ndarray()  # s16, as aiortc's decoders give: packed (1, n * channels) or planar (channels, n)
        samples = data.T if frame.format.is_planar else data.reshape(-1, channels)
        mono = np.multiply(samples.mean(axis=1, dtype=np.float32), 1.0 / 32768.0, dtype=np.float32)
        if frame.sample_rate == RATE:
            return mono
        if self._resampler is None or frame.sample_rate != self._rate:
            self._resampler, self._rate = (
                soxr.ResampleStream(frame.sample_rate, RATE, 1, dtype="float32"),
                frame.sample_rate,
            )
        return self._resampler.resample_chunk(mono)
