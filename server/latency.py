"""Input-to-output delay per frame: when each accepted input frame was pushed, matched to the output it caused.

The engine answers input frame k+1 with output frame k (the first input frame only warms the LM's delays), and
drops the newest input frames when a session's inbox is full, so the frames that went in are always the first
`whole - dropped` of each push.
"""

from __future__ import annotations

from collections import deque


class FrameClock:
    def __init__(self, frame_size: int, limit: int = 4096) -> None:
        self.frame_size = frame_size
        self._partial = 0  # samples buffered in the engine towards the next whole frame
        self._pushed: deque[float] = deque(maxlen=limit)
        self._first = 0  # index (among accepted input frames) of _pushed[0]

    def pushed(self, samples: int, dropped: int, now: float) -> None:
        whole, self._partial = divmod(self._partial + samples, self.frame_size)
        for _ in range(max(whole - dropped, 0)):
            if len(self._pushed) == self._pushed.maxlen:
                self._first += 1
            self._pushed.append(now)

    def delay(self, output_frame: int, now: float) -> float | None:
        """Seconds since the input frame that `output_frame` answers was pushed (None if it is unknown)."""
        wanted = output_frame + 1
        while self._pushed and self._first < wanted:
            self._pushed.popleft()
            self._first += 1
        if self._pushed and self._first == wanted:
            self._first += 1
            return now - self._pushed.popleft()
        return None
