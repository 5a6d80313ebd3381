"""The Realtime API's WebRTC routes, as OpenAI serves them, so that OpenAI's own WebRTC clients work unchanged.

- `POST /v1/realtime/calls`: an SDP offer, as `application/sdp` (the browser SDK, with an `ek_` key) or as
  `multipart/form-data` with `sdp` and an optional `session` (an app server, with the server's key) → 201, the SDP
  answer, `Location: /v1/realtime/calls/{call_id}`. `POST /v1/realtime?model=...` is the beta spelling.
- `POST /v1/realtime/calls/{call_id}/hangup`: the server ends a call.
- `POST /v1/realtime/client_secrets` (and beta `POST /v1/realtime/sessions`): ephemeral `ek_` keys, minted with
  the server's key, for web pages.

Errors are OpenAI's JSON shape (`ApiError`, turned into its response by the app's handler). The call itself is
`call.py`: a Moshi conversation, or a voice agent on a server with `--llm` (`agent_call.py`, its session and keys
read as an agent's); aiortc is imported only when a call comes, and without the `webrtc` extra these routes answer
501 naming it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError

from duplexd.server.connection.access import access_denied, presented_key
from duplexd.server.connection.admission import Refusal, admit
from duplexd.server.connection.client_secrets import ClientSecret
from duplexd.server.connection.closing import Close, CloseCode
from duplexd.server.connection.query import BadQuery, sampling_from_query
from duplexd.server.core.api_error import ApiError
from duplexd.server.core.context import Context, ServerContext
from duplexd.server.realtime import agent_events as aev
from duplexd.server.realtime import events as ev
from duplexd.server.stt.session import asr_parameters

from . import stack

logger = logging.getLogger(__name__)
router = APIRouter()

BETA_KEY_SECONDS = 60.0  # "all tokens expire after one minute" (the beta /v1/realtime/sessions)
MAX_OFFER_BYTES = 64 * 1024


class ExpiresAfter(BaseModel):
    anchor: str = "created_at"
    seconds: int = Field(ge=10, le=7200)


class SecretRequest(BaseModel):
    expires_after: ExpiresAfter | None = None
    session: dict[str, Any] | None = None


def _own(session: dict[str, Any]) -> dict[str, Any]:
    """A session configuration without what the server decides itself (it serves one model, as a realtime one)."""
    return {k: v for k, v in session.items() if k not in ("type", "model")}


def _check_access(request: Request, ctx: ServerContext, minted_ok: bool = True) -> None:
    """`access_denied`'s refusal as HTTP: 401 for the key, 403 for the origin."""
    denied = access_denied(
        request, ctx.settings.api_key, ctx.settings.allowed_origins, ctx.client_secrets if minted_ok else None
    )
    if denied:
        raise ApiError(401 if denied[0] == "invalid_api_key" else 403, denied[1], denied[0])


async def _offer(request: Request) -> tuple[str, dict[str, Any] | None]:
    """The SDP offer and the session configuration the request carries."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "multipart/form-data":
        form = await request.form()
        sdp, session = form.get("sdp"), form.get("session")
        if not isinstance(sdp, str) or not sdp.strip():
            raise ApiError(400, "the form needs an 'sdp' field holding the SDP offer", "invalid_offer", "sdp")
        config = None
        if isinstance(session, str) and session.strip():
            try:
                config = json.loads(session)
            except ValueError as e:
                raise ApiError(400, f"'session' is not JSON: {e}", "invalid_value", "session") from None
            if not isinstance(config, dict):
                raise ApiError(400, "'session' must be a JSON object", "invalid_value", "session")
        return sdp, config
    if kind in ("application/sdp", "text/plain", ""):
        body = await request.body()
        if len(body) > MAX_OFFER_BYTES:
            raise ApiError(413, f"the SDP offer is over {MAX_OFFER_BYTES} bytes", "invalid_offer")
        sdp = body.decode("utf-8", "replace")
        if not sdp.strip():
            raise ApiError(400, "the request body must be the SDP offer", "invalid_offer")
        return sdp, None
    raise ApiError(
        415,
        f"send the SDP offer as application/sdp, or multipart/form-data with sdp and session (got {kind})",
        "unsupported_content_type",
    )


@router.post("/v1/realtime/calls", status_code=201)
@router.post("/v1/realtime", status_code=201)  # the beta spelling (`?model=` ignored: the server has one model)
async def create_call(request: Request, ctx: Context) -> Response:
    _check_access(request, ctx)
    if not ctx.settings.webrtc:
        raise ApiError(404, "WebRTC calls are off on this server (--no-webrtc): use the WebSocket", "webrtc_off")
    if not stack.available():
        raise ApiError(501, stack.EXTRA_MISSING, "webrtc_unavailable")
    sdp, config = await _offer(request)
    if config is None:
        key = ctx.client_secrets.get(presented_key(request))
        config = key.session if key is not None else None
    config = _own(config) if config else None
    runtime, metrics = ctx.runtime, ctx.metrics
    if not runtime.ready:
        raise ApiError(503, runtime.failed or "the server is warming up: try again shortly", "not_ready")
    agent = ctx.runtime.agents is not None
    try:  # an agent hears with the STT model, which takes no sampling (as its WebSocket)
        params = asr_parameters()[0] if agent else sampling_from_query(request.query_params)
    except BadQuery as e:
        raise ApiError(400, str(e), "invalid_parameter") from None
    try:
        session = admit(ctx, "webrtc", params)
    except Refusal as r:
        raise ApiError(503 if r.busy else 400, str(r), r.error) from None
    # aiortc, the optional extra, from here on
    from .agent_call import AgentCall  # noqa: PLC0415
    from .call import BadOffer, Call, CallAdapter  # noqa: PLC0415

    call_id = ev.new_id("rtc")
    call = Call(call_id, ctx, session, config, AgentCall if agent else CallAdapter)
    try:
        answer = await call.answer(sdp)
    except BadOffer as e:
        session.close("client")
        await call.hang_up()
        raise ApiError(400, str(e), "invalid_offer", "sdp") from None
    except BaseException:
        session.close("client")
        await call.hang_up()
        raise
    metrics.sessions.labels("webrtc").inc()
    ctx.calls[call_id] = call
    call.task = asyncio.create_task(call.run(), name=f"call-{call_id}")
    call.task.add_done_callback(lambda _: ctx.calls.pop(call_id, None))
    logger.info("call %s answered (slot %d)", call_id, session.slot)
    location = f"/v1/realtime/calls/{call_id}"
    return Response(answer, status_code=201, media_type="application/sdp", headers={"Location": location})


async def end_calls(ctx: ServerContext, timeout: float = 5.0) -> None:
    """At shutdown: every call still connecting (the drain ends those talking) ends, its slot freed."""
    calls = list(ctx.calls.values())
    for call in calls:
        call.end(Close(CloseCode.GOING_AWAY, "server_shutdown", "the server is shutting down"))
    tasks = [call.task for call in calls if call.task is not None]
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


@router.post("/v1/realtime/calls/{call_id}/hangup")
async def hangup(request: Request, ctx: Context, call_id: str) -> Response:
    _check_access(request, ctx, minted_ok=False)
    call = ctx.calls.get(call_id)
    if call is None or call.ending:
        raise ApiError(404, f"no call {call_id!r} in progress", "call_id_not_found", "call_id")
    call.end(Close(CloseCode.NORMAL, "hangup", "the call was hung up by the server"))
    return Response(status_code=200)


def _mint(ctx: ServerContext, seconds: float, session: dict[str, Any]) -> ClientSecret:
    """A key for `session`, checked as the `session.update` its sessions will start with."""
    try:
        (aev.parse_session if ctx.runtime.agents is not None else ev.parse_session)(_own(session))
    except ev.RealtimeError as e:
        raise ApiError(400, e.message, e.code, e.param) from None
    return ctx.client_secrets.mint(seconds, session)


@router.post("/v1/realtime/client_secrets")
async def mint(request: Request, ctx: Context) -> Response:
    _check_access(request, ctx, minted_ok=False)
    try:
        body = SecretRequest.model_validate_json(await request.body() or b"{}")
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"])
        raise ApiError(400, f"bad {param or 'body'}: {err['msg']}", "invalid_value", param or None) from None
    seconds = body.expires_after.seconds if body.expires_after else ctx.settings.client_secret_seconds
    session = body.session or {}
    key = _mint(ctx, seconds, session)
    shown = {"type": "realtime", **session, "model": ctx.runtime.info.id}
    return JSONResponse({"value": key.value, "expires_at": int(key.expires_at), "session": shown})


@router.post("/v1/realtime/sessions")
async def beta_mint(request: Request, ctx: Context) -> Response:
    _check_access(request, ctx, minted_ok=False)
    try:
        session = json.loads(await request.body() or b"{}")
    except ValueError as e:
        raise ApiError(400, f"the body is not JSON: {e}", "invalid_json") from None
    if not isinstance(session, dict):
        raise ApiError(400, "the body must be a JSON object (the session)", "invalid_value")
    key = _mint(ctx, BETA_KEY_SECONDS, session)
    body = {
        "id": ev.new_id("sess"),
        "object": "realtime.session",
        **session,
        "model": ctx.runtime.info.id,
        "client_secret": {"value": key.value, "expires_at": int(key.expires_at)},
        "created_at": int(time.time()),
    }
    return JSONResponse(body)
