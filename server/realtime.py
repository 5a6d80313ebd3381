"""`WS /v1/realtime`: an OpenAI Realtime subset in duplex mode (JSON events, base64 pcm16 at 24 kHz).

The session is admitted on connect (`session.created`, or an `error` with code `resource_exhausted` and close
1013). Audio flows both ways continuously: every output frame is a `response.output_audio.delta`, and the model's
text a `response.output_audio_transcript.delta`, all within one long response. Sampling can be changed by
`session.update` at any time (`session.sampling`), or set on connect by the Kyutai server's query parameters
(`text_temperature`, ..., `repetition_penalty`, `pad_mult`); the engine applies an update from its next step and
the conversation goes on. Malformed JSON or base64, binary frames and unknown event types end the connection with
an `error` event and a close code; turn-taking events get a non-fatal `unsupported_event`, and a bad session
update a non-fatal `invalid_value` naming the parameter.

Transcription of the user's speech (when the server has a transcriber, `--transcribe`): a `session.update` with
`input_audio_transcription` (or GA `audio.input.transcription`) starts it, `null` stops it. Each utterance the
service's VAD finds becomes one user item: `input_audio_buffer.speech_started`, `.speech_stopped`, `.committed`,
`conversation.item.added`/`.done`, then `conversation.item.input_audio_transcription.delta` and `.completed` (or
`.failed`). Audio times count from the session's first audio. When the transcriber is absent or full, the update
gets a non-fatal `transcription_unavailable` and the conversation goes on untranscribed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from fastapi import APIRouter, WebSocket

from duplexd.engine.config import SamplingParams
from duplexd.engine.errors import CapacityError
from duplexd.engine.session import SessionOutput
from duplexd.engine.transcription import (
    SpeechBegan,
    SpeechEnded,
    TranscriptDelta,
    TranscriptDone,
    TranscriptEvent,
    TranscriptFailed,
)
from duplexd.wire import SAMPLE_RATE

from . import realtime_events as ev
from .access import offered_subprotocols
from .admission import serve
from .closing import Close, CloseCode
from .context import Context, ServerContext
from .pump import Adapter, Pump
from .query import sampling_from_query

logger = logging.getLogger(__name__)
router = APIRouter()


@dataclass
class UserItem:
    """One utterance's user item: its id from speech_started on; created (committed) when speech stops."""

    id: str
    committed: bool = False
    ended: bool = False  # speech stopped
    failed: bool = False


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
        # Transcription: the settings shown in the session object (None: off), the samples received before it
        # started (its event times count from there), its items by utterance number.
        self.transcription: dict | None = None
        self.samples_in = 0
        self.transcript_offset = 0
        self.user_items: dict[int, UserItem] = {}
        self.last_user_item: str | None = None

    def session_object(self, params: SamplingParams) -> dict:
        return ev.session_object(
            self.session_id,
            self.ctx.runtime.info.id,
            params,
            self.ctx.settings.max_session_seconds,
            self.transcription,
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
                pcm = ev.decode_audio(event)
                self.samples_in += len(pcm)
                return pcm
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
        """Apply an update whole or not at all: a refused value or an unavailable transcriber changes nothing."""
        pump = self.pump
        assert pump is not None
        params = event.sampling(pump.session.params)
        transcription = event.transcription()
        if transcription is not None:
            self.set_transcription(pump, event, *transcription)
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

    def set_transcription(
        self, pump: Pump, event: ev.SessionUpdate, param: str, settings: ev.TranscriptionSettings | None
    ) -> None:
        """Start or stop transcribing, or change the prompt of the running stream (for the utterances that begin
        from now on); `RealtimeError` when there is no transcriber for this session."""
        if settings is None:
            pump.stop_transcribing()
            self.transcription = None
            self.user_items.clear()
            return
        prompt = ev.transcription_prompt(settings)
        if pump.transcript is not None:
            pump.transcript.prompt = prompt  # read by the service when an utterance begins
        else:
            try:
                pump.transcribe(prompt)
            except CapacityError as e:
                raise ev.RealtimeError(
                    "transcription_unavailable", f"cannot transcribe this session: {e}", event.event_id, param
                ) from None
            self.transcript_offset = self.samples_in
        self.transcription = ev.transcription_object(self.ctx.runtime.info.transcriber or "unknown", settings)

    async def send_transcript(self, event: TranscriptEvent) -> None:
        if self.transcription is None:  # turned off: what the stopped stream had left is not wanted
            return
        messages: list[str] = []
        if isinstance(event, SpeechBegan):
            item = self.user_items[event.item] = UserItem(ev.new_id("item"))
            messages.append(ev.speech_started(item.id, self.audio_ms(event.start_s)))
        elif isinstance(event, SpeechEnded):
            item = self.user_item(event.item)
            item.ended = True
            messages.append(ev.speech_stopped(item.id, self.audio_ms(event.end_s)))
            messages += self.commit(item)
            if item.failed:  # it failed while it was spoken: nothing more will come for it
                del self.user_items[event.item]
        elif isinstance(event, TranscriptDelta):
            item = self.user_item(event.item)
            messages += self.commit(item)
            messages.append(ev.input_transcript_delta(item.id, event.text))
        elif isinstance(event, TranscriptDone):
            item = self.user_item(event.item)
            messages += self.commit(item)
            messages.append(ev.input_transcript_completed(item.id, event.text, event.end_s - event.start_s))
            self.user_items.pop(event.item, None)
        elif isinstance(event, TranscriptFailed):
            messages += self.fail(event)
        async with self.send_lock:
            for message in messages:
                await self.ws.send_text(message)

    def audio_ms(self, seconds: float) -> int:
        """Milliseconds of the session's input audio for a time on the transcript stream's timeline."""
        return round(self.transcript_offset * 1000 / SAMPLE_RATE + seconds * 1000)

    def user_item(self, number: int) -> UserItem:
        """The item of utterance `number` (one the service never announced gets an id now, so that every event
        names an item)."""
        if number not in self.user_items:
            self.user_items[number] = UserItem(ev.new_id("item"))
        return self.user_items[number]

    def commit(self, item: UserItem) -> list[str]:
        if item.committed:
            return []
        item.committed = True
        previous, self.last_user_item = self.last_user_item, item.id
        return ev.item_committed(item.id, previous)

    def fail(self, event: TranscriptFailed) -> list[str]:
        """A failed utterance: committed now if speech goes on (its speech_stopped still comes, for the same
        item). A failure for an utterance that never began means the transcriber itself failed: every open item
        fails with it, and the client also gets a non-fatal `error`."""
        item = self.user_items.get(event.item)
        if item is not None:
            item.failed = True
            if item.ended:
                del self.user_items[event.item]
            return [*self.commit(item), ev.input_transcript_failed(item.id, event.reason)]
        messages = []
        for item in self.user_items.values():
            messages += [*self.commit(item), ev.input_transcript_failed(item.id, event.reason)]
        self.user_items.clear()
        messages.append(ev.error_event("transcription_failed", event.reason, kind="server_error"))
        return messages


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket, ctx: Context) -> None:
    adapter = RealtimeAdapter(ws, ctx)
    subprotocol = ev.SUBPROTOCOL if ev.SUBPROTOCOL in offered_subprotocols(ws) else None

    async def greet(pump: Pump) -> None:
        adapter.pump = pump
        await adapter.send_text(ev.session_created(adapter.session_object(pump.session.params)))

    await serve(ctx, adapter, subprotocol, lambda: (sampling_from_query(ws.query_params), None), greet)
