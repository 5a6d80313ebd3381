"""The codec's one error: incoming audio that cannot be decoded (a connection ends on it, it is not skipped)."""

from __future__ import annotations


class AudioError(ValueError):
    """Incoming audio that cannot be decoded."""
