"""OpenAI's agents SDK for Python (`openai-agents`), unchanged, as a voice agent's client of duplexd: a `RealtimeAgent`
with a function tool, run by `RealtimeRunner` over the WebSocket at the server's `/v1/realtime`.

The SDK validates every server event against OpenAI's GA types and turns a failure into an `error` event of the
session, as it does a server's `error`: each test collects every event of its session and asserts that none was an
error. The agent is duplexd's `--llm demo` cascade (`tests/agent_server.py`), so only what a 135M model guarantees
is asserted: a reply in words and audio, a forced call of the one tool with arguments the SDK accepts, an answer
after the tool's output.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pytest

from duplexd import wire

from .agent_server import running_agent
from .speech import needs_espeak, speak

if TYPE_CHECKING:  # the SDK is imported by the tests that run it, not when the suite is collected
    from agents.realtime import RealtimeRunner, RealtimeSession

pytestmark = pytest.mark.usefixtures("one_thread")

FRAME = 1920  # 80 ms at 24 kHz
INSTRUCTIONS = "You are a helpful voice assistant. Answer briefly."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_agent(tmp_path_factory) as live:
        yield live


@dataclass
class Events:
    """Every event of one SDK session as it came, with when; and the server's own events, as the SDK passed them on."""

    all: list[Any] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def of(self, kind: str) -> list[Any]:
        return [e for e in self.all if e.type == kind]

    def server(self) -> list[tuple[float, dict]]:
        """The server's events (the SDK's raw model events), with when each came."""
        return [
            (t, e.data.data)
            for t, e in zip(self.times, self.all, strict=True)
            if e.type == "raw_model_event" and e.data.type == "raw_server_event"
        ]

    def server_of(self, kind: str) -> list[dict]:
        return [e for _, e in self.server() if e["type"] == kind]

    def errors(self) -> list[Any]:
        """The session's error events: a server `error`, or a server event the SDK found invalid."""
        return [e.error for e in self.of("error")]

    async def until(self, found: Callable[[], Any], timeout: float = 60) -> Any:
        """Wait until `found()` is truthy (checked on each event), and return it."""
        deadline = time.monotonic() + timeout
        while not (result := found()):
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), max(0.0, deadline - time.monotonic()))
        return result


async def collect(session: RealtimeSession, events: Events) -> None:
    async for event in session:
        events.all.append(event)
        events.times.append(time.monotonic())
        events.changed.set()


def set_volume(level: int, mode: Literal["quiet", "loud"]) -> str:
    """Set the speaker volume.

    Args:
        level: The volume, 0 to 10.
        mode: Quiet or loud.
    """
    return f"The volume is now {level} ({mode})."


def set_volume_output(arguments: str) -> str:
    """What the tool returns for these arguments (the JSON the call came with)."""
    given = json.loads(arguments)
    return f"The volume is now {given['level']} ({given['mode']})."


def completed_calls(response: dict) -> list[dict]:
    """The response's function calls whose arguments are whole (one cut by the token limit is `incomplete`)."""
    return [o for o in response["output"] if o["type"] == "function_call" and o["status"] == "completed"]


def runner(settings: dict) -> RealtimeRunner:
    from agents import function_tool
    from agents.realtime import RealtimeAgent, RealtimeRunner

    agent = RealtimeAgent(name="Assistant", instructions=INSTRUCTIONS, tools=[function_tool(set_volume)])
    return RealtimeRunner(starting_agent=agent, config={"model_settings": settings})


async def in_session(live, settings: dict, script: Callable[[RealtimeSession, Events], Any], timeout: float = 150):
    """Run `script` in an SDK session on `live` (the default model, the server's URL and a key), every event
    collected meanwhile; the events, once the session is closed."""
    events = Events()
    url = f"ws://127.0.0.1:{live.port}/v1/realtime?model=gpt-realtime"
    session = await runner(settings).run(model_config={"url": url, "api_key": "sk-unused"})
    async with session:
        reader = asyncio.create_task(collect(session, events))
        try:
            await events.until(lambda: events.server_of("session.updated"))
            await asyncio.wait_for(script(session, events), timeout)
        finally:
            reader.cancel()
    return events


async def say(session: RealtimeSession, pcm: np.ndarray) -> None:
    """The user says `pcm`, 80 ms at a time at real-time pace, as a microphone would."""
    for i in range(0, len(pcm), FRAME):
        await session.send_audio(wire.pcm16(pcm[i : i + FRAME]))
        await asyncio.sleep(0.08)


async def send_raw(session: RealtimeSession, *messages: tuple[str, dict]) -> None:
    """Client events the SDK passes on as they are: (type, the event's other fields)."""
    from agents.realtime.model_inputs import RealtimeModelRawClientMessage, RealtimeModelSendRawMessage

    for kind, data in messages:
        message = RealtimeModelRawClientMessage(type=kind, other_data=data)
        await session.model.send_event(RealtimeModelSendRawMessage(message=message))


def finished(response: dict) -> bool:
    """Said to its end: completed, or cut at `max_output_tokens`."""
    reason = (response["status_details"] or {}).get("reason")
    return response["status"] == "completed" or (response["status"] == "incomplete" and reason == "max_output_tokens")


def heard_audio(events: Events) -> bytes:
    return b"".join(e.audio.data for e in events.of("audio"))


@needs_espeak
def test_a_spoken_turn_is_answered_in_audio(server, tmp_path):
    """The user's speech (server VAD ends the turn) gets a response: the SDK hands out its audio and the transcript."""
    pcm = speak("Please call me back tomorrow morning.", tmp_path)
    audio = np.concatenate([np.zeros(4800, np.float32), pcm, np.zeros(24000 * 4, np.float32)])
    settings = {"max_output_tokens": 6, "turn_detection": {"type": "server_vad", "interrupt_response": False}}

    async def script(session: RealtimeSession, events: Events) -> None:
        talking = asyncio.create_task(say(session, audio))
        try:  # the user falls silent once answered: the random STT can hear words in silence, a new turn the SDK
            # would cancel the reply for (interrupt_response off, it cancels on speech_started itself)
            await events.until(lambda: events.server_of("response.created"))
        finally:
            talking.cancel()
        await events.until(lambda: events.of("agent_end"))

    events = asyncio.run(in_session(server, settings, script))
    assert events.errors() == []
    kinds = [e["type"] for _, e in events.server()]
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    transcribed = events.server_of("conversation.item.input_audio_transcription.completed")[0]
    assert transcribed["transcript"]
    done = events.server_of("response.done")[0]
    assert finished(done["response"])
    audio_out = heard_audio(events)
    assert audio_out and len(audio_out) % (2 * FRAME) == 0 and events.of("audio_end")
    (message,) = done["response"]["output"]
    history = {item.item_id: item for item in events.of("history_updated")[-1].history}
    assert history[message["id"]].content[0].transcript == message["content"][0]["transcript"] != ""


def test_a_tool_call_is_run_by_the_sdk_and_answered(server):
    """A forced call of the agent's tool: the SDK runs it, sends its output and asks for a response, which answers in
    audio. The session's `tool_choice` is `none`, so only the response that forces the call can call it. The demo's
    llama.cpp may make more than one call in that response: the SDK runs each and asks for a response after each
    output."""
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Quieter please."}]}
    forced = {"tool_choice": {"type": "function", "name": "set_volume"}, "max_output_tokens": 64}
    settings = {"max_output_tokens": 6, "tool_choice": "none", "turn_detection": None}

    def answered(events: Events) -> bool:
        done = events.server_of("response.done")
        return bool(done) and len(done) == 1 + len(completed_calls(done[0]["response"]))

    async def script(session: RealtimeSession, events: Events) -> None:
        await send_raw(session, ("conversation.item.create", {"item": user}), ("response.create", {"response": forced}))
        await events.until(lambda: answered(events))

    events = asyncio.run(in_session(server, settings, script))
    assert events.errors() == []
    first, *answers = (e["response"] for e in events.server_of("response.done"))
    calls = completed_calls(first)
    assert calls and {call["name"] for call in calls} == {"set_volume"}
    ran = [(e.arguments, e.output) for e in events.of("tool_end")]
    assert sorted(ran) == sorted((c["arguments"], set_volume_output(c["arguments"])) for c in calls)
    outputs = [
        e["item"] for e in events.server_of("conversation.item.added") if e["item"]["type"] == "function_call_output"
    ]
    assert sorted((o["call_id"], o["output"]) for o in outputs) == sorted(
        (c["call_id"], set_volume_output(c["arguments"])) for c in calls
    )
    for answer in answers:
        assert finished(answer) and [o["type"] for o in answer["output"]] == ["message"]
        assert any(e.item_id == answer["output"][0]["id"] for e in events.of("audio"))


def test_a_call_cut_short_is_not_run_and_the_conversation_goes_on(server):
    """A forced call that `max_output_tokens` cuts inside its arguments ends `incomplete`: the SDK does not run it, and
    the next response (the SDK's own, after a typed message) is answered, not failed by the cut call in the history."""
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Quieter please."}]}
    forced = {"tool_choice": {"type": "function", "name": "set_volume"}, "max_output_tokens": 12}
    settings = {"max_output_tokens": 6, "tool_choice": "none", "turn_detection": None}

    async def script(session: RealtimeSession, events: Events) -> None:
        await send_raw(session, ("conversation.item.create", {"item": user}), ("response.create", {"response": forced}))
        await events.until(lambda: events.server_of("response.done"))
        await session.send_message("Thank you.")
        await events.until(lambda: len(events.server_of("response.done")) == 2)

    events = asyncio.run(in_session(server, settings, script))
    assert events.errors() == []
    cut, answer = (e["response"] for e in events.server_of("response.done"))
    assert [(o["type"], o["status"]) for o in cut["output"]] == [("function_call", "incomplete")]
    assert not events.of("tool_start")
    assert finished(answer) and [o["type"] for o in answer["output"]] == ["message"]


@needs_espeak
def test_barge_in_stops_the_audio_and_the_sdk_hears_it(server, tmp_path):
    """The user speaking over the reply: the server cancels it before `speech_started` (no audio of it after), the SDK
    says `audio_interrupted` and truncates the item at what it played, and nothing of that is an error."""
    pcm = speak("Stop, wait a moment.", tmp_path)
    detection = {"type": "server_vad", "create_response": False, "interrupt_response": True}
    settings = {"max_output_tokens": 40, "tool_choice": "none", "turn_detection": detection}

    async def script(session: RealtimeSession, events: Events) -> None:
        await session.send_message("Tell a story.")
        await events.until(lambda: events.of("audio"))
        talking = asyncio.create_task(say(session, pcm))
        try:
            await events.until(lambda: events.server_of("response.done") and events.of("audio_interrupted"))
            await events.until(lambda: events.server_of("conversation.item.retrieved"))
        finally:
            talking.cancel()

    events = asyncio.run(in_session(server, settings, script))
    assert events.errors() == []
    (done,) = events.server_of("response.done")
    response = done["response"]
    assert response["status"] == "cancelled" and response["status_details"]["reason"] == "turn_detected"
    server = events.server()
    started = next(t for t, e in server if e["type"] == "input_audio_buffer.speech_started")
    late = [t - started for t, e in server if e["type"] == "response.output_audio.delta" and t > started]
    assert late == [], "audio of the cancelled response after speech_started"
    (truncated,) = events.server_of("conversation.item.truncated")
    (retrieved,) = events.server_of("conversation.item.retrieved")
    message = response["output"][0]
    assert truncated["item_id"] == retrieved["item"]["id"] == message["id"]
    assert retrieved["item"]["status"] == "incomplete"
