"""Real-time pacing of input frames from a shared start.

Frame i is due at `start + i * period`. A frame that cannot go out on time goes out as soon as possible, but never
closer than `min_gap` after the previous one: a stalled client recovers at (by default) twice real time instead of
sending a catch-up burst, and scheduling jitter never accumulates into drift. Every send's lateness against the
nominal schedule is kept, so a slow client is seen as one and not blamed on the server.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from duplexd.wire import FRAME_SECONDS


@dataclass
class Pacer:
    start: float  # time.monotonic() of frame 0
    period: float = FRAME_SECONDS
    min_gap: float | None = None  # default: period / 2
    sent: list[float] = field(default_factory=list)  # actual send times

    def due(self, index: int) -> float:
        return self.start + index * self.period

    def next_time(self) -> float:
        """When the next frame may go out."""
        nominal = self.due(len(self.sent))
        if not self.sent:
            return nominal
        gap = self.period / 2 if self.min_gap is None else self.min_gap
        return max(nominal, self.sent[-1] + gap)

    async def wait(self) -> None:
        delay = self.next_time() - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    def mark(self, when: float | None = None) -> float:
        """Record a send (now by default); returns its lateness against the nominal schedule in seconds."""
        when = time.monotonic() if when is None else when
        lateness = when - self.due(len(self.sent))
        self.sent.append(when)
        return lateness

    def lateness(self) -> list[float]:
        return [t - self.due(i) for i, t in enumerate(self.sent)]
