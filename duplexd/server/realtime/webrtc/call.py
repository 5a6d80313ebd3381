"""One WebRTC call of the Realtime API: its peer connection, its session and the adapter that serves it.

The call is admitted before it is answered (a full or draining server answers the POST with an error, not with a
call that never speaks), then runs as a WebSocket session does, through the same pump and the same event
handlers, with three differences: events ride the `oai-events` data channel, the caller's audio arrives on the
media track instead of `input_audio_buffer.append`, and the speech goes out on the outgoing track
(`response.output_audio.delta` is not sent; `output_audio_buffer.started` / `.cleared` are).

The Realtime protocol drives either a Moshi conversation (`CallAdapter`, a `RealtimeAdapter`) or a voice agent
(`agent_call.AgentCall`, an `AgentAdapter`) behind one interface, `CallSide`: the call hands it the caller's audio,
and it speaks on the call's track. The routes pick which by the server's model (`calls.py`).

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
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from duplexd.engine.dialogue.session import Session, SessionOutput
from duplexd.server.codec import libopus
from duplexd.server.codec.streams import library
from duplexd.server.connection.closing import Close
from duplexd.server.connection.pump import Adapter, Pump
from duplexd.server.core.context import ServerContext
from duplexd.server.realtime import events as ev
from duplexd.server.realtime.conversation import RealtimeAdapter
from duplexd.wire import FRAME_SIZE

from . import stack
from .channel import ChannelSocket
from .tracks import RATE, HeardAudio, SpeechTrack

logger = logging.getLogger(__name__)

AUDIO_GATE_SECONDS = 1.0  # audio waits this long after the channel opens for the client's first session.update
LAST_EVENT_SECONDS = 1.0
OPUS_BITRATE = 32_000  # mono speech at 24 kHz: what a voice needs (aiortc's own encoder sends 96 kb/s stereo)


class BadOffer(ValueError):
    """The SDP offer cannot make a call (unparsable, or no audio to answer)."""


class CallSide(Protocol):
    """What a call needs of the adapter that serves it (an `Adapter` the pump runs, on the call's channel)."""

    audio_open: asyncio.Event  # set once the caller's first event is handled: its audio is taken from then on

    async def start(self, pump: Pump, session: dict[str, Any] | None) -> None:
        """The greeting, after `session` (the offer's or the ephemeral key's configuration) is applied."""

    async def take_audio(self, pcm: np.ndarray) -> np.ndarray | None:
        """The caller's audio from the track (mono float32 at the model's rate): what to push into the session, or
        None when the adapter feeds it itself."""

    def session_created(self) -> str:
        """The `session.created` event a sideband socket is greeted with."""

    async def aclose(self) -> None:
        """The call is over: whatever the adapter still runs stops."""


AdapterFactory = Callable[[ChannelSocket, ServerContext, SpeechTrack], CallSide]


class CallAdapter(RealtimeAdapter):
    """A Moshi conversation on a call: the model's every frame on the track, its text on the channel."""

    name = "webrtc"

    def __init__(self, socket: ChannelSocket, ctx: ServerContext, track: SpeechTrack) -> None:
        super().__init__(socket, ctx)
        self.track = track
        self.audio_open = asyncio.Event()  # the caller's audio is taken once its first event is handled

    def session_created(self) -> str:
        assert self.pump is not None
        return ev.session_created(self.session_object(self.pump.session.params))

    async def aclose(self) -> None:
        pass

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


class Call:
    """A call from its offer to its end; `run` is its task."""

    def __init__(
        self,
        call_id: str,
        ctx: ServerContext,
        session: Session,
        config: dict[str, Any] | None,
        adapter: AdapterFactory = CallAdapter,
    ) -> None:
        settings = ctx.settings
        stack.tune(settings.webrtc_jitter_frames, tuple(settings.webrtc_hosts))
        self.id, self.ctx, self.session, self.config = call_id, ctx, session, config
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=stack.ice_servers(settings.webrtc_ice_servers)))
        self.track = SpeechTrack()
        self.socket = ChannelSocket(self.hang_up)
        self.adapter = adapter(self.socket, ctx, self.track)
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
            assert isinstance(self.adapter, Adapter)
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
            await self.adapter.aclose()
            await self.socket.end_sidebands()
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
                    taken = await self.adapter.take_audio(pcm)
                except Close as close:  # the persona's prompt found no room: the call ends as a socket would
                    pump.end(close)
                    return
                if taken is not None and len(taken):
                    pump.push(taken)

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
