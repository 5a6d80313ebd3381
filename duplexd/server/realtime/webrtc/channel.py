"""A call's `oai-events` data channel, shaped as the WebSocket a session's pump and adapter talk to.

The Realtime API's events travel on it exactly as on `/v1/realtime`'s socket, so the same adapter handles them.
A message received is an ASGI `websocket.receive`; the channel or the peer connection ending is a
`websocket.disconnect` (code 1000: a client hang-up is a normal end); `close` hangs the call up. What is sent goes
to the call's sideband sockets too (`sideband.py`), whichever adapter sends it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.datastructures import Headers, QueryParams
from starlette.types import Message
from starlette.websockets import WebSocket, WebSocketState

from duplexd.server.connection.closing import Close, CloseCode
from duplexd.server.connection.pump import close_socket

SIDEBAND_SEND_SECONDS = 2.0


class ChannelSocket:
    def __init__(self, hang_up: Callable[[], Awaitable[None]]) -> None:
        self._hang_up = hang_up
        self._channel: Any = None  # aiortc's RTCDataChannel, once the caller's has opened
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.opened = asyncio.Event()
        self.query_params, self.headers = QueryParams(), Headers()
        self.client_state = WebSocketState.CONNECTING
        self.application_state = WebSocketState.CONNECTED
        self.sidebands: set[WebSocket] = set()  # control sockets attached by `?call_id=` (sideband.py)

    def attach(self, channel: Any) -> None:
        """The caller's channel: its messages are this socket's from now on."""
        self._channel = channel

        @channel.on("message")
        def on_message(message: str | bytes) -> None:
            kind = "text" if isinstance(message, str) else "bytes"
            self._inbox.put_nowait({"type": "websocket.receive", kind: message})

        @channel.on("close")
        def on_close() -> None:
            self.gone("the oai-events data channel closed")

        if channel.readyState == "open":
            self._open()
        else:
            channel.on("open", self._open)

    def _open(self) -> None:
        self.client_state = WebSocketState.CONNECTED
        self.opened.set()

    def gone(self, why: str) -> None:
        """The caller went away (channel or connection closed, failed)."""
        if self.client_state != WebSocketState.DISCONNECTED:
            self.client_state = WebSocketState.DISCONNECTED
            self._inbox.put_nowait({"type": "websocket.disconnect", "code": 1000, "reason": why})

    async def receive(self) -> Message:
        return await self._inbox.get()

    async def send_text(self, data: str) -> None:
        """On the data channel, and to every sideband (one that cannot take it in time is dropped)."""
        self._send(data)
        for ws in list(self.sidebands):
            try:
                await asyncio.wait_for(ws.send_text(data), SIDEBAND_SEND_SECONDS)
            except Exception:  # noqa: BLE001 - its reader sees it gone; the call goes on
                self.sidebands.discard(ws)

    async def end_sidebands(self) -> None:
        """The call ended: each sideband is closed (1000)."""
        for ws in list(self.sidebands):
            await close_socket(ws, Close(CloseCode.NORMAL, "call_ended", "the call ended"), SIDEBAND_SEND_SECONDS)
        self.sidebands.clear()

    async def send_bytes(self, data: bytes) -> None:
        self._send(data)

    def _send(self, data: str | bytes) -> None:
        if self._channel is None or self._channel.readyState != "open":
            raise ConnectionError("the oai-events data channel is not open")
        self._channel.send(data)

    async def drained(self, timeout: float) -> None:
        """Wait (up to `timeout`) until what was sent has left: the last event before a hang-up must arrive."""
        deadline = asyncio.get_running_loop().time() + timeout
        while (
            self._channel is not None and self._channel.bufferedAmount and asyncio.get_running_loop().time() < deadline
        ):
            await asyncio.sleep(0.01)

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.application_state = WebSocketState.DISCONNECTED
        await self._hang_up()
