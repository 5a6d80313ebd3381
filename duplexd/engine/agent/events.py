"""What a streamed chat completion says, as plain data: the cascade turns these into speech and Realtime events.

One reply yields, in order: `TextDelta`s and, for each tool call, `ToolCallStart`, its `ToolCallArguments`
fragments and, once the reply has finished, its `ToolCallEnd`; then one `Finish` and, where the server counted
them, one `Usage`. Anything that goes wrong (no server, an HTTP error, a stream that breaks off or cannot be read)
is one `LLMError` raised from the stream, never a library's own exception.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TextDelta:
    """A piece of the reply's text, as the server streamed it (not cut at words: `words.WordCutter` does that)."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins: `index` orders the reply's calls; `call_id` is the server's id, or one made here where
    the server sent none (the tool's result must name it)."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """A fragment of a call's JSON arguments; the fragments of one call, joined, are its arguments."""

    index: int
    call_id: str
    fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    """A call is complete: its name and whole arguments (a JSON string as the server wrote it, not parsed here:
    a reply cut at `max_tokens` may leave its last call's arguments unfinished)."""

    index: int
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Finish:
    """The reply has ended: `reason` as the server gave it (`stop`, `length`, `tool_calls`, ...), or None where it
    gave none before ending the stream."""

    reason: str | None


@dataclass(frozen=True)
class Usage:
    """Tokens the reply took, where the server counted them (`stream_options.include_usage`)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


LLMEvent = TextDelta | ToolCallStart | ToolCallArguments | ToolCallEnd | Finish | Usage

ErrorKind = Literal["unreachable", "timeout", "http", "server", "protocol", "cut"]


class LLMError(Exception):
    """The reply failed; the message says how, in words fit for a log line or a client's error event.

    `kind`: `unreachable` (no connection), `timeout` (no connection or no data in time), `http` (an HTTP error
    status), `server` (an error the server sent inside its stream, e.g. llama.cpp's 500 when the model's output does
    not parse as a tool call), `protocol` (a stream that cannot be read: not SSE, malformed JSON), `cut` (the stream
    ended before the reply did). `status`: the HTTP status (or the in-stream error's code), where there is one.
    """

    def __init__(self, kind: ErrorKind, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.status = status
