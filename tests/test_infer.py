"""`duplexd infer` end to end against the reference's Mimi + LMGen driven frame by frame on the same file."""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest
import soundfile as sf
import torch
from moshi.models.lm import LMGen as RefLMGen
from safetensors.torch import save_file

from duplexd.commands.cli import main
from duplexd.commands.infer import read_audio
from duplexd.engine.models.config import DEMO_MIMI, LMConfig
from duplexd.engine.models.tokenizer import TextTokenizer, train_tokenizer
from duplexd.engine.weights.checkpoint import read_lm_config

from .ref_models import fused_state_dict, quantized_reference, reference_lm, reference_mimi, sharpen_mimi_

FRAME = 1920


def speech_like(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """Harmonics with a wandering pitch and a syllable-rate envelope, plus a little noise (stereo)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    pitch = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2)
    left = 0.2 * voice + 0.01 * rng.standard_normal(len(t))
    return np.stack([left, 0.8 * left], axis=1).astype(np.float32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    corpus = resources.files("duplexd.engine.weights").joinpath("data", "demo_corpus.txt").read_text().splitlines()
    train_tokenizer(corpus, root / "tok.model", 400)
    cfg = LMConfig(
        dim=64,
        text_card=TextTokenizer(root / "tok.model").vocab_size,
        num_heads=4,
        num_layers=2,
        depformer_dim=32,
        depformer_dim_feedforward=132,
        depformer_num_heads=2,
        depformer_num_layers=2,
    )
    lm = reference_lm(cfg, seed=11)
    mimi = reference_mimi(seed=12)
    save_file(fused_state_dict(lm, cfg), str(root / "lm.safetensors"))
    save_file({k: v.contiguous() for k, v in mimi.state_dict().items()}, str(root / "mimi.safetensors"))
    # the demo's tiny Mimi (sharpened, so the input shows in its codes) for the tests about the LM's weights alone
    tiny = sharpen_mimi_(reference_mimi(seed=13, mimi_config=DEMO_MIMI.to_reference_dict()))
    save_file({k: v.contiguous() for k, v in tiny.state_dict().items()}, str(root / "tiny_mimi.safetensors"))
    # As published config files and older releases wrote it: with the deprecated key the reference drops.
    config = {**cfg.to_reference_json(), "depformer_causal": True, "depformer_context": 8}
    (root / "config.json").write_text(json.dumps(config))
    return root, lm, mimi, tiny


@torch.no_grad()
def reference_run(lm, mimi, pcm: np.ndarray):
    """Frame by frame as the reference server does it: encode, LMGen step, decode when tokens come out."""
    pcm = np.pad(pcm, (0, -len(pcm) % FRAME))
    gen = RefLMGen(lm, use_sampling=False)
    rows, speech = [], []
    with mimi.streaming(1), gen.streaming(1):
        for index in range(len(pcm) // FRAME):
            codes = mimi.encode(torch.from_numpy(pcm[index * FRAME : (index + 1) * FRAME])[None, None])
            tokens = gen.step(codes)
            if tokens is None:
                continue
            rows.append({"frame": index, "text": int(tokens[0, 0, 0]), "audio": tokens[0, 1:, 0].tolist()})
            speech.append(mimi.decode(tokens[:, 1:])[0, 0].numpy())
    return rows, np.concatenate(speech)


def test_infer_matches_the_reference(checkpoint, tmp_path, capsys):
    """Kyutai's full-size Mimi, found from its file as `infer` finds it."""
    root, lm, mimi, _ = checkpoint
    wav_in = tmp_path / "in.wav"
    sf.write(wav_in, speech_like(2.1, 16000), 16000)  # 16 kHz stereo: resampled and down-mixed
    args = [
        "infer",
        str(wav_in),
        str(tmp_path / "out.wav"),
        "--moshi-weight",
        str(root / "lm.safetensors"),
        "--mimi-weight",
        str(root / "mimi.safetensors"),
        "--tokenizer",
        str(root / "tok.model"),
        "--config",
        str(root / "config.json"),
        "--temp",
        "0",
        "--temp-text",
        "0",
        "--tokens-out",
        str(tmp_path / "tokens.jsonl"),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out

    rows, speech = reference_run(lm, mimi, read_audio(wav_in, 24000, FRAME))
    ours = [json.loads(line) for line in (tmp_path / "tokens.jsonl").read_text().splitlines()]
    assert len(ours) == len(rows) == 26
    for a, b in zip(ours, rows, strict=True):
        assert a == b
    assert len({r["text"] for r in rows}) > 3 and len({tuple(r["audio"]) for r in rows}) > 20

    tokenizer = TextTokenizer(root / "tok.model")
    expected = "".join(tokenizer.piece(r["text"]) for r in rows if r["text"] not in (0, 3))
    assert printed.strip() == expected.strip()

    out, rate = sf.read(tmp_path / "out.wav", dtype="float32")
    assert rate == 24000 and out.shape == speech.shape
    assert np.linalg.norm(out - speech) / np.linalg.norm(speech) < 2e-3  # 16-bit WAV quantisation


def test_bad_inputs_exit_with_a_message(tmp_path, capsys):
    out = str(tmp_path / "out.wav")
    assert main(["infer", str(tmp_path / "missing.wav"), out]) == 2
    assert "cannot read audio" in capsys.readouterr().err
    (tmp_path / "junk.wav").write_bytes(b"RIFF not really a wav file")
    assert main(["infer", str(tmp_path / "junk.wav"), out]) == 2
    assert "cannot read audio" in capsys.readouterr().err
    sf.write(tmp_path / "empty.wav", np.zeros(0, np.float32), 24000)
    assert main(["infer", str(tmp_path / "empty.wav"), out]) == 2
    assert "no audio" in capsys.readouterr().err
    sf.write(tmp_path / "short.wav", np.zeros(1000, np.float32), 24000)
    assert main(["infer", str(tmp_path / "short.wav"), out]) == 2
    assert "too short" in capsys.readouterr().err
    assert main(["infer", str(tmp_path / "short.wav"), out, "--moshi-weight", "x.safetensors"]) == 2
    assert "--mimi-weight, --tokenizer: missing" in capsys.readouterr().err


def test_infer_on_the_demo_model(tmp_path):
    sf.write(tmp_path / "in.wav", speech_like(0.5, 24000)[:, 0], 24000)
    assert main(["infer", str(tmp_path / "in.wav"), str(tmp_path / "out.wav")]) == 0
    out, rate = sf.read(tmp_path / "out.wav")
    assert rate == 24000 and len(out) == (7 - 1) * FRAME and np.abs(out).max() > 0


def test_infer_on_a_q8_checkpoint_matches_the_reference_on_the_dequantized_weights(checkpoint, tmp_path):
    """A Kyutai-style q8 folder (moshi's own `QLinear` quantization, fused naming, `"quantize": true`): greedy
    tokens frame by frame equal the reference's on the dequantized weights (fp32); `--weights-dtype int8` on the
    float checkpoint equals it with the text head left float, as that flag leaves it. On the demo's tiny Mimi: only
    the LM's weights differ from the test above."""
    root, lm, _, mimi = checkpoint
    q8, dequantized = quantized_reference(lm)
    _, float_head = quantized_reference(lm, text_head=False)
    folder = tmp_path / "q8"
    folder.mkdir()
    cfg = read_lm_config(root / "config.json")
    save_file(fused_state_dict(q8, cfg), str(folder / "model.q8.safetensors"))
    (folder / "config.json").write_text(
        json.dumps({**json.loads((root / "config.json").read_text()), "quantize": True})
    )
    wav_in = tmp_path / "in.wav"
    sf.write(wav_in, speech_like(1.5, 24000, seed=2)[:, 0], 24000)
    pcm = read_audio(wav_in, 24000, FRAME)
    expected = {"q8": reference_run(dequantized, mimi, pcm)[0], "int8": reference_run(float_head, mimi, pcm)[0]}
    common = ["--mimi-weight", str(root / "tiny_mimi.safetensors"), "--tokenizer", str(root / "tok.model")]
    common += ["--temp", "0", "--temp-text", "0"]
    runs = {
        "q8": ["--moshi-weight", str(folder / "model.q8.safetensors"), "--config", str(folder / "config.json")],
        "int8": ["--moshi-weight", str(root / "lm.safetensors"), "--config", str(root / "config.json")]
        + ["--weights-dtype", "int8"],
    }
    for name, extra in runs.items():
        out = tmp_path / f"{name}.jsonl"
        assert (
            main(["infer", str(wav_in), str(tmp_path / f"{name}.wav"), *common, *extra, "--tokens-out", str(out)]) == 0
        )
        ours = [json.loads(line) for line in out.read_text().splitlines()]
        assert ours == expected[name], name
    assert len({tuple(r["audio"]) for r in expected["q8"]}) > 10
