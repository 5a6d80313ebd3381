"""A voice agent on a WebRTC call: the `AgentAdapter` with the call's audio.

The caller's audio from the media track goes to the STT stream as `input_audio_buffer.append`'s would; the agent's
speech goes out on the call's track, paced as on the WebSocket (each frame `LEAD_S` ahead of when it plays), and no
`response.output_audio.delta` is sent, as OpenAI does on a call. `output_audio_buffer.started` comes with a
response's first frame and `.stopped` once its last has played; `output_audio_buffer.clear` from the client, and
the user cutting in (with `interrupt_response`), drop what has not been played and say
`output_audio_buffer.cleared`. Unlike a WebSocket client the server knows what was played (the track's count of
samples sent), so the assistant's item is truncated to exactly that.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from duplexd.engine.agent.reply import Audio, Done
from duplexd.server.connection.pump import Pump
from duplexd.server.core.context import ServerContext
from duplexd.server.realtime import events as ev
from duplexd.server.realtime.agent import AgentAdapter, Running

from .channel import ChannelSocket
from .tracks import RATE, SpeechTrack

MIN_WAIT_S = 0.02  # the track sends 20 ms at a time


@dataclass
class OnTrack:
    """One response's speech on the track, as samples of the track's count of speech sent (`SpeechTrack.played`):
    from `start` up to `end` (which a clear moves back to what was played). It is the output audio buffer from
    `started` until `stopped` or `cleared`, gaps in the speech (a slow LLM) included."""

    response_id: str
    item_id: str | None
    start: int
    end: int
    cleared: bool = False
    stopped: bool = False

    @property
    def on(self) -> bool:
        return not (self.cleared or self.stopped)

    def played(self, track: SpeechTrack) -> int:
        return max(0, min(track.played, self.end) - self.start)


class AgentCall(AgentAdapter):
    name = "webrtc"

    def __init__(self, socket: ChannelSocket, ctx: ServerContext, track: SpeechTrack) -> None:
        super().__init__(socket, ctx)
        self.track = track
        self.audio_open = asyncio.Event()  # the caller's audio is taken once its first event is handled
        self.on_track: OnTrack | None = None  # the last response that spoke
        self.stopping: asyncio.Task | None = None  # waits for its speech to play out: `output_audio_buffer.stopped`

    async def start(self, pump: Pump, session: dict[str, Any] | None) -> None:
        await self.greet(pump, session)

    def session_created(self) -> str:
        return ev.session_created(self.session_object())

    async def on_message(self, message: dict) -> np.ndarray | None:
        await super().on_message(message)
        self.audio_open.set()
        return None

    async def take_audio(self, pcm: np.ndarray) -> None:
        """The caller's audio, into the STT stream through the feeder (which pushes it as the model answers)."""
        self.client_samples += len(pcm)
        await self.feed(pcm)

    # ------------------------------------------------------------------------------------------- the speech

    async def play(self, r: Running, audio: Audio) -> bool:
        """The frame onto the track, unless `r` was cancelled: checked and played with no await between, so a
        barge-in's clear (sync, in the STT's writer) is never followed by more of the cancelled speech."""
        async with self.send_lock:
            if r.cancelled is not None:
                return False
            speech = self.on_track
            first = speech is None or speech.response_id != r.id
            if speech is None or first:
                at = self.track.played + self.track.queued
                speech = self.on_track = OnTrack(r.id, r.message_id, at, at)
            self.track.play(audio.pcm)
            speech.end += len(audio.pcm)
            if first:
                await self.ws.send_text(ev.server_event("output_audio_buffer.started", response_id=r.id))
            return True

    def played_ms(self, r: Running) -> int:
        speech = self.on_track
        if speech is None or speech.response_id != r.id:
            return 0
        return round(speech.played(self.track) * 1000 / RATE)

    async def finish(self, r: Running, done: Done | None) -> None:
        await super().finish(r, done)
        speech = self.on_track
        if speech is not None and speech.response_id == r.id and speech.on:
            self.stopping = asyncio.create_task(self.played_out(speech), name=f"agent-call-stopped-{r.id}")

    async def played_out(self, speech: OnTrack) -> None:
        """`output_audio_buffer.stopped` once the track has sent the last of `speech`."""
        while self.track.played < speech.end:
            if self.track.readyState != "live":
                return
            await asyncio.sleep(max((speech.end - self.track.played) / RATE, MIN_WAIT_S))
        speech.stopped = True
        await self.send_text(ev.server_event("output_audio_buffer.stopped", response_id=speech.response_id))

    def clear_track(self) -> str:
        """Drop the speech not played yet; `output_audio_buffer.cleared` to send."""
        self.track.clear()
        speech = self.on_track
        if speech is not None and speech.on:
            speech.cleared = True
            speech.end = min(speech.end, self.track.played)
        if self.stopping is not None:
            self.stopping.cancel()
            self.stopping = None
        running = self.running.id if self.running is not None else None
        response_id = speech.response_id if speech is not None else running
        return ev.server_event("output_audio_buffer.cleared", response_id=response_id or "")

    # ------------------------------------------------------------------------------------------- cutting it short

    def barge_in(self) -> list[str]:
        """The user cut in: the response is cancelled and its speech not played dropped, before speech_started
        goes out; `cleared` follows it while the agent's speech is on (started, not yet stopped)."""
        super().barge_in()
        if self.on_track is None or not self.on_track.on:
            return []
        return [self.clear_track()]

    async def clear_output(self, event: ev.OutputClear) -> None:
        """`output_audio_buffer.clear`: the speech not played is dropped, and the response making it cancelled (the
        server stops generating audio, as OpenAI's does); an assistant item already done is truncated to what was
        played (`conversation.item.truncated`), one under way ends with it."""
        if self.running is not None:
            self.cancel("client_cancelled")
        speech = self.on_track
        unplayed = speech is not None and speech.on and self.track.played < speech.end
        cleared = self.clear_track()
        await self.send_text(cleared)
        if speech is None or not unplayed or speech.item_id is None or speech.item_id not in self.conversation:
            return
        if self.running is not None and self.running.id == speech.response_id:
            return  # its item is closed with the words played when the response ends
        played = round(speech.played(self.track) * 1000 / RATE)
        await self.truncate(
            ev.ItemTruncate(
                type="conversation.item.truncate", item_id=speech.item_id, content_index=0, audio_end_ms=played
            )
        )

    async def aclose(self) -> None:
        if self.stopping is not None:
            self.stopping.cancel()
            with contextlib.suppress(BaseException):
                await self.stopping
        await super().aclose()
