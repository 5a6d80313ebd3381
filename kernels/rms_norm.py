"""RMSNorm as the reference computes it: in fp32, weight `alpha` used as is, eps inside the root.

The Triton kernel and its dispatcher come with the kernels issue; this is the torch reference they are tested
against and the path used on CPU.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`x * alpha * rsqrt(mean(x^2) + eps)` over the last dim, computed in fp32, returned in `x.dtype`."""
    x32 = x.float()
    var = x32.pow(2).mean(dim=-1, keepdim=True).add_(eps)
    return (x32 * (alpha.float() * torch.rsqrt(var))).to(x.dtype)
