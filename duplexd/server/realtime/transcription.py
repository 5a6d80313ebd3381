"""`WS /v1/realtime?intent=transcription` on a speech-to-text model: OpenAI's Realtime transcription session.

The client streams audio (`input_audio_buffer.append`); the model's words come back as they are recognised, one
`conversation.item.input_audio_transcription.delta` per word, and each utterance ends with `.completed` (its whole
text). Utterances are cut as `asr.turns` says: by the model's pause heads where it has them (stt-1b), else by a
silence in its words, under `server_vad` (the default: 500 ms, threshold 0.5) or `semantic_vad`, with
`input_audio_buffer.speech_started` / `.speech_stopped` and the committed item around them; with `turn_detection:
null`, by the client's `input_audio_buffer.commit`. A commit is flushed, as Unmute flushes Kyutai's STT: the server
adds the model's delay in silence after the committed audio, so its words come out without the client sending more
(a client that appends a file, commits and waits gets its transcript). Times are milliseconds of the client's
audio: the added silence is not counted.

The first event is `session.created` (GA), or `transcription_session.created` for a beta client (header
`OpenAI-Beta: realtime=v1`); updates are answered in the dialect they came in. Audio reaches the engine through the
same `Feeder` as `/api/asr-streaming`'s, so a client sending faster than real time loses nothing. Errors follow the
conversation's rules (`realtime`): bad JSON or audio closes with an `error` and a close code, a bad update is a
non-fatal `invalid_value`. Without `intent=transcription` the model has no conversation to offer: the session is
refused with `model_not_conversational`, pointing to the endpoints that serve it.
"""

from __future__ import annotations

import logging

import numpy as np
from fastapi import APIRouter, WebSocket

from duplexd.engine.dialogue.session import SessionOutput
from duplexd.server.connection.access import offered_subprotocols
from duplexd.server.connection.admission import serve
from duplexd.server.connection.closing import Close, CloseCode
from duplexd.server.connection.pump import Adapter, Pump, Socket, text_frame
from duplexd.server.core.context import Context, ServerContext
from duplexd.server.stt.feeder import Feeder
from duplexd.server.stt.session import admitted, asr_parameters, new_stream
from duplexd.server.stt.turns import Turns

from . import events as ev
from . import transcription_events as tev
from .audio_formats import InputAudio
from .items import UserItems

logger = logging.getLogger(__name__)
router = APIRouter()

NOT_CONVERSATIONAL = (
    "this server runs a speech-to-text model, which does not converse: open a transcription session "
    "(/v1/realtime?intent=transcription) or stream audio to /api/asr-streaming"
)
NOT_CONVERSATIONAL_REASON = "speech-to-text model: use ?intent=transcription or /api/asr-streaming"  # <= 123 bytes


class Flushes:
    """The silence the server added to a stream, to map times on the stream back to the client's audio."""

    def __init__(self) -> None:
        self._added: list[tuple[float, float]] = []  # (stream time it starts at, seconds)

    def add(self, at_s: float, seconds: float) -> None:
        self._added.append((at_s, seconds))

    def client_s(self, stream_s: float) -> float:
        """The time on the client's audio of a time on the stream (within added silence: where it was added)."""
        shift = 0.0
        for at, seconds in self._added:
            if stream_s <= at:
                break
            shift += min(seconds, stream_s - at)
        return stream_s - shift


class TranscriptionAdapter(Adapter):
    name = "transcription"

    def __init__(self, ws: Socket, ctx: ServerContext) -> None:
        super().__init__(ws)
        self.ctx = ctx
        self.session_id = ev.new_id("sess")
        self.beta = "realtime=v1" in ws.headers.get("openai-beta", "")
        self.stream = new_stream(ctx)
        self.transcription = ev.TranscriptionSettings()
        self.turn_detection: tev.TurnDetectionSettings | None = tev.DEFAULT_TURN_DETECTION
        self.turns = Turns(self.turn_detection.detection())
        self.flushes = Flushes()
        self.items = UserItems(lambda seconds: round(self.flushes.client_s(seconds) * 1000), commit_on_delta=False)
        self.client_samples = 0  # of audio appended by the client
        self.committed_samples = 0  # of those, up to the last commit (or clear)
        self.feeder: Feeder | None = None  # once admitted
        self.input_audio = InputAudio()  # pcm16 at 24 kHz until an update

    def session_object(self) -> dict:
        return tev.session_object(
            self.session_id, self.ctx.runtime.info.id, self.transcription, self.turn_detection, self.input_audio.format
        )

    def event_name(self, beta: bool, what: str) -> str:
        return f"transcription_session.{what}" if beta else f"session.{what}"

    async def greet(self, pump: Pump) -> None:
        self.feeder = admitted(self.ctx, pump)
        await self.send_text(ev.server_event(self.event_name(self.beta, "created"), session=self.session_object()))

    async def on_message(self, message: dict) -> np.ndarray | None:
        text = text_frame(message)
        try:
            event = tev.parse_event(text)
            if isinstance(event, ev.AudioAppend):
                pcm = ev.decode_audio(event, self.input_audio)
                self.client_samples += len(pcm)
                await self.feed(pcm)
            elif isinstance(event, tev.SessionUpdate | tev.TranscriptionSessionUpdate):
                await self.update(event)
            elif isinstance(event, tev.Commit):
                await self.commit(event)
            elif isinstance(event, tev.Clear):
                self.turns.clear(self.stream_s())
                self.committed_samples = self.client_samples
                await self.send_text(ev.server_event("input_audio_buffer.cleared"))
            elif isinstance(event, ev.ItemRetrieve):
                item = self.items.retrieved(event.item_id)
                if item is None:
                    raise ev.item_not_found(event)
                await self.send_text(ev.item_retrieved(item))
            else:
                raise ev.RealtimeError(
                    "unsupported_event",
                    f"{event.type} has no effect in a transcription session: there is no response to make",
                    event.event_id,
                )
        except ev.RealtimeError as e:
            await self.send_text(e.event())
        return None  # pushed by the feeder

    async def update(self, event: tev.SessionUpdate | tev.TranscriptionSessionUpdate) -> None:
        settings = event.settings()
        if "transcription" in settings.given:
            self.transcription = settings.transcription or ev.TranscriptionSettings()
        self.input_audio = self.input_audio.to(settings.input_format)
        if "turn_detection" in settings.given:
            self.turn_detection = settings.turn_detection
            self.turns.detection = self.turn_detection.detection() if self.turn_detection is not None else None
        beta = isinstance(event, tev.TranscriptionSessionUpdate)
        await self.send_text(ev.server_event(self.event_name(beta, "updated"), session=self.session_object()))

    async def commit(self, event: tev.Commit) -> None:
        """The audio since the last commit becomes one utterance (committed now, completed once transcribed), and
        the delay's worth of silence goes in after it to bring its words out."""
        if self.client_samples == self.committed_samples:
            raise ev.RealtimeError(
                "input_audio_buffer_commit_empty",
                "no audio was appended since the last commit: there is nothing to commit",
                event.event_id,
            )
        self.committed_samples = self.client_samples
        stream, rate = self.stream, self.ctx.runtime.info.sample_rate
        at = self.stream_s()
        silence = -stream.samples % stream.frame_size + (stream.delay + 1) * stream.frame_size
        # the clock once the flush is stepped: a word of the committed audio still coming out then is the next's
        deadline = ((stream.samples + silence) // stream.frame_size - stream.delay) * stream.frame_size / rate
        number = self.turns.commit(at, deadline)
        await self.send_lines(self.items.commit(number))
        self.flushes.add(at, silence / rate)
        await self.feed(np.zeros(silence, np.float32))

    async def feed(self, pcm: np.ndarray) -> None:
        assert self.feeder is not None
        self.stream.received(len(pcm))
        await self.feeder.feed(pcm)

    def stream_s(self) -> float:
        """The time on the stream (the client's audio and the silence added) of what it has received."""
        return self.stream.samples / self.ctx.runtime.info.sample_rate

    async def send_output(self, out: SessionOutput) -> None:
        step = self.stream.step(out.frame, out.text_token, out.pause)
        assert self.feeder is not None
        self.feeder.answer(out.frame + 1)
        lines: list[str] = []
        for event in self.turns.step(step):
            lines += self.items.events(event)
        await self.send_lines(lines)

    async def send_lines(self, lines: list[str]) -> None:
        if not lines:
            return
        async with self.send_lock:
            for line in lines:
                await self.ws.send_text(line)

    async def send_error(self, close: Close) -> None:
        await self.send_text(ev.close_error(close))


@router.websocket("/v1/realtime")
async def transcription_session(ws: WebSocket, ctx: Context) -> None:
    if ws.query_params.get("intent") != tev.INTENT:
        await refuse_conversation(ws)
        return
    adapter = TranscriptionAdapter(ws, ctx)
    subprotocol = ev.SUBPROTOCOL if ev.SUBPROTOCOL in offered_subprotocols(ws) else None
    await serve(ctx, ws, adapter, subprotocol, asr_parameters, adapter.greet)


async def refuse_conversation(ws: WebSocket) -> None:
    """A Realtime conversation asked of a speech-to-text model."""
    await ws.accept()
    await ws.send_text(ev.error_event("model_not_conversational", NOT_CONVERSATIONAL))
    await ws.close(CloseCode.POLICY_VIOLATION, NOT_CONVERSATIONAL_REASON)
