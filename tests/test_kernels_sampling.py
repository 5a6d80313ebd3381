"""Batched top-k sampling: the Triton kernel (interpreter) draws the same tokens as the torch reference.

Greedy is argmax, top-k never leaves the top k (ties at the k-th logit go to the lowest token ids), draws follow
softmax(logits / T) over the top k (chi-square), and a row's draw depends on its (seed, frame, stream) only.
"""

from __future__ import annotations

import pytest
import torch

from duplexd.kernels.dispatch import force_triton
from duplexd.kernels.sampling import FrameSampler, sample, sample_reference, sample_triton
from duplexd.kernels.testing import INT_POISON, poisoned_allocations

CHI2_999 = {5: 20.515}  # chi-square critical values at p = 0.001 by degrees of freedom


def _batch(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    temperature = torch.rand(n, generator=g) * 1.5
    temperature[::4] = 0.0  # greedy rows mixed in
    top_k = torch.randint(1, vocab + 40, (n,), generator=g)  # k = 1 and k > V included
    seeds = torch.randint(0, 2**40, (n,), generator=g)  # wider than 32 bits: only the low bits count
    frames = torch.randint(0, 5000, (n,), generator=g)
    return logits, temperature, top_k, seeds, frames


@pytest.mark.parametrize("vocab, rows_per_program, block_v", [(301, 4, 512), (301, 2, 128), (2048, 8, 2048)])
def test_triton_draws_the_reference_tokens(vocab, rows_per_program, block_v):
    args = _batch(9, vocab, seed=vocab + block_v)
    with poisoned_allocations():
        got = sample_triton(*args, stream=3, rows_per_program=rows_per_program, block_v=block_v)
    assert (got != INT_POISON).all()
    assert torch.equal(got, sample_reference(*args, stream=3))


def test_bf16_logits_and_greedy_is_first_argmax():
    logits, _, top_k, seeds, frames = _batch(6, 200, seed=1)
    logits = logits.round().bfloat16()  # many exact ties, including at the maximum
    zero = torch.zeros(6)
    got = sample_triton(logits, zero, top_k, seeds, frames, stream=0, rows_per_program=8)
    assert torch.equal(got, logits.float().argmax(-1))


def test_top_k_never_leaves_the_top_k_with_ties():
    """Integer logits (ties everywhere); a hot temperature makes every candidate likely."""
    n, vocab = 256, 40
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(0, 6, (n, vocab), generator=g).float()
    top_k = torch.randint(1, 12, (n,), generator=g)
    got = sample_triton(
        logits,
        torch.full((n,), 50.0),
        top_k,
        torch.arange(n),
        torch.zeros(n, dtype=torch.long),
        stream=1,
        rows_per_program=64,
    )
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices  # ties: lowest ids first
    for row in range(n):
        assert got[row] in order[row, : top_k[row]], row
    assert len(set(got.tolist())) > 20


def test_chi_square_on_a_small_vocabulary():
    vocab, k, temperature, n = 12, 6, 0.8, 4096
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    top = logits.topk(k).indices
    expected = torch.softmax(logits[top] / temperature, 0) * n
    for draw in (sample_triton, sample_reference):
        extra = {"rows_per_program": 1024} if draw is sample_triton else {}
        out = draw(
            logits.expand(n, vocab),
            torch.full((n,), temperature),
            torch.full((n,), k),
            torch.full((n,), 11),
            torch.arange(n),
            stream=2,
            **extra,
        )
        assert torch.isin(out, top).all()
        observed = torch.stack([(out == t).sum() for t in top]).double()
        chi2 = ((observed - expected) ** 2 / expected).sum()
        assert chi2 < CHI2_999[k - 1], (draw.__name__, chi2, observed, expected)


def test_same_seed_and_step_same_token_whatever_the_batch():
    logits, temperature, top_k, seeds, frames = _batch(10, 97, seed=4)
    temperature = temperature + 0.5
    full = sample_triton(logits, temperature, top_k, seeds, frames, stream=5, rows_per_program=4)
    for perm in (torch.tensor([7, 3, 1]), torch.tensor([2]), torch.randperm(10, generator=torch.Generator())):
        part = sample_triton(
            logits[perm], temperature[perm], top_k[perm], seeds[perm], frames[perm], stream=5, rows_per_program=8
        )
        assert torch.equal(part, full[perm])
    other_stream = sample_triton(logits, temperature, top_k, seeds, frames, stream=6, rows_per_program=4)
    assert not torch.equal(other_stream, full)


def test_dispatcher():
    args = _batch(3, 50, seed=5)
    assert torch.equal(sample(*args, stream=0), sample_reference(*args, stream=0))
    with force_triton():
        assert torch.equal(sample(*args, stream=0), sample_reference(*args, stream=0))


@pytest.mark.parametrize("vocab, top_k", [(2048, 250), (301, 25), (40, 64)])
def test_frame_sampler_draws_the_reference_tokens(vocab, top_k):
    """The CPU DepFormer's sampler: per-frame keys, a token-hash table, numpy's uint32 hashes, an unordered top k."""
    for seed in range(20):
        logits, temperature, _, seeds, frames = _batch(6, vocab, seed)
        seeds[1] = -(2**40)  # negative seeds: only the low 32 bits count
        sampler = FrameSampler(temperature, top_k, seeds, frames, range(1, 33))
        for stream in (1, 2, 17, 32):
            expected = sample_reference(logits, temperature, torch.full((6,), top_k), seeds, frames, stream)
            assert torch.equal(sampler(stream, logits), expected)
