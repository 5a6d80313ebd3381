"""A session's PersonaPlex persona over the wire: `duplexd serve --voices DIR` on a tiny random PersonaPlex
checkpoint, one server for the module (2 slots).

- Kyutai `/api/chat?text_prompt=..&voice_prompt=..`: the metadata says the persona, the handshake comes once the
  prompt has run; at temperature 0 the same persona answers the same, another role text differently, and the text
  is the engine's offline path's (`Pipeline.prompt` then `Pipeline.step`, as `duplexd infer` runs) for the audio
  the server decodes.
- Realtime: `session.instructions` + `session.voice` before the first audio are applied, and the answer equals the
  engine's offline path on the same input (text, and speech within pcm16's rounding);
  changing them after the audio starts is `persona_locked`, an unknown voice `invalid_value`, and the session
  goes on either way.
- Refusals (1007 with the reason): unknown voice, empty text, a prompt too long for the window, while another
  session keeps getting frames; a persona asked of a server without `--voices` and of a model that is not
  PersonaPlex.
- The browser's persona box: the voice picker lists the server's voices and the session runs the one picked.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import numpy as np
import pytest
import sphn
import torch
from websockets.asyncio.client import connect

from duplexd.clients.audio import write_wav
from duplexd.clients.chat import chat
from duplexd.clients.connection import ConnectOptions, Refused, Sampling
from duplexd.clients.protocols import open_connection
from duplexd.commands.cli import main
from duplexd.engine.dialogue.pipeline import Pipeline
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.models.config import MIMI_PRESETS
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.persona.prompt import Voice, role_prompt
from duplexd.engine.persona.voices import VoiceLibrary, load_preset
from duplexd.engine.weights.checkpoint import load_lm, load_mimi, mimi_ring_rule
from duplexd.engine.weights.demo import ensure_demo
from duplexd.server.core.persona import DEFAULT_TEXT, KYUTAI, REALTIME, PersonaRefused, Personas
from duplexd.wire import pcm16, pcm_from_pcm16, split_frames

from .browser import CHROMIUM, launch_args
from .live_server import demo_cache, running_server
from .personaplex_files import PP_DEMO_TEXT, write_personaplex
from .personaplex_ref import preset_from_codes
from .system_tools import needs
from .test_infer import speech_like

# The demo tokenizer's vocabulary for the text stream, and a window small enough to overflow.
CFG = dataclasses.replace(PP_DEMO_TEXT, context=160)
ROLE = "You enjoy having a good conversation about the weather."
OTHER_ROLE = "You are a pirate who only talks about the sea and ships."
OUT = Path(__file__).resolve().parents[1] / "out"
GREEDY = Sampling(text_temperature=0.0, audio_temperature=0.0)


def _codes(seed: int, frames: int) -> list[list[int]]:
    return torch.randint(0, CFG.card, (frames, 8), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The checkpoint's serve flags, its files and the voices folder (two presets, one audio voice)."""
    root = tmp_path_factory.mktemp("pp_persona")
    weights, ref_lm = write_personaplex(root, CFG, seed=6)
    voices = root / "voices"
    voices.mkdir()
    torch.save(preset_from_codes(CFG, ref_lm, _codes(3, 4)), voices / "NATF0.pt")
    torch.save(preset_from_codes(CFG, ref_lm, _codes(4, 6)), voices / "VARM1.pt")
    write_wav(str(voices / "guest.wav"), speech_like(0.6, 24000, seed=5)[:, 0])
    demo = ensure_demo()
    assert TextTokenizer(demo.tokenizer).vocab_size == CFG.text_card
    flags = ["--moshi-weight", str(weights), "--mimi-weight", str(demo.mimi), "--tokenizer", str(demo.tokenizer)]
    flags += ["--config", str(root / "config.json"), "--mimi-preset", "demo"]
    return flags, root, voices


def _env(tmp_path_factory) -> dict[str, str]:
    return {"DUPLEXD_CACHE": str(demo_cache(tmp_path_factory)), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    flags, _, voices = files
    log = tmp_path_factory.mktemp("pp_persona_server") / "serve.log"
    with running_server(
        log,
        *flags,
        "--voices",
        str(voices),
        "--max-sessions",
        "2",
        "--webrtc-hosts",
        "127.0.0.1",
        env=_env(tmp_path_factory),
    ) as live:
        yield live


def _ws(server, path: str) -> str:
    return server.url.replace("http", "ws", 1) + path


def _options(server, protocol: str = "kyutai", **kw) -> ConnectOptions:
    return ConnectOptions(url=server.url, protocol=protocol, open_timeout=20, **kw)


def _input(seconds: float = 1.0) -> np.ndarray:
    return speech_like(seconds, 24000, seed=3)[:, 0]


async def _refusal(options: ConnectOptions) -> Refused:
    conn = open_connection(options)
    with pytest.raises(Refused) as refused:
        await conn.open()
    return refused.value


# ----------------------------------------------------------------------------------------------- Personas


def _library(*specs: tuple[str, int]) -> VoiceLibrary:
    """Audio-kind voices of `frames` each (their codes are random: the prompt's layout is tested elsewhere)."""
    return VoiceLibrary(
        {name: Voice(name, Path(name), frames, codes=torch.tensor(_codes(1, frames))) for name, frames in specs}
    )


def test_personas_defaults_refusals_and_cache(caplog):
    tokenizer = TextTokenizer(ensure_demo().tokenizer)
    with caplog.at_level(logging.INFO):
        personas = Personas(CFG, tokenizer, _library(*((f"v{i:02d}.wav", 2) for i in range(12)), ("v00.pt", 3)))
    assert personas.default is not None and personas.default.voice == "v00.pt"  # the first: no NATF0.pt
    assert "no NATF0.pt among the voices; the default voice is v00.pt" in caplog.text
    assert personas.default.text == DEFAULT_TEXT
    with pytest.raises(PersonaRefused) as unknown:
        personas.resolve(None, "nobody", REALTIME)
    assert unknown.value.option == "session.voice" and str(unknown.value).startswith(
        "session.voice: unknown voice 'nobody'; this server has v00.pt, v00.wav, v01.wav"
    )
    assert str(unknown.value).endswith("and 3 more (GET /v1/models)")
    with pytest.raises(PersonaRefused, match="unknown voice 'v00'"):  # two files share the stem: ambiguous
        personas.resolve(None, "v00", KYUTAI)
    one = personas.resolve(ROLE, "v03", KYUTAI)  # an unambiguous stem
    assert one is not None and one.voice == "v03.wav" and one.text == ROLE
    assert personas.resolve(ROLE, "v03.wav", KYUTAI).prompt is one.prompt  # built once
    with pytest.raises(PersonaRefused, match=r"^session.instructions is empty$"):
        personas.resolve(" ", None, REALTIME)
    with pytest.raises(PersonaRefused, match="has text the model cannot read: token"):  # a tokenizer too large
        Personas(dataclasses.replace(CFG, text_card=300), tokenizer, _library(("NATF0.pt", 2)))  # at start-up
    off, no_voices = Personas.off(), Personas(CFG, tokenizer, None)
    assert off.resolve(None, None, KYUTAI) is None and no_voices.resolve(None, None, KYUTAI) is None
    with pytest.raises(PersonaRefused, match="need a PersonaPlex model"):
        off.resolve(ROLE, None, KYUTAI)
    with pytest.raises(PersonaRefused, match="^voice_prompt: this server has no voices"):
        no_voices.resolve(None, "NATF0.pt", KYUTAI)


# ----------------------------------------------------------------------------------------------- /v1/models


def test_models_lists_the_voices_and_the_defaults(server):
    model = httpx2.get(f"{server.url}/v1/models", timeout=5).json()["data"][0]
    assert model["persona"] is True and model["voices"] == ["NATF0.pt", "VARM1.pt", "guest.wav"]
    assert model["persona_defaults"] == {"text_prompt": DEFAULT_TEXT, "voice_prompt": "NATF0.pt"}
    assert "persona defaults: voice NATF0.pt" in server.log.read_text()


# ----------------------------------------------------------------------------------------------- Kyutai


def test_kyutai_handshake_comes_after_the_prompt(server):
    async def scenario() -> dict:
        conn = open_connection(_options(server, text_prompt=ROLE, voice_prompt="VARM1"))  # a stem works too
        await conn.open()  # returns at the handshake
        try:
            log = server.log.read_text()
            line = [ln for ln in log.splitlines() if f"kyutai session {conn.info['session_id']}: persona" in ln]
            assert line and "voice VARM1.pt, prompt of" in line[0] and line[0].endswith("; handshake"), log[-2000:]
        finally:
            await conn.close()
        return conn.info

    info = asyncio.run(scenario())
    assert info["text_prompt"] == ROLE and info["voice_prompt"] == "VARM1.pt"
    metrics = httpx2.get(f"{server.url}/metrics", timeout=5).text
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("duplexd_prompt"))
    assert float(samples["duplexd_prompt_frames_total"]) > 0, metrics  # prefilled frames, all sessions so far
    assert float(samples["duplexd_prompt_seconds_count"]) >= 1 and float(samples["duplexd_prompt_seconds_sum"]) > 0


def _heard(pcm: np.ndarray) -> np.ndarray:
    """The whole frames the server decodes from what the Kyutai client sends (Ogg/Opus, one message a frame)."""
    writer, reader = sphn.OpusStreamWriter(24000), sphn.OpusStreamReader(24000)
    decoded = np.concatenate([reader.append_bytes(writer.append_pcm(frame)) for frame in split_frames(pcm)])
    whole = len(decoded) // 1920
    return decoded[: whole * 1920].reshape(whole, 1920)


def test_kyutai_persona_changes_the_answer_and_reproduces(server, files):
    """At temperature 0: the same persona answers the same, another role text otherwise, and the text is what the
    engine's offline path says for the audio the server decodes."""

    def run(role: str) -> tuple[str, np.ndarray, dict]:
        options = _options(server, sampling=GREEDY, text_prompt=role, voice_prompt="NATF0.pt")
        # All frames at once (Ogg holds the last input pages back: a window would wait on answers that cannot
        # come), then what comes back until nothing more does.
        result = asyncio.run(chat(_input(1.0), options, fast=True, window=64, drain=1.5, output_delay=0))
        assert result.frames_received >= 8 and not result.errors, result
        return result.text, result.pcm, result.info

    text, pcm, info = run(ROLE)
    again, pcm_again, _ = run(ROLE)
    other, pcm_other, other_info = run(OTHER_ROLE)
    assert info["voice_prompt"] == "NATF0.pt" and other_info["text_prompt"] == OTHER_ROLE
    assert text == again and np.array_equal(pcm, pcm_again)
    assert (text, pcm.tobytes()) != (other, pcm_other.tobytes())
    expected, _ = _offline(files, ROLE, "NATF0.pt", _heard(_input(1.0)))
    assert expected and text == expected


def test_kyutai_default_persona(server):
    """No parameter: PersonaPlex's client defaults, as its own server would be asked for."""

    async def scenario() -> dict:
        conn = open_connection(_options(server))
        await conn.open()
        await conn.close()
        return conn.info

    info = asyncio.run(scenario())
    assert info["text_prompt"] == DEFAULT_TEXT and info["voice_prompt"] == "NATF0.pt"


def test_bad_personas_are_refused_while_another_session_goes_on(server):
    long_role = " ".join([OTHER_ROLE] * 8)

    async def scenario() -> list[Refused]:
        url = _ws(server, "/v1/realtime")
        async with connect(url, subprotocols=["realtime"]) as ws:  # type: ignore[list-item]
            assert json.loads(await ws.recv())["type"] == "session.created"
            frames = split_frames(_input(8.0))
            counts: list[int] = []
            received = 0

            async def feed() -> None:
                for frame in frames:
                    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": _b64(frame)}))
                    await asyncio.sleep(0.04)

            async def listen() -> None:
                nonlocal received
                async for message in ws:
                    if json.loads(message)["type"] == "response.output_audio.delta":
                        received += 1

            tasks = [asyncio.create_task(feed()), asyncio.create_task(listen())]
            try:
                while received < 3:
                    await asyncio.sleep(0.05)
                refusals = []
                for kw in (
                    {"voice_prompt": "NOPE.pt"},
                    {"text_prompt": "   "},
                    {"text_prompt": long_role},
                ):
                    counts.append(received)
                    refusals.append(await _refusal(_options(server, **kw)))
                counts.append(received)
                deadline = time.monotonic() + 5
                while received < counts[-1] + 3 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                counts.append(received)
            finally:
                for task in tasks:
                    task.cancel()
            assert counts[-1] >= counts[0] + 3, counts  # the live session kept getting frames meanwhile
            return refusals

    unknown, empty, too_long = asyncio.run(scenario())
    for refusal in (unknown, empty, too_long):
        assert refusal.code == 1007, refusal
    assert unknown.message.startswith("voice_prompt: unknown voice 'NOPE.pt'; this server has NATF0.pt, VARM1.pt")
    assert empty.message == "text_prompt is empty"
    assert too_long.message.startswith("text_prompt makes a prompt of"), too_long.message
    assert "the model's context is 160 frames" in too_long.message
    assert "Traceback" not in server.log.read_text()


def _b64(frame: np.ndarray) -> str:
    return base64.b64encode(pcm16(frame).tobytes()).decode("ascii")


# ----------------------------------------------------------------------------------------------- Realtime


def _offline(files, role: str, voice: str, frames: np.ndarray) -> tuple[str, np.ndarray]:
    """What the engine's offline path (`duplexd infer`'s) answers: the prompt, then one step per frame."""
    _, root, voices = files
    demo = ensure_demo()
    lm = load_lm(root / "model.safetensors", root / "config.json")
    mimi = load_mimi(demo.mimi, mimi_ring_rule(MIMI_PRESETS["demo"], lm.cfg))
    tokenizer = TextTokenizer(demo.tokenizer)
    prompt = role_prompt(lm.cfg, load_preset(voices / voice, lm.cfg), role, tokenizer.encode)
    pipeline = Pipeline(lm, mimi, num_slots=1)
    pipeline.reset(0, SamplingParams(text_temperature=0.0, audio_temperature=0.0))
    pipeline.prompt(0, prompt, chunk=prompt.forwards)
    silent = set(lm.cfg.silent_text_ids)
    text, pcm = [], []
    for i in range(len(frames)):
        out = pipeline.step([0], frames[i : i + 1])
        assert out.valid[0]
        token = int(out.tokens[0, 0])
        text.append("" if token in silent else tokenizer.piece(token))
        pcm.append(out.pcm[0].float().cpu().numpy().copy())
    return "".join(text), np.concatenate(pcm)


def test_realtime_persona_before_audio_matches_the_offline_engine(server, files):
    options = _options(server, "realtime", sampling=GREEDY, text_prompt=ROLE, voice_prompt="VARM1.pt")
    pcm = _input(1.5)
    result = asyncio.run(chat(pcm, options, fast=True, output_delay=0))
    assert result.info["instructions"] == ROLE and result.info["voice"] == "VARM1.pt", result.info
    assert result.info["audio"]["output"]["voice"] == "VARM1.pt"
    assert result.frames_received == result.frames_sent == 19 and not result.errors, result
    frames = pcm_from_pcm16(pcm16(split_frames(pcm)).tobytes()).reshape(-1, 1920)  # what the server decodes
    text, speech = _offline(files, ROLE, "VARM1.pt", frames)
    assert text and result.text == text
    assert np.abs(result.pcm - np.clip(speech, -1, 1)).max() < 2e-3  # pcm16 on the wire


def test_realtime_persona_is_locked_once_audio_flows(server):
    async def scenario() -> tuple[dict, dict, dict, int]:
        async with connect(_ws(server, "/v1/realtime"), subprotocols=["realtime"]) as ws:  # type: ignore[list-item]
            created = json.loads(await ws.recv())
            assert created["session"]["instructions"] == DEFAULT_TEXT and created["session"]["voice"] == "NATF0.pt"
            events: asyncio.Queue[dict] = asyncio.Queue()
            deltas = 0

            async def read() -> None:
                nonlocal deltas
                async for message in ws:
                    e = json.loads(message)
                    if e["type"] == "response.output_audio.delta":
                        deltas += 1
                    else:
                        events.put_nowait(e)

            async def event(kind: str) -> dict:
                while (e := await asyncio.wait_for(events.get(), 10))["type"] != kind:
                    pass
                return e

            async def send(event: dict) -> None:
                await ws.send(json.dumps(event))

            reader = asyncio.create_task(read())
            await send({"type": "session.update", "session": {"voice": "nobody"}})
            unknown = await event("error")
            await send({"type": "session.update", "session": {"instructions": ROLE}})
            updated = await event("session.updated")
            frames = split_frames(_input(1.0))
            for frame in frames[:4]:
                await send({"type": "input_audio_buffer.append", "audio": _b64(frame)})
            same = {"instructions": ROLE, "voice": "NATF0"}  # the same again (an SDK resending it) is fine
            await send({"type": "session.update", "session": same})
            assert (await event("session.updated"))["session"]["instructions"] == ROLE
            await send({"type": "session.update", "session": {"instructions": OTHER_ROLE}})
            locked = await event("error")
            await send({"type": "session.update", "session": {"audio": {"output": {"voice": "VARM1.pt"}}}})
            assert (await event("error"))["error"]["param"] == "session.audio.output.voice"  # GA's place too
            for frame in frames[4:]:
                await send({"type": "input_audio_buffer.append", "audio": _b64(frame)})
            deadline = time.monotonic() + 10
            while deltas < len(frames) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            reader.cancel()
            return unknown["error"], updated["session"], locked["error"], deltas

    unknown, updated, locked, deltas = asyncio.run(scenario())
    assert unknown["code"] == "invalid_value" and unknown["param"] == "session.voice", unknown
    assert "unknown voice 'nobody'" in unknown["message"]
    assert updated["instructions"] == ROLE and updated["voice"] == "NATF0.pt"
    assert locked["code"] == "persona_locked" and locked["param"] == "session.instructions", locked
    assert locked["type"] == "invalid_request_error" and "set before the audio starts" in locked["message"]
    assert deltas == 13  # one answer per frame (the prompt warmed the delays up): it went on after both errors
    assert "persona fixed: voice NATF0.pt" in server.log.read_text()


def test_chat_cli_takes_a_persona(server, tmp_path, capsys):
    write_wav(str(tmp_path / "in.wav"), _input(0.4))
    for protocol in ("kyutai", "realtime"):
        args = ["chat", str(tmp_path / "in.wav"), "--out", str(tmp_path / "out.wav"), "--url", server.url, "--fast"]
        args += ["--drain", "0.5"]
        args += ["--protocol", protocol, "--text-prompt", ROLE, "--voice-prompt", "VARM1"]
        assert main(args) == 0
        err = capsys.readouterr().err
        assert f"persona: voice VARM1.pt, role text {ROLE!r}" in err, err
    args = ["chat", str(tmp_path / "in.wav"), "--out", str(tmp_path / "out.wav"), "--url", server.url]
    assert main([*args, "--protocol", "realtime", "--voice-prompt", "nobody"]) == 1
    assert "persona refused: invalid_value: session.voice: unknown voice 'nobody'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- other servers


@contextlib.contextmanager
def _started(*servers: contextlib.AbstractContextManager) -> Iterator[list]:
    """Several `running_server`s started at once (their loading and warm-up overlap), all stopped at the end."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(server.__enter__) for server in servers]
        live = []
        for server, future in zip(servers, futures, strict=True):
            with contextlib.suppress(BaseException):
                live.append(future.result())
                stack.push(server.__exit__)
        assert len(live) == len(servers), "a server did not start (its log says why)"
        yield live


def test_a_persona_needs_voices_and_a_personaplex_model(files, tmp_path_factory, demo_server):
    """PersonaPlex without --voices runs sessions without a persona and refuses one; a model that is not
    PersonaPlex (the demo: the run's shared demo server, tests/live_server.py) refuses one too, and Realtime's
    instructions stay ignored there, as before."""
    flags, _, _ = files
    env = _env(tmp_path_factory)
    plain_log = tmp_path_factory.mktemp("pp_no_voices") / "serve.log"
    demo = demo_server
    with _started(running_server(plain_log, *flags, "--max-sessions", "1", env=env)) as (plain,):

        async def scenario() -> tuple[Refused, Refused, Refused, dict, dict]:
            no_voices = await _refusal(_options(plain, text_prompt=ROLE))
            not_pp = await _refusal(_options(demo, voice_prompt="NATF0.pt"))
            not_pp_rt = await _refusal(_options(demo, "realtime", voice_prompt="NATF0.pt"))  # by session.update
            conn = open_connection(_options(plain))  # no persona asked: runs without one
            await conn.open()
            await conn.close()
            async with connect(_ws(demo, "/v1/realtime"), subprotocols=["realtime"]) as ws:  # type: ignore
                await ws.recv()
                await ws.send(json.dumps({"type": "session.update", "session": {"instructions": ROLE, "voice": "x"}}))
                updated = json.loads(await ws.recv())
            return no_voices, not_pp, not_pp_rt, conn.info, updated

        no_voices, not_pp, not_pp_rt, plain_info, updated = asyncio.run(scenario())
    assert no_voices.code == 1007 and no_voices.message == (
        "text_prompt: this server has no voices, so it gives no persona (start it with --voices DIR)"
    )
    assert not_pp.code == 1007 and not_pp.message.startswith(
        "text_prompt and voice_prompt need a PersonaPlex model; this server's model (duplexd-demo) takes no"
    ), not_pp
    assert "the server's model takes no persona" in not_pp_rt.message, not_pp_rt  # `duplexd chat`'s own check
    assert "text_prompt" not in plain_info
    assert updated["type"] == "session.updated" and "instructions" not in updated["session"], updated
    assert "without --voices: sessions run without a persona" in plain_log.read_text()


# ----------------------------------------------------------------------------------------------- browser


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    sync_api = pytest.importorskip("playwright.sync_api")
    wav = tmp_path_factory.mktemp("mic") / "mic.wav"
    write_wav(str(wav), speech_like(4.0, 24000, seed=5)[:, 0])
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=launch_args(wav))
        context = browser.new_context()
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        yield page
        browser.close()
    assert not errors, errors


@pytest.mark.parametrize("transport", ["websocket", "webrtc"])
@needs("chromium")
def test_browser_persona_box(server, page, transport):
    """The page's persona box, on either transport: the query of the WebSocket, the first event of a call."""
    page.goto(server.url + "/")
    page.wait_for_selector("#persona:not([hidden])", timeout=10000)
    page.evaluate(f"document.getElementById('transport').value = '{transport}'")
    options = page.eval_on_selector_all("#voice_prompt option", "os => os.map(o => o.value)")
    assert options == ["NATF0.pt", "VARM1.pt", "guest.wav"]
    assert page.input_value("#voice_prompt") == "NATF0.pt" and page.input_value("#text_prompt") == DEFAULT_TEXT
    page.select_option("#voice_prompt", "guest.wav")
    page.fill("#text_prompt", OTHER_ROLE)
    page.click("#start")
    page.wait_for_selector("#state[data-state=live]", timeout=15000)
    if transport == "websocket":
        page.wait_for_function("Number(document.getElementById('frames-received').textContent) >= 5", timeout=20000)
    else:  # the voice is on the call's track; the page shows the persona of session.updated
        page.wait_for_function("document.getElementById('first-audio').textContent.endsWith('ms')", timeout=20000)
        page.wait_for_function("document.getElementById('persona-used').textContent.includes('guest')", timeout=5000)
    assert page.inner_text("#persona-used") == "persona: voice guest.wav"
    assert page.get_attribute("#persona-used", "title") == OTHER_ROLE
    assert page.is_disabled("#voice_prompt")
    OUT.mkdir(exist_ok=True)
    page.screenshot(path=str(OUT / f"web-persona-{transport}.png"), full_page=True)  # out/ is git-ignored
    page.click("#stop")
    page.wait_for_selector("#state[data-state=idle]")
    assert server.log.read_text().count("persona fixed: voice guest.wav") == 1 + (transport == "webrtc")
