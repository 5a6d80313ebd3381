"""`WS /v1/realtime`: an OpenAI Realtime subset in duplex mode (JSON events, base64 pcm16 at 24 kHz).

The session is admitted on connect (`session.created`, or an `error` with code `resource_exhausted` and close
1013). Audio flows both ways continuously: every output frame is a `response.output_audio.delta`, and the model's
text a `response.output_audio_transcript.delta`, all within one long response. Sampling can be changed by
`session.update` at any time (`session.sampling`), or set on connect by the Kyutai server's query parameters
(`text_temperature`, ..., `repetition_penalty`, `pad_mult`); the engine applies an update from its next step and
the conversation goes on. Malformed JSON or base64, binary frames and unknown event types end the connection with
an `error` event and a close code; turn-taking events get a non-fatal `unsupported_event`, and a bad session
update a non-fatal `invalid_value` naming the parameter. Every item the session announces (the model's one item,
the user's utterances) can be retrieved (`conversation.item.retrieve`); the model's can be truncated (acknowledged:
its context is not rewound); `response.cancel` is accepted with no effect (the one response goes on, the model
yields the turn by itself). OpenAI's SDKs send all three in their default session.

A PersonaPlex model with voices gives each session a persona: `session.instructions` (the role text) and
`session.voice` (a voice from `/v1/models`), PersonaPlex's defaults until set, or `text_prompt` / `voice_prompt` in
the query. It may change until the first `input_audio_buffer.append`, which fixes it and starts its prompt before
that audio is queued; a change after that is a non-fatal `persona_locked`. Other models ignore both, as before.

Transcription of the user's speech (when the server has a transcriber, `--transcribe`): a `session.update` with
`input_audio_transcription` (or GA `audio.input.transcription`) starts it, `null` stops it. Each utterance the
service's VAD finds becomes one user item: `input_audio_buffer.speech_started`, `.speech_stopped`, `.committed`,
`conversation.item.added`/`.done`, then `conversation.item.input_audio_transcription.delta` and `.completed` (or
`.failed`). Audio times count from the session's first audio. When the transcriber is absent or full, the rest of
the update applies and `session.updated` shows the transcription as it is (`null`): OpenAI's SDKs ask for it by
default, and some end their session on any `error`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from fastapi import APIRouter, WebSocket

from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.dialogue.session import SessionOutput
from duplexd.engine.errors import CapacityError, SessionClosed
from duplexd.engine.transcription.service import TranscriptEvent
from duplexd.server.connection.access import offered_subprotocols, presented_key
from duplexd.server.connection.admission import serve
from duplexd.server.connection.closing import Close, CloseCode
from duplexd.server.connection.pump import Adapter, Pump, Socket, text_frame
from duplexd.server.connection.query import BadQuery, sampling_from_query
from duplexd.server.core.context import Context, ServerContext
from duplexd.server.core.persona import KYUTAI, Names, Persona, PersonaRefused
from duplexd.server.realtime.webrtc import sideband
from duplexd.wire import SAMPLE_RATE

from . import events as ev
from .audio_formats import InputAudio, OutputAudio
from .items import UserItems

logger = logging.getLogger(__name__)
router = APIRouter()

NO_TRANSCRIPTION_SESSIONS = (
    "transcription sessions (intent=transcription) are served by a speech-to-text model, and this server runs a "
    "conversation model: open a conversation and turn on session.audio.input.transcription instead"
)


class RealtimeAdapter(Adapter):
    name = "realtime"

    def __init__(self, ws: Socket, ctx: ServerContext) -> None:
        super().__init__(ws)
        self.ctx = ctx
        self.pump: Pump | None = None
        self.session_id = ev.new_id("sess")
        self.response_id, self.item_id = ev.new_id("resp"), ev.new_id("item")  # the model's one response and item
        self.said: list[str] = []  # the model's text so far (its item's transcript)
        self.audio_delta = ev.AudioDeltas(self.response_id, self.item_id)
        self.input_audio, self.output_audio = InputAudio(), OutputAudio()  # pcm16 at 24 kHz until an update
        self.response_started = False
        # Transcription: the settings shown in the session object (None: off), the samples received before it
        # started (its event times count from there), its items by utterance number.
        self.transcription: dict | None = None
        self.samples_in = 0
        self.transcript_offset = 0
        self.items = UserItems(self.audio_ms)
        # Persona (PersonaPlex with voices): the defaults until a session.update sets them; fixed (its prompt
        # started) by the first audio.
        self.personas = ctx.runtime.personas
        self.persona = self.personas.default
        self.persona_fixed = False

    def parameters(self) -> tuple[SamplingParams, int | None]:
        """Sampling, and a persona, from the query string (Kyutai's names, which the browser sends); `BadQuery`
        (close 1007) for a bad one. The persona may still change by `session.update` until the first audio."""
        query = self.ws.query_params
        params = sampling_from_query(query)
        text, voice = query.get("text_prompt"), query.get("voice_prompt")
        if text is not None or voice is not None:
            try:
                self.persona = self.personas.resolve(text, voice, KYUTAI)
            except PersonaRefused as e:
                raise BadQuery(str(e)) from None
        return params, None

    def session_object(self, params: SamplingParams) -> dict:
        persona = self.persona
        return ev.session_object(
            self.session_id,
            self.ctx.runtime.info.id,
            params,
            self.ctx.settings.max_session_seconds,
            self.transcription,
            (persona.text, persona.voice) if persona is not None else None,
            (self.input_audio.format, self.output_audio.format),
        )

    async def on_message(self, message: dict) -> np.ndarray | None:
        text = text_frame(message)
        try:
            event = ev.parse_event(text)
            if isinstance(event, ev.AudioAppend):  # the hot path: 12.5 a second per session
                return await self.take_audio(ev.decode_audio(event, self.input_audio))
            if isinstance(event, ev.SessionUpdate):
                await self.update_session(event)
            elif isinstance(event, ev.ItemRetrieve):
                await self.send_text(ev.item_retrieved(self.item(event)))
            elif isinstance(event, ev.ItemTruncate):
                await self.send_text(self.truncated(event))
            elif isinstance(event, ev.OutputClear):
                await self.clear_output(event)
            elif not isinstance(event, ev.ResponseCancel):  # a cancel has nothing to do: see the module's docstring
                raise ev.RealtimeError(
                    "unsupported_event",
                    f"{event.type} has no effect on a full-duplex model: it takes turns by itself",
                    event.event_id,
                )
        except ev.RealtimeError as e:
            await self.send_text(e.event())
        return None

    def item(self, event: ev.ItemRetrieve | ev.ItemTruncate) -> dict:
        """The item `event` names, as `conversation.item.retrieved` gives it; `item_not_found` for one this session
        has not announced."""
        if event.item_id == self.item_id and self.response_started:
            return ev.assistant_audio_item(self.item_id, "".join(self.said))
        item = self.items.retrieved(event.item_id)
        if item is None:
            raise ev.item_not_found(event)
        return item

    def truncated(self, event: ev.ItemTruncate) -> str:
        """The client stopped playing the model's item at `audio_end_ms`: acknowledged as OpenAI does. The model's
        context is not rewound: a duplex model heard the user cut in as it happened."""
        if self.item(event)["role"] != "assistant":
            raise ev.RealtimeError(
                "invalid_value", "only the assistant's item has audio to truncate", event.event_id, "item_id"
            )
        return ev.item_truncated(event.item_id, event.content_index, event.audio_end_ms)

    async def clear_output(self, event: ev.OutputClear) -> None:
        """`output_audio_buffer.clear` is a WebRTC call's (`CallAdapter`): on a WebSocket the client holds the audio
        it was sent."""
        raise ev.RealtimeError(
            "unsupported_event",
            "output_audio_buffer.clear is for WebRTC calls: on a WebSocket the client holds the audio it was sent",
            event.event_id,
        )

    async def take_audio(self, pcm: np.ndarray) -> np.ndarray:
        """The user's audio, about to be pushed: the first fixes the persona (its prompt runs before it)."""
        if not self.persona_fixed:
            await self.fix_persona()
        self.samples_in += len(pcm)
        return pcm

    async def update_session(self, event: ev.SessionUpdate) -> None:
        params = self.apply_update(event)
        await self.send_text(ev.session_updated(self.session_object(params)))

    def apply_update(self, event: ev.SessionUpdate) -> SamplingParams:
        """Apply an update whole or not at all: a refused value changes nothing (a transcription this session
        cannot have stays off, and the rest applies). Returns the sampling now in force."""
        pump = self.pump
        assert pump is not None
        params = event.sampling(pump.session.params)
        persona = self.persona_update(event)
        transcription = event.transcription()
        if transcription is not None:
            self.set_transcription(pump, *transcription)
        self.persona = persona
        input_format, output_format = event.formats()
        self.input_audio, self.output_audio = self.input_audio.to(input_format), self.output_audio.to(output_format)
        if params != pump.session.params:
            pump.session.update_params(params)
        return params

    async def start(self, pump: Pump, session: dict[str, Any] | None) -> None:
        """The greeting: `session` (the configuration an ephemeral key or a call's offer carried) applied first, as
        a `session.update` would be (a refused part is told as a non-fatal error), then `session.created`."""
        self.pump = pump
        if session:
            try:
                self.apply_update(ev.parse_session(session))
            except ev.RealtimeError as e:
                await self.send_text(e.event())
        await self.send_text(ev.session_created(self.session_object(pump.session.params)))

    def persona_update(self, event: ev.SessionUpdate) -> Persona | None:
        """The persona after `event`; `RealtimeError` when it asks for one this session cannot have: a bad text or
        voice, no voices on this server (`invalid_value`), or a change after the first audio (`persona_locked`:
        the prompt ran before it). A model that takes no persona ignores both, as before: OpenAI's SDKs may send
        instructions unasked."""
        personas, current = self.personas, self.persona
        if not personas.persona_model:
            return current
        text, voice = event.persona()
        if text is None and voice is None:
            return current
        name, voice_param = voice if voice is not None else (None, ev.VOICE_PARAM)
        names = Names(ev.INSTRUCTIONS_PARAM, voice_param)
        try:
            if self.persona_fixed and personas.available:
                running = (current.text, current.voice) if current is not None else (None, None)
                changed = [
                    param
                    for param, differs in (
                        (ev.INSTRUCTIONS_PARAM, text is not None and text != running[0]),
                        (voice_param, name is not None and personas.voice_name(name, names) != running[1]),
                    )
                    if differs
                ]
                if changed:
                    raise ev.RealtimeError(
                        "persona_locked",
                        f"{changed[0]} is set before the audio starts: this session's persona was fixed by its "
                        "first input_audio_buffer.append and stays for the whole session",
                        event.event_id,
                        changed[0],
                    )
                return current  # the same again: SDKs resend the whole session
            return personas.resolve(
                current.text if text is None and current is not None else text,
                current.voice if name is None and current is not None else name,
                names,
            )
        except PersonaRefused as e:
            raise ev.RealtimeError("invalid_value", str(e), event.event_id, e.option) from None

    async def fix_persona(self) -> None:
        """The first audio: the persona is fixed and its prompt starts, before that audio is pushed (the engine
        queues the audio and steps it once the prompt has run)."""
        self.persona_fixed = True
        persona, pump = self.persona, self.pump
        if persona is None:
            return
        assert pump is not None
        try:
            pump.session.start_prompt(persona.prompt)
        except SessionClosed:
            return  # the writer reports why it ended
        except CapacityError as e:
            raise Close(
                CloseCode.TRY_AGAIN_LATER, "capacity", f"server at capacity: no room for the prompt: {e}"
            ) from None
        except ValueError as e:  # checked when the persona was set: the engine's own word, should it differ
            self.persona = None
            message = f"the persona's prompt was refused ({e}); the session goes on without a persona"
            await self.send_text(ev.error_event("invalid_value", message, param=ev.INSTRUCTIONS_PARAM))
            return
        logger.info(
            "realtime session %s: persona fixed: voice %s, %d prompt frames",
            pump.session.id,
            persona.voice,
            persona.prompt.calls,
        )

    async def send_output(self, out: SessionOutput) -> None:
        messages = []
        if not self.response_started:
            self.response_started = True
            messages.append(ev.response_created(self.response_id))
        messages.append(self.audio_delta(self.output_audio.base64(out.pcm)))
        if out.text:
            self.said.append(out.text)
            messages.append(ev.transcript_delta(self.response_id, self.item_id, out.text))
        async with self.send_lock:
            for message in messages:
                await self.ws.send_text(message)

    async def send_error(self, close: Close) -> None:
        await self.send_text(ev.close_error(close))

    def set_transcription(self, pump: Pump, param: str, settings: ev.TranscriptionSettings | None) -> None:
        """Start or stop transcribing, or change the prompt of the running stream (for the utterances that begin
        from now on). Without a transcriber for this session it stays off, which the session object shows."""
        if settings is None:
            pump.stop_transcribing()
            self.transcription = None
            self.items.clear()
            return
        prompt = ev.transcription_prompt(settings)
        if pump.transcript is not None:
            pump.transcript.prompt = prompt  # read by the service when an utterance begins
        else:
            try:
                pump.transcribe(prompt)
            except CapacityError as e:
                logger.info("realtime session %s: %s asked for, not transcribed: %s", pump.session.id, param, e)
                return
            self.transcript_offset = self.samples_in
        self.transcription = ev.transcription_object(self.ctx.runtime.info.transcriber or "unknown", settings)

    async def send_transcript(self, event: TranscriptEvent) -> None:
        if self.transcription is None:  # turned off: what the stopped stream had left is not wanted
            return
        messages = self.items.events(event)
        async with self.send_lock:
            for message in messages:
                await self.ws.send_text(message)

    def audio_ms(self, seconds: float) -> int:
        """Milliseconds of the session's input audio for a time on the transcript stream's timeline."""
        return round(self.transcript_offset * 1000 / SAMPLE_RATE + seconds * 1000)


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket, ctx: Context) -> None:
    if ws.query_params.get("intent") == "transcription":
        await ws.accept()
        await ws.send_text(ev.error_event("transcription_sessions_unavailable", NO_TRANSCRIPTION_SESSIONS))
        await ws.close(CloseCode.POLICY_VIOLATION, "transcription sessions need a speech-to-text model")
        return
    subprotocol = ev.SUBPROTOCOL if ev.SUBPROTOCOL in offered_subprotocols(ws) else None
    call_id = ws.query_params.get("call_id")
    if call_id is not None:  # a sideband on a WebRTC call
        await sideband.attach(ws, ctx, call_id, subprotocol)
        return
    adapter = RealtimeAdapter(ws, ctx)

    async def greet(pump: Pump) -> None:
        key = ctx.client_secrets.get(presented_key(ws))
        await adapter.start(pump, key.session if key is not None else None)

    await serve(ctx, ws, adapter, subprotocol, adapter.parameters, greet)
