"""The Moshi LM: temporal transformer (one step per frame) and the DepFormer (one sub-step per codebook).

Plain PyTorch in the spirit of gpt-fast: weights are stored in the layout the step wants (fused QKV, the
DepFormer's per-step weights stacked along a leading step axis, all audio embeddings in one table), so a frame
is a handful of matmuls. Float projection weights are stored as [in, out] (`x @ w`): for the single-row matmuls of
a decode step this is 1.3-1.7x faster on CPU BLAS than torch's [out, in] `F.linear`, and batches of rows go
through `kernels.cpu_matmul` (see docs/BENCHMARKS.md). Any projection may instead be an int8 weight
(`int8_weights.Int8Weight`, `--weights-dtype int8`): `LMModel.project` is then `int8_weights.project`, which
runs either kind, and otherwise the float matmul itself, chosen when the weights are laid out, not per call.
`engine.checkpoint` maps the reference's key namings onto these parameters.

The ops come from `duplexd.kernels` (Triton on CUDA, the torch references on CPU). Every residual add is fused
with the norm that follows it (`add_rms_norm`), which on CPU is exactly the unfused arithmetic. The temporal
attention reads the paged KV cache (`engine.kv_cache`) through the paged decode-attention op, with no host
synchronisation, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from duplexd.kernels.rms_norm import add_rms_norm, rms_norm
from duplexd.kernels.rope import rope_angles
from duplexd.kernels.silu_gate import silu_gate

from ..kv.paged import PagedBatch, PagedKVCache
from .config import LMConfig
from .int8_weights import Int8Weight, Projection, Weight, projection

NORM_EPS = 1e-8
CROSS_NORM_EPS = 1e-5  # the reference's cross-attention LayerNorm


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def step_part(name: str) -> AbstractContextManager:
    """A profiler range naming one part of a frame (the temporal transformer, the DepFormer, Mimi's encode and
    decode), by which `bench/gpu_profile.py` attributes the step's kernels; nothing while no profiler runs: a
    `record_function` costs 12-16 us of host time on a small CPU even then, this check about 1 us."""
    return record_function(name) if torch.autograd._profiler_enabled() else nullcontext()


class TemporalLayer(nn.Module):
    """Pre-norm block: RoPE self-attention over the slot's window, then (Kyutai TTS) cross-attention to the slot's
    voice behind a LayerNorm, then the SiLU-gated MLP."""

    def __init__(self, dim: int, hidden: int, cross: bool = False) -> None:
        super().__init__()
        self.attn_norm = _param(dim)
        self.wqkv = _param(dim, 3 * dim)
        self.wo = _param(dim, dim)
        self.mlp_norm = _param(dim)
        self.w_in = _param(dim, 2 * hidden)
        self.w_out = _param(hidden, dim)
        if cross:
            self.cross_norm = _param(dim)
            self.cross_norm_bias = _param(dim)
            # [q | k | v] as the reference stores it; the voice's keys and values are computed once per session
            self.cross_wqkv = _param(dim, 3 * dim)
            self.cross_wo = _param(dim, dim)


class DepformerLayer(nn.Module):
    """DepFormer block; attention and MLP weights have a leading axis of weight sets (one per agent codebook, or
    fewer shared by a schedule: `LMConfig.depformer_weight_set`), norms are shared."""

    def __init__(self, steps: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = _param(dim)
        self.wqkv = _param(steps, dim, 3 * dim)
        self.wo = _param(steps, dim, dim)
        self.mlp_norm = _param(dim)
        self.w_in = _param(steps, dim, 2 * hidden)
        self.w_out = _param(steps, hidden, dim)


def _sets(w: Weight) -> Sequence[Weight]:
    """The weight sets of a stacked weight (a leading axis of DepFormer steps) as views, in one op."""
    if isinstance(w, torch.Tensor):
        return w.unbind(0)
    assert isinstance(w, Int8Weight), "a weight set has no sets"
    return [w[i] for i in range(len(w.codes))]


def gated_mlp(x: torch.Tensor, w_in: Weight, w_out: Weight, project: Projection) -> torch.Tensor:
    """`(silu(gate) * value) @ w_out`; the outputs of `w_in` are [gate | value] as in the reference."""
    return project(silu_gate(project(x, w_in)), w_out)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Single-query attention q [B, H, D] over keys, values [B, H, L, D] with no mask, as two batched matvecs.

    Cheaper than `scaled_dot_product_attention` for the DepFormer's ≤ 8 keys, where the fused op's parallel
    setup costs more than the arithmetic.
    """
    scores = (keys @ q.unsqueeze(-1)).squeeze(-1) * q.shape[-1] ** -0.5
    return (torch.softmax(scores, dim=-1).unsqueeze(-2) @ values).squeeze(-2)


def cross_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Single-query attention q [B, H, D] over every key of keys, values [B, H, S, D] (a voice: no mask, no RoPE)."""
    return F.scaled_dot_product_attention(q[:, :, None], keys, values)[:, :, 0]


@dataclass
class DepformerOutput:
    tokens: torch.Tensor  # [B, agent_codebooks] sampled audio tokens
    logits: torch.Tensor | None  # [B, agent_codebooks, card] when requested


class LMModel(nn.Module):
    project: Projection  # every projection's matmul, for the weights as laid out (`bind_projections`)

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.bind_projections()
        # PersonaPlex's DepFormer steps past the agent's codebooks predict the user's, which are always replaced by
        # the user's codes: they are not built (`LMConfig.predicts_user_audio`).
        d, dd, q = cfg.dim, cfg.depformer_dim, cfg.agent_codebooks
        self.text_emb = _param(cfg.text_card + 1, d)
        if cfg.demux_second_text_stream:  # the muxed streams share the table, each with its own output matrix
            self.text_out1 = _param(d, d)
            self.text_out2 = _param(d, d)
        self.audio_emb = _param(cfg.n_q, cfg.card + 1, d)
        self.layers = nn.ModuleList(TemporalLayer(d, cfg.hidden, cfg.cross_attention) for _ in range(cfg.num_layers))
        self.out_norm = _param(d)
        self.text_head = _param(d, cfg.text_card)
        # Kyutai STT 1B's semantic-VAD heads, [heads, dim, classes] ([in, out] per head); empty without them.
        self.extra_heads = _param(cfg.extra_heads_num_heads, d, cfg.extra_heads_dim)
        if cfg.text_only:  # no DepFormer parameters at all (`LMConfig.text_only`)
            return
        sets, rank = cfg.depformer_weight_sets, cfg.depformer_low_rank_embeddings
        self.dep_in = _param(sets, d, dd)
        self.dep_text_emb = _param(cfg.text_card + 1, rank or dd)
        if cfg.demux_second_text_stream:
            self.dep_text_out1 = _param(rank or dd, dd)
            self.dep_text_out2 = _param(rank or dd, dd)
        elif rank:
            self.dep_text_low_rank = _param(rank, dd)
        self.dep_audio_emb = _param(q - 1, cfg.card + 1, rank or dd)
        if rank:  # embeddings at the low rank, each codebook's own matrix up to the DepFormer's width
            self.dep_audio_low_rank = _param(q - 1, rank, dd)
        self.dep_layers = nn.ModuleList(
            DepformerLayer(sets, dd, cfg.depformer_hidden) for _ in range(cfg.depformer_num_layers)
        )
        self.dep_heads = _param(q, dd, cfg.card)

    def bind_projections(self) -> None:
        """Choose `project` for the weights as they are now; `int8_weights.int8_layout_` and `dequantize_`, which
        change a weight's kind, call it."""
        self.project = projection(self)

    def new_kv_cache(
        self, num_slots: int, num_pages: int, page_size: int, kv_dtype: str = "bf16", attention_kernel: str = "split"
    ) -> PagedKVCache:
        cfg = self.cfg
        return PagedKVCache(
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            head_dim=cfg.head_dim,
            context=cfg.context,
            num_slots=num_slots,
            num_pages=num_pages,
            page_size=page_size,
            dtype=self.text_emb.dtype,
            device=self.text_emb.device,
            window=cfg.attention_window,
            kv_dtype=kv_dtype,
            attention_kernel=attention_kernel,
        )

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Sum of the text and audio embeddings of one column of tokens [B, 1 + n_q]; id -1 embeds as zero."""
        text, audio = tokens[:, 0], tokens[:, 1:]
        # Stream k's rows start at k * (card + 1) in the flattened table: one gather for all streams.
        rows = torch.arange(self.cfg.n_q, device=tokens.device) * (self.cfg.card + 1)
        audio_x = F.embedding(audio.clamp(min=0) + rows, self.audio_emb.flatten(0, 1))
        audio_x = audio_x.masked_fill((audio == -1).unsqueeze(-1), 0.0).sum(dim=1)
        if self.cfg.demux_second_text_stream:
            text_x = self.demux(text, self.text_emb, self.text_out1, self.text_out2)
        else:
            text_x = F.embedding(text.clamp(min=0), self.text_emb).masked_fill((text == -1).unsqueeze(-1), 0.0)
        return audio_x + text_x

    def demux(self, tokens: torch.Tensor, table: torch.Tensor, out1: Weight, out2: Weight) -> torch.Tensor:
        """The embedding of muxed text ids [B] (`(second + 1) * rows + main`, `rows` the table's): `out1` of the
        main token's row plus `out2` of the second's; a second of -1 adds nothing, an id of -1 embeds as zero."""
        rows = table.shape[0]
        ids = tokens.clamp(min=0)
        second = ids // rows - 1
        main_x = self.project(F.embedding(ids % rows, table), out1)
        second_x = self.project(F.embedding(second.clamp(min=0), table), out2)
        y = main_x + second_x.masked_fill((second < 0).unsqueeze(-1), 0.0)
        return y.masked_fill((tokens == -1).unsqueeze(-1), 0.0)

    def depformer_text_embedding(self, text: torch.Tensor) -> torch.Tensor:
        """The DepFormer's input embedding of the text token [B] (muxed for Kyutai TTS)."""
        if self.cfg.demux_second_text_stream:
            return self.demux(text, self.dep_text_emb, self.dep_text_out1, self.dep_text_out2)
        x = F.embedding(text.clamp(min=0), self.dep_text_emb)
        if self.cfg.depformer_low_rank_embeddings:
            x = self.project(x.masked_fill((text == -1).unsqueeze(-1), 0.0), self.dep_text_low_rank)
        return x

    def voice_keys_values(self, source: torch.Tensor) -> torch.Tensor:
        """Each layer's cross-attention keys and values of a voice, source [S, dim] (Kyutai TTS): [layers, 2, heads,
        S, head_dim], computed once when a session starts and kept for its every step."""
        cfg = self.cfg
        layers = cast(Sequence[TemporalLayer], self.layers)
        kv = torch.stack([self.project(source, layer.cross_wqkv[:, cfg.dim :]) for layer in layers])  # [L, S, 2 dim]
        return kv.view(len(layers), -1, 2, cfg.num_heads, cfg.head_dim).permute(0, 2, 3, 1, 4)

    def forward_text(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKVCache,
        view: PagedBatch,
        voices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One temporal step. Returns the post-`out_norm` hidden state [B, dim] and text logits [B, text_card].
        `voices` [layers, 2, B, heads, S, head_dim]: each row's voice keys and values (Kyutai TTS)."""
        return self.forward_embeddings(self.embed(tokens), positions, cache, view, voices)

    def forward_embeddings(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKVCache,
        view: PagedBatch,
        voices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_text` from the summed input embeddings x [B, dim]: a PersonaPlex voice preset stores its
        prompt's first frames as such sums, not as tokens; Kyutai TTS adds its conditioning vector."""
        with step_part("temporal"):
            h = self.temporal(x, positions, cache, view, voices)
            return h, self.project(h, self.text_head)

    def temporal(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKVCache,
        view: PagedBatch,
        voices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The temporal transformer over input embeddings x [B, dim], each row's key and value stored in the cache:
        the post-`out_norm` hidden state [B, dim]. A prompt's prefill needs only this (its tokens are given)."""
        cfg = self.cfg
        heads, dh = cfg.num_heads, cfg.head_dim
        cos, sin = rope_angles(positions, dh, cfg.max_period)
        layers = cast(Sequence[TemporalLayer], self.layers)
        last = len(layers) - 1
        project = self.project
        h = rms_norm(x, layers[0].attn_norm, NORM_EPS)
        if cfg.cross_attention and voices is None:
            raise ValueError("a cross-attention model needs each row's voice keys and values")
        for i, layer in enumerate(layers):
            qkv = project(h, layer.wqkv).view(-1, 3, heads, dh)
            attn = cache.attend_rotary(i, view, qkv[:, 0], qkv[:, 1], qkv[:, 2], cos, sin)
            if voices is None:
                h, x = add_rms_norm(project(attn.flatten(1), layer.wo), x, layer.mlp_norm, NORM_EPS)
            else:
                x = x + project(attn.flatten(1), layer.wo)
                hc = F.layer_norm(x, (cfg.dim,), layer.cross_norm, layer.cross_norm_bias, CROSS_NORM_EPS)
                q = project(hc, layer.cross_wqkv[:, : cfg.dim]).view(-1, heads, dh)
                x = x + project(cross_attend(q, voices[i, 0], voices[i, 1]).flatten(1), layer.cross_wo)
                h = rms_norm(x, layer.mlp_norm, NORM_EPS)
            next_norm = layers[i + 1].attn_norm if i < last else self.out_norm
            h, x = add_rms_norm(gated_mlp(h, layer.w_in, layer.w_out, project), x, next_norm, NORM_EPS)
        return h

    def pause_probabilities(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each extra head's class-0 probability (a pause, for STT's semantic VAD) from the post-`out_norm` hidden
        state [B, dim]: [B, extra_heads_num_heads] fp32, [B, 0] for a model without heads."""
        logits = torch.matmul(hidden.to(self.extra_heads.dtype)[None], self.extra_heads)  # [heads, B, classes]
        return torch.softmax(logits.float(), dim=-1)[..., 0].transpose(0, 1)

    def forward_depformer(
        self,
        hidden: torch.Tensor,
        text_token: torch.Tensor,
        sample,
        want_logits: bool = False,
        steps: int | None = None,
    ):
        """Run one sub-step per agent codebook (the first `steps` of them when given: a Kyutai TTS saying fewer
        codebooks than it has); `sample(step, logits [B, card]) -> tokens [B]` picks each one.

        Sub-step k uses weight set `LMConfig.depformer_weight_set(k)` (k unless a schedule shares sets) and its own
        head, and attends to sub-steps 0..k; it is fed `dep_in[set](hidden)` plus the embedding of the token chosen
        just before it (the text token for k = 0).
        """
        with step_part("depformer"):
            return self._depformer(hidden, text_token, sample, want_logits, steps)

    def _depformer(self, hidden: torch.Tensor, text_token: torch.Tensor, sample, want_logits: bool, steps: int | None):
        cfg = self.cfg
        q = cfg.agent_codebooks if steps is None else steps
        heads, dh = cfg.depformer_num_heads, cfg.depformer_head_dim
        batch = hidden.shape[0]
        dep_layers = cast(Sequence[DepformerLayer], self.dep_layers)
        last = len(dep_layers) - 1
        project = self.project
        # Everything a sub-step reads that does not depend on the tokens, taken out of the loop: each weight set's
        # slices (one unbind a weight, not one select a sub-step) and each weight set's input projection of
        # `hidden` (one matmul a set, not one a sub-step); each layer's keys and values as views.
        in_sets = _sets(self.dep_in)
        dep_in = {w: project(hidden, in_sets[w]) for w in {cfg.depformer_weight_set(step) for step in range(q)}}
        weights = [(_sets(lay.wqkv), _sets(lay.wo), _sets(lay.w_in), _sets(lay.w_out)) for lay in dep_layers]
        heads_w, audio_emb = _sets(self.dep_heads), self.dep_audio_emb.unbind(0)
        low_rank = _sets(self.dep_audio_low_rank) if cfg.depformer_low_rank_embeddings else None
        kv = hidden.new_empty(len(self.dep_layers), 2, batch, heads, q, dh)
        keys, values = [kv[i, 0] for i in range(len(dep_layers))], [kv[i, 1] for i in range(len(dep_layers))]
        attn_norms = [layer.attn_norm for layer in dep_layers]
        prev = self.depformer_text_embedding(text_token)
        tokens, all_logits = [], []
        for step in range(q):
            w = cfg.depformer_weight_set(step)
            h, x = add_rms_norm(dep_in[w], prev, attn_norms[0], NORM_EPS)
            for i, layer in enumerate(dep_layers):
                wqkv, wo, w_in, w_out = weights[i]
                qkv = project(h, wqkv[w]).view(batch, 3, heads, dh)
                keys[i][:, :, step] = qkv[:, 1]
                values[i][:, :, step] = qkv[:, 2]
                attn = attend(qkv[:, 0], keys[i][:, :, : step + 1], values[i][:, :, : step + 1])
                h, x = add_rms_norm(project(attn.flatten(1), wo[w]), x, layer.mlp_norm, NORM_EPS)
                update = gated_mlp(h, w_in[w], w_out[w], project)
                if i < last:
                    h, x = add_rms_norm(update, x, attn_norms[i + 1], NORM_EPS)
                else:
                    x = x + update
            logits = project(x, heads_w[step])
            token = sample(step, logits)
            tokens.append(token)
            if want_logits:
                all_logits.append(logits)
            if step + 1 < q:  # a sampled token is a real one (never -1): its embedding needs no mask
                prev = F.embedding(token, audio_emb[step])
                if low_rank is not None:
                    prev = project(prev, low_rank[step])
        return DepformerOutput(torch.stack(tokens, 1), torch.stack(all_logits, 1) if want_logits else None)
