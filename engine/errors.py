"""Errors the engine raises for bad input, each with a message that names the problem."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be found, read or matched against the model."""


class CapacityError(RuntimeError):
    """No session can be admitted now: no free slot, or too few free KV pages for a whole window."""


class SessionClosed(RuntimeError):
    """The session has ended; it takes no more input."""
