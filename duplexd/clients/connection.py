"""One client connection to a duplexd (or Kyutai) server, whatever the protocol: open, send frames, read events.

`protocols.open_connection` picks the protocol; both speak the same small interface so `duplexd chat` and the
load tester are written once. A refusal (no capacity, bad key, bad parameters) is a `Refused` with the server's
close code and message; anything else that goes wrong is a `ConnectionFailed`.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import NoReturn
from urllib.parse import urlencode, urlsplit, urlunsplit

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

PATHS = {"kyutai": "/api/chat", "realtime": "/v1/realtime"}
TRY_AGAIN_LATER = 1013


@dataclass(frozen=True)
class Sampling:
    """Per-session sampling, sent as the query parameters both of duplexd's protocols read."""

    text_temperature: float | None = None
    text_topk: int | None = None
    audio_temperature: float | None = None
    audio_topk: int | None = None
    seed: int | None = None

    def query(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class ConnectOptions:
    url: str = "ws://127.0.0.1:8998"
    protocol: str = "realtime"
    sampling: Sampling = field(default_factory=Sampling)
    api_key: str | None = None
    open_timeout: float = 30.0  # seconds for the upgrade and the handshake (the server may be busy)
    max_steps: int | None = None
    transcribe: bool = False  # ask for the user's transcripts (Kyutai protocol: `transcribe=1`)
    # A PersonaPlex persona: Kyutai's `text_prompt` / `voice_prompt` query parameters, or Realtime's
    # `session.instructions` / `session.voice` in a `session.update` before the first audio.
    text_prompt: str | None = None
    voice_prompt: str | None = None


@dataclass(frozen=True)
class Event:
    """Something the server sent: `audio` (float32 PCM, possibly empty), `text` (one piece), `error`, or
    `transcript` (`data`: one JSON event about the user's speech, e.g. `transcript_completed`)."""

    kind: str
    pcm: np.ndarray | None = None
    text: str = ""
    data: dict | None = None


class ConnectionFailed(Exception):
    """The connection could not be made or broke; `code` is the WebSocket close code when there was one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Refused(ConnectionFailed):
    """The server turned the session down before it started (capacity, access, parameters)."""

    @property
    def capacity(self) -> bool:
        return self.code == TRY_AGAIN_LATER


def endpoint(options: ConnectOptions) -> str:
    """The WebSocket URL: `http(s)` becomes `ws(s)`, the protocol's path is added when none is given."""
    parts = urlsplit(options.url if "://" in options.url else f"ws://{options.url}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path if parts.path not in ("", "/") else PATHS[options.protocol]
    query = options.sampling.query()
    if options.max_steps is not None:
        query["max_steps"] = str(options.max_steps)
    if options.transcribe:
        query["transcribe"] = "1"
    if options.protocol == "kyutai":
        for name in ("text_prompt", "voice_prompt"):
            if (value := getattr(options, name)) is not None:
                query[name] = value
    extra = urlencode(query)
    joined = "&".join(q for q in (parts.query, extra) if q)
    return urlunsplit((scheme, parts.netloc, path, joined, ""))


class Connection(ABC):
    """A session on the server. `open()` returns once admitted; `events()` ends when the server closes."""

    def __init__(self, options: ConnectOptions) -> None:
        self.options = options
        self.ws: ClientConnection | None = None
        self.info: dict = {}  # what the server said about the session (metadata / session object)
        self.close_code: int | None = None
        self.close_reason: str = ""

    async def open(self) -> None:
        headers = {"Authorization": f"Bearer {self.options.api_key}"} if self.options.api_key else None
        try:
            self.ws = await asyncio.wait_for(
                connect(
                    endpoint(self.options),
                    additional_headers=headers,
                    subprotocols=self.subprotocols(),
                    max_size=None,
                    ping_interval=None,
                    open_timeout=None,
                    compression=None,
                ),
                self.options.open_timeout,
            )
        except InvalidStatus as e:
            raise Refused(f"HTTP {e.response.status_code} on upgrade", e.response.status_code) from None
        except (OSError, InvalidHandshake, asyncio.TimeoutError) as e:
            raise ConnectionFailed(f"cannot connect to {endpoint(self.options)}: {e!r}") from None
        try:
            await asyncio.wait_for(self.handshake(), self.options.open_timeout)
        except ConnectionClosed as e:
            self._closed(e)
            raise Refused(self.close_reason or "closed before the session started", self.close_code) from None
        except asyncio.TimeoutError:
            await self.close()
            raise ConnectionFailed(f"no handshake within {self.options.open_timeout:g} s") from None

    async def refuse(self, message: str) -> NoReturn:
        """The server said no during the handshake: raise `Refused` with the code of the close frame that follows
        its error message (both protocols refuse that way)."""
        assert self.ws is not None
        try:
            await self.ws.recv()
        except ConnectionClosed as e:
            self._closed(e)
        raise Refused(message, self.close_code)

    def _closed(self, e: ConnectionClosed) -> None:
        frame = e.rcvd or e.sent
        self.close_code = frame.code if frame else None
        self.close_reason = frame.reason if frame else ""

    async def events(self) -> AsyncIterator[Event]:
        """Server events until the connection closes (close code and reason are kept)."""
        assert self.ws is not None
        try:
            async for message in self.ws:
                for event in self.parse(message):
                    yield event
        except ConnectionClosed as e:
            self._closed(e)
            return
        self.close_code = self.ws.close_code
        self.close_reason = self.ws.close_reason or ""

    async def send(self, pcm: np.ndarray) -> None:
        assert self.ws is not None
        await self.ws.send(self.encode(pcm))

    async def send_message(self, message: str | bytes) -> None:
        """Send an already encoded message (see `encode_stream`: the load test encodes its input once)."""
        assert self.ws is not None
        await self.ws.send(message)

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()

    def subprotocols(self) -> list | None:
        return None

    async def handshake(self) -> None:
        """Read until the server says the session is admitted; `Refused` if it says no."""
        assert self.ws is not None
        while not await self.greeting(await self.ws.recv()):
            pass

    @abstractmethod
    async def greeting(self, message: str | bytes) -> bool:
        """Take in one message of the handshake: True once admitted; `refuse` on an error."""

    @abstractmethod
    def parse(self, message: str | bytes) -> list[Event]:
        """Events in one server message."""

    @abstractmethod
    def encode(self, pcm: np.ndarray) -> str | bytes:
        """One message carrying `pcm` (float32 at 24 kHz)."""


def http_url(options: ConnectOptions, path: str) -> str:
    """The server's plain-HTTP URL for `path` (`ws` becomes `http`, `wss` becomes `https`)."""
    parts = urlsplit(options.url if "://" in options.url else f"ws://{options.url}")
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def http_get(options: ConnectOptions, path: str, timeout: float = 5.0) -> bytes:
    """The body of a GET on the server's HTTP side, with the API key when there is one. An HTTP error status still
    returns its body (`/ready` answers 503 with its JSON when full); `OSError` when the server cannot be reached."""
    request = urllib.request.Request(http_url(options, path))
    if options.api_key:
        request.add_header("Authorization", f"Bearer {options.api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as e:
        return e.read()


def describe_server(options: ConnectOptions, timeout: float = 5.0) -> dict | None:
    """The server's first `/v1/models` entry (id, demo, ...), or None when it cannot be had (best effort)."""
    try:
        data = json.loads(http_get(options, "/v1/models", timeout).decode("utf-8")).get("data") or []
    except (OSError, ValueError, AttributeError):
        return None
    return data[0] if data and isinstance(data[0], dict) else None
