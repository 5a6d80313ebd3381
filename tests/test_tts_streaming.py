"""`/api/tts_streaming` on a real server (`tts_server`), against moshi-server's behaviour and Unmute's client."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Annotated, Literal

import httpx2
import msgpack
import numpy as np
import pytest
import sphn
from pydantic import BaseModel, Field, TypeAdapter
from safetensors.torch import load_file
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK, InvalidStatus

from duplexd.engine.tts.words import MAIN, StreamWords

from .test_asr_e2e import FRAME, HEADERS, UNMUTE_TYPES, audio_message, speech
from .tts_server import (
    STREAMS,
    TEXT,
    VOICES,
    assert_same,
    expected,
    run,
    say,
    url,
    voice_path,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="session")
def default_voice_messages(model_folder, mimi) -> list[dict]:
    return expected(model_folder, TEXT, 1, mimi)


def test_messages_are_moshi_servers(server, default_voice_messages):
    got, code, reason = run(say(url(server, f"format=PcmMessagePack&voice={VOICES[1]}&cfg_alpha=1.5"), TEXT))
    assert (code, reason) == (1000, "all the text was said")
    assert_same(got, default_voice_messages)
    words = [m["text"] for m in got if m["type"] == "Text"]
    assert words == ["Hello", "there,", "this", "is", "a", "short", "test", "of", "the", "speech", "model's",
                     '<break time="0.30s">', "words."]  # fmt: skip
    gaps = np.diff([m["start_s"] * 12.5 for m in got if m["type"] == "Text"])
    assert (gaps < 9).sum() >= len(gaps) // 2, gaps  # the model's own NEW_WORD starts most words, not the limit


def test_an_unknown_voice_is_the_default_one_and_the_output_follows_the_input(server, default_voice_messages):
    """An unknown voice: the default voice (here Unmute's); another voice or one word changed: other messages.
    The three streams run at once."""

    async def three() -> list[list[dict]]:
        queries = ["format=PcmMessagePack&voice=expresso/nobody.wav", f"format=PcmMessagePack&voice={VOICES[0]}"]
        texts = [TEXT, TEXT, TEXT.replace("speech", "spoken")]
        said = [say(url(server, q), t) for q, t in zip([*queries, "format=PcmMessagePack"], texts, strict=True)]
        return [messages for messages, *_ in await asyncio.gather(*said)]

    unknown, other_voice, changed = run(three())
    assert_same(unknown, default_voice_messages)

    def audio(messages: list[dict]) -> np.ndarray:
        return np.concatenate([m["pcm"] for m in messages if m["type"] == "Audio"])

    for other in (other_voice, changed):
        a, b = audio(other), audio(unknown)
        assert a.shape != b.shape or not np.allclose(a, b, atol=1e-3)
    assert [m["text"] for m in changed if m["type"] == "Text"][9] == "spoken"


def test_a_voice_message_is_one_embedding(server, model_folder, mimi):
    """A `Voice` before the first text replaces the query's voice: one embedding, as moshi-server's worker takes
    it (not the `[file, file]` of a named voice)."""
    folder, _ = model_folder
    emb = load_file(str(voice_path(folder, 0)))["speaker_wavs"]
    message = msgpack.packb({"type": "Voice", "embeddings": emb.flatten().tolist(), "shape": list(emb.shape)})
    text = "Hello there, a short one."
    got = run(say(url(server, f"format=PcmMessagePack&voice={VOICES[1]}"), text, message))[0]
    assert_same(got, expected(model_folder, text, 0, mimi, twice=False))


# ------------------------------------------------------------------------------------------- Unmute's client


class UnmuteText(BaseModel):  # Unmute's `TTSTextMessage` and the others its `TTSMessage` union takes
    type: Literal["Text"]
    text: str
    start_s: float
    stop_s: float


class UnmuteAudio(BaseModel):
    type: Literal["Audio"]
    pcm: list[float]


class UnmuteError(BaseModel):
    type: Literal["Error"]
    message: str


class UnmuteReady(BaseModel):
    type: Literal["Ready"]


UNMUTE_TTS = TypeAdapter(Annotated[UnmuteText | UnmuteAudio | UnmuteError | UnmuteReady, Field(discriminator="type")])


class AtCapacity(Exception):  # Unmute's MissingServiceAtCapacity
    pass


async def unmute_tts(live, voice: str, words: list[str], pace: float = 0.03) -> tuple[list[str], int]:
    """Unmute's `TextToSpeech`: its query (format, voice, cfg_alpha), at most 10 messages for `Ready` (`Error` is
    the server at capacity), words sent as the LLM streams them, every message validated by its pydantic union,
    until the close (a 1000/1001 close ends it, any other raises). (The words told back, the samples.)"""
    async with connect(
        url(live, f"format=PcmMessagePack&voice={voice}&cfg_alpha=1.5"), additional_headers=HEADERS
    ) as ws:
        for _ in range(10):
            message = UNMUTE_TTS.validate_python(msgpack.unpackb(await ws.recv(decode=False)))
            if isinstance(message, UnmuteReady):
                break
            if isinstance(message, UnmuteError):
                raise AtCapacity(message.message)
        else:
            raise AssertionError("no Ready in 10 messages")

        async def send() -> None:
            for word in words:
                await ws.send(msgpack.packb({"type": "Text", "text": word}))
                await asyncio.sleep(pace)
            await ws.send(msgpack.packb({"type": "Eos"}))

        sender = asyncio.create_task(send())
        told, samples = [], 0
        with contextlib.suppress(ConnectionClosedOK):
            async for raw in ws:
                message = UNMUTE_TTS.validate_python(msgpack.unpackb(raw))
                if isinstance(message, UnmuteText):
                    told.append(message.text)
                elif isinstance(message, UnmuteAudio):
                    samples += len(message.pcm)
                else:
                    raise AssertionError(f"unexpected {message}")
        await sender
        return told, samples


async def unmute_stt(live, seconds: float) -> list[str]:
    """Unmute's `SpeechToText` beside it on the same server: audio at real time, its message loop; the types."""
    address = f"ws://127.0.0.1:{live.port}/api/asr-streaming"
    types = []
    async with connect(address, additional_headers=HEADERS) as ws:
        audio = speech(seconds, seed=4)

        async def talk() -> None:
            for i in range(0, len(audio), FRAME):
                await ws.send(audio_message(audio[i : i + FRAME]))
                await asyncio.sleep(0.08)
            await ws.close()

        sender = asyncio.create_task(talk())
        with contextlib.suppress(ConnectionClosed):
            async for raw in ws:
                message = msgpack.unpackb(raw)
                assert message["type"] in UNMUTE_TYPES, message
                types.append(message["type"])
        await sender
    return types


def test_unmutes_clients_speak_and_listen_on_one_server(server):
    """Unmute's text-to-speech (words at an LLM's pace, every word back once and in order, all its audio) and its
    speech-to-text (a `Step` a frame) on one duplexd at once."""
    words = "Sure, I can help with that. Here is a short answer for you.".split()

    async def both():
        return await asyncio.gather(unmute_tts(server, VOICES[0], words), unmute_stt(server, 3.0))

    (told, samples), stt_types = run(both())
    assert told == words
    assert samples > 0 and samples % 1920 == 0
    assert stt_types[0] == "Ready" and stt_types.count("Step") >= 20


def test_a_full_server_refuses_as_moshi_server_and_a_closed_stream_frees_its_slot(server):
    async def go() -> None:
        holders = [await connect(url(server), additional_headers=HEADERS) for _ in range(STREAMS)]
        try:
            for ws in holders:
                assert msgpack.unpackb(await ws.recv()) == {"type": "Ready"}
            with pytest.raises(AtCapacity, match="no free channels"):
                await unmute_tts(server, VOICES[0], ["hi"])
            async with connect(url(server), additional_headers=HEADERS) as ws:  # the refusal: Error, then the close
                assert msgpack.unpackb(await ws.recv()) == {"type": "Error", "message": "no free channels"}
                with pytest.raises(ConnectionClosed):
                    await ws.recv()
                assert ws.close_code == 1013
            await holders.pop().close()
            for _ in range(50):  # the slot is free at the service's next turn
                with contextlib.suppress(AtCapacity):
                    told, _ = await unmute_tts(server, VOICES[0], ["Hi", "again."])
                    assert told == ["Hi", "again."]
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("the closed stream's slot was not freed")
        finally:
            for ws in holders:
                await ws.close()

    run(go())


# ------------------------------------------------------------------------------------------- ends and bad input


async def ready_then(live, *sends: bytes | str, query: str = "format=PcmMessagePack") -> tuple[list, int | None, str]:
    """Open a stream, take `Ready`, send `sends`, read until the close: (messages after Ready, code, reason)."""
    async with connect(url(live, query), additional_headers=HEADERS) as ws:
        assert msgpack.unpackb(await ws.recv()) == {"type": "Ready"}
        for data in sends:
            await ws.send(data)
        messages = []
        with contextlib.suppress(ConnectionClosed):
            async for raw in ws:
                messages.append(msgpack.unpackb(raw))
        return messages, ws.close_code, ws.close_reason


@pytest.mark.parametrize(
    ("sends", "code", "reason"),
    [
        ((), 1000, "idle timeout: no message for 2 s"),
        ((msgpack.packb({"type": "Text", "text": "Waiting for the rest"}),), 1000, "idle timeout"),
        ((b"\0",), 1000, "the text was empty"),
        ((b"\xc1\x00",), 1007, "not a MessagePack message"),
        ((msgpack.packb({"type": "Speak"}),), 1007, "unknown message type 'Speak'"),
        ((msgpack.packb({"type": "Text", "text": 3}),), 1007, "`text` must be a string"),
        ((msgpack.packb({"type": "Voice", "embeddings": [0.0] * 8, "shape": [1, 8]}),), 1007, "`shape` must be"),
    ],
    ids=["silent", "no end of text", "nothing to say", "not MessagePack", "unknown type", "bad field", "bad voice"],
)
def test_after_ready_every_end_is_the_close_frame_alone(server, sends, code, reason):
    """Unmute's loop takes no `Error` after `Ready`: the close's code and reason say why, and nothing else comes."""
    messages, got_code, got_reason = run(ready_then(server, *sends))
    assert all(m["type"] in ("Audio", "Text") for m in messages), messages  # no Error
    assert got_code == code and reason in got_reason, (got_code, got_reason)


def test_the_raw_and_opus_formats(server):
    """`Pcm`: raw f32 frames and nothing else; `OggOpus`: Ogg pages (the default); `OggOpusMessagePack`: `Ready`,
    then `OggOpus` messages whose bytes are arrays, as rmp_serde writes a `Vec<u8>`. Each decodes to the frames
    `PcmMessagePack` sends for the same words."""
    text = "Hi there."

    async def raw(query: str) -> tuple[list[bytes], int | None]:
        async with connect(url(server, query), additional_headers=HEADERS) as ws:
            await ws.send(text)  # a raw text frame is text too
            await ws.send(b"\0")
            out = []
            with contextlib.suppress(ConnectionClosed):
                async for data in ws:
                    out.append(data)
            return out, ws.close_code

    async def all_formats():
        return await asyncio.gather(
            raw("format=Pcm"), raw(""), raw("format=OggOpusMessagePack"), say(url(server), text)
        )

    (pcm, c1), (ogg, c2), (packed, c3), (reference, *_) = run(all_formats())
    assert c1 == c2 == c3 == 1000
    frames = [np.asarray(m["pcm"], dtype=np.float32) for m in reference if m["type"] == "Audio"]
    assert [len(f) for f in pcm] == [1920 * 4] * len(frames)
    assert np.allclose(np.frombuffer(b"".join(pcm), "<f4"), np.concatenate(frames), atol=1e-5)  # other batches
    assert msgpack.unpackb(packed[0]) == {"type": "Ready"}
    messages = [msgpack.unpackb(m) for m in packed[1:]]
    assert {m["type"] for m in messages} == {"OggOpus", "Text"}
    pages = b"".join(bytes(m["data"]) for m in messages if m["type"] == "OggOpus")
    for stream in (b"".join(ogg), pages):
        assert stream.startswith(b"OggS")
        decoded, rate = sphn.read_opus_bytes(stream)
        assert abs(decoded.shape[-1] * 24000 / rate - 1920 * len(frames)) <= 1920  # sphn decodes at 48 kHz


def test_refused_upgrades_and_the_post_endpoint(server, default_voice_messages):
    async def refused(query: str, headers: dict) -> int:
        with pytest.raises(InvalidStatus) as e:
            async with connect(url(server, query), additional_headers=headers):
                pass
        return e.value.response.status_code

    assert run(refused("format=Pcm", {})) == 401
    assert run(refused("format=Wav", HEADERS)) == 400
    post = f"{server.url}/api/tts_streaming"
    assert httpx2.post(post, json={"text": "hi"}).status_code == 401
    assert httpx2.post(post, json={"text": "  "}, headers=HEADERS).status_code == 422
    answer = httpx2.post(post, json={"text": TEXT, "voice": "nobody"}, headers=HEADERS, timeout=120)
    assert answer.status_code == 200 and answer.headers["content-type"] == "audio/wav"
    body = answer.content
    assert body[:4] == b"RIFF" and struct.unpack("<I", body[4:8])[0] == 0xFFFFFFFF and body[36:40] == b"data"
    samples = np.frombuffer(body[44:], "<i2")
    frames = np.concatenate([m["pcm"] for m in default_voice_messages if m["type"] == "Audio"])
    want = (np.clip(frames, -1, 1) * 32767).astype(np.int32)  # POST words: one message
    assert samples.shape == want.shape and np.abs(samples.astype(np.int32) - want).max() <= 1


def test_the_module_lists(server):
    modules = httpx2.get(f"{server.url}/api/modules_info").json()
    assert [m["type"] for m in modules] == ["batched_asr", "py"]
    assert modules[1] == {"type": "py", "path": "/api/tts_streaming", "used_slots": "0", "total_slots": str(STREAMS)}
    models = httpx2.get(f"{server.url}/v1/models", headers=HEADERS).json()["data"]
    tts = next(m for m in models if m.get("task") == "text-to-speech")
    assert tts["voices"] == sorted(VOICES) and tts["default_voice"] == VOICES[1]
    assert "duplexd_tts_streams_capacity 4.0" in httpx2.get(f"{server.url}/metrics").text


def test_stream_words_are_split_as_moshi_server_splits_them():
    """moshi-server's rules (its `tts_preprocess` and worker): breaks at most 10 s and at least a step, named by a
    tag; the `/` of the tag required; normalisation; the main speaker's token before the stream's first word only;
    a word's padding one step per token (`padding_between` 1, plus its tokens beyond the first)."""

    def encode(word: str) -> list[int]:
        return [10 + len(word)] * (1 + len(word) // 4)

    words = StreamWords(encode)
    first = words.split('Hello <break time="0.5s"/> world <break time="1.0s"/>!')
    assert [(w.text, w.padding) for w in first] == [
        ("Hello", 3), ('<break time="0.50s">', 6), ("world", 2), ('<break time="1.00s">', 12), ("!", 1)
    ]  # fmt: skip
    assert first[0].tokens == (MAIN, 15, 15) and first[1].tokens == () and first[2].tokens == (15, 15)
    later = words.split('<break time="20s"/><break time="0.01s"/><break time="0s"/><break time="1.2.3s"/>x')
    assert [(w.text, w.padding) for w in later] == [
        ('<break time="20.00s">', 125),
        ('<break time="0.01s">', 1),
        ("x", 1),
    ]
    assert later[-1].tokens == (11,)  # no second BOS
    assert [w.text for w in words.split('l’été: (oui) – non <break time="1s">')] == [
        "l'été", "oui", "non", "<break", 'time="1s">'
    ]  # fmt: skip


def test_ready_reports_each_model(server):
    body = httpx2.get(f"{server.url}/ready").json()
    assert body["ready"] and [m["task"] for m in body["models"]] == ["speech-to-text", "text-to-speech"]
    assert body["models"][1]["capacity"] == STREAMS
