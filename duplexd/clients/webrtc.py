"""A Realtime API caller over WebRTC (aiortc, the `webrtc` extra): what OpenAI's WebRTC clients do, from Python.

It creates the `oai-events` data channel and one audio track (the "microphone", paced in real time), posts its SDP
offer to `/v1/realtime/calls` (`application/sdp`, or the multipart form of an app server) and takes the answer.
The tests and `bench/webrtc_calls.py` drive duplexd with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import json
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any

import av
import numpy as np
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from duplexd import wire

MIC_RATE = 48000
FRAME = MIC_RATE // 50


class Microphone(MediaStreamTrack):
    """`pcm` (mono, 48 kHz) in 20 ms frames at real-time pace, then silence; `sent_at` the first frame's time."""

    kind = "audio"

    def __init__(self, pcm: np.ndarray) -> None:
        super().__init__()
        self.pcm, self.pts = pcm, 0
        self.started: float | None = None

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self.started is None:
            self.started = now
        elif (wait := self.started + self.pts / MIC_RATE - now) > 0:
            await asyncio.sleep(wait)
        chunk = np.zeros(FRAME, np.float32)
        part = self.pcm[self.pts : self.pts + FRAME]
        chunk[: len(part)] = part
        frame = av.AudioFrame.from_ndarray(wire.pcm16(chunk).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = MIC_RATE, self.pts, fractions.Fraction(1, MIC_RATE)
        self.pts += FRAME
        return frame


@dataclass
class Answer:
    status: int
    text: str
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.text)


def post(url: str, body: bytes, headers: dict[str, str]) -> Answer:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return Answer(
                response.status, response.read().decode(), {k.lower(): v for k, v in response.headers.items()}
            )
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read().decode(), {k.lower(): v for k, v in e.headers.items()})


class Caller:
    """One call: `call` connects, `events` gets the server's events, `heard` the decoded speech (mono, 48 kHz) and
    `heard_at` when each of its frames was decoded."""

    def __init__(self, mic: np.ndarray | None) -> None:
        """`mic`: the microphone's audio (mono, 48 kHz); None for a caller that only listens (recvonly)."""
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = Microphone(mic) if mic is not None else None
        if self.mic is not None:
            self.pc.addTrack(self.mic)
        else:
            self.pc.addTransceiver("audio", direction="recvonly")
        self.channel = self.pc.createDataChannel("oai-events")
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.opened = asyncio.Event()
        self.closed = asyncio.Event()
        self.heard: list[np.ndarray] = []
        self.heard_at: list[float] = []
        self.first_sound: float | None = None  # when the first non-silent frame was decoded
        self.call_id: str | None = None
        self._listener: asyncio.Task | None = None
        self.channel.on("open", self.opened.set)
        self.channel.on("close", self.closed.set)
        self.channel.on("message", lambda m: self.events.put_nowait(json.loads(m)))

        @self.pc.on("track")
        def on_track(track: MediaStreamTrack) -> None:
            self._listener = asyncio.ensure_future(self._listen(track))

    async def _listen(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            assert isinstance(frame, av.AudioFrame)
            data = frame.to_ndarray().reshape(-1, len(frame.layout.channels)).mean(axis=1) / 32768.0
            if self.first_sound is None and np.abs(data).max() > 1e-3:
                self.first_sound = time.monotonic()
            self.heard.append(data.astype(np.float32))
            self.heard_at.append(time.monotonic())

    async def offer(self, strip_candidates: bool = False) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        sdp = self.pc.localDescription.sdp
        if strip_candidates:  # as OpenAI's browser SDK posts it: before gathering
            lines = sdp.splitlines(keepends=True)
            sdp = "".join(line for line in lines if not line.startswith(("a=candidate", "a=end-of-candidates")))
        return sdp

    async def call(
        self,
        url: str,
        key: str | None = None,
        session: dict[str, Any] | None = None,
        strip_candidates: bool = False,
    ) -> Answer:
        """POST the offer to `url` (the calls URL): `application/sdp`, or multipart with `session` when given.
        On 201 the answer is set; any other answer is returned as it is."""
        sdp = await self.offer(strip_candidates)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if session is None:
            body, kind = sdp.encode(), "application/sdp"
        else:
            boundary = uuid.uuid4().hex
            parts = [("sdp", sdp), ("session", json.dumps(session))]
            body = (
                "".join(
                    f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
                    for name, value in parts
                ).encode()
                + f"--{boundary}--\r\n".encode()
            )
            kind = f"multipart/form-data; boundary={boundary}"
        answer = await asyncio.to_thread(post, url, body, {**headers, "Content-Type": kind})
        if answer.status == 201:
            self.call_id = answer.headers.get("location", "").rsplit("/", 1)[-1]
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer.text, type="answer"))
        return answer

    def send(self, event: dict[str, Any]) -> None:
        self.channel.send(json.dumps(event))

    async def next_event(self, kind: str, timeout: float = 20.0) -> dict[str, Any]:
        """The next event of type `kind` (those before it are dropped; an `error` raises)."""
        deadline = time.monotonic() + timeout
        while True:
            event = await asyncio.wait_for(self.events.get(), max(deadline - time.monotonic(), 0.01))
            if event["type"] == kind:
                return event
            if event["type"] == "error":
                raise AssertionError(event)

    async def hang_up(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(BaseException):
                await self._listener
        if self.mic is not None:
            self.mic.stop()
        await self.pc.close()
