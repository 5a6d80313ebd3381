"""Random-weight files in PersonaPlex's formats for tests: the LM checkpoint (Moshi naming, 16 DepFormer sets,
or only the agent's 8) and `.pt` voice presets.

The LM comes from the reference `moshi` package built with dep_q = n_q (its DepFormer then has one weight set
per audio codebook, as PersonaPlex's does), with every norm weight perturbed (`ref_models.perturb_`), so a weight
loaded into the wrong place changes the numbers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from duplexd.engine.models.config import LMConfig

from .ref_models import reference_lm

# Tiny PersonaPlex: several layers and heads, odd text vocabulary, 16 audio streams, 16 DepFormer sets; NVIDIA's ring
# rule, as the loader chooses it for a PersonaPlex file.
PP_SMALL = LMConfig(
    dim=48,
    text_card=301,
    num_heads=3,
    num_layers=2,
    depformer_dim=32,
    depformer_dim_feedforward=132,
    depformer_num_heads=2,
    depformer_num_layers=2,
    dep_q=16,
    ring_rule="personaplex",
)

# PP_SMALL reading the demo tokenizer's whole vocabulary (546 pieces), as a server with the demo tokenizer needs: a
# role text's token ids must be ones the LM can embed.
PP_DEMO_TEXT = dataclasses.replace(PP_SMALL, text_card=546)


def _step_of(key: str) -> int | None:
    """The DepFormer step a module-naming key belongs to (None for shared tensors)."""
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("depformer_in", "depformer_emb", "linears", "gating", "in_projs", "out_projs"):
            if parts[i + 1].isdigit():
                return int(parts[i + 1]) + (1 if part == "depformer_emb" else 0)  # emb k feeds step k + 1
    return None


def personaplex_state_dict(lm, cfg: LMConfig, sets: int = 16, naming: str = "module") -> dict[str, torch.Tensor]:
    """The reference LM's tensors as a PersonaPlex checkpoint holding DepFormer sets 0..sets-1."""
    module = {k: v.contiguous() for k, v in lm.state_dict().items()}
    kept = {k: v for k, v in module.items() if (step := _step_of(k)) is None or step < sets}
    if naming == "module":
        return kept
    out = {k: v for k, v in kept.items() if ".self_attn.in_projs." not in k and ".self_attn.out_projs." not in k}
    for prefix, layers, steps in (("transformer", cfg.num_layers, 1), ("depformer", cfg.depformer_num_layers, sets)):
        for i in range(layers):
            p = f"{prefix}.layers.{i}.self_attn."
            out[p + "in_proj_weight"] = torch.cat([module[p + f"in_projs.{k}.weight"] for k in range(steps)])
            out[p + "out_proj.weight"] = torch.cat([module[p + f"out_projs.{k}.weight"] for k in range(steps)])
    return out


def write_personaplex(
    root: Path, cfg: LMConfig = PP_SMALL, seed: int = 0, sets: int = 16, naming: str = "module", lm=None
) -> tuple[Path, object]:
    """`root/model.safetensors` and `root/config.json` stating the tiny sizes but not `dep_q` (PersonaPlex's own
    config.json is empty: the loader reads dep_q from the checkpoint); returns the weights' path and the reference
    LM they hold."""
    lm = lm if lm is not None else reference_lm(cfg, seed)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "model.safetensors"
    save_file(personaplex_state_dict(lm, cfg, sets, naming), str(path))
    (root / "config.json").write_text(json.dumps({k: v for k, v in cfg.to_reference_json().items() if k != "dep_q"}))
    return path, lm
