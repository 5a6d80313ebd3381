"""Device memory of a speech service: what `duplexd capacity` sets aside for `duplexd serve --tts`'s streams.

The same allocations the service makes, counted on the `meta` device: the LM (its projections int8 or float) and
Mimi weights, each stream's whole window of KV pages (`TTSGen` reserves one per slot), its voice's cross-attention
keys and values in every layer (5 voice places of 125 frames, and one more row for the scratch slot that pads a
bucket), and its Mimi streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv.paged import PagedKVCache, window_pages
from ..models.config import MIMI_PRESETS, LMConfig
from ..models.mimi import MimiModel, MimiStreams
from ..weights.checkpoint import build_lm, int8_plan
from .config import TTSConfig

PAGE_SIZE = 16  # TTSGen's


@dataclass(frozen=True)
class SpeechMemory:
    weights: int  # LM and Mimi
    kv: int  # every stream's window, the scratch page included
    voices: int  # cross-attention keys and values
    mimi_streams: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.voices + self.mimi_streams


def speech_memory(
    cfg: LMConfig,
    tts: TTSConfig,
    streams: int,
    dtype: torch.dtype,
    mimi_preset: str = "mimi-32",
    weights_dtype: str | None = None,
) -> SpeechMemory:
    """`weights_dtype` "int8": the LM's projections as int8 weights (`--tts-weights-dtype int8`)."""
    lm = build_lm(cfg, "meta", dtype, int8=int8_plan(cfg, set(), weights_dtype))
    with torch.device("meta"):
        mimi = MimiModel(MIMI_PRESETS[mimi_preset])
    weights = sum(t.nbytes for m in (lm, mimi) for t in [*m.parameters(), *m.buffers()])
    page = PagedKVCache.page_bytes(cfg.num_layers, cfg.num_heads, cfg.head_dim, PAGE_SIZE, dtype)
    kv = (streams * window_pages(cfg.context, PAGE_SIZE) + 1) * page
    sources = tts.max_speakers * tts.speaker_frames
    voices = cfg.num_layers * 2 * (streams + 1) * cfg.num_heads * sources * cfg.head_dim * dtype.itemsize
    return SpeechMemory(weights, kv, voices, MimiStreams.state_bytes(mimi, streams))
