"""The Gemma 4 transcriber against `transformers` on the tiny random demo model (fp32, CPU).

Reference: `Gemma4Processor` (chat template, feature extractor, audio-token expansion) and
`Gemma4ForConditionalGeneration.generate(do_sample=False)` on the whole utterance. duplexd's side streams it
80 ms at a time. The whole span is compared, the last tokens included: the stream ends as the extractor pads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duplexd.clients.audio import speech_like, write_wav
from duplexd.commands import cli
from duplexd.engine.transcription.transcriber import STEP_SAMPLES, Transcriber, num_audio_tokens

from .gemma4_ref import generate, hf_inputs, needs_transformers

pytestmark = needs_transformers
MAX_NEW = 16
# Odd lengths: a partial last step with 0-7 valid frames, an exact multiple of the step, one sample past it.
LENGTHS = [9_999, 17_337, 15_360, 15_361, 26_111]


def utterance(n: int, seed: int) -> np.ndarray:
    return speech_like(n / 16_000 + 0.01, seed=seed, sample_rate=16_000)[:n]


@pytest.fixture(scope="module")
def tr(gemma4_folder):
    return Transcriber.from_pretrained(gemma4_folder, max_slots=4, max_new_tokens=MAX_NEW)


_refs: dict[tuple[int, int], list[int]] = {}


def hf_tokens(hf, n: int, seed: int) -> list[int]:
    """The reference transcript (new tokens up to, not including, end of turn); memoised across tests."""
    if (n, seed) not in _refs:
        _refs[(n, seed)] = generate(hf, utterance(n, seed), MAX_NEW)
    return _refs[(n, seed)]


def test_prompt_and_token_count_match_processor(gemma4_hf, tr):
    proc, _ = gemma4_hf
    for n in [161, 162, 1280, 1281, 9_999, 15_360, 15_361]:
        inp = hf_inputs(proc, utterance(n, 0))
        ids = inp["input_ids"][0].tolist()
        count = ids.count(tr.audio_token_id)
        assert count == num_audio_tokens(n) == proc._compute_audio_num_tokens(np.zeros(n), 16_000)
        assert ids == tr.prompt_ids(count)


def test_soft_tokens_match_reference_to_the_last(gemma4_hf, tr):
    """Every soft token of the stream, the final partial step's included, equals HF's get_audio_features."""
    proc, model = gemma4_hf
    for n in LENGTHS:
        wave = utterance(n, 1)
        inp = hf_inputs(proc, wave)
        with torch.no_grad():
            ref = model.model.get_audio_features(inp["input_features"], inp["input_features_mask"])
        ref_soft = ref.pooler_output[ref.attention_mask]
        slot = tr.open_stream()
        for start in range(0, n, 1000):  # chunks that do not line up with steps
            tr.feed(slot, wave[start : start + 1000])
        soft = tr.flush(slot)
        tr.close(slot)
        assert soft.shape == ref_soft.shape
        err = float((soft - ref_soft).abs().max() / ref_soft.abs().max())
        assert err < 1e-5, (n, err)


@pytest.mark.parametrize("n", LENGTHS)
def test_transcript_matches_generate(gemma4_hf, tr, n):
    ours = tr.transcribe(utterance(n, 1))
    ref = hf_tokens(gemma4_hf, n, 1)
    assert ours == ref
    assert len(ref) >= 4 and len(set(ref)) >= 3, f"degenerate reference transcript {ref}"


def test_batch_equals_each_alone(gemma4_hf, tr):
    """Three utterances of different lengths, fed interleaved in ragged chunks, decoded as one batch."""
    lengths = [LENGTHS[0], LENGTHS[1], LENGTHS[4]]
    waves = [utterance(n, 1) for n in lengths]
    slots = [tr.open_stream() for _ in waves]
    for start in range(0, max(lengths), 777):
        for slot, wave in zip(slots, waves, strict=True):
            if start < len(wave):
                tr.feed(slot, wave[start : start + 777])
    batch = tr.finish_many(slots)
    for slot in slots:
        tr.close(slot)
    assert batch == [hf_tokens(gemma4_hf, n, 1) for n in lengths]
    assert len({tuple(t) for t in batch}) == 3


def test_one_changed_step_changes_the_transcript(gemma4_hf, tr):
    n = LENGTHS[1]
    wave = utterance(n, 1)
    changed = wave.copy()
    changed[5 * STEP_SAMPLES : 6 * STEP_SAMPLES] *= -0.5  # one 80 ms step
    ours = tr.transcribe(changed)
    assert ours != hf_tokens(gemma4_hf, n, 1)
    # and the reference agrees on the changed audio too
    proc, model = gemma4_hf
    inp = hf_inputs(proc, changed)
    with torch.no_grad():
        out = model.generate(**inp, do_sample=False, max_new_tokens=MAX_NEW)
    assert ours == out[0, inp["input_ids"].shape[1] :].tolist()[: len(ours)]


def test_slots_run_out_and_come_back(tr):
    slots = [tr.open_stream() for _ in range(tr.state.max_slots)]
    with pytest.raises(RuntimeError, match="slots are in use"):
        tr.open_stream()
    for slot in slots:
        tr.close(slot)
    assert tr.open_stream() == slots[0]
    tr.close(slots[0])


def test_cli_transcribes_a_file(gemma4_folder, tmp_path, capsys):
    path = tmp_path / "a.wav"
    write_wav(path, speech_like(1.3, seed=2), 24_000)  # resampled to 16 kHz by the reader
    assert cli.main(["transcribe", str(path), "--model", str(gemma4_folder), "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip()


def test_cli_errors(gemma4_folder, tmp_path, capsys):
    path = tmp_path / "a.wav"
    write_wav(path, speech_like(0.5, seed=2), 16_000)
    assert cli.main(["transcribe", str(tmp_path / "missing.wav"), "--model", str(gemma4_folder)]) == 2
    assert "cannot read audio" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["transcribe", str(path), "--model", str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("duplexd transcribe: error: --model ") and "\n" not in err
    assert cli.main(["transcribe", str(path), "--model", str(tmp_path / "nowhere")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_past_30_s_is_dropped_as_the_reference_does(tr):
    slot = tr.open_stream()
    wave = utterance(31 * 16_000, 3)
    for start in range(0, len(wave), 16_000):
        tr.feed(slot, wave[start : start + 16_000])
    assert tr.flush(slot).shape[0] == num_audio_tokens(len(wave)) == 750
    with pytest.raises(RuntimeError, match="finished"):
        tr.feed(slot, wave[:1280])
    tr.close(slot)


def test_demo_is_written_once(tmp_path, monkeypatch):
    from duplexd.engine.weights import gemma4_demo

    first = gemma4_demo.ensure_gemma4_demo(tmp_path)
    assert (first / "model.safetensors").is_file() and (first / "tokenizer.json").is_file()
    monkeypatch.setattr(gemma4_demo, "write_demo", lambda *a, **k: pytest.fail("written twice"))
    assert gemma4_demo.ensure_gemma4_demo(tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary folder left behind
