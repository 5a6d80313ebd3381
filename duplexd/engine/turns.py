"""Turns on a device shared by several models' loops: one step at a time, the real-time loop's first.

Two loops that step on one device at once (the conversation or speech-to-text engine, and the text-to-speech
service) slow each other down more than their steps add up: on a CPU they split the cores and hand the GIL back and
forth every switch interval, so a 15 ms speech-to-text step took 90 ms beside a text-to-speech one (bench/
speech_mix.py) and its streams fell behind for good. With turns each step runs alone at full speed, and a loop
whose users send audio in real time (`urgent`) goes before the others whenever it waits: the longest it waits is
the one step already running. A device with one loop needs no turns (`None`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class DeviceTurns:
    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._busy = False
        self._urgent_waiting = 0

    @contextlib.contextmanager
    def turn(self, urgent: bool) -> Iterator[None]:
        """Hold the device for one step."""
        with self._ready:
            self._urgent_waiting += urgent
            self._ready.wait_for(lambda: not self._busy and (urgent or not self._urgent_waiting))
            self._urgent_waiting -= urgent
            self._busy = True
        try:
            yield
        finally:
            with self._ready:
                self._busy = False
                self._ready.notify_all()


def maybe_turn(turns: DeviceTurns | None, urgent: bool) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if turns is None else turns.turn(urgent)
