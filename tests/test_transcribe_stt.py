"""`duplexd transcribe --model STT`: a file through a Kyutai STT model frame by frame, its words timed by moshi-server's
rules (the plain statement of asr.rs in tests/test_asr_words.py, fed the tokens the run wrote), its tokens those of
the engine on the same padded audio, and another file gives other tokens."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from duplexd.clients.audio import speech_like
from duplexd.commands import transcribe_stt
from duplexd.commands.cli import main
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.weights.demo import ensure_demo_stt

from .test_asr_words import RustAsr

RATE = 24000


@pytest.fixture(scope="module")
def talkative(tmp_path_factory):
    """The demo STT model with word boundaries and padding made likely: its text head's rows for the end of padding
    (0) and padding (3) scaled up, so its text is words of a few pieces instead of one endless word."""
    demo = ensure_demo_stt(tmp_path_factory.mktemp("stt"))
    weights = load_file(demo.lm)
    head = weights["text_linear.weight"].clone()
    head[0] *= 12.0
    head[3] *= 12.0
    weights["text_linear.weight"] = head
    save_file(weights, demo.lm)
    return transcribe_stt.SttFiles(demo.lm, demo.mimi, demo.tokenizer, demo.config, demo.mimi_preset)


def _run(files, audio, tmp_path, name: str) -> tuple[dict, list[dict], str]:
    wav, tokens = tmp_path / f"{name}.wav", tmp_path / f"{name}.jsonl"
    sf.write(wav, audio, RATE)
    args = argparse.Namespace(
        input=str(wav), format="verbose_json", device="cpu", dtype="float32", tokens_out=str(tokens)
    )
    return args, files, tokens


def test_words_follow_moshi_servers_rules_on_the_tokens_of_the_run(talkative, tmp_path, capsys):
    audio = speech_like(3.0, seed=1)
    args, files, tokens_path = _run(talkative, audio, tmp_path, "a")
    assert transcribe_stt.run(args, files) == 0
    body = json.loads(capsys.readouterr().out)
    lines = [json.loads(line) for line in tokens_path.read_text().splitlines()]
    tokens = [line["text"] for line in lines]
    assert len(lines) == -(-(len(audio) + round(1.5 * RATE)) // 1920)  # the audio, then delay + 1 s of silence
    assert all(len(line["pause"]) == 4 and all(0 <= p <= 1 for p in line["pause"]) for line in lines)

    oracle, events = RustAsr(1, 6), []  # the demo's 0.5 s delay: moshi-server's 6 tokens
    for token in tokens:
        events += [message for _, message in oracle.step([token], [True])]
    decode = TextTokenizer(talkative.tokenizer).decode
    expected: list[dict] = []
    for message in events:
        if message[0] == "Word":
            expected.append({"word": decode(list(message[1])), "start": round(message[2], 3)})
        elif expected and "end" not in expected[-1]:
            expected[-1]["end"] = round(message[1], 3)
    assert len(expected) >= 3, tokens  # the test sees words, not one endless run of pieces
    assert body["words"] == expected
    assert body["text"] == " ".join(w["word"] for w in expected)
    assert body["duration"] == pytest.approx(len(audio) / RATE, abs=1e-3)

    other = speech_like(3.0, seed=2)
    args, files, other_path = _run(talkative, other, tmp_path, "b")
    transcribe_stt.run(args, files)
    capsys.readouterr()
    other_tokens = [json.loads(line)["text"] for line in other_path.read_text().splitlines()]
    assert other_tokens != tokens  # the words come from the audio


def test_the_cli_runs_the_demo_stt_and_refuses_what_it_cannot_write(tmp_path, capsys):
    wav = tmp_path / "in.wav"
    sf.write(wav, speech_like(1.0, seed=3), RATE)
    assert main(["transcribe", str(wav), "--model", "demo-stt"]) == 0
    assert capsys.readouterr().out.endswith("\n")
    assert main(["transcribe", str(wav), "--model", "demo-stt", "--format", "srt"]) == 2
    assert "srt" in capsys.readouterr().err
    assert main(["transcribe", str(wav), "--model", "demo", "--tokens-out", str(tmp_path / "t.jsonl")]) == 2
    assert "--tokens-out" in capsys.readouterr().err


def test_tokens_equal_the_pipeline_on_the_same_padded_audio(talkative, tmp_path, capsys):
    from duplexd.engine.dialogue.pipeline import Pipeline
    from duplexd.engine.dialogue.sampling import SamplingParams
    from duplexd.engine.models.config import MIMI_PRESETS
    from duplexd.engine.weights.checkpoint import load_lm, load_mimi

    audio = speech_like(1.5, seed=4)
    args, files, tokens_path = _run(talkative, audio, tmp_path, "c")
    transcribe_stt.run(args, files)
    capsys.readouterr()
    tokens = [json.loads(line)["text"] for line in tokens_path.read_text().splitlines()]
    lm = load_lm(files.lm, files.config)
    mimi = load_mimi(files.mimi, MIMI_PRESETS[files.mimi_preset], dtype=torch.float32)
    pipeline = Pipeline(lm, mimi, num_slots=2)
    pipeline.reset(1, SamplingParams(text_temperature=0.0, text_topk=1))
    padded = np.concatenate([audio, np.zeros(round(1.5 * RATE), np.float32)])
    padded = np.pad(padded, (0, -len(padded) % 1920))
    direct = [int(pipeline.step([1], frame[None]).tokens[0, 0]) for frame in padded.reshape(-1, 1920)]
    assert tokens == direct
