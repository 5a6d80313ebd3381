"""The embedded demo models: a tiny random-weight Moshi LM (and a speech-to-text LM), Mimi and tokenizer, in the
reference's format.

It runs everything end to end on a laptop CPU without a download. It has learnt nothing: it speaks noise and
writes word pieces at random, and says so in the log. Files are written once into the user's cache directory
(atomically, so concurrent starts never see half a file) and reused afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ..models.config import DEMO, DEMO_MIMI, DEMO_MIMI_32, DEMO_STT, LMConfig, MimiConfig
from ..models.lm import LMModel
from ..models.mimi import MimiModel
from ..models.tokenizer import TextTokenizer, train_tokenizer
from .checkpoint import CONFIG_NAME, MIMI_NAME, MOSHI_NAME, build_lm, save_lm_weights, save_mimi_weights

logger = logging.getLogger(__name__)

DEMO_VERSION = 2
DEMO_STT_VERSION = 1
# The STT demo's config.json keys beside the LM's, as Kyutai's STT 1B states them.
STT_KEYS = {
    "model_type": "stt",
    "stt_config": {"audio_delay_seconds": 0.5, "audio_silence_prefix_seconds": 0.0},
    "lm_gen_config": {"temp": 0.0, "temp_text": 0.0, "top_k": 250, "top_k_text": 50},
}
DEMO_SEED = 20240917
TOKENIZER_NAME = "tokenizer.model"
TOKENIZER_VOCAB = 1000


@dataclass(frozen=True)
class DemoFiles:
    root: Path
    lm: Path
    mimi: Path
    config: Path
    tokenizer: Path
    mimi_preset: str = "demo"  # the `MIMI_PRESETS` entry its Mimi is read with


def cache_root() -> Path:
    """`$DUPLEXD_CACHE`, else `$XDG_CACHE_HOME/duplexd`, else `~/.cache/duplexd`."""
    if os.environ.get("DUPLEXD_CACHE"):
        return Path(os.environ["DUPLEXD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "duplexd"


def atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@torch.no_grad()
def random_lm(cfg: LMConfig, seed: int) -> LMModel:
    """Seeded random weights at the scale of a trained model's init: N(0, 1/fan_in) matrices, unit norms."""
    gen = torch.Generator().manual_seed(seed)
    model = build_lm(cfg)
    for name, p in model.named_parameters():
        if name.endswith("norm"):
            p.fill_(1.0)
        elif "emb" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


@torch.no_grad()
def draw_random_(lm: LMModel, seed: int) -> LMModel:
    """`random_lm`'s rule (N(0, 1/fan_in) matrices, N(0, 1) embeddings, unit norms) drawn on the model's own device
    and dtype: a 7B model is ready in seconds, with the released shapes, so its step costs what the real one does.
    Benchmarks and `--random-weights` use it; tests want `random_lm` (the same numbers on every machine)."""
    gen = torch.Generator(device=lm.text_emb.device).manual_seed(seed)
    for name, p in lm.named_parameters():
        if name.endswith("norm"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 1.0 if "emb" in name else p.shape[-1] ** -0.5, generator=gen)
    return lm


def ensure_demo(root: Path | None = None) -> DemoFiles:
    """Write the demo files if they are not there yet; return their paths."""
    return _ensure((root or cache_root()) / f"demo-v{DEMO_VERSION}", DEMO, DEMO_MIMI, "demo", "it speaks noise")


def ensure_demo_stt(root: Path | None = None) -> DemoFiles:
    """The demo speech-to-text model (preset `demo-stt`: Kyutai STT's architecture, tiny, with four semantic-VAD
    heads and a 32-frame window) and its 32-codebook Mimi (`mimi_preset` "demo-32"), written if they are not there
    yet; the same tokenizer as the demo Moshi. It has learnt nothing: its text is a jumble of word pieces."""
    root = (root or cache_root()) / f"demo-stt-v{DEMO_STT_VERSION}"
    return _ensure(root, DEMO_STT, DEMO_MIMI_32, "demo-32", "its text is noise", STT_KEYS)


def _ensure(
    root: Path, cfg: LMConfig, mimi_cfg: MimiConfig, mimi_preset: str, says: str, keys: dict | None = None
) -> DemoFiles:
    """Write the files of a demo model in `root` unless they are all there; `keys`: more config.json keys."""
    files = DemoFiles(root, root / MOSHI_NAME, root / MIMI_NAME, root / CONFIG_NAME, root / TOKENIZER_NAME, mimi_preset)
    if all(p.is_file() for p in (files.lm, files.mimi, files.config, files.tokenizer)):
        return files
    root.mkdir(parents=True, exist_ok=True)
    logger.info("writing a demo model (random weights, %s) to %s", says, root)
    corpus = (resources.files(__package__) / "data" / "demo_corpus.txt").read_text(encoding="utf-8")
    atomic_write(files.tokenizer, lambda p: train_tokenizer(corpus.splitlines(), p, TOKENIZER_VOCAB))
    cfg = dataclasses.replace(cfg, text_card=TextTokenizer(files.tokenizer).vocab_size)
    model = random_lm(cfg, DEMO_SEED)
    atomic_write(files.lm, lambda p: save_lm_weights(model, p, naming="fused"))
    mimi = MimiModel(mimi_cfg).init_weights_(DEMO_SEED)
    atomic_write(files.mimi, lambda p: save_mimi_weights(mimi, p, naming="fused"))
    config = {
        **cfg.to_reference_json(),
        "moshi_name": MOSHI_NAME,
        "mimi_name": MIMI_NAME,
        "tokenizer_name": TOKENIZER_NAME,
        **(keys or {}),
    }
    atomic_write(files.config, lambda p: p.write_text(json.dumps(config, indent=2)))
    return files
