"""`WS /v1/realtime`: an OpenAI Realtime subset in duplex mode (JSON events, base64 pcm16 at 24 kHz).

The session is admitted on connect (`session.created`, or an `error` with code `resource_exhausted` and close
1013). Audio flows both ways continuously: every output frame is a `response.output_audio.delta`, and the model's
text a `response.output_audio_transcript.delta`, all within one long response. Sampling can be changed by
`session.update` at any time (`session.sampling`), or set on connect by the Kyutai server's query parameters
(`text_temperature`, ..., `repetition_penalty`, `pad_mult`); the engine applies an update from its next step and
the conversation goes on. Malformed JSON or base64, binary frames and unknown event types end the connection with
an `error` event and a close code; turn-taking events get a non-fatal `unsupported_event`, and a bad session
update a non-fatal `invalid_value` naming the parameter.
"""

from __future__ import annotations

import logging

import numpy as np
from fastapi import APIRouter, WebSocket

from duplexd.engine.config import SamplingParams
from duplexd.engine.session import SessionOutput

from . import realtime_events as ev
from .access import offered_subprotocols
from .admission import serve
from .closing import Close, CloseCode
from .context import Context, ServerContext
from .pump import Adapter, Pump
from .query import sampling_from_query

logger = logging.getLogger(__name__)
router = APIRouter()


class RealtimeAdapter(Adapter):
    name = "realtime"

    def __init__(self, ws: WebSocket, ctx: ServerContext) -> None:
        super().__init__(ws)
        self.ctx = ctx
        self.pump: Pump | None = None
        self.session_id = ev.new_id("sess")
        self.response_id, self.item_id = ev.new_id("resp"), ev.new_id("item")
        self.audio_delta = ev.AudioDeltas(self.response_id, self.item_id)
        self.response_started = False

    def session_object(self, params: SamplingParams) -> dict:
        return ev.session_object(
            self.session_id, self.ctx.runtime.info.id, params, self.ctx.settings.max_session_seconds
        )

    async def on_message(self, message: dict) -> np.ndarray | None:
        text = message.get("text")
        if text is None:
            raise Close(
                CloseCode.UNSUPPORTED_DATA,
                "binary_frame",
                "binary frames are not part of this protocol: send JSON events as text",
            )
        try:
            event = ev.parse_event(text)
            if isinstance(event, ev.AudioAppend):  # the hot path: 12.5 a second per session
                return ev.decode_audio(event)
            if isinstance(event, ev.SessionUpdate):
                await self.update_session(event)
            else:
                raise ev.RealtimeError(
                    "unsupported_event",
                    f"{event.type} has no effect on a full-duplex model: it takes turns by itself",
                    event.event_id,
                )
        except ev.RealtimeError as e:
            await self.send_text(ev.error_event(e.code, e.message, event_id=e.event_id, param=e.param))
        return None

    async def update_session(self, event: ev.SessionUpdate) -> None:
        pump = self.pump
        assert pump is not None
        params = event.sampling(pump.session.params)
        if params != pump.session.params:
            pump.session.update_params(params)
        await self.send_text(ev.session_updated(self.session_object(params)))

    async def send_output(self, out: SessionOutput) -> None:
        messages = []
        if not self.response_started:
            self.response_started = True
            messages.append(ev.response_created(self.response_id))
        messages.append(self.audio_delta(out.pcm))
        if out.text:
            messages.append(ev.transcript_delta(self.response_id, self.item_id, out.text))
        async with self.send_lock:
            for message in messages:
                await self.ws.send_text(message)

    async def send_error(self, close: Close) -> None:
        kind = (
            "server_error"
            if close.code in (CloseCode.INTERNAL_ERROR, CloseCode.TRY_AGAIN_LATER, CloseCode.GOING_AWAY)
            else "invalid_request_error"
        )
        code = "resource_exhausted" if close.error == "capacity" else close.error
        await self.send_text(ev.error_event(code, close.message, kind=kind))


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket, ctx: Context) -> None:
    adapter = RealtimeAdapter(ws, ctx)
    subprotocol = ev.SUBPROTOCOL if ev.SUBPROTOCOL in offered_subprotocols(ws) else None

    async def greet(pump: Pump) -> None:
        adapter.pump = pump
        await adapter.send_text(ev.session_created(adapter.session_object(pump.session.params)))

    await serve(ctx, adapter, subprotocol, lambda: (sampling_from_query(ws.query_params), None), greet)
