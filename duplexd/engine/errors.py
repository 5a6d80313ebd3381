"""Errors the engine raises for bad input, each with a message that names the problem."""

from __future__ import annotations


class InputRefused(ValueError):
    """Input the engine cannot use. `option` is the keyword it came in as (`moshi_weight`, `device`), when one
    did, so each front end can name it its own way (a command-line flag, a setting)."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class CheckpointError(InputRefused):
    """A checkpoint that cannot be found, read or matched against the model."""


class DeviceError(InputRefused):
    """A device this machine does not have, or one the engine cannot run on."""


class CapacityError(RuntimeError):
    """No session can be admitted now: no free slot, or too few free KV pages for a whole window."""


class SessionClosed(RuntimeError):
    """The session has ended; it takes no more input."""
