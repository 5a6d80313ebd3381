"""OpenAI's own browser SDK (`@openai/agents-realtime` from npm, unchanged, its default session) in headless
Chromium against `duplexd serve`, from a page on another origin, over both transports at once: WebRTC (an
ephemeral `ek_` key, the SDK refuses any other in a browser; CORS; the offer posted before gathering, with no
candidates; the model's speech played from the track; `close()` hanging up, so the slot comes back) and the
WebSocket (the key as a subprotocol; the page sends its audio at real time, as an app does).

Each transport runs against a server without a transcriber and one with one (`--transcribe demo`), and no
session sees an `error`: the SDK asks for input transcription by default (without a transcriber,
`session.updated` shows it off); it retrieves each user item once its transcript is complete, and on the WebSocket
it truncates the model's item and cancels the response whenever the user starts speaking, then retrieves that item
too. The SDK is bundled once with esbuild (also from npm) and cached outside the repository (`browser_sdk.py`).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from duplexd import wire
from duplexd.clients.audio import speech_like, write_wav
from duplexd.wire import SAMPLE_RATE

from .browser import CHROMIUM, launch_args
from .browser_sdk import page_origin as serve_page
from .browser_sdk import sdk_bundle as bundle_sdk
from .live_server import demo_cache, running_server, running_side_by_side
from .system_tools import needs

sync_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("aiortc")
pytestmark = needs("chromium")

KEY = "sdk-key"
TRANSCRIBER = "gemma4-demo"  # the model id the server gives its demo transcriber
PAGE = """<!doctype html><meta charset="utf-8"><title>agents-realtime</title>
<script type="module">
import { RealtimeAgent, RealtimeSession, OpenAIRealtimeWebRTC, OpenAIRealtimeWebSocket } from "./sdk.js";
const FRAME = 3840;  // bytes: 80 ms of pcm16 at 24 kHz
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// mic.pcm at real time, then silence, until the session is over (the WebSocket transport takes no microphone).
async function speak(session, over) {
  const pcm = await (await fetch("./mic.pcm")).arrayBuffer(), t0 = performance.now();
  for (let i = 0; !over(); i++) {
    const at = i * FRAME;
    session.sendAudio(at + FRAME <= pcm.byteLength ? pcm.slice(at, at + FRAME) : new ArrayBuffer(FRAME));
    await sleep(t0 + (i + 1) * 80 - performance.now());
  }
}

// One session with the SDK's defaults: `seconds` long, and until items of each of `roles` were retrieved (30 s at
// most).
window.call = async (base, key, kind, seconds, roles) => {
  const events = [], errors = [];
  const transport = kind === "webrtc"
    ? new OpenAIRealtimeWebRTC({ baseUrl: base + "/v1/realtime/calls" })
    : new OpenAIRealtimeWebSocket({ url: base.replace(/^http/, "ws") + "/v1/realtime" });
  transport.on("*", (e) => events.push(e.type === "response.output_audio.delta" ? { type: e.type } : e));
  const session = new RealtimeSession(new RealtimeAgent({ name: "duplexd" }), { transport });
  session.on("error", (e) => errors.push(JSON.stringify(e.error)));
  await session.connect({ apiKey: key });
  let over = false;
  const sending = kind === "websocket" ? speak(session, () => over) : null;
  const retrieved = (role) => events.some((e) => e.type === "conversation.item.retrieved" && e.item.role === role);
  await sleep(seconds * 1000);
  const deadline = performance.now() + 30000;
  while (performance.now() < deadline && !roles.every(retrieved)) await sleep(100);
  let packets = 0, energy = 0, callId = null;
  if (kind === "webrtc") {
    (await transport.connectionState.peerConnection.getStats()).forEach((s) => {
      if (s.type === "inbound-rtp" && s.kind === "audio") { packets = s.packetsReceived; energy = s.totalAudioEnergy; }
    });
    callId = transport.callId;
  }
  over = true;
  await sending;
  session.close();
  return { events, errors, callId, packets, energy };
};
window.ready = true;
</script>"""


@pytest.fixture(scope="module")
def sdk_bundle() -> Path:
    return bundle_sdk()


@pytest.fixture(scope="module")
def mic() -> np.ndarray:
    """What the user says: silence (the model is speaking by then), one utterance to the VAD, silence."""
    silence = np.zeros(3 * SAMPLE_RATE // 2, np.float32)
    return np.concatenate([silence, speech_like(2.5, seed=1), silence])


@pytest.fixture(scope="module")
def page_origin(tmp_path_factory, sdk_bundle, mic):
    """The web app: its page, the bundle and the audio its WebSocket session sends, served from another origin
    than the API."""
    root = tmp_path_factory.mktemp("app")
    (root / "mic.pcm").write_bytes(wire.pcm16(mic).tobytes())
    with serve_page(root, PAGE, sdk_bundle) as origin:
        yield origin


@pytest.fixture(scope="module")
def servers(tmp_path_factory, page_origin):
    """Two servers started side by side, each for one session per transport: without a transcriber and with the
    demo one."""
    logs = tmp_path_factory.mktemp("sdk-server")
    env = {"DUPLEXD_CACHE": str(demo_cache(tmp_path_factory))}
    args = ("--max-sessions", "2", "--api-key", KEY, "--allowed-origins", page_origin, "--webrtc-hosts", "127.0.0.1")
    with running_side_by_side(
        running_server(logs / "plain.log", *args, env=env),
        running_server(logs / "transcribe.log", *args, "--transcribe", "demo", "--transcribe-max-tokens", "8", env=env),
    ) as lives:
        yield lives


def _active(server) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        match = re.search(r"^duplexd_sessions_active (\S+)$", r.read().decode(), re.M)
    return float(match.group(1)) if match else 0.0


def _ephemeral_key(server) -> str:
    request = urllib.request.Request(
        f"{server.url}/v1/realtime/client_secrets",
        data=json.dumps({"session": {"type": "realtime", "model": "gpt-realtime"}}).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())["value"]


def _of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"] == kind]


def test_openai_agents_realtime_sdk_default_sessions_see_no_error(servers, page_origin, mic, tmp_path):
    plain, transcribing = servers
    wav = tmp_path / "mic.wav"
    write_wav(str(wav), mic)  # the WebRTC calls' microphone (Chromium loops it)
    sessions = [  # server, transport, the roles of the items to wait for (retrieved)
        (plain, "webrtc", []),
        (plain, "websocket", []),
        (transcribing, "webrtc", ["user"]),
        (transcribing, "websocket", ["user", "assistant"]),
    ]
    runs = [[s.url, _ephemeral_key(s), kind, 3, roles] for s, kind, roles in sessions]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=launch_args(wav))
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{page_origin}/index.html")
            page.wait_for_function("window.ready === true", timeout=30000)
            results = page.evaluate("(runs) => Promise.all(runs.map((r) => window.call(...r)))", runs)
        finally:
            browser.close()
    assert not errors, errors
    calls = {(server is transcribing, kind): r for (server, kind, _), r in zip(sessions, results, strict=True)}
    for (transcribes, kind), result in calls.items():
        events = result["events"]
        where = f"{kind}, {'with' if transcribes else 'without'} a transcriber"
        assert not result["errors"] and not _of(events, "error"), (where, result["errors"], _of(events, "error"))
        assert _of(events, "session.created"), where
        updated = _of(events, "session.updated")  # connect() resolved on the first
        shown = updated[-1]["session"]["audio"]["input"]["transcription"]  # as it is: the SDK asked for it
        assert shown == ({"model": TRANSCRIBER, "language": None, "prompt": None} if transcribes else None), where
    call = calls[False, "webrtc"]
    assert call["callId"].startswith("rtc_")  # Location, exposed by CORS
    assert _of(call["events"], "output_audio_buffer.started")
    assert _of(call["events"], "response.output_audio_transcript.delta")
    assert not _of(call["events"], "response.output_audio.delta")
    assert call["packets"] > 50 and call["energy"] > 0  # the model's speech played from the track
    assert _of(calls[False, "websocket"]["events"], "response.output_audio.delta")  # the model speaks back
    for kind in ("webrtc", "websocket"):
        events = calls[True, kind]["events"]
        completed = _of(events, "conversation.item.input_audio_transcription.completed")
        transcripts = {e["item_id"]: e["transcript"] for e in completed}
        users = [e["item"] for e in _of(events, "conversation.item.retrieved") if e["item"]["role"] == "user"]
        assert users, kind
        for item in users:  # each user item the SDK retrieved, with its whole transcript
            assert item["content"][0]["transcript"] == transcripts[item["id"]]
    events = calls[True, "websocket"]["events"]
    truncated = _of(events, "conversation.item.truncated")  # the user cut in: the SDK truncated the model's item
    said = [e["item"] for e in _of(events, "conversation.item.retrieved") if e["item"]["role"] == "assistant"]
    assert said and truncated and {i["id"] for i in said} == {t["item_id"] for t in truncated}
    deadline = time.monotonic() + 10
    while _active(plain) or _active(transcribing):  # close() hung up: the slots are back
        assert time.monotonic() < deadline, "the SDK's close() did not end every session"
        time.sleep(0.1)
