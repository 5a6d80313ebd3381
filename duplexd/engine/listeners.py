"""Callbacks other parts register on the engine's threads (steps, dropped frames, prompts, transcripts).

One idiom for all of them: `add` returns the function that removes the callback, and calling the `Listeners`
calls each callback in turn, where a failing one is logged and never reaches the thread that reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, ParamSpec

P = ParamSpec("P")
logger = logging.getLogger(__name__)


class Listeners(Generic[P]):
    def __init__(self, what: str) -> None:
        self.what = what  # what the callbacks hear about, for the log
        self._callbacks: list[Callable[P, None]] = []

    def add(self, callback: Callable[P, None]) -> Callable[[], None]:
        """Call `callback` from now on; returns a function that stops it."""
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for callback in list(self._callbacks):  # a copy: a callback may remove itself
            try:
                callback(*args, **kwargs)
            except Exception:
                logger.exception("%s listener failed", self.what)
