"""`WS /api/asr-streaming`: moshi-server's streaming speech to text, for Kyutai's clients (DSM's scripts, Unmute).

The upgrade is refused with HTTP 401 without the API key (moshi-server's `kyutai-api-key` header or `auth_id`
query, or any form `server.access` takes), as moshi-server does; then the connection goes through the server's
admission and pump like every session, with `Ready` as its greeting and `Error{"no free channels"}` as its
refusal at capacity (`stream.StreamAdapter`: after `Ready`, no `Error`, only the close frame). Audio (`Audio`
samples, or `OggOpus` decoded on the codec threads) goes into the session through a `Feeder`; each step comes back
as `AsrStream` says. A message that cannot be read ends the connection with a close code and a reason saying why
(1003 text frame, 1007 bad message, 1009 too big), never touching any other stream. As moshi-server: the server
pings every `--ws-ping-interval` (10 s) and drops a client that does not answer, and drops one that sent nothing
for `--asr-idle-timeout` (120 s).
"""

from __future__ import annotations

import logging

import numpy as np
from fastapi import APIRouter, WebSocket

from duplexd.engine.dialogue.session import SessionOutput
from duplexd.server.codec.batches import CodecBatches, Decoder, Encoder, codec_close
from duplexd.server.codec.errors import AudioError
from duplexd.server.connection.admission import serve
from duplexd.server.connection.closing import Close, CloseCode
from duplexd.server.connection.pump import Pump, binary_frame
from duplexd.server.core.context import Context, ServerContext
from duplexd.server.stt.feeder import Feeder
from duplexd.server.stt.session import admitted, asr_parameters, new_stream

from . import asr_messages as messages
from .stream import StreamAdapter, refuse_upgrade

logger = logging.getLogger(__name__)
router = APIRouter()

PATH = "/api/asr-streaming"


class AsrAdapter(StreamAdapter):
    name = "asr"

    def __init__(self, ws: WebSocket, ctx: ServerContext) -> None:
        super().__init__(ws)
        self.ctx = ctx
        self.stream = new_stream(ctx)
        self.feeder: Feeder | None = None  # once admitted
        self.codec: CodecBatches = ctx.codec
        self.opus: tuple[Decoder, Encoder] | None = None  # made for the first OggOpus message

    def admitted(self, pump: Pump) -> None:
        self.feeder = admitted(self.ctx, pump)

    async def on_message(self, message: dict) -> np.ndarray | None:
        data = binary_frame(message, "MessagePack maps in binary frames")
        try:
            msg = messages.decode(data)
        except messages.MessageError as e:
            raise Close(CloseCode.INVALID_PAYLOAD, "invalid_message", str(e)) from None
        if isinstance(msg, messages.Marker):
            self.stream.marker(msg.id)
            return None
        pcm = msg.pcm if isinstance(msg, messages.Audio) else await self._decode(msg.data)
        assert self.feeder is not None
        self.stream.received(len(pcm))
        await self.feeder.feed(pcm)
        return None  # pushed by the feeder

    async def _decode(self, data: bytes) -> np.ndarray:
        if self.opus is None:
            self.opus = self.codec.streams(self.ctx.settings.opus_profile, self.ctx.runtime.info.sample_rate)
        try:
            return await self.codec.decode(self.opus[0], data)
        except AudioError as e:
            raise codec_close(e) from None

    def release(self) -> None:
        if self.opus is not None:
            self.codec.release(*self.opus)

    async def send_output(self, out: SessionOutput) -> None:
        answer = messages.step_messages(self.stream.step(out.frame, out.text_token, out.pause))
        assert self.feeder is not None
        self.feeder.answer(out.frame + 1)
        async with self.send_lock:
            for message in answer:
                await self.ws.send_bytes(messages.pack(message))


@router.websocket(PATH)
async def asr_streaming(ws: WebSocket, ctx: Context) -> None:
    if await refuse_upgrade(ws, ctx):
        return
    adapter = AsrAdapter(ws, ctx)

    async def greet(pump: Pump) -> None:
        adapter.admitted(pump)
        await adapter.send_ready()

    try:
        await serve(ctx, ws, adapter, None, asr_parameters, greet)
    finally:
        adapter.release()
