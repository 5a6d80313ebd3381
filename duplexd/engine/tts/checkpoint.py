"""A Kyutai TTS checkpoint's conditioner weights (`condition_provider.conditioners.*`, fp32 in the file): the
voice projection and padding row, and each lookup table with its projection and padding row. The LM's own
tensors are loaded by `weights.checkpoint.load_lm_weights`, which leaves these to this module."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models.lm import LMModel
from ..weights.checkpoint import (
    CONDITIONING_PREFIX,
    KeyMap,
    dequantized_q8,
    key_map,
    load_mapped,
    param_view,
    q8_keys,
)
from .conditioning import Conditioner


def conditioner_key_map(conditioner: Conditioner) -> list[KeyMap]:
    cfg, dim = conditioner.cfg, conditioner.dim
    pre = CONDITIONING_PREFIX
    rows = []
    if cfg.speaker_dim:
        rows += [
            KeyMap(f"{pre}speaker_wavs.output_proj.weight", (dim, cfg.speaker_dim), "speaker_proj", transposed=True),
            KeyMap(f"{pre}speaker_wavs.learnt_padding", (1, 1, dim), "speaker_padding"),
        ]
    for name, table in cfg.tables.items():
        rows += [
            KeyMap(f"{pre}{name}.embed.weight", (table.n_bins + 1, table.dim), f"tables.{name}"),
            KeyMap(f"{pre}{name}.output_proj.weight", (dim, table.dim), f"table_proj.{name}", transposed=True),
            KeyMap(f"{pre}{name}.learnt_padding", (1, 1, dim), f"table_padding.{name}"),
        ]
    return rows


def load_conditioner(conditioner: Conditioner, path: Path) -> None:
    """Fill `conditioner` from the checkpoint at `path` (a q8 file's projections dequantized); `CheckpointError` on
    a missing or misshapen tensor."""
    tensors: dict[str, torch.Tensor] = dict(conditioner.named_parameters())
    q8 = q8_keys(path)
    rows = [r for row in conditioner_key_map(conditioner) for r in (dequantized_q8(row) if row.key in q8 else [row])]
    load_mapped(
        tensors,
        path,
        lambda naming: rows,
        what="conditioner ",
        ignore=lambda key: not key.startswith(CONDITIONING_PREFIX),
    )


def save_tts_weights(model: LMModel, conditioner: Conditioner, path: str | Path, naming: str = "module") -> None:
    """Write a TTS model as Kyutai's file holds it (LM and conditioners in one safetensors file, loadable by moshi).
    The DepFormer's low-rank text matrix, which the reference builds but never uses beside the muxed embedding,
    is written as zeros."""
    lm_tensors: dict[str, torch.Tensor] = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    out = {
        row.key: torch.zeros(row.shape) if row.param is None else param_view(lm_tensors, row).reshape(row.shape)
        for row in key_map(model.cfg, naming, model.cfg.dep_q)
    }
    params: dict[str, torch.Tensor] = dict(conditioner.named_parameters())
    out |= {row.key: param_view(params, row).reshape(row.shape) for row in conditioner_key_map(conditioner)}
    save_file({key: tensor.contiguous() for key, tensor in out.items()}, str(path))
