"""The steps every WebSocket goes through before its session starts: access, parameters, a slot.

The upgrade is accepted first so that every refusal reaches the client as a protocol error message plus a close
code (1008 access, 1007 bad parameters, 1013 no capacity or draining), never as a silent HTTP 403 or a hang. The
slot itself (`admit`) is the same step for a WebRTC call, which says its `Refusal` as an HTTP error instead, and for
moshi-server's POST of a file, which waits for one (`admit_waiting`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from starlette.websockets import WebSocket

from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.dialogue.session import Session
from duplexd.engine.errors import CapacityError
from duplexd.engine.persona.prompt import PersonaPrompt
from duplexd.server.core.context import ServerContext

from .access import access_denied
from .closing import Close, CloseCode
from .pump import Adapter, Pump, close_connection
from .query import BadQuery

logger = logging.getLogger(__name__)


class Refusal(Exception):  # noqa: N818 - an answer, not a failure
    """Why a session got no slot, for each transport to say in its own terms: `busy` (draining or full: try again
    later or elsewhere) or a parameter the engine cannot take; `error` is the protocol's code for it."""

    def __init__(self, error: str, message: str, busy: bool) -> None:
        super().__init__(message)
        self.error, self.busy = error, busy


def admit(
    ctx: ServerContext,
    name: str,
    params: SamplingParams,
    max_frames: int | None = None,
    prompt: PersonaPrompt | None = None,
) -> Session:
    """A slot for a session that passed access and its parameters; `Refusal` (counted in the metrics) while the
    server drains, when it is full or warming up, or when the engine cannot take the persona `prompt`."""
    metrics = ctx.metrics
    if ctx.drain.draining:
        metrics.refused.labels("draining").inc()
        raise Refusal("server_draining", "server draining (shutting down): connect to another replica", busy=True)
    try:
        return ctx.runtime.open_session(params, max_frames, prompt)
    except CapacityError as e:
        metrics.refused.labels("capacity").inc()
        logger.info("%s session refused: %s", name, e)
        raise Refusal("capacity", f"server at capacity: {e}", busy=True) from None
    except ValueError as e:  # the engine cannot take this persona's prompt (checked before, said again)
        metrics.refused.labels("invalid_parameter").inc()
        raise Refusal("invalid_parameter", f"persona prompt refused: {e}", busy=False) from None


async def admit_waiting(ctx: ServerContext, name: str, params: SamplingParams, seconds: float, retry: float) -> Session:
    """`admit` for a request that waits for a slot while the server is full rather than be refused at once (moshi-
    server's POST tries 1000 times, 100 ms apart): a slot is tried every `retry` s for `seconds`, or until the server
    drains, and then `admit` decides, so that a refusal is counted and logged once, as the one it is."""
    deadline = time.monotonic() + seconds
    while not ctx.drain.draining and time.monotonic() < deadline:
        try:
            return ctx.runtime.open_session(params)
        except CapacityError:
            await asyncio.sleep(retry)
    return admit(ctx, name, params)


async def serve(
    ctx: ServerContext,
    ws: WebSocket,
    adapter: Adapter,
    subprotocol: str | None,
    parameters: Callable[[], tuple[SamplingParams, int | None]],
    admitted: Callable[[Pump], Awaitable[None]],
) -> None:
    """Accept, admit and pump one connection (`adapter` speaks on `ws`); `admitted` sends the protocol's greeting
    (handshake, session)."""
    metrics = ctx.metrics
    await ws.accept(subprotocol=subprotocol)
    try:
        denied = access_denied(ws, ctx.settings.api_key, ctx.settings.allowed_origins, ctx.client_secrets)
        if denied:
            metrics.refused.labels(denied[0]).inc()
            raise Close(CloseCode.POLICY_VIOLATION, *denied)
        try:
            params, max_frames = parameters()
        except BadQuery as e:
            metrics.refused.labels("invalid_parameter").inc()
            raise Close(CloseCode.INVALID_PAYLOAD, "invalid_parameter", str(e)) from None
        try:
            session = admit(ctx, adapter.name, params, max_frames, adapter.opening_prompt())
        except Refusal as r:
            code = CloseCode.TRY_AGAIN_LATER if r.busy else CloseCode.INVALID_PAYLOAD
            raise Close(code, r.error, str(r)) from None
    except Close as close:
        await close_connection(adapter, close, ctx.settings.send_timeout)
        return
    metrics.sessions.labels(adapter.name).inc()
    logger.info("%s session %s admitted (slot %d, seed %d)", adapter.name, session.id, session.slot, params.seed)
    pump = Pump(adapter, session, ctx.limits, metrics, ctx.runtime.transcription)
    ctx.drain.add(pump)
    try:
        try:
            await admitted(pump)
        except BaseException as e:  # the client went away during the greeting, or the server is stopping
            pump.stop_transcribing()
            pump.session.close("client")
            metrics.closed.labels("lost").inc()
            if not isinstance(e, Exception):
                raise
            return
        end = await pump.run()
    finally:
        ctx.drain.discard(pump)
    logger.info("%s session %s ended: %s", adapter.name, pump.session.id, end.error if isinstance(end, Close) else end)
