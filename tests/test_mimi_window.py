"""Mimi past its window: a PersonaPlex model's Mimi follows NVIDIA's fork, a Moshi model's moshi 0.2.13.

Mimi's transformers keep a ring of `context` steps at 25 Hz (250: 10 s), and each 80 ms frame writes two steps'
keys, then attends. moshi 0.2.13 labels every entry with the step it holds; the fork's older cache gives a full
ring's oldest entry a future position, so a frame's queries attend only its newest `context - 1` positions. The
rules are stated in plain Python (`ring_rules`): duplexd's mask is checked against them over explicit key sets, and
whole streams, batched with slots at different positions, against the reference Mimi with the fork's labels put in
(or moshi's own), at a short window and at the real one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from duplexd.engine.models.config import (
    DEMO_MIMI,
    MIMI,
    MOSHI_7B,
    PERSONAPLEX_7B,
    RING_RULES,
    ConfigError,
    MimiConfig,
)
from duplexd.engine.models.mimi import MimiStreams, ring_mask
from duplexd.engine.weights.checkpoint import load_mimi, mimi_ring_rule

from .ref_models import reference_mimi, sharpen_mimi_
from .ring_rules import RULES, attended, held
from .test_mimi import FS, reference_stream, speech_like

STEPS = DEMO_MIMI.downsample_stride  # transformer steps a frame writes (2)


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------- the rule and the mask


def test_the_rule_is_part_of_mimis_config():
    assert MIMI.ring_rule == "moshi" and MIMI.attention_window == MIMI.context == 250
    fork = dataclasses.replace(MIMI, ring_rule="personaplex")
    assert fork.attention_window == 249
    assert fork.to_reference_dict() == MIMI.to_reference_dict()  # the reference's Mimi takes no such key
    with pytest.raises(ConfigError, match="ring_rule 'fork' is not one of moshi, personaplex"):
        dataclasses.replace(MIMI, ring_rule="fork")
    # A frame's first step must keep a key: its own, under the rule's window.
    assert dataclasses.replace(MIMI, context=2).attention_window == 2
    with pytest.raises(ConfigError, match="context 2 leaves the first of a frame's 2 transformer steps no key"):
        dataclasses.replace(fork, context=2)
    with pytest.raises(ConfigError, match="context 1 leaves"):
        dataclasses.replace(MIMI, context=1)


def test_mimi_takes_its_lms_rule():
    assert mimi_ring_rule(MIMI, PERSONAPLEX_7B).ring_rule == "personaplex"
    assert mimi_ring_rule(DEMO_MIMI, PERSONAPLEX_7B) == dataclasses.replace(DEMO_MIMI, ring_rule="personaplex")
    assert mimi_ring_rule(MIMI, MOSHI_7B) is MIMI
    assert mimi_ring_rule(dataclasses.replace(MIMI, ring_rule="personaplex"), MOSHI_7B) == MIMI


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_the_mask_attends_the_keys_each_rule_labels(rule, steps):
    """Rows of one call at different positions in a 7-entry ring, before, at and long past its filling: each
    query attends exactly the entries whose plain-Python label is within the window of it."""
    capacity = 7
    ends = list(range(steps, 5 * capacity))  # a row's keys written after its call
    for shift in range(len(ends)):
        batch = [ends[(shift + j * 5) % len(ends)] for j in range(4)]
        positions = torch.tensor([[end - steps + t for t in range(steps)] for end in batch])
        keys = torch.tensor([held(end, capacity) for end in batch])  # what the ring holds: the true steps
        mask = ring_mask(positions, keys, capacity, capacity - RING_RULES[rule])
        for row, end in enumerate(batch):
            for t in range(steps):
                query = end - steps + t
                seen = mask[row, t].nonzero().flatten().tolist()
                assert seen == attended(rule, query, end, capacity, capacity), f"{rule}: query {query} after {end}"


# ---------------------------------------------------------------------------------------- whole streams


def _batched(model, plan: dict[int, tuple[int, torch.Tensor, torch.Tensor]], steps: int, num_slots: int):
    """Slots step together from their start frame on: `plan[slot] = (start, pcm [n * FS], codes [K, n] to decode)`.
    Per slot: (codes [K, n], pcm [n * FS]) as duplexd's batched streams made them."""
    streams = MimiStreams(model, num_slots=num_slots)
    got: dict[int, tuple[list, list]] = {slot: ([], []) for slot in plan}
    for step in range(steps):
        live = [slot for slot, (start, pcm, _) in plan.items() if start <= step < start + pcm.shape[-1] // FS]
        if not live:
            continue
        frame = {slot: step - plan[slot][0] for slot in live}
        pcm = torch.stack([plan[s][1][frame[s] * FS : (frame[s] + 1) * FS] for s in live])
        codes = streams.encode(live, pcm)
        speech = streams.decode(live, torch.stack([plan[s][2][:, frame[s] : frame[s] + 1] for s in live]))
        for i, slot in enumerate(live):
            got[slot][0].append(codes[i])
            got[slot][1].append(speech[i])
    return {slot: (torch.cat(c, -1), torch.cat(p, -1)) for slot, (c, p) in got.items()}


def _mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a != b).sum())


def _frame_gap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per frame, the largest sample difference."""
    return (a - b).view(-1, FS).abs().amax(-1)


def _load(ref, cfg: MimiConfig, rule: str, path):
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    return load_mimi(path, dataclasses.replace(cfg, ring_rule=rule))


# A short window (8 steps: 4 frames) that the streams pass many times over, in a Mimi small enough to run them all.
SHORT = MimiConfig(
    dimension=32, n_filters=4, num_heads=2, num_layers=2, dim_feedforward=48, codebook_dim=8, n_q=10, card=64, context=8
)


@pytest.fixture(scope="module")
def short_ref():
    return sharpen_mimi_(reference_mimi(seed=21, mimi_config=SHORT.to_reference_dict()))


@pytest.fixture(scope="module")
def short_signals():
    return {slot: speech_like(frames, seed=10 + slot) for slot, frames in ((3, 16), (0, 12), (2, 9))}


@pytest.fixture(scope="module")
def short_expected(short_ref, short_signals):
    return {
        rule: {slot: reference_stream(short_ref, pcm, rule) for slot, pcm in short_signals.items()}
        for rule in sorted(RULES)
    }


@pytest.mark.parametrize("rule", sorted(RULES))
def test_short_window_streams_batched_follow_the_rule(short_ref, short_signals, short_expected, rule, tmp_path):
    """Slots 3, 0 and 2 of 4 start at frames 0, 3 and 7 and step together, each many windows long."""
    model = _load(short_ref, SHORT, rule, tmp_path / "m.safetensors")
    expected = short_expected[rule]
    starts = {3: 0, 0: 3, 2: 7}
    plan = {slot: (starts[slot], pcm, expected[slot][0][0]) for slot, pcm in short_signals.items()}
    ours = _batched(model, plan, steps=16, num_slots=4)
    for slot, (codes, pcm) in ours.items():
        ref_codes, ref_pcm = expected[slot]
        assert _mismatches(codes, ref_codes[0]) <= 1, f"{rule}: slot {slot}"
        assert _frame_gap(pcm, ref_pcm[0]).max() <= 1e-5, f"{rule}: slot {slot}"
    # The rules part once a ring is full (frame 3, its 8th step), and not before: each test fails with the other.
    moshi, fork = short_expected["moshi"][3], short_expected["personaplex"][3]
    assert torch.equal(moshi[0][0, :, :3], fork[0][0, :, :3])
    gap = _frame_gap(moshi[1][0], fork[1][0])
    assert _mismatches(moshi[0], fork[0]) >= 5
    assert gap[:3].max() == 0 and gap[3] > 1e-4


# The real window (250 steps: 10 s), in the demo's tiny Mimi: slot 1 runs 11.2 s; slot 0 the same audio from 8
# frames later, so both pass the window beside each other at different positions.
LONG, LAG = 140, 8
WINDOW_FRAME = DEMO_MIMI.context // STEPS - 1  # the frame whose call fills the ring: 124, the 125th


@pytest.fixture(scope="module")
def long_ref():
    return sharpen_mimi_(reference_mimi(seed=12, mimi_config=DEMO_MIMI.to_reference_dict()))


@pytest.fixture(scope="module")
def long_signal():
    return speech_like(LONG, seed=1)


@pytest.fixture(scope="module")
def long_expected(long_ref, long_signal):
    """Per rule, the reference's (codes [8, LONG], pcm [LONG * FS]), run when first asked for."""
    runs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(rule: str) -> tuple[torch.Tensor, torch.Tensor]:
        if rule not in runs:
            codes, pcm = reference_stream(long_ref, long_signal, rule)
            runs[rule] = (codes[0], pcm[0])
        return runs[rule]

    return get


@pytest.mark.parametrize("rule", sorted(RULES))
def test_real_window_streams_batched_follow_the_rule(long_ref, long_signal, long_expected, rule, tmp_path):
    """Slots 1 and 0 of 3, the same audio 8 frames apart, past the window side by side."""
    codes, pcm = long_expected(rule)
    model = _load(long_ref, DEMO_MIMI, rule, tmp_path / "m.safetensors")
    plan = {1: (0, long_signal, codes), 0: (LAG, long_signal[: (LONG - LAG) * FS], codes[:, : LONG - LAG])}
    ours = _batched(model, plan, steps=LONG, num_slots=3)
    for slot, frames in ((1, LONG), (0, LONG - LAG)):
        assert frames > WINDOW_FRAME + 5
        assert _mismatches(ours[slot][0], codes[:, :frames]) <= 1, f"{rule}: slot {slot}"
        assert _frame_gap(ours[slot][1], pcm[: frames * FS]).max() <= 1e-5, f"{rule}: slot {slot}"


def test_the_rules_part_where_the_ring_fills(long_expected):
    """The test above fails with the other rule: speech parts at the frame whose steps fill the ring (a full ring's
    oldest left out), codes from then on."""
    moshi, fork = long_expected("moshi"), long_expected("personaplex")
    gap = _frame_gap(moshi[1], fork[1])
    assert gap[:WINDOW_FRAME].max() == 0 and gap[WINDOW_FRAME] > 0
    assert gap.max() > 1e-4  # far past float noise and the tolerance above
    parted = (moshi[0] != fork[0]).any(0).nonzero().flatten()
    assert parted.min() >= WINDOW_FRAME and _mismatches(moshi[0], fork[0]) >= 5
