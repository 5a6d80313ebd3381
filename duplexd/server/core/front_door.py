"""The front door: what a TCP connection must do before a request reaches the app, and how many may be open.

uvicorn waits forever for a request head and accepts every connection, so a client that opens sockets and says
nothing would hold the process's file descriptors until it runs out. `FrontDoor` bounds both, from accept to close:

* header timeout: a connection whose request head (request line and headers; a WebSocket handshake is one) is not
  complete `--header-timeout` seconds after it opened is closed. On a keep-alive connection the clock starts again
  with the first byte after a response (idle between requests, uvicorn's keep-alive timeout applies), so a second
  request that stalls half-way is closed too.
* caps: connections open per client address (`--max-connections-per-ip`) and in all (`--max-connections`), a
  WebSocket counted until it closes. A connection over a cap gets a short grace to send its head, which is
  answered 503 naming the limit (a WebSocket upgrade gets it as its handshake response: it is never accepted); at
  most `WAITING_REFUSALS` refused connections wait at once, any more are closed at accept.

The limits are applied by subclasses of the protocols uvicorn runs: its httptools HTTP protocol (what
`http="auto"` picks, uvicorn[standard] installs httptools) and whatever WebSocket protocol `ws="auto"` picks.
Everything runs on the event loop, so the bookkeeping needs no lock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

if TYPE_CHECKING:
    from .metrics import Metrics
    from .settings import ServerSettings

logger = logging.getLogger(__name__)

REFUSAL_GRACE_SECONDS = 1.0  # how long a refused connection may take to send the head its 503 answers
WAITING_REFUSALS = 64  # refused connections waiting for their head at once; more are closed at accept
FD_RESERVE = 256  # descriptors besides the connections: model files, engine and codec threads, logs, pipes


@dataclass(frozen=True)
class Refusal:
    """Why a connection is over a cap, and the ASGI app that answers its request (or WebSocket handshake) with a
    503 saying so. `answered`: it may wait for its head to get that answer; if not, it is closed at accept."""

    reason: Literal["per_ip", "total"]
    option: str
    limit: int
    address: str
    answered: bool

    @property
    def message(self) -> str:
        where = f"from {self.address}" if self.reason == "per_ip" else "to this server"
        return f"more than {self.limit} connections {where} ({self.option}): close some or try again later"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = json.dumps({"error": "too_many_connections", "message": self.message}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", b"1"),
            (b"connection", b"close"),
        ]
        if scope["type"] == "websocket":
            if "websocket.http.response" not in scope.get("extensions", {}):
                await send({"type": "websocket.close", "code": 1013})  # uvicorn answers a bare 403
                return
            await send({"type": "websocket.http.response.start", "status": 503, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})


@dataclass
class _Record:
    address: str
    refusal: Refusal | None


class FrontDoor:
    """The open connections (by any key, uvicorn's transports in the server) and the limits they pass; the
    protocol classes from `protocols()` apply it to a uvicorn server."""

    def __init__(
        self,
        header_timeout: float,
        per_address: int,
        total: int,
        metrics: Metrics | None = None,
        waiting_refusals: int = WAITING_REFUSALS,
    ) -> None:
        self.header_timeout, self.per_address_limit, self.total_limit = header_timeout, per_address, total
        self.metrics, self.waiting_limit = metrics, waiting_refusals
        self._records: dict[Hashable, _Record] = {}
        self._per_address: Counter[str] = Counter()
        self.admitted = 0  # connections within the caps
        self.waiting = 0  # refused connections waiting for their head

    @classmethod
    def from_settings(cls, settings: ServerSettings, metrics: Metrics | None = None) -> FrontDoor:
        return cls(settings.header_timeout, settings.max_connections_per_ip, settings.max_connections, metrics)

    @property
    def open_connections(self) -> int:
        return len(self._records)

    def connections_from(self, address: str) -> int:
        return self._per_address[address]

    def open(self, key: Hashable, address: str) -> Refusal | None:
        """Count a new connection: None when it is within the caps, else its refusal (counted while it waits)."""
        refusal = self._refusal(address)
        if refusal is not None and self.metrics is not None:
            self.metrics.connections_refused.labels(refusal.reason).inc()
        if refusal is not None and not refusal.answered:
            return refusal
        self._records[key] = _Record(address, refusal)
        if refusal is None:
            self.admitted += 1
            self._per_address[address] += 1
        else:
            self.waiting += 1
        if self.metrics is not None:
            self.metrics.connections_open.inc()
        return refusal

    def _refusal(self, address: str) -> Refusal | None:
        answered = self.waiting < self.waiting_limit
        if self._per_address[address] >= self.per_address_limit:
            return Refusal("per_ip", "--max-connections-per-ip", self.per_address_limit, address, answered)
        if self.admitted >= self.total_limit:
            return Refusal("total", "--max-connections", self.total_limit, address, answered)
        return None

    def refusal(self, key: Hashable) -> Refusal | None:
        record = self._records.get(key)
        return record.refusal if record is not None else None

    def timed_out(self, key: Hashable) -> None:
        """A connection within the caps whose head did not come in time (refused ones are counted as refused)."""
        if self.refusal(key) is None and self.metrics is not None:
            self.metrics.connections_timed_out.inc()

    def close(self, key: Hashable) -> None:
        """The connection is gone (idempotent: closed before it was counted, or told twice)."""
        record = self._records.pop(key, None)
        if record is None:
            return
        if record.refusal is not None:
            self.waiting -= 1
        else:
            self.admitted -= 1
            self._per_address[record.address] -= 1
            if not self._per_address[record.address]:
                del self._per_address[record.address]
        if self.metrics is not None:
            self.metrics.connections_open.dec()

    def protocols(self) -> tuple[type[asyncio.Protocol], type[asyncio.Protocol]]:
        """uvicorn's HTTP and WebSocket protocol classes bound to this door, for `uvicorn.Config(http=, ws=)`."""
        if not isinstance(AutoWebSocketsProtocol, type):
            raise RuntimeError("no WebSocket library for uvicorn: install websockets")
        http = type("FrontDoorHttp", (_GuardedHttp,), {"door": self})
        websocket = type("FrontDoorWebSocket", (_CountedWebSocket, AutoWebSocketsProtocol), {"door": self})
        return http, websocket

    def check_fd_limit(self) -> None:
        """Raise the soft open-file limit to what the caps need (up to the hard limit), or warn that it is lower:
        past it, accept fails and the caps never get to act."""
        needed = self.total_limit + self.waiting_limit + FD_RESERVE
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
            if raised > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
                soft = raised
        if soft != resource.RLIM_INFINITY and soft < needed:
            logger.warning(
                "the open-file limit (ulimit -n) is %d, below the %d that --max-connections %d needs: raise it or "
                "lower --max-connections",
                soft,
                needed,
                self.total_limit,
            )


class _GuardedHttp(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with the header timeout and the caps of its `door`."""

    door: ClassVar[FrontDoor]
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        refusal = self.door.open(transport, self.client[0] if self.client else "unknown")
        if refusal is None:
            self._arm(self.door.header_timeout)
        elif refusal.answered:
            self.app = refusal  # answers every request on this connection; Connection: close ends it
            self._arm(min(REFUSAL_GRACE_SECONDS, self.door.header_timeout))
        else:
            transport.close()

    def data_received(self, data: bytes) -> None:
        if self.timeout_keep_alive_task is not None:  # idle after a response: these bytes begin the next head
            self._arm(self.door.header_timeout)
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.door.close(self.transport)
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(seconds, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.door.timed_out(self.transport)
            logger.debug("%s: no complete request head in time; closing", self.client)
            self.transport.close()


class _CountedWebSocket(asyncio.Protocol):
    """Mixed into uvicorn's WebSocket protocol: the connection stays counted after the upgrade until it closes, and
    an upgrade over a cap is answered by its `Refusal` (503) instead of the app."""

    door: ClassVar[FrontDoor]
    app: Any  # uvicorn's WebSocket protocols run `self.app` for the handshake
    _counted: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._counted = transport
        refusal = self.door.refusal(transport)
        if refusal is not None:
            self.app = refusal

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            super().connection_lost(exc)
        finally:
            if self._counted is not None:
                self.door.close(self._counted)
