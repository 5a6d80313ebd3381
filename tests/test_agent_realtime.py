"""A voice agent on `/v1/realtime` (`duplexd serve` with an STT main model, `--tts demo-tts` and `--llm demo`: a real
llama.cpp server with SmolLM2-135M), driven by the official `openai` SDK's realtime client, unchanged. Every event
the server sends is validated against the SDK's own GA types (`RealtimeServerEvent`), strictly.

What a 135M model guarantees is asserted, not what it chooses: a reply in words, said by the TTS and paced at real
time, each word's transcript delta once; a forced tool call of the one tool offered, its arguments valid against the
tool's schema; the tool's output answered. The STT is the demo STT with its text head leaning to words
(`test_asr_e2e.words_model`), so espeak's speech makes a turn that its pause heads end.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from openai import AsyncOpenAI
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from duplexd import wire

from .agent_server import running_agent
from .live_server import running_server
from .speech import needs_espeak, speak

pytestmark = pytest.mark.usefixtures("one_thread")

SERVER_EVENTS: TypeAdapter[RealtimeServerEvent] = TypeAdapter(RealtimeServerEvent)
VOLUME = {
    "type": "function",
    "name": "set_volume",
    "description": "Set the speaker volume.",
    "parameters": {
        "type": "object",
        "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 10}, "mode": {"enum": ["quiet", "loud"]}},
        "required": ["level", "mode"],
    },
}
SHORT = {"type": "realtime", "max_output_tokens": 6, "audio": {"input": {"turn_detection": None}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_agent(tmp_path_factory) as live:
        yield live


@dataclass
class Seen:
    events: list[dict] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def types(self, without_deltas: bool = False) -> list[str]:
        return [e["type"] for e in self.events if not (without_deltas and e["type"].endswith(".delta"))]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


async def until(conn, seen: Seen, kind: str, timeout: float = 60) -> dict:
    """Read events (each validated against OpenAI's types) until one of `kind`; an `error` fails the test."""
    deadline = time.monotonic() + timeout
    while True:
        raw = await asyncio.wait_for(conn.recv_bytes(), deadline - time.monotonic())
        SERVER_EVENTS.validate_json(raw, strict=True)
        event = json.loads(raw)
        seen.events.append(event)
        seen.times.append(time.monotonic())
        assert event["type"] != "error", event
        if event["type"] == kind:
            return event


async def opened(conn, seen: Seen, session: dict) -> None:
    """The session created, then updated to `session`."""
    await until(conn, seen, "session.created")
    await conn.session.update(session=session)
    await until(conn, seen, "session.updated")


def connect(live):
    return AsyncOpenAI(base_url=f"{live.url}/v1", api_key="sk-unused").realtime.connect(model="gpt-realtime")


def run(coro, timeout: float = 180):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def finished(response: dict) -> bool:
    """Said to its end: completed, or cut at `max_output_tokens` as OpenAI says it."""
    details = response["status_details"]
    return response["status"] == "completed" or (
        response["status"] == "incomplete" and details["reason"] == "max_output_tokens"
    )


def completed_calls(response: dict) -> list[dict]:
    """The response's function calls whose arguments are whole (one cut by the token limit is `incomplete`)."""
    return [o for o in response["output"] if o["type"] == "function_call" and o["status"] == "completed"]


def audio_b64(pcm: np.ndarray) -> str:
    return base64.b64encode(wire.pcm16(pcm)).decode()


async def talk(conn, pcm: np.ndarray) -> None:
    """The user says `pcm`, 80 ms an append at real-time pace."""
    for i in range(0, len(pcm), 1920):
        await conn.input_audio_buffer.append(audio=audio_b64(pcm[i : i + 1920]))
        await asyncio.sleep(0.08)


def test_a_typed_turn_is_answered_in_speech_in_openais_order(server):
    async def turn() -> Seen:
        seen = Seen()
        async with connect(server) as conn:
            await opened(conn, seen, SHORT)
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}
            await conn.conversation.item.create(item=item)
            await conn.response.create()
            await until(conn, seen, "response.done")
        return seen

    seen = run(turn())
    lifecycle = [t for t in seen.types(without_deltas=True) if t.startswith(("response.", "conversation."))]
    assert lifecycle == [
        "conversation.item.added", "conversation.item.done",  # the user's text item
        "response.created", "response.output_item.added", "conversation.item.added", "response.content_part.added",
        "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
        "response.output_item.done", "conversation.item.done", "response.done",
    ]  # fmt: skip
    done = seen.of("response.done")[0]["response"]
    assert finished(done) and done["usage"]["output_tokens"] > 0
    (message,) = done["output"]
    words = "".join(e["delta"] for e in seen.of("response.output_audio_transcript.delta"))
    assert (
        message["content"][0]["transcript"]
        == words
        == seen.of("response.output_audio_transcript.done")[0]["transcript"]
    )
    assert len(words.split()) >= 2 and any(c.isalpha() for c in words)  # the LLM's own words, said
    audio = [i for i, e in enumerate(seen.events) if e["type"] == "response.output_audio.delta"]
    samples = sum(len(base64.b64decode(seen.events[i]["delta"])) // 2 for i in audio)
    assert samples == len(audio) * 1920 and len(audio) >= len(words.split())
    span = seen.times[audio[-1]] - seen.times[audio[0]]
    assert span >= (len(audio) - 1) * 0.08 - 0.32 - 0.1, "paced at real time, at most 320 ms ahead"


@needs_espeak
def test_a_spoken_turn_is_heard_and_answered(server, tmp_path):
    """server_vad on the STT's pause heads: speech, then silence, ends the turn; the response answers the user's
    transcript (the conversation holds it). Not interrupted: the STT's words in the silence after are not a
    barge-in here."""
    pcm = speak("Please call me back tomorrow morning.", tmp_path)
    audio = np.concatenate([np.zeros(4800, np.float32), pcm, np.zeros(24000 * 4, np.float32)])
    detection = {"type": "server_vad", "interrupt_response": False}

    async def turn() -> tuple[Seen, dict]:
        seen = Seen()
        async with connect(server) as conn:
            await opened(conn, seen, {**SHORT, "audio": {"input": {"turn_detection": detection}}})

            talking = asyncio.create_task(talk(conn, audio))
            await until(conn, seen, "response.done")
            talking.cancel()
            user = seen.of("conversation.item.input_audio_transcription.completed")[0]
            await conn.conversation.item.retrieve(item_id=user["item_id"])
            retrieved = await until(conn, seen, "conversation.item.retrieved")
        return seen, retrieved

    seen, retrieved = run(turn())
    order = seen.types(without_deltas=True)
    assert order.index("input_audio_buffer.speech_started") < order.index("input_audio_buffer.committed")
    assert order.index("conversation.item.input_audio_transcription.completed") < order.index("response.created")
    assert retrieved["item"]["role"] == "user" and retrieved["item"]["content"][0]["transcript"]
    assert finished(seen.of("response.done")[0]["response"])


@needs_espeak
def test_barge_in_cancels_the_response_and_keeps_what_was_heard(server, tmp_path):
    pcm = speak("Stop, wait a moment.", tmp_path)
    detection = {"type": "server_vad", "create_response": False, "interrupt_response": True}

    async def interrupted() -> tuple[Seen, dict]:
        seen = Seen()
        async with connect(server) as conn:
            session = {**SHORT, "max_output_tokens": 40, "audio": {"input": {"turn_detection": detection}}}
            await opened(conn, seen, session)
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell a story."}]}
            await conn.conversation.item.create(item=item)
            await conn.response.create()
            await until(conn, seen, "response.output_audio.delta")

            talking = asyncio.create_task(talk(conn, pcm))
            done = await until(conn, seen, "response.done")
            talking.cancel()
            message = done["response"]["output"][0]
            await conn.conversation.item.retrieve(item_id=message["id"])
            retrieved = await until(conn, seen, "conversation.item.retrieved")
        return seen, retrieved

    seen, retrieved = run(interrupted())
    done = seen.of("response.done")[0]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected"
    types = seen.types()
    started = types.index("input_audio_buffer.speech_started")
    assert types[started:].count("response.output_audio.delta") == 0, "no audio after the user cut in"
    released = "".join(e["delta"] for e in seen.of("response.output_audio_transcript.delta"))
    heard = retrieved["item"]["content"][0]["transcript"]
    assert released.startswith(heard) and retrieved["item"]["status"] == "incomplete"


def test_a_tool_call_then_its_output_is_answered(server):
    async def call() -> Seen:
        seen = Seen()
        async with connect(server) as conn:
            await opened(conn, seen, {**SHORT, "tools": [VOLUME], "max_output_tokens": 128})
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Quieter please."}]}
            await conn.conversation.item.create(item=item)
            await conn.response.create(response={"tool_choice": "required"})
            done = await until(conn, seen, "response.done")
            calls = [
                o for o in done["response"]["output"] if o["type"] == "function_call" and o["status"] == "completed"
            ]
            assert calls, done
            output = {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": '{"ok": true}'}
            await conn.conversation.item.create(item=output)
            await conn.response.create(response={"tool_choice": "none", "max_output_tokens": 6})
            await until(conn, seen, "response.done")
        return seen

    seen = run(call())
    first, second = seen.of("response.done")
    calls = completed_calls(first["response"])
    for call_item in calls:
        assert call_item["name"] == "set_volume" and call_item["status"] == "completed"
        jsonschema.validate(json.loads(call_item["arguments"]), VOLUME["parameters"])
    call_id = calls[0]["call_id"]
    events = [e for e in seen.events if e.get("call_id") == call_id or e.get("item", {}).get("call_id") == call_id]
    assert [e["type"] for e in events if not e["type"].endswith(".delta")] == [
        "response.output_item.added", "conversation.item.added", "response.function_call_arguments.done",
        "conversation.item.done", "response.output_item.done",
        "conversation.item.added", "conversation.item.done",  # the client's function_call_output
    ]  # fmt: skip
    deltas = "".join(e["delta"] for e in seen.of("response.function_call_arguments.delta") if e["call_id"] == call_id)
    assert deltas == calls[0]["arguments"]
    assert finished(second["response"]) and second["response"]["output"][0]["type"] == "message"


def test_without_parallel_tool_calls_a_response_makes_one_call(server):
    """`parallel_tool_calls: false`, the session's: one function call a response, whole, with its events alone, where
    the demo's llama.cpp (which does not honour the flag) calls as often as it likes; a response's own `true` lifts
    it. The session shows the setting."""

    async def call() -> tuple[Seen, list[dict]]:
        seen = Seen()
        async with connect(server) as conn:
            session = {**SHORT, "tools": [VOLUME], "max_output_tokens": 128, "parallel_tool_calls": False}
            await opened(conn, seen, session)
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Quieter please."}]}
            await conn.conversation.item.create(item=item)
            responses = []
            for params in ({}, {"parallel_tool_calls": True}):
                await conn.response.create(response={"tool_choice": "required", **params})
                responses.append((await until(conn, seen, "response.done"))["response"])
        return seen, responses

    seen, (single, parallel) = run(call())
    assert seen.of("session.updated")[-1]["session"]["parallel_tool_calls"] is False
    assert [o["type"] for o in single["output"]] == ["function_call"], single["output"]
    kept = single["output"][0]["call_id"]
    added = [e["item"]["call_id"] for e in seen.of("response.output_item.added") if e["response_id"] == single["id"]]
    assert added == [kept]  # no event for a call dropped
    assert parallel["output"] and all(o["type"] == "function_call" for o in parallel["output"])


def test_client_mistakes_are_non_fatal_errors(server):
    """Each is an `error` the client can read, and the session goes on to answer."""

    async def mistakes() -> list[dict]:
        errors = []
        async with connect(server) as conn:
            await conn.session.update(session=SHORT)
            await conn.response.cancel()
            output = {"type": "function_call_output", "call_id": "call_nobody", "output": "{}"}
            await conn.conversation.item.create(item=output)
            await conn.conversation.item.retrieve(item_id="item_nobody")
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]}
            await conn.conversation.item.create(item=item)
            await conn.response.create()
            await conn.response.create()  # one at a time
            async for event in conn:
                if event.type == "error":
                    errors.append(event.error.model_dump())
                if event.type == "response.done":
                    assert finished(event.response.model_dump())
                    return errors
        return errors

    codes = [e["code"] for e in run(mistakes())]
    assert codes == ["response_cancel_not_active", "invalid_value", "item_not_found",
                     "conversation_already_has_active_response"]  # fmt: skip


def test_an_llm_that_cannot_be_reached_fails_the_response_not_the_session(tmp_path_factory):
    log = Path(tmp_path_factory.mktemp("agent-dead")) / "serve.log"
    args = ["--hf-repo", "demo-stt", "--tts", "demo-tts", "--llm", "http://127.0.0.1:9/v1"]  # the demo STT as is

    async def ask(live) -> list[dict]:
        seen = Seen()
        async with connect(live) as conn:
            await until(conn, seen, "session.created")
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]}
            await conn.conversation.item.create(item=item)
            await conn.response.create()
            first = await until(conn, seen, "response.done")
            await conn.session.update(session=SHORT)
            await until(conn, seen, "session.updated")
        return [first]

    with running_server(log, *args) as live:
        (done,) = run(ask(live))
        import httpx2

        stt = httpx2.get(f"{live.url}/v1/models", timeout=10).json()["data"][0]
        assert stt["id"] == "demo-stt" and stt["demo"] is True  # the built-in page tells its user so
    response = done["response"]
    assert response["status"] == "failed" and response["output"] == []
    assert "127.0.0.1:9" in response["status_details"]["error"]["message"]
    assert "Traceback" not in log.read_text()


def test_the_models_list_says_what_the_agent_is_made_of(server):
    import httpx2

    models = httpx2.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    (agent,) = [m for m in models if m.get("task") == "voice-agent"]
    stt, tts = models[0], next(m for m in models if m.get("task") == "text-to-speech")
    assert agent["hears_with"] == stt["id"] and agent["speaks_with"] == tts["id"]
    assert agent["llm"]["demo"] is True and agent["llm"]["url"].startswith("http://127.0.0.1:")
    assert agent["endpoints"] == ["/v1/realtime", "/v1/realtime/calls"] and agent["voices"] == tts["voices"]
    assert stt["protocols"][-2:] == ["/v1/realtime", "/v1/realtime/calls"]  # the built-in page calls over WebRTC


def test_a_text_only_out_of_band_response_leaves_the_conversation_alone(server):
    """`output_modalities: ["text"]` streams `response.output_text.delta`s and no audio; `conversation: "none"` with an
    `input` of its own answers that input and adds nothing to the conversation (OpenAI's out-of-band response), its
    `metadata` carried through."""

    async def aside() -> Seen:
        seen = Seen()
        async with connect(server) as conn:
            await opened(conn, seen, SHORT)
            question = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}
            await conn.response.create(
                response={
                    "conversation": "none",
                    "input": [question],
                    "output_modalities": ["text"],
                    "metadata": {"purpose": "classify"},
                }
            )
            done = await until(conn, seen, "response.done")
            message = done["response"]["output"][0]
            await conn.conversation.item.retrieve(item_id=message["id"])
            seen.events.append(json.loads(await asyncio.wait_for(conn.recv_bytes(), 30)))
        return seen

    seen = run(aside())
    done = seen.of("response.done")[0]["response"]
    assert finished(done) and done["metadata"] == {"purpose": "classify"} and done["conversation_id"] is None
    text = "".join(e["delta"] for e in seen.of("response.output_text.delta"))
    assert text and done["output"][0]["content"][0] == {"type": "output_text", "text": text}
    assert not seen.of("response.output_audio.delta") and not seen.of("conversation.item.added")
    assert seen.events[-1]["type"] == "error" and seen.events[-1]["error"]["code"] == "item_not_found"


def test_the_session_shows_what_it_will_do(server):
    """What stock clients send by default is taken as a cascade can honour it: an OpenAI voice name speaks in the
    default TTS voice, a served one in itself; `semantic_vad` with its switches; the tools and tool choice; G.711."""

    async def updates() -> list[dict]:
        seen = Seen()
        async with connect(server) as conn:
            created = await until(conn, seen, "session.created")
            default = created["session"]["audio"]["output"]["voice"]
            session = {
                "type": "realtime",
                "output_modalities": ["audio"],
                "tools": [VOLUME],
                "tool_choice": "auto",
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcmu"},
                        "transcription": {"model": "gpt-4o-mini-transcribe"},
                        "turn_detection": {"type": "semantic_vad", "eagerness": "high", "interrupt_response": False},
                    },
                    "output": {"voice": "ash"},
                },
            }
            await conn.session.update(session=session)
            first = (await until(conn, seen, "session.updated"))["session"]
            await conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": "demo/bob.wav"}}})
            second = (await until(conn, seen, "session.updated"))["session"]
        return [default, first, second]

    default, first, second = run(updates())
    assert first["audio"]["output"]["voice"] == default and second["audio"]["output"]["voice"] == "demo/bob.wav"
    detection = first["audio"]["input"]["turn_detection"]
    assert detection["type"] == "semantic_vad" and detection["eagerness"] == "high"
    assert detection["interrupt_response"] is False and detection["create_response"] is True
    assert first["tools"][0]["name"] == "set_volume" and first["tool_choice"] == "auto"
    assert first["audio"]["input"]["format"]["type"] == "audio/pcmu" and first["audio"]["input"]["transcription"]


def test_an_idle_timeout_prompts_a_response_once_the_reply_has_played(server):
    """`idle_timeout_ms`: after a reply's audio has played out and the user has said nothing for that long,
    `input_audio_buffer.timeout_triggered`, then a response of the agent's own."""

    async def idle() -> Seen:
        seen = Seen()
        async with connect(server) as conn:
            detection = {"type": "server_vad", "idle_timeout_ms": 700, "interrupt_response": False}
            await opened(conn, seen, {**SHORT, "audio": {"input": {"turn_detection": detection}}})
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello."}]}
            await conn.conversation.item.create(item=item)
            await conn.response.create()
            await until(conn, seen, "response.done")
            await until(conn, seen, "input_audio_buffer.timeout_triggered")
            await until(conn, seen, "response.done")
        return seen

    seen = run(idle())
    first_done = seen.types().index("response.done")
    audio = [i for i, e in enumerate(seen.events[:first_done]) if e["type"] == "response.output_audio.delta"]
    played_out = seen.times[audio[0]] + len(audio) * 0.08  # the client plays from the first frame
    fired = seen.times[seen.types().index("input_audio_buffer.timeout_triggered")]
    assert played_out + 0.7 - 0.1 <= fired <= played_out + 0.7 + 1.5
    assert len(seen.of("response.created")) == 2 and all(finished(d["response"]) for d in seen.of("response.done"))
