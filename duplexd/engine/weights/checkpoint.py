"""Load the Moshi LM from safetensors in either of the reference's key namings, tensor by tensor.

The reference stores attention projections either per module (`self_attn.in_projs.{k}.weight`, one per
DepFormer step) or fused (`self_attn.in_proj_weight`, the DepFormer's steps stacked along dim 0). Both map onto
duplexd's parameters through one table of `KeyMap` rows; the same table writes checkpoints in reference naming.
Tensors are read one at a time through safetensors' mmap and copied into preallocated parameters, so peak
memory stays near the size of the weights.

Kyutai's q8 files store every projection as int8 codes (`…weight`) plus an fp32 row absmax (`…weight_scb`); a
projection can also be quantized as it is read from a float file (`--weights-dtype int8`), by the same recipe, so
both routes give the same int8 tensors (`models.int8_weights`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..models.config import MIMI, MIMI_PRESETS, MOSHI_7B, ConfigError, LMConfig, MimiConfig
from ..models.int8_weights import (
    WEIGHT_DTYPES,
    Int8Weight,
    dequantize_,
    int8_layout_,
    int8_names,
    quantizable,
    quantize_,
    quantize_rows,
)
from ..models.lm import LMModel
from ..models.mimi import MimiModel, reference_keys
from .config_file import SttSettings, lm_config_from_dict, stt_settings_from_dict
from .hub import hub_file, hub_repo, resolve_file

logger = logging.getLogger(__name__)

MOSHI_NAME = "model.safetensors"
MIMI_NAME = "tokenizer-e351c8d8-checkpoint125.safetensors"
# `--weights-dtype int8` keeps the text head in the float dtype: on bench/weights_dtype.py its text logits are 3x
# closer to the float model's (relative error 2.5e-3 against 7.0e-3, top-1 99.7 % against 98.6 %) for 0.12 GiB
# on Moshi 7B, which changes no GPU's session count (docs/BENCHMARKS.md). A q8 file's int8 head stays as stored.
INT8_TEXT_HEAD = False
CONFIG_NAME = "config.json"
NAMINGS = ("module", "fused")


@dataclass(frozen=True)
class KeyMap:
    """One checkpoint tensor: its key, shape, and where it lands (a parameter, or one step of it).

    Projection weights are [out, in] in the checkpoint and [in, out] in duplexd (`transposed`). `param` None: the
    tensor is checked but not loaded (PersonaPlex's DepFormer steps for the user's codebooks); `lead`: only the
    tensor's first `lead` rows are loaded (the agent's steps of a fused DepFormer projection). `dtype`: the
    safetensors dtype the file must hold (q8 codes and scales), `FLOAT` for any float, None unchecked.
    `quantize`: a float projection read into the int8 weight `param` (its `.codes` and `.absmax`). `scales`: the
    key of the fp32 row scales of a q8 pair whose int8 codes land in a float `param`, dequantized as they are read.
    """

    key: str
    shape: tuple[int, ...]
    param: str | None
    index: int | None = None
    transposed: bool = False
    lead: int | None = None
    dtype: str | None = None
    quantize: bool = False
    scales: str | None = None


FLOAT = "float"


def _linear(key: str, shape: tuple[int, int], param: str | None, index: int | None = None) -> KeyMap:
    return KeyMap(key, shape, param, index, transposed=True)


def key_map(cfg: LMConfig, naming: str, sets: int | None = None) -> list[KeyMap]:
    """Every tensor of a reference LM checkpoint in the given naming, in the reference's key order.

    `sets`: DepFormer weight sets in the file (default `dep_q`). Steps past the agent's codebooks are checked
    but not loaded (`LMConfig.predicts_user_audio`).
    """
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {NAMINGS}")
    d, dd, card = cfg.dim, cfg.depformer_dim, cfg.card
    q = cfg.dep_q if sets is None else sets
    run = cfg.agent_codebooks

    def step(param: str, k: int, steps: int = run) -> str | None:
        return param if k < steps else None

    rows: list[KeyMap] = [KeyMap(f"emb.{k}.weight", (card + 1, d), "audio_emb", k) for k in range(cfg.n_q)]
    rows += [
        KeyMap("text_emb.weight", (cfg.text_card + 1, d), "text_emb"),
        _linear("text_linear.weight", (cfg.text_card, d), "text_head"),
    ]
    if cfg.demux_second_text_stream:
        rows += [_linear(f"text_emb.out{k}.weight", (d, d), f"text_out{k}") for k in (1, 2)]
    for i in range(cfg.num_layers):
        pre, dst = f"transformer.layers.{i}.", f"layers.{i}."
        attn = (
            [
                _linear(pre + "self_attn.in_projs.0.weight", (3 * d, d), dst + "wqkv"),
                _linear(pre + "self_attn.out_projs.0.weight", (d, d), dst + "wo"),
            ]
            if naming == "module"
            else [
                _linear(pre + "self_attn.in_proj_weight", (3 * d, d), dst + "wqkv"),
                _linear(pre + "self_attn.out_proj.weight", (d, d), dst + "wo"),
            ]
        )
        rows += [
            KeyMap(pre + "norm1.alpha", (1, 1, d), dst + "attn_norm"),
            *attn,
            KeyMap(pre + "norm2.alpha", (1, 1, d), dst + "mlp_norm"),
            _linear(pre + "gating.linear_in.weight", (2 * cfg.hidden, d), dst + "w_in"),
            _linear(pre + "gating.linear_out.weight", (d, cfg.hidden), dst + "w_out"),
        ]
        if cfg.cross_attention:
            cross = "cross_attention.in_projs.0.weight" if naming == "module" else "cross_attention.in_proj_weight"
            out = "cross_attention.out_projs.0.weight" if naming == "module" else "cross_attention.out_proj.weight"
            rows += [
                KeyMap(pre + "norm_cross.weight", (d,), dst + "cross_norm"),
                KeyMap(pre + "norm_cross.bias", (d,), dst + "cross_norm_bias"),
                _linear(pre + cross, (3 * d, d), dst + "cross_wqkv"),
                _linear(pre + out, (d, d), dst + "cross_wo"),
            ]
    rows.append(KeyMap("out_norm.alpha", (1, 1, d), "out_norm"))
    heads = cfg.extra_heads_num_heads
    rows += [_linear(f"extra_heads.{k}.weight", (cfg.extra_heads_dim, d), "extra_heads", k) for k in range(heads)]
    if not q:  # a text-only model (Kyutai STT): no DepFormer
        return rows
    # Weight sets in the file (one a step, or the schedule's) and those duplexd loads (the agent's steps' sets).
    sets, loaded = (
        (cfg.depformer_weight_sets if cfg.depformer_weights_per_step_schedule else q),
        cfg.depformer_weight_sets,
    )
    rank = cfg.depformer_low_rank_embeddings
    rows += [_linear(f"depformer_in.{k}.weight", (dd, d), step("dep_in", k, loaded), k) for k in range(sets)]
    rows += [
        KeyMap(f"depformer_emb.{k}.weight", (card + 1, rank or dd), step("dep_audio_emb", k, run - 1), k)
        for k in range(q - 1)
    ]
    if rank:
        rows += [
            _linear(f"depformer_emb.{k}.low_rank.weight", (dd, rank), step("dep_audio_low_rank", k, run - 1), k)
            for k in range(q - 1)
        ]
    rows.append(KeyMap("depformer_text_emb.weight", (cfg.text_card + 1, rank or dd), "dep_text_emb"))
    if cfg.demux_second_text_stream:
        rows += [_linear(f"depformer_text_emb.out{k}.weight", (dd, rank or dd), f"dep_text_out{k}") for k in (1, 2)]
    if rank:  # the reference builds it with the demux too, where it goes unused
        unused = cfg.demux_second_text_stream
        rows.append(_linear("depformer_text_emb.low_rank.weight", (dd, rank), None if unused else "dep_text_low_rank"))
    hid = cfg.depformer_hidden
    lead = run if q > run else None
    for i in range(cfg.depformer_num_layers):
        pre, dst = f"depformer.layers.{i}.", f"dep_layers.{i}."
        rows += [
            KeyMap(pre + "norm1.alpha", (1, 1, dd), dst + "attn_norm"),
            KeyMap(pre + "norm2.alpha", (1, 1, dd), dst + "mlp_norm"),
        ]
        if naming == "module":
            rows += [
                _linear(pre + f"self_attn.in_projs.{k}.weight", (3 * dd, dd), step(dst + "wqkv", k, loaded), k)
                for k in range(sets)
            ]
            rows += [
                _linear(pre + f"self_attn.out_projs.{k}.weight", (dd, dd), step(dst + "wo", k, loaded), k)
                for k in range(sets)
            ]
        else:
            rows += [
                KeyMap(
                    pre + "self_attn.in_proj_weight",
                    (sets * 3 * dd, dd),
                    dst + "wqkv",
                    None,
                    True,
                    lead and lead * 3 * dd,
                ),
                KeyMap(pre + "self_attn.out_proj.weight", (sets * dd, dd), dst + "wo", None, True, lead and lead * dd),
            ]
        for k in range(sets):
            rows += [
                _linear(pre + f"gating.{k}.linear_in.weight", (2 * hid, dd), step(dst + "w_in", k, loaded), k),
                _linear(pre + f"gating.{k}.linear_out.weight", (dd, hid), step(dst + "w_out", k, loaded), k),
            ]
    rows += [_linear(f"linears.{k}.weight", (card, dd), step("dep_heads", k), k) for k in range(q)]
    return rows


def extra_heads_in(keys: set[str] | list[str]) -> int:
    """How many extra heads (`extra_heads.k.weight`, Kyutai STT 1B's semantic VAD) a reference LM checkpoint holds,
    by its highest k (so a missing one is reported as missing)."""
    found = [int(m.group(1)) for key in keys if (m := _HEAD_KEY.fullmatch(key))]
    return max(found) + 1 if found else 0


_HEAD_KEY = re.compile(r"extra_heads\.(\d+)\.weight")


def depformer_sets(keys: set[str] | list[str]) -> int:
    """How many DepFormer weight sets a reference LM checkpoint holds (by its highest `linears.k` or
    `depformer_in.k`, so a missing key is reported as missing): 8 for Moshi, 16 for PersonaPlex as released."""
    found = [int(m.group(2)) for key in keys if (m := _SET_KEY.fullmatch(key))]
    return max(found) + 1 if found else 0


_SET_KEY = re.compile(r"(linears|depformer_in)\.(\d+)\.weight")


def param_view(params: dict[str, torch.Tensor], row: KeyMap, param: str | None = None) -> torch.Tensor:
    """The parameter slice a checkpoint tensor fills, as a view in the checkpoint's orientation."""
    name = param or row.param
    assert name is not None
    p = params[name]
    p = p if row.index is None else p[row.index]
    return p.transpose(-1, -2) if row.transposed else p


def _store(tensors: dict[str, torch.Tensor], row: KeyMap, tensor: torch.Tensor) -> None:
    """Copy a checkpoint tensor into its place; a `quantize` row is quantized on the target's device first."""
    if row.lead is not None:
        tensor = tensor[: row.lead]
    if not row.quantize:
        target = param_view(tensors, row)
        target.copy_(tensor.view(target.shape))
        return
    codes_at = param_view(tensors, row, f"{row.param}.codes")
    absmax_at = param_view(tensors, row, f"{row.param}.absmax")
    codes, absmax = quantize_rows(tensor.to(codes_at.device))
    codes_at.copy_(codes.view(codes_at.shape))
    absmax_at.copy_(absmax.view(absmax_at.shape))


def _normalise(key: str) -> str:
    # The reference's load hook also accepts `in_proj.weight` for the fused projection.
    return key.replace("self_attn.in_proj.weight", "self_attn.in_proj_weight")


def detect_naming(keys: set[str]) -> str:
    return "fused" if any(k.endswith("self_attn.in_proj_weight") for k in keys) else "module"


def _few(keys: set[str] | list[str], n: int = 5) -> str:
    keys = sorted(keys)
    more = f" … and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def load_mapped(
    tensors: dict[str, torch.Tensor],
    path: Path,
    rows_for: Callable[[str], list[KeyMap]],
    normalise: Callable[[str], str] = _normalise,
    what: str = "",
    ignore: Callable[[str], bool] | None = None,
) -> str:
    """Fill `tensors` (by duplexd name) from the safetensors file at `path` through a key map.

    `rows_for(naming)` gives the map for the naming the file turns out to use; everything is checked (missing,
    unexpected, shapes) before the first tensor is read. Returns the naming. Raises `CheckpointError`.
    """
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
    with handle as f:
        original = {normalise(k): k for k in f.keys() if ignore is None or not ignore(k)}
        naming = detect_naming(set(original))
        expected = {row.key: row for row in rows_for(naming)}
        missing = set(expected) - set(original)
        unexpected = set(original) - set(expected)
        if missing:
            raise CheckpointError(f"{path}: {len(missing)} missing {what}key(s) ({naming} naming): {_few(missing)}")
        if unexpected:
            raise CheckpointError(f"{path}: {len(unexpected)} unexpected {what}key(s): {_few(unexpected)}")
        for key, row in expected.items():
            info = f.get_slice(original[key])
            shape = tuple(info.get_shape())
            if shape != row.shape:
                raise CheckpointError(
                    f"{path}: shape mismatch for {key}: expected {list(row.shape)}, got {list(shape)}"
                )
            dtype = info.get_dtype()
            if row.dtype == FLOAT and dtype not in _FLOATS:
                raise CheckpointError(
                    f"{path}: {key} is {dtype}, expected a float tensor (or a q8 pair with {key}_scb)"
                )
            if row.dtype not in (None, FLOAT) and dtype != row.dtype:
                raise CheckpointError(f"{path}: {key} is {dtype}, a q8 file holds it as {row.dtype}")
        for key, row in expected.items():
            if row.param is None:
                continue
            try:
                tensor = f.get_tensor(original[key])
                if row.scales is not None:  # a q8 pair read into a float parameter
                    tensor = tensor.float() * f.get_tensor(original[row.scales])[:, None] / 127
            except SafetensorError as e:
                raise CheckpointError(f"{path}: cannot read {key} (truncated or corrupt file?): {e}") from None
            _store(tensors, row, tensor)
    return naming


_FLOATS = frozenset({"F64", "F32", "F16", "BF16"})


def save_mapped(tensors: dict[str, torch.Tensor], rows: list[KeyMap], path: str | Path) -> None:
    """Write `tensors` under their reference keys (the inverse of `load_mapped`); rows that are not loaded
    cannot be written."""
    if any(row.param is None or row.lead is not None for row in rows):
        raise ValueError("the key map has rows that duplexd does not hold")
    save_file({row.key: param_view(tensors, row).reshape(row.shape).contiguous() for row in rows}, str(path))


def _header_keys(path: Path) -> set[str]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return set(f.keys())
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None


def checked_sets(cfg: LMConfig, path: Path, keys: set[str]) -> int:
    """The DepFormer weight sets of the file at `path`, checked against `cfg`. A PersonaPlex checkpoint
    (dep_q = n_q) may hold only the agent's sets: the reference then copies them for the user's steps, which
    duplexd does not run (`LMConfig.predicts_user_audio`). Raises `CheckpointError`."""
    sets = depformer_sets(keys)
    if sets == cfg.dep_q:
        return sets
    if cfg.predicts_user_audio and sets == cfg.agent_codebooks:
        logger.info(
            "%s holds %d DepFormer weight sets of %d: the user's steps (which the reference copies from the agent's) "
            "only predict the user's codebooks, which are always forced; duplexd does not run them",
            path,
            sets,
            cfg.dep_q,
        )
        return sets
    if sets == cfg.n_q and cfg.dep_q < cfg.n_q:
        raise CheckpointError(
            f"{path} holds {sets} DepFormer weight sets (a PersonaPlex checkpoint) but its config says dep_q="
            f"{cfg.dep_q}; pass a config with dep_q={sets}, or none (an empty config.json is read from the checkpoint)"
        )
    expected = f"{cfg.dep_q}" + (f" or {cfg.agent_codebooks}" if cfg.predicts_user_audio else "")
    raise CheckpointError(f"{path} holds {sets} DepFormer weight sets (linears.k heads), the config expects {expected}")


def dequantized_q8(row: KeyMap) -> list[KeyMap]:
    """The rows of a q8 pair (int8 codes + fp32 `_scb`) read into the float parameter of `row`: the codes,
    dequantized as they are read (`codes * scb / 127`, as moshi's `QLinear` holds them), and the scales (checked,
    read with the codes)."""
    scales = f"{row.key}_scb"
    return [
        dataclasses.replace(row, dtype="I8", scales=scales),
        KeyMap(scales, row.shape[:1], None, dtype="F32"),
    ]


def _lm_rows(cfg: LMConfig, naming: str, sets: int, int8: set[str], q8_keys: set[str]) -> list[KeyMap]:
    """The key map for a model whose projections `int8` are int8 weights, from a file whose `q8_keys` are stored
    as q8 pairs (codes + `_scb`): such a pair fills `.codes` and `.absmax` of an int8 weight, or is dequantized
    into a float parameter (what duplexd keeps float: a TTS model's cross-attention, demux and low-rank
    embeddings); a float projection of the file is quantized into an int8 weight as it is read."""
    rows = []
    for row in key_map(cfg, naming, sets):
        if row.key in q8_keys and row.param is not None and row.param not in int8:
            rows += dequantized_q8(row)
        elif row.key in q8_keys:
            codes = row.param and f"{row.param}.codes"
            absmax = row.param and f"{row.param}.absmax"
            rows += [
                dataclasses.replace(row, param=codes, transposed=False, dtype="I8"),
                dataclasses.replace(
                    row, key=f"{row.key}_scb", shape=row.shape[:1], param=absmax, transposed=False, dtype="F32"
                ),
            ]
        else:
            quantize = row.param in int8  # read as float, stored as codes [out, in]: the file's orientation
            rows.append(
                dataclasses.replace(row, dtype=FLOAT, quantize=quantize, transposed=row.transposed and not quantize)
            )
    return rows


def _q8_keys(keys: set[str]) -> set[str]:
    return {_normalise(k.removesuffix("_scb")) for k in keys if k.endswith("_scb")}


def q8_keys(path: Path) -> set[str]:
    """The keys of the file at `path` stored as q8 pairs (int8 codes beside fp32 `_scb` scales)."""
    return _q8_keys(_header_keys(path))


def _lm_tensors(model: LMModel) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def load_lm_weights(model: LMModel, path: Path) -> str:
    """Fill `model` from the safetensors file at `path`; returns the naming found. Raises `CheckpointError`.

    The model's int8 weights are read from the file's q8 pairs, or quantized from its float projections; a q8
    pair must land in an int8 weight (`stored_int8` tells which projections a file holds as int8)."""
    keys = _header_keys(path)
    sets = checked_sets(model.cfg, path, keys)
    heads = extra_heads_in(keys)
    if heads != model.cfg.extra_heads_num_heads:
        raise CheckpointError(
            f"{path} holds {heads} extra heads (extra_heads.k.weight), its config declares "
            f"extra_heads_num_heads={model.cfg.extra_heads_num_heads}"
            + (": Kyutai's semantic-VAD heads are in the -candle release of kyutai/stt-1b-en_fr" if not heads else "")
        )
    int8, q8 = int8_names(model), _q8_keys(keys)
    tensors = _lm_tensors(model)

    naming = load_mapped(
        tensors,
        path,
        lambda naming: _lm_rows(model.cfg, naming, sets, int8, q8),
        ignore=_conditioning_key if model.cfg.speaks_text else None,
    )
    for name in int8:
        weight = model.get_submodule(name)
        assert isinstance(weight, Int8Weight)
        weight.set_from_absmax_()
    return naming


def _conditioning_key(key: str) -> bool:
    """A Kyutai TTS file's conditioner weights, which `tts.checkpoint` loads, not the LM."""
    return key.startswith(CONDITIONING_PREFIX)


CONDITIONING_PREFIX = "condition_provider.conditioners."


def stored_int8(cfg: LMConfig, path: Path) -> set[str]:
    """The duplexd projections that the file at `path` holds as q8 pairs (int8 codes + fp32 `_scb`); the file's
    other q8 pairs (a TTS model's cross-attention, demux and low-rank embeddings) are dequantized as they load."""
    keys = _header_keys(path)
    q8 = _q8_keys(keys)
    rows = key_map(cfg, detect_naming({_normalise(k) for k in keys}), depformer_sets(keys) or cfg.dep_q)
    return set(quantizable(row.param for row in rows if row.key in q8 and row.param is not None))


def save_lm_weights(model: LMModel, path: str | Path, naming: str = "fused") -> None:
    """Write `model` as a reference-format LM checkpoint (loadable by `moshi` and by duplexd); its int8 weights
    as q8 pairs, as Kyutai's q8 files hold them. A PersonaPlex model is written with the agent's DepFormer sets
    only, the ones it holds."""
    cfg, int8 = model.cfg, int8_names(model)
    rows = key_map(cfg, naming, cfg.agent_codebooks)
    q8 = {row.key for row in rows if row.param in int8}
    save_mapped(_lm_tensors(model), _lm_rows(cfg, naming, cfg.agent_codebooks, int8, q8), path)


def int8_plan(cfg: LMConfig, stored: set[str], weights_dtype: str | None, text_head: bool = INT8_TEXT_HEAD) -> set[str]:
    """The projections to hold as int8: as the file stores them (`weights_dtype` None), none ("bf16": the
    model's float dtype) or every quantizable one ("int8"; the text head too if `text_head`)."""
    if weights_dtype is None:
        return set(stored)
    if weights_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"weights_dtype {weights_dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    if weights_dtype == "bf16":
        return set()
    with torch.device("meta"):
        names = [n for n, _ in LMModel(cfg).named_parameters()]
    return set(quantizable(names, text_head))


def quantize_lm_(model: LMModel, weights_dtype: str | None, text_head: bool = INT8_TEXT_HEAD) -> LMModel:
    """`model` with its float projections quantized in place when `weights_dtype` is "int8" (random weights, or a
    model built in memory); otherwise unchanged."""
    wanted = int8_plan(model.cfg, int8_names(model), weights_dtype, text_head)
    quantize_(model, sorted(wanted - int8_names(model)))
    return model


def build_lm(
    cfg: LMConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    int8: set[str] | frozenset[str] = frozenset(),
) -> LMModel:
    """An uninitialised model allocated directly in `dtype` on `device` (no fp32 detour), the projections
    `int8` as int8 weights."""
    with torch.device("meta"):
        model = LMModel(cfg)
    model = model.to(dtype)
    int8_layout_(model, sorted(int8))
    return model.to_empty(device=device).eval()


def _read_config_json(path: str | Path) -> dict[str, Any]:
    try:
        raw = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: must hold a JSON object of LM settings")
    return raw


def _config_from(raw: dict[str, Any], path: str | Path) -> LMConfig:
    try:
        return lm_config_from_dict(raw)
    except ConfigError as e:
        raise CheckpointError(f"{path}: bad config: {e}") from None


def read_lm_config(path: str | Path) -> LMConfig:
    """A reference `config.json` as an `LMConfig`; `CheckpointError` naming the file when it cannot be used."""
    return _config_from(_read_config_json(path), path)


def read_stt_settings(path: str | Path, raw: dict[str, Any] | None = None) -> SttSettings | None:
    """A Kyutai STT `config.json`'s serving settings (`SttSettings`), None for another model's config;
    `CheckpointError` naming the file when it cannot be used. `raw`: its contents, when already read."""
    try:
        return stt_settings_from_dict(_read_config_json(path) if raw is None else raw)
    except ConfigError as e:
        raise CheckpointError(f"{path}: bad config: {e}") from None


def lm_config_for(weights: Path, config: LMConfig | str | Path | None, weights_ref: str) -> LMConfig:
    """The LM configuration: `config` itself, the `config.json` it names, the one beside the weights (or in their
    hub repo), else Moshi 7B (as the reference does). Raises `CheckpointError`.

    A config that does not state `dep_q` (none at all, or PersonaPlex's empty `config.json`) takes it from the
    checkpoint: one DepFormer set per audio codebook (16) is PersonaPlex, whose DepFormer also predicts the user.
    """
    if isinstance(config, LMConfig):
        return config
    source: str | Path | None = None
    if config is not None:
        source = resolve_file(config, CONFIG_NAME)
    else:
        beside = weights.parent / CONFIG_NAME
        if not beside.is_file() and (repo := hub_repo(weights_ref)) is not None:
            try:
                beside = hub_file(repo, CONFIG_NAME)
            except CheckpointError as e:
                logger.info("no config from hf://%s: %s", repo, e)
        if beside.is_file():
            source = beside
    if source is None:
        logger.warning("no %s beside %s: assuming the Moshi 7B configuration", CONFIG_NAME, weights_ref)
        raw: dict[str, Any] = {}
    else:
        raw = _read_config_json(source)
    if "dep_q" not in raw:
        n_q = int(raw.get("n_q", MOSHI_7B.n_q))
        if depformer_sets(_header_keys(weights)) == n_q:
            logger.info(
                "%s holds one DepFormer set per audio codebook: a PersonaPlex checkpoint (dep_q=%d)", weights, n_q
            )
            raw = {**raw, "dep_q": n_q}
    return checkpoint_ring_rule(_config_from(raw, source or weights))


def checkpoint_ring_rule(cfg: LMConfig) -> LMConfig:
    """`cfg` with the ring rule of the server its checkpoint was made for: a PersonaPlex checkpoint (a DepFormer
    that also predicts the user, dep_q = n_q) ran under NVIDIA's fork of moshi, whose older ring cache attends one
    key fewer once the window is full; a Moshi checkpoint keeps moshi's rule."""
    rule = "personaplex" if cfg.predicts_user_audio else "moshi"
    return cfg if cfg.ring_rule == rule else dataclasses.replace(cfg, ring_rule=rule)


def mimi_ring_rule(mimi: MimiConfig, lm: LMConfig) -> MimiConfig:
    """`mimi` with the ring rule of the LM it serves (`checkpoint_ring_rule`): one server ran both, with one ring
    cache, so a PersonaPlex LM's Mimi attends as NVIDIA's fork does too (a 250-step window at 25 Hz: 10 s)."""
    return mimi if mimi.ring_rule == lm.ring_rule else dataclasses.replace(mimi, ring_rule=lm.ring_rule)


TOKENIZER_NAME = "tokenizer_spm_32k_3.model"  # Moshi's sentencepiece model, in Kyutai's repos


@dataclass(frozen=True)
class CheckpointNames:
    """The files of a checkpoint folder or hub repo, as its config.json names them (moshi reads `moshi_name`,
    `mimi_name` and `tokenizer_name`: Kyutai's q8 and STT repos use them), the usual names where it does not;
    `stt`: the config is a Kyutai speech-to-text model's (it reads all 32 of Mimi's codebooks)."""

    moshi: str = MOSHI_NAME
    mimi: str = MIMI_NAME
    tokenizer: str = TOKENIZER_NAME
    stt: bool = False


def repo_config(ref: str | Path) -> Path | None:
    """The config.json of a local folder or a hub repo id (downloaded), None when there is none."""
    text = str(ref).removeprefix("file://")
    folder = Path(text).expanduser()
    config = folder / CONFIG_NAME if folder.is_dir() else None
    if config is None and hub_repo(text) == text:  # a repo id, not a file in it
        try:
            config = hub_file(text, CONFIG_NAME)
        except CheckpointError:
            pass
    return config if config is not None and config.is_file() else None


def checkpoint_names(config: Path | None) -> CheckpointNames:
    """The file names `config` (a config.json, or None) gives; `CheckpointError` for a file that is not JSON."""
    if config is None:
        return CheckpointNames()
    raw = _read_config_json(config)

    def name(key: str, default: str) -> str:
        value = raw.get(key)
        return value if isinstance(value, str) and value and "/" not in value else default

    return CheckpointNames(
        name("moshi_name", MOSHI_NAME),
        name("mimi_name", MIMI_NAME),
        name("tokenizer_name", TOKENIZER_NAME),
        read_stt_settings(config, raw) is not None,
    )


def lm_file_name(ref: str | Path) -> str:
    """The LM file a folder or hub repo `ref` holds: the one its config.json names, else `model.safetensors`."""
    return checkpoint_names(repo_config(ref)).moshi


def load_lm(
    weights: str | Path,
    config: LMConfig | str | Path | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    weights_dtype: str | None = None,
    int8_text_head: bool = INT8_TEXT_HEAD,
) -> LMModel:
    """Load an LM from a local file or folder, `hf://org/repo/file`, or a Hugging Face repo id.

    The configuration is `config` if given (an `LMConfig` or a reference `config.json`), else the
    `config.json` beside the weights, else Moshi 7B (as the reference does). `weights_dtype`: "int8" quantizes
    the projections as they are read (a q8 file's are int8 already), "bf16" keeps them in `dtype` (a q8 file's
    are dequantized), None takes the file's own format (`int8_plan`).
    """
    path = resolve_file(weights, lm_file_name(weights))
    cfg = lm_config_for(path, config, str(weights))
    stored = stored_int8(cfg, path)
    wanted = int8_plan(cfg, stored, weights_dtype, int8_text_head)
    model = build_lm(cfg, device, dtype, int8=stored | wanted)
    naming = load_lm_weights(model, path)
    dequantize_(model, sorted(stored - wanted), dtype)
    logger.info(
        "loaded LM from %s (%s naming%s, %d layers, dim %d, %d of its projections int8)",
        path,
        naming,
        ", q8" if stored else "",
        cfg.num_layers,
        cfg.dim,
        len(wanted),
    )
    return model


# --------------------------------------------------------------------------------------------------- Mimi

# Codebook buffer names of older checkpoints (the reference's `EuclideanCodebook._load_from_state_dict`).
_OLD_CODEBOOK_NAMES = {
    "inited": "_initialized",
    "cluster_size": "cluster_usage",
    "embed_avg": "embedding_sum",
    "embed_sum": "embedding_sum",
}


def mimi_key_map(model: MimiModel, naming: str) -> list[KeyMap]:
    """Every tensor of a reference Mimi checkpoint in the given naming ("module" or "fused")."""
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {NAMINGS}")
    return [
        KeyMap(key, shape, name, transposed=transposed)
        for key, name, shape, transposed in reference_keys(model, naming)
    ]


def _normalise_mimi(key: str) -> str:
    key = _normalise(key)
    if "._codebook." in key:
        prefix, leaf = key.rsplit(".", 1)
        key = f"{prefix}.{_OLD_CODEBOOK_NAMES.get(leaf, leaf)}"
    return key


def _mimi_tensors(model: MimiModel) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def load_mimi_weights(model: MimiModel, path: Path) -> str:
    """Fill `model` from the safetensors file at `path`; returns the naming found. Raises `CheckpointError`."""
    return load_mapped(
        _mimi_tensors(model), path, lambda naming: mimi_key_map(model, naming), _normalise_mimi, what="Mimi "
    )


def mimi_preset_of(path: Path, presets: Iterable[str]) -> str | None:
    """The first of `presets` whose Mimi has exactly the keys and shapes of the file at `path` (header only, no
    tensor read), None when none has or the file is unreadable (loading says why). A file does not say how many
    codebooks are used, only the architecture: this tells the demo's tiny Mimi from Kyutai's full-size one."""
    return mimi_config_of(path, {name: MIMI_PRESETS[name] for name in presets})


def mimi_config_of(path: Path, configs: dict[str, MimiConfig]) -> str | None:
    """`mimi_preset_of` over any named configs: the first whose Mimi has exactly the file's keys and shapes."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            shapes = {_normalise_mimi(key): tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError):
        return None
    naming = detect_naming(set(shapes))
    for name, cfg in configs.items():
        with torch.device("meta"):
            model = MimiModel(cfg)
        if {row.key: row.shape for row in mimi_key_map(model, naming)} == shapes:
            return name
    return None


def save_mimi_weights(model: MimiModel, path: str | Path, naming: str = "module") -> None:
    """Write `model` as a reference-format Mimi checkpoint (loads strictly into the reference `MimiModel`)."""
    save_mapped(_mimi_tensors(model), mimi_key_map(model, naming), path)


def load_mimi(
    weights: str | Path,
    config: MimiConfig | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> MimiModel:
    """Load Mimi from a local file or folder, `file://`, `hf://org/repo/file`, or a Hugging Face repo id.

    `config` defaults to the released Mimi (`MIMI`); the reference keeps no Mimi config beside the weights.
    """
    cfg = config or MIMI
    path = resolve_file(weights, MIMI_NAME)
    with torch.device("meta"):
        model = MimiModel(cfg)
    model = model.to(dtype).to_empty(device=device).eval()
    naming = load_mimi_weights(model, path)
    logger.info(
        "loaded Mimi from %s (%s naming, %d codebooks used, %s ring rule)",
        path,
        naming,
        cfg.num_codebooks,
        cfg.ring_rule,
    )
    return model
