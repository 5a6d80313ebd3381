"""Batched temperature + top-k sampling with per-row parameters and counter-based randomness.

Each candidate token's noise is a hash of (seed, frame, stream, token id), so a session's tokens depend only on
its own seed and position, never on who shares its batch, and no generator state has to be kept or synchronised.
Keying the noise by token id (not by rank among the top k) lets the Triton kernel find the top k by a threshold
without sorting and still draw the very same token as the torch reference.

Sampling is a Gumbel-max race over the top-k logits scaled by 1/temperature, which draws from the same
distribution as the reference's softmax → top-k → exponential race. Temperature 0 is greedy argmax (first index
of the maximum). Top-k ties: the kernel breaks a tie at the k-th largest logit towards lower token ids, while
`torch.topk` leaves the order of ties unspecified, so the two may differ in rows whose k-th and (k+1)-th logits
are exactly equal.

The text stream may carry a `pad_mult` per row (the Rust server's knob): it multiplies the padding token's
probability under softmax(logits / T) by exp(pad_mult) before top-k and the draw, which is the same as adding
T * pad_mult to that token's logit first, and that is what both paths do. Greedy rows (T = 0) take the argmax of
the unmodified logits, as the Rust server does, so pad_mult has no effect on them.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ._triton import tl, triton
from .dispatch import use_triton

_M32 = 0xFFFFFFFF
_SEED_SALT = 0x9E3779B9
_TOKEN_SALT = 0x632BE5AB


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), without overflowing int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """The `lowbias32` integer hash on int64 tensors holding 32-bit values."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, frames: torch.Tensor, stream: int, tokens: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) draws [B, n] for the token ids `tokens` [B, n], keyed by each row's seed and frame.

    24 random bits as the odd integer 2m + 1 over 2^24: exact in fp32, so torch and Triton agree bit for bit.
    """
    key = hash32(hash32(hash32(seeds ^ _SEED_SALT) ^ frames) ^ stream)
    bits = hash32(key[:, None] ^ hash32(tokens + _TOKEN_SALT))
    return ((bits >> 9) * 2 + 1).float() * 2.0**-24


def pad_bias(temperature: torch.Tensor, pad_mult: torch.Tensor) -> torch.Tensor:
    """What a row adds to its padding logit: T * pad_mult, 0 for greedy rows (the Rust server's argmax ignores
    pad_mult)."""
    return torch.where(temperature > 0, temperature * pad_mult, 0.0)


def pad_bias_reference(
    logits: torch.Tensor, temperature: torch.Tensor, pad_mult: torch.Tensor, pad_id: int
) -> torch.Tensor:
    """fp32 `logits` with T * pad_mult added at `pad_id` (softmax(x / T) there times exp(pad_mult)). A zero bias
    leaves the logit untouched (not even -0.0 → +0.0), so pad_mult = 0 is bit-identical to no pad_mult."""
    out = logits.to(torch.float32, copy=True)
    add = pad_bias(temperature, pad_mult)
    out[:, pad_id] = torch.where(add != 0, out[:, pad_id] + add, out[:, pad_id])
    return out


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    frames: torch.Tensor,
    stream: int,
    pad_id: int = -1,
    pad_mult: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row of `logits` [B, V]; per-row `temperature`, `top_k`, `seeds`, `frames` [B], and
    optionally `pad_mult` [B] for token `pad_id`."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    if pad_mult is not None:
        logits = pad_bias_reference(logits, temperature, pad_mult, pad_id)
    k_max = max(1, min(int(top_k.max()), logits.shape[-1]))
    values, indices = logits.topk(k_max, dim=-1)
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, frames, stream, indices)))
    scores = values / temperature.clamp(min=1e-6)[:, None] + gumbel
    ranks = torch.arange(k_max, device=logits.device)
    scores = scores.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    sampled = indices.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(temperature > 0, sampled, greedy)


@triton.jit
def _hash32(x):
    """lowbias32 on uint32 (multiplications wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _load_block(
    logits_ptr, rows, rmask, stride, v0, vocab, pad_id, pad_add, BLOCK_V: tl.constexpr, HAS_PAD: tl.constexpr
):
    """Logits [BLOCK_B, BLOCK_V] in fp32 (-inf outside), their order-preserving uint32 keys (0 outside), mask;
    with HAS_PAD, `pad_add` [BLOCK_B] added at column `pad_id` where it is not 0."""
    cols = v0 + tl.arange(0, BLOCK_V)
    mask = rmask[:, None] & (cols[None, :] < vocab)
    x = tl.load(logits_ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=-float("inf"))
    x = x.to(tl.float32)
    if HAS_PAD:
        x = tl.where((cols == pad_id)[None, :] & (pad_add != 0)[:, None], x + pad_add[:, None], x)
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return x, tl.where(mask, key, 0), mask, cols


# `stream` is data (0 for text, 1 + step in the DepFormer), not a size: unspecialised, the value 1 does not become a
# compile-time constant, and one compiled kernel serves every stream.
@triton.jit(do_not_specialize=["stream"])
def _sample_kernel(
    logits_ptr,
    temp_ptr,
    topk_ptr,
    seed_ptr,
    frame_ptr,
    pad_mult_ptr,
    out_ptr,
    n_rows,
    vocab,
    stride,
    stream,
    pad_id,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_PAD: tl.constexpr,
):
    """BLOCK_B rows per program. Greedy argmax; the k-th largest key by a radix select; ties at that threshold
    taken in token order; then a Gumbel-max race over the candidates."""
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    rmask = rows < n_rows
    rows = rows.to(tl.int64)
    temp = tl.load(temp_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    k = tl.load(topk_ptr + rows, mask=rmask, other=1).to(tl.int32)
    k = tl.minimum(tl.maximum(k, 1), vocab)
    seed = tl.load(seed_ptr + rows, mask=rmask, other=0).to(tl.uint32)
    frame = tl.load(frame_ptr + rows, mask=rmask, other=0).to(tl.uint32)
    row_key = _hash32(_hash32(_hash32(seed ^ 0x9E3779B9) ^ frame) ^ stream.to(tl.uint32))
    no_pad = tl.zeros([BLOCK_B], tl.float32)
    if HAS_PAD:
        pad_mult = tl.load(pad_mult_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        pad_add = tl.where(temp > 0, temp * pad_mult, 0.0)
    else:
        pad_add = no_pad

    best = tl.full([BLOCK_B], -float("inf"), tl.float32)
    greedy = tl.zeros([BLOCK_B], tl.int32)
    for v0 in range(0, vocab, BLOCK_V):  # greedy: the argmax of the logits as given (no pad bias)
        x, key, mask, cols = _load_block(logits_ptr, rows, rmask, stride, v0, vocab, pad_id, no_pad, BLOCK_V, False)
        top = tl.max(x, axis=1)
        arg = tl.argmax(x, axis=1).to(tl.int32) + v0
        greedy = tl.where(top > best, arg, greedy)
        best = tl.maximum(top, best)

    # The k-th largest key, 4 bits at a time from the top: keep the largest digit d such that at least k keys
    # are >= (prefix | d); the count for d = 0 is >= k by induction, so some digit always qualifies.
    thr = tl.zeros([BLOCK_B], tl.uint32)
    digits = tl.arange(0, 16).to(tl.uint32)
    for i in tl.static_range(8):
        trials = thr[:, None] | (digits[None, :] << (28 - 4 * i))
        counts = tl.zeros([BLOCK_B, 16], tl.int32)
        for v0 in range(0, vocab, BLOCK_V):
            x, key, mask, cols = _load_block(
                logits_ptr, rows, rmask, stride, v0, vocab, pad_id, pad_add, BLOCK_V, HAS_PAD
            )
            counts += tl.sum((key[:, None, :] >= trials[:, :, None]).to(tl.int32), axis=2)
        digit = tl.sum((counts >= k[:, None]).to(tl.int32), axis=1) - 1
        thr = thr | (digit.to(tl.uint32) << (28 - 4 * i))
    above = tl.zeros([BLOCK_B], tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        x, key, mask, cols = _load_block(logits_ptr, rows, rmask, stride, v0, vocab, pad_id, pad_add, BLOCK_V, HAS_PAD)
        above += tl.sum((key > thr[:, None]).to(tl.int32), axis=1)
    ties_wanted = k - above

    inv_temp = 1.0 / tl.maximum(temp, 1e-6)
    best_score = tl.full([BLOCK_B], -float("inf"), tl.float32)
    sampled = tl.zeros([BLOCK_B], tl.int32)
    ties_seen = tl.zeros([BLOCK_B], tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        x, key, mask, cols = _load_block(logits_ptr, rows, rmask, stride, v0, vocab, pad_id, pad_add, BLOCK_V, HAS_PAD)
        tie = mask & (key == thr[:, None])
        tie_rank = tl.cumsum(tie.to(tl.int32), axis=1) + ties_seen[:, None]
        ties_seen += tl.sum(tie.to(tl.int32), axis=1)
        candidate = (key > thr[:, None]) | (tie & (tie_rank <= ties_wanted[:, None]))
        bits = _hash32(row_key[:, None] ^ _hash32(cols.to(tl.uint32) + 0x632BE5AB)[None, :])
        u = ((bits >> 9) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
        score = tl.where(candidate, x * inv_temp[:, None] - tl.log(-tl.log(u)), -float("inf"))
        top = tl.max(score, axis=1)
        arg = tl.argmax(score, axis=1).to(tl.int32) + v0
        sampled = tl.where(top > best_score, arg, sampled)
        best_score = tl.maximum(top, best_score)
    token = tl.where(temp > 0, sampled, greedy)
    tl.store(out_ptr + rows, token.to(tl.int64), mask=rmask)


def sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    frames: torch.Tensor,
    stream: int,
    pad_id: int = -1,
    pad_mult: torch.Tensor | None = None,
    rows_per_program: int = 1,
    block_v: int | None = None,
) -> torch.Tensor:
    """Triton `sample`; `rows_per_program` and `block_v` (vocabulary tile) are powers of two."""
    batch, vocab = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(batch, dtype=torch.long, device=logits.device)
    block_v = block_v or min(triton.next_power_of_2(vocab), 1024)
    _sample_kernel[(triton.cdiv(batch, rows_per_program),)](
        logits,
        temperature.contiguous(),
        top_k.contiguous(),
        seeds.contiguous(),
        frames.contiguous(),
        temperature if pad_mult is None else pad_mult.contiguous(),
        out,  # (no pad: a pointer never read)
        batch,
        vocab,
        logits.stride(0),
        stream,
        pad_id,
        BLOCK_B=rows_per_program,
        BLOCK_V=block_v,
        HAS_PAD=pad_mult is not None,
    )
    return out


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    frames: torch.Tensor,
    stream: int,
    pad_id: int = -1,
    pad_mult: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of `logits` [B, V] (int64 [B]), with `pad_mult` [B] for token `pad_id` if given;
    Triton on CUDA, the torch reference elsewhere."""
    if use_triton(logits):
        return sample_triton(logits, temperature, top_k, seeds, frames, stream, pad_id, pad_mult)
    return sample_reference(logits, temperature, top_k, seeds, frames, stream, pad_id, pad_mult)


def _hash32_np(x: np.ndarray) -> np.ndarray:
    """`hash32` on uint32 arrays, whose multiplications wrap mod 2^32 as the Triton kernel's do: 7 numpy ops
    instead of torch's 19 on int64."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


@functools.cache
def _token_hashes(vocab: int) -> np.ndarray:
    """`hash32(token + _TOKEN_SALT)` of every token id below `vocab` (uint32): the token's half of the noise key."""
    return _hash32_np(np.arange(vocab, dtype=np.uint32) + np.uint32(_TOKEN_SALT))


class FrameSampler:
    """`sample_reference` for the streams `streams` of one frame of CPU rows, the same draws in a fifth of the ops:
    the rows' temperatures and keys are read once a frame, not once a stream; the token half of the noise key
    comes from a table; the hashes run in numpy's wrapping uint32 (the float maths stays torch's, as the
    reference's). One top-k for every row (`top_k`), as the DepFormer's streams have."""

    def __init__(
        self, temperature: torch.Tensor, top_k: int, seeds: torch.Tensor, frames: torch.Tensor, streams: range
    ) -> None:
        self.top_k, self.first_stream = top_k, streams.start
        self.divisor = temperature.float().clamp(min=1e-6)[:, None]
        self.positive = temperature > 0
        self.mixed = not bool(self.positive.all())  # greedy rows (T = 0) take the argmax, as the reference's
        seed_key = _hash32_np(seeds.numpy().astype(np.uint32) ^ np.uint32(_SEED_SALT))
        row = _hash32_np(seed_key ^ frames.numpy().astype(np.uint32))
        self.keys = _hash32_np(row[:, None] ^ np.arange(streams.start, streams.stop, dtype=np.uint32)[None, :])

    def __call__(self, stream: int, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        vocab = logits.shape[-1]
        k = max(1, min(self.top_k, vocab))
        flat = logits.numpy()
        # The top k unordered (a 4th of torch.topk's time): the draw is the candidates' best score, whatever their
        # order (exact ties of two scores aside, which the reference's order breaks otherwise).
        top = np.argpartition(flat, vocab - k, axis=-1)[:, vocab - k :] if k < vocab else np.indices(flat.shape)[1]
        values = torch.from_numpy(np.take_along_axis(flat, top, axis=-1))
        column = stream - self.first_stream
        bits = _hash32_np(self.keys[:, column : column + 1] ^ _token_hashes(vocab)[top])
        noise = torch.from_numpy(((bits >> np.uint32(9)) * np.uint32(2) + np.uint32(1)).astype(np.float32))
        gumbel = -torch.log(-torch.log(noise * 2.0**-24))
        best = (values / self.divisor + gumbel).argmax(dim=-1, keepdim=True).numpy()
        sampled = torch.from_numpy(np.take_along_axis(top, best, axis=-1)[:, 0].astype(np.int64))
        return torch.where(self.positive, sampled, logits.argmax(dim=-1)) if self.mixed else sampled
