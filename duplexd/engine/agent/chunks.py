"""Chat-completion chunks (the JSON of each `data:` line) to events, whatever the server.

Servers differ in what they repeat and what they leave out, so this reads the stream by OpenAI's rules and
tolerates the rest: a tool call is keyed by its `index` (by its `id`, or the latest call, where a server sends
no index); its id and name are taken from the first fragment that has them (a server repeating them in every
fragment adds nothing; one sending no id gets one made here); arguments come in any number of fragments, as a
string or, from some servers, as an object; more than one call may come even when `parallel_tool_calls` was false.
Calls end when the reply finishes, since a server may interleave calls' fragments.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from .events import Finish, LLMError, LLMEvent, TextDelta, ToolCallArguments, ToolCallEnd, ToolCallStart, Usage

log = logging.getLogger(__name__)


@dataclass
class _Call:
    index: int
    call_id: str = ""
    name: str = ""
    arguments: str = ""
    started: bool = False


class ChunkParser:
    """One reply's chunks, fed in order (`feed`), then its end (`end`)."""

    def __init__(self) -> None:
        self._calls: dict[int, _Call] = {}
        self._latest: int | None = None
        self.finished = False  # a finish_reason has come
        self.usage: Usage | None = None

    def feed(self, payload: str, kind: str = "") -> list[LLMEvent]:
        """The events one server-sent event adds (`payload`, its data; `kind`, its `event:` type); raises
        `LLMError` for an error the server sent or a payload that is not a chunk."""
        try:
            chunk = json.loads(payload)
        except ValueError:
            if kind == "error":
                raise _stream_error(payload) from None
            raise LLMError("protocol", f"the LLM server sent malformed JSON in its stream: {_clip(payload)}") from None
        if kind == "error":
            raise _stream_error(chunk.get("error", chunk) if isinstance(chunk, dict) else chunk)
        if not isinstance(chunk, dict):
            raise LLMError("protocol", f"the LLM server sent a chunk that is not a JSON object: {_clip(payload)}")
        if chunk.get("error") is not None:
            raise _stream_error(chunk["error"])
        if isinstance(chunk.get("usage"), dict):
            self.usage = _usage(chunk["usage"])
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise LLMError("protocol", f"the LLM server sent `choices` that is not a list: {_clip(payload)}")
        events: list[LLMEvent] = []
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0 and not self.finished:
                self._choice(choice, events)
        return events

    def end(self) -> list[LLMEvent]:
        """The events that close a reply whose stream ended as it should: `[DONE]`, or the body's end after a finish
        reason (whether a stream that ended otherwise was cut is the caller's to say: it saw how it ended)."""
        events: list[LLMEvent] = []
        if not self.finished:
            events.extend(self._close_calls())
            events.append(Finish(None))
            self.finished = True
        if self.usage is not None:
            events.append(self.usage)
        return events

    def _choice(self, choice: dict[str, Any], events: list[LLMEvent]) -> None:
        delta = choice.get("delta") or {}
        if isinstance(delta, dict):
            content = delta.get("content")
            if isinstance(content, str) and content:
                events.append(TextDelta(content))
            for fragment in delta.get("tool_calls") or []:
                self._fragment(fragment, events)
        reason = choice.get("finish_reason")
        if reason:
            events.extend(self._close_calls())
            events.append(Finish(str(reason)))
            self.finished = True

    def _fragment(self, fragment: Any, events: list[LLMEvent]) -> None:
        if not isinstance(fragment, dict):
            raise LLMError("protocol", f"the LLM server sent a tool call that is not an object: {_clip(fragment)}")
        call = self._call_for(fragment)
        function = fragment.get("function") or {}
        if not isinstance(function, dict):
            raise LLMError("protocol", f"the LLM server sent a tool call's `function` as {_clip(function)}")
        name = function.get("name")
        if isinstance(name, str) and name and not call.name:
            call.name = name
        arguments = function.get("arguments")
        if isinstance(arguments, (dict, list)):
            arguments = json.dumps(arguments)
        arguments = arguments if isinstance(arguments, str) else ""
        if not call.started and call.name:
            call.call_id = call.call_id or f"call_{uuid.uuid4().hex[:24]}"
            call.started = True
            events.append(ToolCallStart(call.index, call.call_id, call.name))
            if call.arguments:  # fragments that came before the name
                events.append(ToolCallArguments(call.index, call.call_id, call.arguments))
        call.arguments += arguments
        if call.started and arguments:
            events.append(ToolCallArguments(call.index, call.call_id, arguments))

    def _call_for(self, fragment: dict[str, Any]) -> _Call:
        index = fragment.get("index")
        call_id = fragment.get("id")
        call_id = call_id if isinstance(call_id, str) and call_id else ""
        if not isinstance(index, int) or isinstance(index, bool):
            by_id = [c.index for c in self._calls.values() if call_id and c.call_id == call_id]
            if by_id:
                index = by_id[0]
            elif call_id or self._latest is None:
                index = max(self._calls, default=-1) + 1
            else:
                index = self._latest
        call = self._calls.get(index)
        if call is None:
            call = self._calls[index] = _Call(index)
        if call_id and not call.call_id:
            call.call_id = call_id
        elif call_id and call_id != call.call_id:
            log.debug("tool call %d: id %r after %r, keeping the first", index, call_id, call.call_id)
        self._latest = index
        return call

    def _close_calls(self) -> list[LLMEvent]:
        events: list[LLMEvent] = []
        for index in sorted(self._calls):
            call = self._calls[index]
            if not call.started:
                raise LLMError("protocol", f"the LLM server sent tool call {index} without a function name")
            events.append(ToolCallEnd(index, call.call_id, call.name, call.arguments))
        self._calls.clear()
        return events


def _stream_error(error: Any) -> LLMError:
    """An error object the server sent inside the stream (llama.cpp, vLLM: `{"error": {"code", "message"}}`)."""
    if isinstance(error, dict):
        message = error.get("message") or json.dumps(error)
        code = error.get("code")
        status = code if isinstance(code, int) and not isinstance(code, bool) else None
    else:
        message, status = str(error), None
    where = f" ({status})" if status is not None else ""
    return LLMError("server", f"the LLM server failed mid-reply{where}: {_clip(message)}", status)


def _usage(usage: dict[str, Any]) -> Usage:
    def count(key: str) -> int:
        value = usage.get(key)
        return value if isinstance(value, int) else 0

    prompt, completion = count("prompt_tokens"), count("completion_tokens")
    return Usage(prompt, completion, count("total_tokens") or prompt + completion)


def _clip(value: Any, limit: int = 300) -> str:
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
