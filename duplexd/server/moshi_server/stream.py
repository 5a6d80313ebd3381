"""What every moshi-server streaming endpoint (`/api/asr-streaming`, and the TTS one to come) says as a stream
starts and ends: `Ready` once it has a slot, `Error` only before that, and after it the close frame alone.

moshi-server sends `Error` only to a stream that got no slot ("no free channels"). Its clients read nothing else
outside the module's own messages once `Ready` is out: Unmute's message loop raises on any type it does not know,
and its handler catches only the connection closing, so an `Error` there reaches the user as an internal error. So
before `Ready` a refusal is `Error{message}` then the close; after it, every end the server decides (drain, idle,
length, engine or codec failure, a message it cannot read) is the close frame alone, whose code and reason say why.
"""

from __future__ import annotations

import msgpack
from fastapi import WebSocket
from fastapi.responses import JSONResponse

from duplexd.server.connection.access import access_denied
from duplexd.server.connection.closing import Close
from duplexd.server.connection.pump import Adapter
from duplexd.server.core.context import ServerContext

NO_FREE_CHANNELS = "no free channels"  # moshi-server's refusal at capacity, which Unmute recognises


def ready() -> dict:
    return {"type": "Ready"}


def error(message: str) -> dict:
    return {"type": "Error", "message": message}


def pack(message: dict) -> bytes:
    """`Ready` and `Error` as rmp_serde writes them (a struct map, the tag first): no floats to size."""
    return msgpack.packb(message)


class StreamAdapter(Adapter):
    """An adapter for one moshi-server stream: `send_ready` greets, `send_error` keeps the close rule above."""

    is_ready = False

    async def send_ready(self) -> None:
        self.is_ready = True  # from here on, no Error: even a Ready lost to a failed send was the stream's start
        await self.send_bytes(pack(ready()))

    async def send_error(self, close: Close) -> None:
        if self.is_ready:
            return  # the close frame alone says why
        await self.send_bytes(pack(error(NO_FREE_CHANNELS if close.error == "capacity" else close.message)))


async def refuse_upgrade(ws: WebSocket, ctx: ServerContext) -> bool:
    """Refuse the upgrade as moshi-server does, with HTTP 401 without the API key (403 for a browser origin not
    allowed); True when refused. A server without the denial extension accepts, and admission refuses with a
    close code."""
    denied = access_denied(ws, ctx.settings.api_key, ctx.settings.allowed_origins)
    if denied is None or "websocket.http.response" not in ws.scope.get("extensions", {}):
        return False
    ctx.metrics.refused.labels(denied[0]).inc()
    status = 401 if denied[0] == "invalid_api_key" else 403
    await ws.send_denial_response(JSONResponse({"error": denied[0], "message": denied[1]}, status_code=status))
    return True
