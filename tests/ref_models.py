"""Random-weight reference (`moshi`) models for parity tests and benchmarks, with every constant perturbed."""

from __future__ import annotations

import os

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # the reference compiles RMSNorm on CPU otherwise (≈10 s)

import torch  # noqa: E402
from moshi.models import loaders  # noqa: E402
from moshi.models.lm import LMModel as RefLMModel  # noqa: E402

from duplexd.engine.config import LMConfig  # noqa: E402


def reference_kwargs(cfg: LMConfig) -> dict:
    kw = dict(loaders._lm_kwargs)
    kw.update(cfg.to_reference_json())
    return kw


@torch.no_grad()
def perturb_(module: torch.nn.Module, seed: int = 0) -> None:
    """Give norm weights (which start at exactly 1) random values so a dropped or misplaced weight shows."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("alpha"):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))


def reference_lm(cfg: LMConfig, seed: int = 0) -> RefLMModel:
    torch.manual_seed(seed)
    lm = loaders.get_moshi_lm(None, lm_kwargs=reference_kwargs(cfg), device="cpu", dtype=torch.float32)
    perturb_(lm, seed)
    return lm.eval()


def fused_state_dict(lm: RefLMModel, cfg: LMConfig) -> dict[str, torch.Tensor]:
    """The reference's module-naming state dict rewritten in the fused checkpoint naming."""
    out = {}
    for k, v in lm.state_dict().items():
        if ".self_attn.in_projs." in k or ".self_attn.out_projs." in k:
            continue
        out[k] = v.contiguous()
    for prefix, n in (("transformer", cfg.num_layers), ("depformer", cfg.depformer_num_layers)):
        steps = 1 if prefix == "transformer" else cfg.dep_q
        for i in range(n):
            sd = lm.state_dict()
            p = f"{prefix}.layers.{i}.self_attn."
            out[p + "in_proj_weight"] = torch.cat([sd[p + f"in_projs.{k}.weight"] for k in range(steps)]).contiguous()
            out[p + "out_proj.weight"] = torch.cat([sd[p + f"out_projs.{k}.weight"] for k in range(steps)]).contiguous()
    return out
