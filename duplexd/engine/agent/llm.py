"""A streaming client of an OpenAI-compatible `POST /v1/chat/completions` (vLLM, llama.cpp's server, Ollama,
OpenAI): one request at a time, its reply as plain events while it streams (`events.py`).

It speaks HTTP through `httpx2` (which the hub client already brings) and reads the server-sent events itself,
rather than through the `openai` package: the voice agent needs the raw chunks of many servers, each with its own
quirks (`chunks.py`), and the server process one dependency fewer. Cancelling the task that iterates a stream
exits the request's `async with`, which closes the connection at once; llama.cpp and vLLM stop generating for a
client that has gone, so a barged-in reply frees its server slot. Nothing is retried: a retried reply would say
again the words already spoken.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx2

from ..errors import InputRefused
from .chunks import ChunkParser
from .events import LLMError, LLMEvent

log = logging.getLogger(__name__)

ERROR_BODY_BYTES = 16384  # enough of an error reply to quote its message


@dataclass(frozen=True)
class LLMConfig:
    """Where the LLM is and how to ask it.

    `base_url`: the API root, `/v1` included (`http://127.0.0.1:8080/v1`); `model`: vLLM and OpenAI need the
    served name, llama.cpp ignores it; `read_timeout_s`: the longest the server may stay silent, the first token
    after a long prompt included; `temperature`, `max_tokens`: None leaves the server's default; `extra_body`:
    more fields of the request body as given (`top_p`, `chat_template_kwargs`, ...), over the ones set here.
    """

    base_url: str
    model: str = "default"
    api_key: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    temperature: float | None = None
    max_tokens: int | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    include_usage: bool = True  # ask for the token counts (`stream_options.include_usage`)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise InputRefused(f"the LLM's URL must start with http:// or https://, not {self.base_url!r}", "llm")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise InputRefused("the LLM's timeouts must be positive", "llm")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InputRefused(f"the LLM's max_tokens must be at least 1, not {self.max_tokens}", "llm")

    @property
    def chat_url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"


@dataclass(frozen=True)
class ChatRequest:
    """One turn to complete: `messages` and `tools` in the chat-completions API's own shapes (plain dicts, as the
    cascade keeps its conversation), `tool_choice` (`auto`, `none`, `required`; llama.cpp takes only strings), and
    overrides of the config for this request (None: the config's)."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] = ()
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)


def request_body(config: LLMConfig, request: ChatRequest) -> dict[str, Any]:
    """The JSON body of a streamed request: the config's settings, then the request's, then both extra bodies."""
    body: dict[str, Any] = {"model": config.model, "messages": list(request.messages), "stream": True}
    if config.include_usage:
        body["stream_options"] = {"include_usage": True}
    temperature = request.temperature if request.temperature is not None else config.temperature
    if temperature is not None:
        body["temperature"] = temperature
    max_tokens = request.max_tokens if request.max_tokens is not None else config.max_tokens
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if request.tools:
        body["tools"] = list(request.tools)
    if request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    if request.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    return body | dict(config.extra_body) | dict(request.extra_body)


class LLMClient:
    """Streams chat completions from one server, over a pool of kept-alive connections (`aclose` or `async with`
    closes it)."""

    def __init__(self, config: LLMConfig) -> None:
        self.config = config
        headers = {"Accept": "text/event-stream"}
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        timeout = httpx2.Timeout(
            connect=config.connect_timeout_s,
            read=config.read_timeout_s,
            write=config.read_timeout_s,
            pool=config.connect_timeout_s,
        )
        self._http = httpx2.AsyncClient(headers=headers, timeout=timeout)

    async def __aenter__(self) -> LLMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def models(self) -> list[str]:
        """The ids the server's `GET /models` lists (vLLM answers 404 to any other `model`)."""
        url = self.config.base_url.rstrip("/") + "/models"
        try:
            response = await self._http.get(url, headers={"Accept": "application/json"})
        except httpx2.HTTPError as exc:
            raise _transport_error(exc, url, self.config, mid_reply=False) from None
        if response.status_code >= 400:
            raise _http_error(response.status_code, response.reason_phrase, response.content, url)
        try:
            return [str(model["id"]) for model in response.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise LLMError("protocol", f"{url} did not answer an OpenAI model list: {response.text[:200]!r}") from None

    async def stream(self, request: ChatRequest) -> AsyncGenerator[LLMEvent, None]:
        """The reply to `request`, event by event (`events.py` gives their order); raises `LLMError` if it fails.

        Cancel the task iterating it to stop the reply: the connection closes at once. A consumer that stops
        iterating without cancelling should close the generator (`contextlib.aclosing`) to close it as promptly.
        """
        url = self.config.chat_url
        parser = ChunkParser()
        done = answered = False
        chunks = 0
        try:
            async with self._http.stream("POST", url, json=request_body(self.config, request)) as response:
                answered = True
                if response.status_code >= 400:
                    body = await _read_some(response)
                    raise _http_error(response.status_code, response.reason_phrase, body, url)
                if response.headers.get("content-type", "").startswith("application/json"):
                    raise _not_a_stream(await _read_some(response), url)
                async for kind, payload in _server_sent_events(response.aiter_lines()):
                    if payload.strip() == "[DONE]":
                        done = True
                        break
                    chunks += 1
                    for event in parser.feed(payload, kind):
                        yield event
        except httpx2.HTTPError as exc:
            if not (parser.finished and isinstance(exc, httpx2.TransportError)):
                raise _transport_error(exc, url, self.config, mid_reply=answered) from None
            log.debug("the LLM stream broke after its finish reason (%s: %s)", type(exc).__name__, exc)
        if not (done or parser.finished):
            raise LLMError(
                "cut", f"the LLM server at {url} ended its stream mid-reply, after {chunks} chunks and before finishing"
            )
        for event in parser.end():
            yield event


async def _server_sent_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, str]]:
    """(event type, data) of each server-sent event: `data:` lines joined, comments and ids skipped; an event not
    ended by a blank line at the stream's end still counts."""
    kind = ""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield kind, "\n".join(data)
            kind, data = "", []
            continue
        field_name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field_name == "data":
            data.append(value)
        elif field_name == "event":
            kind = value
    if data:
        yield kind, "\n".join(data)


async def _read_some(response: httpx2.Response) -> bytes:
    body = b""
    async for piece in response.aiter_bytes():
        body += piece
        if len(body) >= ERROR_BODY_BYTES:
            break
    return body[:ERROR_BODY_BYTES]


def _detail(body: bytes) -> str:
    """An error reply's message: OpenAI's `{"error": {"message"}}`, Ollama's `{"error": "..."}`, or the text."""
    text = body.decode("utf-8", "replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict):
            text = str(error.get("message") or error.get("detail") or json.dumps(error))
        elif error is not None:
            text = str(error)
    text = " ".join(text.split())
    return (text[:297] + "...") if len(text) > 300 else (text or "(no body)")


def _http_error(status: int, reason: str, body: bytes, url: str) -> LLMError:
    hints = {
        401: " (check the API key)",
        403: " (check the API key)",
        404: " (check the base URL, which most servers want ending in /v1, and the model's name)",
    }
    return LLMError(
        "http",
        f"the LLM server at {url} answered HTTP {status} {reason}: {_detail(body)}{hints.get(status, '')}",
        status,
    )


def _not_a_stream(body: bytes, url: str) -> LLMError:
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and parsed.get("error") is not None:
        return LLMError("server", f"the LLM server at {url} failed: {_detail(body)}")
    return LLMError("protocol", f"the LLM server at {url} answered one JSON reply, not a stream of events")


def _transport_error(exc: httpx2.HTTPError, url: str, config: LLMConfig, mid_reply: bool) -> LLMError:
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, httpx2.ConnectTimeout):
        return LLMError("timeout", f"no connection to the LLM server at {url} within {config.connect_timeout_s:g} s")
    if isinstance(exc, httpx2.ConnectError):
        return LLMError("unreachable", f"cannot reach the LLM server at {url} ({what})")
    if isinstance(exc, httpx2.TimeoutException):
        return LLMError("timeout", f"the LLM server at {url} sent nothing for {config.read_timeout_s:g} s")
    if isinstance(exc, httpx2.TransportError):
        if mid_reply:
            return LLMError("cut", f"the connection to the LLM server at {url} broke mid-reply ({what})")
        return LLMError("unreachable", f"the LLM server at {url} closed the connection without answering ({what})")
    return LLMError("protocol", f"the LLM server at {url} sent a reply that cannot be read ({what})")
