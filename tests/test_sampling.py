"""Sampling: greedy at temperature 0, top-k respected, the right distribution, and batch-independent draws."""

from __future__ import annotations

import torch

from duplexd.kernels.sampling import hash32, sample


def _rows(n, **values):
    return {
        k: torch.full((n,), v, dtype=torch.float32 if isinstance(v, float) else torch.long) for k, v in values.items()
    }


def test_hash32_matches_a_python_implementation():
    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2, 12345, 0xFFFFFFFF, 0x80000000, 987654321]
    assert hash32(torch.tensor(xs)).tolist() == [lowbias32(x) for x in xs]


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    p = _rows(5, temperature=0.0, top_k=7, seeds=3, frames=4)
    out = sample(logits, p["temperature"], p["top_k"], p["seeds"], p["frames"], stream=2)
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_and_distribution():
    """Many draws over frames follow softmax(logits / T) restricted to the top k."""
    vocab, k, temperature, n = 12, 4, 0.7, 12000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 2
    p = _rows(n, temperature=temperature, top_k=k, seeds=11)
    out = sample(logits.expand(n, vocab), p["temperature"], p["top_k"], p["seeds"], torch.arange(n), stream=0)
    top = logits.topk(k).indices
    assert torch.isin(out, top).all()
    expected = torch.softmax(logits[top] / temperature, 0)
    observed = torch.stack([(out == t).float().mean() for t in top])
    assert (observed - expected).abs().max() < 0.02, (observed, expected)


def test_draws_depend_only_on_the_row_not_the_batch():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(2))
    temps = torch.tensor([0.8, 1.0, 0.5, 0.9, 1.2, 0.7])
    topk = torch.tensor([250, 30, 100, 500, 5, 60])
    seeds = torch.tensor([1, 2, 3, 4, 5, 6])
    frames = torch.tensor([0, 7, 7, 100, 3, 9])
    full = sample(logits, temps, topk, seeds, frames, stream=3)
    for perm in (torch.tensor([5, 3, 1]), torch.tensor([2]), torch.tensor([4, 0, 2, 1, 5, 3])):
        part = sample(logits[perm], temps[perm], topk[perm], seeds[perm], frames[perm], stream=3)
        assert torch.equal(part, full[perm])


def test_seed_frame_and_stream_change_the_draw():
    n = 200
    logits = torch.zeros(n, 1000)  # uniform: every draw is decided by the noise alone
    p = _rows(n, temperature=1.0, top_k=1000)
    base = sample(logits, p["temperature"], p["top_k"], torch.arange(n), torch.zeros(n, dtype=torch.long), 0)
    other_seed = sample(logits, p["temperature"], p["top_k"], torch.arange(n) + n, torch.zeros(n, dtype=torch.long), 0)
    other_frame = sample(logits, p["temperature"], p["top_k"], torch.arange(n), torch.ones(n, dtype=torch.long), 0)
    other_stream = sample(logits, p["temperature"], p["top_k"], torch.arange(n), torch.zeros(n, dtype=torch.long), 1)
    for other in (other_seed, other_frame, other_stream):
        assert (other != base).float().mean() > 0.9
    assert len(set(base.tolist())) > 150
