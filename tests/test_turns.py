"""Device turns: one step at a time, and a waiting real-time loop goes before the others."""

from __future__ import annotations

import threading
import time

from duplexd.engine.turns import DeviceTurns


def test_one_at_a_time_and_the_urgent_loop_first():
    turns, order, inside = DeviceTurns(), [], []
    release = threading.Event()

    def step(name: str, urgent: bool, hold: threading.Event | None = None) -> None:
        with turns.turn(urgent):
            inside.append(name)
            assert len(inside) == 1, inside  # nobody else holds the device
            order.append(name)
            if hold is not None:
                hold.wait(10)
            inside.remove(name)

    first = threading.Thread(target=step, args=("speech 1", False, release))
    first.start()
    while not order:
        time.sleep(0.001)
    waiting = [
        threading.Thread(target=step, args=("speech 2", False)),
        threading.Thread(target=step, args=("engine", True)),
    ]
    for thread in waiting:
        thread.start()
        time.sleep(0.05)  # speech 2 waits before the engine does
    release.set()
    for thread in [first, *waiting]:
        thread.join(10)
    assert order == ["speech 1", "engine", "speech 2"]
