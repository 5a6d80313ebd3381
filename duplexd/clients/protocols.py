"""The protocol of a connection chosen by name (`ConnectOptions.protocol`): here, apart from `connection.py`, so that
the base class and its two subclasses (`kyutai.py`, `realtime.py`) import one way."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from . import kyutai, realtime
from .connection import Connection, ConnectOptions


def open_connection(options: ConnectOptions) -> Connection:
    """A (not yet opened) connection for `options.protocol`."""
    if options.protocol == "kyutai":
        return kyutai.KyutaiConnection(options)
    if options.protocol == "realtime":
        return realtime.RealtimeConnection(options)
    raise ValueError(f"unknown protocol {options.protocol!r} (kyutai or realtime)")


def encode_stream(protocol: str, frames: Iterable[np.ndarray]) -> list[str | bytes]:
    """The wire messages of a whole input, one per frame, ready for `Connection.send_message`."""
    if protocol == "kyutai":
        return list(kyutai.encode_stream(frames))
    return list(realtime.encode_stream(frames))
