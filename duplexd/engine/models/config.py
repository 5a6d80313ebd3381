"""Model configurations: dataclasses and the released presets.

Field names follow the reference's LM kwargs (`moshi.models.loaders._lm_kwargs`) so a reference `config.json`
maps onto `LMConfig` key for key (`weights/config_file.py` reads one); everything derived (head dims, gated hidden
sizes, special ids) is a property.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration that duplexd cannot run, with the offending key named."""


# Ring KV cache rules (`LMConfig.ring_rule`, `MimiConfig.ring_rule`): how many of the window's `context` keys the rule
# leaves out once full.
RING_RULES: dict[str, int] = {"moshi": 0, "personaplex": 1}


def gated_hidden(dim: int, dim_feedforward: int) -> int:
    """Hidden width of the reference's SiLU-gated MLP for a given feed-forward size."""
    if dim_feedforward == 4 * dim:
        return 21 * dim // 8
    return 2 * dim_feedforward // 3


@dataclass(frozen=True)
class LMConfig:
    """The Moshi LM: temporal transformer over 1 text + `n_q` audio streams, and the DepFormer.

    `dep_q = 0` is a text-only model (Kyutai STT): no DepFormer, every audio stream is the user's. Its optional
    `extra_heads_num_heads` heads (`Linear(dim, extra_heads_dim)` on the post-`out_norm` hidden state, softmaxed)
    are the 1B's semantic VAD: class 0 is the probability of a pause.
    """

    dim: int = 4096
    text_card: int = 32000
    existing_text_padding_id: int = 3
    existing_text_end_padding_id: int = 0
    n_q: int = 16
    dep_q: int = 8
    card: int = 2048
    num_heads: int = 32
    num_layers: int = 32
    hidden_scale: float = 4.125
    context: int = 3000
    max_period: float = 10000.0
    depformer_dim: int = 1024
    depformer_dim_feedforward: int = 4224
    depformer_num_heads: int = 16
    depformer_num_layers: int = 6
    delays: tuple[int, ...] = (0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1)
    extra_heads_num_heads: int = 0
    extra_heads_dim: int = 6
    # Kyutai TTS: the text input is two muxed streams (`(second + 1) * (text_card + 1) + main`), each temporal layer
    # cross-attends to the voice, and the DepFormer shares weight sets between steps (`schedule[step]`) and embeds
    # its input tokens at a low rank.
    demux_second_text_stream: bool = False
    cross_attention: bool = False
    depformer_weights_per_step_schedule: tuple[int, ...] | None = None
    depformer_low_rank_embeddings: int | None = None
    # Not a reference key: which ring KV cache the checkpoint's own server runs, chosen by the loader. "moshi"
    # (moshi 0.2.13) attends all `context` keys once the window is full; "personaplex" (NVIDIA's fork, which carries
    # moshi's older ring cache) gives the oldest entry a future position, so it attends `context - 1`.
    ring_rule: str = "moshi"

    def __post_init__(self) -> None:
        object.__setattr__(self, "delays", tuple(int(d) for d in self.delays))
        schedule = self.depformer_weights_per_step_schedule
        if schedule is not None:
            schedule = tuple(int(k) for k in schedule)
            object.__setattr__(self, "depformer_weights_per_step_schedule", schedule)
            if len(schedule) != self.dep_q or min(schedule, default=0) < 0:
                raise ConfigError(
                    f"depformer_weights_per_step_schedule has {len(schedule)} entries, expected dep_q = {self.dep_q}"
                    " weight-set indices >= 0"
                )
        if self.depformer_low_rank_embeddings is not None and self.depformer_low_rank_embeddings < 1:
            raise ConfigError("depformer_low_rank_embeddings must be a positive rank")
        if len(self.delays) != self.num_codebooks:
            raise ConfigError(f"delays has {len(self.delays)} entries, expected n_q + 1 = {self.num_codebooks}")
        if self.dim % self.num_heads or self.depformer_dim % self.depformer_num_heads:
            raise ConfigError("dim and depformer_dim must be divisible by their head counts")
        if self.head_dim % 2:
            raise ConfigError(f"head dim {self.head_dim} must be even for RoPE")
        if not 0 <= self.dep_q <= self.n_q:
            raise ConfigError(f"dep_q={self.dep_q} must be in 0..n_q={self.n_q}")
        if self.predicts_user_audio and self.n_q % 2:
            raise ConfigError(f"dep_q = n_q = {self.n_q} (PersonaPlex) needs an even n_q: half agent, half user")
        if not self.text_only and self.num_user_codebooks > self.agent_codebooks:
            raise ConfigError("more user codebooks than model codebooks is not supported")
        if self.extra_heads_num_heads < 0 or self.extra_heads_dim < 1:
            raise ConfigError("extra_heads_num_heads must be >= 0 and extra_heads_dim >= 1")
        if self.context < 1:
            raise ConfigError("context must be positive")
        if self.ring_rule not in RING_RULES:
            raise ConfigError(f"ring_rule {self.ring_rule!r} is not one of {', '.join(RING_RULES)}")
        if self.attention_window < 1:
            raise ConfigError(f"context {self.context} leaves no key to attend under the {self.ring_rule} ring rule")

    # Derived sizes.
    @property
    def attention_window(self) -> int:
        """Keys a temporal query attends once the window is full (`ring_rule`), in decode and in the prefill."""
        return self.context - RING_RULES[self.ring_rule]

    @property
    def num_codebooks(self) -> int:
        return self.n_q + 1

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def hidden(self) -> int:
        return gated_hidden(self.dim, int(self.hidden_scale * self.dim))

    @property
    def depformer_head_dim(self) -> int:
        return self.depformer_dim // self.depformer_num_heads

    @property
    def depformer_hidden(self) -> int:
        return gated_hidden(self.depformer_dim, self.depformer_dim_feedforward)

    @property
    def max_delay(self) -> int:
        return max(self.delays)

    @property
    def depformer_weight_sets(self) -> int:
        """DepFormer weight sets stored: one per step, or as many as the schedule names (11 for Kyutai TTS)."""
        schedule = self.depformer_weights_per_step_schedule
        return max(schedule) + 1 if schedule else self.agent_codebooks

    def depformer_weight_set(self, step: int) -> int:
        """The weight set DepFormer step `step` runs with."""
        schedule = self.depformer_weights_per_step_schedule
        return schedule[step] if schedule else step

    @property
    def text_in_card(self) -> int:
        """Rows of the text input embedding (the text vocabulary and the initial token): what muxed ids divide by."""
        return self.text_card + 1

    @property
    def predicts_user_audio(self) -> bool:
        """The DepFormer also predicts the user's codebooks (`dep_q == n_q`: PersonaPlex).

        Those predictions are always replaced by the user's real codes, and the DepFormer is causal over its
        steps, so they never change what the agent says: duplexd runs only the agent's steps. Such a model also
        follows PersonaPlex's streaming rules (a persona prompt, and the user's audio read one frame later).
        """
        return self.dep_q == self.n_q and not self.speaks_text

    @property
    def speaks_text(self) -> bool:
        """A text-to-speech model (Kyutai TTS): its text is forced from the words to say, it takes no audio in, and
        its DepFormer predicts every codebook (`dep_q == n_q`)."""
        return self.cross_attention or self.demux_second_text_stream

    @property
    def text_only(self) -> bool:
        """No DepFormer (`dep_q == 0`: Kyutai STT): the model writes text only, every audio stream is the user's,
        and neither the DepFormer nor Mimi's decoder is run."""
        return self.dep_q == 0

    @property
    def user_lag(self) -> int:
        """Frames between a user frame and the step that first reads it, beyond the stream's delay.

        0 for Moshi: the codes of user frame n are read at step n. 1 for PersonaPlex and for text-only models:
        step n reads user frame n - 1 and step 0 reads the initial tokens. That is the STT convention of
        moshi-server (Rust `asr.rs`) and of `moshi.run_inference`, which feeds moshi's Python `LMGen` frame 0
        twice: `LMGen` fed [c0, c0, c1, c2, ...] equals duplexd fed [c0, c1, c2, ...], output for output.
        """
        return 1 if self.predicts_user_audio or self.text_only else 0

    @property
    def agent_codebooks(self) -> int:
        """Audio codebooks the model speaks (8 for Moshi and PersonaPlex): the DepFormer steps duplexd runs."""
        return self.n_q // 2 if self.predicts_user_audio else self.dep_q

    @property
    def num_user_codebooks(self) -> int:
        """User audio codebooks fed to the model (8 for Moshi and PersonaPlex)."""
        return self.n_q - self.agent_codebooks

    # Special token ids (reference `LMModel` properties).
    @property
    def initial_token_id(self) -> int:
        return self.card

    @property
    def text_initial_token_id(self) -> int:
        return self.text_card

    @property
    def text_padding_token_id(self) -> int:
        return self.existing_text_padding_id

    @property
    def end_of_text_padding_id(self) -> int:
        return self.existing_text_end_padding_id

    @property
    def silent_text_ids(self) -> frozenset[int]:
        """Text tokens that say nothing (padding, end of padding): never shown, never penalised."""
        return frozenset((self.text_padding_token_id, self.end_of_text_padding_id))

    def to_reference_json(self) -> dict[str, Any]:
        """The reference `config.json` form (LM kwargs); readable by both duplexd and `moshi`."""
        out = dataclasses.asdict(self)
        out["delays"] = list(self.delays)
        if self.depformer_weights_per_step_schedule is not None:
            out["depformer_weights_per_step_schedule"] = list(self.depformer_weights_per_step_schedule)
        del out["ring_rule"]  # duplexd's own: the reference knows one rule
        out.update(REFERENCE_FIXED)
        return out


# Reference LM kwargs duplexd implements with exactly these values (written into every config it makes; reading one,
# `weights.config_file`, refuses any other value).
REFERENCE_FIXED: dict[str, Any] = {
    "causal": True,
    "layer_scale": None,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
}
MOSHI_7B = LMConfig()
# PersonaPlex 7B (`nvidia/personaplex-7b-v1`): Moshi 7B whose DepFormer also predicts the user's 8 codebooks.
PERSONAPLEX_7B = dataclasses.replace(MOSHI_7B, dep_q=16, ring_rule="personaplex")

# Tiny, real architecture: several layers and heads, all 16 input codebooks, 8 DepFormer steps.
# `text_card` is replaced by the demo tokenizer's vocabulary size when the demo is written.
DEMO = LMConfig(
    dim=128,
    text_card=1000,
    num_heads=4,
    num_layers=3,
    depformer_dim=64,
    depformer_dim_feedforward=int(4.125 * 64),
    depformer_num_heads=4,
    depformer_num_layers=2,
)

# Kyutai STT (`kyutai/stt-1b-en_fr`, with the semantic-VAD heads of its `-candle` release, and `kyutai/stt-2.6b-en`):
# text only, all 32 Mimi codebooks in, no delays, RoPE period 1e5; the 2.6B has head dim 64.
STT_1B = LMConfig(
    dim=2048,
    text_card=8000,
    n_q=32,
    dep_q=0,
    num_heads=16,
    num_layers=16,
    context=750,
    max_period=100000.0,
    delays=(0,) * 33,
    extra_heads_num_heads=4,
)
STT_2_6B = dataclasses.replace(
    STT_1B, text_card=4000, num_heads=32, num_layers=48, context=375, extra_heads_num_heads=0
)
# Tiny STT of the same architecture: several layers and heads, 32 codebooks in, 4 VAD heads, and a window of 32
# frames (2.56 s) so that sessions run past it. `text_card` is the demo tokenizer's, as for `DEMO`.
DEMO_STT = dataclasses.replace(STT_1B, dim=128, text_card=1000, num_heads=4, num_layers=3, context=32)

# Kyutai TTS 1.6B (`kyutai/tts-1.6b-en_fr`): no audio in, 32 codebooks out through a 4-layer DepFormer of 11 weight
# sets, the text muxed with a lookahead stream, cross-attention to the voice in every temporal layer.
TTS_1_6B = LMConfig(
    dim=2048,
    text_card=8000,
    n_q=32,
    dep_q=32,
    num_heads=16,
    num_layers=16,
    context=500,
    depformer_dim=1024,
    depformer_dim_feedforward=3072,
    depformer_num_heads=16,
    depformer_num_layers=4,
    delays=(0, 0) + (2,) * 31,
    demux_second_text_stream=True,
    cross_attention=True,
    depformer_weights_per_step_schedule=tuple(range(8)) + (8,) * 8 + (9,) * 8 + (10,) * 8,
    depformer_low_rank_embeddings=128,
)

PRESETS: dict[str, LMConfig] = {
    "moshi-7b": MOSHI_7B,
    "demo": DEMO,
    "stt-1b": STT_1B,
    "stt-2.6b": STT_2_6B,
    "demo-stt": DEMO_STT,
}


@dataclass(frozen=True)
class MimiConfig:
    """The Mimi codec (reference `loaders._mimi_config`): SEANet + transformers + split RVQ.

    The encoder SEANet downsamples by `prod(ratios)` to `sample_rate / hop` Hz, a learnt strided conv takes that
    to `frame_rate`; one codec frame is `frame_size` samples. Only the first `num_codebooks` codebooks are used.
    """

    sample_rate: int = 24000
    frame_rate: float = 12.5
    channels: int = 1
    # SEANet
    dimension: int = 512
    n_filters: int = 64
    ratios: tuple[int, ...] = (8, 6, 5, 4)
    n_residual_layers: int = 1
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_base: int = 2
    compress: int = 2
    # Encoder and decoder transformers (d_model = dimension)
    num_heads: int = 8
    num_layers: int = 8
    dim_feedforward: int = 2048
    layer_scale: float = 0.01
    context: int = 250
    max_period: float = 10000.0
    # Split residual vector quantizer
    codebook_dim: int = 256
    n_q: int = 32
    n_q_semantic: int = 1
    card: int = 2048
    num_codebooks: int = 8
    # The released model upsamples channel-wise (reference `upsample_channel_wise_bug=True`).
    upsample_channel_wise: bool = True
    # Not a reference key: the ring KV cache of the server the LM beside it was made for (`LMConfig.ring_rule`),
    # chosen with the LM's (`weights.checkpoint.mimi_ring_rule`). A frame writes its steps' keys, then attends:
    # "moshi" (moshi 0.2.13) every key of the ring within `context` of a query; "personaplex" (NVIDIA's fork, whose
    # older ring cache Mimi's transformers carry too) gives the oldest entry of a full ring a future position, so
    # a frame's queries attend only its newest `context - 1` positions (`attention_window`).
    ring_rule: str = "moshi"

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratios", tuple(int(r) for r in self.ratios))
        if self.channels != 1:
            raise ConfigError("only mono Mimi is supported")
        if self.dimension % self.num_heads or (self.dimension // self.num_heads) % 2:
            raise ConfigError("dimension must split into heads of even size")
        if self.encoder_frame_rate % self.frame_rate or self.encoder_frame_rate <= self.frame_rate:
            raise ConfigError(
                f"encoder rate {self.encoder_frame_rate} Hz must be an integer multiple of frame_rate {self.frame_rate}"
            )
        if self.sample_rate % self.frame_rate or self.frame_size != self.hop_length * self.downsample_stride:
            raise ConfigError("frame_size must be a whole number of samples")
        if not self.n_q_semantic < self.n_q or not self.n_q_semantic <= self.num_codebooks <= self.n_q:
            raise ConfigError(f"num_codebooks={self.num_codebooks} must be in {self.n_q_semantic}..{self.n_q}")
        if self.context < 1:
            raise ConfigError("context must be positive")
        if self.ring_rule not in RING_RULES:
            raise ConfigError(f"ring_rule {self.ring_rule!r} is not one of {', '.join(RING_RULES)}")
        if self.attention_window < self.downsample_stride:
            raise ConfigError(
                f"context {self.context} leaves the first of a frame's {self.downsample_stride} transformer steps no "
                f"key to attend under the {self.ring_rule} ring rule"
            )

    @property
    def attention_window(self) -> int:
        """The newest positions of a slot's ring that a frame's transformer queries attend (`ring_rule`); each query
        also only those within `context` of itself."""
        return self.context - RING_RULES[self.ring_rule]

    @property
    def hop_length(self) -> int:
        """Samples per encoder (SEANet) step."""
        hop = 1
        for ratio in self.ratios:
            hop *= ratio
        return hop

    @property
    def encoder_frame_rate(self) -> float:
        return self.sample_rate / self.hop_length

    @property
    def downsample_stride(self) -> int:
        return int(self.encoder_frame_rate / self.frame_rate)

    @property
    def frame_size(self) -> int:
        """Samples per codec frame (1920 = 80 ms at 24 kHz for the released model)."""
        return int(self.sample_rate / self.frame_rate)

    @property
    def head_dim(self) -> int:
        return self.dimension // self.num_heads

    def to_reference_dict(self) -> dict[str, Any]:
        """The reference's `mimi_config` form (`loaders._mimi_config`), for `loaders.get_mimi(None, it)`."""
        d = self.dimension
        seanet = {
            "channels": self.channels,
            "dimension": d,
            "causal": True,
            "n_filters": self.n_filters,
            "n_residual_layers": self.n_residual_layers,
            "activation": "ELU",
            "compress": self.compress,
            "dilation_base": self.dilation_base,
            "disable_norm_outer_blocks": 0,
            "kernel_size": self.kernel_size,
            "residual_kernel_size": self.residual_kernel_size,
            "last_kernel_size": self.last_kernel_size,
            "norm": "none",
            "pad_mode": "constant",
            "ratios": list(self.ratios),
            "true_skip": True,
        }
        quantizer = {
            "dimension": self.codebook_dim,
            "n_q": self.n_q,
            "bins": self.card,
            "input_dimension": d,
            "output_dimension": d,
        }
        transformer = {
            "d_model": d,
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "causal": True,
            "layer_scale": self.layer_scale,
            "context": self.context,
            "conv_layout": True,
            "max_period": self.max_period,
            "gating": "none",
            "norm": "layer_norm",
            "positional_embedding": "rope",
            "dim_feedforward": self.dim_feedforward,
            "input_dimension": d,
            "output_dimensions": [d],
        }
        return {
            "sample_rate": self.sample_rate,
            "channels": self.channels,
            "frame_rate": self.frame_rate,
            "seanet": seanet,
            "quantizer": quantizer,
            "transformer": transformer,
        }


MIMI = MimiConfig()

# Tiny, same architecture and every code path (SEANet stages, resampling, both transformers, split RVQ with
# 2048-entry codebooks); hop 960 at 24 kHz keeps the 1920-sample frame.
DEMO_MIMI = MimiConfig(
    dimension=32,
    n_filters=4,
    num_heads=2,
    num_layers=2,
    dim_feedforward=64,
    codebook_dim=16,
    n_q=16,
)

# What STT reads: all 32 codebooks (the reference's `CheckpointInfo.get_mimi` takes max(dep_q, n_q - dep_q)).
MIMI_32 = dataclasses.replace(MIMI, num_codebooks=32)
DEMO_MIMI_32 = dataclasses.replace(DEMO_MIMI, n_q=32, num_codebooks=32)

MIMI_PRESETS: dict[str, MimiConfig] = {"mimi": MIMI, "demo": DEMO_MIMI, "mimi-32": MIMI_32, "demo-32": DEMO_MIMI_32}
# The Mimi preset whose codebooks each LM preset reads and writes.
PRESET_MIMI: dict[str, str] = {
    "moshi-7b": "mimi",
    "demo": "demo",
    "stt-1b": "mimi-32",
    "stt-2.6b": "mimi-32",
    "demo-stt": "demo-32",
}
