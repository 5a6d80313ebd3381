"""Sessions past the window: a PersonaPlex checkpoint follows NVIDIA's fork (a full ring attends `context - 1`
keys), a Moshi checkpoint moshi 0.2.13 (all `context`). The rules are stated in plain Python (`ring_rules`); the
paged KV cache is checked against them frame by frame and prefilled, batched with slots at other positions, and
whole PersonaPlex sessions against the reference `moshi` LM with the fork's rule put in, past the window.

Only the temporal transformer's rule is swapped in the oracle: the fork's DepFormer ring (dep_q = 16 entries, reset
every frame) fills at its last step, the user's last codebook, which duplexd does not run; the fork's Mimi also
carries the older cache (250 steps at 25 Hz), and duplexd's Mimi follows it there (test_mimi_window)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from moshi.modules.transformer import RingKVCache

from duplexd.engine.dialogue.engine import Engine, EngineConfig
from duplexd.engine.dialogue.lm_gen import LMGen
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.kv.paged import PagedKVCache
from duplexd.engine.models.config import DEMO_MIMI, RING_RULES, ConfigError, LMConfig
from duplexd.engine.models.mimi import MimiModel
from duplexd.engine.persona.prompt import Voice, build_prompt
from duplexd.engine.weights.checkpoint import load_lm, mimi_ring_rule
from duplexd.engine.weights.demo import random_lm

from .personaplex_files import PP_SMALL, write_personaplex
from .personaplex_ref import Oracle, ReferenceSession
from .ref_models import reference_lm
from .ring_rules import RULES, attended, fork_positions, held, moshi_positions
from .test_lm_parity import SMALL, _write

GREEDY = SamplingParams(text_temperature=0.0, text_topk=1, audio_temperature=0.0, audio_topk=1)
TOL = 1e-4
# Prompts of 25 and 22 frames (7-frame voices, 6 and 3 role-text tokens, 2 x 6 of silence) in a 26-frame window.
CFG = dataclasses.replace(PP_SMALL, context=26)
TEXT_A, TEXT_B = [21, 42, 99, 7, 250, 13], [5, 77, 123]
EARLY, LIVE = 5, 24  # session B steps EARLY frames alone, then both LIVE frames together: both pass the window


# ---------------------------------------------------------------------------------------- the rules themselves


@pytest.mark.parametrize("capacity", [5, 8])
def test_the_plain_python_moshi_rule_is_the_reference_cache(capacity):
    """moshi's own RingKVCache labels its ring as `moshi_positions` says, calls of one and two steps mixed."""
    cache = RingKVCache(1, 1, 1, capacity, respect_exec_mask=True, device=torch.device("cpu"), dtype=torch.float32)
    end = 0
    for call in range(4 * capacity):
        steps = 1 + call % 2
        x = torch.zeros(1, 1, steps, 1)
        _, _, positions = cache.complete(x, x, torch.tensor([True]))
        end += steps
        assert positions[0].tolist() == moshi_positions(end, capacity), f"after {end} keys"


def test_the_fork_drops_the_oldest_key_once_the_ring_is_full():
    capacity = 6
    for end in range(1, 4 * capacity):
        truth = held(end, capacity)
        assert moshi_positions(end, capacity) == truth  # every entry labelled with the step it holds
        fork = fork_positions(end, capacity)
        wrong = [i for i in range(capacity) if fork[i] != truth[i]]
        assert wrong == ([end % capacity] if end >= capacity else []), f"after {end} keys"
        if wrong:
            assert fork[wrong[0]] == end and truth[wrong[0]] == end - capacity  # the oldest, given a future step
        q = end - 1
        assert len(attended("moshi", q, end, capacity, capacity)) == min(end, capacity)
        assert len(attended("personaplex", q, end, capacity, capacity)) == min(end, capacity - 1)


# ---------------------------------------------------------------------------------------- the paged KV cache

HEADS, DIM, CONTEXT, PAGE = 2, 4, 11, 4  # a ring of 12 positions (3 pages) over an 11-frame window


def _rule_attention(rule: str, q: torch.Tensor, history: dict[int, tuple], position: int) -> torch.Tensor:
    """fp64 attention of q [H, D] at `position` (its key just written) over what `rule` lets it see."""
    end = position + 1
    truth = held(end, CONTEXT)
    seen = [truth[i] for i in attended(rule, position, end, CONTEXT, CONTEXT)]
    keys = torch.stack([history[p][0] for p in seen]).double()  # [n, H, D]
    values = torch.stack([history[p][1] for p in seen]).double()
    probs = torch.softmax(torch.einsum("hd,nhd->hn", q.double(), keys) * DIM**-0.5, dim=-1)
    return torch.einsum("hn,nhd->hd", probs, values)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("prefill_path", ["runs", "rows"])
def test_paged_cache_attends_as_the_rule_says(rule, prefill_path):
    """Slot 0 is prefilled with a whole window and slot 1 with 5 frames in one forward while slot 2 is already 7
    frames in; then all step frame by frame in changing subsets until each is past twice the window."""
    cache = PagedKVCache(
        num_layers=1,
        num_heads=HEADS,
        head_dim=DIM,
        context=CONTEXT,
        num_slots=3,
        num_pages=9,
        page_size=PAGE,
        window=CONTEXT - RING_RULES[rule],
    )
    for slot in range(3):
        cache.allocate(slot)
        cache.upload(slot)
    gen = torch.Generator().manual_seed(5)
    history: dict[int, dict[int, tuple]] = {0: {}, 1: {}, 2: {}}
    positions = {0: 0, 1: 0, 2: 0}

    def run(rows: list[tuple[int, int]], runs=None) -> None:
        q = 3 * torch.randn(len(rows), HEADS, DIM, generator=gen)  # sharp: attention far from uniform
        k, v = 3 * torch.randn(len(rows), HEADS, DIM, generator=gen), torch.randn(len(rows), HEADS, DIM, generator=gen)
        for j, (slot, p) in enumerate(rows):
            history[slot][p] = (k[j], v[j])
        view = cache.batch(torch.tensor([s for s, _ in rows]), torch.tensor([p for _, p in rows]), runs)
        out = cache.attend(0, view, q, k, v)
        for j, (slot, p) in enumerate(rows):
            expected = _rule_attention(rule, q[j], history[slot], p)
            assert (out[j].double() - expected).abs().max() <= 1e-5, f"{rule}: slot {slot} at position {p}"
        for slot, p in rows:
            positions[slot] = max(positions[slot], p + 1)

    for _ in range(7):
        run([(2, positions[2])])
    rows = [(0, p) for p in range(CONTEXT)] + [(1, p) for p in range(5)]
    run(rows, ((0, CONTEXT, 0), (CONTEXT, CONTEXT + 5, 0)) if prefill_path == "runs" else None)
    for frame in range(2 * CONTEXT + 3):
        slots = [s for s in (2, 0, 1) if (frame + s) % 4]  # varying subsets and orders
        run([(s, positions[s]) for s in slots])
    assert min(positions.values()) > 2 * CONTEXT


def test_a_window_outside_the_ring_is_refused():
    with pytest.raises(ValueError, match="window 12 of context 11"):
        PagedKVCache(num_layers=1, num_heads=1, head_dim=2, context=11, num_slots=1, num_pages=3, window=12)


# ---------------------------------------------------------------------------------------- the config and loader


def test_the_rule_is_part_of_the_config():
    assert PP_SMALL.ring_rule == "personaplex" and PP_SMALL.attention_window == PP_SMALL.context - 1
    assert dataclasses.replace(PP_SMALL, ring_rule="moshi").attention_window == PP_SMALL.context
    assert "ring_rule" not in PP_SMALL.to_reference_json()  # the reference's LMModel takes no such key
    with pytest.raises(ConfigError, match="ring_rule 'fork' is not one of moshi, personaplex"):
        dataclasses.replace(PP_SMALL, ring_rule="fork")
    with pytest.raises(ConfigError, match="context 1 leaves no key"):
        dataclasses.replace(PP_SMALL, context=1, ring_rule="personaplex")


def test_the_loader_chooses_the_rule_by_checkpoint(tmp_path):
    pp_path, _ = write_personaplex(tmp_path / "pp", CFG, seed=1)
    assert load_lm(pp_path).cfg.ring_rule == "personaplex"
    moshi_cfg = LMConfig(**SMALL, context=16)
    moshi_path = _write(reference_lm(moshi_cfg, seed=1), moshi_cfg, tmp_path, "fused")
    (tmp_path / "config.json").write_text(json.dumps(moshi_cfg.to_reference_json()))
    assert load_lm(moshi_path).cfg.ring_rule == "moshi"
    # A config given as an object is the caller's choice, kept as it is.
    assert load_lm(pp_path, dataclasses.replace(CFG, ring_rule="moshi")).cfg.ring_rule == "moshi"


def test_an_engine_refuses_an_lm_and_a_mimi_of_different_rules():
    """One server ran both with one ring cache: a Mimi attending by the other rule would part from it past 10 s of
    audio, so no engine is built on the pair; with the LM's rule (`mimi_ring_rule`) it is."""
    lm = random_lm(CFG, seed=0)
    with pytest.raises(ConfigError, match=r"Mimi's ring rule \(moshi\) is not the LM's \(personaplex\)"):
        Engine(lm, MimiModel(DEMO_MIMI), config=EngineConfig(max_sessions=1))
    Engine(lm, MimiModel(mimi_ring_rule(DEMO_MIMI, lm.cfg)), config=EngineConfig(max_sessions=1))


# ---------------------------------------------------------------------------------------- whole sessions


def _codes(n: int, seed: int) -> list[list[int]]:
    return torch.randint(0, CFG.card, (n, 8), generator=torch.Generator().manual_seed(seed)).tolist()


VOICE_A, VOICE_B = _codes(7, 1), _codes(7, 2)
USER_A, USER_B = _codes(LIVE, 3), _codes(EARLY + LIVE, 4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, ref = write_personaplex(tmp_path_factory.mktemp("pp_window"), CFG, seed=8)
    return path, ref


def _reference(ref, rule: str, text, voice, user) -> list:
    oracle = Oracle(ref, ring_rule=rule)
    try:
        session = ReferenceSession(CFG, oracle)
        session.prompt(text, codes=voice)
        return [session.live(u) for u in user]
    finally:
        oracle.close()


def _voice(codes) -> Voice:
    return Voice("v", None, len(codes), codes=torch.tensor(codes))  # type: ignore[arg-type]


def _duplexd(model, chunk: int):
    """B (slot 0) is prompted and steps EARLY frames alone; then A (slot 1) is prompted (`chunk` frames per
    forward) and both step together. Per session: [(tokens [9], text logits)] per live frame."""
    gen = LMGen(model, num_slots=2)
    for slot in (0, 1):
        gen.reset(slot, GREEDY)
    gen.prompt(0, build_prompt(CFG, _voice(VOICE_B), TEXT_B), chunk=chunk)
    outs: dict[str, list] = {"A": [], "B": []}
    for u in USER_B[:EARLY]:
        out = gen.step(torch.tensor([0]), torch.tensor([u]), return_logits=True)
        outs["B"].append((out.tokens[0].tolist(), out.text_logits[0]))
    prompt_a = build_prompt(CFG, _voice(VOICE_A), TEXT_A)
    gen.prompt(1, prompt_a, chunk=chunk)
    for a, b in zip(USER_A, USER_B[EARLY:], strict=True):
        out = gen.step(torch.tensor([1, 0]), torch.tensor([a, b]), return_logits=True)
        outs["A"].append((out.tokens[0].tolist(), out.text_logits[0]))
        outs["B"].append((out.tokens[1].tolist(), out.text_logits[1]))
    assert prompt_a.forwards + LIVE > CFG.context + 10  # A's queries run well past the window
    return outs


def _parted(ours: list, calls: list) -> int | None:
    """The first live frame whose tokens or text logits differ from the reference's, or None."""
    for frame, ((tokens, logits), call) in enumerate(zip(ours, calls, strict=True)):
        if tokens != call.output[:9] or (logits - call.text_logits).abs().max() > TOL:
            return frame
    return None


@pytest.fixture(scope="module")
def fork_reference(checkpoint):
    _, ref = checkpoint
    return {
        "A": _reference(ref, "personaplex", TEXT_A, VOICE_A, USER_A),
        "B": _reference(ref, "personaplex", TEXT_B, VOICE_B, USER_B),
    }


@pytest.mark.parametrize("chunk", [1, 1000], ids=["frame_by_frame", "prefilled"])
def test_personaplex_sessions_past_the_window_match_the_fork(checkpoint, fork_reference, chunk):
    path, _ = checkpoint
    outs = _duplexd(load_lm(path), chunk)
    for name in ("A", "B"):
        assert _parted(outs[name], fork_reference[name]) is None, f"session {name}"
    texts = {tokens[0] for tokens, _ in outs["A"]} | {tokens[1] for tokens, _ in outs["A"]}
    assert len(texts) > 3, "degenerate run: the model should emit varied tokens"


def test_moshi_rule_on_a_personaplex_checkpoint_parts_from_the_fork_at_the_window(checkpoint, fork_reference):
    """With the rule swapped, duplexd follows moshi's reference instead, and parts from the fork exactly when a
    session's ring first fills: the test above would fail with the wrong rule."""
    path, ref = checkpoint
    outs = _duplexd(load_lm(path, dataclasses.replace(load_lm(path).cfg, ring_rule="moshi")), chunk=1000)
    prompt_forwards = {"A": build_prompt(CFG, _voice(VOICE_A), TEXT_A).forwards}
    prompt_forwards["B"] = build_prompt(CFG, _voice(VOICE_B), TEXT_B).forwards
    moshi_reference = {
        "A": _reference(ref, "moshi", TEXT_A, VOICE_A, USER_A),
        "B": _reference(ref, "moshi", TEXT_B, VOICE_B, USER_B),
    }
    for name in ("A", "B"):
        assert _parted(outs[name], moshi_reference[name]) is None, f"session {name} under moshi's rule"
        # Live frame f's query is at position forwards + f, after forwards + f + 1 keys: the rules first differ
        # when that count reaches the context.
        full = CFG.context - prompt_forwards[name] - 1
        assert _parted(outs[name], fork_reference[name]) == full, f"session {name}"
