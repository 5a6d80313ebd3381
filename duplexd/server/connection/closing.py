"""Why a connection ends: one exception carrying the WebSocket close code, the reason and the client message.

Codes (RFC 6455): 1000 normal end (client, max length, idle), 1001 server going away, 1002 protocol error,
1003 wrong frame type, 1007 undecodable payload, 1008 policy (API key, origin, stalled reader), 1009 too big,
1011 engine failure, 1013 no capacity (try again later).
"""

from __future__ import annotations

from enum import IntEnum


class CloseCode(IntEnum):
    NORMAL = 1000
    GOING_AWAY = 1001
    PROTOCOL_ERROR = 1002
    UNSUPPORTED_DATA = 1003
    INVALID_PAYLOAD = 1007
    POLICY_VIOLATION = 1008
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    TRY_AGAIN_LATER = 1013


class Close(Exception):  # noqa: N818 - it is a control-flow signal, not an error
    """End the connection with `code`; `error` is a short machine code, `message` is told to the client."""

    def __init__(self, code: CloseCode, error: str, message: str | None = None, *, notify: bool = True) -> None:
        super().__init__(message or error)
        self.code, self.error, self.message, self.notify = code, error, message or error, notify

    @property
    def reason(self) -> str:
        """The close frame's reason: at most 123 bytes by RFC 6455."""
        return self.message.encode("utf-8")[:123].decode("utf-8", "ignore")


class Disconnected(Exception):  # noqa: N818
    """The client went away (close frame or dropped connection): nothing more can be sent."""

    def __init__(self, detail: str, code: int | None = None) -> None:
        super().__init__(detail)
        self.code = code

    @property
    def label(self) -> str:
        """`client` for a clean close by the client, `lost` for a dropped connection or failed keep-alive."""
        return "client" if self.code in (CloseCode.NORMAL, CloseCode.GOING_AWAY) else "lost"


def slow_reader(timeout: float) -> Close:
    """The close for a client that stopped reading (one send blocked for `timeout` s): the close frame alone, as an
    error message would block too."""
    return Close(
        CloseCode.POLICY_VIOLATION,
        "slow_reader",
        f"the client stopped reading: a send was blocked for {timeout:g} s",
        notify=False,
    )


def close_for_session_end(reason: str | None) -> Close:
    """The close that tells the client why the engine ended its session."""
    if reason == "max_frames":
        return Close(CloseCode.NORMAL, "max_session_length", "maximum session length reached")
    if reason == "engine_stopped":
        return Close(CloseCode.GOING_AWAY, "server_shutdown", "the server is shutting down")
    if reason == "engine_error":
        return Close(CloseCode.INTERNAL_ERROR, "engine_error", "the model failed on this session; please reconnect")
    return Close(CloseCode.INTERNAL_ERROR, "session_ended", f"the session ended ({reason})")
