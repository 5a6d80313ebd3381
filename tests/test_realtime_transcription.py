"""Transcription of the user's speech on `/v1/realtime`, end to end: a real `duplexd serve --transcribe demo`
(the tiny random Gemma 4, the real Silero VAD) on a real port, real espeak-ng speech, and the official `openai`
SDK's realtime client parsing every event into its typed classes.

Parity: each completed transcript equals the `transformers` reference (`generate`, greedy) on the span a VAD of
the test's own finds in the same audio, decoded as the server decodes (`Transcriber.text`). The server is started
with `--transcribe-max-tokens` = the reference's `max_new`, so both stop at the same length.

Audio goes at real time (the SDK test) or twice that (the others; the transcription stream holds 4 s), so the
transcriber keeps up on two cores and no frame is dropped.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("websockets")

from openai.types import realtime as rt  # noqa: E402
from openai.types.realtime.conversation_item_input_audio_transcription_completed_event import (  # noqa: E402
    UsageTranscriptTextUsageDuration,
)
from websockets.asyncio.client import connect  # noqa: E402

from duplexd import wire  # noqa: E402
from duplexd.engine.transcription.transcriber import DEFAULT_PROMPT, Transcriber  # noqa: E402
from duplexd.engine.transcription.vad import load_silero  # noqa: E402
from duplexd.engine.weights.gemma4_demo import ensure_gemma4_demo  # noqa: E402
from duplexd.wire import FRAME_SIZE, SAMPLE_RATE, split_frames  # noqa: E402

from .gemma4_ref import generate, load_reference, needs_transformers  # noqa: E402
from .live_server import demo_cache, running_server, running_side_by_side  # noqa: E402
from .speech import TOLERANCE, compose, needs_espeak, speak_all  # noqa: E402
from .test_transcription import reference_stops  # noqa: E402

pytestmark = [needs_espeak, needs_transformers]
MAX_NEW = 12
FRAME_S = FRAME_SIZE / SAMPLE_RATE
TRANSCRIBER = "gemma4-demo"  # the model id the server gives its demo transcriber
ITEM_EVENTS = (
    rt.InputAudioBufferSpeechStartedEvent,
    rt.InputAudioBufferSpeechStoppedEvent,
    rt.InputAudioBufferCommittedEvent,
    rt.ConversationItemAdded,
    rt.ConversationItemDone,
    rt.ConversationItemInputAudioTranscriptionDeltaEvent,
    rt.ConversationItemInputAudioTranscriptionCompletedEvent,
    rt.ConversationItemInputAudioTranscriptionFailedEvent,
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return demo_cache(tmp_path_factory)


@pytest.fixture(scope="module")
def folder(cache):
    return ensure_gemma4_demo(cache)  # the folder `--transcribe demo` finds there


@pytest.fixture(scope="module")
def transcribing(tmp_path_factory, cache, folder):
    """The server transcribing (as the reference: `max_new` tokens); its log without a traceback at the end."""
    logs = tmp_path_factory.mktemp("realtime-transcription")
    env = {"DUPLEXD_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    args = ("--max-sessions", "2", "--transcribe", "demo", "--transcribe-max-tokens", str(MAX_NEW))
    with running_side_by_side(running_server(logs / "transcribe.log", *args, env=env)) as (live,):
        yield live


@pytest.fixture
def plain(demo_server):
    """A server without a transcriber: the run's shared demo server (tests/live_server.py), its slot free."""
    return demo_server


@pytest.fixture(scope="module")
def hf(folder):
    return load_reference(folder)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return Transcriber.from_pretrained(folder, max_slots=1, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return speak_all(tmp_path_factory.mktemp("espeak"))


@pytest.fixture(scope="module")
def silero():
    return load_silero()


def on_the_wire(pcm: np.ndarray) -> np.ndarray:
    """What the server hears: the audio as pcm16."""
    return wire.pcm_from_pcm16(wire.pcm16(pcm).tobytes())


def reference(hf, tokenizer, silero, pcm: np.ndarray, prompt: str = DEFAULT_PROMPT) -> list[tuple[int, int, str]]:
    """(start_ms, end_ms, transcript) of each utterance, as the server must give them."""
    out = []
    for stop in reference_stops(silero, pcm):
        text = tokenizer.text(generate(hf, stop.audio, MAX_NEW, prompt))
        out.append((round(stop.start * 1000 / SAMPLE_RATE), round(stop.t * 1000), text))
    return out


class Paced:
    """Sends 80 ms frames of audio (then silence) on a schedule, `speed` times real time, until stopped."""

    def __init__(self, send, pcm: np.ndarray, speed: float = 1.0) -> None:
        self.send, self.frames, self.period = send, split_frames(pcm), FRAME_S / speed
        self.sent = 0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        silence = np.zeros(FRAME_SIZE, np.float32)
        start = time.monotonic()
        while True:
            frame = self.frames[self.sent] if self.sent < len(self.frames) else silence
            await self.send(base64.b64encode(wire.pcm16(frame).tobytes()).decode())
            self.sent += 1
            await asyncio.sleep(max(0.0, start + self.sent * self.period - time.monotonic()))

    @property
    def done(self) -> bool:
        return self.sent >= len(self.frames)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


# ----------------------------------------------------------------------------------------- the official SDK


def test_openai_sdk_gets_speech_events_and_transcripts(transcribing, hf, tokenizer, clips, silero):
    pcm, truth = compose([0.7, clips[0], 1.0, clips[1], 0.9, clips[2], 1.2], seed=21)
    heard = on_the_wire(pcm)

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{transcribing.url}/v1", api_key="unused")
        async with client.realtime.connect(model="duplexd") as conn:
            created = await conn.recv()
            assert isinstance(created, rt.SessionCreatedEvent)
            assert created.session.audio.input.transcription is None
            await conn.session.update(
                session={"type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}
            )
            updated = await conn.recv()
            assert isinstance(updated, rt.SessionUpdatedEvent), updated
            sender = Paced(_append(conn), heard)
            events, audio_frames, results = [], 0, 0
            deadline = time.monotonic() + len(heard) / SAMPLE_RATE + 30
            try:
                while results < 3:
                    assert time.monotonic() < deadline, [e.type for e in events]
                    raw = await asyncio.wait_for(conn.recv_bytes(), 10)
                    event = conn.parse_event(raw)  # what `conn.recv()` returns
                    if isinstance(event, rt.ResponseAudioDeltaEvent):
                        audio_frames += 1
                        continue
                    if isinstance(event, ITEM_EVENTS):
                        assert type(event).model_validate_json(raw) == event  # every required field, typed
                        events.append(event)
                        results += isinstance(
                            event,
                            rt.ConversationItemInputAudioTranscriptionCompletedEvent
                            | rt.ConversationItemInputAudioTranscriptionFailedEvent,
                        )
                    elif isinstance(event, rt.RealtimeErrorEvent):
                        raise AssertionError(event.error)
            finally:
                await sender.stop()
            return updated, events, audio_frames

    updated, events, audio_frames = asyncio.run(asyncio.wait_for(main(), 90))
    transcription = updated.session.audio.input.transcription
    assert transcription.model == TRANSCRIBER  # what the server uses, not what was asked for
    assert updated.session.model_extra["input_audio_transcription"] == {
        "model": TRANSCRIBER,
        "language": None,
        "prompt": None,
    }
    assert audio_frames >= 5  # the conversation went on (slowly on a loaded machine: its inbox drops frames)

    expected = reference(hf, tokenizer, silero, heard)
    assert len(expected) == 3
    started = [e for e in events if isinstance(e, rt.InputAudioBufferSpeechStartedEvent)]
    ids = [e.item_id for e in started]
    assert len(set(ids)) == 3 and all(i.startswith("item_") for i in ids)
    previous = None
    for item_id, (start_ms, end_ms, text), (true_start, true_end) in zip(ids, expected, truth, strict=True):
        mine = [e for e in events if getattr(e, "item_id", None) == item_id or _item_of(e) == item_id]
        kinds = [type(e) for e in mine]
        assert kinds == [
            rt.InputAudioBufferSpeechStartedEvent,
            rt.InputAudioBufferSpeechStoppedEvent,
            rt.InputAudioBufferCommittedEvent,
            rt.ConversationItemAdded,
            rt.ConversationItemDone,
            *([rt.ConversationItemInputAudioTranscriptionDeltaEvent] if text else []),
            rt.ConversationItemInputAudioTranscriptionCompletedEvent,
        ], kinds
        began, stopped, committed, added = mine[:4]
        assert began.audio_start_ms == start_ms and stopped.audio_end_ms == end_ms
        assert abs(start_ms / 1000 - true_start) <= TOLERANCE and abs(end_ms / 1000 - true_end) <= TOLERANCE
        assert committed.previous_item_id == previous and added.previous_item_id == previous
        item = added.item
        assert isinstance(item, rt.RealtimeConversationItemUserMessage)
        assert item.id == item_id and item.role == "user" and item.content[0].type == "input_audio"
        completed = mine[-1]
        assert completed.content_index == 0 and completed.transcript == text  # parity through the server
        assert isinstance(completed.usage, UsageTranscriptTextUsageDuration)
        assert abs(completed.usage.seconds - (end_ms - start_ms) / 1000) < 0.01
        if text:
            assert mine[-2].delta == text and mine[-2].content_index == 0
        previous = item_id
    assert len({e.transcript for e in events if hasattr(e, "transcript")}) == 3  # three different utterances


def _append(conn):
    async def send(audio: str) -> None:
        await conn.input_audio_buffer.append(audio=audio)

    return send


def _item_of(event) -> str | None:
    item = getattr(event, "item", None)
    return getattr(item, "id", None)


# ------------------------------------------------------------------------------- beta shape, off, errors (raw)


class Raw:
    """A plain websockets client: JSON events in, the conversation's own events (`response.*`) counted apart."""

    def __init__(self, ws) -> None:
        self.ws, self.audio_frames = ws, 0

    async def send(self, **event) -> None:
        await self.ws.send(json.dumps(event))

    async def append(self, audio: str) -> None:
        await self.send(type="input_audio_buffer.append", audio=audio)

    async def next(self, timeout: float = 10.0) -> dict:
        """The next event that is not the model's audio or text; `TimeoutError` when none within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            event = json.loads(await asyncio.wait_for(self.ws.recv(), max(deadline - time.monotonic(), 0.001)))
            if event["type"] == "response.output_audio.delta":
                self.audio_frames += 1
            elif not event["type"].startswith("response."):
                return event

    async def talk(self, frames: int) -> list[dict]:
        """Send `frames` frames of silence and receive the model's answer to them (N in, N - 1 out); the other
        events meanwhile."""
        others, goal = [], self.audio_frames + frames - 1
        for _ in range(frames):
            await self.append(base64.b64encode(bytes(2 * FRAME_SIZE)).decode())
        while self.audio_frames < goal:
            event = json.loads(await asyncio.wait_for(self.ws.recv(), 10))
            if event["type"] == "response.output_audio.delta":
                self.audio_frames += 1
            elif not event["type"].startswith("response."):
                others.append(event)
        return others

    async def until(self, kind: str, timeout: float = 30.0) -> tuple[dict, list[dict]]:
        """Events up to the first of `kind`: (that one, those before it)."""
        before, deadline = [], time.monotonic() + timeout
        while (event := await self.next(max(deadline - time.monotonic(), 0.01))).get("type") != kind:
            before.append(event)
        return event, before

    async def quiet(self, sender: Paced, extra_s: float) -> list[dict]:
        """Every event until the sender has sent its audio and `extra_s` more seconds have passed."""
        events = []
        while not sender.done:
            with contextlib.suppress(asyncio.TimeoutError):
                events.append(await self.next(0.2))
        deadline = time.monotonic() + extra_s
        with contextlib.suppress(asyncio.TimeoutError):
            while (left := deadline - time.monotonic()) > 0:
                events.append(await self.next(left))
        return events


@contextlib.asynccontextmanager
async def raw_session(server):
    async with connect(f"ws://127.0.0.1:{server.port}/v1/realtime", subprotocols=["realtime"]) as ws:
        client = Raw(ws)
        created = await client.next()
        assert created["type"] == "session.created", created
        assert created["session"]["input_audio_transcription"] is None
        assert created["session"]["audio"]["input"]["transcription"] is None
        yield client


def test_beta_shape_with_language_and_prompt_then_off(transcribing, hf, tokenizer, clips, silero):
    """The beta `input_audio_transcription` with a language and a prompt: Gemma gets the instruction they make
    (parity with the reference given the same); `null` turns it off and speech gets no more events."""
    first, _ = compose([0.6, clips[0], 1.0], seed=22)
    second, _ = compose([0.5, clips[1], 1.0], seed=23)
    settings = {"model": "whisper-1", "language": "en", "prompt": "a fox and a dog"}
    prompt = "Transcribe the following speech segment in English. Hint: a fox and a dog"

    async def main():
        async with raw_session(transcribing) as client:
            await client.send(type="session.update", session={"input_audio_transcription": settings})
            on, _ = await client.until("session.updated")
            sender = Paced(client.append, on_the_wire(first), speed=2.0)
            completed, before = await client.until("conversation.item.input_audio_transcription.completed")
            await client.send(type="conversation.item.retrieve", item_id=completed["item_id"])
            retrieved = [(await client.until("conversation.item.retrieved"))[0]]
            await client.send(type="session.update", session={"input_audio_transcription": None})
            off, _ = await client.until("session.updated")
            await client.send(type="conversation.item.retrieve", item_id=completed["item_id"])
            retrieved.append((await client.until("conversation.item.retrieved"))[0])  # off: its items stay
            await sender.stop()
            audio_before = client.audio_frames
            sender = Paced(client.append, on_the_wire(second), speed=2.0)
            after = await client.quiet(sender, 1.5)
            await sender.stop()
            return on, completed, before, retrieved, off, after, client.audio_frames - audio_before

    on, completed, before, retrieved, off, after, audio_frames = asyncio.run(asyncio.wait_for(main(), 60))
    shown = {**settings, "model": TRANSCRIBER}
    assert on["session"]["input_audio_transcription"] == shown
    assert on["session"]["audio"]["input"]["transcription"] == shown
    assert [e["type"] for e in before] == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
        "conversation.item.input_audio_transcription.delta",
    ]
    [(_, _, text)] = reference(hf, tokenizer, silero, on_the_wire(first), prompt)
    assert completed["transcript"] == text and completed["item_id"] == before[0]["item_id"]
    item = {**before[3]["item"], "content": [{"type": "input_audio", "transcript": text}]}
    assert [e["item"] for e in retrieved] == [item, item]  # as announced, with its transcript, on and off
    assert off["session"]["input_audio_transcription"] is None
    assert off["session"]["audio"]["input"]["transcription"] is None
    assert after == [] and audio_frames >= 2  # speech, no transcription events; the conversation goes on


def test_bad_transcription_settings_are_refused_by_name(transcribing):
    async def main():
        async with raw_session(transcribing) as client:
            await client.send(type="session.update", event_id="e1", session={"input_audio_transcription": "on"})
            wrong_type = await client.next()
            await client.send(
                type="session.update", session={"audio": {"input": {"transcription": {"language": "english"}}}}
            )
            wrong_language = await client.next()
            await client.send(
                type="session.update", session={"audio": {"input": {"transcription": {"language": "de"}}}}
            )
            fine, _ = await client.until("session.updated")
            assert await client.talk(5) == []  # still talking
            return wrong_type, wrong_language, fine

    wrong_type, wrong_language, fine = asyncio.run(asyncio.wait_for(main(), 60))
    assert wrong_type["type"] == "error" and wrong_type["error"]["code"] == "invalid_value"
    assert wrong_type["error"]["param"] == "session.input_audio_transcription"
    assert wrong_type["error"]["event_id"] == "e1"
    assert wrong_language["error"]["code"] == "invalid_value"
    assert wrong_language["error"]["param"] == "session.audio.input.transcription.language"
    assert fine["session"]["audio"]["input"]["transcription"] == {
        "model": TRANSCRIBER,
        "language": "de",
        "prompt": None,
    }


def test_no_transcriber_leaves_transcription_off_without_an_error(plain):
    """A server without `--transcribe`: an update that asks for transcription (as OpenAI's SDKs do by default)
    applies the rest, and `session.updated` shows transcription as it is, off; no `error`."""

    async def main():
        async with raw_session(plain) as client:
            await client.send(
                type="session.update",
                session={"audio": {"input": {"transcription": {"model": "whisper-1"}}}, "sampling": {"seed": 5}},
            )
            updated = await client.next()
            between = await client.talk(5)
            await client.send(type="session.update", session={"input_audio_transcription": {}, "sampling": {"seed": 6}})
            beta, _ = await client.until("session.updated")
            return updated, between, beta

    updated, between, beta = asyncio.run(asyncio.wait_for(main(), 60))
    assert updated["type"] == "session.updated", updated
    assert updated["session"]["audio"]["input"]["transcription"] is None
    assert updated["session"]["input_audio_transcription"] is None
    assert updated["session"]["sampling"]["seed"] == 5
    assert between == []
    assert beta["session"]["input_audio_transcription"] is None and beta["session"]["sampling"]["seed"] == 6
