"""Which weight files a model is loaded from, and checking them all before the first one is loaded.

`duplexd infer` and `duplexd serve` take the same file options; both resolve them here: explicit files, a Hugging
Face repo for those not given, or (none) the embedded demo model. `check_model_files` resolves every reference to a
local file and reads what is cheap to read (safetensors headers, the config), so a missing or corrupt file is
refused in seconds, naming its option, instead of after minutes of loading the others.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from ..models.config import MIMI_PRESETS, LMConfig
from ..models.tokenizer import TextTokenizer
from .checkpoint import (
    CONFIG_NAME,
    MIMI_NAME,
    TOKENIZER_NAME,
    checkpoint_names,
    lm_config_for,
    lm_file_name,
    mimi_preset_of,
    repo_config,
)
from .demo import ensure_demo, ensure_demo_stt
from .hub import hub_repo, resolve_file

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelFiles:
    """Weight references (paths, `hf://org/repo/file` or repo ids) and the Mimi preset they are read with."""

    moshi: str
    mimi: str
    tokenizer: str
    config: str | None
    mimi_preset: str
    hf_repo: str | None = None  # where the references not given explicitly come from


def model_files(
    *,
    moshi_weight: str | None = None,
    mimi_weight: str | None = None,
    tokenizer: str | None = None,
    config: str | None = None,
    hf_repo: str | None = None,
    mimi_preset: str | None = None,
) -> ModelFiles:
    """Where the weights come from: explicit files, a Hugging Face repo (or a local folder holding one) for those
    not given, or (neither) the demo model. The files not given are those the repo's config.json names. The Mimi
    preset, when not given: `_mimi_preset`."""
    if hf_repo == "demo-stt":  # the demo speech-to-text model, written into the cache
        stt = ensure_demo_stt()
        return ModelFiles(str(stt.lm), str(stt.mimi), str(stt.tokenizer), str(stt.config), stt.mimi_preset, hf_repo)
    if hf_repo:
        folder = Path(hf_repo).expanduser()
        local = folder.is_dir()
        base = str(folder) if local else f"hf://{hf_repo}"
        found = repo_config(hf_repo)
        names = checkpoint_names(found)
        mimi = mimi_weight or f"{base}/{names.mimi}"
        return ModelFiles(
            moshi_weight or f"{base}/{names.moshi}",
            mimi,
            tokenizer or f"{base}/{names.tokenizer}",
            config or (str(found) if local and found is not None else None),
            mimi_preset or _mimi_preset(names.stt, config, mimi),
            hf_repo,
        )
    given = {"moshi_weight": moshi_weight, "mimi_weight": mimi_weight, "tokenizer": tokenizer}
    if any(given.values()):
        missing = [name for name, value in given.items() if not value]
        if missing:
            flags = ", ".join("--" + name.replace("_", "-") for name in missing)
            raise CheckpointError(f"{flags}: missing; pass them too, or --hf-repo to take them from a repo")
        preset = mimi_preset or _mimi_preset(False, config, str(mimi_weight))
        return ModelFiles(moshi_weight, mimi_weight, tokenizer, config, preset)  # type: ignore[arg-type]
    demo = ensure_demo()
    logger.warning("no weights given: using the demo model (random weights; it speaks noise)")
    return ModelFiles(str(demo.lm), str(demo.mimi), str(demo.tokenizer), config or str(demo.config), "demo")


def _mimi_preset(stt: bool, config: str | None, mimi: str) -> str:
    """The Mimi preset when none is given: the codebooks the LM reads (all 32 for a speech-to-text LM, by its repo's
    config or a local `config`, else 8), at full size (`mimi-32`, `mimi`) unless `mimi` is a local file of the
    demo's tiny Mimi (`demo-32`, `demo`: its header says so), so a demo folder needs no flag either."""
    if not stt and config is not None and Path(config).expanduser().is_file():
        stt = checkpoint_names(Path(config).expanduser()).stt
    full, tiny = ("mimi-32", "demo-32") if stt else ("mimi", "demo")
    path = Path(mimi.removeprefix("file://")).expanduser()
    preset = tiny if path.is_file() and mimi_preset_of(path, (tiny,)) == tiny else full
    if stt:
        logger.info("a speech-to-text LM: Mimi with all 32 codebooks (%s)", preset)
    return preset


def check_mimi_preset(preset: str, cfg: LMConfig) -> None:
    """The Mimi preset must give the LM all the codebooks it reads (a speech-to-text LM reads 32): refused before
    any model loads, tagged with its option."""
    mimi = MIMI_PRESETS[preset]
    if mimi.num_codebooks < cfg.num_user_codebooks or mimi.card != cfg.card:
        stt = " (a speech-to-text LM: leave the option out, or give a -32 preset)" if cfg.text_only else ""
        raise CheckpointError(
            f"{preset}: Mimi with {mimi.num_codebooks} codebooks of {mimi.card}, and the LM reads "
            f"{cfg.num_user_codebooks} of {cfg.card}{stt}",
            "mimi_preset",
        )


def local_file(ref: str, default_name: str, option: str) -> Path:
    """`ref` as a local file (downloaded if it is on the hub); `CheckpointError` tagged with `option`, its message
    starting with `ref`."""
    text = ref.removeprefix("file://")
    path = Path(text).expanduser()
    if not text.startswith("hf://") and not path.exists() and hub_repo(text) is None:
        raise CheckpointError(f"{ref}: file not found", option)
    try:
        return resolve_file(ref, default_name)
    except CheckpointError as e:
        raise CheckpointError(f"{ref}: {e}", option) from None


def _check_safetensors(path: Path, ref: str, option: str) -> None:
    """Reads the header only: a truncated or foreign file fails here, not after the other models are loaded."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{ref}: not a readable safetensors file ({e})", option) from None


def check_tokenizer(tokenizer: TextTokenizer, cfg: LMConfig, path: str | Path) -> None:
    """The LM writes text ids up to `text_card`; a tokenizer with fewer pieces would fail mid-session."""
    if tokenizer.vocab_size < cfg.text_card:
        raise CheckpointError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} pieces but the LM writes {cfg.text_card} text tokens; "
            "pass the tokenizer the LM was trained with",
            "tokenizer",
        )


def check_lm_files(ref: str, config: str | None, option: str = "moshi_weight") -> LMConfig:
    """The LM weights' header and its configuration checked; returns the configuration they will load with."""
    path = local_file(ref, lm_file_name(ref), option)
    _check_safetensors(path, ref, option)
    config_path = config and str(local_file(config, CONFIG_NAME, "config"))
    try:
        return lm_config_for(path, config_path, ref)
    except CheckpointError as e:  # its message starts with the config file's path
        raise CheckpointError(str(e), "config" if config else option) from None


def check_tokenizer_file(ref: str, cfg: LMConfig, option: str = "tokenizer") -> None:
    """The tokenizer readable and large enough for the LM."""
    path = local_file(ref, TOKENIZER_NAME, option)
    try:
        check_tokenizer(TextTokenizer(path), cfg, ref)
    except CheckpointError as e:  # its message starts with the tokenizer's path
        raise CheckpointError(str(e), option) from None


def check_model_files(files: ModelFiles) -> LMConfig:
    """Every reference resolved to a local file (hub files are downloaded into the cache, where loading finds them)
    and checked as far as is cheap: safetensors headers, the LM config, the tokenizer; returns the LM's
    configuration. Raises `CheckpointError` tagged with the option at fault."""

    def option(ref: str, name: str, own: str) -> str:
        return "hf_repo" if files.hf_repo and ref == f"hf://{files.hf_repo}/{name}" else own

    lm_option = option(files.moshi, lm_file_name(files.hf_repo) if files.hf_repo else "", "moshi_weight")
    cfg = check_lm_files(files.moshi, files.config, lm_option)
    check_mimi_preset(files.mimi_preset, cfg)
    mimi_option = option(files.mimi, MIMI_NAME, "mimi_weight")
    _check_safetensors(local_file(files.mimi, MIMI_NAME, mimi_option), files.mimi, mimi_option)
    check_tokenizer_file(files.tokenizer, cfg, option(files.tokenizer, TOKENIZER_NAME, "tokenizer"))
    return cfg
