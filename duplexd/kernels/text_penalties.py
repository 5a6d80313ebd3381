"""The Rust server's repetition penalty on text logits, per row, before temperature and sampling.

A row's history [H] holds its latest sampled text tokens, newest first; -1 marks an empty entry. Walking it from
the newest, tokens in `skip` (padding, end of padding, the text start token) and empty entries are passed over,
and the walk stops after `context` other tokens, duplicates included. Each distinct token met is penalised once:
a logit x >= 0 becomes x / penalty, a negative one x * penalty; penalty 1.0 changes nothing (exactly).

Both paths write out[t] = f(logits[t]) for every token t met, reading the untouched input: a duplicate writes the
very same value again, so "once" needs no de-duplication, and the kernel's lanes cannot race on a value.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .dispatch import use_triton
from .sampling import pad_bias_reference


def _penalised_tokens(history: torch.Tensor, context: torch.Tensor, vocab: int, skip: tuple[int, ...]) -> torch.Tensor:
    """[B, H] bool: the history entries the walk penalises."""
    valid = (history >= 0) & (history < vocab)
    for token in skip:
        valid &= history != token
    return valid & (valid.cumsum(dim=1) <= context[:, None])


def repetition_penalty_reference(
    logits: torch.Tensor, history: torch.Tensor, penalty: torch.Tensor, context: torch.Tensor, skip: tuple[int, ...]
) -> torch.Tensor:
    """fp32 copy of `logits` [B, V] penalised by each row's `history` [B, H], `penalty` [B] and `context` [B].

    Touches only the history's entries, not the whole vocabulary (the CPU engine runs this every step): entries
    the walk does not penalise are sent to a spare column past the vocabulary, so their writes cannot undo a
    penalised duplicate's."""
    batch, vocab = logits.shape
    out = torch.empty(batch, vocab + 1, dtype=torch.float32, device=logits.device)
    out[:, :vocab] = logits
    out[:, vocab] = 0.0
    tokens = torch.where(_penalised_tokens(history, context, vocab, skip), history, vocab)
    x = out.gather(1, tokens)
    p = penalty.float()[:, None]
    out.scatter_(1, tokens, torch.where(x >= 0, x / p, x * p))
    return out[:, :vocab]


def text_penalties_reference(
    logits: torch.Tensor,
    history: torch.Tensor,
    penalty: torch.Tensor,
    context: torch.Tensor,
    skip: tuple[int, ...],
    pad_id: int,
    pad_mult: torch.Tensor,
    temperature: torch.Tensor,
) -> torch.Tensor:
    """The text logits a row's draw sees: repetition penalty, then T * pad_mult at `pad_id` where T > 0 (the
    sampling kernel folds that second part into its loads)."""
    penalised = repetition_penalty_reference(logits, history, penalty, context, skip)
    return pad_bias_reference(penalised, temperature, pad_mult, pad_id)


@triton.jit
def _repetition_penalty_kernel(
    in_ptr,
    out_ptr,
    hist_ptr,
    penalty_ptr,
    context_ptr,
    vocab,
    in_stride,
    out_stride,
    hist_stride,
    hist_len,
    skip0,
    skip1,
    skip2,
    BLOCK_H: tl.constexpr,
):
    """One row per program: the whole history at once, a running count of the tokens that are not skipped."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_H)
    tokens = tl.load(hist_ptr + row * hist_stride + j, mask=j < hist_len, other=-1)
    valid = (tokens >= 0) & (tokens < vocab) & (tokens != skip0) & (tokens != skip1) & (tokens != skip2)
    seen = tl.cumsum(valid.to(tl.int32), axis=0)
    context = tl.load(context_ptr + row).to(tl.int32)
    used = valid & (seen <= context)
    penalty = tl.load(penalty_ptr + row).to(tl.float32)
    x = tl.load(in_ptr + row * in_stride + tokens, mask=used, other=0.0).to(tl.float32)
    y = tl.where(x >= 0, tl.math.div_rn(x, penalty), x * penalty)
    tl.store(out_ptr + row * out_stride + tokens, y, mask=used)


def repetition_penalty_triton(
    logits: torch.Tensor, history: torch.Tensor, penalty: torch.Tensor, context: torch.Tensor, skip: tuple[int, ...]
) -> torch.Tensor:
    """Triton `repetition_penalty`: a fp32 copy of the logits, then the kernel reads the input, writes the copy."""
    if len(skip) > 3:
        raise ValueError("at most 3 skipped tokens")
    skip = tuple(skip) + (-1,) * (3 - len(skip))
    batch, vocab = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    history = history if history.stride(-1) == 1 else history.contiguous()
    out = logits.to(torch.float32, copy=True)
    _repetition_penalty_kernel[(batch,)](
        logits,
        out,
        history,
        penalty.contiguous(),
        context.contiguous(),
        vocab,
        logits.stride(0),
        out.stride(0),
        history.stride(0),
        history.shape[1],
        *skip,
        BLOCK_H=triton.next_power_of_2(max(history.shape[1], 1)),
    )
    return out


def repetition_penalty(
    logits: torch.Tensor, history: torch.Tensor, penalty: torch.Tensor, context: torch.Tensor, skip: tuple[int, ...]
) -> torch.Tensor:
    """Penalised fp32 copy of `logits` [B, V] (see the module docstring); Triton on CUDA, torch elsewhere."""
    if use_triton(logits):
        return repetition_penalty_triton(logits, history, penalty, context, skip)
    return repetition_penalty_reference(logits, history, penalty, context, skip)
