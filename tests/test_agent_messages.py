"""The chat messages a voice agent's items become: chat completions wants each assistant message's tool calls
answered by tool messages right after it, and OpenAI refuses any other order; a Realtime conversation can hold an
output after the user spoke again, a call never answered, or an output whose call was deleted."""

from __future__ import annotations

from duplexd.server.realtime.agent import UNANSWERED, _answered


def call(*ids: str) -> dict:
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]
    return {"role": "assistant", "content": "", "tool_calls": calls}


def tool(call_id: str, output: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def test_each_call_is_answered_right_after_it_whatever_the_items_order():
    user, later = {"role": "user", "content": "hi"}, {"role": "user", "content": "and?"}
    messages = [user, call("a", "b"), later, tool("b", "B"), tool("a", "A")]
    assert _answered(messages) == [user, call("a", "b"), tool("a", "A"), tool("b", "B"), later]


def test_a_call_never_answered_says_so_and_an_output_of_no_call_is_left_out():
    user = {"role": "user", "content": "hi"}
    messages = [user, call("a"), tool("gone", "x"), {"role": "user", "content": "well?"}]
    assert _answered(messages) == [user, call("a"), tool("a", UNANSWERED), messages[-1]]


def test_messages_already_in_order_are_kept_as_they_are():
    messages = [{"role": "system", "content": "s"}, call("a"), tool("a", "A"), {"role": "assistant", "content": "ok"}]
    assert _answered(messages) == messages
