"""`duplexd speak` on the demo TTS model: a wav and the frames as moshi's `TTSResult.frames` lays them out, and one
clear line for each kind of bad input."""

from __future__ import annotations

import json

import pytest
import soundfile as sf
import torch
from safetensors.torch import save_file

from duplexd.commands.cli import main
from duplexd.engine.tts.demo import DEMO_TTS, DEMO_VOICES, demo_tts_folder
from duplexd.engine.tts.model import load_tts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    demo_tts_folder(root)
    return root


@pytest.fixture
def env(cache, monkeypatch):
    monkeypatch.setenv("DUPLEXD_CACHE", str(cache))
    return cache


def test_speak_writes_the_audio_after_the_delay_and_every_frame(env, tmp_path):
    out, tokens = tmp_path / "hi.wav", tmp_path / "hi.jsonl"
    assert main(["speak", "Hi there, you.", "--out", str(out), "--tokens-out", str(tokens), "--temp", "0"]) == 0
    rows = [json.loads(line) for line in tokens.read_text().splitlines()]
    model = load_tts(demo_tts_folder(env))
    delay = model.tts.delay_steps
    assert [r["frame"] for r in rows] == list(range(len(rows))) and len(rows) > delay + 10
    assert all(r["audio"] == [-1] * DEMO_TTS.dep_q for r in rows[:delay])
    assert all(0 <= c < DEMO_TTS.card for r in rows[delay:] for c in r["audio"])
    card = model.lm.cfg.text_in_card
    words = [r["text"] % card for r in rows if 3 < r["text"] % card < card - 1]  # the words' tokens, in order
    assert words[: len(model.tokenizer.encode("Hi"))] == model.tokenizer.encode("Hi")
    audio, rate = sf.read(out)
    assert rate == 24000 and len(audio) == (len(rows) - delay) * 1920
    assert float((audio**2).mean()) > 0


def test_int8_weights_say_the_same_words_in_other_frames(env, tmp_path):
    """`--weights-dtype int8`: the projections quantized as they load; the words are said (the same text tokens
    in order) and the audio codes move (the quantization is applied)."""
    rows = {}
    for dtype in ("bf16", "int8"):
        tokens = tmp_path / f"{dtype}.jsonl"
        argv = ["speak", "Hi there, you.", "--out", str(tmp_path / f"{dtype}.wav"), "--tokens-out", str(tokens)]
        assert main([*argv, "--temp", "0", "--weights-dtype", dtype]) == 0
        rows[dtype] = [json.loads(line) for line in tokens.read_text().splitlines()]
    card = DEMO_TTS.text_in_card

    def words(frames: list[dict]) -> list[int]:
        return [r["text"] % card for r in frames if 3 < r["text"] % card < card - 1]

    assert words(rows["int8"]) == words(rows["bf16"]) and words(rows["bf16"])
    assert [r["audio"] for r in rows["int8"]] != [r["audio"] for r in rows["bf16"]]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["   "], "--text no words to say"),
        (["hi", "--voice", "demo/carol.wav"], "unknown voice 'demo/carol.wav'"),
        (["hi", "--cfg-coef", "2.2"], "--cfg-coef 2.2: the model takes 1.0, 1.5"),
        (["hi", "--temp", "-1"], "--temp -1.0: must be >= 0"),
        (["hi", "--model", "/nonexistent"], "--model /nonexistent is not a folder"),
        (["hi", "--text-file", "x.txt"], "not both"),
    ],
)
def test_bad_input_is_one_line(env, tmp_path, capsys, argv, message):
    assert main(["speak", *argv, "--out", str(tmp_path / "x.wav")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err, err


def test_a_voice_file_of_the_wrong_shape_is_refused(env, tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    save_file({"speaker_wavs": torch.zeros(1, 7, 125)}, str(bad))
    assert main(["speak", "hi", "--voice", str(bad), "--out", str(tmp_path / "x.wav")]) == 2
    assert "speaker_wavs is [1, 7, 125], the model takes [1, 32, 125]" in capsys.readouterr().err
    assert DEMO_VOICES[0].startswith("demo/")


def test_a_dialogue_model_is_not_a_tts_model(env, tmp_path, capsys):
    from duplexd.engine.weights.demo import ensure_demo

    folder = ensure_demo(env).root
    assert main(["speak", "hi", "--model", str(folder), "--out", str(tmp_path / "x.wav")]) == 2
    assert f"{folder} is not a Kyutai TTS model" in capsys.readouterr().err
