"""A stream's audio on its way into its engine session, never further ahead of the answers than the session holds.

moshi-server keeps whatever a client sends and steps it a frame at a time, so a client may send a whole file at
once ("as fast as possible") and get every word of it. duplexd's session drops frames past its inbox bound, and
its outbox drops answers nobody takes, so the feeder keeps at most `ahead` frames between pushed and answered
(`ahead` is at most both bounds): no frame and no answer is ever dropped. The rest waits here, pushed as answers
come back. Up to `limit` samples wait without holding the client back (so its later messages, a close among them,
are still read); past that `feed` returns only once the backlog is under the limit again, and TCP holds the client.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from duplexd.engine.dialogue.session import Session
from duplexd.engine.errors import SessionClosed


class Feeder:
    def __init__(self, session: Session, frame_size: int, ahead: int, limit: int = 0) -> None:
        if ahead < 1:
            raise ValueError("a session must be allowed at least one frame ahead")
        self.session, self.frame_size, self.ahead, self.limit = session, frame_size, ahead, limit
        self.pushed = 0  # frames pushed into the session
        self.answered = 0  # of those, frames answered
        self._pending: np.ndarray = np.zeros(0, dtype=np.float32)
        self._room = asyncio.Event()

    @property
    def waiting(self) -> int:
        """Samples received and not yet pushed."""
        return len(self._pending)

    def add(self, pcm: np.ndarray) -> None:
        """Take `pcm` and push what there is room for."""
        self._pending = np.concatenate([self._pending, np.asarray(pcm, dtype=np.float32).reshape(-1)])
        self.push()

    def push(self) -> None:
        """Push the whole frames waiting, as many as there is room for."""
        count = min(len(self._pending) // self.frame_size, self.ahead - (self.pushed - self.answered))
        if count <= 0:
            return
        take = count * self.frame_size
        frames, self._pending = self._pending[:take], self._pending[take:]
        self.pushed += count
        with contextlib.suppress(SessionClosed):  # the writer sees the end and reports it
            self.session.push(frames)

    def answer(self, frames: int) -> None:
        """The session has answered its first `frames` frames: push more."""
        self.answered = max(self.answered, frames)
        self.push()
        self._room.set()

    async def feed(self, pcm: np.ndarray) -> None:
        """Take `pcm`; returns once at most `limit` samples wait (or the session has ended)."""
        self.add(pcm)
        while len(self._pending) > max(self.limit, self.frame_size - 1) and not self.session.closed:
            self._room.clear()
            await self._room.wait()
