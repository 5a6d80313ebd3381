"""Errors the engine raises for bad input, each with a message that names the problem."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be found, read or matched against the model."""
