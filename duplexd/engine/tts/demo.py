"""The demo TTS model: Kyutai TTS's architecture and file layout at a tiny size, random weights, and two voices.

Every mechanism of `kyutai/tts-1.6b-en_fr` is there (32 codebooks out through an 11-set DepFormer schedule with
low-rank embeddings, the muxed lookahead text, cross-attention to the voice with its position embedding, the
`control` and `cfg` tables, the 1.28 s audio delay) with the demo tokenizer and the 32-codebook demo Mimi, so
`duplexd speak --model demo-tts`, the tests and the benches run with no download. It has learnt nothing: it
speaks noise. Written once into the cache folder, like the other demos.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models.config import DEMO_MIMI_32, TTS_1_6B
from ..models.mimi import MimiModel
from ..models.tokenizer import TextTokenizer
from ..weights.checkpoint import CONFIG_NAME, MIMI_NAME, MOSHI_NAME, save_mimi_weights
from ..weights.demo import (
    DEMO_SEED,
    TOKENIZER_NAME,
    TOKENIZER_VOCAB,
    atomic_write,
    cache_root,
    ensure_demo,
    random_lm,
)
from .checkpoint import save_tts_weights
from .conditioning import Conditioner
from .config import tts_config_from_dict

logger = logging.getLogger(__name__)

DEMO_TTS_VERSION = 1
DEMO_VOICES = ("demo/alice.wav", "demo/bob.wav")
SPEAKER_DIM = 32
CFG_VALUES = [f"{x / 2:.1f}" for x in range(2, 9)]  # "1.0" ... "4.0", as the released model


def tts_keys(speaker_dim: int, control_dim: int, audio_delay: float = 1.28) -> dict:
    """The config.json keys of a Kyutai TTS model beside its LM kwargs, as the 1.6B states them (its `cfg` table of
    coefficients 1.0 to 4.0 and its `control` table), for a voice embedding of `speaker_dim`."""
    return {
        "model_type": "tts",
        "conditioners": {
            "speaker_wavs": {"type": "tensor", "tensor": {"dim": speaker_dim}},
            "cfg": {"type": "lut", "lut": {"n_bins": 7, "dim": 16, "tokenizer": "noop", "possible_values": CFG_VALUES}},
            "control": {
                "type": "lut",
                "lut": {"n_bins": 1, "dim": control_dim, "tokenizer": "noop", "possible_values": ["ok"]},
            },
        },
        "fuser": {
            "cross_attention_pos_emb": True,
            "cross_attention_pos_emb_scale": 1,
            "sum": ["control", "cfg"],
            "prepend": [],
            "cross": ["speaker_wavs"],
        },
        "tts_config": {"audio_delay": audio_delay, "second_stream_ahead": 2},
        "model_id": {"sig": "d0d0d0d0", "epoch": 1},
        "lm_gen_config": {"temp": 0.6, "temp_text": 0.6},
    }


TTS_KEYS = tts_keys(SPEAKER_DIM, 16)
DEMO_TTS = dataclasses.replace(
    TTS_1_6B,
    text_card=TOKENIZER_VOCAB,  # the demo tokenizer's
    dim=128,
    num_heads=4,
    num_layers=3,
    context=64,
    depformer_dim=64,
    depformer_dim_feedforward=128,
    depformer_num_heads=2,
    depformer_num_layers=2,
    depformer_low_rank_embeddings=16,
)


def demo_tts_folder(root: Path | None = None) -> Path:
    """The demo TTS model's folder (written if it is not there yet): config.json, weights, Mimi, tokenizer and a
    `voices/` folder with `DEMO_VOICES`."""
    folder = (root or cache_root()) / f"demo-tts-v{DEMO_TTS_VERSION}"
    config = folder / CONFIG_NAME
    if config.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    logger.info("writing the demo TTS model (random weights: it speaks noise) to %s", folder)
    tokenizer = ensure_demo(root).tokenizer  # the demo tokenizer, shared with the other demos
    atomic_write(folder / TOKENIZER_NAME, lambda p: p.write_bytes(tokenizer.read_bytes()))
    cfg = dataclasses.replace(DEMO_TTS, text_card=TextTokenizer(tokenizer).vocab_size)
    raw = {**cfg.to_reference_json(), **TTS_KEYS, "moshi_name": MOSHI_NAME, "mimi_name": MIMI_NAME}
    raw["tokenizer_name"] = TOKENIZER_NAME
    tts = tts_config_from_dict(raw)
    assert tts is not None
    model = random_lm(cfg, DEMO_SEED)
    conditioner = Conditioner(tts, cfg.dim)
    gen = torch.Generator().manual_seed(DEMO_SEED + 1)
    with torch.no_grad():
        for name, p in conditioner.named_parameters():
            scale = 0.2 if "padding" in name else (1.0 if name.startswith("tables.") else p.shape[0] ** -0.5)
            p.copy_(scale * torch.randn(p.shape, generator=gen))
    atomic_write(folder / MOSHI_NAME, lambda p: save_tts_weights(model, conditioner, p))
    mimi = MimiModel(DEMO_MIMI_32).init_weights_(DEMO_SEED)
    atomic_write(folder / MIMI_NAME, lambda p: save_mimi_weights(mimi, p, naming="fused"))
    for k, name in enumerate(DEMO_VOICES):
        path = folder / "voices" / (name + tts.voice_suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        emb = torch.randn(
            1, SPEAKER_DIM, tts.speaker_frames, generator=torch.Generator().manual_seed(DEMO_SEED + 2 + k)
        )
        atomic_write(path, lambda p, emb=emb: save_file({"speaker_wavs": emb}, str(p)))
    atomic_write(config, lambda p: p.write_text(json.dumps(raw, indent=2)))  # last: it marks the folder complete
    return folder
