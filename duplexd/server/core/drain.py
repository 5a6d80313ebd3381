"""Graceful drain for `duplexd serve`: on SIGTERM or SIGINT the listener stays up while open sessions finish.

uvicorn's own handlers stop listening at once and drop every WebSocket (close 1012), which would cut each
conversation mid-sentence and hide `/ready` from the balancer. Instead the first signal turns `/ready` to 503
(`"draining": true`, so HAProxy or Kubernetes stop sending new sessions here) and refuses new sessions (1013
`server_draining`, so clients retry and land on another replica); open sessions go on for up to the drain timeout,
any still open then get 1001 `server_shutdown`, and only then does uvicorn's shutdown start. The process exits 0.
A second signal ends the drain at once; a third skips uvicorn's wait for connections.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from types import FrameType
from typing import Protocol

import uvicorn

from duplexd.server.connection.closing import Close, CloseCode

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05
CLOSE_WAIT_SECONDS = 5.0  # for sessions told to go away to send their close frames


class Open(Protocol):
    """An open connection the drain can end (a session's pump, a speech stream)."""

    def end(self, close: Close) -> None: ...


class Drain:
    """The open sessions and whether the server is draining: read by `/ready` and admission, run by the server."""

    def __init__(self) -> None:
        self.draining = False
        self._pumps: set[Open] = set()
        self._cut = False

    @property
    def open_sessions(self) -> int:
        return len(self._pumps)

    def add(self, pump: Open) -> None:
        self._pumps.add(pump)

    def discard(self, pump: Open) -> None:
        self._pumps.discard(pump)

    def cut(self) -> None:
        """Stop waiting for sessions to end by themselves (a second signal)."""
        self._cut = True

    async def _until(self, deadline: float) -> bool:
        """Wait until no session is open (True), the deadline passes or the drain is cut (False)."""
        while self._pumps:
            if self._cut or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_SECONDS)
        return True

    async def run(self, timeout: float) -> None:
        """Refuse new sessions, let the open ones go on for up to `timeout` seconds, then tell the rest to go."""
        self.draining = True
        logger.info(
            "draining: /ready is 503 and new sessions are refused; %d open session(s) have up to %g s",
            len(self._pumps),
            timeout,
        )
        if await self._until(time.monotonic() + timeout):
            logger.info("drained: no session open")
            return
        logger.warning(
            "drain %s: closing %d open session(s) with 1001",
            "cut short" if self._cut else "timed out",
            len(self._pumps),
        )
        going = Close(CloseCode.GOING_AWAY, "server_shutdown", "server going away: reconnect to another replica")
        for pump in list(self._pumps):
            pump.end(going)
        self._cut = False
        await self._until(time.monotonic() + CLOSE_WAIT_SECONDS)


class DrainingServer(uvicorn.Server):
    """uvicorn with the drain in front of its shutdown: signals start the drain instead of stopping the server."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout: float) -> None:
        super().__init__(config)
        self.drain, self.drain_timeout = drain, timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        self._task: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (main thread). Unlike uvicorn's, it does not re-raise the signal after the shutdown, so a
        drained server exits 0 rather than 130 or by SIGTERM."""
        self._signals += 1
        name = signal.Signals(sig).name
        if self._signals == 1 and self._loop is not None:
            self.drain.draining = True  # now, not when the loop gets to the drain: /ready must not lag the signal
            logger.info("%s: draining for up to %g s (signal again to stop sooner)", name, self.drain_timeout)
            self._loop.call_soon_threadsafe(self._start_drain)
        elif self._signals == 2 and self._loop is not None:
            logger.info("%s again: ending the drain now", name)
            self.drain.cut()
        else:
            logger.info("%s: stopping without waiting for connections", name)
            self.should_exit = self.force_exit = True

    def _start_drain(self) -> None:
        self._task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.drain.run(self.drain_timeout)
        except Exception:  # noqa: BLE001 - the server must still stop
            logger.exception("drain failed; shutting down")
        finally:
            self.should_exit = True
