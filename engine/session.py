"""One conversation as the engine sees it: a bounded inbox of 80 ms frames and a bounded outbox of answers.

Any thread pushes audio; the engine thread takes one frame per step and hands back one output per frame. Outputs
are received from asyncio (`await recv()`, bound to the loop that first waits) or from a thread (`get()`). All
state is guarded by the engine's lock, so a session can be closed from anywhere at any time: the engine frees
its slot and KV pages between two steps and never delivers to it again.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .config import SamplingParams
from .errors import SessionClosed

if TYPE_CHECKING:
    from .scheduler import Engine


@dataclass(frozen=True)
class SessionOutput:
    frame: int  # index of the output frame in this session (0, 1, ...)
    pcm: np.ndarray  # float32 [frame_size]: the model's speech for this frame
    text_token: int
    text: str  # "" for padding tokens, else the token's text with "▁" as a space (what the reference sends)
    audio_tokens: tuple[int, ...] = ()  # the model's audio codes for this frame (dep_q of them)


class Session:
    def __init__(self, engine: Engine, slot: int, params: SamplingParams, max_frames: int | None) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.slot, self.params, self.max_frames = slot, params, max_frames
        self._engine = engine
        self._lock = engine._lock
        self._ready = threading.Condition(self._lock)
        self._partial = np.zeros(0, dtype=np.float32)
        self._inbox: deque[np.ndarray] = deque()
        self._outbox: deque[SessionOutput] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        try:
            self._bind(asyncio.get_running_loop())
        except RuntimeError:
            pass
        self.closed = False  # no more input: closed by the client or ended by the engine
        self.close_reason: str | None = None
        self.steps = 0
        self.frames_in = self.frames_out = self.frames_dropped_in = self.frames_dropped_out = 0

    def __repr__(self) -> str:
        return f"Session({self.id}, slot={self.slot}, closed={self.closed})"

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._event = loop, asyncio.Event()

    # ------------------------------------------------------------------------------------------- any thread

    def push(self, pcm: np.ndarray) -> int:
        """Queue mono float audio at the engine's rate (any length); returns how many whole frames were dropped
        because the inbox already held `max_pending_frames`. Non-finite samples become 0."""
        samples = np.nan_to_num(np.asarray(pcm, dtype=np.float32).reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)
        size, limit = self._engine.frame_size, self._engine.config.max_pending_frames
        with self._lock:
            if self.closed:
                raise SessionClosed(f"session {self.id} has ended ({self.close_reason})")
            data = np.concatenate([self._partial, samples]) if len(self._partial) else samples
            whole = len(data) // size
            self._partial = data[whole * size :].copy()
            dropped = 0
            for i in range(whole):
                if len(self._inbox) >= limit:
                    dropped += 1
                    continue
                self._inbox.append(data[i * size : (i + 1) * size])
            self.frames_in += whole - dropped
            self.frames_dropped_in += dropped
            if whole > dropped:
                self._engine._work.notify()
        return dropped

    def update_params(self, params: SamplingParams) -> None:
        """Sample with `params` from the next step on; the conversation keeps its position and history."""
        with self._lock:
            if self.closed:
                raise SessionClosed(f"session {self.id} has ended ({self.close_reason})")
            self.params = params
            self._engine._retuned.append(self)
            self._engine._work.notify()

    def close(self, reason: str = "client") -> None:
        """End the session now: pending input and undelivered output are discarded. Idempotent."""
        with self._lock:
            self._outbox.clear()
            if not self.closed:
                self._end(reason)

    async def recv(self) -> SessionOutput | None:
        """The next output frame, or None once the session has ended and its outputs are all received."""
        while True:
            with self._lock:
                if self._loop is None:
                    self._bind(asyncio.get_running_loop())
                if self._outbox:
                    return self._outbox.popleft()
                if self.closed:
                    return None
                event = self._event
                event.clear()
            await event.wait()

    def get(self, timeout: float | None = None) -> SessionOutput | None:
        """Blocking `recv` for threads; `TimeoutError` when nothing arrives within `timeout` seconds."""
        with self._lock:
            if not self._ready.wait_for(lambda: self._outbox or self.closed, timeout):
                raise TimeoutError(f"no output from session {self.id} within {timeout} s")
            return self._outbox.popleft() if self._outbox else None

    @property
    def pending_frames(self) -> int:
        with self._lock:
            return len(self._inbox)

    # ------------------------------------------------------------------------------------------- engine side
    # Called with the engine's lock held.

    def _end(self, reason: str) -> None:
        self.closed, self.close_reason = True, reason
        self._inbox.clear()
        self._engine._ended.append(self)
        self._engine._work.notify()
        self._wake()

    def _take_frame(self) -> np.ndarray | None:
        return self._inbox.popleft() if self._inbox and not self.closed else None

    def _deliver(self, out: SessionOutput) -> None:
        if self.closed:
            return
        if len(self._outbox) >= self._engine.config.max_output_frames:
            self._outbox.popleft()
            self.frames_dropped_out += 1
        self._outbox.append(out)
        self.frames_out += 1
        self._wake()

    def _wake(self) -> None:
        self._ready.notify_all()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the loop has closed: nobody is waiting any more
                pass
