"""The load-test runner: N concurrent sessions, all admitted first, then paced input from one shared start.

Each session connects (staggered over `ramp`), waits for the shared start, sends its frames at 80 ms (see
`pacing`), records the arrival of every whole output frame, and after its last frame listens for a fixed drain
window; audio arriving later is not counted. Refused sessions are kept (they stay in the denominator).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import numpy.typing as npt

from duplexd.wire import FRAME_SECONDS, FRAME_SIZE, split_frames

from .audio import level_db, read_audio, speech_like
from .connection import Connection, ConnectionFailed, ConnectOptions, Refused
from .pacing import Pacer
from .protocols import encode_stream, open_connection
from .stats import Overall, SessionTrace, StatsConfig, as_dict, overall, session_stats, timeline

logger = logging.getLogger(__name__)
VOICED_DB = -50.0
START_MARGIN = 0.2  # seconds between the last admission and the shared start


@dataclass(frozen=True)
class LoadTestConfig:
    connect: ConnectOptions = field(default_factory=ConnectOptions)
    sessions: int = 1
    duration: float = 10.0  # seconds of input per session
    ramp: float = 0.0  # connections are spread over this many seconds
    drain: float = 1.0  # seconds to keep listening after the last input frame
    input: str | None = None  # WAV (any soundfile format); None: generated speech-like audio
    seed: int = 0
    stats: StatsConfig = field(default_factory=StatsConfig)

    @property
    def frames(self) -> int:
        return max(1, round(self.duration / FRAME_SECONDS))


@dataclass
class Progress:
    """Live counters for the progress line."""

    sessions: int
    frames_total: int
    admitted: int = 0
    refused: int = 0
    errors: int = 0
    sent: int = 0
    received: int = 0
    started: float | None = None  # monotonic time of the shared start


@dataclass
class LoadTestResult:
    config: LoadTestConfig
    traces: list[SessionTrace]
    date: str
    wall_s: float

    @property
    def overall(self) -> Overall:
        return overall(self.traces, self.config.stats)

    def to_dict(self) -> dict:
        cfg = asdict(self.config)
        cfg["connect"]["api_key"] = "***" if self.config.connect.api_key else None
        return {
            "date": self.date,
            "wall_s": self.wall_s,
            "config": cfg,
            "overall": as_dict(self.overall),
            "sessions": [as_dict(session_stats(t, self.config.stats)) for t in self.traces],
            "timeline": timeline(self.traces, self.config.stats),
        }


def input_frames(config: LoadTestConfig) -> np.ndarray:
    """Exactly `config.frames` frames: the input file looped (or cut), or generated speech; `InputError` when the
    file cannot be read."""
    pcm = read_audio(config.input) if config.input else speech_like(config.duration + 1.0, seed=config.seed)
    need = config.frames * FRAME_SIZE
    return split_frames(np.tile(pcm, -(-need // len(pcm)))[:need])


class _Session:
    def __init__(self, index: int, config: LoadTestConfig, progress: Progress, frames: int | None = None) -> None:
        self.config, self.progress = config, progress
        self.trace = SessionTrace(index, config.frames if frames is None else frames)
        self.conn: Connection = open_connection(config.connect)
        self.samples = 0
        self.pending: npt.NDArray[np.float32] = np.zeros(0, np.float32)
        self.t0 = 0.0
        self.listen_until = float("inf")

    async def admit(self, delay: float) -> None:
        await asyncio.sleep(delay)
        started = time.monotonic()
        try:
            await self.conn.open()
        except Refused as e:
            self._fail("refused", e.message, e.code)
        except ConnectionFailed as e:
            self._fail("error", e.message, e.code)
        else:
            self.trace.connect_s = time.monotonic() - started
            self.progress.admitted += 1

    def _fail(self, status: str, error: str, code: int | None) -> None:
        if self.trace.status != "ok":
            return
        self.trace.status, self.trace.error, self.trace.close_code = status, error, code
        if status == "refused":
            self.progress.refused += 1
        else:
            self.progress.errors += 1

    async def run(self, t0: float, messages: list[str | bytes]) -> None:
        if self.trace.status != "ok":
            return
        self.t0 = t0
        receiver = asyncio.create_task(self._receive())
        try:
            await self._send(t0, messages, receiver)
            self.listen_until = time.monotonic() + self.config.drain
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(receiver), self.config.drain)
        finally:
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await receiver
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.conn.close(), 2.0)

    async def _send(self, t0: float, messages: list[str | bytes], receiver: asyncio.Task) -> None:
        pacer = Pacer(t0, FRAME_SECONDS)
        for message in messages:
            await pacer.wait()
            if receiver.done():  # the server closed the session
                return
            try:
                await self.conn.send_message(message)
            except Exception as e:  # noqa: BLE001 - a broken connection, whatever the exception
                self._fail("error", f"send failed: {e!r}", self.conn.close_code)
                return
            now = time.monotonic()
            self.trace.send_lateness.append(pacer.mark(now))
            self.trace.sent.append(now - t0)
            self.progress.sent += 1

    async def _receive(self) -> None:
        try:
            async for event in self.conn.events():
                now = time.monotonic()
                if now > self.listen_until:
                    continue
                if event.kind == "audio" and event.pcm is not None and len(event.pcm):
                    self._audio(event.pcm, now - self.t0)
                elif event.kind == "text":
                    self.trace.text_pieces += 1
                    self.trace.text += event.text
                elif event.kind == "error":
                    self._fail("error", event.text, None)
        except ValueError as e:  # a malformed packet (bad base64, bad Ogg)
            self._fail("error", f"invalid audio from the server: {e}", None)
            return
        if time.monotonic() < self.listen_until and self.conn.close_code not in (None, 1000):
            self._fail(
                "error", f"closed by the server: {self.conn.close_code} {self.conn.close_reason}", self.conn.close_code
            )

    def _audio(self, pcm: np.ndarray, when: float) -> None:
        self.pending = np.concatenate([self.pending, pcm]) if len(self.pending) else pcm
        while len(self.pending) >= FRAME_SIZE:
            frame, self.pending = self.pending[:FRAME_SIZE], self.pending[FRAME_SIZE:]
            self.trace.received.append(when)
            self.trace.voiced += level_db(frame) > VOICED_DB
            self.progress.received += 1


async def run_load_test(
    config: LoadTestConfig, on_progress: Callable[[Progress], None] | None = None
) -> LoadTestResult:
    """Run one load test (one session count) and return its raw traces."""
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    wall = time.monotonic()
    messages = encode_stream(config.connect.protocol, input_frames(config))
    progress = Progress(config.sessions, config.sessions * config.frames)
    sessions = [_Session(i, config, progress) for i in range(config.sessions)]
    spacing = config.ramp / config.sessions if config.sessions > 1 else 0.0
    ticker = asyncio.create_task(_tick(progress, on_progress)) if on_progress else None
    try:
        await asyncio.gather(*(s.admit(i * spacing) for i, s in enumerate(sessions)))
        t0 = time.monotonic() + START_MARGIN
        progress.started = t0
        await asyncio.gather(*(s.run(t0, messages) for s in sessions))
    finally:
        if ticker:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
        if on_progress:
            on_progress(progress)
    return LoadTestResult(config, [s.trace for s in sessions], date, time.monotonic() - wall)


async def _tick(progress: Progress, callback: Callable[[Progress], None]) -> None:
    while True:
        callback(progress)
        await asyncio.sleep(0.5)
