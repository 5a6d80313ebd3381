"""Mimi, the streaming neural audio codec of Moshi, with per-slot streaming state.

Encode: pcm frame (1920 samples) → causal SEANet (→ 25 Hz) → transformer → learnt strided conv (→ 12.5 Hz)
→ split RVQ (1 semantic + acoustic codebooks) → `num_codebooks` codes. Decode mirrors it: codebook sums →
channel-wise transposed conv (→ 25 Hz) → transformer → SEANet decoder → pcm.

Modules here are stateless: every streaming layer (conv left context, transposed-conv overlap, transformer KV
ring and positions) keeps its state in tensors with one row per slot, owned by `MimiStreams`. A call steps any
subset of slots; rows are read and written in place, so slots never see each other's state.

Parameter names follow the reference's module naming minus its wrapper levels (`encoder.model.0.weight` for the
reference's `encoder.model.0.conv.conv.weight`); `reference_keys` gives the exact mapping for checkpoints.
Transformer projections are stored [in, out] and multiplied through `kernels.cpu_matmul` (faster on CPU).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.cpu_matmul import MAX_ROWS, matmul
from ...kernels.rope import apply_rope, rope_angles
from .config import MimiConfig

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------- slot state


@dataclass
class _Buffer:
    """One per-slot state tensor [num_slots, ...] and the value a reset puts back."""

    data: torch.Tensor
    reset_value: float | bool | None  # None: never reset (stale entries are masked out)


class Rows:
    """The slots one call steps: `index` [B] on the device, and, when the caller knows them on the host and they
    are consecutive, a slice (state read as views, no gathers: faster on CPU). Built from host lists the caller
    already holds, never by reading `index` back, so a step never waits for the device.
    """

    def __init__(self, index: torch.Tensor, host: Sequence[int] | None = None) -> None:
        self.index = index
        self.where: slice | torch.Tensor = index
        if host is not None and len(host) and list(host) == list(range(host[0], host[0] + len(host))):
            self.where = slice(host[0], host[0] + len(host))

    def get(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.where]

    def put(self, buf: torch.Tensor, value: torch.Tensor) -> None:
        if isinstance(self.where, slice):
            buf[self.where].copy_(value)
        else:
            buf[self.where] = value


class _Ctx:
    """What a streaming layer sees during one call: the rows and its own state buffers."""

    def __init__(self, rows: Rows, state: dict[nn.Module, dict[str, _Buffer]]) -> None:
        self.rows = rows
        self.state = state

    def get(self, module: nn.Module, name: str) -> torch.Tensor:
        return self.rows.get(self.state[module][name].data)

    def put(self, module: nn.Module, name: str, value: torch.Tensor) -> None:
        self.rows.put(self.state[module][name].data, value)

    def buffer(self, module: nn.Module, name: str) -> torch.Tensor:
        return self.state[module][name].data


# --------------------------------------------------------------------------------------------------- layers


class StreamingConv1d(nn.Module):
    """Causal conv: each call is left-padded with the previous call's last inputs (zeros at start).

    `replicate`: at a slot's first call the left context is the first sample repeated (the reference's
    `pad_mode="replicate"`, used by the learnt downsample).
    """

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: int,
        stride: int = 1,
        dilation: int = 1,
        groups: int = 1,
        bias: bool = True,
        replicate: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cout, cin // groups, kernel))
        self.bias = nn.Parameter(torch.empty(cout)) if bias else None
        self.stride, self.dilation, self.groups, self.replicate = stride, dilation, groups, replicate
        self.in_channels = cin
        self.context = (kernel - 1) * dilation + 1 - stride

    def init_state(self, num_slots: int, **factory) -> dict[str, _Buffer]:
        if not self.context:
            return {}
        state = {"previous": _Buffer(torch.zeros(num_slots, self.in_channels, self.context, **factory), 0.0)}
        if self.replicate:
            state["first"] = _Buffer(torch.ones(num_slots, dtype=torch.bool, device=factory["device"]), True)
        return state

    def forward(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        if self.context:
            previous = ctx.get(self, "previous")
            if self.replicate:
                first = ctx.get(self, "first")
                previous = torch.where(first.view(-1, 1, 1), x[..., :1], previous)
                ctx.put(self, "first", torch.zeros_like(first))
            x = torch.cat([previous, x], dim=-1)
            ctx.put(self, "previous", x[..., -self.context :])
        if self.groups != 1:
            return F.conv1d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
        # im2col + one matmul: torch's CPU conv1d takes a slow generic path for most of these shapes.
        cout, cin, K = self.weight.shape
        if K == 1 and self.stride == 1:
            cols = x
        else:
            cols = x.unfold(-1, (K - 1) * self.dilation + 1, self.stride)[..., :: self.dilation]
            cols = cols.transpose(2, 3).reshape(x.shape[0], cin * K, -1)
        w, B, T = self.weight.view(cout, cin * K), x.shape[0], cols.shape[-1]
        if B * T <= MAX_ROWS:  # few output steps: weight-bound, the packed matmul wins
            y = matmul(cols.transpose(1, 2).reshape(B * T, cin * K), w.t()).view(B, T, cout).transpose(1, 2)
        elif B == 1:
            y = (w @ cols[0])[None]
        else:  # one matmul over all rows' time steps (a batched matmul here is several times slower)
            y = (w @ cols.transpose(0, 1).reshape(cin * K, -1)).view(cout, B, -1).transpose(0, 1)
        return y + self.bias[:, None] if self.bias is not None else y


class StreamingConvTranspose1d(nn.Module):
    """Causal transposed conv: the overlap tail of each call (minus bias) is added to the next call's head."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, groups: int = 1, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cin, cout // groups, kernel))
        self.bias = nn.Parameter(torch.empty(cout)) if bias else None
        self.stride, self.groups = stride, groups
        self.out_channels = cout
        self.overlap = kernel - stride

    def init_state(self, num_slots: int, **factory) -> dict[str, _Buffer]:
        if not self.overlap:
            return {}
        return {"partial": _Buffer(torch.zeros(num_slots, self.out_channels, self.overlap, **factory), 0.0)}

    def _full(self, x: torch.Tensor) -> torch.Tensor:
        """`conv_transpose1d` (untrimmed) as a matmul plus overlap-add: torch's CPU kernel for these shapes is
        its slow reference path (over half of a decode step)."""
        B, cin, T = x.shape
        K, S = self.weight.shape[-1], self.stride
        if K % S or self.groups not in (1, cin) or (self.groups == cin and self.weight.shape[1] != 1):
            return F.conv_transpose1d(x, self.weight, self.bias, S, groups=self.groups)
        m, cout = K // S, self.out_channels
        if self.groups == 1:
            z = matmul(x.transpose(1, 2).reshape(B * T, cin), self.weight.view(cin, cout * K)).view(B, T, cout, m, S)
        else:  # depthwise
            z = (x.transpose(1, 2)[..., None] * self.weight[:, 0]).view(B, T, cout, m, S)
        y = z[:, :, :, 0] if m == 1 else x.new_zeros(B, T + m - 1, cout, S)
        if m > 1:
            for j in range(m):
                y[:, j : j + T] += z[:, :, :, j]
        y = y.permute(0, 2, 1, 3).reshape(B, cout, -1)
        return y + self.bias[:, None] if self.bias is not None else y

    def forward(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        y = self._full(x)
        n = self.overlap
        if not n:
            return y
        y[..., :n] += ctx.get(self, "partial")
        tail = y[..., -n:]
        ctx.put(self, "partial", tail - self.bias[:, None] if self.bias is not None else tail)
        return y[..., :-n]


class ResidualBlock(nn.Module):
    """SEANet residual unit: x + conv1x1(elu(conv_k(elu(x)))), the hidden width `dim / compress`."""

    def __init__(self, dim: int, hidden: int, kernel: int, dilation: int) -> None:
        super().__init__()
        # Indices 1 and 3 as in the reference (0 and 2 are its ELUs).
        self.block = nn.ModuleList(
            [
                nn.ELU(),
                StreamingConv1d(dim, hidden, kernel, dilation=dilation),
                nn.ELU(),
                StreamingConv1d(hidden, dim, 1),
            ]
        )

    def forward(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        h = self.block[1](F.elu(x), ctx)
        return x + self.block[3](F.elu(h), ctx)


def _run(layers: nn.ModuleList, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    for layer in layers:
        x = F.elu(x) if isinstance(layer, nn.ELU) else layer(x, ctx)
    return x


class SEANetEncoder(nn.Module):
    """pcm [B, 1, T] → latents [B, dimension, T / hop]; ELUs sit in `model` so indices match the reference."""

    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        nf, hidden = cfg.n_filters, cfg.compress
        layers: list[nn.Module] = [StreamingConv1d(cfg.channels, nf, cfg.kernel_size)]
        mult = 1
        for ratio in reversed(cfg.ratios):
            dim = mult * nf
            layers += [
                ResidualBlock(dim, dim // hidden, cfg.residual_kernel_size, cfg.dilation_base**j)
                for j in range(cfg.n_residual_layers)
            ]
            layers += [nn.ELU(), StreamingConv1d(dim, 2 * dim, 2 * ratio, stride=ratio)]
            mult *= 2
        layers += [nn.ELU(), StreamingConv1d(mult * nf, cfg.dimension, cfg.last_kernel_size)]
        self.model = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        return _run(self.model, x, ctx)


class SEANetDecoder(nn.Module):
    """latents [B, dimension, T] → pcm [B, 1, T * hop]."""

    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        nf, hidden = cfg.n_filters, cfg.compress
        mult = 2 ** len(cfg.ratios)
        layers: list[nn.Module] = [StreamingConv1d(cfg.dimension, mult * nf, cfg.kernel_size)]
        for ratio in cfg.ratios:
            dim = mult * nf
            layers += [nn.ELU(), StreamingConvTranspose1d(dim, dim // 2, 2 * ratio, ratio)]
            layers += [
                ResidualBlock(dim // 2, dim // 2 // hidden, cfg.residual_kernel_size, cfg.dilation_base**j)
                for j in range(cfg.n_residual_layers)
            ]
            mult //= 2
        layers += [nn.ELU(), StreamingConv1d(nf, cfg.channels, cfg.last_kernel_size)]
        self.model = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        return _run(self.model, x, ctx)


class TransformerLayer(nn.Module):
    """Pre-norm layer: LayerNorm → RoPE attention → LayerScale, LayerNorm → GELU MLP → LayerScale."""

    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        d, ff = cfg.dimension, cfg.dim_feedforward
        self.num_heads = cfg.num_heads
        self.norm1 = nn.LayerNorm(d, eps=1e-5)
        self.norm2 = nn.LayerNorm(d, eps=1e-5)
        self.wqkv = nn.Parameter(torch.empty(d, 3 * d))
        self.wo = nn.Parameter(torch.empty(d, d))
        self.w1 = nn.Parameter(torch.empty(d, ff))
        self.w2 = nn.Parameter(torch.empty(ff, d))
        self.layer_scale_1 = nn.Parameter(torch.full((d,), cfg.layer_scale))
        self.layer_scale_2 = nn.Parameter(torch.full((d,), cfg.layer_scale))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        rows: Rows,
        ring: torch.Tensor,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, d]; cache [S, 2, H, L, D] is this layer's KV ring, `ring` [B, T] where new entries go."""
        B, T, d = x.shape
        qkv = matmul(self.norm1(x), self.wqkv).view(B, T, 3, self.num_heads, -1)
        q = apply_rope(qkv[:, :, 0], cos, sin)
        k = apply_rope(qkv[:, :, 1], cos, sin)
        cache[rows.index[:, None], 0, :, ring] = k
        cache[rows.index[:, None], 1, :, ring] = qkv[:, :, 2]
        kv = rows.get(cache)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), kv[:, 0], kv[:, 1], attn_mask=mask)
        x = x + self.layer_scale_1 * matmul(attn.transpose(1, 2).reshape(B, T, d), self.wo)
        return x + self.layer_scale_2 * matmul(F.gelu(matmul(self.norm2(x), self.w1)), self.w2)


def ring_mask(positions: torch.Tensor, keys: torch.Tensor, context: int, window: int) -> torch.Tensor:
    """Which ring entries each query of a call attends: [B, T, L] from the call's query positions [B, T] (its keys
    just written) and the position each ring entry holds [B, L] (-1: not written since the slot's reset).

    An entry is attended when it is within `context` steps of the query, not after it, and among the newest
    `window` positions of the ring: `window == context` is moshi's rule (a full ring's every entry), `context - 1`
    NVIDIA's fork's (never a full ring's oldest, which its cache labels with a future position).
    """
    keys = keys[:, None, :]
    delta = positions[:, :, None] - keys
    newest = positions[:, -1:, None]
    return (keys >= 0) & (delta >= 0) & (delta < context) & (newest - keys < window)


class Transformer(nn.Module):
    """Causal transformer over [B, T, d] with a sliding window of `context` steps kept in a per-slot KV ring.

    Ring semantics follow the reference (`RingKVCache`, capacity = context): new keys are written before
    attending, and each query sees the stored keys at positions in (pos - context, pos], less a full ring's oldest
    under NVIDIA's fork's rule (`MimiConfig.ring_rule`, `ring_mask`).
    """

    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        self.context, self.window, self.max_period = cfg.context, cfg.attention_window, cfg.max_period
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg.num_layers)])

    def init_state(self, num_slots: int, **factory) -> dict[str, _Buffer]:
        L, H, D = self.context, self.num_heads, self.head_dim
        long = {"device": factory["device"], "dtype": torch.long}
        return {
            "kv": _Buffer(torch.zeros(len(self.layers), num_slots, 2, H, L, D, **factory), None),
            "offset": _Buffer(torch.zeros(num_slots, **long), 0),
            "positions": _Buffer(torch.full((num_slots, L), -1, **long), -1),
        }

    def forward(self, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        rows = ctx.rows
        T = x.shape[1]
        positions = ctx.get(self, "offset")[:, None] + torch.arange(T, device=x.device)
        ring = positions % self.context
        ctx.put(self, "offset", positions[:, -1] + 1)
        stored = ctx.buffer(self, "positions")
        stored[rows.index[:, None], ring] = positions
        mask = ring_mask(positions, rows.get(stored), self.context, self.window)[:, None]
        cos, sin = rope_angles(positions, self.head_dim, self.max_period)
        kv = ctx.buffer(self, "kv")
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, rows, ring, kv[i])
        return x


class Codebook(nn.Module):
    """Euclidean codebook; centroids are `embedding_sum / cluster_usage`, recomputed when either changes."""

    cluster_usage: torch.Tensor
    embedding_sum: torch.Tensor

    def __init__(self, dim: int, card: int) -> None:
        super().__init__()
        self.register_buffer("_initialized", torch.zeros(1))
        self.register_buffer("cluster_usage", torch.ones(card))
        self.register_buffer("embedding_sum", torch.zeros(card, dim))
        self._cache: tuple[tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(centroids [card, dim], centroids^T [dim, card], squared norms [card])."""
        key = (
            self.cluster_usage._version,
            self.embedding_sum._version,
            self.embedding_sum.data_ptr(),
            self.cluster_usage.data_ptr(),
        )
        if self._cache is None or self._cache[0] != key:
            emb = self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]
            self._cache = (key, emb, emb.t().contiguous(), (emb * emb).sum(-1))
        return self._cache[1:]


class _VQ(nn.Module):
    def __init__(self, dim: int, card: int) -> None:
        super().__init__()
        self._codebook = Codebook(dim, card)  # the reference's key name (`layers.N._codebook.embedding_sum`)

    @property
    def codebook(self) -> Codebook:
        return self._codebook


class _VQLayers(nn.Module):
    def __init__(self, n: int, dim: int, card: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_VQ(dim, card) for _ in range(n)])


class ResidualVQ(nn.Module):
    """1×1 projections around a residual stack of codebooks; projections stored [in, out]."""

    def __init__(self, n_q: int, dim: int, codebook_dim: int, card: int) -> None:
        super().__init__()
        self.input_proj = nn.Parameter(torch.empty(dim, codebook_dim))
        self.output_proj = nn.Parameter(torch.empty(codebook_dim, dim))
        self.vq = _VQLayers(n_q, codebook_dim, card)

    @property
    def codebooks(self) -> list[Codebook]:
        return [cast(_VQ, layer).codebook for layer in self.vq.layers]

    def encode(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x [N, dim] → codes [N, n]: nearest centroid of the residual, codebook after codebook."""
        residual = x @ self.input_proj
        codes = []
        for codebook in self.codebooks[:n]:
            emb, emb_t, norms = codebook.tables()
            # argmin |r - e|^2 = argmin |e|^2 - 2 r.e  (the reference's cdist takes the same matmul path)
            idx = torch.addmm(norms, residual, emb_t, alpha=-2.0).argmin(-1)
            residual = residual - emb[idx]
            codes.append(idx)
        return torch.stack(codes, dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [N, n] → [N, dim]."""
        books = self.codebooks[: codes.shape[1]]
        total = books[0].tables()[0][codes[:, 0]]
        for k in range(1, len(books)):
            total = total + books[k].tables()[0][codes[:, k]]
        return total @ self.output_proj


class SplitRVQ(nn.Module):
    """Semantic codebook(s) and acoustic codebooks quantize the same latent through separate projections."""

    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        self.n_semantic = cfg.n_q_semantic
        self.rvq_first = ResidualVQ(cfg.n_q_semantic, cfg.dimension, cfg.codebook_dim, cfg.card)
        self.rvq_rest = ResidualVQ(cfg.n_q - cfg.n_q_semantic, cfg.dimension, cfg.codebook_dim, cfg.card)

    def encode(self, x: torch.Tensor, n: int) -> torch.Tensor:
        first = self.rvq_first.encode(x, self.n_semantic)
        return torch.cat([first, self.rvq_rest.encode(x, n - self.n_semantic)], dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first.decode(codes[:, : self.n_semantic]) + self.rvq_rest.decode(codes[:, self.n_semantic :])


class MimiModel(nn.Module):
    """The Mimi codec's weights and per-frame compute; streaming state lives in `MimiStreams`."""

    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, stride = cfg.dimension, cfg.downsample_stride
        self.encoder = SEANetEncoder(cfg)
        self.encoder_transformer = Transformer(cfg)
        self.downsample = StreamingConv1d(d, d, 2 * stride, stride=stride, bias=False, replicate=True)
        self.quantizer = SplitRVQ(cfg)
        groups = d if cfg.upsample_channel_wise else 1
        self.upsample = StreamingConvTranspose1d(d, d, 2 * stride, stride, groups=groups, bias=False)
        self.decoder_transformer = Transformer(cfg)
        self.decoder = SEANetDecoder(cfg)
        self.requires_grad_(False)  # inference only; lets loaders copy into parameters in place

    @property
    def encoder_modules(self) -> list[nn.Module]:
        return [self.encoder, self.encoder_transformer, self.downsample]

    @property
    def decoder_modules(self) -> list[nn.Module]:
        return [self.upsample, self.decoder_transformer, self.decoder]

    def latents(self, pcm: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        """pcm [B, frame_size * k] → the unquantized latents [B, dimension, k] (advancing the encoder state by k
        frames): what the quantizer reads, the reference's `encode_to_latent(x, quantize=False)`."""
        emb = self.encoder(pcm[:, None, :], ctx)
        emb = self.encoder_transformer(emb.transpose(1, 2), ctx).transpose(1, 2)
        return self.downsample(emb, ctx)

    def encode_frame(self, pcm: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        """pcm [B, frame_size] → codes [B, num_codebooks] (one frame, advancing the encoder state)."""
        return self.quantizer.encode(self.latents(pcm, ctx)[..., 0], self.cfg.num_codebooks)

    def decode_frame(self, codes: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        """codes [B, num_codebooks] → pcm [B, frame_size] (one frame, advancing the decoder state)."""
        emb = self.upsample(self.quantizer.decode(codes)[..., None], ctx)
        emb = self.decoder_transformer(emb.transpose(1, 2), ctx).transpose(1, 2)
        return self.decoder(emb, ctx)[:, 0]

    @torch.no_grad()
    def init_weights_(self, seed: int = 0) -> MimiModel:
        """Random weights of sensible scale and real codebooks (for the demo model and tests)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            noise = torch.randn(p.shape, generator=gen)
            if "layer_scale" in name:
                p.copy_(self.cfg.layer_scale * (1 + 0.1 * noise))
            elif isinstance(owner, nn.LayerNorm):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.01 * noise)
            else:
                if p.dim() == 2:  # [in, out]
                    fan_in = p.shape[0]
                elif isinstance(owner, StreamingConvTranspose1d):  # [in, out/groups, k], stride k/2
                    fan_in = p.shape[0] // owner.groups * max(1, p.shape[2] // owner.stride)
                else:  # [out, in/groups, k]
                    fan_in = p[0].numel()
                p.copy_(noise / math.sqrt(fan_in))
        for name, buf in self.named_buffers():
            if name.endswith("cluster_usage"):
                buf.copy_(0.5 + torch.rand(buf.shape, generator=gen))
        for name, buf in self.named_buffers():
            if name.endswith("embedding_sum"):
                usage = self.get_buffer(name.rsplit(".", 1)[0] + ".cluster_usage")
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen) * usage[:, None])
            elif name.endswith("_initialized"):
                buf.fill_(1.0)
        return self


def reference_keys(model: MimiModel, naming: str = "module") -> list[tuple[str, str, tuple[int, ...], bool]]:
    """(reference key, duplexd name, reference shape, transposed) for every tensor of a reference checkpoint.

    `naming`: "module" (`self_attn.in_projs.0.weight`) or "fused" (`self_attn.in_proj_weight`); the two
    differ only in the attention projection names since Mimi has one projection per layer.
    """
    rows = []
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    convtr = {n for n, m in model.named_modules() if isinstance(m, StreamingConvTranspose1d)}
    for name, t in tensors.items():
        owner, leaf = name.rsplit(".", 1)
        shape, transposed = tuple(t.shape), False
        if ".vq." in name:
            key = name
        elif "_transformer." in name:
            half, rest = name.split(".", 1)
            key = f"{half}.transformer.{rest}"
            proj = {
                "wqkv": "self_attn.in_projs.0.weight",
                "wo": "self_attn.out_projs.0.weight",
                "w1": "linear1.weight",
                "w2": "linear2.weight",
            }
            if naming == "fused":
                proj.update(wqkv="self_attn.in_proj_weight", wo="self_attn.out_proj.weight")
            if leaf in proj:
                key = f"{key.rsplit('.', 1)[0]}.{proj[leaf]}"
                shape, transposed = shape[::-1], True
            elif leaf.startswith("layer_scale"):
                key = f"{key.rsplit('.', 1)[0]}.{leaf}.scale"
        elif name.startswith("quantizer."):
            key = f"{name}.weight"
            shape, transposed = (*shape[::-1], 1), True
        elif owner in convtr:
            wrap = "convtr.convtr.convtr" if owner == "upsample" else "convtr.convtr"
            key = f"{owner}.{wrap}.{leaf}"
        else:
            key = f"{owner}.{'conv.conv.conv' if owner == 'downsample' else 'conv.conv'}.{leaf}"
        rows.append((key, name, shape, transposed))
    return rows


# --------------------------------------------------------------------------------------------------- streams


def _init_states(roots: list[nn.Module], rows: int, device, dtype) -> dict[nn.Module, dict[str, _Buffer]]:
    out = {}
    for root in roots:
        for m in root.modules():
            init_state = getattr(m, "init_state", None)
            if init_state is not None and (state := init_state(rows, device=device, dtype=dtype)):
                out[m] = state
    return out


class MimiStreams:
    """Streaming encoder and decoder state for `num_slots` independent audio streams, allocated once.

    `encode` and `decode` step any subset of slots by whole frames; their states are independent, so they may be
    interleaved freely. A fresh (or reset) slot behaves as the reference's `mimi.streaming()` right after entry:
    consecutive `encode` calls give the same codes as the reference's streaming `mimi.encode` on the same frames.
    The reference *server* additionally resets Mimi after the first frame it encodes; a caller
    reproducing that calls `reset(slot)` after the first `encode` (the LM ignores that first frame anyway).

    Every state tensor has one more row, the scratch slot (`scratch_slot`): padding rows of a bucketed batch, and
    rows whose output is not wanted, step it, so they never touch a real stream. `encode_frame`/`decode_frame`
    are the host-free per-frame calls (no checks that would read device values); `encode`/`decode` check their
    arguments first. `decoder=False` keeps no decoder state (a text-only LM, Kyutai STT, never decodes).
    """

    def __init__(self, model: MimiModel, num_slots: int, *, decoder: bool = True) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.model, self.num_slots, self.scratch_slot = model, num_slots, num_slots
        self.cfg = model.cfg
        p = next(model.parameters())
        self._encoder = _init_states(model.encoder_modules, num_slots + 1, p.device, p.dtype)
        self._decoder = _init_states(model.decoder_modules if decoder else [], num_slots + 1, p.device, p.dtype)
        self.has_decoder = decoder

    @staticmethod
    def state_bytes(model: MimiModel, num_slots: int, *, decoder: bool = True) -> int:
        """Device memory the streams of `num_slots` slots take (to size other pools before allocating them)."""
        dtype = next(model.parameters()).dtype
        roots = model.encoder_modules + (model.decoder_modules if decoder else [])
        states = _init_states(roots, num_slots + 1, "meta", dtype)
        return sum(b.data.nbytes for bufs in states.values() for b in bufs.values())

    def reset(self, slot: int, *, encoder: bool = True, decoder: bool = True) -> None:
        """Start `slot` afresh (by default both directions); other slots are untouched."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.num_slots - 1}")
        for half, on in ((self._encoder, encoder), (self._decoder, decoder)):
            if on:
                for bufs in half.values():
                    for b in bufs.values():
                        if b.reset_value is not None:
                            b.data[slot] = b.reset_value

    def encode_frame(self, rows: Rows, pcm: torch.Tensor) -> torch.Tensor:
        """pcm [B, frame_size] → codes long [B, num_codebooks] for `rows`, one frame; no checks, no host work."""
        return self.model.encode_frame(pcm.to(self.model.downsample.weight.dtype), _Ctx(rows, self._encoder))

    def decode_frame(self, rows: Rows, codes: torch.Tensor) -> torch.Tensor:
        """codes long [B, num_codebooks] (in 0..card-1) → pcm [B, frame_size] for `rows`; no checks, no host work."""
        if not self.has_decoder:
            raise ValueError("these Mimi streams keep no decoder state (decoder=False)")
        return self.model.decode_frame(codes, _Ctx(rows, self._decoder))

    def _rows(self, slots: torch.Tensor | Sequence[int], batch: int) -> Rows:
        """Checked rows for the public calls (reads `slots` on the host)."""
        ids = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        if isinstance(slots, torch.Tensor) and (slots.dim() != 1 or slots.dtype not in (torch.int64, torch.int32)):
            raise ValueError(f"slots must be a 1-D integer tensor with one entry per batch row ({batch})")
        if len(ids) != batch or not batch:
            raise ValueError(f"slots must have one entry per batch row ({batch})")
        if min(ids) < 0 or max(ids) >= self.num_slots:
            raise ValueError(f"slots must be in 0..{self.num_slots - 1}, got {ids}")
        if len(set(ids)) != batch:
            raise ValueError(f"slots must be distinct, got {ids}")
        device = self.model.downsample.weight.device
        return Rows(torch.tensor(ids, dtype=torch.long, device=device), ids)

    def _frames(self, pcm: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Checked pcm [B, frame_size * n] (or [B, 1, ...]) cut into its n frames, in the model's dtype."""
        if pcm.dim() == 3 and pcm.shape[1] == 1:
            pcm = pcm[:, 0]
        fs = self.cfg.frame_size
        if pcm.dim() != 2 or pcm.shape[-1] == 0 or pcm.shape[-1] % fs:
            raise ValueError(
                f"pcm must be [batch, samples] with samples a positive multiple of the frame size {fs}, "
                f"got shape {list(pcm.shape)}; buffer partial frames before encoding"
            )
        return pcm.to(self.model.downsample.weight.dtype).split(fs, dim=-1)

    @torch.no_grad()
    def encode(self, slots: torch.Tensor | Sequence[int], pcm: torch.Tensor) -> torch.Tensor:
        """pcm float [B, frame_size * n] (or [B, 1, ...]) → codes long [B, num_codebooks, n]."""
        frames = self._frames(pcm)
        rows = self._rows(slots, frames[0].shape[0])
        return torch.stack([self.encode_frame(rows, frame) for frame in frames], dim=-1)

    @torch.no_grad()
    def encode_latent(
        self, slots: torch.Tensor | Sequence[int], pcm: torch.Tensor, frames_per_call: int = 1
    ) -> torch.Tensor:
        """pcm float [B, frame_size * n] (or [B, 1, ...]) → the unquantized latents [B, dimension, n]: from a fresh
        slot, the reference's `encode_to_latent(pcm, quantize=False)` on the same samples while n frames' steps fit
        the transformers' context. `frames_per_call` frames go through at once (each call's steps' keys are
        written before they attend, so a call may take no more steps than the context holds)."""
        steps = frames_per_call * self.cfg.downsample_stride
        if not 1 <= steps <= self.cfg.context:
            raise ValueError(f"frames_per_call must be 1 to {self.cfg.context // self.cfg.downsample_stride}")
        frames = self._frames(pcm)
        rows = self._rows(slots, frames[0].shape[0])
        ctx = _Ctx(rows, self._encoder)
        chunks = [torch.cat(frames[i : i + frames_per_call], dim=-1) for i in range(0, len(frames), frames_per_call)]
        return torch.cat([self.model.latents(chunk, ctx) for chunk in chunks], dim=-1)

    @torch.no_grad()
    def decode(self, slots: torch.Tensor | Sequence[int], codes: torch.Tensor) -> torch.Tensor:
        """codes long [B, num_codebooks, n] → pcm float [B, frame_size * n]."""
        k = self.cfg.num_codebooks
        if codes.dim() != 3 or codes.shape[1] != k or codes.shape[2] == 0:
            raise ValueError(f"codes must be [batch, {k}, frames] with frames >= 1, got shape {list(codes.shape)}")
        if codes.dtype.is_floating_point:
            raise ValueError("codes must be integers")
        if int(codes.min()) < 0 or int(codes.max()) >= self.cfg.card:
            raise ValueError(f"codes must be in 0..{self.cfg.card - 1}")
        rows = self._rows(slots, codes.shape[0])
        codes = codes.long()
        return torch.cat([self.decode_frame(rows, codes[:, :, t]) for t in range(codes.shape[2])], dim=-1)
