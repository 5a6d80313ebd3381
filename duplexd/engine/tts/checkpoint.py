"""A Kyutai TTS checkpoint's conditioner weights (`condition_provider.conditioners.*`, fp32 in the file): the
voice projection and padding row, and each lookup table with its projection and padding row. The LM's own
tensors are loaded by `weights.checkpoint.load_lm_weights`, which leaves these to this module."""

from __future__ import annotations

from pathlib import Path

import torch

from ..weights.checkpoint import CONDITIONING_PREFIX, KeyMap, load_mapped
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
    """Fill `conditioner` from the checkpoint at `path`; `CheckpointError` on a missing or misshapen tensor."""
    tensors: dict[str, torch.Tensor] = dict(conditioner.named_parameters())
    load_mapped(
        tensors,
        path,
        lambda naming: conditioner_key_map(conditioner),
        what="conditioner ",
        ignore=lambda key: not key.startswith(CONDITIONING_PREFIX),
    )
