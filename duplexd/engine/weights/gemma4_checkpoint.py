"""Load the Gemma 4 audio tower and `embed_audio` from a Gemma 4 E2B/E4B checkpoint in Hugging Face layout.

Only the audio tensors are read (`model.audio_tower.*`, `model.embed_audio.*`; the LM's gigabytes are skipped),
one tensor at a time through safetensors' mmap, straight into parameters allocated once. On the hub only the
shards holding audio tensors are downloaded. Every failure is a `CheckpointError` naming the file or key.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from ..models.gemma4_audio import Gemma4AudioConfig, Gemma4AudioEncoder
from ..models.log_mel import LogMel
from .hub import hub_file

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# Checkpoint prefix -> prefix in `Gemma4AudioEncoder.state_dict()`, tried in order.
PREFIXES = (
    ("model.audio_tower.", "audio_tower."),
    ("model.embed_audio.", "embed_audio."),
    ("audio_tower.", "audio_tower."),
    ("embed_audio.", "embed_audio."),
)


def _map_key(key: str) -> str | None:
    for src, dst in PREFIXES:
        if key.startswith(src):
            return dst + key[len(src) :]
    return None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


class _Source:
    """A checkpoint location: a local folder, a single .safetensors file, or a hub repo id."""

    def __init__(self, ref: str | Path) -> None:
        self.repo: str | None
        self.root: Path | None
        text = str(ref)
        if text.startswith("hf://"):
            text = text[len("hf://") :]
            self.repo, self.root = text.strip("/"), None
            return
        path = Path(text).expanduser()
        if path.exists():
            self.repo, self.root = None, path
        elif "/" in text and not text.startswith((".", "/", "~")) and text.count("/") == 1 and path.suffix == "":
            self.repo, self.root = text, None
        else:
            raise CheckpointError(f"checkpoint not found: {path}")

    def file(self, name: str, required: bool = True) -> Path | None:
        if self.repo is not None:
            try:
                return hub_file(self.repo, name)
            except CheckpointError:
                if required:
                    raise
                return None
        assert self.root is not None
        path = self.root / name if self.root.is_dir() else self.root.parent / name
        if path.is_file():
            return path
        if required:
            raise CheckpointError(f"file not found: {path}")
        return None

    def shards(self) -> list[Path]:
        """The safetensors files that hold audio tensors."""
        if self.root is not None and self.root.is_file():
            return [self.root]
        index = self.file(INDEX_NAME, required=False)
        if index is None:
            if self.root is not None and not (self.root / SINGLE_NAME).is_file():
                found = sorted(self.root.glob("*.safetensors"))
                if len(found) == 1:
                    return found
                raise CheckpointError(f"file not found: {self.root / SINGLE_NAME} (and no {INDEX_NAME})")
            return [self.file(SINGLE_NAME)]  # type: ignore[list-item]
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        names = sorted({f for k, f in weight_map.items() if _map_key(k) is not None})
        if not names:
            raise CheckpointError(f"{index} lists no audio tensors (model.audio_tower.*): not a Gemma 4 E2B/E4B?")
        return [self.file(n) for n in names]  # type: ignore[misc]

    def config(self) -> dict | None:
        path = self.file(CONFIG_NAME, required=False)
        return None if path is None else _read_json(path)


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path} is not a safetensors file: {e}") from None


def _audio_keys(shards: Iterable[Path]) -> dict[str, tuple[Path, str]]:
    """Model key -> (shard, checkpoint key) for every audio tensor in the shards."""
    out: dict[str, tuple[Path, str]] = {}
    for shard in shards:
        with _open(shard) as f:
            for key in f.keys():
                dst = _map_key(key)
                if dst is not None:
                    out[dst] = (shard, key)
    return out


def config_from_checkpoint(cfg_json: dict | None, keys: dict[str, tuple[Path, str]]) -> Gemma4AudioConfig:
    """Audio config from `config.json` (`audio_config`, `text_config.hidden_size`), defaults otherwise."""
    has_embed = any(k.startswith("embed_audio.") for k in keys)
    text_hidden = None
    audio: dict = {}
    if cfg_json is not None:
        audio = cfg_json.get("audio_config") or {}
        text_hidden = (cfg_json.get("text_config") or {}).get("hidden_size")
        if not audio:
            raise CheckpointError("config.json has no audio_config: this Gemma 4 checkpoint has no audio tower")
    if has_embed and text_hidden is None:
        text_hidden = 1536  # E2B; corrected from the tensor shape below if it differs
    cfg = Gemma4AudioConfig.from_hf(audio, text_hidden_size=text_hidden if has_embed else None)
    if has_embed and cfg_json is None:
        shard, key = keys["embed_audio.embedding_projection.weight"]
        with _open(shard) as f:
            cfg.text_hidden_size = int(f.get_slice(key).get_shape()[0])
    return cfg


def load_gemma4_audio(
    ref: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    config: Gemma4AudioConfig | None = None,
) -> Gemma4AudioEncoder:
    """Build a `Gemma4AudioEncoder` from a Gemma 4 checkpoint (folder, .safetensors file, or hub repo id)."""
    src = _Source(ref)
    shards = src.shards()
    keys = _audio_keys(shards)
    if not keys:
        raise CheckpointError(f"no audio tensors (model.audio_tower.*) in {', '.join(map(str, shards))}")
    cfg = config or config_from_checkpoint(src.config(), keys)
    with torch.device("meta"):
        model = Gemma4AudioEncoder(cfg)
    model.to_empty(device=device)
    model.front_end = LogMel(model.front_end.cfg).to(device)  # constants, not in the checkpoint
    expected = model.state_dict()
    unexpected = sorted(set(keys) - set(expected))
    if unexpected:
        shard, key = keys[unexpected[0]]
        raise CheckpointError(f"unexpected key {key} in {shard} ({len(unexpected)} unexpected in all)")
    missing = sorted(set(expected) - set(keys))
    if missing:
        few = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"missing keys ({len(missing)}): {few}")
    by_shard: dict[Path, list[str]] = {}
    for dst, (shard, _) in keys.items():
        by_shard.setdefault(shard, []).append(dst)
    with torch.no_grad():
        for shard, names in by_shard.items():
            with _open(shard) as f:
                for dst in names:
                    key = keys[dst][1]
                    target = expected[dst]
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != tuple(target.shape):
                        raise CheckpointError(f"shape mismatch for {key}: expected {tuple(target.shape)}, got {shape}")
                    target.copy_(f.get_tensor(key))
    if dtype != torch.float32:  # the front end stays in fp32/fp64
        model.audio_tower.to(dtype=dtype)
        if model.embed_audio is not None:
            model.embed_audio.to(dtype=dtype)
    model.eval()
    logger.info("loaded Gemma 4 audio tower (%d tensors, %d layers) from %s", len(keys), cfg.num_hidden_layers, ref)
    return model.prepare()
