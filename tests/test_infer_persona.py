"""`duplexd infer --text-prompt T --voice-prompt V` on a tiny random PersonaPlex checkpoint, greedy: the
--tokens-out JSONL from the first live frame on against the plain-Python statement of the reference's rules
(`personaplex_ref`, with NVIDIA's ring rule), with a `.pt` preset and with an audio voice, the session running
past the LM's window; with the preset, 11 s of live audio past Mimi's too (250 steps: 10 s, where the fork's Mimi
parts from moshi's: the user's codes and the speech, by the reference Mimi with the fork's labels); and each refusal
of a bad prompt."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import numpy as np
import pytest
import sentencepiece as spm
import soundfile as sf
import torch
from safetensors.torch import save_file

from duplexd.commands.cli import main
from duplexd.commands.infer import read_audio
from duplexd.engine.models.config import DEMO_MIMI
from duplexd.engine.models.tokenizer import TextTokenizer, train_tokenizer
from duplexd.engine.persona.voices import load_audio_voice
from duplexd.engine.weights.checkpoint import load_lm, load_mimi, mimi_ring_rule

from .personaplex_files import PP_SMALL, write_personaplex
from .personaplex_ref import Oracle, ReferenceSession, preset_from_codes
from .ref_models import quantized_reference, reference_mimi, sharpen_mimi_
from .ring_rules import mimi_transformers, use_fork_rule
from .test_infer import FRAME, speech_like

# A real tokenizer's vocabulary; a 96-frame window, which the prompt (82-85 frames) and the input overrun. Mimi is the
# demo's tiny one, its window the real 250 steps (10 s), which 11 s of input overrun (the last frame zero-padded).
CFG = dataclasses.replace(PP_SMALL, text_card=400, context=96)
INPUT_SECONDS, LIVE = 11.0, 138
# the tests of the prompt and the weights (the preset voice's test runs past Mimi's window for them all): 32 live
# frames, still past the LM's window
SHORT_SECONDS, SHORT_LIVE = 2.5, 32
MIMI_WINDOW_FRAMES = DEMO_MIMI.context // DEMO_MIMI.downsample_stride  # 125
ROLE = "You are a wise and friendly teacher who answers questions about the weather."
VOICE_CODES = torch.randint(0, CFG.card, (5, 8), generator=torch.Generator().manual_seed(1)).tolist()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A PersonaPlex checkpoint, its Mimi and tokenizer, a user's input, a `.pt` preset and an audio voice. Mimi's
    attention is sharpened so that its ring rule shows in the codes, not only in float noise."""
    root = tmp_path_factory.mktemp("pp_infer")
    corpus = resources.files("duplexd.engine.weights").joinpath("data", "demo_corpus.txt").read_text().splitlines()
    train_tokenizer(corpus, root / "tok.model", 400)
    assert TextTokenizer(root / "tok.model").vocab_size == CFG.text_card
    weights, ref_lm = write_personaplex(root, CFG, seed=4)
    ref_mimi = sharpen_mimi_(reference_mimi(seed=12, mimi_config=DEMO_MIMI.to_reference_dict()))
    save_file({k: v.contiguous() for k, v in ref_mimi.state_dict().items()}, str(root / "mimi.safetensors"))
    sf.write(root / "in.wav", speech_like(INPUT_SECONDS, 24000, seed=3)[:, 0], 24000)
    sf.write(root / "short.wav", speech_like(SHORT_SECONDS, 24000, seed=3)[:, 0], 24000)
    torch.save(preset_from_codes(CFG, ref_lm, VOICE_CODES), root / "voice.pt")
    sf.write(root / "voice.wav", speech_like(0.6, 16000, seed=5), 16000)  # resampled, channel 0
    return root, weights, ref_lm, ref_mimi


def _args(root, weights, tmp_path, *extra: str, config=None, audio: str = "in.wav") -> list[str]:
    return [
        "infer",
        str(root / audio),
        str(tmp_path / "out.wav"),
        "--moshi-weight",
        str(weights),
        "--mimi-weight",
        str(root / "mimi.safetensors"),
        "--tokenizer",
        str(root / "tok.model"),
        "--config",
        str(config or root / "config.json"),
        "--temp",
        "0",
        "--temp-text",
        "0",
        "--tokens-out",
        str(tmp_path / "tokens.jsonl"),
        *extra,
    ]


def _infer(files, tmp_path, role: str, voice: str, audio: str = "in.wav") -> list[dict]:
    root, weights, _, _ = files
    args = _args(root, weights, tmp_path, "--text-prompt", role, "--voice-prompt", str(root / voice), audio=audio)
    assert main(args) == 0
    return [json.loads(line) for line in (tmp_path / "tokens.jsonl").read_text().splitlines()]


@torch.no_grad()
def _user_codes(ref_mimi, root, rule: str = "personaplex", audio: str = "in.wav") -> list[list[int]]:
    """The input file's codes, one frame at a time through the reference Mimi, its rings labelled by `rule`."""
    pcm = read_audio(root / audio, 24000, FRAME)
    pcm = np.pad(pcm, (0, -len(pcm) % FRAME))
    with ref_mimi.streaming(1):
        if rule == "personaplex":
            use_fork_rule(*mimi_transformers(ref_mimi))
        return [
            ref_mimi.encode(torch.from_numpy(pcm[i * FRAME : (i + 1) * FRAME])[None, None])[0, :, 0].tolist()
            for i in range(len(pcm) // FRAME)
        ]


@torch.no_grad()
def _speech(ref_mimi, frames: list[dict]) -> np.ndarray:
    """The agent's codes of each live frame decoded by a fresh reference Mimi with the fork's labels."""
    with ref_mimi.streaming(1):
        use_fork_rule(*mimi_transformers(ref_mimi))
        return np.concatenate([ref_mimi.decode(torch.tensor(f["audio"])[None, :, None])[0, 0].numpy() for f in frames])


def _expected(files, role: str, codes=None, preset=None, audio: str = "in.wav") -> list[dict]:
    """The statement's live calls: the prompt forced, then the user's codes one frame each."""
    root, _, ref_lm, ref_mimi = files
    sp = spm.SentencePieceProcessor(model_file=str(root / "tok.model"))
    text = sp.encode(f"<system> {role} <system>")  # no BOS, no EOS
    oracle = Oracle(ref_lm, ring_rule="personaplex")
    try:
        session = ReferenceSession(CFG, oracle)
        session.prompt(text, codes=codes, preset=preset)
        prompted = len(session.calls)
        live = [session.live(u) for u in _user_codes(ref_mimi, root, audio=audio)]
    finally:
        oracle.close()
    assert prompted + len(live) > CFG.context + 10  # the session's last frames are well past the window
    return [{"frame": i, "text": c.output[0], "audio": c.output[1:9]} for i, c in enumerate(live)]


def _check(ours: list[dict], expected: list[dict], live: int = LIVE) -> None:
    assert len(ours) == len(expected) == live  # every live frame has an output: the prompt warmed the delays up
    for a, b in zip(ours, expected, strict=True):
        assert a == b, f"frame {b['frame']}"
    assert len({r["text"] for r in ours} | {r["audio"][0] for r in ours}) > 3, "degenerate run"


def test_preset_voice_matches_the_reference_rules(files, tmp_path):
    root = files[0]
    state = torch.load(root / "voice.pt", weights_only=True)
    preset = (state["embeddings"][:, 0], len(VOICE_CODES), state["cache"][0].tolist())
    expected = _expected(files, ROLE, preset=preset)
    _check(_infer(files, tmp_path, ROLE, "voice.pt"), expected)
    out, rate = sf.read(tmp_path / "out.wav", dtype="float32")
    assert rate == 24000 and len(out) == LIVE * FRAME  # OUT starts at the first live frame too
    sf.write(tmp_path / "expected.wav", _speech(files[3], expected), rate)  # the same 16-bit rounding
    gap = np.abs(out - sf.read(tmp_path / "expected.wav", dtype="float32")[0]).reshape(LIVE, FRAME).max(-1)
    assert gap.max() <= 1.01 / 2**15, f"speech parts at frame {int(np.argmax(gap > 1.01 / 2**15))}"  # a last bit


def test_mimis_rule_changes_the_users_codes_past_10_s(files):
    """The tests above fail with moshi's Mimi rule: the input's codes part from the fork's once Mimi's ring is full."""
    root, _, _, ref_mimi = files
    fork, moshi = _user_codes(ref_mimi, root), _user_codes(ref_mimi, root, "moshi")
    parted = [i for i, (a, b) in enumerate(zip(fork, moshi, strict=True)) if a != b]
    assert parted and parted[0] >= MIMI_WINDOW_FRAMES - 1 and len(parted) >= 3, parted


def test_audio_voice_matches_the_reference_rules(files, tmp_path):
    root = files[0]
    cfg = load_lm(files[1]).cfg
    mimi = load_mimi(root / "mimi.safetensors", mimi_ring_rule(DEMO_MIMI, cfg))
    codes = load_audio_voice(root / "voice.wav", mimi, cfg).codes  # checked in test_voices
    assert codes is not None and len(codes) == 8  # 0.6 s at 12.5 Hz, rounded up
    expected = _expected(files, ROLE, codes=codes.tolist(), audio="short.wav")
    _check(_infer(files, tmp_path, ROLE, "voice.wav", audio="short.wav"), expected, SHORT_LIVE)


def test_int8_weights_match_the_reference_rules_on_the_dequantized_weights(files, tmp_path):
    """PersonaPlex has no q8 checkpoint: `--weights-dtype int8` quantizes it as it loads, by moshi's recipe (the
    text head left float)."""
    root, weights, ref_lm, ref_mimi = files
    _, dequantized = quantized_reference(ref_lm, text_head=False)
    state = torch.load(root / "voice.pt", weights_only=True)
    preset = (state["embeddings"][:, 0], len(VOICE_CODES), state["cache"][0].tolist())
    args = _args(
        root, weights, tmp_path, "--text-prompt", ROLE, "--voice-prompt", str(root / "voice.pt"), audio="short.wav"
    )
    assert main([*args, "--weights-dtype", "int8"]) == 0
    ours = [json.loads(line) for line in (tmp_path / "tokens.jsonl").read_text().splitlines()]
    expected = _expected((root, weights, dequantized, ref_mimi), ROLE, preset=preset, audio="short.wav")
    _check(ours, expected, SHORT_LIVE)


def test_one_prompt_word_changes_the_output(files, tmp_path):
    base = _infer(files, tmp_path, ROLE, "voice.pt", audio="short.wav")
    other = _infer(files, tmp_path, ROLE.replace("weather", "ocean"), "voice.pt", audio="short.wav")
    assert len(base) == len(other) == SHORT_LIVE
    assert base[0] == other[0]  # the first live frame is forced: padding and silence
    assert base != other


def _refused(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_bad_prompts_are_refused(files, tmp_path, capsys):
    root, weights, _, _ = files

    def run(*extra: str, config=None) -> str:
        return _refused(_args(root, weights, tmp_path, *extra, config=config), capsys)

    assert "--voice-prompt needs --text-prompt too" in run("--voice-prompt", str(root / "voice.pt"))
    assert "--text-prompt needs --voice-prompt too" in run("--text-prompt", ROLE)
    assert "--text-prompt is empty" in run("--text-prompt", "  ", "--voice-prompt", str(root / "voice.pt"))
    missing = run("--text-prompt", ROLE, "--voice-prompt", str(root / "nope.pt"))
    assert "--voice-prompt voice file not found" in missing
    (tmp_path / "junk.wav").write_bytes(b"RIFF not really a wav file")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    (tmp_path / "voice.txt").write_text("hello")
    torch.save({"embeddings": torch.zeros(3, 1, 1, 7), "cache": torch.zeros(1, 17, 5)}, tmp_path / "other.pt")
    for name, message in (
        ("junk.wav", "cannot read audio"),
        ("junk.pt", "not a PersonaPlex voice preset"),
        ("voice.txt", "not a voice file"),
        ("other.pt", "another model's voice"),
    ):
        err = run("--text-prompt", ROLE, "--voice-prompt", str(tmp_path / name))
        assert "error: --voice-prompt" in err and message in err, err

    config = json.loads((root / "config.json").read_text())
    (tmp_path / "short.json").write_text(json.dumps({**config, "context": 30}))
    err = run("--text-prompt", ROLE, "--voice-prompt", str(root / "voice.pt"), config=tmp_path / "short.json")
    assert "--text-prompt makes a prompt of" in err and "the model's context is 30 frames" in err, err


def test_a_prompt_needs_a_personaplex_model(files, tmp_path, capsys):
    sf.write(tmp_path / "in.wav", speech_like(0.2, 24000)[:, 0], 24000)
    args = ["infer", str(tmp_path / "in.wav"), str(tmp_path / "out.wav")]  # the demo model: Moshi, no prompt
    err = _refused([*args, "--text-prompt", ROLE, "--voice-prompt", str(files[0] / "voice.pt")], capsys)
    assert "--text-prompt needs a PersonaPlex model" in err
