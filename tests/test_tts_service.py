"""The batched speech service on the demo TTS: streams that start at different times, whose words arrive over time,
each give the speech and word times that generating it alone gives; a stream inside its audio delay takes steps
alone between the steps of all; a full service refuses, a closed stream frees its slot."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

from duplexd.engine.errors import CapacityError, SessionClosed
from duplexd.engine.models.int8_weights import int8_names
from duplexd.engine.models.mimi import MimiStreams
from duplexd.engine.tts.demo import DEMO_VOICES, demo_tts_folder
from duplexd.engine.tts.generate import TTSGen, Voice, generate
from duplexd.engine.tts.model import load_tts, voice_embedding
from duplexd.engine.tts.service import PCM_LIMIT, TEXT_ONLY_STEPS, SpeechChunk, SpeechEnd, SpeechService, WordTaken
from duplexd.engine.tts.words import script_words

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = ["Hello there, you.", "One two three."]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_tts(demo_tts_folder(tmp_path_factory.mktemp("cache")))


def voice(model, k: int) -> Voice:
    return Voice((voice_embedding(DEMO_VOICES[k], model.folder / "voices", model.tts),))


def alone(model, text: str, k: int) -> tuple[np.ndarray, list[tuple[str, int]]]:
    words = script_words([text], model.tokenizer.encode)
    result = generate(TTSGen(model.lm, model.conditioner, model.tts, 1), [words], [voice(model, k)])[0]
    codes = torch.tensor([row[1:] for row in result.frames[model.tts.delay_steps :]])
    with torch.no_grad():
        pcm = MimiStreams(model.mimi, 1).decode([0], codes.t()[None])[0].clamp(-PCM_LIMIT, PCM_LIMIT).numpy()
    return pcm, result.transcript


def collect(stream) -> tuple[np.ndarray, list[tuple[str, int]], list[int]]:
    chunks, words, frames, ends = [], [], [], []
    while (event := stream.get(timeout=120)) is not None:
        if isinstance(event, SpeechChunk):
            chunks.append(event.pcm)
            frames.append(event.frame)
        elif isinstance(event, SpeechEnd):
            ends.append(event.steps)
        else:
            assert isinstance(event, WordTaken)
            words.append((event.text, event.step))
    assert len(ends) == 1 and ends[0] > len(frames), ends  # the end comes once, last, counting the silent steps
    return np.concatenate(chunks), words, frames


def test_streams_at_different_times_say_what_they_say_alone(model):
    expected = [alone(model, text, k) for k, text in enumerate(TEXTS)]
    service = SpeechService(model, max_streams=2)
    service.start()
    try:
        first = service.open(voice(model, 0))
        for word in script_words([TEXTS[0]], model.tokenizer.encode):  # one word at a time, as an LLM sends them
            first.push([word])
            time.sleep(0.05)
        first.finish()
        second = service.open(voice(model, 1))
        second.push(script_words([TEXTS[1]], model.tokenizer.encode))
        second.finish()
        for stream, (pcm, transcript) in zip((first, second), expected, strict=True):
            got, words, frames = collect(stream)
            assert words == transcript
            assert frames == list(range(len(frames)))
            assert got.shape == pcm.shape and np.allclose(got, pcm, atol=1e-5), float(np.abs(got - pcm).max())
        with pytest.raises(SessionClosed):
            first.push(script_words(["late"], model.tokenizer.encode))
    finally:
        service.stop()


def test_a_new_stream_steps_alone_inside_its_audio_delay_and_says_what_it_says_alone(model):
    long = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen."
    expected = alone(model, TEXTS[1], 1)
    service = SpeechService(model, max_streams=2)
    steps: list[tuple[int, ...]] = []  # each slot's step count after each step
    service.on_step.add(lambda seconds, streams: steps.append(tuple(service.gen.steps)))
    service.start()
    try:
        first = service.open(voice(model, 0))
        first.push(script_words([long], model.tokenizer.encode))
        first.finish()
        while not isinstance(first.get(timeout=120), SpeechChunk):  # the first stream speaks
            pass
        second = service.open(voice(model, 1))
        second.push(script_words([TEXTS[1]], model.tokenizer.encode))
        second.finish()
        pcm, words, frames = collect(second)
        collect_rest(first)
    finally:
        service.stop()
    assert words == expected[1] and frames == list(range(len(frames)))
    assert pcm.shape == expected[0].shape and np.allclose(pcm, expected[0], atol=1e-5)
    # which slots each step advanced, while the second (slot 1) was inside its delay: it alone for TEXT_ONLY_STEPS
    # steps, then both, and so on; after its delay, both every step
    stepped = [{i for i in (0, 1) if now[i] != before[i]} for before, now in itertools.pairwise(steps)]
    delay = model.tts.delay_steps
    inside = [s for s, now in zip(stepped, steps[1:], strict=True) if 1 in s and now[1] <= delay]
    cycle = [{1}] * TEXT_ONLY_STEPS + [{0, 1}]
    assert inside == (cycle * delay)[:delay], inside
    after = [s for s, now in zip(stepped, steps[1:], strict=True) if now[1] > delay]
    assert {0, 1} in after, "the first stream speaks on after the second's delay"


def test_a_full_service_refuses_and_a_closed_stream_frees_its_slot(model):
    service = SpeechService(model, max_streams=1)
    service.start()
    try:
        stream = service.open(voice(model, 0))
        with pytest.raises(CapacityError):
            service.open(voice(model, 1))
        stream.push(script_words(["Waiting for more words"], model.tokenizer.encode))  # never finished
        stream.close()
        assert stream.get(timeout=30) is None or collect_rest(stream)
        other = service.open(voice(model, 1))  # the slot is free again
        other.push(script_words(["Hi."], model.tokenizer.encode))
        other.finish()
        assert len(collect(other)[0]) > 0
    finally:
        service.stop()


def collect_rest(stream) -> bool:
    while stream.get(timeout=30) is not None:
        pass
    return True


def test_the_served_model_takes_its_weights_dtype(tmp_path, monkeypatch):
    """`serve --tts demo-tts --tts-weights-dtype int8`: the speech service's LM holds int8 projections; by default
    as the file stores them (float)."""
    from duplexd.server.core.settings import ServerSettings
    from duplexd.server.core.speech import load_speech

    monkeypatch.setenv("DUPLEXD_CACHE", str(tmp_path))
    for dtype, int8 in ((None, False), ("int8", True)):
        speech = load_speech(ServerSettings(tts="demo-tts", tts_weights_dtype=dtype), "cpu", torch.float32)
        assert bool(int8_names(speech.model.lm)) == int8
