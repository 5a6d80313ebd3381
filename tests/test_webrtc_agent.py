"""A voice agent on a WebRTC call (`POST /v1/realtime/calls` on `duplexd serve` with an STT main model, `--tts
demo-tts` and `--llm demo`), placed by an aiortc caller as OpenAI's WebRTC clients place one: the user's speech on the
microphone track, the agent's speech on the server's track, every event on `oai-events` validated strictly against
the `openai` SDK's GA `RealtimeServerEvent`.

As in tests/test_agent_realtime.py, what the 135M demo LLM guarantees is asserted, not what it chooses: a reply in
words, played on the track at real time between `output_audio_buffer.started` and `.stopped`; a forced call of the
one tool offered with schema-valid arguments, its output answered in speech; a barge-in that empties the track.
Then OpenAI's own browser SDK, in headless Chromium, places a call with a function tool (`browser_sdk.py`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx2
import jsonschema
import numpy as np
import pytest
import soxr

from duplexd.clients.audio import write_wav
from duplexd.wire import SAMPLE_RATE

from .browser import CHROMIUM, launch_args
from .browser_sdk import page_origin as serve_page
from .browser_sdk import sdk_bundle
from .live_server import running_server
from .speech import needs_espeak, speak
from .system_tools import needs
from .test_agent_realtime import SERVER_EVENTS, VOLUME, completed_calls, finished
from .test_asr_e2e import words_model

pytest.importorskip("aiortc")
from duplexd.clients.webrtc import MIC_RATE, Caller  # noqa: E402
from duplexd.server.realtime.webrtc import stack  # noqa: E402

stack.tune(2, ("127.0.0.1",))  # the callers gather on loopback too (aioice leaves it out)

pytestmark = pytest.mark.usefixtures("one_thread")
SOUND = 1e-3  # a decoded frame louder than this is speech (the track's silence decodes to about 0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    stt = words_model(tmp_path_factory.mktemp("call-agent-stt"))
    log = tmp_path_factory.mktemp("call-agent-server") / "serve.log"
    args = ["--hf-repo", str(stt.root), "--tts", "demo-tts", "--tts-temperature", "0", "--llm", "demo",
            "--webrtc-hosts", "127.0.0.1", "--webrtc-jitter-frames", "1"]  # fmt: skip
    with running_server(log, *args) as live:
        yield live
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


@dataclass
class Seen:
    events: list[dict] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    def when(self, kind: str) -> float:
        return self.times[self.types().index(kind)]


async def until(caller: Caller, seen: Seen, kind: str, timeout: float = 60) -> dict:
    """Read the channel's events (each validated against OpenAI's types) until one of `kind`; an `error` fails."""
    deadline = time.monotonic() + timeout
    while True:
        event = await asyncio.wait_for(caller.events.get(), deadline - time.monotonic())
        SERVER_EVENTS.validate_json(json.dumps(event), strict=True)
        seen.events.append(event)
        seen.times.append(time.monotonic())
        assert event["type"] != "error", event
        if event["type"] == kind:
            return event


def silence(seconds: float) -> np.ndarray:
    return np.zeros(round(seconds * MIC_RATE), np.float32)


def at_mic_rate(pcm: np.ndarray) -> np.ndarray:
    return soxr.resample(pcm, SAMPLE_RATE, MIC_RATE).astype(np.float32)


def say(caller: Caller, pcm: np.ndarray) -> None:
    """The microphone (saying silence until now) says `pcm` (at 48 kHz) from its next frame on."""
    mic = caller.mic
    assert mic is not None
    mic.pcm = np.concatenate([np.zeros(mic.pts, np.float32), pcm])


def sounds(caller: Caller) -> list[float]:
    """When each frame of the agent's speech was heard."""
    return [at for at, pcm in zip(caller.heard_at, caller.heard, strict=True) if np.abs(pcm).max() > SOUND]


async def placed(server, mic: np.ndarray | None, session: dict | None = None) -> tuple[Caller, Seen, dict]:
    caller = Caller(mic)
    answer = await caller.call(f"{server.url}/v1/realtime/calls", session=session)
    assert answer.status == 201, answer.text
    seen = Seen()
    created = await until(caller, seen, "session.created")
    return caller, seen, created


def run(coro, timeout: float = 180):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def active(server) -> float:
    import re  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        match = re.search(r"^duplexd_sessions_active (\S+)$", r.read().decode(), re.M)
    return float(match.group(1)) if match else 0.0


def wait_idle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while active(server):
        assert time.monotonic() < deadline, "the call's slot was not freed"
        time.sleep(0.05)


@needs_espeak
def test_a_spoken_turn_on_the_microphone_is_answered_on_the_track(server, tmp_path):
    """The offer's session (multipart) applies before `session.created`; the user's speech on the track ends a
    turn on the STT's pause heads; the reply's words come on the channel and its speech on the track, played at real
    time between `output_audio_buffer.started` and `.stopped`, with no `response.output_audio.delta`."""
    words = at_mic_rate(speak("Please call me back tomorrow morning.", tmp_path))
    detection = {"type": "server_vad", "interrupt_response": False}
    session = {"type": "realtime", "max_output_tokens": 6, "audio": {"input": {"turn_detection": detection}}}

    async def turn() -> tuple[Caller, Seen, dict]:
        caller, seen, created = await placed(server, silence(120), session)
        caller.send({"type": "session.update", "session": {"type": "realtime"}})  # the microphone is taken
        await until(caller, seen, "session.updated")
        say(caller, words)
        await until(caller, seen, "response.done")
        await until(caller, seen, "output_audio_buffer.stopped")
        await asyncio.sleep(0.2)  # the jitter buffer's last frames
        await caller.hang_up()
        return caller, seen, created

    caller, seen, created = run(turn())
    assert created["session"]["max_output_tokens"] == 6
    order = seen.types()
    assert order.index("input_audio_buffer.speech_started") < order.index("input_audio_buffer.committed")
    assert order.index("conversation.item.input_audio_transcription.completed") < order.index("response.created")
    assert seen.of("conversation.item.input_audio_transcription.completed")[0]["transcript"]
    assert "response.output_audio.delta" not in order  # the speech is on the track
    started, done = seen.of("output_audio_buffer.started")[0], seen.of("response.done")[0]["response"]
    assert (
        finished(done)
        and started["response_id"] == done["id"] == seen.of("output_audio_buffer.stopped")[0]["response_id"]
    )
    said = "".join(e["delta"] for e in seen.of("response.output_audio_transcript.delta"))
    assert len(said.split()) >= 2 and done["output"][0]["content"][0]["transcript"] == said
    heard = sounds(caller)
    assert heard, "no speech on the track"
    playing = seen.when("output_audio_buffer.stopped") - seen.when("output_audio_buffer.started")
    assert heard[0] >= seen.when("output_audio_buffer.started") - 0.05
    assert abs((heard[-1] - heard[0]) - playing) < 0.4, "played at real time, as long as started..stopped says"
    wait_idle(server)  # the hang-up freed the slot


def test_a_forced_tool_call_then_its_output_is_answered_in_speech(server):
    session = {"type": "realtime", "tools": [VOLUME], "tool_choice": {"type": "function", "name": "set_volume"},
               "max_output_tokens": 128, "audio": {"input": {"turn_detection": None}}}  # fmt: skip

    async def call() -> tuple[Caller, Seen]:
        caller, seen, _ = await placed(server, silence(120))
        caller.send({"type": "session.update", "session": session})
        await until(caller, seen, "session.updated")
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Quieter please."}]}
        caller.send({"type": "conversation.item.create", "item": item})
        caller.send({"type": "response.create"})
        done = await until(caller, seen, "response.done")
        calls = completed_calls(done["response"])
        assert calls, done
        output = {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": '{"ok": true}'}
        caller.send({"type": "conversation.item.create", "item": output})
        caller.send({"type": "response.create", "response": {"tool_choice": "none", "max_output_tokens": 6}})
        await until(caller, seen, "response.done")
        await until(caller, seen, "output_audio_buffer.stopped")
        await caller.hang_up()
        return caller, seen

    caller, seen = run(call())
    first, second = (d["response"] for d in seen.of("response.done"))
    for call_item in completed_calls(first):
        assert call_item["name"] == "set_volume"
        jsonschema.validate(json.loads(call_item["arguments"]), VOLUME["parameters"])
    assert finished(second) and second["output"][0]["type"] == "message"
    assert seen.of("output_audio_buffer.started")[-1]["response_id"] == second["id"]
    assert second["output"][0]["content"][0]["transcript"] and sounds(caller), "the answer is said on the track"
    wait_idle(server)


@needs_espeak
def test_barge_in_clears_the_track_and_cancels_the_response(server, tmp_path):
    """The user speaking over the agent: the track goes quiet within a frame or two of `speech_started`,
    `output_audio_buffer.cleared` follows it, the response is cancelled (`turn_detected`) and its item keeps the
    words played."""
    words = at_mic_rate(speak("Stop, wait a moment.", tmp_path))
    detection = {"type": "server_vad", "create_response": False, "interrupt_response": True}
    session = {"type": "realtime", "max_output_tokens": 40, "audio": {"input": {"turn_detection": detection}}}

    async def interrupted() -> tuple[Caller, Seen, dict]:
        caller, seen, _ = await placed(server, silence(120), session)
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell a story."}]}
        caller.send({"type": "conversation.item.create", "item": item})
        caller.send({"type": "response.create"})
        await until(caller, seen, "output_audio_buffer.started")
        while caller.first_sound is None:  # the agent is heard
            await asyncio.sleep(0.02)
        say(caller, words)
        done = await until(caller, seen, "response.done")
        await asyncio.sleep(0.5)  # anything the track still played would arrive by now
        message = done["response"]["output"][0]
        caller.send({"type": "conversation.item.retrieve", "item_id": message["id"]})
        retrieved = await until(caller, seen, "conversation.item.retrieved")
        await caller.hang_up()
        return caller, seen, retrieved

    caller, seen, retrieved = run(interrupted())
    done = seen.of("response.done")[0]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected"
    order = seen.types()
    assert order.index("input_audio_buffer.speech_started") < order.index("output_audio_buffer.cleared")
    assert "output_audio_buffer.stopped" not in order
    heard = sounds(caller)
    cut = seen.when("input_audio_buffer.speech_started")
    assert heard and heard[0] < cut, "the agent was heard before the user cut in"
    assert heard[-1] <= cut + 0.2, f"the track went on {heard[-1] - cut:.2f} s after speech_started"
    released = "".join(e["delta"] for e in seen.of("response.output_audio_transcript.delta"))
    kept = retrieved["item"]["content"][0]["transcript"]
    assert released.startswith(kept) and retrieved["item"]["status"] == "incomplete"
    wait_idle(server)


AGENT_PAGE = """<!doctype html><meta charset="utf-8"><title>agents-realtime, a tool</title>
<script type="module">
import { RealtimeAgent, RealtimeSession, OpenAIRealtimeWebRTC, tool } from "./sdk.js";
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// One call with a function tool the session forces: the SDK runs it here and sends its output; the page then
// lets the agent answer in a few words (tool_choice none) and waits for that answer to have played.
window.call = async (base, key) => {
  const events = [], errors = [], calls = [];
  const transport = new OpenAIRealtimeWebRTC({ baseUrl: base + "/v1/realtime/calls" });
  transport.on("*", (e) => events.push(e));
  const setVolume = tool({
    name: "set_volume",
    description: "Set the speaker volume.",
    parameters: { type: "object", properties: { level: { type: "integer", minimum: 0, maximum: 10 } },
                  required: ["level"], additionalProperties: false },
    execute: async (args) => {
      calls.push(args);
      transport.sendEvent({ type: "session.update",
                            session: { type: "realtime", tool_choice: "none", max_output_tokens: 6 } });
      return "the volume is set";
    },
  });
  const agent = new RealtimeAgent({ name: "duplexd", instructions: "Answer briefly.", tools: [setVolume] });
  const session = new RealtimeSession(agent, { transport, config: {
    toolChoice: { type: "function", name: "set_volume" }, audio: { input: { turnDetection: null } } } });
  session.on("error", (e) => errors.push(JSON.stringify(e.error)));
  await session.connect({ apiKey: key });
  session.sendMessage("Quieter please.");
  const answered = () => events.some((e) => e.type === "output_audio_buffer.stopped")
    && events.some((e) => e.type === "response.done" && e.response.output.some((o) => o.type === "message"));
  const deadline = performance.now() + 150000;
  while (performance.now() < deadline && !answered()) await sleep(100);
  let packets = 0, energy = 0;
  (await transport.connectionState.peerConnection.getStats()).forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "audio") { packets = s.packetsReceived; energy = s.totalAudioEnergy; }
  });
  const callId = transport.callId;
  session.close();
  return { events, errors, calls, packets, energy, callId };
};
window.ready = true;
</script>"""


def story(events: list[dict]) -> str:
    """What a failed call's events said, in short: each event's type, with the tool choice a session took and what
    each response gave."""
    told = []
    for e in events:
        if e["type"] in ("session.created", "session.updated"):
            told.append(f"{e['type']} tool_choice={e['session'].get('tool_choice')}")
        elif e["type"] == "response.done":
            told.append(f"response.done {[o['type'] for o in e['response']['output']]}")
        elif not e["type"].endswith(".delta") or not told or told[-1] != e["type"]:
            told.append(e["type"])
    return "\n".join(told)


@needs("chromium")
def test_openais_browser_sdk_calls_the_agent_runs_its_tool_and_hears_the_answer(server, tmp_path):
    """`@openai/agents-realtime` 0.20.0 in headless Chromium over WebRTC (an `ek_` key, from a page on another
    origin): the session forces the agent's function tool, the SDK runs it in the page and sends its output, the
    agent answers in speech played from the track, and the session sees no `error`."""
    sync_api = pytest.importorskip("playwright.sync_api")
    minted = httpx2.post(f"{server.url}/v1/realtime/client_secrets", json={"session": {"type": "realtime"}}, timeout=10)
    key = minted.json()["value"]
    wav = tmp_path / "mic.wav"
    write_wav(str(wav), np.zeros(SAMPLE_RATE, np.float32))  # the microphone Chromium captures: quiet
    with serve_page(tmp_path, AGENT_PAGE, sdk_bundle()) as origin, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=launch_args(wav))
        try:
            page = browser.new_page()
            page_errors: list[str] = []
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            page.goto(f"{origin}/index.html")
            page.wait_for_function("window.ready === true", timeout=30000)
            result = page.evaluate("([base, key]) => window.call(base, key)", [server.url, key])
        finally:
            browser.close()
    events = result["events"]
    assert not page_errors and not result["errors"], (page_errors, result["errors"])
    assert not [e for e in events if e["type"] == "error"]
    for event in events:
        SERVER_EVENTS.validate_json(json.dumps(event), strict=True)
    assert result["calls"]  # the tool ran in the page, with arguments its schema allows (the LLM may call it twice)
    for args in result["calls"]:
        jsonschema.validate(
            args, {"type": "object", "properties": {"level": {"type": "integer"}}, "required": ["level"]}
        )
    done = [e["response"] for e in events if e["type"] == "response.done"]
    assert {(o["type"], o["name"]) for o in done[0]["output"]} == {("function_call", "set_volume")}
    answer = done[-1]
    assert (
        finished(answer)
        and answer["output"][0]["type"] == "message"
        and answer["output"][0]["content"][0]["transcript"]
    ), story(events)
    outputs = [
        e for e in events if e["type"] == "conversation.item.added" and e["item"]["type"] == "function_call_output"
    ]
    assert outputs and outputs[0]["item"]["call_id"] == done[0]["output"][0]["call_id"]
    assert any(e["type"] == "output_audio_buffer.started" and e["response_id"] == answer["id"] for e in events)
    assert not [e for e in events if e["type"] == "response.output_audio.delta"]
    assert result["callId"].startswith("rtc_") and result["packets"] > 50 and result["energy"] > 0
    wait_idle(server)  # close() hung up
