"""Turns on a device shared by several models' loops: one step at a time, the real-time loop's first, up to a bound.

Two loops that step on one device at once (the conversation or speech-to-text engine, and the text-to-speech
service) slow each other down more than their steps add up: on a CPU they split the cores and hand the GIL back and
forth every switch interval, so a 15 ms speech-to-text step took 90 ms beside a text-to-speech one (bench/
speech_mix.py) and its streams fell behind for good. With turns each step runs alone at full speed, and a loop
whose users send audio in real time (`urgent`) goes before the others whenever it waits: the longest it waits is
the one step already running. On an overloaded device the urgent loop is always behind and always waiting, so it
goes first only `URGENT_RUN` turns in a row while another loop waits: both slow down, and neither starves (a voice
agent's speech had stopped for good behind a speech-to-text engine that could not catch up). A device with one loop
needs no turns (`None`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

URGENT_RUN = 2  # urgent turns in a row while another loop waits, before that loop's turn


class DeviceTurns:
    def __init__(self, urgent_run: int = URGENT_RUN) -> None:
        self.urgent_run = urgent_run
        self._ready = threading.Condition()
        self._busy = False
        self._waiting = {True: 0, False: 0}  # urgent, other
        self._run = 0  # urgent turns taken in a row while another loop waited

    def _owed(self) -> bool:
        """Another loop has waited out the urgent loop's run: the next turn is its."""
        return bool(self._waiting[False]) and self._run >= self.urgent_run

    def _free_for(self, urgent: bool) -> bool:
        if self._busy:
            return False
        return not self._owed() if urgent else self._owed() or not self._waiting[True]

    @contextlib.contextmanager
    def turn(self, urgent: bool) -> Iterator[None]:
        """Hold the device for one step."""
        with self._ready:
            self._waiting[urgent] += 1
            self._ready.wait_for(lambda: self._free_for(urgent))
            self._waiting[urgent] -= 1
            self._run = self._run + 1 if urgent and self._waiting[False] else 0
            self._busy = True
        try:
            yield
        finally:
            with self._ready:
                self._busy = False
                self._ready.notify_all()


def maybe_turn(turns: DeviceTurns | None, urgent: bool) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if turns is None else turns.turn(urgent)
