"""`POST /v1/audio/speech` on a real server (`tts_server`), through the official `openai` SDK, unchanged.

Every format carries the speech `/api/tts_streaming` sends for the same words (moshi's oracle, `expected`): `pcm`
and `wav` its samples as 16-bit, `flac` the same losslessly, `mp3` and `opus` a decodable stream of its length;
`sse` the same bytes in base64 deltas, then `speech.audio.done`. Refusals come in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import openai
import pytest
import soundfile as sf
import sphn

from .test_asr_e2e import KEY
from .tts_server import expected, run

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "Hi there, how are you?"


@pytest.fixture(scope="module")
def speech(model_folder, mimi) -> np.ndarray:
    """The samples the default voice says for TEXT, as `/api/tts_streaming` sends them."""
    return np.concatenate([m["pcm"] for m in expected(model_folder, TEXT, 1, mimi) if m["type"] == "Audio"])


def same_samples(data: bytes, speech: np.ndarray) -> bool:
    """16-bit samples of `speech` (to one step: the server's floats match the oracle's to 1e-5, not bit for bit)."""
    got = np.frombuffer(data, "<i2").astype(np.int32)
    want = (np.clip(speech, -1, 1) * 32767).astype(np.int32)
    return got.shape == want.shape and int(np.abs(got - want).max()) <= 1


def client(live, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0)


async def create(live, response_format: str, **extra) -> tuple[bytes, str]:
    async with client(live).audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=TEXT, response_format=response_format, **extra
    ) as response:
        chunks = [chunk async for chunk in response.iter_bytes()]
        assert response.headers["openai-model"]
        return b"".join(chunks), response.headers["content-type"]


def test_every_format_carries_the_speech(server, speech):
    async def four():
        return await asyncio.gather(*(create(server, fmt) for fmt in ("wav", "pcm", "flac", "mp3")))

    (wav, wav_type), (pcm, pcm_type), (flac, flac_type), (mp3, mp3_type) = run(four())
    assert (wav_type, pcm_type, flac_type, mp3_type) == ("audio/wav", "audio/pcm", "audio/flac", "audio/mpeg")
    assert wav[:4] == b"RIFF" and same_samples(wav[44:], speech)
    assert same_samples(pcm, speech)
    lossless, rate = sf.read(io.BytesIO(flac), dtype="float32")
    assert rate == 24000 and len(lossless) == len(speech) and np.abs(lossless - speech).max() < 2e-4
    decoded, rate = sf.read(io.BytesIO(mp3), dtype="float32")
    assert rate == 24000 and abs(len(decoded) - len(speech)) <= 2 * 1920 and float((decoded**2).mean()) > 1e-4
    opus, opus_type = run(create(server, "opus"))
    pages, rate = sphn.read_opus_bytes(opus)
    assert opus_type == "audio/ogg" and abs(pages.shape[-1] * 24000 / rate - len(speech)) <= 1920


def test_sse_sends_the_same_bytes_in_deltas(server, speech):
    async def events() -> list[dict]:
        async with client(server).audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TEXT, response_format="pcm", stream_format="sse"
        ) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in response.iter_lines()]
        return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]

    got = run(events())
    assert [e["type"] for e in got] == ["speech.audio.delta"] * (len(got) - 1) + ["speech.audio.done"]
    audio = b"".join(base64.b64decode(e["audio"]) for e in got[:-1])
    assert same_samples(audio, speech)
    usage = got[-1]["usage"]
    assert usage["input_tokens"] == len(TEXT.split()) and usage["total_tokens"] > usage["input_tokens"]


@pytest.mark.parametrize(
    ("kwargs", "status", "param", "message"),
    [
        ({"response_format": "aac"}, 400, "response_format", "no AAC encoder"),
        ({"response_format": "ogg"}, 400, "response_format", "one of mp3, opus"),
        ({"input": "   "}, 400, "input", "no words to say"),
        ({"input": "x" * 4097}, 400, "input", "at most 4096 characters"),
        ({"speed": 9.0}, 400, "speed", "less than or equal to 4"),
    ],
    ids=["aac", "unknown format", "no words", "too long", "speed"],
)
def test_refusals_in_openais_shape(server, kwargs, status, param, message):
    async def go() -> None:
        request = {"model": "tts-1", "voice": "alloy", "input": TEXT, **kwargs}
        with pytest.raises(openai.APIStatusError) as e:
            async with client(server).audio.speech.with_streaming_response.create(**request) as response:
                await response.read()
        assert e.value.status_code == status
        error = e.value.body
        assert isinstance(error, dict) and error["param"] == param and message in error["message"], error
        assert error["type"] == "invalid_request_error"

    run(go())


def test_a_wrong_key_is_refused(server):
    async def go() -> None:
        with pytest.raises(openai.AuthenticationError):
            await client(server, key="wrong").audio.speech.create(model="tts-1", voice="alloy", input=TEXT)

    run(go())
