"""Kyutai TTS against moshi 0.2.13's `TTSModel.generate` (temperature 0, fp32, CPU) on a perturbed random config
that keeps every mechanism: cross-attention to the voice with its position embedding, the `control` and `cfg`
tables summed in, the muxed second text stream, low-rank DepFormer embeddings, a weight schedule with unequal
groups, delays [0, 0, 2, ...], an audio delay of 5 steps (not 16), and a 12-step context, so the window slides."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from moshi.models.tts import Entry, StateMachine, TokenIds, script_to_entries
from safetensors.torch import save_file

from duplexd.engine.models.int8_weights import int8_names
from duplexd.engine.tts.checkpoint import load_conditioner
from duplexd.engine.tts.conditioning import Conditioner
from duplexd.engine.tts.config import tts_config_from_dict
from duplexd.engine.tts.demo import tts_keys
from duplexd.engine.tts.generate import TTSGen, Voice, generate
from duplexd.engine.tts.words import Word, WordFeeder, script_words
from duplexd.engine.weights.checkpoint import load_lm
from duplexd.engine.weights.config_file import lm_config_from_dict

from .ref_models import quantized_reference, reference_tts, tuned_tts_lm

pytestmark = pytest.mark.usefixtures("one_thread")

SPEAKER_DIM, FRAMES = 8, 125
RAW = {
    "dim": 64,
    "text_card": 40,
    "n_q": 6,
    "dep_q": 6,
    "card": 50,
    "num_heads": 4,
    "num_layers": 3,
    "hidden_scale": 4.125,
    "context": 12,
    "max_period": 10000,
    "delays": [0, 0, 2, 2, 2, 2, 2],
    "depformer_dim": 32,
    "depformer_dim_feedforward": 96,
    "depformer_num_heads": 2,
    "depformer_num_layers": 2,
    "depformer_weights_per_step": True,
    "depformer_weights_per_step_schedule": [0, 1, 1, 2, 2, 2],
    "depformer_low_rank_embeddings": 8,
    "demux_second_stream": True,
    "cross_attention": True,
    **tts_keys(SPEAKER_DIM, 64, audio_delay=0.4),
}
DELAY_STEPS = 5  # int(0.4 * 12.5)


def reference_tts_lm(voice_path, seed: int = 0):
    """moshi's LM for RAW, redrawn and leaning to start words (`tuned_tts_lm`), calibrated on the first script."""
    return tuned_tts_lm(
        RAW, lambda lm: reference_generate(lm, [script_words([SCRIPTS[0]], encode)], [voice_path]), seed
    )


def encode(word: str) -> list[int]:
    """A stand-in tokenizer: 1 to 3 ids in 4..39 from the word's letters (every letter counts)."""
    h = sum((i + 1) * ord(c) for i, c in enumerate(word))
    return [4 + (h * (7 + 2 * i) + i) % 36 for i in range(min(3, 1 + len(word) // 4))]


class Tokenizer:
    def encode(self, word: str) -> list[int]:  # moshi's script_to_entries calls tokenizer.encode
        return encode(word)


SCRIPTS = [
    "Hello there, this is a (short) test: of the speech model’s words.",
    'One two <break time="0.4s"/> three four five six seven.',
]


SAID: dict[tuple, Any] = {}  # what each side says for the same arguments, computed once per `models`


def once(key: tuple, compute: Callable[[], Any]) -> Any:
    if key not in SAID:
        SAID[key] = compute()
    return SAID[key]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    SAID.clear()
    tmp = tmp_path_factory.mktemp("tts")
    voices = []
    for k in range(2):
        emb = torch.randn(1, SPEAKER_DIM, FRAMES, generator=torch.Generator().manual_seed(10 + k))
        voice_path = tmp / f"voice{k}.safetensors"
        save_file({"speaker_wavs": emb}, str(voice_path))
        voices.append((emb[0], voice_path))
    ref = reference_tts_lm(voices[0][1])
    path = tmp / "tts.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    (tmp / "config.json").write_text(json.dumps(RAW))
    cfg = lm_config_from_dict(RAW)
    tts = tts_config_from_dict(RAW)
    assert tts is not None and tts.delay_steps == DELAY_STEPS
    model = load_lm(path, cfg)
    conditioner = Conditioner(tts, cfg.dim)
    load_conditioner(conditioner, path)
    yield ref, model, conditioner, tts, voices
    SAID.clear()


def reference_generate(ref_lm, scripts: list[list[Word]], voice_paths, cfg_coef: float = 2.0, n_q: int = 6):
    tts = reference_tts(copy.deepcopy(ref_lm), DELAY_STEPS, max_gen_length=400, n_q=n_q)
    entries = [[Entry(list(w.tokens), w.text, w.padding) for w in words] for words in scripts]
    attributes = [tts.make_condition_attributes([path], cfg_coef=cfg_coef) for path in voice_paths]
    return tts.generate(entries, attributes)


def duplexd_generate(
    models, scripts, voice_indices, cfg_value: str = "2.0", n_q: int | None = None, temperature=0.0, seed: int = 0
):
    _, model, conditioner, tts, voices = models
    gen = TTSGen(model, conditioner, tts, num_slots=len(scripts), n_q=n_q)
    chosen = [Voice((voices[k][0],), (("control", "ok"), ("cfg", cfg_value))) for k in voice_indices]
    return generate(gen, scripts, chosen, temperature, seed, max_steps=400)


def moshi_says(models, scripts: list[list[Word]], voice_indices: list[int], n_q: int = 6):
    """`reference_generate` on the float model in those voices, run once per module for the same arguments."""
    voices = models[4]
    key = ("moshi", tuple(map(tuple, scripts)), tuple(voice_indices), n_q)
    return once(key, lambda: reference_generate(models[0], scripts, [voices[k][1] for k in voice_indices], n_q=n_q))


def duplexd_says(models, scripts: list[list[Word]], voice_indices: list[int], n_q: int = 6, temperature=0.0, seed=0):
    """`duplexd_generate` (a fresh `TTSGen` of one slot a script, cfg "2.0"), run once per module for the same
    arguments."""
    key = ("duplexd", tuple(map(tuple, scripts)), tuple(voice_indices), n_q, temperature, seed)
    return once(
        key, lambda: duplexd_generate(models, scripts, voice_indices, n_q=n_q, temperature=temperature, seed=seed)
    )


def test_script_words_are_moshis_entries():
    for script in SCRIPTS + ["", "  spaced   out  ", 'a <break time="1.5s"/> b'], ["Hi (you):", "me too"]:
        turns = script if isinstance(script, list) else [script]
        ours = script_words(turns, encode, padding_between=1)
        theirs = script_to_entries(Tokenizer(), TokenIds(41), 12.5, turns, multi_speaker=True, padding_between=1)
        assert [(list(w.tokens), w.text, w.padding) for w in ours] == [(e.tokens, e.text, e.padding) for e in theirs]


def test_word_feeder_follows_moshis_state_machine():
    """Random samples (NEW_WORD, PAD and others) through both machines, step by step."""
    words = script_words([SCRIPTS[1] + " " + SCRIPTS[0]], encode)
    for ahead in (0, 2):
        theirs = StateMachine(TokenIds(41), second_stream_ahead=ahead, max_padding=5, initial_padding=2)
        ours = WordFeeder(41, second_stream_ahead=ahead, max_padding=5, initial_padding=2)
        state_t = theirs.new_state([Entry(list(w.tokens), w.text, w.padding) for w in words])
        state_o = ours.start(words)
        gen = torch.Generator().manual_seed(ahead)
        for step in range(150):
            sampled = int(torch.tensor([0, 3, 3, 7])[torch.randint(0, 4, (1,), generator=gen)])
            assert ours.next_token(step, state_o, sampled) == theirs.process(step, state_t, sampled), step
        assert state_o.end_step == state_t.end_step is not None
        assert state_o.consumed_at == state_t.consumption_times
        assert state_o.transcript == state_t.transcript


def test_one_script_matches_generate(models):
    words = script_words([SCRIPTS[0]], encode)
    theirs = moshi_says(models, [words], [0])
    ours = duplexd_says(models, [words], [0])[0]
    frames = [f[0, :, 0].tolist() for f in theirs.frames]
    assert theirs.end_steps[0] is not None and len(frames) > 3 * DELAY_STEPS
    assert ours.frames == frames
    assert (ours.end_step, ours.consumed_at, ours.transcript) == (
        theirs.end_steps[0],
        theirs.all_consumption_times[0],
        theirs.all_transcripts[0],
    )
    # Not degenerate: the model's own NEW_WORD samples start most words, not the padding limit.
    started = {step for step, (sampled, _) in enumerate(theirs.logged_text_tokens[0]) if sampled == 0}
    by_model = sum(step in started for step in ours.consumed_at)
    assert by_model >= len(ours.consumed_at) // 2, (by_model, len(ours.consumed_at))
    assert len({tuple(f[1:]) for f in frames[DELAY_STEPS + 2 :]}) > 5, "varied audio"


def test_a_batch_matches_generate(models):
    """Two scripts of different lengths in two voices, batched, as moshi batches them (one step for both)."""
    scripts = [script_words([text], encode) for text in SCRIPTS]
    theirs = moshi_says(models, scripts, [0, 1])
    ours = duplexd_says(models, scripts, [0, 1])
    for b, result in enumerate(ours):
        assert result.frames == [f[b, :, 0].tolist() for f in theirs.frames], f"script {b}"
        assert result.consumed_at == theirs.all_consumption_times[b]
    assert ours[0].end_step != ours[1].end_step


@pytest.mark.parametrize("n_q", [6, 4])
def test_fewer_codebooks_say_what_generate_says_with_them(models, n_q):
    """moshi's `TTSModel(n_q=4)` on a 6-codebook model sets `lm.dep_q = 4`: the DepFormer samples 4 codebooks and
    the temporal transformer reads the zero token for the other 2. Two scripts batched in two voices: the frames
    (1 + n_q a row), end steps and consumption steps are generate's; 4 codebooks are not the first 4 of 6 (what
    the model reads back changes what it says next)."""
    scripts = [script_words([text], encode) for text in SCRIPTS]
    theirs = moshi_says(models, scripts, [0, 1], n_q=n_q)
    ours = duplexd_says(models, scripts, [0, 1], n_q=n_q)
    for b, result in enumerate(ours):
        frames = [f[b, :, 0].tolist() for f in theirs.frames]
        assert len(frames[0]) == 1 + n_q
        assert result.frames == frames, f"script {b}"
        assert (result.end_step, result.consumed_at) == (theirs.end_steps[b], theirs.all_consumption_times[b])
    if n_q < 6:
        full = duplexd_says(models, scripts, [0, 1])
        assert [[row[: 1 + n_q] for row in r.frames] for r in full] != [r.frames for r in ours]


def test_codebooks_outside_the_model_are_refused(models):
    _, model, conditioner, tts, _ = models
    for n_q in (0, 7):
        with pytest.raises(ValueError, match=f"n_q={n_q}: the model says 1 to 6 codebooks"):
            TTSGen(model, conditioner, tts, 1, n_q=n_q)


@pytest.mark.parametrize(
    ("temperature", "pad", "n_q"), [(0.0, False, 6), (0.0, True, 6), (0.6, False, 6), (0.6, True, 6), (0.0, True, 4)]
)
def test_sessions_at_different_positions_match_each_alone(models, temperature, pad, n_q):
    """Slot 1 starts 7 steps after slot 0 (so one is in its audio delay while the other speaks) and slot 0 ends
    first; each gives the frames it gives alone, greedy or sampled, saying every codebook or 4 of 6. With `pad`,
    every step runs as a CUDA graph runs it: at a bucket of 4 rows (the others the scratch slot's), every row sampled
    and through the DepFormer."""
    _, model, conditioner, tts, voices = models
    scripts = [script_words([text], encode) for text in SCRIPTS]
    alone = [duplexd_says(models, [words], [k], n_q, temperature, seed=k)[0].frames for k, words in enumerate(scripts)]
    gen = TTSGen(model, conditioner, tts, num_slots=3, buckets=(4,), pad=pad, n_q=n_q)
    frames: list[list[list[int]]] = [[], []]
    gen.start(2, scripts[0], Voice((voices[0][0],)))  # slot 2 runs alongside, to be left out of a step
    for step in range(len(alone[1]) + 30):
        if step == 0:
            gen.start(0, scripts[0], Voice((voices[0][0],)), temperature, seed=0)
        if step == 7:
            gen.start(1, scripts[1], Voice((voices[1][0],)), temperature, seed=1)
        slots = [s for s, begun in ((0, True), (1, step >= 7), (2, step % 3 == 0)) if begun]
        slots = [s for s in slots if s == 2 or len(frames[s]) < len(alone[s])]
        if not slots:
            continue
        out, valid = gen.step(slots)
        for row, slot in enumerate(slots):
            if slot < 2 and valid[row]:
                frames[slot].append(out[row].tolist())
    assert frames == alone
    assert (int(gen.offsets[gen.scratch]) > 0) == pad  # the padding rows ran, in the scratch slot


@pytest.mark.parametrize("change", ["word", "voice", "cfg"])
def test_frames_change_with_the_input(models, change):
    words = script_words([SCRIPTS[0]], encode)
    base = duplexd_says(models, [words], [0])[0].frames
    if change == "word":
        words = script_words([SCRIPTS[0].replace("short", "shirt")], encode)
        assert [w.tokens for w in words] != [w.tokens for w in script_words([SCRIPTS[0]], encode)]
    other = duplexd_generate(models, [words], [1 if change == "voice" else 0], "3.5" if change == "cfg" else "2.0")
    assert other[0].frames != base


def test_bad_input_is_refused_clearly(models):
    _, model, conditioner, tts, voices = models
    with pytest.raises(ValueError, match=r"must be \[8, 125\]"):
        conditioner.cross_source([torch.zeros(8, 100)])
    with pytest.raises(ValueError, match="1 to 5"):
        conditioner.cross_source([])
    with pytest.raises(ValueError, match="'2.2' is not one of"):
        conditioner.sum_vector({"control": "ok", "cfg": "2.2"})


def test_sampling_is_seeded(models):
    """At temperature 0.6 (the model's default): a seed gives the same frames every time (a fresh run against the
    module's first run of it), another seed others."""
    words = script_words([SCRIPTS[1]], encode)

    def run(seed: int) -> list[list[int]]:
        return duplexd_generate(models, [words], [1], temperature=0.6, seed=seed)[0].frames

    first = duplexd_says(models, [words], [1], temperature=0.6, seed=1)[0].frames
    assert run(1) == first and run(2) != first


def test_two_voices_as_moshi_servers_worker_builds_them(models):
    """moshi-server's TTS worker conditions on `[voice, voice]` (the same file twice): two of the five speaker places
    filled. duplexd given the embedding twice gives generate's frames with those attributes."""
    ref_lm, _, _, _, voices = models
    words = script_words([SCRIPTS[1]], encode)
    tts = reference_tts(copy.deepcopy(ref_lm), DELAY_STEPS, max_gen_length=400)
    entries = [[Entry(list(w.tokens), w.text, w.padding) for w in words]]
    theirs = tts.generate(entries, [tts.make_condition_attributes([voices[0][1]] * 2, cfg_coef=2.0)])
    _, model, conditioner, tts_cfg, _ = models
    gen = TTSGen(model, conditioner, tts_cfg, num_slots=1)
    ours = generate(gen, [words], [Voice((voices[0][0], voices[0][0]))], max_steps=400)[0]
    assert ours.frames == [f[0, :, 0].tolist() for f in theirs.frames]
    single = duplexd_generate(models, [words], [0])[0]
    assert single.frames != ours.frames  # one voice place or two is another conditioning


@pytest.mark.parametrize("n_q", [6, 4])
def test_words_streamed_one_a_step_give_generates_frames(models, n_q):
    """Words arriving one per step (as moshi-server's Rust side feeds its worker), the text's end after the last:
    the slot steps only when `ready` (the next word and two lookahead words there, or the text complete) and gives
    generate's frames (with every codebook, or 4 of 6); a second slot whose words come in a burst later waits
    meanwhile without holding it up."""
    _, model, conditioner, tts, voices = models
    words = script_words([SCRIPTS[0]], encode)
    theirs = moshi_says(models, [words], [0], n_q=n_q)
    alone = duplexd_says(models, [words], [0], n_q=n_q)[0]
    assert alone.frames == [f[0, :, 0].tolist() for f in theirs.frames]
    gen = TTSGen(model, conditioner, tts, num_slots=2, n_q=n_q)
    gen.start(0, [], Voice((voices[0][0],)))
    gen.start(1, [], Voice((voices[1][0],)))
    frames: list[list[int]] = []
    waited, calls = 0, 0
    while len(frames) < len(alone.frames):
        calls += 1
        if calls <= len(words):
            gen.push(0, words[calls - 1 : calls])
        elif calls == len(words) + 1:
            gen.finish(0)
        if calls == 20:
            gen.push(1, words[:4])
        slots = [slot for slot in (0, 1) if gen.ready(slot)]
        waited += 0 not in slots
        if not slots:
            continue
        out, valid = gen.step(slots)
        if 0 in slots and valid[slots.index(0)]:
            frames.append(out[slots.index(0)].tolist())
    assert frames == alone.frames
    assert waited == 2  # the first word's two lookahead words came with the next two calls
    late = gen.states[1]  # four words, no end: it took two and waits for more, never past its words
    assert late is not None and len(late.consumed_at) == 2 and late.end_step is None and not gen.ready(1)


def test_a_q8_file_as_moshi_writes_it_says_what_moshi_says_on_its_weights(models, tmp_path):
    """moshi's q8 model (every Linear a `QLinear`: the projections, and the cross-attention, the demux matrices, the
    low-rank DepFormer embeddings and the conditioners' projections too) saved as its file: duplexd holds the
    projections as int8 weights, dequantizes the rest as it loads, and gives the frames of moshi's generate on the
    dequantized weights (fp32); the float file quantized as it loads holds the same codes, and the frames differ
    from the float model's (the quantization is applied)."""
    ref_lm, float_model, _, tts, voices = models
    q8, dequantized = quantized_reference(ref_lm)
    path = tmp_path / "tts.q8.safetensors"
    save_file({k: v.contiguous() for k, v in q8.state_dict().items()}, str(path))
    cfg = lm_config_from_dict(RAW)
    model = load_lm(path, cfg)
    names = int8_names(model)
    assert len(names) == 4 * 3 + 4 * 2 + 3  # temporal and DepFormer projections, dep_in, dep_heads, the text head
    conditioner = Conditioner(tts, cfg.dim)
    load_conditioner(conditioner, path)
    scripts = [script_words([text], encode) for text in SCRIPTS]
    theirs = reference_generate(dequantized, scripts, [voices[0][1], voices[1][1]])
    ours = generate(TTSGen(model, conditioner, tts, 2), scripts, [Voice((voices[k][0],)) for k in (0, 1)])
    for b, result in enumerate(ours):
        assert result.frames == [f[b, :, 0].tolist() for f in theirs.frames], f"script {b}"
    floats = duplexd_says(models, scripts, [0, 1])
    assert [r.frames for r in ours] != [r.frames for r in floats]
    float_path = tmp_path / "tts.safetensors"
    save_file({k: v.contiguous() for k, v in ref_lm.state_dict().items()}, str(float_path))
    quantized = load_lm(float_path, cfg, weights_dtype="int8", int8_text_head=True)
    assert int8_names(quantized) == names
    for name in names:
        assert torch.equal(quantized.get_submodule(name).codes, model.get_submodule(name).codes), name
