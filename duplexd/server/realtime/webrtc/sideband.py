"""`WS /v1/realtime?call_id=...`: a sideband control socket on a WebRTC call, as OpenAI's.

An app server keeps the call's tools, instructions and logs on its side: it opens a WebSocket with the server's
key (not an ephemeral one) and the call id from `Location`, sends client events as the caller's data channel
would, and gets every server event of the call too. It does not carry audio out (that is on the call's track);
audio it appends goes into the session as the caller's does. The call ending closes it (1000); it closing leaves
the call as it is.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from starlette.websockets import WebSocket

from duplexd.server.connection.access import access_denied
from duplexd.server.connection.closing import Close, CloseCode, Disconnected
from duplexd.server.connection.pump import close_socket
from duplexd.server.core.context import ServerContext
from duplexd.server.realtime import events as ev

logger = logging.getLogger(__name__)


async def attach(ws: WebSocket, ctx: ServerContext, call_id: str, subprotocol: str | None) -> None:
    """Serve one sideband socket until it or its call ends."""
    await ws.accept(subprotocol=subprotocol)
    call: Any = ctx.calls.get(call_id)
    try:
        denied = access_denied(ws, ctx.settings.api_key, ctx.settings.allowed_origins)  # the server's key only
        if denied:
            raise Close(CloseCode.POLICY_VIOLATION, *denied)
        if call is None or call.pump is None or call.ending:
            raise Close(CloseCode.POLICY_VIOLATION, "call_id_not_found", f"no call {call_id!r} in progress")
        call.socket.sidebands.add(ws)
        logger.info("call %s: sideband attached", call_id)
        await ws.send_text(call.adapter.session_created())
        await call.pump.read(ws)  # its events act on the call, as the caller's do
    except Disconnected:
        pass
    except Close as close:  # refused, or a fatal event on the sideband: that ends the sideband, not the call
        with contextlib.suppress(Exception):
            await ws.send_text(ev.close_error(close))
        await close_socket(ws, close, ctx.settings.send_timeout)
    finally:
        if call is not None and ws in call.socket.sidebands:
            call.socket.sidebands.discard(ws)
            logger.info("call %s: sideband detached", call_id)
