"""End to end: `/api/asr-streaming` of a real `duplexd serve` (the demo STT model, CPU, 3 slots) on a free port.

The clients are Kyutai's own, their message flow transliterated: DSM's `stt_from_file_rust_server.py` (1 s of
silence, the file paced at `rtf`, 5 s of silence, `Marker`, 35 s of silence, stop at the marker's echo) at real
time and as fast as possible, and the shape Unmute's `SpeechToText` validates (`Ready` first, a `Step` per frame
with four probabilities). What the server says is checked against the same model run here, one frame at a time,
its text tokens turned into words by the transliteration of moshi-server's rules (`test_asr_words.RustAsr`): every
word, time, pause probability and the marker's step.

The demo STT's random text head hardly ever writes padding or a word start, so it would never complete a word: the
served copy has the head's rows for those two tokens redrawn larger (`words_model`), and its text has words. The
served folder is laid out as Kyutai's STT repos are (their file names, which config.json names) and given to
`--hf-repo` alone, as `--hf-repo kyutai/stt-1b-en_fr` would be: no `--mimi-preset` either.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
import msgpack
import numpy as np
import openai
import pytest
import soundfile as sf
import sphn
import torch
from openai.types import realtime as rt
from openai.types.realtime.realtime_server_event import ConversationItemRetrieved
from pydantic import BaseModel
from safetensors.torch import load_file, save_file
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from duplexd import wire
from duplexd.engine.dialogue.pipeline import Pipeline
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.models.config import MIMI_PRESETS
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.weights.checkpoint import load_lm, load_mimi
from duplexd.engine.weights.demo import DemoFiles, ensure_demo_stt
from duplexd.server.codec.streams import OggOpusDecoder

from .live_server import running_server
from .test_asr_words import RustAsr

RATE, FRAME = 24000, 1920
KEY = "public_token"
HEADERS = {"kyutai-api-key": KEY}
DELAY = 6  # the demo STT's config: 0.5 s, as stt-1b
SLOTS = 3
IDLE = 3.0  # --asr-idle-timeout, moshi-server's 120 s made short
MAX_MESSAGE = 256 << 10
KYUTAI_MIMI, KYUTAI_TOKENIZER = "mimi-pytorch-e351c8d8@125.safetensors", "tokenizer_en_fr_audio_8000.model"


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True, use_single_float=True)


def audio_message(pcm) -> bytes:
    return pack({"type": "Audio", "pcm": [float(x) for x in pcm]})


def words_model(root: Path) -> DemoFiles:
    """The demo STT in `root`, as Kyutai's STT repos lay it out (their file names, named by config.json), its text
    head's rows for word start (0) and padding (3) redrawn 4x the mean norm."""
    demo = ensure_demo_stt(root / "cache")
    folder = root / "stt"
    folder.mkdir()
    files = DemoFiles(
        folder, folder / "model.safetensors", folder / KYUTAI_MIMI, folder / "config.json", folder / KYUTAI_TOKENIZER,
        demo.mimi_preset,
    )  # fmt: skip
    shutil.copy(demo.mimi, files.mimi)
    shutil.copy(demo.tokenizer, files.tokenizer)
    config = json.loads(demo.config.read_text())
    config.update(mimi_name=KYUTAI_MIMI, tokenizer_name=KYUTAI_TOKENIZER)
    files.config.write_text(json.dumps(config))
    weights = load_file(demo.lm)
    head = weights["text_linear.weight"]
    gen = torch.Generator().manual_seed(0)
    for token in (0, 3):
        row = torch.randn(head.shape[1], generator=gen)
        head[token] = row / row.norm() * head.norm(dim=1).mean() * 4
    save_file(weights, files.lm)
    return files


@dataclass
class Expected:
    words: list[dict]  # Word and EndWord, as the server sends them
    pause: list[list[float]]  # per step


class Reference:
    """The served model, here: one stream stepped frame by frame, its tokens read by moshi-server's rules."""

    def __init__(self, files: DemoFiles) -> None:
        self.lm = load_lm(files.lm, files.config)
        self.mimi = load_mimi(files.mimi, MIMI_PRESETS[files.mimi_preset])
        self.tokenizer = TextTokenizer(files.tokenizer)

    def run(self, pcm: np.ndarray, steps: int) -> Expected:
        pipeline = Pipeline(self.lm, self.mimi, num_slots=1)
        pipeline.reset(0, SamplingParams(text_temperature=0.0))
        pcm = np.concatenate([pcm, np.zeros(max(0, steps * FRAME - len(pcm)), np.float32)])
        rust = RustAsr(1, DELAY)
        words, pause = [], []
        for step in range(steps):
            out = pipeline.step([0], pcm[None, step * FRAME : (step + 1) * FRAME])
            pause.append([float(p) for p in out.pause[0]])
            for _, message in rust.step([int(out.tokens[0, 0])], [True]):
                if message[0] == "Word":
                    words.append({"type": "Word", "text": self.tokenizer.decode(message[1]), "start_time": message[2]})
                else:
                    words.append({"type": "EndWord", "stop_time": message[1]})
        return Expected(words, pause)


@dataclass
class Server:
    port: int
    log: Path

    def ws(self, query: str = "") -> str:
        return f"ws://127.0.0.1:{self.port}/api/asr-streaming{query}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def stt_files(tmp_path_factory) -> DemoFiles:
    return words_model(tmp_path_factory.mktemp("asr"))


@pytest.fixture(scope="module")
def reference(stt_files) -> Reference:
    return Reference(stt_files)


@pytest.fixture(scope="module")
def server(stt_files, tmp_path_factory):
    log = tmp_path_factory.mktemp("asr-server") / "serve.log"
    args = [
        "--hf-repo", str(stt_files.root),  # the files its config.json names; Mimi's preset from them (demo-32)
        "--max-sessions", str(SLOTS), "--api-key", KEY, "--asr-idle-timeout", str(IDLE),
        "--max-message-bytes", str(MAX_MESSAGE), "--ws-ping-interval", "1", "--ws-ping-timeout", "2",
    ]  # fmt: skip
    with running_server(log, *args) as live:
        yield Server(live.port, log)
    assert live.proc.returncode == 0, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


def used_slots(server: Server) -> int:
    return int(httpx2.get(server.http + "/api/modules_info", timeout=5).json()[0]["used_slots"])


def admissible(server: Server) -> int:
    return int(httpx2.get(server.http + "/ready", timeout=5).json()["admissible_sessions"])


def wait_idle(server: Server) -> None:
    """The previous test's streams have all ended and their slots are back: none used, and every one admissible
    again (a closed session's slot is freed by the engine's loop a moment after it stops counting as used)."""
    deadline = time.monotonic() + 10
    while used_slots(server) or admissible(server) < SLOTS:
        assert time.monotonic() < deadline, "slots still taken"
        time.sleep(0.05)


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def speech(seconds: float, seed: int = 0) -> np.ndarray:
    """Something for the model to hear: tones gliding under noise."""
    t = np.arange(int(seconds * RATE)) / RATE
    rng = np.random.default_rng(seed)
    return (0.3 * np.sin(2 * np.pi * (200 + 150 * t) * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


# --------------------------------------------------------------------------------------------- Kyutai's clients


async def dsm_file_client(url: str, audio: np.ndarray, rtf: float) -> tuple[list[dict], np.ndarray]:
    """DSM's stt_from_file_rust_server.py: every message received until the marker's echo (included), and the
    audio sent before the marker."""
    sent: list[np.ndarray] = []

    async def send_audio(pcm) -> None:
        sent.append(np.asarray(pcm, np.float32))
        await ws.send(audio_message(pcm))

    async def send_messages() -> None:
        await send_audio([0.0] * RATE)
        start = time.time()
        for i in range(0, len(audio), FRAME):
            await send_audio(audio[i : i + FRAME])
            expected = start + (i + 1) / RATE / rtf
            await asyncio.sleep(max(expected - time.time(), 0.001))
        for _ in range(5):
            await send_audio([0.0] * RATE)
        before_marker.extend(sent)
        await ws.send(pack({"type": "Marker", "id": 0}))
        for _ in range(35):
            await ws.send(audio_message([0.0] * RATE))

    async def receive_messages() -> list[dict]:
        received = []
        async for message in ws:
            data = msgpack.unpackb(message, raw=False)
            received.append(data)
            if data["type"] == "Marker":
                break
        return received

    before_marker: list[np.ndarray] = []
    async with connect(url, additional_headers=HEADERS, max_size=None) as ws:
        _, received = await asyncio.gather(send_messages(), receive_messages())
    return received, np.concatenate(before_marker)


@pytest.mark.parametrize("rtf", [1.01, 1000.0], ids=["real-time", "as-fast-as-possible"])
def test_dsm_file_client(server, reference, rtf):
    audio = speech(1.5)
    received, before_marker = run(dsm_file_client(server.ws(), audio, rtf))
    assert received[0] == {"type": "Ready"}
    steps = [m for m in received if m["type"] == "Step"]
    assert received[-1] == {"type": "Marker", "id": 0}
    # the marker comes back once every whole frame sent before it has been stepped, plus the delay
    assert len(steps) == len(before_marker) // FRAME + DELAY
    assert [s["step_idx"] for s in steps] == list(range(len(steps)))
    expected = reference.run(before_marker, len(steps))
    words = [m for m in received if m["type"] in ("Word", "EndWord")]
    assert words == expected.words
    assert sum(m["type"] == "Word" for m in words) >= 3, "the model should write words"
    np.testing.assert_allclose([s["prs"] for s in steps], expected.pause, atol=1e-4)
    assert all(s["buffered_pcm"] >= 0 for s in steps)
    # order: each step's Step comes before its words
    assert received[1]["type"] == "Step"


def test_ogg_opus_is_heard_as_its_decoded_audio(server, reference):
    """`OggOpus` messages, as sphn (Kyutai's clients) writes the stream, in 80 ms pieces: the words and pause
    probabilities are those of the decoded audio sent as samples."""
    wait_idle(server)
    audio = np.concatenate([speech(2.0, seed=7), np.zeros(RATE, np.float32)])
    writer = sphn.OpusStreamWriter(RATE)
    pages = [page for i in range(0, len(audio), FRAME) if (page := writer.append_pcm(audio[i : i + FRAME]))]
    decoder = OggOpusDecoder(RATE)
    heard = np.concatenate([decoder.decode(page) for page in pages])

    async def main() -> list[dict]:
        async with connect(server.ws(), additional_headers=HEADERS) as ws:
            assert msgpack.unpackb(await ws.recv()) == {"type": "Ready"}
            for page in pages:
                await ws.send(pack({"type": "OggOpus", "data": page}))
            await ws.send(pack({"type": "Marker", "id": 7}))
            silence = writer.append_pcm(np.zeros(RATE * 2, np.float32))
            await ws.send(pack({"type": "OggOpus", "data": silence}))
            received = []
            while not received or received[-1]["type"] != "Marker":
                received.append(msgpack.unpackb(await asyncio.wait_for(ws.recv(), 30)))
            return received

    received = run(main())
    steps = [m for m in received if m["type"] == "Step"]
    assert len(steps) == len(heard) // FRAME + DELAY and received[-1] == {"type": "Marker", "id": 7}
    expected = reference.run(heard, len(steps))
    assert [m for m in received if m["type"] in ("Word", "EndWord")] == expected.words
    assert sum(m["type"] == "Word" for m in expected.words) >= 3, "the model should write words"
    np.testing.assert_allclose([s["prs"] for s in steps], expected.pause, atol=1e-4)


def test_a_silent_stream_is_closed_after_the_idle_timeout(server):
    """moshi-server's idle rule, its 120 s made `IDLE` here: a stream with no message is closed (1000, by the close
    frame alone: Unmute's client reads it without an unknown message); another, talking, goes on being answered."""
    wait_idle(server)

    async def main() -> tuple[float, tuple[int | None, str], int, int]:
        async with (
            connect(server.ws(), additional_headers=HEADERS) as silent,
            connect(server.ws(), additional_headers=HEADERS) as talking,
        ):
            await talking.recv()
            started = time.monotonic()
            steps: list[int] = []
            tasks = [asyncio.create_task(keep_talking(talking)), asyncio.create_task(listen(talking, steps))]
            closed = await unmute_until_closed(silent)
            waited = time.monotonic() - started
            at_close = len(steps)
            await asyncio.sleep(1.0)
            for task in tasks:
                task.cancel()
            return waited, closed, at_close, len(steps)

    async def keep_talking(ws) -> None:
        while True:
            await ws.send(audio_message(np.zeros(FRAME)))
            await asyncio.sleep(0.08)

    async def listen(ws, steps: list[int]) -> None:
        async for message in ws:
            if msgpack.unpackb(message)["type"] == "Step":
                steps.append(1)

    waited, closed, at_close, at_end = run(main())
    assert IDLE - 0.5 <= waited <= IDLE + 3
    assert closed[0] == 1000 and "idle timeout" in closed[1], closed
    assert at_close >= 20 and at_end >= at_close + 8  # answered all along, and still a second later


class STTWordMessage(BaseModel):
    type: str
    text: str
    start_time: float


class STTEndWordMessage(BaseModel):
    type: str
    stop_time: float


class STTStepMessage(BaseModel):
    type: str
    step_idx: int
    prs: list[float]


def test_unmute_shape(server):
    """Unmute's SpeechToText: Ready first (else it reports the service at capacity), then a Step for every frame
    sent (its clock), each with the four pause heads it reads prs[2] of, and words it validates."""

    audio = speech(2.0, seed=1)
    frames = len(audio) // FRAME

    async def go() -> tuple[dict, list[dict]]:
        async with connect(server.ws(), additional_headers=HEADERS) as ws:
            first = msgpack.unpackb(await ws.recv())
            for i in range(frames):  # one frame per message, as Unmute sends its 80 ms blocks
                await ws.send(msgpack.packb({"type": "Audio", "pcm": audio[i * FRAME : (i + 1) * FRAME].tolist()},
                                            use_bin_type=True, use_single_float=True))  # fmt: skip
            got = []
            while sum(m["type"] == "Step" for m in got) < frames:
                got.append(msgpack.unpackb(await ws.recv()))
            return first, got

    first, got = run(go())
    assert first == {"type": "Ready"}
    for message in got:
        if message["type"] == "Step":
            step = STTStepMessage.model_validate(message)
            assert len(step.prs) == 4 and all(0.0 <= p <= 1.0 for p in step.prs)
        elif message["type"] == "Word":
            STTWordMessage.model_validate(message)
        else:
            STTEndWordMessage.model_validate(message)
    assert [m["step_idx"] for m in got if m["type"] == "Step"] == list(range(frames))


# --------------------------------------------------------------------------------------------- refusals


async def expect_close(url: str, send, says: str, code: int, headers=HEADERS) -> None:
    """After `Ready`, a bad message ends the stream with the close frame alone (no `Error`: Unmute's client would
    fail on it), its reason saying why."""
    async with connect(url, additional_headers=headers, max_size=None) as ws:
        assert msgpack.unpackb(await ws.recv()) == {"type": "Ready"}
        await send(ws)
        closed, reason = await unmute_until_closed(ws)
        assert closed == code and says in reason, (closed, reason)


UNMUTE_TYPES = ("Ready", "Word", "EndWord", "Step", "Marker")


async def unmute_until_closed(ws) -> tuple[int | None, str]:
    """Unmute's `SpeechToText` message loop: every message must be one of the types it knows (it raises
    `ValueError("Unknown message: ...")` on any other, which its handler does not catch); returns the server's
    close code and reason, the only end Unmute's handler expects (the loop ends on 1000 and 1001, raises
    `ConnectionClosed` on the others)."""
    with contextlib.suppress(ConnectionClosed):
        async for raw in ws:
            message = msgpack.unpackb(raw)
            if message.get("type") not in UNMUTE_TYPES:
                raise ValueError(f"Unknown message: {message}")
    return ws.close_code, ws.close_reason


BAD = {
    "not MessagePack": (lambda ws: ws.send(b"\xc1\x00"), "not a MessagePack message", 1007),
    "unknown type": (lambda ws: ws.send(pack({"type": "Transcribe"})), "unknown message type", 1007),
    "wrong field type": (lambda ws: ws.send(pack({"type": "Audio", "pcm": "loud"})), "`pcm` must be", 1007),
    "marker id": (lambda ws: ws.send(pack({"type": "Marker", "id": "end"})), "`id` must be", 1007),
    "huge": (lambda ws: ws.send(audio_message(np.zeros(MAX_MESSAGE // 4))), "over the limit", 1009),
    "text frame": (lambda ws: ws.send('{"type": "Audio"}'), "text frames are not part", 1003),
    "bad Ogg": (lambda ws: ws.send(pack({"type": "OggOpus", "data": b"RIFF" * 64})), "Ogg", 1007),
}


def test_bad_input_while_another_stream_runs(server):
    """Each bad message: a close whose code and reason say why, and nothing else; the healthy stream beside them
    never stops."""

    async def go() -> list[int]:
        async with connect(server.ws(), additional_headers=HEADERS) as healthy:
            assert msgpack.unpackb(await healthy.recv()) == {"type": "Ready"}
            steps = 0

            async def talk() -> None:
                audio = speech(30.0, seed=2)
                for i in range(0, len(audio), FRAME):
                    await healthy.send(audio_message(audio[i : i + FRAME]))
                    await asyncio.sleep(0.02)

            async def listen() -> None:
                nonlocal steps
                async for message in healthy:
                    steps += msgpack.unpackb(message)["type"] == "Step"

            tasks = [asyncio.create_task(talk()), asyncio.create_task(listen())]
            counts = []
            for send, says, code in BAD.values():
                await expect_close(server.ws(), send, says, code)
                mark, deadline = steps, time.monotonic() + 10
                while steps < mark + 3 and time.monotonic() < deadline:  # the healthy stream goes on
                    await asyncio.sleep(0.01)
                counts.append(steps - mark)
            for task in tasks:
                task.cancel()
            return counts

    counts = run(go())
    assert all(count >= 3 for count in counts), counts


def test_capacity_then_a_slot_back(server):
    wait_idle(server)

    async def go() -> None:
        streams = [await connect(server.ws(), additional_headers=HEADERS) for _ in range(SLOTS)]
        try:
            for ws in streams:
                assert msgpack.unpackb(await ws.recv()) == {"type": "Ready"}
            async with connect(server.ws(), additional_headers=HEADERS) as refused:
                assert msgpack.unpackb(await refused.recv()) == {"type": "Error", "message": "no free channels"}
                with pytest.raises(ConnectionClosed):
                    await refused.recv()
            assert used_slots(server) == SLOTS
        finally:
            for ws in streams:
                await ws.close()
        await asyncio.to_thread(wait_idle, server)  # the slots come back as the sessions end
        async with connect(server.ws(), additional_headers=HEADERS) as again:
            assert msgpack.unpackb(await again.recv()) == {"type": "Ready"}

    run(go())


def test_api_key(server):
    async def go() -> None:
        for url, headers in (
            (server.ws(), {}),
            (server.ws("?auth_id=wrong"), {}),
            (server.ws(), {"kyutai-api-key": "no"}),
        ):
            with pytest.raises(InvalidStatus) as refused:
                async with connect(url, additional_headers=headers):
                    pass
            assert refused.value.response.status_code == 401
        async with connect(server.ws(f"?auth_id={KEY}")) as ws:  # browsers cannot set headers: the query
            assert msgpack.unpackb(await ws.recv()) == {"type": "Ready"}

    run(go())
    assert httpx2.post(server.http + "/api/asr-streaming", content=b"RIFF", timeout=10).status_code == 401


# --------------------------------------------------------------------------------------------- plain HTTP


def test_post_file(server, reference):
    """POST a WAV: the words moshi-server would answer, the file followed by the marker and 10 s of silence."""
    audio = speech(2.0, seed=3)
    body = io.BytesIO()
    sf.write(body, audio, RATE, format="WAV", subtype="FLOAT")
    answer = httpx2.post(server.http + "/api/asr-streaming", content=body.getvalue(), headers=HEADERS, timeout=60)
    assert answer.status_code == 200, answer.text
    expected = reference.run(audio, len(audio) // FRAME + DELAY)
    assert answer.json() == expected.words and expected.words
    bad = httpx2.post(server.http + "/api/asr-streaming", content=b"not audio at all", headers=HEADERS, timeout=10)
    assert bad.status_code == 400 and "unsupported audio format" in bad.json()["message"]


def test_build_and_modules_info(server):
    info = httpx2.get(server.http + "/api/build_info", timeout=5).json()
    rust_fields = ("build_timestamp", "build_date", "git_branch", "git_timestamp", "git_date", "git_hash",
                   "git_describe", "rustc_host_triple", "rustc_version", "cargo_target_triple")  # fmt: skip
    assert all(isinstance(info[field], str) for field in rust_fields)
    modules = httpx2.get(server.http + "/api/modules_info", timeout=5).json()
    assert len(modules) == 1 and modules[0]["type"] == "batched_asr" and modules[0]["path"] == "/api/asr-streaming"
    assert modules[0]["total_slots"] == str(SLOTS) and modules[0]["used_slots"].isdigit()
    models = httpx2.get(server.http + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).json()
    assert models["data"][0]["protocols"] == ["/api/asr-streaming", "/v1/realtime?intent=transcription"]


def test_conversation_endpoints_say_this_model_only_transcribes(server):
    """A Moshi client (Kyutai protocol) or a Realtime client pointed at an STT server is told, in its own protocol,
    where to stream instead; the server goes on serving ASR streams."""

    async def go() -> tuple[bytes, str, int, int]:
        base = server.ws().split("/api/")[0]
        async with connect(f"{base}/api/chat?auth_id={KEY}") as ws:
            kyutai = await ws.recv()
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            kyutai_code = closed.value.rcvd.code
        async with connect(f"{base}/v1/realtime?auth_id={KEY}") as ws:
            event = await ws.recv()
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            realtime_code = closed.value.rcvd.code
        async with connect(server.ws(f"?auth_id={KEY}")) as ws:
            assert msgpack.unpackb(await ws.recv()) == {"type": "Ready"}
        return kyutai, event, kyutai_code, realtime_code

    kyutai, event, kyutai_code, realtime_code = run(go())
    assert kyutai[0] == 5 and b"/api/asr-streaming" in kyutai  # the Kyutai protocol's error kind
    assert '"model_not_conversational"' in event and "/api/asr-streaming" in event
    assert kyutai_code == realtime_code == 1008


# ----------------------------------------------------------------------- OpenAI Realtime transcription sessions
# `/v1/realtime?intent=transcription` on the same server. The official `openai` SDK (GA dialect, no turn
# detection) appends a clip as fast as it can, commits and gets the transcript without sending more audio (the
# server's flush): exactly the reference's words of that audio, and other audio gives other words. A beta client
# (header `OpenAI-Beta: realtime=v1`, `transcription_session.update`) with server VAD at threshold 0 gets
# utterances ended by the pause heads wherever its words pause; at threshold 1 none ends, and its commit ends one
# with every word. Bad events get the protocol's errors, and the session goes on.

BETA = {"OpenAI-Beta": "realtime=v1", "Authorization": f"Bearer {KEY}"}


def b64(pcm: np.ndarray) -> str:
    return base64.b64encode(wire.pcm16(pcm).tobytes()).decode()


def expected_words(reference, pcm: np.ndarray, extra_steps: int) -> list[tuple[str, float]]:
    """The reference's words (text, start) for `pcm` as pcm16 carries it, then silence, over its frames and
    `extra_steps` more."""
    steps = math.ceil(len(pcm) / FRAME) + extra_steps
    heard = wire.pcm_from_pcm16(wire.pcm16(pcm).tobytes())
    return [(w["text"], w["start_time"]) for w in reference.run(heard, steps).words if w["type"] == "Word"]


def test_openai_sdk_commit_gets_the_words_of_the_audio(server, reference):
    wait_idle(server)
    pcm = speech(2.5, seed=3)
    at = len(pcm) / RATE
    words = [text for text, start in expected_words(reference, pcm, DELAY + 1) if start < at]
    assert words, "the reference has no words for this audio: the test would prove nothing"

    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.http}/v1", api_key=KEY)
        async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
            created = await conn.recv()
            assert isinstance(created, rt.SessionCreatedEvent), created
            assert created.session.type == "transcription"
            await conn.session.update(session={"type": "transcription", "audio": {"input": {"turn_detection": None}}})
            updated = await conn.recv()
            assert isinstance(updated, rt.SessionUpdatedEvent), updated
            assert updated.session.audio.input.turn_detection is None
            for i in range(0, len(pcm), 2400):
                await conn.input_audio_buffer.append(audio=b64(pcm[i : i + 2400]))
            await conn.input_audio_buffer.commit()
            events = []
            while not isinstance(events[-1:] and events[-1], rt.ConversationItemInputAudioTranscriptionCompletedEvent):
                events.append(await asyncio.wait_for(conn.recv(), 30))
            await conn.conversation.item.retrieve(item_id=events[-1].item_id)
            retrieved = await asyncio.wait_for(conn.recv(), 30)
            return events, retrieved

    events, retrieved = run(main())
    committed = [e for e in events if isinstance(e, rt.InputAudioBufferCommittedEvent)]
    deltas = [e for e in events if isinstance(e, rt.ConversationItemInputAudioTranscriptionDeltaEvent)]
    completed = events[-1]
    assert len(committed) == 1 and committed[0].item_id == completed.item_id
    assert not [e for e in events if isinstance(e, rt.InputAudioBufferSpeechStartedEvent)]  # no turn detection
    assert completed.transcript == " ".join(words)
    assert "".join(d.delta for d in deltas if d.item_id == completed.item_id) == completed.transcript
    assert isinstance(retrieved, ConversationItemRetrieved), retrieved  # the item, with its whole transcript
    assert retrieved.item.id == completed.item_id and retrieved.item.content[0].transcript == completed.transcript
    other = [text for text, start in expected_words(reference, speech(2.5, seed=4), DELAY + 1) if start < at]
    assert other != words  # other audio, other words: the transcript is the audio's


async def beta_session(url: str, threshold: float, pcm: np.ndarray, deltas: int) -> list[dict]:
    """A beta client: server VAD with the 2 s pause head at `threshold`; appends `pcm`, waits for `deltas` words,
    commits, and returns every event until the commit's utterance completes, the session's first event first."""
    async with connect(url, additional_headers=BETA) as ws:
        events = [json.loads(await ws.recv())]

        async def until(done) -> None:
            while not done():
                events.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))

        detection = {"type": "server_vad", "threshold": threshold, "silence_duration_ms": 2000, "prefix_padding_ms": 0}
        await ws.send(json.dumps({"type": "transcription_session.update", "session": {"turn_detection": detection}}))
        await until(lambda: len(events) == 2)
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(pcm)}))
        await until(lambda: len(of(events, "transcription.delta")) == deltas)
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await until(lambda: len(of(events, "committed")) == 1 + len(of(events, "speech_stopped")))
        last = of(events, "committed")[-1]["item_id"]
        await until(lambda: any(e["item_id"] == last for e in of(events, "transcription.completed")))
        return events


def of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["type"].endswith(kind)]


def test_beta_client_server_vad_by_the_pause_heads(server, reference):
    wait_idle(server)
    pcm = np.concatenate([speech(2.0, seed=5), np.zeros(RATE, np.float32)])
    at = len(pcm) / RATE
    before = expected_words(reference, pcm, 0)  # the words out before the commit's flush
    words = [text for text, start in expected_words(reference, pcm, DELAY + 1) if start < at]
    assert len(words) >= 2
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?intent=transcription"

    every_word = run(beta_session(url, 0.0, pcm, len(before)))
    assert every_word[0]["type"] == "transcription_session.created"
    assert every_word[0]["session"]["turn_detection"]["type"] == "server_vad"
    assert every_word[1]["type"] == "transcription_session.updated"
    assert every_word[1]["session"]["turn_detection"]["threshold"] == 0.0
    started, stopped = of(every_word, "speech_started"), of(every_word, "speech_stopped")
    completed = of(every_word, "transcription.completed")
    # any pause probability is above 0: an utterance ends wherever no word is under way after one (a word that
    # runs straight into the next does not end it); the commit ends the last
    assert len(stopped) >= 2
    assert " ".join(c["transcript"] for c in completed if c["transcript"]) == " ".join(words)
    assert [s["item_id"] for s in started] == [s["item_id"] for s in stopped]
    assert [c["item_id"] for c in completed][: len(stopped)] == [s["item_id"] for s in stopped]
    for event in started:
        order = [e["type"] for e in every_word if e.get("item_id", e.get("item", {}).get("id")) == event["item_id"]]
        assert order[:2] == ["input_audio_buffer.speech_started", "conversation.item.input_audio_transcription.delta"]
        assert order[-5:] == ["input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
                              "conversation.item.added", "conversation.item.done",
                              "conversation.item.input_audio_transcription.completed"]  # fmt: skip
    assert all(s["audio_start_ms"] <= t["audio_end_ms"] for s, t in zip(started, stopped, strict=True))

    never = run(beta_session(url, 1.0, pcm, len(before)))
    assert not of(never, "speech_stopped")  # no probability is above 1: only the commit ends the utterance
    assert [c["transcript"] for c in of(never, "transcription.completed")] == [" ".join(words)]


def test_bad_events_get_the_protocols_errors(server):
    wait_idle(server)
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?intent=transcription"

    async def main() -> tuple[list[dict], int]:
        async with connect(url, additional_headers=BETA) as ws:
            await ws.recv()
            for event in (
                {"type": "input_audio_buffer.commit", "event_id": "e1"},  # nothing appended yet
                {"type": "response.create", "event_id": "e2"},
                {"type": "session.update", "event_id": "e3", "session": {"type": "realtime"}},
                {
                    "type": "transcription_session.update",
                    "event_id": "e4",
                    "session": {"turn_detection": {"type": "server_vad", "threshold": 2}},
                },  # fmt: skip
            ):
                await ws.send(json.dumps(event))
            errors = [json.loads(await ws.recv()) for _ in range(4)]
            await ws.send(json.dumps({"type": "no.such.event"}))
            closing = json.loads(await ws.recv())
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            return [*errors, closing], closed.value.rcvd.code

    errors, code = run(main())
    assert [(e["error"]["code"], e["error"]["event_id"]) for e in errors[:4]] == [
        ("input_audio_buffer_commit_empty", "e1"),
        ("unsupported_event", "e2"),
        ("invalid_value", "e3"),
        ("invalid_value", "e4"),
    ]
    assert errors[2]["error"]["param"] == "session.type"
    assert "threshold" in errors[3]["error"]["message"]
    assert errors[4]["error"]["code"] == "unknown_event" and code == 1002
