"""A Kyutai TTS model that says fewer than 32 codebooks, or is asked to (`--n-q`, `--tts-n-q`).

A folder laid out as Kyutai's with a 16-codebook model (its Mimi file the usual 32-codebook one) says its script
through `duplexd speak` and both servers' endpoints, with moshi's frames (`TTSModel.generate`, which decodes
`n_q` codebooks of its Mimi) and Mimi decoding 16. Asked for 12 of them, it says what moshi's `TTSModel(n_q=12)`
says. And the reference fact behind the default (all the model's codebooks): moshi-server's worker configures
`n_q = 24`, which only reaches Mimi's `set_num_codebooks`, and moshi's Mimi decodes every codebook it is given
whatever that setting, so the worker's 32 sampled codebooks are all heard.
"""

from __future__ import annotations

import copy
import json

import httpx2
import numpy as np
import pytest
import soundfile as sf
import torch
from moshi.models.tts import Entry

from duplexd.commands.cli import main
from duplexd.engine.models.config import DEMO_MIMI_32
from duplexd.engine.models.mimi import MimiStreams
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.tts.model import load_tts
from duplexd.engine.tts.words import script_words

from .live_server import running_server
from .ref_models import reference_mimi, reference_tts
from .test_asr_e2e import HEADERS, KEY, words_model
from .tts_server import (
    DELAY_STEPS,
    RAW,
    VOICES,
    assert_same,
    expected,
    run,
    say,
    url,
    voice_path,
    write_model_folder,
)

pytestmark = pytest.mark.usefixtures("one_thread")

RAW_16 = RAW | {
    "n_q": 16,
    "dep_q": 16,
    "delays": [0, 0] + [2] * 15,
    "depformer_weights_per_step_schedule": [0, 1, 1, 1] + [2] * 12,
}
# Shorter than the shared server's TEXT (52 frames, not 107: each reference run of 16 codebooks halves), its
# punctuation, parentheses and break kept, and still past the 16-step context (asserted where it is said).
TEXT = 'Hello there, a (short) test <break time="0.3s"/> words.'


@pytest.fixture(scope="module")
def folder16(tmp_path_factory):
    return write_model_folder(tmp_path_factory.mktemp("tts16"), RAW_16)


@pytest.fixture(scope="module")
def server16(folder16, tmp_path_factory):
    folder, _ = folder16
    stt = words_model(tmp_path_factory.mktemp("tts16-stt"))
    log = tmp_path_factory.mktemp("tts16-server") / "serve.log"
    args = ["--hf-repo", str(stt.root), "--api-key", KEY, "--tts", str(folder), "--tts-temperature", "0"]
    with running_server(log, *args) as live:
        yield live
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


def moshi_frames(folder16, n_q: int) -> list[list[int]]:
    """generate's frames for TEXT in the first voice, saying `n_q` codebooks (greedy, as `speak --temp 0`)."""
    folder, lm = folder16
    words = script_words([TEXT], TextTokenizer(folder / "tokenizer.model").encode, padding_between=1)
    tts = reference_tts(copy.deepcopy(lm), DELAY_STEPS, max_gen_length=600, n_q=n_q)
    entries = [[Entry(list(w.tokens), w.text, w.padding) for w in words]]
    result = tts.generate(entries, [tts.make_condition_attributes([voice_path(folder, 0)], cfg_coef=2.0)])
    assert result.end_steps[0] is not None
    return [f[0, :, 0].tolist() for f in result.frames]


@pytest.mark.parametrize("n_q", [None, 12])
def test_speak_says_a_16_codebook_model_as_moshi(folder16, tmp_path, n_q):
    folder, _ = folder16
    out, tokens = tmp_path / "out.wav", tmp_path / "out.jsonl"
    argv = ["speak", TEXT, "--model", str(folder), "--voice", VOICES[0], "--temp", "0"]
    argv += ["--out", str(out), "--tokens-out", str(tokens)] + (["--n-q", str(n_q)] if n_q else [])
    assert main(argv) == 0
    rows = [json.loads(line) for line in tokens.read_text().splitlines()]
    frames = moshi_frames(folder16, n_q or 16)
    assert [[r["text"], *r["audio"]] for r in rows] == frames
    assert len(frames) - DELAY_STEPS > RAW_16["context"]  # the speech outlasts the window: it slides
    assert len(rows[-1]["audio"]) == (n_q or 16)
    mimi = MimiStreams(load_tts(folder, n_q=n_q).mimi, 1)
    codes = torch.tensor([f[1:] for f in frames[DELAY_STEPS:]]).t()[None]
    with torch.no_grad():
        want = mimi.decode([0], codes)[0].numpy()
    audio, rate = sf.read(out, dtype="float32")  # 16-bit samples
    assert rate == 24000 and audio.shape == want.shape and np.abs(audio - np.clip(want, -1, 1)).max() < 1e-4
    assert float((audio**2).mean()) > 0


def test_both_servers_say_a_16_codebook_model_as_moshi_server(server16, folder16):
    folder, _ = folder16
    mimi = MimiStreams(load_tts(folder).mimi, 1)
    want = expected(folder16, TEXT, 0, mimi)
    got, code, _ = run(say(url(server16, f"format=PcmMessagePack&voice={VOICES[0]}"), TEXT))
    assert code == 1000
    assert_same(got, want)
    speech = np.concatenate([m["pcm"] for m in want if m["type"] == "Audio"])
    body = {"model": "tts-1", "voice": VOICES[0], "input": TEXT, "response_format": "pcm"}
    response = httpx2.post(f"{server16.url}/v1/audio/speech", json=body, headers=HEADERS, timeout=60)
    assert response.status_code == 200, response.text
    samples = np.frombuffer(response.content, "<i2").astype(np.int32)
    assert samples.shape == speech.shape
    assert np.abs(samples - (np.clip(speech, -1, 1) * 32767).astype(np.int32)).max() <= 1


def test_a_codebook_count_outside_the_model_is_one_line(folder16, tmp_path, capsys):
    folder, _ = folder16
    assert main(["speak", "hi", "--model", str(folder), "--n-q", "17", "--out", str(tmp_path / "x.wav")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--n-q 17: tts says 1 to 16 codebooks") and "\n" not in err, err


def test_moshis_mimi_decodes_every_codebook_it_is_given():
    """The reference fact the default rests on: `set_num_codebooks(24)` (what moshi-server's worker sets through
    `TTSModel.from_checkpoint_info(n_q=24)`) leaves `decode` of 32 codebooks as it was; decoding 24 differs."""
    ref = reference_mimi(seed=4, mimi_config=DEMO_MIMI_32.to_reference_dict())
    codes = torch.randint(0, DEMO_MIMI_32.card, (1, 32, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref.set_num_codebooks(32)
        all_32 = ref.decode(codes)
        ref.set_num_codebooks(24)
        told_24 = ref.decode(codes)
        first_24 = ref.decode(codes[:, :24])
    assert torch.equal(all_32, told_24)
    assert (all_32 - first_24).abs().max() > 1e-5  # the last codebooks add little, but far above rounding (1e-7)
