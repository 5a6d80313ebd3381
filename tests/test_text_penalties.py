"""Repetition penalty and pad_mult: the torch reference and the Triton kernels (interpreter) against the rules
stated as plain Python, and the defaults leave every token bit-identical."""

from __future__ import annotations

import pytest
import torch

from duplexd.kernels.dispatch import force_triton
from duplexd.kernels.sampling import sample, sample_reference, sample_triton
from duplexd.kernels.text_penalties import (
    repetition_penalty,
    repetition_penalty_reference,
    repetition_penalty_triton,
    text_penalties_reference,
)

PAD, EOP, START = 3, 0, 32000
SKIP = (PAD, EOP, START)


def rules(
    logits: list[float], history: list[int], penalty: float, context: int, pad_mult: float, temperature: float
) -> list[float]:
    """The Rust server's rules, one row, as loops over lists."""
    out = list(logits)
    met: list[int] = []
    for token in history:  # newest first
        if len(met) == context:
            break
        if token < 0 or token in SKIP:
            continue
        met.append(token)
    for token in set(met):
        x = torch.tensor(logits[token], dtype=torch.float32)
        out[token] = float(x / penalty if x >= 0 else x * penalty)
    if temperature > 0 and pad_mult != 0:
        add = float(torch.tensor(temperature, dtype=torch.float32) * torch.tensor(pad_mult, dtype=torch.float32))
        if add != 0:
            out[PAD] = float(torch.tensor(out[PAD], dtype=torch.float32) + add)
    return out


def _batch(rows: int, vocab: int, hist_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 4  # positive and negative
    # Histories full of duplicates and special tokens, with empty (-1) tails of random lengths.
    history = torch.randint(0, 12, (rows, hist_len), generator=g)
    history[:, 1::4] = torch.tensor(SKIP)[torch.randint(0, 2, (rows, 1), generator=g)]
    for row in range(rows):
        history[row, torch.randint(0, hist_len + 1, (1,), generator=g).item() :] = -1
    penalty = torch.rand(rows, generator=g) * 3 + 0.2  # < 1 and > 1
    context = torch.randint(0, hist_len + 10, (rows,), generator=g)  # shorter and longer than the history
    pad_mult = torch.randn(rows, generator=g) * 2
    temperature = torch.rand(rows, generator=g) + 0.1
    temperature[::3] = 0.0  # greedy rows
    return logits, history, penalty, context, pad_mult, temperature


def _expected(logits, history, penalty, context, pad_mult, temperature) -> torch.Tensor:
    return torch.tensor(
        [
            rules(
                logits[r].tolist(),
                history[r].tolist(),
                penalty[r].item(),
                int(context[r]),
                pad_mult[r].item(),
                temperature[r].item(),
            )
            for r in range(len(logits))
        ],
        dtype=torch.float32,
    )


@pytest.mark.parametrize("hist_len", [3, 7, 40])
def test_reference_and_kernel_follow_the_rules(hist_len):
    logits, history, penalty, context, pad_mult, temperature = _batch(9, 50, hist_len, seed=hist_len)
    expected = _expected(logits, history, penalty, context, pad_mult, temperature)
    got = text_penalties_reference(logits, history, penalty, context, SKIP, PAD, pad_mult, temperature)
    assert torch.equal(got, expected)
    zero = torch.zeros_like(pad_mult)
    no_pad = _expected(logits, history, penalty, context, zero, temperature)
    kernel = repetition_penalty_triton(logits, history, penalty, context, SKIP)
    assert torch.equal(kernel, no_pad)
    assert torch.equal(repetition_penalty_reference(logits, history, penalty, context, SKIP), no_pad)
    assert not torch.equal(kernel, logits)  # some rows were penalised


def test_bf16_and_strided_inputs():
    logits, history, penalty, context, *_ = _batch(5, 64, 16, seed=3)
    wide = torch.zeros(5, 80).bfloat16()
    wide[:, :64] = logits.bfloat16()
    view = wide[:, :64]
    ref = repetition_penalty_reference(view, history, penalty, context, SKIP)
    assert ref.dtype == torch.float32
    assert torch.equal(repetition_penalty_triton(view, history, penalty, context, SKIP), ref)


def _sampling(rows: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    top_k = torch.randint(1, vocab, (rows,), generator=g)
    return top_k, torch.randint(0, 2**31, (rows,), generator=g), torch.randint(0, 500, (rows,), generator=g)


@pytest.mark.parametrize("vocab, block_v", [(50, 64), (301, 128)])
def test_triton_sampling_with_pad_mult_draws_the_reference_tokens(vocab, block_v):
    logits, history, penalty, context, pad_mult, temperature = _batch(12, vocab, 20, seed=vocab)
    pad_mult[::2] = torch.randn(6) * 8  # strong either way: the pad token wins or vanishes
    top_k, seeds, frames = _sampling(12, vocab, seed=vocab)
    penalised = repetition_penalty_reference(logits, history, penalty, context, SKIP)
    ref = sample_reference(penalised, temperature, top_k, seeds, frames, 0, PAD, pad_mult)
    got = sample_triton(
        penalised, temperature, top_k, seeds, frames, 0, PAD, pad_mult, rows_per_program=4, block_v=block_v
    )
    assert torch.equal(got, ref)
    # ... and the same as sampling the fully penalised logits (pad bias included) with no pad_mult.
    full = text_penalties_reference(logits, history, penalty, context, SKIP, PAD, pad_mult, temperature)
    assert torch.equal(ref, sample_reference(full, temperature, top_k, seeds, frames, 0))
    greedy = temperature == 0
    assert torch.equal(ref[greedy], penalised[greedy].argmax(-1))  # greedy: pad_mult has no effect


def test_pad_mult_moves_the_pad_token():
    rows, vocab = 256, 30
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5)).expand(rows, vocab).contiguous()
    logits[:, PAD] = 1.0
    args = (torch.ones(rows), torch.full((rows,), vocab), torch.arange(rows), torch.zeros(rows, dtype=torch.long))
    counts = []
    for mult in (-4.0, 0.0, 4.0):
        tokens = sample_reference(logits, *args, 0, PAD, torch.full((rows,), mult))
        counts.append(int((tokens == PAD).sum()))
    assert counts[0] < counts[1] < counts[2] and counts[2] > rows // 2, counts


def test_defaults_are_bit_identical():
    """penalty 1 and pad_mult 0: the same logits (bit for bit, -0.0 included) and tokens as no penalties."""
    logits, history, _, context, _, temperature = _batch(16, 64, 30, seed=9)
    logits[:, PAD] = -0.0
    logits[:, :8] = 0.0
    ones, zeros = torch.ones(16), torch.zeros(16)
    top_k, seeds, frames = _sampling(16, 64, seed=9)
    for penalise in (repetition_penalty_reference, repetition_penalty_triton):
        out = penalise(logits, history, ones, context, SKIP)
        assert torch.equal(out.view(torch.int32), logits.view(torch.int32))
    plain = sample_reference(logits, temperature, top_k, seeds, frames, 0)
    assert torch.equal(sample_reference(logits, temperature, top_k, seeds, frames, 0, PAD, zeros), plain)
    plain_triton = sample_triton(logits, temperature, top_k, seeds, frames, 0, rows_per_program=4)
    assert torch.equal(
        sample_triton(logits, temperature, top_k, seeds, frames, 0, PAD, zeros, rows_per_program=4), plain_triton
    )


def test_a_penalty_changes_greedy_tokens():
    logits, history, _, _, _, _ = _batch(8, 40, 10, seed=11)
    logits = logits.abs()
    logits[:, [EOP, PAD]] = -1.0
    history[:, 0] = logits.argmax(-1)  # the current favourite was just said
    strong, context = torch.full((8,), 1e6), torch.full((8,), 10)
    greedy = torch.zeros(8)
    args = (torch.ones(8, dtype=torch.long), torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long), 0)
    for path in (False, True):
        with force_triton(path):
            penalised = repetition_penalty(logits, history, strong, context, SKIP)
            tokens = sample(penalised, greedy, *args)
        assert not (tokens == logits.argmax(-1)).any()
        assert torch.equal(tokens, repetition_penalty_reference(logits, history, strong, context, SKIP).argmax(-1))
