"""`POST /v1/audio/transcriptions` on a real `duplexd serve --transcribe demo` (tiny random Gemma 4, CPU), with
real espeak-ng speech, the real Silero VAD, and `transformers` as the reference.

Parity: for each utterance the server reports, the tokens equal `Gemma4ForConditionalGeneration.generate` (greedy)
on the same 16 kHz audio: the upload decoded as the server decodes it (`audio_upload.decode`), cut where the
offline VAD (`vad.segments`) puts the utterance, from its onset less the pre-roll (never before the previous
utterance's end). The official `openai` SDK parses the answers; bad uploads get OpenAI-style 4xx errors while a
live Realtime session goes on.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re

import httpx2
import numpy as np
import pytest
import soundfile as sf
from websockets.asyncio.client import connect

openai = pytest.importorskip("openai")

from duplexd.engine.transcription.transcriber import DEFAULT_PROMPT  # noqa: E402
from duplexd.engine.transcription.vad import VAD_RATE, VadConfig, load_silero, segments  # noqa: E402
from duplexd.engine.weights.gemma4_demo import ensure_gemma4_demo  # noqa: E402
from duplexd.server.codec.upload import UploadError, decode  # noqa: E402

from .gemma4_ref import generate, load_reference, needs_transformers  # noqa: E402
from .live_server import demo_cache, running_server  # noqa: E402
from .speech import TOLERANCE, compose, needs_espeak, speak, speak_all  # noqa: E402

pytestmark = [needs_espeak, needs_transformers, pytest.mark.usefixtures("one_thread")]
KEY = "transcribe-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_NEW = 8
MAX_SECONDS = 40
SERVER_ARGS = [
    "--transcribe",
    "demo",
    "--transcribe-max-tokens",
    str(MAX_NEW),
    "--max-transcribe-seconds",
    str(MAX_SECONDS),
    "--max-upload-bytes",
    "2MiB",
    "--api-key",
    KEY,
    "--max-sessions",
    "2",
]
PREROLL = VadConfig().samples(VadConfig().preroll_s)
RATE, FRAME = 24_000, 1920


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return demo_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def hf(cache):
    return load_reference(ensure_gemma4_demo(cache))  # the folder the server's `--transcribe demo` then finds


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache, hf):
    log = tmp_path_factory.mktemp("transcribe-server") / "serve.log"
    with running_server(log, *SERVER_ARGS, env={"DUPLEXD_CACHE": str(cache)}) as live:
        yield live
    assert live.proc.returncode == 0, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return speak_all(tmp_path_factory.mktemp("espeak"))


@pytest.fixture(scope="module")
def speech(tmp_path_factory, clips):
    """Three sentences with pauses, as a 24 kHz 16-bit WAV; and where they are."""
    pcm, truth = compose([0.7, clips[0], 1.2, clips[1], 0.9, clips[2], 0.8], seed=21)
    path = tmp_path_factory.mktemp("upload") / "speech.wav"
    sf.write(path, pcm, RATE, subtype="PCM_16")
    return path, truth


@pytest.fixture(scope="module")
def silero():
    return load_silero()


def post(server, files=None, data=None, headers=None, **kw) -> httpx2.Response:
    """A request to the endpoint, with the API key unless `headers` say otherwise."""
    return httpx2.post(
        f"{server.url}/v1/audio/transcriptions",
        files=files,
        data=data,
        headers=AUTH if headers is None else headers,
        timeout=120,
        **kw,
    )


def wav_bytes(pcm: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = "PCM_16") -> bytes:
    out = io.BytesIO()
    sf.write(out, pcm, rate, format=fmt, subtype=subtype)
    return out.getvalue()


def reference(hf, silero, path, prompt: str = DEFAULT_PROMPT) -> list[tuple[float, float, list[int]]]:
    """(start, end, tokens) per utterance: the VAD on the decoded upload, `generate` from the pre-roll."""
    with open(path, "rb") as f:
        pcm = decode(f, MAX_SECONDS).pcm
    out, floor = [], 0
    for start_s, end_s in segments(pcm, VAD_RATE, model=silero):
        start, end = round(start_s * VAD_RATE), round(end_s * VAD_RATE)
        audio_start = max(start - PREROLL, floor)
        out.append((start_s, end_s, generate(hf, pcm[audio_start:end], MAX_NEW, prompt)))
        floor = end
    return out


def test_verbose_json_equals_generate_on_each_vad_span(server, hf, silero, speech):
    path, truth = speech
    with open(path, "rb") as f:
        r = post(server, files={"file": ("speech.wav", f, "audio/wav")}, data={"response_format": "verbose_json"})
    assert r.status_code == 200, r.text
    assert r.headers["openai-model"] == "gemma4-demo"
    body = r.json()
    expected = reference(hf, silero, path)
    assert len(expected) == 3 and all(abs(s - t[0]) < TOLERANCE for (s, _, _), t in zip(expected, truth, strict=True))
    got = body["segments"]
    assert [seg["tokens"] for seg in got] == [tokens for _, _, tokens in expected]
    assert all(len(seg["tokens"]) >= 3 for seg in got)  # a real transcript each, not an empty one
    assert [(seg["start"], seg["end"]) for seg in got] == [pytest.approx((s, e), abs=1e-6) for s, e, _ in expected]
    tok = hf[0].tokenizer
    assert [seg["text"] for seg in got] == [tok.decode(seg["tokens"], skip_special_tokens=True) for seg in got]
    assert body["text"] == " ".join(seg["text"].strip() for seg in got if seg["text"].strip())
    assert body["duration"] == pytest.approx(sf.info(path).duration, abs=1e-3)
    assert body["task"] == "transcribe" and [seg["id"] for seg in got] == [0, 1, 2]
    assert all(seg["temperature"] == 0.0 and seg["no_speech_prob"] == 0.0 for seg in got)
    # OpenAI's `language` and `prompt` shape the instruction, as on /v1/realtime.
    with open(path, "rb") as f:
        data = {"response_format": "verbose_json", "language": "fr", "prompt": "kites, fox"}
        shaped = post(server, files={"file": ("speech.wav", f, "audio/wav")}, data=data).json()["segments"]
    prompt = "Transcribe the following speech segment in French. Hint: kites, fox"
    assert [seg["tokens"] for seg in shaped] == [t for _, _, t in reference(hf, silero, path, prompt)]
    assert [seg["tokens"] for seg in shaped] != [seg["tokens"] for seg in got]


def test_the_openai_sdk_parses_the_answers(server, speech):
    path, _ = speech
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    with open(path, "rb") as f:
        verbose = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="verbose_json")
    assert isinstance(verbose, openai.types.audio.TranscriptionVerbose)
    assert verbose.segments and all(isinstance(s, openai.types.audio.TranscriptionSegment) for s in verbose.segments)
    assert verbose.text and verbose.duration > 9
    with open(path, "rb") as f:
        text = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="text")
    assert isinstance(text, str) and text == verbose.text + "\n"
    with open(path, "rb") as f:
        plain = client.audio.transcriptions.create(model="gpt-4o-transcribe", file=f, temperature=0.4)
    assert isinstance(plain, openai.types.audio.Transcription) and plain.text == verbose.text
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.transcriptions.create(model="whisper-1", file=("notes.txt", b"not audio at all"))
    assert refused.value.code == "unsupported_format" and "WAV" in refused.value.message
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with open(path, "rb") as f, pytest.raises(openai.AuthenticationError):
        wrong.audio.transcriptions.create(model="whisper-1", file=f)


def test_past_30_s_is_split_and_silence_is_empty(server, hf, clips, tmp_path):
    """33 s of speech without a pause (cut at 30 s by the VAD) as FLAC; silence gives no text and no segments;
    a lone short word the VAD misses is transcribed whole (a short, loud file)."""
    parts: list = [0.5]
    while sum(len(p) for p in parts if not isinstance(p, float)) < 33 * RATE:
        parts += [clips[len(parts) % 3], 0.1]
    pcm, _ = compose(parts, seed=5)
    r = post(
        server,
        files={"file": ("long.flac", wav_bytes(pcm, RATE, "FLAC", None))},
        data={"response_format": "verbose_json"},
    )
    assert r.status_code == 200, r.text
    got = r.json()["segments"]
    assert len(got) >= 2 and 25.0 < got[0]["end"] - got[0]["start"] <= 30.0  # cut at 30 s, the pre-roll included
    assert 0.0 <= got[1]["start"] - got[0]["end"] < 0.5 and got[-1]["end"] > 33.0
    assert all(seg["tokens"] for seg in got)

    silence = wav_bytes(np.zeros(3 * VAD_RATE, np.float32), VAD_RATE)
    r = post(server, files={"file": ("silence.wav", silence)}, data={"response_format": "verbose_json"})
    assert r.status_code == 200 and r.json()["text"] == "" and r.json()["segments"] == [], r.text

    word = speak("Hi", tmp_path)  # trimmed tight: Silero never calls it speech
    path = tmp_path / "hi.wav"
    sf.write(path, word, RATE, subtype="PCM_16")
    with open(path, "rb") as f:
        pcm16 = decode(f, MAX_SECONDS).pcm
    assert segments(pcm16, VAD_RATE) == []
    with open(path, "rb") as f:
        r = post(server, files={"file": ("hi.wav", f)}, data={"response_format": "verbose_json"})
    (seg,) = r.json()["segments"]
    assert seg["no_speech_prob"] == 1.0 and seg["start"] == 0.0
    assert seg["tokens"] == generate(hf, pcm16, MAX_NEW)


def _mp4() -> bytes:
    return b"\x00\x00\x00\x20ftypisom\x00\x00\x02\x00isomiso2avc1mp41" + bytes(200)


BAD = {
    # name: (files, data, headers (None: the key), status, code)
    "corrupt WAV": (
        {"file": ("a.wav", b"RIFF\x10\x00\x00\x00WAVE" + bytes(range(256)) * 4)},
        {},
        None,
        400,
        "invalid_audio",
    ),
    "text file": ({"file": ("notes.txt", b"hello, this is not audio\n" * 10)}, {}, None, 400, "unsupported_format"),
    "MP4 header": ({"file": ("a.m4a", _mp4())}, {}, None, 400, "unsupported_format"),
    "empty file": ({"file": ("a.wav", b"")}, {}, None, 400, "empty_file"),
    "no frames": ({"file": ("a.wav", wav_bytes(np.zeros(0, np.float32), VAD_RATE))}, {}, None, 400, "no_audio"),
    "over-long": (
        {"file": ("a.wav", wav_bytes(np.zeros(45 * 8000, np.float32), 8000))},
        {},
        None,
        400,
        "audio_too_long",
    ),
    "over-size": ({"file": ("a.wav", b"RIFF" + bytes(3 << 20))}, {}, None, 413, "file_too_large"),
    "missing file": (None, {"model": "whisper-1"}, None, 400, "missing_file"),
    "file as text": (None, {"file": "hello"}, None, 400, "invalid_value"),
    "bad response_format": (
        {"file": ("a.wav", wav_bytes(np.zeros(VAD_RATE, np.float32), VAD_RATE))},
        {"response_format": "diarized_json"},
        None,
        400,
        "invalid_response_format",
    ),
    "bad temperature": (
        {"file": ("a.wav", wav_bytes(np.zeros(VAD_RATE, np.float32), VAD_RATE))},
        {"temperature": "2.5"},
        None,
        400,
        "invalid_value",
    ),
    "no API key": ({"file": ("a.wav", b"RIFF")}, {}, {}, 401, "invalid_api_key"),
}


async def _session_frames(ws, frames: int) -> int:
    """Send `frames` 80 ms frames of a tone on a Realtime session; count the audio deltas that come back."""
    t = np.arange(frames * FRAME) / RATE
    pcm = (0.3 * np.sin(2 * np.pi * 330 * t) * 32767).astype("<i2")
    for i in range(frames):
        chunk = base64.b64encode(pcm[i * FRAME : (i + 1) * FRAME].tobytes()).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
    deltas = 0
    while deltas < frames - 1:
        event = json.loads(await asyncio.wait_for(ws.recv(), 30))
        deltas += event["type"] == "response.output_audio.delta"
    return deltas


def test_bad_uploads_are_refused_and_nothing_else_is_harmed(server, speech):
    path, _ = speech

    async def main() -> dict[str, httpx2.Response]:
        ws_url = server.url.replace("http", "ws", 1) + "/v1/realtime"
        async with connect(ws_url, subprotocols=["realtime"], additional_headers=AUTH) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            assert await _session_frames(ws, 5) == 4
            answers = {}
            async with httpx2.AsyncClient(timeout=60) as client:
                for name, (files, data, headers, _, _) in BAD.items():
                    answers[name] = await client.post(
                        f"{server.url}/v1/audio/transcriptions",
                        files=files,
                        data=data,
                        headers=AUTH if headers is None else headers,
                    )
                good = await client.post(
                    f"{server.url}/v1/audio/transcriptions", files={"file": path.read_bytes()}, headers=AUTH
                )
                assert good.status_code == 200 and good.json()["text"], good.text
            assert await _session_frames(ws, 5) == 4  # the session went on throughout
            return answers

    answers = asyncio.run(asyncio.wait_for(main(), 120))
    for name, (_, _, _, status, code) in BAD.items():
        r = answers[name]
        assert r.status_code == status, (name, r.status_code, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["code"] == code and error["message"], (name, error)
    assert "MP4" in answers["MP4 header"].json()["error"]["message"]
    assert "WAV, FLAC, Ogg" in answers["text file"].json()["error"]["message"]
    assert answers["bad response_format"].json()["error"]["param"] == "response_format"
    boundary = "duplexd-test"

    def chunked():  # no Content-Length: the limit is enforced while the body arrives
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF'.encode()
        for _ in range(48):
            yield bytes(1 << 16)
        yield f"\r\n--{boundary}--\r\n".encode()

    r = post(server, content=chunked(), headers={**AUTH, "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large", r.text
    with open(path, "rb") as f:  # and the server still transcribes
        r = post(server, files={"file": ("speech.wav", f)})
    assert r.status_code == 200 and r.json()["text"], r.text
    metrics = httpx2.get(f"{server.url}/metrics").text
    assert re.search(r'^duplexd_file_transcriptions_total\{outcome="unsupported_format"\} [2-9]', metrics, re.M)
    assert re.search(r'^duplexd_file_transcriptions_total\{outcome="completed"\} [1-9]', metrics, re.M)


def test_a_server_without_a_transcriber_says_so(demo_server):
    """The run's shared demo server (tests/live_server.py): no `--transcribe`."""
    r = httpx2.post(
        f"{demo_server.url}/v1/audio/transcriptions",
        files={"file": ("a.wav", wav_bytes(np.zeros(VAD_RATE, np.float32), VAD_RATE))},
        timeout=30,
    )
    models = httpx2.get(f"{demo_server.url}/v1/models", timeout=10).json()["data"]
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["code"] == "transcription_not_enabled" and "--transcribe" in error["message"]
    assert [m.get("task") for m in models] == [None]  # no transcription model listed


@pytest.mark.parametrize(
    "fmt, subtype, exact",
    [
        ("WAV", "PCM_16", True),
        ("FLAC", None, True),
        ("OGG", "VORBIS", False),
        ("OGG", "OPUS", False),
        ("MP3", None, False),
    ],
)
def test_upload_formats_decode_to_16k_mono(fmt, subtype, exact):
    if fmt not in sf.available_formats():
        pytest.skip(f"this libsndfile cannot write {fmt}")
    t = np.arange(48_000) / 48_000
    stereo = np.stack([0.3 * np.sin(2 * np.pi * 220 * t), 0.3 * np.sin(2 * np.pi * 330 * t)], 1).astype(np.float32)
    decoded = decode(io.BytesIO(wav_bytes(stereo, 48_000, fmt, subtype)), MAX_SECONDS)
    assert decoded.rate == 48_000 and decoded.channels == 2
    assert abs(len(decoded.pcm) - VAD_RATE) <= 0.05 * VAD_RATE  # lossy codecs pad a little
    if exact:
        import soxr

        mono = soxr.resample(stereo.mean(axis=1), 48_000, VAD_RATE)
        np.testing.assert_allclose(decoded.pcm, mono, atol=2e-3)
    with pytest.raises(UploadError, match="longer than"):
        decode(io.BytesIO(wav_bytes(stereo, 48_000, fmt, subtype)), 0.5)


def test_the_cli_prints_what_the_server_answers(server, speech, cache, capsys):
    """`duplexd transcribe --format verbose_json` takes the same path: the same segments, token for token."""
    from duplexd.commands import cli

    path, _ = speech
    argv = ["transcribe", str(path), "--model", str(ensure_gemma4_demo(cache)), "--max-new-tokens", str(MAX_NEW)]
    assert cli.main([*argv, "--format", "verbose_json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    with open(path, "rb") as f:
        served = post(server, files={"file": f}, data={"response_format": "verbose_json"}).json()
    assert printed["segments"] == served["segments"] and printed["text"] == served["text"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == served["text"] + "\n"
