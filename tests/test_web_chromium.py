"""The browser voice chat in a real headless Chromium (Debian's, driven by Playwright), against `duplexd serve`.

Chromium's fake media flags feed the microphone from a WAV file (an espeak-ng sentence between silences, looped;
synthetic speech-like noise without espeak-ng), so the page really captures, streams, plays and shows text, and
the server (`--transcribe demo`) really transcribes what the "user" says. Screenshots are saved in the test's tmp
dir and copied to out/ (git-ignored) for a look.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path

import httpx2
import pytest

from duplexd.clients.audio import speech_like, write_wav
from duplexd.clients.connection import ConnectOptions
from duplexd.clients.protocols import open_connection

from .browser import CHROMIUM, launch_args
from .live_server import demo_cache, running_server
from .speech import compose, needs_espeak, speak
from .system_tools import needs

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = needs("chromium")
OUT = Path(__file__).resolve().parents[1] / "out"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = demo_cache(tmp_path_factory)
    log = tmp_path_factory.mktemp("web-server") / "serve.log"
    env = {"DUPLEXD_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    # A long idle timeout: the refusal test's holder sends nothing while the browser, maybe slow beside another test
    # worker, starts; it must not be closed for idling before the browser is refused.
    args = ("--max-sessions", "1", "--transcribe", "demo", "--transcribe-max-tokens", "16", "--idle-timeout", "120",
            "--webrtc-hosts", "127.0.0.1")  # fmt: skip
    with running_server(log, *args, env=env) as live:
        yield live


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    mic = tmp_path_factory.mktemp("mic")
    wav = mic / "mic.wav"
    if shutil.which("espeak-ng"):
        pcm, _ = compose([0.6, speak("Please call me back tomorrow morning.", mic), 1.4], seed=5)
    else:
        pcm = speech_like(4.0, seed=5)
    write_wav(str(wav), pcm)
    args = launch_args(wav)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    assert not errors, errors


def save(page, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    OUT.mkdir(exist_ok=True)
    shutil.copy(shot, OUT / name)
    return shot


def wait_until_idle(server, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx2.get(f"{server.url}/ready", timeout=5).json().get("admissible_sessions") != 1:
        assert time.monotonic() < deadline, "the server's slot never came free"
        time.sleep(0.1)


def frames(page) -> int:
    return int(page.inner_text("#frames-received"))


def open_page(server, page, transport: str = "websocket") -> None:
    """The page, with its transport chosen (auto picks WebRTC: this server serves calls)."""
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model-id').textContent.length > 0", timeout=10000)
    page.evaluate(f"document.getElementById('transport').value = '{transport}'")


def test_talks_hears_and_reads_the_model(server, page, tmp_path):
    open_page(server, page)
    page.wait_for_selector("#demo-note:not([hidden])", timeout=10000)  # the server says it runs the demo model
    assert page.is_hidden("#persona")  # the demo model takes no persona
    page.click("#start")
    page.wait_for_selector("#state[data-state=live]", timeout=15000)
    page.wait_for_function("Number(document.getElementById('frames-received').textContent) >= 30", timeout=20000)
    page.wait_for_function("document.getElementById('text').textContent.length > 0", timeout=5000)
    # The mic meter moves (when the looped file speaks: noise suppression may silence its pauses).
    page.wait_for_function("parseFloat(document.getElementById('in-level').style.width) > 0", timeout=10000)
    first = page.inner_text("#first-audio")
    assert first.endswith("ms")
    save(page, tmp_path, "web-chat.png")
    before = frames(page)  # still streaming (12.5 frames a second; generous on a loaded machine)
    page.wait_for_function(
        f"Number(document.getElementById('frames-received').textContent) >= {before + 5}", timeout=5000
    )
    page.click("#stop")
    page.wait_for_selector("#state[data-state=idle]")
    assert page.is_hidden("#message")


def test_refused_session_says_the_server_is_full(server, page, tmp_path):
    """The only slot is held by another client (on its own thread and loop: Playwright owns this one)."""
    admitted, release = threading.Event(), threading.Event()

    async def hold() -> None:
        conn = open_connection(ConnectOptions(url=server.url))
        await conn.open()
        admitted.set()
        await asyncio.to_thread(release.wait, 100)
        await conn.close()

    wait_until_idle(server)  # the previous test's session may still be closing
    holder = threading.Thread(target=lambda: asyncio.run(hold()))
    holder.start()
    try:
        assert admitted.wait(15)
        open_page(server, page, "auto")  # a call is refused as a WebSocket is
        page.click("#start")
        page.wait_for_selector("#state[data-state=refused]", timeout=60000)  # a page start on a loaded box
        assert "server is full" in page.inner_text("#message")
        assert page.is_enabled("#start")
        save(page, tmp_path, "web-refused.png")
    finally:
        release.set()
        holder.join(10)


@needs_espeak
def test_shows_the_users_captions(server, page, tmp_path):
    """With "Transcribe me" on (the default: the server lists a transcription model), each thing the microphone
    says gets a caption line: a placeholder while it is spoken, then the server's transcript."""
    wait_until_idle(server)
    open_page(server, page)
    page.wait_for_selector("#transcribe-toggle:not([hidden])", timeout=10000)
    assert page.is_checked("#transcribe") and page.is_visible("#you")
    page.click("#start")
    page.wait_for_selector("#state[data-state=live]", timeout=15000)
    page.wait_for_selector("#captions li[data-state=speaking]", timeout=20000)
    assert "speaking" in page.inner_text("#captions li[data-state=speaking]")
    page.wait_for_selector("#captions li[data-state=done]", timeout=30000)
    first = page.query_selector("#captions li[data-state=done]")
    assert first is not None
    text = first.inner_text()
    assert text and "…" not in text and first.get_attribute("data-item").startswith("item_")
    assert page.is_hidden("#message")  # no transcription error
    save(page, tmp_path, "web-captions.png")
    page.click("#stop")
    page.wait_for_selector("#state[data-state=idle]")


def test_talks_over_webrtc_when_the_server_serves_calls(server, page, tmp_path):
    """Auto: the server lists /v1/realtime/calls, so the page calls (the microphone on the peer connection, the
    voice from the track, events on oai-events); its first event turns the user's captions on; Stop hangs up."""
    wait_until_idle(server)
    open_page(server, page, "auto")
    page.click("#start")
    page.wait_for_selector("#state[data-state=live]", timeout=20000)
    assert "WebRTC" in page.inner_text("#state")
    page.wait_for_function("document.getElementById('text').textContent.length > 0", timeout=15000)
    page.wait_for_function("document.getElementById('first-audio').textContent.endsWith('ms')", timeout=10000)
    page.wait_for_function("parseFloat(document.getElementById('out-level').style.width) > 0", timeout=10000)
    if shutil.which("espeak-ng"):  # the microphone reached the server over the call: its words are transcribed
        page.wait_for_selector("#captions li[data-state=done]", timeout=30000)
    assert frames(page) == 0  # no audio event: the voice is on the track
    save(page, tmp_path, "web-webrtc.png")
    page.click("#stop")
    page.wait_for_selector("#state[data-state=idle]")
    wait_until_idle(server)  # the hang-up freed the slot
    assert page.is_hidden("#message")


def test_lost_connection_is_reported(server, page, tmp_path):
    """Last in the module: it stops the server under the page."""
    open_page(server, page)
    page.click("#start")
    page.wait_for_selector("#state[data-state=live]", timeout=15000)
    page.wait_for_function("Number(document.getElementById('frames-received').textContent) >= 3", timeout=15000)
    server.proc.kill()
    page.wait_for_selector("#state[data-state=lost]", timeout=10000)
    assert "Connection lost" in page.inner_text("#message")
    save(page, tmp_path, "web-lost.png")
