"""One WebRTC call of the Realtime API: its peer connection, its session and the adapter that serves it.

The call is admitted before it is answered (a full or draining server answers the POST with an error, not with a
call that never speaks), then runs as a WebSocket session does, through the same pump and the same event
handlers (`RealtimeAdapter`), with three differences: events ride the `oai-events` data channel, the caller's
audio arrives on the media track instead of `input_audio_buffer.append`, and the model's speech goes out on the
outgoing track (`response.output_audio.delta` is not sent; `output_audio_buffer.started` / `.cleared` are).

A call that has not opened its data channel `--webrtc-connect-timeout` seconds after its offer is ended: a client
that gives up while connecting never hangs up. A server hang-up (`/hangup`, the drain, an error) sends its last
event (`error` naming why) and waits for it to leave before closing the connection: the browser notices a silent
peer only seconds later.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from starlette.websockets import WebSocket

from duplexd.engine.dialogue.session import Session, SessionOutput
from duplexd.server.codec import libopus
from duplexd.server.codec.streams import library
from duplexd.server.connection.closing import Close, CloseCode
from duplexd.server.connection.pump import Pump, close_socket
from duplexd.server.core.context import ServerContext
from duplexd.server.realtime import events as ev
from duplexd.server.realtime.conversation import RealtimeAdapter
from duplexd.wire import FRAME_SIZE

from . import stack
from .channel import ChannelSocket
from .tracks import RATE, HeardAudio, SpeechTrack

logger = logging.getLogger(__name__)

SIDEBAND_SEND_SECONDS = 2.0
AUDIO_GATE_SECONDS = 1.0  # audio waits this long after the channel opens for the client's first session.update
LAST_EVENT_SECONDS = 1.0
OPUS_BITRATE = 32_000  # mono speech at 24 kHz: what a voice needs (aiortc's own encoder sends 96 kb/s stereo)


class BadOffer(ValueError):
    """The SDP offer cannot make a call (unparsable, or no audio to answer)."""


class CallAdapter(RealtimeAdapter):
    name = "webrtc"

    def __init__(self, socket: ChannelSocket, ctx: ServerContext, track: SpeechTrack) -> None:
        super().__init__(socket, ctx)
        self.track = track
        self.sidebands: set[WebSocket] = set()  # control sockets attached by `?call_id=` (sideband.py)
        self.audio_open = asyncio.Event()  # the caller's audio is taken once its first event is handled

    async def send_text(self, data: str) -> None:
        """On the data channel, and to every sideband (one that cannot take it in time is dropped)."""
        await super().send_text(data)
        for ws in list(self.sidebands):
            try:
                await asyncio.wait_for(ws.send_text(data), SIDEBAND_SEND_SECONDS)
            except Exception:  # noqa: BLE001 - its reader sees it gone; the call goes on
                self.sidebands.discard(ws)

    async def on_message(self, message: dict) -> np.ndarray | None:
        pcm = await super().on_message(message)
        self.audio_open.set()
        return pcm

    async def clear_output(self, event: ev.OutputClear) -> None:
        """`output_audio_buffer.clear`: the speech not sent yet is dropped; the assistant's item is truncated to
        what went out (the server knows it: the client cannot, over WebRTC)."""
        self.track.clear()
        played_ms = round(self.track.played * 1000 / RATE)
        await self.send_text(ev.server_event("output_audio_buffer.cleared", response_id=self.response_id))
        await self.send_text(ev.item_truncated(self.item_id, 0, played_ms))

    async def send_output(self, out: SessionOutput) -> None:
        messages = []
        if not self.response_started:
            self.response_started = True
            messages += [
                ev.response_created(self.response_id),
                ev.server_event("output_audio_buffer.started", response_id=self.response_id),
            ]
        self.track.play(out.pcm)
        if out.text:
            self.said.append(out.text)
            messages.append(ev.transcript_delta(self.response_id, self.item_id, out.text))
        for message in messages:
            await self.send_text(message)

    async def end_sidebands(self) -> None:
        for ws in list(self.sidebands):
            await close_socket(ws, Close(CloseCode.NORMAL, "call_ended", "the call ended"), SIDEBAND_SEND_SECONDS)
        self.sidebands.clear()


class Call:
    """A call from its offer to its end; `run` is its task."""

    def __init__(self, call_id: str, ctx: ServerContext, session: Session, config: dict[str, Any] | None) -> None:
        settings = ctx.settings
        stack.tune(settings.webrtc_jitter_frames, tuple(settings.webrtc_hosts))
        self.id, self.ctx, self.session, self.config = call_id, ctx, session, config
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=stack.ice_servers(settings.webrtc_ice_servers)))
        self.track = SpeechTrack()
        self.socket = ChannelSocket(self.hang_up)
        self.adapter = CallAdapter(self.socket, ctx, self.track)
        self.pump: Pump | None = None
        self.task: asyncio.Task | None = None  # `run`, held here while the call is in `ServerContext.calls`
        self.ending = False  # its session is over and it is hanging up: no longer a call in progress
        self._remote: Any = None  # the caller's audio track
        self._encoder: libopus.Encoder | None = None  # the speech's, on an Opus call
        self._closed = False

        @self.pc.on("datachannel")
        def on_datachannel(channel: Any) -> None:
            if channel.label == "oai-events" and self.socket.client_state.name == "CONNECTING":
                self.socket.attach(channel)

        @self.pc.on("track")
        def on_track(track: Any) -> None:
            if track.kind == "audio" and self._remote is None:
                self._remote = track

        @self.pc.on("connectionstatechange")
        async def on_state() -> None:
            if self.pc.connectionState in ("failed", "closed"):
                self.socket.gone(f"the peer connection {self.pc.connectionState}")

    async def answer(self, offer: str) -> str:
        """The SDP answer to `offer`; `BadOffer` when it cannot make a call."""
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer, type="offer"))
        except (ValueError, KeyError, IndexError) as e:
            raise BadOffer(f"the SDP offer could not be read: {e}") from None
        audio = [t for t in self.pc.getTransceivers() if t.kind == "audio"]
        if not audio:
            raise BadOffer("the SDP offer has no audio section: a call needs one (m=audio, Opus or PCMU/PCMA)")
        audio[0].direction = "sendrecv"
        self.pc.addTrack(self.track)
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        codecs = audio[0]._codecs  # negotiated, the one used first (aiortc 1.16's attribute)
        lib = library()
        if codecs and codecs[0].mimeType.lower() == "audio/opus" and lib is not None:
            self._encoder = libopus.Encoder(lib, RATE, libopus.OPUS_APPLICATION_VOIP, bitrate=OPUS_BITRATE)
            self.track.encode_with(self._encoder.encode)
        return self.pc.localDescription.sdp

    async def run(self) -> None:
        """Wait for the caller's channel (or expire), then pump the session until the call ends."""
        ctx, metrics = self.ctx, self.ctx.metrics
        try:
            try:
                await asyncio.wait_for(self.socket.opened.wait(), ctx.settings.webrtc_connect_timeout)
            except asyncio.TimeoutError:
                metrics.refused.labels("connect_timeout").inc()
                logger.info("call %s never connected: ended after %gs", self.id, ctx.settings.webrtc_connect_timeout)
                return
            if self.socket.client_state.name == "DISCONNECTED":
                return
            pump = self.pump = Pump(self.adapter, self.session, ctx.limits, metrics, ctx.runtime.transcription)
            ctx.drain.add(pump)
            listener = asyncio.create_task(self._listen(), name="call-audio")
            try:
                await self.adapter.start(pump, self.config)
                asyncio.get_running_loop().call_later(AUDIO_GATE_SECONDS, self.adapter.audio_open.set)
                end = await pump.run()
            finally:
                listener.cancel()
                with contextlib.suppress(BaseException):
                    await listener
                ctx.drain.discard(pump)
            logger.info("call %s ended: %s", self.id, end.error if isinstance(end, Close) else end)
        finally:
            self.ending = True  # before the caller can see the connection close: `/hangup` then finds no call
            self.session.close("client")
            await self.adapter.end_sidebands()
            await self.hang_up()

    async def _listen(self) -> None:
        """The caller's audio into the session, from the first handled event on; silence at real-time pace for a
        caller that sends none (a listen-only offer), since the model steps on its input."""
        pump = self.pump
        assert pump is not None
        frames = self._frames() if self._remote is not None else self._silence()
        async for pcm in frames:
            if self.adapter.audio_open.is_set() and len(pcm):
                try:
                    pump.push(await self.adapter.take_audio(pcm))
                except Close as close:  # the persona's prompt found no room: the call ends as a socket would
                    pump.end(close)
                    return

    async def _frames(self) -> AsyncIterator[np.ndarray]:
        heard = HeardAudio()
        while True:
            try:
                frame = await self._remote.recv()
            except MediaStreamError:
                return
            yield heard(frame)

    @staticmethod
    async def _silence() -> AsyncIterator[np.ndarray]:
        loop, frame = asyncio.get_running_loop(), np.zeros(FRAME_SIZE, np.float32)
        start = loop.time()
        for n in itertools.count(1):
            await asyncio.sleep(max(start + n * FRAME_SIZE / RATE - loop.time(), 0))
            yield frame

    def end(self, close: Close) -> None:
        """End the call from the server's side (`/hangup`): the client gets `close`'s error event first."""
        if self.pump is not None:
            self.pump.end(close)
        else:  # still connecting: `run` stops waiting, frees the slot and hangs up
            self.socket.gone(close.message)
            self.socket.opened.set()

    async def hang_up(self) -> None:
        """Close the connection, after the last event has left."""
        if self._closed:
            return
        self._closed = True
        await self.socket.drained(LAST_EVENT_SECONDS)
        self.track.stop()
        await self.pc.close()
        if self._encoder is not None:
            self._encoder.close()
