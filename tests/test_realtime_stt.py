"""End to end: OpenAI Realtime transcription sessions (`/v1/realtime?intent=transcription`) of a real `duplexd
serve` on the demo STT model (`test_asr_e2e`'s server and reference: the model stepped here frame by frame, its
tokens read by moshi-server's rules).

The official `openai` SDK (GA dialect, no turn detection) appends a clip as fast as it can, commits and gets the
transcript without sending more audio (the server's flush): exactly the reference's words of that audio, and other
audio gives other words. A beta client (header `OpenAI-Beta: realtime=v1`, `transcription_session.update`) with
server VAD at threshold 0 gets utterances ended by the pause heads wherever its words pause; at threshold 1 none
ends, and its commit ends one with every word. Bad events get the protocol's errors, and the session goes on."""

# ruff: noqa: F811 - the fixtures imported from test_asr_e2e are named as its tests take them
from __future__ import annotations

import asyncio
import base64
import json
import math

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from openai.types import realtime as rt  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402

from duplexd import wire  # noqa: E402

from .test_asr_e2e import DELAY, FRAME, KEY, RATE, reference, run, server, speech, stt_files, wait_idle  # noqa: E402, F401

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
            return events

    events = run(main())
    committed = [e for e in events if isinstance(e, rt.InputAudioBufferCommittedEvent)]
    deltas = [e for e in events if isinstance(e, rt.ConversationItemInputAudioTranscriptionDeltaEvent)]
    completed = events[-1]
    assert len(committed) == 1 and committed[0].item_id == completed.item_id
    assert not [e for e in events if isinstance(e, rt.InputAudioBufferSpeechStartedEvent)]  # no turn detection
    assert completed.transcript == " ".join(words)
    assert "".join(d.delta for d in deltas if d.item_id == completed.item_id) == completed.transcript
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
