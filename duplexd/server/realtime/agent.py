"""`WS /v1/realtime` as a voice agent: Kyutai STT → an OpenAI-compatible LLM → Kyutai TTS (`--llm`, `--tts`, an
STT main model).

The user's audio goes to the session's STT stream (the main engine, batched with every other session), cut into
turns as a transcription session cuts them (`TranscriptionAdapter`: the pause heads under `server_vad` or
`semantic_vad`, or the client's commit). A turn's end, with `create_response`, starts a response: the session's
items become chat messages, the LLM streams its reply, and each word goes to a TTS stream of its own as it comes
(`engine.agent.reply`). The speech goes out paced at real time, `LEAD_S` ahead, each word's transcript delta with
the frame it is heard from; the assistant item holds the words that were heard. Tool calls come as OpenAI streams
them (a `function_call` item, its argument deltas, done), and the client's `function_call_output` item then a
`response.create` lets the LLM answer. The user speaking during a response (with `interrupt_response`) cancels it:
the LLM's request and the TTS stream end at once, the item keeps what was heard, and `response.done` says
`cancelled` (`turn_detected`). `response.cancel` does the same (`client_cancelled`). With `idle_timeout_ms`, a quiet
user (after the reply has played out) gets `input_audio_buffer.timeout_triggered` and a response.

Every response goes `response.created` → per output item `response.output_item.added`, `conversation.item.added`
(and for speech `response.content_part.added`, the deltas, `.done`s) → `response.output_item.done` →
`response.done` with `output[]` and `usage`. An LLM that fails ends its response `failed` with the reason, and the
session goes on; an `error` event is sent only for a client's event that cannot be honoured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from duplexd.engine.agent.events import TextDelta, ToolCallArguments, ToolCallEnd, ToolCallStart
from duplexd.engine.agent.llm import ChatRequest
from duplexd.engine.agent.reply import Audio, Done, Reply, Speaker, Spoken
from duplexd.engine.dialogue.session import SessionOutput
from duplexd.engine.transcription.service import SpeechBegan, SpeechEnded, TranscriptDone
from duplexd.engine.tts.service import SpeechStream
from duplexd.server.connection.access import offered_subprotocols, presented_key
from duplexd.server.connection.admission import serve
from duplexd.server.connection.pump import Pump, Socket, text_frame
from duplexd.server.connection.speech import open_speech, speech_of
from duplexd.server.core.context import Context, ServerContext
from duplexd.server.realtime.webrtc import sideband
from duplexd.server.stt.session import admitted, asr_parameters
from duplexd.server.stt.turns import Turns

from . import agent_events as aev
from . import events as ev
from . import transcription_events as tev
from .audio_formats import OutputAudio
from .transcription import TranscriptionAdapter, transcription_session

logger = logging.getLogger(__name__)
router = APIRouter()

FRAME_S = 0.08
FRAME_MS = 80
LEAD_S = 0.32  # speech sent ahead of real time (Unmute's 4 frames): enough to play smoothly, little to cut
DEFAULT_INSTRUCTIONS = "You are a helpful voice assistant. Answer briefly, in plain spoken sentences."
TRANSCRIPT_WAIT_S = 5.0  # a response asked for right after a commit waits this long for the turn's transcript


@dataclass
class Running:
    """A response under way."""

    id: str
    reply: Reply
    audio: bool
    conversation: bool
    modalities: list[aev.Modality]
    max_output_tokens: aev.MaxTokens
    metadata: dict[str, str] | None
    parallel_tool_calls: bool = True  # False: the LLM's calls after its first are dropped (servers may not honour it)
    message_id: str | None = None  # its message item, once it has words or audio
    output: list[dict[str, Any]] = field(default_factory=list)  # the finished output items, in order
    calls: dict[int, tuple[str, str, str]] = field(default_factory=dict)  # index → (item id, call id, name)
    heard: list[tuple[str, int]] = field(default_factory=list)  # words released, with the frame each starts
    text: list[str] = field(default_factory=list)  # text-only output
    frames_sent: int = 0
    started: float | None = None  # when its first audio frame went out
    cancelled: str | None = None  # the reason, once cancelled

    def takes_call(self, index: int) -> bool:
        """Whether the LLM's call `index` is part of the response: any, or its first alone without parallel calls."""
        return self.parallel_tool_calls or not self.calls or index in self.calls

    def played_ms(self) -> int:
        """Audio the client has had time to play: the frames sent, capped by the time since the first."""
        if self.started is None:
            return 0
        return min(self.frames_sent * FRAME_MS, int((time.monotonic() - self.started) * 1000))

    def played_out(self) -> float:
        """When the audio sent will have played (the client plays from the first frame); now if none was sent."""
        now = time.monotonic()
        return now if self.started is None else max(now, self.started + self.frames_sent * FRAME_S)


class AgentAdapter(TranscriptionAdapter):
    name = "agent"

    def __init__(self, ws: Socket, ctx: ServerContext) -> None:
        super().__init__(ws, ctx)
        agents = ctx.runtime.agents
        assert agents is not None
        self.agents = agents
        self.speech = speech_of(ctx)
        self.instructions = DEFAULT_INSTRUCTIONS
        self.tools: list[aev.Tool] = []
        self.tool_choice: aev.ToolChoice = "auto"
        self.parallel_tool_calls = True
        self.modalities: list[aev.Modality] = ["audio"]
        self.max_output_tokens: aev.MaxTokens = "inf"
        self.turn_detection: aev.AgentTurnDetection | None = aev.DEFAULT_TURN_DETECTION
        self.turns = Turns(self.turn_detection.detection())
        self.voice = self.speech.default_voice
        self.output_audio = OutputAudio()
        self.conversation: dict[str, dict[str, Any]] = {}  # item id → item, in the conversation's order
        self.heard: dict[str, list[tuple[str, int]]] = {}  # assistant item id → its words and their frames
        self.running: Running | None = None
        self.task: asyncio.Task | None = None
        self.transcribing = 0  # utterances committed whose transcript has not come yet
        self.transcribed = asyncio.Event()
        # `idle_timeout_ms`: quiet since when (no user speech, no response playing), and what moves that
        self.quiet_since = time.monotonic()
        self.user_speaking = False
        self.activity = asyncio.Event()
        self.idle_task: asyncio.Task | None = None

    # ------------------------------------------------------------------------------------------- the session

    def session_object(self) -> dict:
        return aev.session_object(
            self.session_id,
            self.agents.model_id,
            self.instructions,
            self.tools,
            self.tool_choice,
            self.parallel_tool_calls,
            self.modalities,
            self.max_output_tokens,
            self.turn_detection,
            self.voice,
            {"model": self.ctx.runtime.info.id, "language": None, "prompt": None},
            (self.input_audio.format, self.output_audio.format),
        )

    async def greet(self, pump: Pump, session: dict[str, Any] | None = None) -> None:
        """`session.created`, after `session` (the configuration an ephemeral key or a call's offer carried) is
        applied as a `session.update` would be (a refused one is told as a non-fatal error)."""
        self.feeder = admitted(self.ctx, pump)
        if session:
            try:
                self.update_session(aev.parse_session(session))
            except ev.RealtimeError as e:
                await self.send_text(e.event())
        await self.send_text(ev.session_created(self.session_object()))
        self.idle_task = asyncio.create_task(self.watch_idle(), name=f"agent-idle-{self.session_id}")

    def update_session(self, event: aev.SessionUpdate) -> None:
        s = event.session
        given = s.model_fields_set
        if s.type == "transcription":
            raise ev.RealtimeError(
                "invalid_value",
                "this is a conversation with a voice agent: for a transcription session connect with "
                "?intent=transcription",
                event.event_id,
                "session.type",
            )
        if s.instructions is not None:
            self.instructions = s.instructions
        if s.tools is not None:
            self.tools = s.tools
        if s.tool_choice is not None:
            self.tool_choice = s.tool_choice
        if s.parallel_tool_calls is not None:
            self.parallel_tool_calls = s.parallel_tool_calls
        modalities = s.output_modalities or s.modalities
        if modalities:
            self.modalities = ["audio"] if "audio" in modalities else ["text"]
        if s.max_output_tokens is not None:
            self.max_output_tokens = s.max_output_tokens
        side = s.audio.input if s.audio is not None else None
        output = s.audio.output if s.audio is not None else None
        if side is not None and "turn_detection" in side.model_fields_set:
            self.set_turn_detection(side.turn_detection)
        elif "turn_detection" in given:
            self.set_turn_detection(s.turn_detection)
        voice = output.voice if output is not None and output.voice is not None else s.voice
        if voice is not None:
            name = voice if isinstance(voice, str) else voice.get("id") if isinstance(voice, dict) else None
            # OpenAI's voice names (alloy, ash, ...) and any other name not served speak in the default voice
            self.voice = name if name in self.speech.voices else self.speech.default_voice
        in_format = side.format.type if side is not None and side.format is not None else None
        out_format = output.format.type if output is not None and output.format is not None else None
        self.input_audio = self.input_audio.to(in_format or aev.beta_format(s.input_audio_format))
        self.output_audio = self.output_audio.to(out_format or aev.beta_format(s.output_audio_format))

    def set_turn_detection(self, detection: aev.AgentTurnDetection | None) -> None:
        self.turn_detection = detection
        self.turns.detection = detection.detection() if detection is not None else None
        self.quiet(time.monotonic())

    # ------------------------------------------------------------------------------------------- idle timeout

    def quiet(self, since: float) -> None:
        """The session is quiet from `since` (the user's speech or a response's audio ended, a setting changed)."""
        self.quiet_since = since
        self.activity.set()

    def idle_deadline(self) -> float | None:
        """When `idle_timeout_ms` fires: None while it is off, the user speaks or a response runs."""
        detection = self.turn_detection
        if detection is None or not detection.idle_timeout_ms or self.running is not None or self.user_speaking:
            return None
        return self.quiet_since + detection.idle_timeout_ms / 1000

    async def watch_idle(self) -> None:
        """Wakes at the idle deadline, or when what sets it changes; at the deadline, `idle_timeout`."""
        while True:
            self.activity.clear()
            deadline = self.idle_deadline()
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.activity.wait(), wait)
                continue
            deadline = self.idle_deadline()
            if deadline is not None and time.monotonic() >= deadline:
                await self.idle_timeout()

    async def idle_timeout(self) -> None:
        """No speech for `idle_timeout_ms`: `input_audio_buffer.timeout_triggered` over the quiet audio, that audio
        committed as the user's turn (when any came), and a response, as OpenAI's server VAD does."""
        now = time.monotonic()
        rate = self.ctx.runtime.info.sample_rate
        end_ms = round(self.client_samples * 1000 / rate)
        start_ms = max(0, end_ms - round((now - self.quiet_since) * 1000))
        self.quiet(now)
        item_id = ev.new_id("item")
        if self.client_samples > self.committed_samples:
            await self.commit(aev.Commit(type="input_audio_buffer.commit"))
            item_id = self.items.last or item_id
        await self.send_text(ev.server_event(
            "input_audio_buffer.timeout_triggered", audio_start_ms=start_ms, audio_end_ms=end_ms, item_id=item_id
        ))  # fmt: skip
        detection = self.turn_detection
        if detection is not None and detection.create_response and self.running is None:
            self.respond(aev.ResponseParams(), None)

    # ------------------------------------------------------------------------------------------- client events

    async def on_message(self, message: dict) -> np.ndarray | None:
        text = text_frame(message)
        try:
            event = aev.parse_event(text)
            if isinstance(event, ev.AudioAppend):
                pcm = ev.decode_audio(event, self.input_audio)
                self.client_samples += len(pcm)
                await self.feed(pcm)
            elif isinstance(event, aev.SessionUpdate):
                self.update_session(event)
                await self.send_text(ev.session_updated(self.session_object()))
            elif isinstance(event, aev.Commit):
                await self.commit(event)
            elif isinstance(event, aev.Clear):
                self.turns.clear(self.stream_s())
                self.committed_samples = self.client_samples
                await self.send_text(ev.server_event("input_audio_buffer.cleared"))
            elif isinstance(event, aev.ItemCreate):
                await self.create_item(event)
            elif isinstance(event, aev.ItemDelete):
                if self.conversation.pop(event.item_id, None) is None:
                    raise aev.item_not_found(event.item_id, event.event_id)
                await self.send_text(ev.server_event("conversation.item.deleted", item_id=event.item_id))
            elif isinstance(event, ev.ItemRetrieve):
                await self.settled()
                await self.send_text(ev.item_retrieved(self.item(event.item_id, event.event_id)))
            elif isinstance(event, ev.ItemTruncate):
                await self.settled()
                await self.truncate(event)
            elif isinstance(event, aev.ResponseCreate):
                self.respond(event.response, event.event_id)
            elif isinstance(event, aev.ResponseCancel):
                if self.running is None or (event.response_id and event.response_id != self.running.id):
                    raise ev.RealtimeError(
                        "response_cancel_not_active", "there is no response under way to cancel", event.event_id
                    )
                self.cancel("client_cancelled")
            elif isinstance(event, ev.OutputClear):
                await self.clear_output(event)
            else:  # transcription_session.update
                raise ev.RealtimeError(
                    "unsupported_event", f"{event.type} is not part of a voice agent's session", event.event_id
                )
        except ev.RealtimeError as e:
            await self.send_text(e.event())
        return None  # pushed by the feeder

    async def clear_output(self, event: ev.OutputClear) -> None:
        """`output_audio_buffer.clear` is a WebRTC call's (`webrtc/agent_call.py`): on a WebSocket the client holds
        the audio it was sent."""
        raise ev.RealtimeError(
            "unsupported_event",
            "output_audio_buffer.clear is for WebRTC calls: on a WebSocket the client holds the audio it was sent",
            event.event_id,
        )

    async def commit(self, event: tev.Commit) -> None:
        """A transcription session's commit, its transcript awaited by a response asked for meanwhile."""
        self.transcribing += 1
        self.transcribed.clear()
        try:
            await super().commit(event)
        except ev.RealtimeError:
            self.transcribing -= 1
            raise

    def last_item(self) -> str | None:
        """The id of the conversation's last item (what a new one follows)."""
        return next(reversed(self.conversation), None)

    def item(self, item_id: str, event_id: str | None) -> dict[str, Any]:
        item = self.conversation.get(item_id) or self.items.retrieved(item_id)
        if item is None:
            raise aev.item_not_found(item_id, event_id)
        return item

    async def create_item(self, event: aev.ItemCreate) -> None:
        item = event.item
        item_id = item.id or ev.new_id("item")
        if item_id in self.conversation:
            raise ev.RealtimeError(
                "invalid_value", f"the conversation already has an item {item_id!r}", event.event_id, "item.id"
            )
        if isinstance(item, aev.MessageItem):
            audio_parts = [p for p in item.content if p.type in ("input_audio", "audio", "output_audio")]
            if audio_parts and not any(p.words for p in audio_parts):
                raise ev.RealtimeError(
                    "invalid_value",
                    "a message's audio is heard through the input audio buffer: give its text (input_text)",
                    event.event_id,
                    "item.content",
                )
            kind = "output_text" if item.role == "assistant" else "input_text"
            made = aev.message_item(
                item_id, item.role, [{"type": kind, "text": " ".join(p.words for p in item.content)}]
            )
        elif isinstance(item, aev.FunctionCallItem):
            made = aev.function_call_item(item_id, item.call_id, item.name, item.arguments, "completed")
        else:
            if not any(
                i.get("call_id") == item.call_id for i in self.conversation.values() if i["type"] == "function_call"
            ):
                raise ev.RealtimeError(
                    "invalid_value",
                    f"no function call {item.call_id!r} in this conversation for this output",
                    event.event_id,
                    "item.call_id",
                )
            made = aev.function_output_item(item_id, item.call_id, item.output)
        previous = self.last_item()
        self.conversation[item_id] = made
        await self.send_lines(aev.item_added(made, previous))

    async def settled(self) -> None:
        """A cancelled response's last events go out first: a retrieve or truncate sent on `speech_started` (as the
        SDKs send them) sees the item as the cancelled response left it, `incomplete`, not still `in_progress`."""
        if self.running is not None and self.running.cancelled is not None and self.task is not None:
            await asyncio.wait({self.task})  # its outcome is the response's own (reported there)

    async def truncate(self, event: ev.ItemTruncate) -> None:
        """The client played the assistant's item up to `audio_end_ms`: its transcript keeps the words heard."""
        item = self.item(event.item_id, event.event_id)
        if item.get("role") != "assistant" or item["type"] != "message":
            raise ev.RealtimeError(
                "invalid_value", "only an assistant message's audio can be truncated", event.event_id, "item_id"
            )
        words = self.heard.get(event.item_id)
        if words is not None:
            item["content"] = [aev.content_object(True, _heard(words, event.audio_end_ms))]
        await self.send_text(ev.item_truncated(event.item_id, event.content_index, event.audio_end_ms))

    # ------------------------------------------------------------------------------------------- the STT's turns

    async def send_output(self, out: SessionOutput) -> None:
        step = self.stream.step(out.frame, out.text_token, out.pause)
        assert self.feeder is not None
        self.feeder.answer(out.frame + 1)
        for event in self.turns.step(step):
            item_id = self.items.item(event.item).id if isinstance(event, TranscriptDone) else ""
            after: list[str] = []
            if isinstance(event, SpeechBegan):
                self.user_speaking = True
                self.activity.set()
                if self.interrupts():
                    after = self.barge_in()  # before speech_started goes out
            elif isinstance(event, SpeechEnded | TranscriptDone) and self.user_speaking:
                self.user_speaking = False
                self.quiet(time.monotonic())
            await self.send_lines(self.items.events(event) + after)
            if isinstance(event, TranscriptDone):
                user = self.items.retrieved(item_id)
                assert user is not None
                self.conversation[item_id] = user
                if self.transcribing:
                    self.transcribing -= 1
                if not self.transcribing:
                    self.transcribed.set()
                detection = self.turn_detection
                if detection is not None and detection.create_response and self.running is None:
                    self.respond(aev.ResponseParams(), None)

    def interrupts(self) -> bool:
        return self.turn_detection is not None and self.turn_detection.interrupt_response

    def barge_in(self) -> list[str]:
        """The user started speaking: the response under way is cancelled. Returns what to send after
        `speech_started` (a call's `output_audio_buffer.cleared`; nothing on a WebSocket)."""
        if self.running is not None:
            self.cancel("turn_detected")
        return []

    # ------------------------------------------------------------------------------------------- responses

    def respond(self, params: aev.ResponseParams, event_id: str | None) -> None:
        if self.running is not None:
            raise ev.RealtimeError(
                "conversation_already_has_active_response",
                f"response {self.running.id} is under way: cancel it or wait for its response.done",
                event_id,
            )
        modalities = params.output_modalities or params.modalities or self.modalities
        audio = "audio" in modalities
        tools = params.tools if params.tools is not None else self.tools
        tool_choice = params.tool_choice if params.tool_choice is not None else self.tool_choice
        limit = params.max_output_tokens if params.max_output_tokens is not None else self.max_output_tokens
        parallel = params.parallel_tool_calls if params.parallel_tool_calls is not None else self.parallel_tool_calls
        messages = self.messages(params, event_id)
        forced = bool(tools) and (tool_choice == "required" or isinstance(tool_choice, dict))
        prefill = self.agents.forced_call_prefill
        if forced and prefill is not None:  # the demo's llama.cpp: one tool offered is the one called
            if isinstance(tool_choice, dict):
                tools = [tool for tool in tools if tool.name == tool_choice.get("name")] or tools
            tool_choice = "required"
            messages.append({"role": "assistant", "content": prefill})
        offered = [tool.chat_tool() for tool in tools] if tool_choice != "none" else []
        request = ChatRequest(
            messages,
            tools=offered,
            tool_choice=_chat_tool_choice(tool_choice) if tools else None,
            parallel_tool_calls=False if offered and not parallel else None,
            max_tokens=aev.max_tokens(limit),
        )
        speaker = None
        if audio:
            splitter = self.speech.words()
            speaker = Speaker(self.open_speech, splitter.split)
        running = Running(
            ev.new_id("resp"),
            Reply(self.agents.client, request, speaker),
            audio,
            params.conversation != "none",
            ["audio"] if audio else ["text"],
            limit,
            params.metadata,
            parallel,
        )
        self.running = running
        self.activity.set()
        self.task = asyncio.create_task(self.run_response(running), name=f"agent-{running.id}")

    def open_speech(self) -> SpeechStream:
        stream = open_speech(self.ctx)
        self.speech.begin(stream, self.speech.voice(self.voice))
        return stream

    def messages(self, params: aev.ResponseParams, event_id: str | None) -> list[dict[str, Any]]:
        """The chat messages of a response: its instructions, then the conversation's items (or its own `input`)."""
        instructions = params.instructions if params.instructions is not None else self.instructions
        messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
        if params.input is not None:
            items = []
            for given in params.input:
                if isinstance(given, aev.ItemReference):
                    items.append(self.item(given.id, event_id))
                else:
                    items.append(given.model_dump())
        elif params.conversation == "none":
            items = []
        else:
            items = list(self.conversation.values())
        for item in items:
            _add_message(messages, item)
        return _answered(messages)

    def cancel(self, reason: str) -> None:
        running = self.running
        if running is None or running.cancelled is not None:
            return
        running.cancelled = reason
        running.reply.cancel()

    async def run_response(self, r: Running) -> None:
        try:
            await self._run(r)
        except WebSocketDisconnect:  # the client left mid-reply (its Stop, a closed tab): nobody's fault
            logger.info("agent session %s: the client left during response %s", self.session_id, r.id)
            r.reply.cancel()
        except Exception:  # noqa: BLE001 - the transport is gone or a bug: the session's tasks report the first
            logger.exception("agent session %s: response %s failed", self.session_id, r.id)
            r.reply.cancel()
        finally:
            if self.running is r:
                self.running = None
                self.quiet(r.played_out() if r.cancelled is None else time.monotonic())

    async def _run(self, r: Running) -> None:
        created = aev.response_object(
            r.id, "in_progress", r.modalities, r.max_output_tokens, r.metadata, r.conversation
        )
        await self.send_text(ev.server_event("response.created", response=created))
        if self.transcribing:  # a commit's transcript is on its way: the reply is to answer it
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.transcribed.wait(), TRANSCRIPT_WAIT_S)
        words: deque[tuple[str, int]] = deque()  # spoken by the TTS, not yet heard
        done: Done | None = None
        async for event in r.reply.events():
            if isinstance(event, Spoken):
                await self.open_message(r)
                words.append((event.text, event.frame))
            elif isinstance(event, Audio):
                await self.open_message(r)
                await self.send_audio(r, event, words)
            elif isinstance(event, TextDelta):
                if not r.audio:
                    await self.open_message(r)
                    r.text.append(event.text)
                    await self.send_lines([self.part_event("response.output_text.delta", r, delta=event.text)])
            elif isinstance(event, ToolCallStart | ToolCallArguments | ToolCallEnd) and not r.takes_call(event.index):
                continue  # `parallel_tool_calls: false`, and the LLM called again: one call a response
            elif isinstance(event, ToolCallStart):
                await self.start_call(r, event)
            elif isinstance(event, ToolCallArguments):
                item_id, call_id, _ = r.calls[event.index]
                await self.send_lines([ev.server_event(
                    "response.function_call_arguments.delta", response_id=r.id, item_id=item_id,
                    output_index=self.output_index(r, item_id), call_id=call_id, delta=event.fragment,
                )])  # fmt: skip
            elif isinstance(event, ToolCallEnd):
                await self.end_call(r, event)
            elif isinstance(event, Done):
                done = event
        if r.cancelled is None:  # the words not yet heard come with the last audio
            while words:
                await self.release_word(r, *words.popleft())
        await self.close_message(r)
        await self.finish(r, done)

    def output_index(self, r: Running, item_id: str) -> int:
        order = ([r.message_id] if r.message_id is not None else []) + [c[0] for c in r.calls.values()]
        return order.index(item_id) if item_id in order else len(order)

    def part_event(self, kind: str, r: Running, **fields: Any) -> str:
        assert r.message_id is not None
        return ev.server_event(kind, response_id=r.id, item_id=r.message_id, output_index=0, content_index=0, **fields)

    async def open_message(self, r: Running) -> None:
        """The response's message item, at its first word or audio."""
        if r.message_id is not None:
            return
        r.message_id = ev.new_id("item")
        item = aev.message_item(r.message_id, "assistant", [], "in_progress")
        previous = self.last_item()
        if r.conversation:
            self.conversation[r.message_id] = item
            self.heard[r.message_id] = r.heard
        await self.send_lines([
            ev.server_event("response.output_item.added", response_id=r.id, output_index=0, item=item),
            *_in_conversation(r, "conversation.item.added", previous, item),
            self.part_event("response.content_part.added", r, part=aev.part_object(r.audio, "")),
        ])  # fmt: skip

    async def send_audio(self, r: Running, audio: Audio, words: deque[tuple[str, int]]) -> None:
        """One frame of speech, paced: frame f goes out `LEAD_S` before it plays, the words heard from it first."""
        now = time.monotonic()
        if r.started is None:
            r.started = now
        wait = r.started + audio.frame * FRAME_S - LEAD_S - now
        if wait > 0:
            await asyncio.sleep(wait)
        while words and words[0][1] <= audio.frame + 1:
            await self.release_word(r, *words.popleft())
        if await self.play(r, audio):
            r.frames_sent = audio.frame + 1

    async def play(self, r: Running, audio: Audio) -> bool:
        """One frame of `r`'s speech to the client unless `r` was cancelled: a delta on the WebSocket (a call plays
        it on its track)."""
        delta = self.part_event("response.output_audio.delta", r, delta=self.output_audio.base64(audio.pcm))
        return await self.send_live(r, delta)

    def played_ms(self, r: Running) -> int:
        """How much of `r`'s speech the client has played (on a WebSocket, as far as the server can tell)."""
        return r.played_ms()

    async def release_word(self, r: Running, word: str, frame: int) -> None:
        delta = self.part_event("response.output_audio_transcript.delta", r, delta=word if not r.heard else f" {word}")
        if await self.send_live(r, delta):
            r.heard.append((word, frame))

    async def send_live(self, r: Running, line: str) -> bool:
        """Send `line` unless `r` was cancelled, checked under the send lock: a barge-in's `speech_started`, sent
        after the cancel, is never followed by more of the cancelled speech."""
        async with self.send_lock:
            if r.cancelled is not None:
                return False
            await self.ws.send_text(line)
            return True

    async def close_message(self, r: Running) -> None:
        if r.message_id is None:
            return
        if r.audio:
            text = _heard(r.heard, self.played_ms(r) if r.cancelled is not None else None)
            lines = [
                self.part_event("response.output_audio.done", r),
                self.part_event("response.output_audio_transcript.done", r, transcript=text),
            ]
        else:
            text = "".join(r.text)
            lines = [self.part_event("response.output_text.done", r, text=text)]
        status = "incomplete" if r.cancelled is not None else "completed"
        item = aev.message_item(r.message_id, "assistant", [aev.content_object(r.audio, text)], status)
        lines += [
            self.part_event("response.content_part.done", r, part=aev.part_object(r.audio, text)),
            ev.server_event("response.output_item.done", response_id=r.id, output_index=0, item=item),
            *_in_conversation(r, "conversation.item.done", None, item),
        ]
        if r.conversation and r.message_id in self.conversation:
            self.conversation[r.message_id] = item
        r.output.insert(0, item)
        await self.send_lines(lines)

    async def start_call(self, r: Running, call: ToolCallStart) -> None:
        item_id = ev.new_id("item")
        r.calls[call.index] = (item_id, call.call_id, call.name)
        item = aev.function_call_item(item_id, call.call_id, call.name, "", "in_progress")
        previous = self.last_item()
        index = self.output_index(r, item_id)
        await self.send_lines([
            ev.server_event("response.output_item.added", response_id=r.id, output_index=index, item=item),
            *_in_conversation(r, "conversation.item.added", previous, item),
        ])  # fmt: skip

    async def end_call(self, r: Running, call: ToolCallEnd) -> None:
        item_id, call_id, name = r.calls[call.index]
        index = self.output_index(r, item_id)
        # arguments cut short (the reply ran out of tokens) are no call to make: the item says so
        status = "completed" if _is_json(call.arguments) else "incomplete"
        item = aev.function_call_item(item_id, call_id, name, call.arguments, status)
        if r.conversation:
            self.conversation[item_id] = item
        r.output.append(item)
        await self.send_lines([
            ev.server_event("response.function_call_arguments.done", response_id=r.id, item_id=item_id,
                            output_index=index, call_id=call_id, name=name, arguments=call.arguments),
            *_in_conversation(r, "conversation.item.done", None, item),
            ev.server_event("response.output_item.done", response_id=r.id, output_index=index, item=item),
        ])  # fmt: skip

    async def finish(self, r: Running, done: Done | None) -> None:
        self.ctx.metrics.on_agent_reply(r.reply.times.stages())
        usage = aev.usage_object(0, 0)
        if done is not None and done.usage is not None:
            usage = aev.usage_object(done.usage.prompt_tokens, done.usage.completion_tokens)
        details: dict[str, Any] | None = None
        if r.cancelled is not None:
            status, details = "cancelled", {"type": "cancelled", "reason": r.cancelled}
        elif done is not None and done.error is not None:
            status = "failed"
            details = {"type": "failed", "error": {"type": "server_error", "code": "llm_failed", "message": done.error}}
        elif done is not None and done.reason == "length":
            status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        else:
            status = "completed"
        response = aev.response_object(
            r.id, status, r.modalities, r.max_output_tokens, r.metadata, r.conversation, r.output, usage, details
        )
        await self.send_text(ev.server_event("response.done", response=response))

    async def aclose(self) -> None:
        """The session is over: its response stops (its LLM request and TTS stream with it), and its idle watch."""
        if self.running is not None:
            self.running.reply.cancel()
        for task in (self.task, self.idle_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task


def _heard(words: list[tuple[str, int]], before_ms: int | None) -> str:
    """The words heard before `before_ms` of the speech (all of them: None), each from its own frame."""
    return " ".join(word for word, frame in words if before_ms is None or frame * FRAME_MS < before_ms)


def _in_conversation(r: Running, kind: str, previous: str | None, item: dict[str, Any]) -> list[str]:
    """A response item's `conversation.item.*` event: none for an out-of-band response (`conversation: "none"`),
    whose items stay outside the conversation."""
    return [ev.server_event(kind, previous_item_id=previous, item=item)] if r.conversation else []


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _chat_tool_choice(choice: aev.ToolChoice) -> str | dict[str, Any]:
    """The Realtime `tool_choice` as chat completions take it (`{type: function, name}` → `{type, function}`)."""
    if isinstance(choice, dict) and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _add_message(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    """One Realtime item as chat messages (a function call joins the assistant message before it)."""
    kind = item.get("type")
    if kind == "message":
        text = " ".join(
            (part.get("text") if part.get("text") is not None else part.get("transcript")) or ""
            for part in item.get("content", [])
        ).strip()
        if text:
            messages.append({"role": item.get("role", "user"), "content": text})
    elif kind == "function_call":
        if not _is_json(item.get("arguments") or "{}"):
            return  # cut short by the token limit (`incomplete`): never made, and llama.cpp refuses such arguments
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}  # fmt: skip
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item.get("output", "")})


UNANSWERED = "(no output: the call was not answered)"


def _answered(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as chat completions takes them: each assistant message with tool calls followed at once by one
    tool message per call, whatever the items' order (an output after the user spoke again), a call the client never
    answered given `UNANSWERED` (OpenAI refuses a call without its answer), an output of no call left out."""
    outputs = {m["tool_call_id"]: m for m in messages if m["role"] == "tool"}
    paired: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            continue
        paired.append(message)
        for call in message.get("tool_calls", []):
            paired.append(
                outputs.get(call["id"]) or {"role": "tool", "tool_call_id": call["id"], "content": UNANSWERED}
            )
    return paired


@router.websocket("/v1/realtime")
async def agent_session(ws: WebSocket, ctx: Context) -> None:
    """A voice agent's conversation; `?intent=transcription` is a transcription session on the STT model, as
    without `--llm`."""
    if ws.query_params.get("intent") == tev.INTENT:
        await transcription_session(ws, ctx)
        return
    subprotocol = ev.SUBPROTOCOL if ev.SUBPROTOCOL in offered_subprotocols(ws) else None
    call_id = ws.query_params.get("call_id")
    if call_id is not None:  # a sideband on a WebRTC call
        await sideband.attach(ws, ctx, call_id, subprotocol)
        return
    adapter = AgentAdapter(ws, ctx)

    async def greet(pump: Pump) -> None:
        key = ctx.client_secrets.get(presented_key(ws))
        await adapter.greet(pump, key.session if key is not None else None)

    try:
        await serve(ctx, ws, adapter, subprotocol, asr_parameters, greet)
    finally:
        await adapter.aclose()
