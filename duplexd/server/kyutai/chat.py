"""`WS /api/chat`: the Kyutai protocol, as the reference server and its web and Python clients speak it.

Binary messages only: kind byte + payload. Audio is one continuous Ogg/Opus stream at 24 kHz per direction, decoded
and encoded on the codec threads (or worker processes) with every other session's (`codec_batches`); the downlink
in `--opus-profile`; text is the model's raw piece per non-padding step. Sampling (repetition penalty and pad_mult
included) comes from the Rust server's query parameters.
Order on the wire: metadata (0x04 JSON), handshake (0x00) once admitted, then audio (0x01) and text (0x02).
A PersonaPlex persona (`text_prompt`, `voice_prompt`, PersonaPlex's own names, or its defaults) starts at admission
and the handshake waits for its prompt to have run, as PersonaPlex's server sends it after the prompt.
Opt-in (`?transcribe=1`): JSON events about what the user says (speech started/stopped, transcripts) on the ping
kind (0x06), which Kyutai's own clients ignore; a server that cannot transcribe says so once and goes on.
Kinds a client may send besides audio (handshake, control, ping, ...) are accepted and ignored, as the
reference does; an unknown kind byte, a text frame or undecodable Ogg/Opus ends the connection with an
error message (0x05) and a close code.
"""

from __future__ import annotations

import logging

import numpy as np
from fastapi import APIRouter, WebSocket

from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.dialogue.session import SessionOutput
from duplexd.engine.errors import CapacityError
from duplexd.engine.persona.prompt import PersonaPrompt
from duplexd.engine.transcription.service import TranscriptEvent
from duplexd.server.codec.batches import CodecBatches, codec_close
from duplexd.server.codec.errors import AudioError
from duplexd.server.codec.workers import CodecWorkerError
from duplexd.server.connection.admission import serve
from duplexd.server.connection.closing import Close, CloseCode
from duplexd.server.connection.pump import Adapter, Pump, binary_frame
from duplexd.server.connection.query import (
    BadQuery,
    max_frames_from_query,
    sampling_from_query,
    transcription_from_query,
)
from duplexd.server.core.build_info import BUILD_INFO
from duplexd.server.core.context import Context, ServerContext
from duplexd.server.core.persona import KYUTAI, Persona, PersonaRefused, Personas

from . import messages

logger = logging.getLogger(__name__)
router = APIRouter()


class KyutaiAdapter(Adapter):
    name = "kyutai"

    def __init__(
        self, ws: WebSocket, sample_rate: int, personas: Personas, codec: CodecBatches, opus_profile: str
    ) -> None:
        super().__init__(ws)
        self.codec = codec
        self.decoder, self.encoder = codec.streams(opus_profile, sample_rate)
        self.personas = personas
        self.persona: Persona | None = None  # set from the query (PersonaPlex's defaults where it has voices)
        self.transcribe_prompt: str | None = None  # set from the query: the client asked for its transcripts

    def parameters(self) -> tuple[SamplingParams, int | None]:
        """The session's settings from the query string; `BadQuery` (close 1007) for a bad one."""
        query = self.ws.query_params
        self.transcribe_prompt = transcription_from_query(query)
        params, max_frames = sampling_from_query(query), max_frames_from_query(query)
        try:  # PersonaPlex's own names; on PersonaPlex with voices, absent ones take its defaults
            self.persona = self.personas.resolve(query.get("text_prompt"), query.get("voice_prompt"), KYUTAI)
        except PersonaRefused as e:
            raise BadQuery(str(e)) from None
        return params, max_frames

    def opening_prompt(self) -> PersonaPrompt | None:
        return None if self.persona is None else self.persona.prompt

    def start_transcribing(self, pump: Pump) -> str | None:
        """Transcribe the user when asked to; why not (no transcriber, no free stream), or None."""
        if self.transcribe_prompt is None:
            return None
        try:
            pump.transcribe(self.transcribe_prompt)
        except CapacityError as e:
            logger.info("session %s: no transcription: %s", pump.session.id, e)
            return f"transcription unavailable: {e}; the conversation goes on without it"
        return None

    async def on_message(self, message: dict) -> np.ndarray | None:
        data = binary_frame(message, "binary kind-byte messages")
        try:
            msg = messages.decode(data)
        except messages.ProtocolError as e:
            raise Close(CloseCode.PROTOCOL_ERROR, "unknown_kind", str(e)) from None
        if msg.kind != messages.Kind.AUDIO:
            logger.debug("ignoring a %s message from the client", msg.kind.name.lower())
            return None
        try:
            return await self.codec.decode(self.decoder, msg.payload)
        except AudioError as e:
            raise codec_close(e) from None

    async def send_output(self, out: SessionOutput) -> None:
        try:
            ogg = await self.codec.encode(self.encoder, out.pcm)
        except CodecWorkerError as e:
            raise codec_close(e) from None
        async with self.send_lock:
            if ogg:
                await self.ws.send_bytes(messages.audio(ogg))
            if out.text:
                await self.ws.send_bytes(messages.text(out.text))

    async def send_error(self, close: Close) -> None:
        await self.send_bytes(messages.error(close.message))

    async def send_transcript(self, event: TranscriptEvent) -> None:
        await self.send_bytes(messages.transcript(event))


def _name(path: str) -> str:
    """A weight file's name without the server's directories."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def metadata(ctx: ServerContext, pump: Pump, persona: Persona | None = None) -> dict:
    """What the Rust server announces before its handshake, plus the session's id, seed and length limit, and
    whether its user is transcribed."""
    params, info = pump.session.params, ctx.runtime.info
    return {
        "text_temperature": params.text_temperature,
        "text_topk": params.text_topk,
        "audio_temperature": params.audio_temperature,
        "audio_topk": params.audio_topk,
        "pad_mult": params.pad_mult,
        "repetition_penalty_context": params.repetition_penalty_context,
        "repetition_penalty": params.repetition_penalty,
        "lm_model_file": _name(info.lm_file),
        "mimi_model_file": _name(info.mimi_file),
        "model": info.id,
        "demo": info.demo,
        "build_info": BUILD_INFO,
        "instance_name": ctx.settings.instance_name,
        "session_id": pump.session.id,
        "seed": params.seed,
        "max_steps": pump.session.max_frames,
        "transcription": pump.transcript is not None,  # this session gets its user's transcripts (0x06 JSON)
        **persona_metadata(persona),
    }


def persona_metadata(persona: Persona | None) -> dict:
    """The persona a session runs with, under PersonaPlex's query names (nothing when it has none)."""
    return {} if persona is None else {"text_prompt": persona.text, "voice_prompt": persona.voice}


@router.websocket("/api/chat")
async def chat(ws: WebSocket, ctx: Context) -> None:
    adapter = KyutaiAdapter(
        ws, ctx.runtime.info.sample_rate, ctx.runtime.personas, ctx.codec, ctx.settings.opus_profile
    )

    async def greet(pump: Pump) -> None:
        unavailable = adapter.start_transcribing(pump)  # first: the metadata says whether it is on
        await adapter.send_bytes(messages.metadata(metadata(ctx, pump, adapter.persona)))
        persona = adapter.persona
        if persona is not None:  # as PersonaPlex's server: the prompt runs, then the handshake
            if not await pump.session.until_live():
                return  # the session ended during its prompt: the pump tells the client why
            logger.info(
                "kyutai session %s: persona voice %s, prompt of %d frames run in %.0f ms; handshake",
                pump.session.id,
                persona.voice,
                persona.prompt.calls,
                (pump.session.prompt_seconds or 0.0) * 1000,
            )
        await adapter.send_bytes(messages.handshake())
        if unavailable:
            await adapter.send_bytes(messages.transcription_unavailable(unavailable))

    try:
        await serve(ctx, ws, adapter, None, adapter.parameters, greet)
    finally:
        ctx.codec.release(adapter.decoder, adapter.encoder)
