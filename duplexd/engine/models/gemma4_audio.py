"""Gemma 4 audio tower (USM-style conformer) with a whole-file path and a batched, per-slot streaming path.

duplexd's own implementation; `transformers`' `Gemma4AudioModel` is the parity target (tests compare the two).
Parameter names follow the Hugging Face checkpoint, so `model.audio_tower.*` / `model.embed_audio.*` load as-is.

Every operator is causal at token granularity (40 ms per token), which is what makes streaming exact:

* subsampler: two 3x3 stride-2 convs over (time, mel); token t reads mel frames 4t-3 .. 4t+3;
* attention: causal sliding window of `window` keys (HF Gemma 4 attends to distances 0..11), plus a
  Transformer-XL relative-position term, a per-dim query scale and a tanh soft cap;
* light conv: causal depthwise conv (k = 5) after a GLU.

Instead of HF's 12-token blocks with a 24-key unfolded context and a dense 5-D mask, both paths share one
banded-attention routine: queries in blocks of `Q` tokens see `Q + window - 1` keys, the relative term is
computed once per distance and shifted into place, and the band/padding mask is built from a small key-valid
tensor. Streaming is the same routine with `Q` = new tokens and the keys of the previous `window - 1` tokens
taken from per-slot state.

End of file: for a stream of n x 640 samples, `encode_step` equals the whole-file `encode` on every token but the
last. The reference frames 321 samples per 320-sample window, so it marks the file's last mel frame invalid and
zeroes it; that frame is the final input of the last token. A stream has no such padding (its frames continue
into the next chunk), so only that one token differs, and attention being causal, nothing before it.

Padded batches: right-padded rows are packed away for every token-wise layer (`Packing`), so a batch of uneven
files costs about the sum of their lengths, not batch x longest.

On CPU in fp32 the big matmuls go through oneDNN with weights packed once (`prepare()`), which is markedly
faster than unpacked BLAS for the small row counts of streaming and still plain fp32 arithmetic.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .log_mel import LogMel, LogMelConfig

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------- config


@dataclass
class Gemma4AudioConfig:
    """Gemma 4 audio tower config; defaults are the E2B/E4B `audio_config` (field names as in HF)."""

    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    hidden_act: str = "silu"
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536
    # Keys each token attends to (itself included). None = HF Gemma 4's measured behaviour, distances
    # 0 .. attention_context_left - 2 (12 keys); Gemma 3n and the position table allow one more (13).
    attention_window: int | None = None
    # Hidden size of the text decoder `embed_audio` projects into (1536 for E2B, 2560 for E4B); None = no embedder.
    text_hidden_size: int | None = 1536
    num_mel_bins: int = 128

    def __post_init__(self) -> None:
        c0, c1 = self.subsampling_conv_channels  # a list when read from JSON
        self.subsampling_conv_channels = (int(c0), int(c1))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.subsampling_conv_channels[0] // 4 * 4 != self.num_mel_bins:
            # HF sizes input_proj_linear from conv channels[0]; it only works when that equals the mel-bin count.
            raise ValueError("subsampling_conv_channels[0] must equal the number of mel bins (128)")
        if self.attention_context_right != 0:
            raise ValueError("attention_context_right > 0 (lookahead) is not supported")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}")
        if self.window < 1:
            raise ValueError("attention window must be >= 1")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def window(self) -> int:
        return self.attention_window if self.attention_window is not None else self.attention_context_left - 1

    @classmethod
    def from_hf(cls, audio_config: Any, text_hidden_size: int | None = 1536) -> Gemma4AudioConfig:
        """Build from an HF `audio_config` (dict or config object); unknown HF fields are ignored."""
        d = audio_config if isinstance(audio_config, dict) else audio_config.to_dict()
        names = {f.name for f in fields(cls)} - {"text_hidden_size", "attention_window", "num_mel_bins"}
        return cls(**{k: v for k, v in d.items() if k in names}, text_hidden_size=text_hidden_size)


# --------------------------------------------------------------------------------------------------- helpers


def _onednn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor, rows_hint: int = 64) -> torch.Tensor | None:
    """oneDNN-packed copy of a linear weight on CPU fp32, or None where packing does not apply."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not _onednn_ok():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
    except (RuntimeError, NotImplementedError) as exc:  # pragma: no cover - build without oneDNN matmul
        logger.info("oneDNN weight packing unavailable (%s); using plain linear", exc)
        return None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    clamp: tuple[float, float] | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias), then clamp(lo, hi) if given; fused into the oneDNN call when the weight is packed."""
    if packed is not None:
        if clamp is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "hardtanh", list(clamp), "")
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    y = F.linear(x, weight, bias)
    return y if clamp is None else y.clamp_(*clamp)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma RMSNorm: fp32 math, weight used as-is (not 1 + w). torch's fused op gives the same bits."""
    y = F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(), eps)
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class ClippableLinear(nn.Module):
    """Linear (no bias) between input and output clamps whose bounds come from the checkpoint.

    The bounds are real model parameters: skipping them is reported to wreck the encoder past layer 5.
    """

    def __init__(self, cfg: Gemma4AudioConfig, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False)
        self.clipped = cfg.use_clipped_linears
        if self.clipped:
            self.input_min = nn.Buffer(torch.tensor(-math.inf))
            self.input_max = nn.Buffer(torch.tensor(math.inf))
            self.output_min = nn.Buffer(torch.tensor(-math.inf))
            self.output_max = nn.Buffer(torch.tensor(math.inf))
        self.packed: torch.Tensor | None = None
        self._bounds: tuple[float | None, float | None, float | None, float | None] | None = None

    def prepare(self, pack: bool) -> None:
        """Cache the bounds as Python floats (None when infinite) and pack the weight."""
        if self.clipped:
            vals = [float(b) for b in (self.input_min, self.input_max, self.output_min, self.output_max)]
            self._bounds = tuple(v if math.isfinite(v) else None for v in vals)  # type: ignore[assignment]
        else:
            self._bounds = (None, None, None, None)
        self.packed = pack_weight(self.linear.weight) if pack else None

    @property
    def input_bounds(self) -> tuple[float | None, float | None]:
        """The input clamp once prepared (None where unbounded)."""
        return (self._bounds or (None, None))[:2]

    def clip_in(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        if self._bounds is None:
            return torch.clamp(x, self.input_min, self.input_max) if self.clipped else x
        lo, hi = self._bounds[0], self._bounds[1]
        if lo is None and hi is None:
            return x
        return x.clamp_(lo, hi) if inplace else x.clamp(lo, hi)

    def _out_clamp(self) -> tuple[float, float] | None:
        """Output bounds for a fused clamp (None when both are infinite or not cached yet)."""
        if self._bounds is None or (self._bounds[2] is None and self._bounds[3] is None):
            return None
        lo, hi = self._bounds[2], self._bounds[3]
        return (-math.inf if lo is None else lo, math.inf if hi is None else hi)

    def clip_out(self, y: torch.Tensor) -> torch.Tensor:
        if self._bounds is None:
            return torch.clamp(y, self.output_min, self.output_max) if self.clipped else y
        lo, hi = self._bounds[2], self._bounds[3]
        return y if lo is None and hi is None else y.clamp_(lo, hi)

    def forward(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """`inplace` lets the input clamp overwrite x (for temporaries)."""
        if self._bounds is None:
            return self.clip_out(linear(self.clip_in(x), self.linear.weight, self.packed))
        return linear(self.clip_in(x, inplace), self.linear.weight, self.packed, clamp=self._out_clamp())


def relative_positions(hidden: int, window: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Sinusoid rows for distances 0 .. window-1, layout [sin | cos] with timescales 1 .. 1e4 (HF's table)."""
    n = hidden // 2
    inc = math.log(1.0e4) / max(n - 1, 1)
    inv = torch.exp(torch.arange(n, device=device) * -inc).float()
    t = torch.arange(window, device=device)[:, None] * inv[None]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=-1).to(dtype)


def rel_shift(qr: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[..., Q, W] scores by distance -> [..., Q, Q+W-1] scores by key, key j of query i at distance W-1+i-j.

    Out-of-band entries come out as 0 (they are masked anyway). Transformer-XL's pad-and-reshape trick.
    """
    *lead, q, w = qr.shape
    flipped = qr.flip(-1)  # column m = distance W-1-m, i.e. key offset j - i = m
    padded = F.pad(flipped, (0, num_keys + 1 - w))
    flat = padded.reshape(*lead, q * (num_keys + 1))[..., : q * num_keys]
    return flat.reshape(*lead, q, num_keys)


def band_mask(q: int, window: int, device=None) -> torch.Tensor:
    """[Q, Q+W-1] bool: key j lies in query i's window (distance 0 .. W-1)."""
    i = torch.arange(q, device=device)[:, None]
    j = torch.arange(q + window - 1, device=device)[None, :]
    return (j >= i) & (j <= i + window - 1)


def causal_depthwise(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor | None) -> torch.Tensor:
    """Causal depthwise conv over time. x [B, T, C], weight [C, 1, K], history [B, K-1, C] (None = zeros)."""
    k = weight.shape[-1]
    if history is None:
        xp = F.pad(x, (0, 0, k - 1, 0))
    else:
        xp = torch.cat([history.to(x.dtype), x], dim=1)
    t = x.shape[1]
    w = weight[:, 0, :].t()  # [K, C]
    y = xp[:, 0:t] * w[0]
    for i in range(1, k):
        y.addcmul_(xp[:, i : i + t], w[i])
    return y


class Packing:
    """Valid tokens of a right-padded batch, packed into rows: token-wise layers skip the padding entirely.

    Only the attention and the depthwise conv need the [B, T] layout; they scatter into it (zeros at padding,
    which is masked as a key and, being after every valid token, never reaches the causal conv) and gather back.
    """

    def __init__(self, mask: torch.Tensor) -> None:
        self.shape = tuple(mask.shape)
        self.index = mask.reshape(-1).nonzero().squeeze(1)

    @staticmethod
    def applies(mask: torch.Tensor) -> bool:
        """Worth it and exact: some padding, and every row is valid-prefix-then-padding."""
        if bool(mask.all()):
            return False
        n = mask.sum(1, keepdim=True)
        return bool((mask == (torch.arange(mask.shape[1], device=mask.device)[None] < n)).all())

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(self.shape[0] * self.shape[1], *x.shape[1:])
        out.index_copy_(0, self.index, x)
        return out.view(*self.shape, *x.shape[1:])


# --------------------------------------------------------------------------------------------------- modules


class SubsampleLayer(nn.Module):
    """Conv2d 3x3 stride 2 (no bias) -> LayerNorm over channels (weight only) -> ReLU."""

    def __init__(self, c_in: int, c_out: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(c_out, eps=eps, bias=False)

    def forward(self, x: torch.Tensor, time_padding: int) -> torch.Tensor:
        """x [B, C, T, F] -> [B, T', F', C'] (channels last). `time_padding` is 1 for files, 0 for streams."""
        w = self.conv.weight
        if w.shape[1] == 1:
            # One input channel: 9 taps gathered by unfold and one matmul land channels-last directly, which is
            # cheaper than a conv with 128 output planes followed by a transposing copy for the LayerNorm.
            b, _, t, f = x.shape
            cols = F.unfold(x, kernel_size=3, stride=2, padding=(time_padding, 1))  # [B, 9, T'*F']
            t_out, f_out = (t + 2 * time_padding - 3) // 2 + 1, (f - 1) // 2 + 1
            y = (cols.transpose(1, 2) @ w.view(w.shape[0], 9).t()).view(b, t_out, f_out, -1)
        else:
            y = F.conv2d(x, w, stride=2, padding=(time_padding, 1)).permute(0, 2, 3, 1)
        return torch.relu_(self.norm(y))


class SubsampleConvProjection(nn.Module):
    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        c0, c1 = cfg.subsampling_conv_channels
        self.layer0 = SubsampleLayer(1, c0, cfg.rms_norm_eps)
        self.layer1 = SubsampleLayer(c0, c1, cfg.rms_norm_eps)
        self.input_proj_linear = nn.Linear((c0 // 4) * c1, cfg.hidden_size, bias=False)
        self.packed: torch.Tensor | None = None

    def project(self, y: torch.Tensor) -> torch.Tensor:
        b, t = y.shape[:2]
        return linear(y.reshape(b, t, -1), self.input_proj_linear.weight, self.packed)

    def forward(self, feats: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Whole file: feats [B, T, bins], mask [B, T] -> tokens [B, ceil(T/4), hidden], token mask."""
        x = feats[:, None]
        if mask is not None:
            x = x * mask[:, None, :, None]
        y = self.layer0(x, 1)
        if mask is not None:
            mask = mask[:, ::2]
            y = y * mask[:, :, None, None]
        y = self.layer1(y.permute(0, 3, 1, 2), 1)
        if mask is not None:
            mask = mask[:, ::2]
        return self.project(y), mask

    def step(
        self,
        mel: torch.Tensor,
        prev_mel: torch.Tensor,
        prev_row: torch.Tensor,
        valid_frames: torch.Tensor | None = None,
    ):
        """Stream: mel [B, 4n, bins] with the previous mel frame [B, bins] and previous layer0 row
        [B, F0, C0] -> (tokens [B, n, hidden], new prev_mel, new prev_row).

        `valid_frames` [B] (last step of a stream only) zeroes frames from that index on and the layer0 rows they
        start, as the whole-file forward does with its frame mask, so the final tokens match it too."""
        if valid_frames is not None:
            frame_ok = torch.arange(mel.shape[1], device=mel.device)[None, :] < valid_frames[:, None]
            mel = mel * frame_ok[..., None]
        x = torch.cat([prev_mel[:, None], mel], dim=1)[:, None]
        y0 = self.layer0(x, 0)  # [B, 2n, F0, C0]
        if valid_frames is not None:
            y0 = y0 * frame_ok[:, ::2, None, None]
        y1 = self.layer1(torch.cat([prev_row[:, None], y0], dim=1).permute(0, 3, 1, 2), 0)
        return self.project(y1), mel[:, -1], y0[:, -1]


class FeedForward(nn.Module):
    """Macaron half-step FFN: x + 0.5 * post_norm(clamp(W2 silu(W1 pre_norm(clamp(x)))))."""

    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        self.ffw_layer_1 = ClippableLinear(cfg, cfg.hidden_size, cfg.hidden_size * 4)
        self.ffw_layer_2 = ClippableLinear(cfg, cfg.hidden_size * 4, cfg.hidden_size)
        self.pre_layer_norm = RMSNorm(cfg.hidden_size)  # HF uses the default eps here, not rms_norm_eps
        self.post_layer_norm = RMSNorm(cfg.hidden_size)
        self.scale = cfg.residual_weight
        self.clip = cfg.gradient_clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = min(self.clip, torch.finfo(x.dtype).max)
        h = self.pre_layer_norm(x.clamp(-g, g))
        h = F.silu(self.ffw_layer_1(h, inplace=True), inplace=True)
        h = self.post_layer_norm(self.ffw_layer_2(h, inplace=True).clamp_(-g, g))
        return torch.add(x, h, alpha=self.scale)


class Attention(nn.Module):
    """Causal sliding-window attention with relative-position logits, per-dim query scale and soft cap."""

    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        self.num_heads, self.head_dim, self.window = h, cfg.head_dim, cfg.window
        self.q_scale = cfg.head_dim**-0.5 / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        self.q_proj = ClippableLinear(cfg, d, d)
        self.k_proj = ClippableLinear(cfg, d, d)
        self.v_proj = ClippableLinear(cfg, d, d)
        self.post = ClippableLinear(cfg, d, d)
        self.relative_k_proj = nn.Linear(d, d, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(cfg.head_dim))
        self._rel_k: torch.Tensor | None = None  # [H, D, W], from prepare()
        self._qkv: torch.Tensor | None = None  # fused [3d, d] weight when q/k/v share input bounds
        self._qkv_packed: torch.Tensor | None = None

    def prepare(self, pack: bool) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.post):
            lin.prepare(pack)
        self._rel_k = self.relative_keys()
        in_bounds = {lin.input_bounds for lin in (self.q_proj, self.k_proj, self.v_proj)}
        same_in = len(in_bounds) == 1  # the three share their input clamp, so one fused projection serves
        if same_in:
            w = torch.cat([self.q_proj.linear.weight, self.k_proj.linear.weight, self.v_proj.linear.weight]).detach()
            self._qkv, self._qkv_packed = w, (pack_weight(w) if pack else None)
        else:
            self._qkv = self._qkv_packed = None

    def relative_keys(self) -> torch.Tensor:
        w = self.relative_k_proj.weight
        pos = relative_positions(self.cfg.hidden_size, self.window, torch.float32, w.device)
        rk = F.linear(pos.to(w.dtype), w).float()  # [W, H*D]
        return rk.view(self.window, self.num_heads, self.head_dim).permute(1, 2, 0)  # [H, D, W]

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (scaled), k (scaled), v as float32 [..., H, D] for x [..., d]."""
        shape = (*x.shape[:-1], self.num_heads, self.head_dim)
        if self._qkv is not None:
            qkv = linear(self.q_proj.clip_in(x), self._qkv, self._qkv_packed)
            q, k, v = qkv.split(self.cfg.hidden_size, dim=-1)
            q, k, v = self.q_proj.clip_out(q), self.k_proj.clip_out(k), self.v_proj.clip_out(v)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        scale = self.q_scale * F.softplus(self.per_dim_scale.float())
        q = q.float().view(shape) * scale
        k = k.float().view(shape) * self.k_scale
        return q, k, v.float().view(shape)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """Banded attention over blocks. q [B, H, N, Q, D]; k, v [B, H, N, Q+W-1, D] where key j of a block is
        at distance W-1+i-j from query i; key_valid [B, N, Q+W-1]. Returns [B, H, N, Q, D]."""
        rel_k = self._rel_k if self._rel_k is not None else self.relative_keys()
        nq, nk = q.shape[-2], k.shape[-2]
        logits = q @ k.transpose(-1, -2)
        logits += rel_shift(q @ rel_k[:, None], nk)
        cap = self.cfg.attention_logit_cap
        logits = torch.tanh_(logits.div_(cap)).mul_(cap)
        valid = band_mask(nq, self.window, q.device) & key_valid[:, None, :, None, :]
        logits.masked_fill_(~valid, self.cfg.attention_invalid_logits_value)
        return torch.softmax(logits, dim=-1) @ v

    def forward(
        self, x: torch.Tensor, key_valid: torch.Tensor, packing: Packing | None = None, block: int = 32
    ) -> torch.Tensor:
        """Whole sequences. x [B, T, d] (or packed [N, d] with `packing`); key_valid [B, T] bool."""
        q, k, v = self.project_qkv(x)
        if packing is not None:
            q, k, v = packing.unpack(q), packing.unpack(k), packing.unpack(v)
        b, t = q.shape[:2]
        w, blk = self.window, min(block, t)
        nb = -(-t // blk)
        pad = nb * blk - t
        qb = F.pad(q, (0, 0, 0, 0, 0, pad)).view(b, nb, blk, self.num_heads, self.head_dim).permute(0, 3, 1, 2, 4)

        def windows(z: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [B, H, nb, blk+W-1, D]
            z = F.pad(z, (0, 0, 0, 0, w - 1, pad)).unfold(1, blk + w - 1, blk)  # [B, nb, H, D, L]
            return z.permute(0, 2, 1, 4, 3)

        kv_valid = F.pad(key_valid, (w - 1, pad), value=False).unfold(1, blk + w - 1, blk)  # [B, nb, L]
        out = self.attend(qb, windows(k), windows(v), kv_valid)  # [B, H, nb, blk, D]
        out = out.permute(0, 2, 3, 1, 4).reshape(b, nb * blk, -1)[:, :t]
        if packing is not None:
            out = packing.pack(out)
        return self.post(out.to(x.dtype))

    def step(
        self, x: torch.Tensor, k_hist: torch.Tensor, v_hist: torch.Tensor, hist_valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stream: x [B, n, d]; k/v_hist [B, W-1, H, D] (scaled keys/values of the previous W-1 tokens);
        hist_valid [B, W-1]. Returns (output, new k_hist, new v_hist)."""
        b, n, _ = x.shape
        q, k, v = self.project_qkv(x)
        keys = torch.cat([k_hist, k], dim=1)
        vals = torch.cat([v_hist, v], dim=1)
        key_valid = torch.cat([hist_valid, hist_valid.new_ones(b, n)], dim=1)[:, None]
        out = self.attend(
            q.transpose(1, 2)[:, :, None], keys.transpose(1, 2)[:, :, None], vals.transpose(1, 2)[:, :, None], key_valid
        )
        out = out[:, :, 0].transpose(1, 2).reshape(b, n, -1)
        keep = self.window - 1
        return self.post(out.to(x.dtype)), keys[:, keys.shape[1] - keep :], vals[:, vals.shape[1] - keep :]


class LightConv1d(nn.Module):
    """pre_norm -> linear_start -> GLU -> causal depthwise conv -> clamp -> conv_norm -> SiLU -> linear_end, + x."""

    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.linear_start = ClippableLinear(cfg, d, 2 * d)
        self.linear_end = ClippableLinear(cfg, d, d)
        self.depthwise_conv1d = nn.Conv1d(d, d, cfg.conv_kernel_size, groups=d, bias=False)
        self.pre_layer_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.conv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.clip = cfg.gradient_clipping

    def forward(
        self, x: torch.Tensor, history: torch.Tensor | None = None, packing: Packing | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output, GLU outputs [B, T, d]: the conv history a stream keeps)."""
        g = F.glu(self.linear_start(self.pre_layer_norm(x), inplace=True), dim=-1)
        if packing is not None:
            h = packing.pack(causal_depthwise(packing.unpack(g), self.depthwise_conv1d.weight, None))
        else:
            h = causal_depthwise(g, self.depthwise_conv1d.weight, history)
        c = min(self.clip, torch.finfo(h.dtype).max)
        h = F.silu(self.conv_norm(h.clamp_(-c, c)), inplace=True)
        return x + self.linear_end(h, inplace=True), g


class ConformerLayer(nn.Module):
    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.feed_forward1 = FeedForward(cfg)
        self.self_attn = Attention(cfg)
        self.lconv1d = LightConv1d(cfg)
        self.feed_forward2 = FeedForward(cfg)
        self.norm_pre_attn = RMSNorm(d)
        self.norm_post_attn = RMSNorm(d)
        self.norm_out = RMSNorm(d)
        self.clip = cfg.gradient_clipping

    def _attn_in(self, x: torch.Tensor) -> torch.Tensor:
        g = min(self.clip, torch.finfo(x.dtype).max)
        return self.norm_pre_attn(x.clamp(-g, g))

    def _finish(self, x: torch.Tensor, a: torch.Tensor, conv_hist: torch.Tensor | None, packing=None):
        g = min(self.clip, torch.finfo(x.dtype).max)
        x = x + self.norm_post_attn(a.clamp_(-g, g))
        x, glu = self.lconv1d(x, conv_hist, packing)
        x = self.feed_forward2(x)
        return self.norm_out(x.clamp_(-g, g)), glu

    def forward(self, x: torch.Tensor, key_valid: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        x = self.feed_forward1(x)
        return self._finish(x, self.self_attn(self._attn_in(x), key_valid, packing), None, packing)[0]

    def step(self, x, k_hist, v_hist, hist_valid, conv_hist):
        x = self.feed_forward1(x)
        a, k_hist, v_hist = self.self_attn.step(self._attn_in(x), k_hist, v_hist, hist_valid)
        x, glu = self._finish(x, a, conv_hist)
        keep = conv_hist.shape[1]
        conv_hist = torch.cat([conv_hist, glu], dim=1)[:, -keep:] if keep else conv_hist
        return x, k_hist, v_hist, conv_hist


class Gemma4AudioTower(nn.Module):
    """`model.audio_tower`: subsampler, conformer layers, `output_proj` (1024 -> 1536, with bias)."""

    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        self.config = cfg
        self.subsample_conv_projection = SubsampleConvProjection(cfg)
        self.layers = nn.ModuleList([ConformerLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.output_proj_dims, bias=True)
        self._out_packed: torch.Tensor | None = None

    @property
    def conformer_layers(self) -> Sequence[ConformerLayer]:
        return cast(Sequence[ConformerLayer], self.layers)

    def prepare(self, pack: bool) -> None:
        self.subsample_conv_projection.packed = (
            pack_weight(self.subsample_conv_projection.input_proj_linear.weight) if pack else None
        )
        for layer in self.conformer_layers:
            layer.feed_forward1.ffw_layer_1.prepare(pack)
            layer.feed_forward1.ffw_layer_2.prepare(pack)
            layer.feed_forward2.ffw_layer_1.prepare(pack)
            layer.feed_forward2.ffw_layer_2.prepare(pack)
            layer.lconv1d.linear_start.prepare(pack)
            layer.lconv1d.linear_end.prepare(pack)
            layer.self_attn.prepare(pack)
        self._out_packed = pack_weight(self.output_proj.weight) if pack else None

    def output(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.output_proj.weight, self._out_packed, self.output_proj.bias)

    def forward(self, features: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, T, bins], mask [B, T] (True = valid) -> ([B, ceil(T/4), out], token mask [B, T/4]).

        Outputs at padded positions are zeros (HF leaves values there that nothing may use).
        """
        x, tmask = self.subsample_conv_projection(features, mask)
        if tmask is None:
            tmask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        packing = Packing(tmask) if Packing.applies(tmask) else None
        if packing is not None:
            x = packing.pack(x)
        for layer in self.conformer_layers:
            x = layer(x, tmask, packing)
        x = self.output(x)
        return (packing.unpack(x) if packing is not None else x), tmask


class Gemma4AudioEmbedder(nn.Module):
    """`model.embed_audio`: scale-free RMSNorm then a projection into the text model's hidden size."""

    def __init__(self, cfg: Gemma4AudioConfig) -> None:
        super().__init__()
        assert cfg.text_hidden_size is not None
        self.eps = cfg.rms_norm_eps
        self.embedding_projection = nn.Linear(cfg.output_proj_dims, cfg.text_hidden_size, bias=False)
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(x, None, self.eps), self.embedding_projection.weight, self.packed)


# --------------------------------------------------------------------------------------------------- streaming


@dataclass
class Gemma4AudioStreamState:
    """Per-slot streaming state, allocated once for `max_slots`; row i belongs to slot i."""

    mel_tail: torch.Tensor  # [S, 160] last samples (left half-window of the next frame)
    prev_mel: torch.Tensor  # [S, bins] previous mel frame (subsampler layer0 time tap)
    prev_row: torch.Tensor  # [S, F0, C0] previous layer0 output row (layer1 time tap)
    k: torch.Tensor  # [L, S, W-1, H, D] scaled keys of the last W-1 tokens
    v: torch.Tensor  # [L, S, W-1, H, D]
    conv: torch.Tensor  # [L, S, K-1, d] last GLU outputs (depthwise-conv history)
    tokens: torch.Tensor  # [S] int64 tokens produced so far
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def max_slots(self) -> int:
        return int(self.tokens.shape[0])

    def reset(self, slots: torch.Tensor | Sequence[int] | None = None) -> None:
        """Zero the state of `slots` (all when None); other slots are untouched."""
        if slots is None:
            slots = torch.arange(self.max_slots, device=self.tokens.device)
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.tokens.device)
        for t in (self.mel_tail, self.prev_mel, self.prev_row, self.tokens):
            t.index_fill_(0, idx, 0)
        for t in (self.k, self.v, self.conv):
            t.index_fill_(1, idx, 0)


# --------------------------------------------------------------------------------------------------- encoder


@dataclass
class EncodeOutput:
    hidden: torch.Tensor  # [B, T, output_proj_dims] tower output
    mask: torch.Tensor  # [B, T] bool, True = valid token
    soft_tokens: torch.Tensor | None  # [B, T, text_hidden] after embed_audio (None without an embedder)


class Gemma4AudioEncoder(nn.Module):
    """Front end + `audio_tower` + `embed_audio`. State-dict keys are the checkpoint's minus `model.`."""

    tokens_per_second = 25
    samples_per_token = 640

    def __init__(self, cfg: Gemma4AudioConfig | None = None, front_end: LogMelConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = cfg or Gemma4AudioConfig()
        self.front_end = LogMel(front_end or LogMelConfig(num_mel_bins=cfg.num_mel_bins))
        self.audio_tower = Gemma4AudioTower(cfg)
        self.embed_audio = Gemma4AudioEmbedder(cfg) if cfg.text_hidden_size else None
        self._prepared = False
        self.pack_weights = True

    # -- preparation: cached bounds, packed weights, relative keys. Redone after loads and device moves.
    def prepare(self, pack: bool | None = None) -> Gemma4AudioEncoder:
        """Cache derived tensors (call after changing weights; `load_state_dict` and `.to()` do it lazily)."""
        if pack is not None:
            self.pack_weights = pack
        with torch.no_grad():
            self.audio_tower.prepare(self.pack_weights)
            if self.embed_audio is not None:
                self.embed_audio.packed = (
                    pack_weight(self.embed_audio.embedding_projection.weight) if self.pack_weights else None
                )
        self._prepared = True
        return self

    def _ensure_prepared(self) -> None:
        if not self._prepared:
            self.prepare()

    def _apply(self, fn, recurse: bool = True):
        self._prepared = False
        return super()._apply(fn, recurse)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        self._prepared = False
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def device(self) -> torch.device:
        return self.audio_tower.output_proj.weight.device

    # -- whole files
    @torch.inference_mode()
    def encode_features(self, features: torch.Tensor, mask: torch.Tensor | None = None) -> EncodeOutput:
        """Tower (+ embedder) on log-mel features [B, T, bins] with frame mask [B, T]."""
        self._ensure_prepared()
        dtype = self.audio_tower.output_proj.weight.dtype
        mask = None if mask is None else mask.to(self.device)
        hidden, tmask = self.audio_tower(features.to(self.device, dtype), mask)
        soft = self.embed_audio(hidden) if self.embed_audio is not None else None
        return EncodeOutput(hidden, tmask, soft)

    @torch.inference_mode()
    def encode(
        self, waves: torch.Tensor | Sequence[torch.Tensor], lengths: torch.Tensor | Sequence[int] | None = None
    ) -> EncodeOutput:
        """Whole utterances (16 kHz mono; a list or a right-padded [B, N] batch with `lengths`)."""
        if isinstance(waves, torch.Tensor):
            waves = waves.to(self.device)
        else:
            waves = [w.to(self.device) for w in waves]
        feats, mask = self.front_end(waves, lengths)
        return self.encode_features(feats, mask)

    # -- streams
    def new_stream_state(self, max_slots: int) -> Gemma4AudioStreamState:
        cfg, dev = self.config, self.device
        dtype = self.audio_tower.output_proj.weight.dtype
        c0 = cfg.subsampling_conv_channels[0]
        L, H, D, W = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim, cfg.window
        return Gemma4AudioStreamState(
            mel_tail=torch.zeros(max_slots, self.front_end.tail_length, device=dev),
            prev_mel=torch.zeros(max_slots, cfg.num_mel_bins, device=dev, dtype=dtype),
            prev_row=torch.zeros(max_slots, cfg.num_mel_bins // 2, c0, device=dev, dtype=dtype),
            k=torch.zeros(L, max_slots, W - 1, H, D, device=dev),
            v=torch.zeros(L, max_slots, W - 1, H, D, device=dev),
            conv=torch.zeros(L, max_slots, cfg.conv_kernel_size - 1, cfg.hidden_size, device=dev, dtype=dtype),
            tokens=torch.zeros(max_slots, dtype=torch.long, device=dev),
        )

    @torch.inference_mode()
    def encode_step(
        self,
        state: Gemma4AudioStreamState,
        slots: torch.Tensor | Sequence[int],
        pcm: torch.Tensor,
        valid_frames: torch.Tensor | Sequence[int] | None = None,
    ) -> EncodeOutput:
        """Advance `slots` by one chunk each: pcm [B, n] at 16 kHz, n a multiple of 640 (80 ms = 1280 -> 2 tokens).

        Exact with respect to the whole-file `encode` of the concatenated audio, except for the last token(s) of
        a file, where the reference pads (see docs). Slots not listed do not move. For a stream's last chunk,
        `valid_frames` [B] (mel frames of the chunk the reference counts as valid) reproduces that padding: the
        chunk's tokens up to ceil(valid_frames / 4) then equal the reference's; the state is not reusable after.
        """
        self._ensure_prepared()
        if pcm.dim() != 2 or pcm.shape[1] % self.samples_per_token or pcm.shape[1] == 0:
            raise ValueError(f"pcm must be [B, k*{self.samples_per_token}] samples, got {tuple(pcm.shape)}")
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        if idx.numel() != pcm.shape[0]:
            raise ValueError("one slot per pcm row")
        if idx.unique().numel() != idx.numel():
            raise ValueError("a slot may appear only once per step")
        dtype = self.audio_tower.output_proj.weight.dtype
        tower = self.audio_tower
        mel, tail = self.front_end.stream(state.mel_tail[idx], pcm.to(self.device))
        state.mel_tail[idx] = tail
        valid = None if valid_frames is None else torch.as_tensor(valid_frames, device=self.device)
        x, prev_mel, prev_row = tower.subsample_conv_projection.step(
            mel.to(dtype), state.prev_mel[idx], state.prev_row[idx], valid
        )
        state.prev_mel[idx], state.prev_row[idx] = prev_mel, prev_row
        w = self.config.window
        seen = state.tokens[idx]
        # History row c holds token (seen - (W-1) + c); it exists iff that index is >= 0.
        hist_valid = torch.arange(w - 1, device=self.device)[None, :] >= (w - 1 - seen)[:, None]
        for i, layer in enumerate(tower.conformer_layers):
            x, k, v, c = layer.step(x, state.k[i, idx], state.v[i, idx], hist_valid, state.conv[i, idx])
            state.k[i, idx], state.v[i, idx], state.conv[i, idx] = k, v, c
        state.tokens[idx] += x.shape[1]
        hidden = tower.output(x)
        soft = self.embed_audio(hidden) if self.embed_audio is not None else None
        return EncodeOutput(hidden, torch.ones(hidden.shape[:2], dtype=torch.bool, device=self.device), soft)
