"""Random-weight reference (`moshi`) models for parity tests and benchmarks, with every constant perturbed."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("NO_TORCH_COMPILE", "1")  # the reference compiles RMSNorm on CPU otherwise (≈10 s)

import torch  # noqa: E402
from moshi.models import loaders  # noqa: E402
from moshi.models.lm import LMModel as RefLMModel  # noqa: E402

from duplexd.engine.models.config import LMConfig  # noqa: E402


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
    """The reference's module-naming state dict rewritten in the fused checkpoint naming (a q8 model's `_scb`
    scales fused alongside their codes, as moshi's load hook splits them)."""
    sd = lm.state_dict()
    out = {
        k: v.contiguous() for k, v in sd.items() if ".self_attn.in_projs." not in k and ".self_attn.out_projs." not in k
    }
    for prefix, n in (("transformer", cfg.num_layers), ("depformer", cfg.depformer_num_layers)):
        steps = 1 if prefix == "transformer" else cfg.dep_q
        for i in range(n):
            p = f"{prefix}.layers.{i}.self_attn."
            for suffix in ("", "_scb"):
                if p + f"in_projs.0.weight{suffix}" not in sd:
                    continue
                ins = [sd[p + f"in_projs.{k}.weight{suffix}"] for k in range(steps)]
                outs = [sd[p + f"out_projs.{k}.weight{suffix}"] for k in range(steps)]
                out[p + f"in_proj_weight{suffix}"] = torch.cat(ins).contiguous()
                out[p + f"out_proj.weight{suffix}"] = torch.cat(outs).contiguous()
    return out


def reference_mimi(seed: int = 0, mimi_config: dict | None = None):
    """A random reference Mimi (real config unless given) with real codebooks and every constant perturbed.

    A fresh reference Mimi has all-zero codebooks (every code 0) and exact-constant LayerNorm and LayerScale
    parameters; both would hide bugs, so they get random values here, before the first encode (the reference
    caches its centroids on first use).
    """
    torch.manual_seed(seed)
    mimi = loaders.get_mimi(None, mimi_config=mimi_config, device="cpu")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in mimi.named_parameters():
            if ".norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            elif "layer_scale" in name:
                p.mul_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
        for name, m in mimi.named_modules():
            if name.endswith("_codebook"):
                usage = 0.5 + torch.rand(m.cluster_usage.shape, generator=gen)
                m.cluster_usage.copy_(usage)
                m.embedding_sum.copy_(0.01 * torch.randn(m.embedding_sum.shape, generator=gen) * usage[:, None])
                m._initialized.fill_(1.0)
                m.register_buffer("_embedding", None, persistent=False)
    return mimi.eval()


@torch.no_grad()
def quantized_reference(lm: RefLMModel, text_head: bool = True) -> tuple[RefLMModel, RefLMModel]:
    """moshi's own q8 model of `lm` (every Linear a `QLinear`, quantized by bitsandbytes as `export_quantized`
    does) and the reference LM on its dequantized weights (`CB * SCB / 127`, fp32; the text head left as it was
    unless `text_head`, as `--weights-dtype int8` leaves it): the oracle of duplexd's int8 weights, since moshi's q8
    forward is W8A8 in fp16 and its loader cannot read its own q8 files."""
    from moshi.utils.quantize import QLinear, replace_linear_with_qlinear

    q8 = copy.deepcopy(lm)
    replace_linear_with_qlinear(q8)
    dequantized = copy.deepcopy(lm)
    quantized = dict(q8.named_modules())
    for name, module in dequantized.named_modules():
        if isinstance(module, torch.nn.Linear) and (text_head or name != "text_linear"):
            q = quantized[name]
            assert isinstance(q, QLinear)
            module.weight.copy_(q.weight.float() * q.weight_scb[:, None] / 127)
    return q8.eval(), dequantized.eval()


@torch.no_grad()
def sharpen_attention_(lm: RefLMModel, factor: float = 2.0) -> RefLMModel:
    """Scale the temporal layers' query projections by `factor`: peaked attention, so a key attended that should
    not be (or one left out: a wrong window or lag) moves the outputs well past float noise."""
    for layer in lm.transformer.layers:
        for proj in layer.self_attn.in_projs:
            proj.weight[: lm.dim].mul_(factor)
    return lm


@torch.no_grad()
def sharpen_mimi_(mimi, factor: float = 8.0, layer_scale: float = 30.0):
    """Scale a reference Mimi's transformer query and key projections by `factor` and their layer scales by
    `layer_scale`: peaked attention that carries into the latents, so one key attended or left out (a ring rule)
    changes codes and speech, not only float noise."""
    for transformer in (mimi.encoder_transformer.transformer, mimi.decoder_transformer.transformer):
        for layer in transformer.layers:
            for proj in layer.self_attn.in_projs:
                proj.weight[: 2 * layer.self_attn.embed_dim].mul_(factor)
            layer.layer_scale_1.scale.mul_(layer_scale)
            layer.layer_scale_2.scale.mul_(layer_scale)
    return mimi


class ReferenceStt:
    """One reference STT conversation at batch 1: moshi's `LMGen(temp=0, temp_text=0).step_with_extra_heads` fed the
    previous frame's codes at each step and frame 0 at step 0 (`moshi.run_inference`'s frame 0 twice). `step` takes
    the frame duplexd gets at the same step, so both sides are fed the same list."""

    def __init__(self, lm: RefLMModel) -> None:
        from moshi.models.lm import LMGen as RefLMGen

        self.lm = copy.deepcopy(lm)  # a reference model streams one conversation at a time
        self.gen = RefLMGen(self.lm, temp=0, temp_text=0)
        self.text_logits: list[torch.Tensor] = []
        self.gen.on_text_logits_hook = self.text_logits.append
        self.gen.streaming_forever(1)
        self.previous: torch.Tensor | None = None

    def step(self, codes: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """codes [n_q] → (text token, text logits [text_card], each extra head's class-0 probability [heads])."""
        fed = codes if self.previous is None else self.previous
        self.previous = codes
        self.text_logits.clear()
        out = self.gen.step_with_extra_heads(fed[None, :, None])
        assert out is not None  # no delays: every step answers
        tokens, heads = out
        pause = torch.stack([h[0, 0, 0] for h in heads]) if heads else torch.zeros(0)
        return int(tokens[0, 0, 0]), self.text_logits[0][0, 0, 0], pause


def reference_tts(lm: RefLMModel, delay_steps: int, **kwargs):
    """moshi's `TTSModel` around `lm` for `generate` at temperature 0: Kyutai's state machine (lookahead 2, padding 8
    at most, 2 at the start), no Mimi or tokenizer (the callers give words, and generate decodes nothing). `n_q`
    (default: every codebook the DepFormer has): the codebooks generate says, as `TTSModel.from_checkpoint_info`'s."""
    from moshi.models.tts import StateMachine, TokenIds, TTSModel

    machine = StateMachine(TokenIds(lm.text_card + 1), second_stream_ahead=2, max_padding=8, initial_padding=2)
    return TTSModel(
        lm=lm,
        mimi=None,  # type: ignore[arg-type]
        tokenizer=None,  # type: ignore[arg-type]
        voice_suffix="",
        voice_repo="",
        machine=machine,
        delay_steps=delay_steps,
        temp=0.0,
        **({"n_q": lm.dep_q} | kwargs),
    )


def tts_reference_kwargs(raw: dict) -> dict:
    """moshi's LM kwargs for a Kyutai TTS config.json `raw` (its conditioners, fuser and TTS switches)."""
    from duplexd.engine.weights.config_file import lm_config_from_dict

    kwargs = lm_config_from_dict(raw).to_reference_json()
    kwargs.pop("demux_second_text_stream")
    kwargs |= {k: raw[k] for k in ("conditioners", "fuser", "demux_second_stream", "depformer_weights_per_step")}
    return copy.deepcopy(kwargs)


@torch.no_grad()
def tuned_tts_lm(raw: dict, calibrate, seed: int = 0) -> RefLMModel:
    """moshi's TTS LM for `raw` with every weight redrawn (norms and LayerNorm parameters off 1 and 0, the
    conditioners' padding rows and tables too) and the text head leaning to PAD and NEW_WORD, so the model's own
    samples start words rather than the padding limit: PAD against NEW_WORD along one direction of the hidden
    state, its mean taken out over `calibrate(lm)` (a generation run), so the state's side of it picks, and both
    outweigh the other text tokens."""
    torch.manual_seed(seed)
    lm = loaders.get_moshi_lm(None, lm_kwargs=tts_reference_kwargs(raw), device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for name, p in lm.named_parameters():
        if name.endswith("alpha") or name.endswith("norm_cross.weight"):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias") or "learnt_padding" in name or "embed.weight" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 2 and "emb" not in name:
            p.copy_(1.5 * torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    lm.eval()
    hidden: list[torch.Tensor] = []
    lm.text_linear.register_forward_hook(lambda module, args, out: hidden.append(args[0].reshape(-1, lm.dim)))
    calibrate(lm)
    lm.text_linear._forward_hooks.clear()
    states = torch.cat(hidden)
    mean = states.mean(0)
    u = torch.randn(lm.dim, generator=gen)
    u -= (u @ mean) / (mean @ mean) * mean
    u *= 4.0 / (states @ u).std()
    lm.text_linear.weight[0], lm.text_linear.weight[3] = u, -u
    return lm
