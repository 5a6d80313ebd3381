"""`POST /api/voice` on a real `duplexd serve`, as Unmute clones voices through moshi-server: Unmute's client as it is
(kyutai-labs/unmute, `unmute/tts/voice_cloning.py`: `requests.post(f"{VOICE_CLONING_SERVER}/api/voice",
data=audio_data, headers={"Content-Type": "application/octet-stream"})`, `raise_for_status()`, the body kept as it
came), the answer's bytes as moshi-server's rmp_serde writes them, that answer sent on to `/api/tts_streaming` first
thing, as Unmute's `TextToSpeech.start_up` sends a `custom:` voice, and every bad recording refused clearly.

The server is Unmute's whole speech side in one: the demo STT as its main model, the demo TTS (greedy, so a
voice's speech is repeatable), and voice cloning with the demo's voice Mimi (its 32-wide latent is the demo TTS's
voice) and a small random Demucs, behind Unmute's API key (`public_token`), which `/api/voice` does not ask for,
as moshi-server's.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import struct
import threading
import time

import msgpack
import numpy as np
import pytest
import requests
import soundfile as sf
import torch
import yaml
from denoiser.demucs import Demucs
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplexd.commands.cli import build_parser
from duplexd.engine.models.config import DEMO_MIMI
from duplexd.engine.models.mimi import MimiModel
from duplexd.engine.voice.maker import load_voice_maker
from duplexd.engine.voice.recording import read_recording
from duplexd.engine.weights.checkpoint import save_mimi_weights
from duplexd.engine.weights.demo import ensure_demo_stt
from duplexd.server.cli import settings_from_args

from .live_server import running_server
from .test_deploy_files import DOCKER, interpolate
from .test_tts_streaming import unmute_stt
from .test_voice_cloning import recording

HEADERS = {"kyutai-api-key": "public_token"}  # Unmute's `kyutai_constants.HEADERS`
WORDS = ["Hello", "there,", "this", "is", "my", "own", "voice."]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("voice-server")
    save_mimi_weights(MimiModel(DEMO_MIMI).init_weights_(21), root / "voice_mimi.safetensors", naming="fused")
    torch.manual_seed(22)
    torch.save(Demucs(hidden=8).state_dict(), root / "dns8.th")
    return root / "voice_mimi.safetensors", root / "dns8.th"


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    log = tmp_path_factory.mktemp("voice-server-log") / "serve.log"
    mimi, dns = files
    stt = ensure_demo_stt(tmp_path_factory.mktemp("voice-server-stt"))
    args = [
        "--moshi-weight", str(stt.lm), "--mimi-weight", str(stt.mimi), "--tokenizer", str(stt.tokenizer),
        "--config", str(stt.config), "--max-sessions", "1", "--api-key", "public_token", "--tts", "demo-tts",
        "--tts-temperature", "0", "--tts-streams", "2", "--voice-mimi", str(mimi), "--voice-denoiser", str(dns),
    ]  # fmt: skip
    with running_server(log, *args) as live:
        yield live
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


def wav_bytes(pcm: np.ndarray, rate: int, fmt: str = "WAV") -> bytes:
    out = io.BytesIO()
    sf.write(out, pcm, rate, format=fmt)
    return out.getvalue()


def post_voice(url: str, audio_data: bytes) -> requests.Response:
    """Unmute's `clone_voice` request, as it is (it then calls `raise_for_status()` and keeps `.content`)."""
    return requests.post(f"{url}/api/voice", data=audio_data, headers={"Content-Type": "application/octet-stream"})


def rmp_serde_voice(embeddings: list[float], shape: list[int]) -> bytes:
    """`OutMsg::Voice{embeddings, shape}` as moshi-server serializes it (rmp_serde, struct map): a 3-entry fixmap,
    fixstr keys in field order after the `type` tag, the f32s as float 32 (0xca), the sizes as positive fixints."""
    assert len(embeddings) < 1 << 16 and all(0 <= n < 128 for n in shape) and len(shape) < 16
    floats = b"".join(b"\xca" + struct.pack(">f", x) for x in embeddings)
    return (
        b"\x83\xa4type\xa5Voice\xaaembeddings\xdc"
        + len(embeddings).to_bytes(2, "big")
        + floats
        + b"\xa5shape"
        + bytes([0x90 | len(shape), *shape])
    )


async def unmute_speak(port: int, words: list[str], voice_embedding: bytes | None) -> np.ndarray:
    """Unmute's `TextToSpeech` (`unmute/tts/text_to_speech.py`) with a `custom:` voice: its query without `voice`
    (`format=PcmMessagePack`, `cfg_alpha=1.5`), the cached `/api/voice` answer sent as it came, at most 10 messages
    for `Ready`, a `Text` per word and `Eos`; the audio it gets until the close."""
    address = f"ws://127.0.0.1:{port}/api/tts_streaming?format=PcmMessagePack&cfg_alpha=1.5"
    async with connect(address, additional_headers=HEADERS, max_size=None) as ws:
        if voice_embedding is not None:
            await ws.send(voice_embedding)
        for _ in range(10):
            message = msgpack.unpackb(await ws.recv(decode=False))
            assert message["type"] != "Error", message
            if message["type"] == "Ready":
                break
        else:
            raise AssertionError("no Ready")
        for word in words:
            await ws.send(msgpack.packb({"type": "Text", "text": word}))
        await ws.send(msgpack.packb({"type": "Eos"}))
        pcm: list[float] = []
        with contextlib.suppress(ConnectionClosed):
            async for raw in ws:
                message = msgpack.unpackb(raw)
                if message["type"] == "Audio":
                    pcm.extend(message["pcm"])
        assert ws.close_code == 1000, (ws.close_code, ws.close_reason)
        return np.asarray(pcm, dtype=np.float32)


def speak(port: int, voice_embedding: bytes | None) -> np.ndarray:
    return asyncio.run(asyncio.wait_for(unmute_speak(port, WORDS, voice_embedding), 120))


def test_unmute_clones_a_voice_and_speaks_in_it(server, files):
    audio = wav_bytes(np.stack([recording(12.0, rate=48_000), recording(12.0, seed=9, rate=48_000)], axis=1), 48_000)
    response = post_voice(server.url, audio)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/octet-stream"
    response.raise_for_status()
    msgpack_data = response.content
    voice = msgpack.unpackb(msgpack_data)
    assert list(voice) == ["type", "embeddings", "shape"] and voice["type"] == "Voice"
    assert voice["shape"] == [1, 32, 125] and len(voice["embeddings"]) == 32 * 125
    assert msgpack_data == rmp_serde_voice(voice["embeddings"], voice["shape"])
    # the voice the engine makes of the same upload (its first channel, at 24 kHz, its first 10 s)
    want = load_voice_maker(*files).make(read_recording(io.BytesIO(audio))).numpy().reshape(-1)
    assert np.allclose(np.asarray(voice["embeddings"], dtype=np.float32), want, atol=1e-5 * float(np.abs(want).max()))
    # Unmute sends those bytes as the stream's first message: the TTS speaks in the voice, not in its default one
    default, cloned, again = (speak(server.port, v) for v in (None, msgpack_data, msgpack_data))
    assert len(cloned) >= 1920 * len(WORDS) and len(default)
    assert np.array_equal(cloned, again)  # greedy: the same voice says the same
    n = min(len(default), len(cloned))
    assert len(default) != len(cloned) or np.abs(default[:n] - cloned[:n]).max() > 1e-3


def test_unmutes_three_clients_on_one_duplexd(server):
    """Unmute's voice cloning, text to speech in the cloned voice and speech to text, at once on the one server
    (its STT the demo's, a `Step` a frame while the others run)."""
    audio = wav_bytes(recording(11.0, seed=3), 24_000)

    async def three() -> tuple[requests.Response, list[str]]:
        cloned = asyncio.to_thread(post_voice, server.url, audio)
        response, types = await asyncio.gather(cloned, unmute_stt(server, 4.0))
        return response, types

    response, stt_types = asyncio.run(asyncio.wait_for(three(), 120))
    response.raise_for_status()
    assert stt_types[0] == "Ready" and stt_types.count("Step") >= 20  # of 50 frames, while a voice was made
    said = speak(server.port, response.content)
    assert len(said) >= 1920 * len(WORDS) and float(np.abs(said).max()) > 0


def test_bad_recordings_get_a_clear_refusal(server):
    short = wav_bytes(recording(0.5), 24_000)
    silent = wav_bytes(np.zeros(24_000 * 3, np.float32), 24_000)
    broken = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(40))
    cases = [
        (b"", 400, "empty_file"),
        (b"these are words, not a recording", 400, "unsupported_format"),
        (b"\x1a\x45\xdf\xa3" + bytes(200), 400, "unsupported_format"),  # WebM: named
        (broken, 400, "invalid_audio"),
        (short, 400, "audio_too_short"),
        (silent, 400, "silent_audio"),
        (bytes(16 * 1024 * 1024 + 1), 413, "file_too_large"),
    ]
    for body, status, error in cases:
        response = post_voice(server.url, body)
        assert response.status_code == status, (error, response.text[:300])
        refusal = response.json()
        assert refusal["error"] == error and refusal["message"], refusal
        with pytest.raises(requests.HTTPError):  # what Unmute's `clone_voice` raises
            response.raise_for_status()
    assert "WebM/Matroska is not supported" in post_voice(server.url, cases[2][0]).json()["message"]
    # a short FLAC at 16 kHz: resampled, padded with silence to 10 s as moshi-server pads it, a voice
    flac = post_voice(server.url, wav_bytes(recording(3.0, rate=16_000), 16_000, "FLAC"))
    assert flac.status_code == 200 and msgpack.unpackb(flac.content)["shape"] == [1, 32, 125]
    metrics = requests.get(f"{server.url}/metrics").text
    assert 'duplexd_sessions_refused_total{reason="silent_audio"} 1.0' in metrics
    assert 'duplexd_sessions_total{protocol="voice"}' in metrics


def test_the_event_loop_answers_while_voices_are_made(server):
    """Voices are made on their own thread: the server answers other requests meanwhile."""
    audio = wav_bytes(recording(10.0), 24_000)
    answers: list[int] = []

    def clone() -> None:
        answers.append(post_voice(server.url, audio).status_code)

    started = time.perf_counter()
    clone()
    alone = time.perf_counter() - started  # one voice, the server otherwise idle
    posts = [threading.Thread(target=clone) for _ in "abc"]
    for post in posts:
        post.start()
    waits = []
    while any(post.is_alive() for post in posts):
        started = time.perf_counter()
        assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
        waits.append(time.perf_counter() - started)
        time.sleep(0.02)
    for post in posts:
        post.join()
    print(f"a voice alone: {alone:.2f} s; /health meanwhile: {len(waits)} answers, the slowest {max(waits):.3f} s")
    assert answers == [200] * 4
    assert len(waits) >= 5 and max(waits) < min(0.3 * alone, 1.0), waits


def test_moshi_servers_other_routes_as_unmute_probes_them(server):
    """Unmute's health check of its voice-cloning server is `GET /api/build_info` (200: up); moshi-server lists its
    `PyPost` modules nowhere, so `/api/modules_info` shows only the STT and the TTS."""
    assert requests.get(f"{server.url}/api/build_info", timeout=2).status_code == 200
    modules = json.loads(requests.get(f"{server.url}/api/modules_info").text)
    assert [(m["type"], m["path"]) for m in modules] == [
        ("batched_asr", "/api/asr-streaming"),
        ("py", "/api/tts_streaming"),
    ]


def test_unmutes_compose_file_points_all_three_at_one_duplexd():
    """docker/compose.unmute.yaml: Unmute's backend finds its STT, TTS and voice cloning at the one duplexd, whose
    command is settings `duplexd serve` takes, with Unmute's voice Mimi and the dns64 file mounted where it is named."""
    compose = yaml.safe_load(interpolate((DOCKER / "compose.unmute.yaml").read_text()))
    env = dict(item.split("=", 1) for item in compose["services"]["backend"]["environment"])
    assert env["KYUTAI_STT_URL"] == env["KYUTAI_TTS_URL"] == "ws://duplexd:8998"
    assert env["KYUTAI_VOICE_CLONING_URL"] == "http://duplexd:8998"  # Unmute posts to it with requests: http
    duplexd = compose["services"]["duplexd"]
    settings = settings_from_args(build_parser("serve").parse_args(["serve", *duplexd["command"]]))
    assert settings.voice_mimi == "hf://kyutai/unmute-voice-cloning/e9d43d50_500_mimi_voice.safetensors"
    assert settings.tts and settings.api_key == "public_token"
    assert any(mount.split(":")[1] == settings.voice_denoiser for mount in duplexd["volumes"])
