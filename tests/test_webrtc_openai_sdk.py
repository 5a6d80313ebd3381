"""OpenAI's own browser SDK (`@openai/agents-realtime` from npm, unchanged) in headless Chromium, calling
`duplexd serve` over WebRTC from a page on another origin: an ephemeral `ek_` key (the SDK refuses any other in a
browser), CORS, the offer posted before gathering (no candidates), `session.updated` within the SDK's 5 s, the
model's speech played from the track, transcript events on `oai-events`, and `close()` hanging up (the slot comes
back). The SDK is bundled once with esbuild (also from npm) and cached outside the repository.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from duplexd.clients.audio import speech_like, write_wav

from .browser import CHROMIUM, launch_args
from .live_server import free_port, running_server

sync_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("aiortc")
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (.ci/run)")

SDK = "@openai/agents-realtime@0.20.0"
ESBUILD = "esbuild@0.28.2"
KEY = "sdk-key"
PAGE = """<!doctype html><meta charset="utf-8"><title>agents-realtime</title>
<script type="module">
import { RealtimeAgent, RealtimeSession, OpenAIRealtimeWebRTC } from "./sdk.js";
window.call = async (base, key) => {
  const events = [];
  const transport = new OpenAIRealtimeWebRTC({ baseUrl: base + "/v1/realtime/calls" });
  transport.on("*", (e) => events.push(e.type));
  const session = new RealtimeSession(new RealtimeAgent({ name: "duplexd" }), { transport });
  const t0 = performance.now();
  await session.connect({ apiKey: key });
  const connectedMs = performance.now() - t0;
  await new Promise((r) => setTimeout(r, 3000));
  const pc = transport.connectionState.peerConnection;
  let inbound = null;
  (await pc.getStats()).forEach((s) => { if (s.type === "inbound-rtp" && s.kind === "audio") inbound = s; });
  const callId = transport.callId;
  session.close();
  return { events, connectedMs, callId,
           packets: inbound ? inbound.packetsReceived : 0, energy: inbound ? inbound.totalAudioEnergy : 0 };
};
window.ready = true;
</script>"""


@pytest.fixture(scope="module")
def sdk_bundle() -> Path:
    """The SDK as one ES module (esbuild), cached under ~/.cache/duplexd-test/npm."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("needs node and npm to fetch OpenAI's browser SDK")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "duplexd-test" / "npm"
    bundle = cache / SDK.lstrip("@").replace("/", "-").replace("@", "-") / "sdk.js"
    if bundle.exists():
        return bundle
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        install = subprocess.run(["npm", "install", "--no-audit", "--no-fund", SDK, ESBUILD], cwd=tmp,
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
        if install.returncode:
            pytest.skip(f"npm install {SDK} failed: {(install.stderr or install.stdout).strip()[-300:]}")
        entry = Path(tmp) / "entry.js"
        entry.write_text(
            "export { RealtimeAgent, RealtimeSession, OpenAIRealtimeWebRTC } from '@openai/agents-realtime';\n"
        )
        built = subprocess.run(
            [str(Path(tmp) / "node_modules/.bin/esbuild"), str(entry), "--bundle", "--format=esm",
             "--platform=browser", f"--outfile={Path(tmp) / 'sdk.js'}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if built.returncode:  # the bundler's own binary (an npm optional dependency) did not come: the machine's
            pytest.skip(f"esbuild could not bundle the SDK: {built.stderr.strip()[-300:]}")
        bundle.parent.mkdir(parents=True, exist_ok=True)
        os.replace(Path(tmp) / "sdk.js", bundle)
    return bundle


@pytest.fixture(scope="module")
def page_origin(tmp_path_factory, sdk_bundle):
    """The web app: its page and the bundle, served from another origin than the API."""
    root = tmp_path_factory.mktemp("app")
    (root / "index.html").write_text(PAGE)
    shutil.copy(sdk_bundle, root / "sdk.js")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[method-assign]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory, page_origin):
    log = tmp_path_factory.mktemp("sdk-server") / "serve.log"
    env = {"DUPLEXD_CACHE": str(tmp_path_factory.getbasetemp() / "duplexd-cache")}
    args = ("--max-sessions", "1", "--api-key", KEY, "--allowed-origins", page_origin, "--webrtc-hosts", "127.0.0.1")
    with running_server(log, *args, env=env) as live:
        yield live
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


def _active(server) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        match = re.search(r"^duplexd_sessions_active (\S+)$", r.read().decode(), re.M)
    return float(match.group(1)) if match else 0.0


def test_openai_agents_realtime_sdk_calls_duplexd_over_webrtc(server, page_origin, tmp_path):
    request = urllib.request.Request(
        f"{server.url}/v1/realtime/client_secrets",
        data=json.dumps({"session": {"type": "realtime", "model": "gpt-realtime"}}).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        key = json.loads(r.read())["value"]
    wav = tmp_path / "mic.wav"
    write_wav(str(wav), speech_like(4.0, seed=2))
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=launch_args(wav))
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{page_origin}/index.html")
            page.wait_for_function("window.ready === true", timeout=30000)
            result = page.evaluate("([base, key]) => window.call(base, key)", [server.url, key])
        finally:
            browser.close()
    assert not errors, errors
    events = result["events"]
    assert "session.created" in events and "session.updated" in events  # connect() resolved on session.updated
    assert result["callId"].startswith("rtc_")  # Location, exposed by CORS
    assert "output_audio_buffer.started" in events and "response.output_audio_transcript.delta" in events
    assert "response.output_audio.delta" not in events
    assert result["packets"] > 50 and result["energy"] > 0  # the model's speech played from the track
    deadline = time.monotonic() + 10
    while _active(server):  # close() hung up: the slot is back
        assert time.monotonic() < deadline, "the SDK's close() did not end the call"
        time.sleep(0.1)
