"""One admitted conversation: a reader task (client → engine) and a writer task (engine → client).

Neither task waits on the other, so a client that floods, stalls or vanishes only ever affects its own
session. The policies (all per session, documented in docs/SERVER.md):

* faster than real time: the engine's inbox keeps `max_pending_frames`; newer frames are dropped and counted;
* stops reading: the engine's outbox keeps `max_output_frames` (the oldest is dropped and counted); a single send
  blocked for `send_timeout`, or unanswered keep-alive pings, close the connection;
* goes silent: no message for `idle_timeout` closes it (1000, "idle timeout"); with `idle_after_answers`, no message
  and no answer sent;
* vanishes: the disconnect ends the reader; the session is closed in `finally`, on every path.

Wall-clock session length is capped at `max_session_seconds` (the engine also caps the frames).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np
from starlette.datastructures import Headers, QueryParams
from starlette.types import Message
from starlette.websockets import WebSocketState

from duplexd.engine.dialogue.session import Session, SessionOutput
from duplexd.engine.errors import CapacityError, SessionClosed
from duplexd.engine.persona.prompt import PersonaPrompt
from duplexd.engine.transcription.service import TranscriptEvent, TranscriptionService, TranscriptStream
from duplexd.engine.transcription.transcriber import DEFAULT_PROMPT
from duplexd.server.core.metrics import Metrics

from .closing import Close, CloseCode, Disconnected, close_for_session_end, slow_reader

logger = logging.getLogger(__name__)

BAD_INPUT = {CloseCode.PROTOCOL_ERROR, CloseCode.UNSUPPORTED_DATA, CloseCode.INVALID_PAYLOAD, CloseCode.MESSAGE_TOO_BIG}


@dataclass(frozen=True)
class Limits:
    idle_timeout: float
    send_timeout: float
    max_session_seconds: float
    max_message_bytes: int
    late_frame_seconds: float
    # Speech to text: each answer sent restarts the idle clock too, so a client that sent audio ahead is not idle
    # while it waits for the words of it, however long stepping them takes; a conversation counts messages only.
    idle_after_answers: bool = False


class Socket(Protocol):
    """What a session's pump and adapter use of their connection: a Starlette `WebSocket`, or a WebRTC call's
    `oai-events` data channel standing in for one (`server/realtime/webrtc/channel.py`)."""

    @property
    def query_params(self) -> QueryParams: ...
    @property
    def headers(self) -> Headers: ...
    @property
    def client_state(self) -> WebSocketState: ...
    @property
    def application_state(self) -> WebSocketState: ...
    async def receive(self) -> Message: ...
    async def send_text(self, data: str) -> None: ...
    async def send_bytes(self, data: bytes) -> None: ...
    async def close(self, code: int = 1000, reason: str | None = None) -> None: ...


class Adapter(ABC):
    """A wire protocol: turns client messages into audio and engine outputs into messages."""

    name: str

    def __init__(self, ws: Socket) -> None:
        self.ws = ws
        self.send_lock = asyncio.Lock()  # sends come from both tasks; keep each message whole and in order

    def opening_prompt(self) -> PersonaPrompt | None:
        """The persona prompt the engine runs as the session is admitted (Kyutai: from the query); None when there
        is none, or when the protocol starts it later itself."""
        return None

    @abstractmethod
    async def on_message(self, message: dict) -> np.ndarray | None:
        """Handle one ASGI `websocket.receive` message; return audio to push (or None). Raise `Close`."""

    @abstractmethod
    async def send_output(self, out: SessionOutput) -> None:
        """Send one output frame (audio and text)."""

    @abstractmethod
    async def send_error(self, close: Close) -> None:
        """Tell the client why the connection is about to close."""

    async def send_transcript(self, event: TranscriptEvent) -> None:  # noqa: B027 - optional
        """Send one transcription event (speech started/stopped, transcript); only once `Pump.transcribe` was
        called. Protocols without transcription never get one."""

    async def send_bytes(self, data: bytes) -> None:
        async with self.send_lock:
            await self.ws.send_bytes(data)

    async def send_text(self, data: str) -> None:
        async with self.send_lock:
            await self.ws.send_text(data)


async def receive(ws: Socket, timeout: float | None = None) -> dict:
    """The next client message; `Disconnected` when the client has gone, `TimeoutError` after `timeout` (None, as
    the pump calls it: no timer, its watchdog keeps the idle timeout)."""
    try:
        message = await (ws.receive() if timeout is None else asyncio.wait_for(ws.receive(), timeout))
    except asyncio.TimeoutError:
        raise TimeoutError from None
    except RuntimeError as e:  # starlette: receive after the disconnect message
        raise Disconnected(str(e)) from None
    if message["type"] == "websocket.disconnect":
        raise Disconnected(f"client left (close code {message.get('code')})", message.get("code"))
    return cast(dict, message)  # starlette's Message is a dict typed as a MutableMapping


def binary_frame(message: dict, expected: str) -> bytes:
    """The bytes of a binary protocol's message; `Close` (1003) naming what to send (`expected`) for a text frame."""
    data = message.get("bytes")
    if data is None:
        raise Close(
            CloseCode.UNSUPPORTED_DATA, "text_frame", f"text frames are not part of this protocol: send {expected}"
        )
    return data


def text_frame(message: dict) -> str:
    """The text of a JSON protocol's message; `Close` (1003) for a binary frame."""
    text = message.get("text")
    if text is None:
        raise Close(
            CloseCode.UNSUPPORTED_DATA,
            "binary_frame",
            "binary frames are not part of this protocol: send JSON events as text",
        )
    return text


def message_size(message: dict) -> int:
    data = message.get("bytes")
    return len(data) if data is not None else len(message.get("text") or "")


def check_size(message: dict, limit: int) -> None:
    """`Close` (1009) for a message over `limit` bytes."""
    size = message_size(message)
    if size > limit:
        raise Close(
            CloseCode.MESSAGE_TOO_BIG, "message_too_big", f"message of {size} bytes is over the limit of {limit} bytes"
        )


class Pump:
    """Runs one admitted session until it ends, then always closes it (slot and pages back)."""

    def __init__(
        self,
        adapter: Adapter,
        session: Session,
        limits: Limits,
        metrics: Metrics,
        transcription: TranscriptionService | None = None,
    ) -> None:
        self.adapter, self.session, self.limits, self.metrics = adapter, session, limits, metrics
        self.transcription = transcription
        self.transcript: TranscriptStream | None = None
        self._relay: asyncio.Task | None = None
        self.started = time.monotonic()
        # What the watchdog checks: when the client last sent a message, and since when a send has been blocked
        # (None: no send in progress). One timer per session instead of two per frame (wait_for makes a task).
        self._last_message = self.started
        self._last_answer = -math.inf  # when the last output was sent (`Limits.idle_after_answers`)
        self._sending_since: float | None = None
        self._ended = asyncio.Event()  # set by `end`: the server ends this session (drain timeout)
        self._end_close: Close | None = None

    # ------------------------------------------------------------------------------------------- the tasks

    async def read(self, ws: Socket) -> None:
        """Client messages from `ws` through the adapter into the session, until `Disconnected` or `Close`: the
        session's own connection, or another socket acting on it (a WebRTC call's sideband)."""
        while True:
            message = await receive(ws)
            self._last_message = time.monotonic()
            check_size(message, self.limits.max_message_bytes)
            pcm = await self.adapter.on_message(message)
            if pcm is not None and len(pcm):
                self.push(pcm)

    def push(self, pcm: np.ndarray) -> None:
        """Queue audio (frames over the inbox bound are dropped and counted by the engine's drop events). Audio
        keeps the session from idling, whether it came in a message or on a call's media track."""
        self._last_message = time.monotonic()
        with contextlib.suppress(SessionClosed):  # the writer sees the end and reports it
            self.session.push(pcm)
        if self.transcript is not None:
            self.transcript.push(pcm)

    # ------------------------------------------------------------------------------------------- transcription

    def transcribe(self, prompt: str = DEFAULT_PROMPT) -> None:
        """Transcribe the user's audio from now on; the adapter's `send_transcript` gets the events. Idempotent.
        `CapacityError` when this server has no transcriber or all its streams are taken (the conversation goes
        on either way)."""
        if self.transcript is not None:
            return
        if self.transcription is None:
            raise CapacityError("this server has no transcriber (start it with --transcribe MODEL)")
        self.transcript = self.transcription.open_stream(prompt)
        self._relay = asyncio.create_task(self._relay_transcripts(self.transcript), name="ws-transcripts")

    def stop_transcribing(self) -> None:
        """Stop transcribing; events the stream still held are not sent."""
        if self._relay is not None:
            self._relay.cancel()
            self._relay = None
        if self.transcript is not None:
            self.transcript.close()
            self.transcript = None

    async def _relay_transcripts(self, stream: TranscriptStream) -> None:
        while (event := await stream.recv()) is not None:
            try:
                await self.adapter.send_transcript(event)
            except Exception as e:  # noqa: BLE001 - the transport is gone: the reader and writer report it
                logger.debug("session %s: transcript not sent: %s", self.session.id, e)
                return

    async def _write(self) -> None:
        limits = self.limits
        session = self.session
        while True:
            out = await session.recv()
            if out is None:
                raise close_for_session_end(session.close_reason)
            now = time.monotonic()
            delay = now - out.arrival  # since the input frame whose step made this output was pushed
            self.metrics.latency.observe(delay)
            if delay > limits.late_frame_seconds:
                self.metrics.late.inc()
            self._sending_since = self._last_answer = now
            try:
                await self.adapter.send_output(out)
            except Close:  # the adapter ends the session (its output cannot be made)
                raise
            except Exception as e:  # noqa: BLE001 - the transport is gone; any other error means the same
                raise Disconnected(str(e)) from None
            self._sending_since = None

    async def _watch(self) -> None:
        """Idle and send timeouts: ends the session when the client sent nothing for `idle_timeout` (nor was sent an
        answer, with `idle_after_answers`), or when one send has been blocked for `send_timeout`. Wakes at the next
        deadline that could pass, not per frame."""
        limits = self.limits
        while True:
            now = time.monotonic()
            active = max(self._last_message, self._last_answer) if limits.idle_after_answers else self._last_message
            idle_at = active + limits.idle_timeout
            if now >= idle_at:
                raise Close(CloseCode.NORMAL, "idle_timeout", f"idle timeout: no message for {limits.idle_timeout:g} s")
            sending = self._sending_since
            if sending is not None and now >= sending + limits.send_timeout:
                raise slow_reader(limits.send_timeout)
            # A send that starts after now cannot time out before now + send_timeout.
            await asyncio.sleep(min(idle_at, (now if sending is None else sending) + limits.send_timeout) - now)

    def end(self, close: Close) -> None:
        """End the session from outside (the drain timed out): the client gets `close`."""
        self._end_close = close
        self._ended.set()

    async def _until_ended(self) -> None:
        await self._ended.wait()
        assert self._end_close is not None
        raise self._end_close

    async def run(self) -> Close | Disconnected:
        """Pump until the session ends; returns the close sent to the client, or how it disconnected."""
        self._last_message = time.monotonic()  # the idle clock starts with the conversation, after the greeting
        tasks = [
            asyncio.create_task(self.read(self.adapter.ws), name="ws-read"),
            asyncio.create_task(self._write(), name="ws-write"),
            asyncio.create_task(self._watch(), name="ws-watch"),
            asyncio.create_task(self._until_ended(), name="ws-end"),
        ]
        try:
            remaining = self.limits.max_session_seconds - (time.monotonic() - self.started)  # inf: no cap
            timeout = None if math.isinf(remaining) else max(remaining, 0)
            done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                outcome: BaseException | None = Close(
                    CloseCode.NORMAL, "max_session_length", "maximum session length reached"
                )
            else:  # when both ended, the reader's reason is the cause (the writer only saw the session end)
                outcome = (tasks[0] if tasks[0] in done else next(iter(done))).exception()
        finally:
            relay = self._relay
            self.stop_transcribing()
            if relay is not None:
                tasks.append(relay)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            self.session.close("client")
        end = count_end(outcome, self.metrics, self.adapter.name, f"session {self.session.id}")
        if isinstance(end, Close):
            await close_connection(self.adapter, end, self.limits.send_timeout)
        return end


def count_end(outcome: BaseException | None, metrics: Metrics, protocol: str, name: str) -> Close | Disconnected:
    """How a connection ended (its first task's exception), counted once: `closed` by a disconnect's label or a
    close's error, and `protocol_errors` (under `protocol`) for bad input.

    `lost` and `internal_error` are kept apart on purpose: `lost` is the client's side (a dropped connection, and a
    send that failed, which its sender raises as `Disconnected`: the transport is gone and nothing of ours needs
    mending), while anything else that ended a connection is a failure of ours, logged with its traceback and
    counted `internal_error` (1011 to the client). No outcome (None: the tasks each end by raising, so none gave a
    reason) is taken as the connection gone: `lost`."""
    if outcome is None:
        outcome = Disconnected("client left")
    if isinstance(outcome, Disconnected):
        metrics.closed.labels(outcome.label).inc()
        return outcome
    if not isinstance(outcome, Close):
        logger.error("%s failed", name, exc_info=outcome)
        outcome = Close(CloseCode.INTERNAL_ERROR, "internal_error", "internal server error")
    metrics.closed.labels(outcome.error).inc()
    if outcome.code in BAD_INPUT:
        metrics.protocol_errors.labels(protocol, outcome.error).inc()
    return outcome


async def close_connection(adapter: Adapter, close: Close, timeout: float) -> None:
    """Send the error message (if any) and the close frame, without waiting long on a client that stalls."""
    if not connected(adapter.ws):
        return
    with contextlib.suppress(Exception):
        if close.notify:
            await asyncio.wait_for(adapter.send_error(close), timeout)
        await _close_frame(adapter.ws, close, timeout)


async def close_socket(ws: Socket, close: Close, timeout: float) -> None:
    """The close frame alone (no error message), the same way."""
    if not connected(ws):
        return
    with contextlib.suppress(Exception):
        await _close_frame(ws, close, timeout)


def connected(ws: Socket) -> bool:
    return ws.client_state == WebSocketState.CONNECTED and ws.application_state == WebSocketState.CONNECTED


async def _close_frame(ws: Socket, close: Close, timeout: float) -> None:
    await asyncio.wait_for(ws.close(close.code, close.reason), min(timeout, 2.0))
