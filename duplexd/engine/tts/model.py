"""A Kyutai TTS model folder loaded whole: the LM and its conditioners (one file), Mimi decoding the codebooks it
says, the text tokenizer, and the voices.

How many codebooks it says (`n_q`) is the model's own count unless asked for fewer. That default is what a
moshi-server user hears: its TTS worker (`rust/moshi-server/tts.py`) is configured with `n_q = 24`, but that value
only reaches `TTSModel.from_checkpoint_info`, which passes it to Mimi's `set_num_codebooks` (its encoder's setting;
`decode` decodes every codebook it is given), while the worker's `LMGen` keeps `lm.dep_q` at the model's 32: the
DepFormer samples 32 codebooks and Mimi decodes 32. Fewer (`--n-q 24`) is what moshi's `TTSModel.generate` says with
`n_q=24` (it sets `lm.dep_q = n_q`): a quarter fewer DepFormer steps, the others read as the zero token.

The folder is laid out as Kyutai publishes `kyutai/tts-1.6b-en_fr`: a `config.json` (LM kwargs plus `model_type`
"tts", `tts_config`, `conditioners`, `fuser`, `model_id`) naming its files (`moshi_name`, `mimi_name`,
`tokenizer_name`). A voice is an embedding file laid out as `kyutai/tts-voices` lays them out: `NAME` +
`.<sig>@<epoch>.safetensors` under a voices folder (`expresso/ex03-ex01_happy_001_channel1_334s.wav` is a name),
holding `speaker_wavs` [1, speaker_dim, frames].
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..errors import CheckpointError, InputRefused
from ..models.config import MIMI_PRESETS, ConfigError
from ..models.lm import LMModel
from ..models.mimi import MimiModel
from ..models.tokenizer import TextTokenizer
from ..weights.checkpoint import CONFIG_NAME, MIMI_NAME, MOSHI_NAME, load_lm, load_mimi, mimi_preset_of
from ..weights.config_file import lm_config_from_dict
from .checkpoint import load_conditioner
from .conditioning import Conditioner
from .config import TTSConfig, tts_config_from_dict

logger = logging.getLogger(__name__)

MIMI_32 = ("demo-32", "mimi-32")  # the Mimi presets a TTS model decodes with (32 codebooks, n_q of them used)


@dataclass
class TTSModel:
    lm: LMModel
    conditioner: Conditioner
    tts: TTSConfig
    mimi: MimiModel
    tokenizer: TextTokenizer
    folder: Path

    @property
    def n_q(self) -> int:
        """The codebooks it says: those its Mimi decodes."""
        return self.mimi.cfg.num_codebooks


def read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder (a Kyutai TTS model folder, or demo-tts)", "model")
    path = folder / CONFIG_NAME
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read it as a JSON config ({e})", "model") from None
    if not isinstance(raw, dict) or (raw.get("model_type") != "tts" and "tts_config" not in raw):
        raise CheckpointError(f"{folder} is not a Kyutai TTS model (its config.json has no model_type tts)", "model")
    return raw


def load_tts(
    folder: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    weights_dtype: str | None = None,
    n_q: int | None = None,
) -> TTSModel:
    """Load the TTS model in `folder`; `CheckpointError` naming the file or key that does not fit. `weights_dtype`:
    the LM's projections as `load_lm` takes them (int8, bf16, or None: as the file stores them; a q8 file's other
    matrices, the conditioners' too, are dequantized as they load). `n_q`: the codebooks to say (default: all the
    model's); `InputRefused` (option `n_q`) outside 1 to the model's."""
    folder = Path(folder)
    raw = read_config(folder)
    try:
        cfg, tts = lm_config_from_dict(raw), tts_config_from_dict(raw)
    except ConfigError as e:
        raise CheckpointError(f"{folder / CONFIG_NAME}: {e}", "model") from None
    assert tts is not None
    n_q = cfg.dep_q if n_q is None else n_q
    if not 1 <= n_q <= cfg.dep_q:
        raise InputRefused(f"{n_q}: {folder.name} says 1 to {cfg.dep_q} codebooks", "n_q")
    weights = folder / raw.get("moshi_name", MOSHI_NAME)
    mimi_path = folder / raw.get("mimi_name", MIMI_NAME)
    tokenizer_path = folder / raw.get("tokenizer_name", "tokenizer.model")
    for path in (weights, mimi_path, tokenizer_path):
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (named by {folder / CONFIG_NAME})", "model")
    try:
        lm = load_lm(weights, cfg, device=device, dtype=dtype, weights_dtype=weights_dtype)
    except ConfigError as e:
        raise CheckpointError(str(e), "model") from None
    conditioner = Conditioner(tts, cfg.dim)
    load_conditioner(conditioner, weights)
    preset = mimi_preset_of(mimi_path, MIMI_32)
    if preset is None:
        raise CheckpointError(f"{mimi_path} is not a Mimi duplexd knows (32 codebooks: {', '.join(MIMI_32)})", "model")
    if MIMI_PRESETS[preset].n_q < n_q:
        raise CheckpointError(f"{mimi_path} has {MIMI_PRESETS[preset].n_q} codebooks, the model says {n_q}", "model")
    mimi = load_mimi(mimi_path, dataclasses.replace(MIMI_PRESETS[preset], num_codebooks=n_q), device=device)
    tokenizer = TextTokenizer(tokenizer_path)
    if tokenizer.vocab_size != cfg.text_card:
        raise CheckpointError(f"{tokenizer_path} has {tokenizer.vocab_size} pieces, the model {cfg.text_card}", "model")
    logger.info("loaded the TTS model in %s (audio delay %d frames, %d codebooks said)", folder, tts.delay_steps, n_q)
    return TTSModel(lm, conditioner, tts, mimi, tokenizer, folder)


def voice_embedding(voice: str, voices: Path | None, tts: TTSConfig) -> torch.Tensor:
    """The embedding [speaker_dim, frames] of `voice`: an embedding file, or a voice name under `voices` (the
    name plus the model's suffix). `CheckpointError` naming the voice when there is no such voice or the file does
    not hold one of the model's shape."""
    path = Path(voice)
    if not (path.suffix == ".safetensors" and path.is_file()):
        if voices is None:
            raise CheckpointError(f"{voice!r}: not an embedding file, and no voices folder to look it up in", "voice")
        path = voices / (voice + tts.voice_suffix)
        if not path.is_file():
            known = sorted(
                str(p.relative_to(voices)).removesuffix(tts.voice_suffix) for p in voices.rglob("*" + tts.voice_suffix)
            )
            listed = ", ".join(known[:8]) + (" …" if len(known) > 8 else "")
            raise CheckpointError(f"unknown voice {voice!r} in {voices} (voices: {listed or 'none'})", "voice")
    try:
        emb = load_file(str(path))["speaker_wavs"]
    except (SafetensorError, OSError, KeyError) as e:
        raise CheckpointError(f"{path}: not a voice embedding file (speaker_wavs): {e}", "voice") from None
    expected = (1, tts.speaker_dim, tts.speaker_frames)
    if tuple(emb.shape) != expected:
        raise CheckpointError(f"{path}: speaker_wavs is {list(emb.shape)}, the model takes {list(expected)}", "voice")
    return emb[0].float()
