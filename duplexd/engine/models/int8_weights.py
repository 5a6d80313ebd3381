"""Projection weights as int8 codes with an fp32 scale per output channel: weight-only int8 (W8A16).

The format is the one of Kyutai's q8 checkpoints (bitsandbytes' LLM.int8 layout): codes [out, in] and each output
row's absmax (`SCB`), dequantized weight = codes * absmax / 127. It halves the bytes a decode step reads (the step
is weight-bandwidth bound at small batches) and the memory the weights take, which is what lets a 24 GB card hold
a dozen sessions. Activations stay in the model's dtype; the kernel converts the codes in registers and applies the
scale after an fp32 accumulation (`kernels.w8a16_matmul`), so no dequantized copy of a weight is ever made.

Codes keep the checkpoint's [out, in] orientation (the kernel reads a row's inputs contiguously), unlike duplexd's
float weights, which are [in, out]. The scales stay fp32 whatever the model's dtype: `Int8Weight` moves with the
model but is never cast (casting them to bf16 is what breaks moshi's own q8 loader).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol, cast, runtime_checkable

import torch
from torch import nn

from duplexd.kernels.cpu_matmul import matmul
from duplexd.kernels.w8a16_matmul import check_w8a16_kernel, int8_matmul

WEIGHT_DTYPES = ("bf16", "int8")  # bf16: the model's float dtype (fp32 on CPU), as `--kv-dtype bf16` is
QMAX = 127.0

# The LMModel parameters that int8 weights replace: every temporal and DepFormer projection, the DepFormer's input
# projections and its audio heads; the text head is a switch (`TEXT_HEAD`). Embeddings and norms stay float, as in
# Kyutai's q8 files.
_PROJECTIONS = re.compile(r"(layers|dep_layers)\.\d+\.(wqkv|wo|w_in|w_out)|dep_in|dep_heads")
TEXT_HEAD = "text_head"

# Every LMModel weight by part, as `weight_dtypes` (and `duplexd capacity`) names them.
_PARTS = {
    "projections": re.compile(r"(layers|dep_layers)\.\d+\.(wqkv|wo|w_in|w_out)|dep_in"),
    "audio_heads": re.compile(r"dep_heads"),
    "text_head": re.compile(TEXT_HEAD),
    "extra_heads": re.compile(r"extra_heads"),
    "embeddings": re.compile(r"(dep_)?(text|audio)_emb"),
    "norms": re.compile(r"(.+\.)?\w*norm"),
}


class Int8Slice(NamedTuple):
    """One weight set of a stacked `Int8Weight` (a DepFormer step): views, no copy."""

    codes: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # fp32 [out]: absmax / 127
    kernel: str = "tiles"  # the Triton kernel that multiplies by it (`kernels.w8a16_matmul.W8A16_KERNELS`)


class Int8Weight(nn.Module):
    """Codes int8 [*lead, out, in], the file's absmax fp32 [*lead, out] (kept to write q8 files exactly) and the
    dequantization factor `scale` = absmax / 127 the kernel multiplies by. `lead` stacks weight sets (one per
    DepFormer step); indexing picks one."""

    codes: torch.Tensor
    absmax: torch.Tensor
    scale: torch.Tensor
    kernel: str  # the Triton kernel that multiplies by it (`use_int8_kernel`)

    def __init__(self, lead: tuple[int, ...], out: int, inp: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.kernel = "tiles"
        self.register_buffer("codes", torch.empty(*lead, out, inp, dtype=torch.int8, device=device))
        self.register_buffer("absmax", torch.empty(*lead, out, dtype=torch.float32, device=device))
        self.register_buffer("scale", torch.empty(*lead, out, dtype=torch.float32, device=device))

    def __getitem__(self, index: int) -> Int8Slice:
        return Int8Slice(self.codes[index], self.scale[index], self.kernel)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Int8Weight:
        # `model.to(torch.bfloat16)` must move these buffers, never cast them.
        for name, t in self._buffers.items():
            if t is not None:
                moved = fn(t)
                self._buffers[name] = moved if moved.dtype == t.dtype else t.to(device=moved.device)
        return self

    def set_from_absmax_(self) -> None:
        """Recompute `scale` after `absmax` was written (a q8 file holds only the absmax)."""
        torch.div(self.absmax, QMAX, out=self.scale)

    def dequantized(self) -> torch.Tensor:
        """The float weight it stands for, fp32, in duplexd's [*lead, in, out] orientation: `codes * absmax / 127`
        as the reference dequantizes."""
        return (self.codes.float() * self.absmax.unsqueeze(-1) / QMAX).transpose(-1, -2)

    def extra_repr(self) -> str:
        return f"codes={list(self.codes.shape)}"


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and absmax of each row of `weight` [..., out, in] by moshi's recipe (bitsandbytes'
    `int8_vectorwise_quant` on `weight.half()`): absmax of the fp16 row, codes = round-half-even(w * 127 / absmax).
    An all-zero row gets zero codes (the recipe would divide 0 by 0)."""
    half = weight.half()
    absmax = half.abs().amax(dim=-1).float()
    codes = torch.round(half * (QMAX / absmax.unsqueeze(-1)))
    return torch.where(absmax.unsqueeze(-1) > 0, codes, 0.0).to(torch.int8), absmax


Weight = torch.Tensor | Int8Weight | Int8Slice
Projection = Callable[[torch.Tensor, Weight], torch.Tensor]


def project(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """`x @ W` for a float weight [in, out] or an int8 one."""
    if isinstance(w, torch.Tensor):
        return matmul(x, w)
    return int8_matmul(x, w.codes, w.scale, w.kernel)


def use_int8_kernel(model: nn.Module, kernel: str) -> None:
    """Every int8 weight of `model` multiplied by the Triton kernel `kernel` from the next call on (a CUDA graph
    keeps the one it captured)."""
    check_w8a16_kernel(kernel)
    for module in model.modules():
        if isinstance(module, Int8Weight):
            module.kernel = kernel


def projection(model: nn.Module) -> Projection:
    """What `model`'s projections run, decided once per weight layout rather than per call: the float matmul
    itself when no weight is int8 (the float path pays no type check per projection and step), else `project`."""
    return project if int8_names(model) else cast(Projection, matmul)


def weight_dtypes(model: nn.Module) -> dict[str, str]:
    """The format each part of an LM's weights is held in, "int8" (codes with fp32 row scales) or the float dtype:
    what `--weights-dtype int8` changes and what it leaves (embeddings, norms, the text head). Parts the model
    lacks (STT's extra heads, a text-only model's DepFormer) are left out."""
    held = [(name, "int8") for name in int8_names(model)]
    held += [(name, str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters() if p.numel()]
    found: dict[str, set[str]] = {}
    for name, dtype in held:
        part = next((part for part, rule in _PARTS.items() if rule.fullmatch(name)), None)
        if part is None:
            raise ValueError(f"{name}: in no part of the LM's weights")
        found.setdefault(part, set()).add(dtype)
    return {part: "+".join(sorted(found[part])) for part in _PARTS if part in found}


def quantizable(names: Iterable[str], text_head: bool = True) -> list[str]:
    """The parameter names among `names` that int8 weights replace."""
    return [n for n in names if _PROJECTIONS.fullmatch(n) or (text_head and n == TEXT_HEAD)]


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def int8_names(model: nn.Module) -> set[str]:
    """The names of the model's int8 weights."""
    return {name for name, m in model.named_modules() if isinstance(m, Int8Weight)}


@runtime_checkable
class Projecting(Protocol):
    """A model whose projection function follows its weights' kind (`LMModel`): told when a weight changes kind."""

    def bind_projections(self) -> None: ...


def _rebind(model: nn.Module) -> None:
    if isinstance(model, Projecting):
        model.bind_projections()


def int8_layout_(model: nn.Module, names: Iterable[str]) -> None:
    """Replace the float parameters `names` (shape [*lead, in, out]) with uninitialised int8 weights on the same
    device (works on `meta`); the model's `project` follows."""
    for name in names:
        owner, leaf = _owner(model, name)
        p = getattr(owner, leaf)
        *lead, inp, out = p.shape
        delattr(owner, leaf)
        setattr(owner, leaf, Int8Weight(tuple(lead), out, inp, device=p.device))
    _rebind(model)


def quantize_(model: nn.Module, names: Iterable[str]) -> None:
    """Quantize the float parameters `names` in place (on their device), by `quantize_rows`."""
    for name in names:
        owner, leaf = _owner(model, name)
        p = getattr(owner, leaf)
        codes, absmax = quantize_rows(p.detach().transpose(-1, -2))
        int8_layout_(model, [name])
        w = getattr(owner, leaf)
        w.codes.copy_(codes)
        w.absmax.copy_(absmax)
        w.set_from_absmax_()


def dequantize_(model: nn.Module, names: Iterable[str], dtype: torch.dtype) -> None:
    """Replace the int8 weights `names` with float parameters in `dtype` (a q8 file served with float weights); the
    model's `project` follows."""
    for name in names:
        owner, leaf = _owner(model, name)
        w = getattr(owner, leaf)
        assert isinstance(w, Int8Weight), name
        delattr(owner, leaf)
        owner.register_parameter(leaf, nn.Parameter(w.dequantized().to(dtype).contiguous(), requires_grad=False))
    _rebind(model)
