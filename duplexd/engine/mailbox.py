"""Items a worker thread hands to one consumer that waits from asyncio or from a thread.

The engine's loop and the transcriber's threads produce; a connection's task consumes with `await recv()` (bound
to the event loop that first waits, and woken with `call_soon_threadsafe`) and tests or CLI threads with `get()`.
The owner's lock guards the items, so producers append and wake under the lock they already hold.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    """`items` to receive until `finished()` (the owner's state) is true and they are all taken."""

    def __init__(self, lock: threading.Lock, finished: Callable[[], bool]) -> None:
        self.items: deque[T] = deque()
        self._lock, self._finished = lock, finished
        self._ready = threading.Condition(lock)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        try:
            self._bind(asyncio.get_running_loop())
        except RuntimeError:
            pass

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._event = loop, asyncio.Event()

    async def recv(self) -> T | None:
        """The next item, or None once finished and empty."""
        await self.until(lambda: bool(self.items) or self._finished())
        with self._lock:  # one consumer: what made the wait end is still there
            return self.items.popleft() if self.items else None

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait from asyncio until `condition()` (read under the owner's lock) holds; the owner calls `wake`
        whenever it may have become true."""
        while True:
            with self._lock:
                if self._loop is None:
                    self._bind(asyncio.get_running_loop())
                if condition():
                    return
                event = self._event
                assert event is not None  # bound above
                event.clear()
            await event.wait()

    def get(self, timeout: float | None = None, what: str = "item") -> T | None:
        """Blocking `recv` for threads; `TimeoutError` when nothing arrives within `timeout` seconds."""
        with self._lock:
            if not self._ready.wait_for(lambda: self.items or self._finished(), timeout):
                raise TimeoutError(f"no {what} within {timeout} s")
            return self.items.popleft() if self.items else None

    def wake(self) -> None:
        """Items were added or the owner finished (lock held)."""
        self._ready.notify_all()
        if self._loop is not None and self._event is not None:
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the loop has closed: nobody is waiting any more
                pass
