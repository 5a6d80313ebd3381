"""`duplexd capacity`: how many sessions of a model fit on a GPU, by the sizing rule the server itself uses.

The LM and Mimi are built on the `meta` device (shapes, no memory), their weights counted, and what is left of the
GPU's memory goes through the engine's own pool sizing (`sessions_that_fit` → `pool_pages`: less Mimi's streams
per slot and `CUDA_HEADROOM`, pages of `page_size` frames, a whole window, or `--window` frames, per session), so
the answer is what `duplexd serve --max-sessions N` on that GPU admits. `--gpu-memory` is the device's total as
the driver reports it (nvidia-smi's "memory.total"; an H200 shows about 140 GiB, 139 usable); the CUDA context
and libraries' share of it is an estimate (`CUDA_CONTEXT`) that a live device replaces with its own free memory.

The last line printed is one JSON object: `{"sessions": N, ...}` with the byte breakdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from duplexd.engine.devices import check_device, check_kv_dtype
from duplexd.engine.dialogue.engine import (
    CUDA_HEADROOM,
    EngineConfig,
    kv_page_bytes,
    pool_pages,
    session_pages,
    sessions_that_fit,
)
from duplexd.engine.errors import InputRefused
from duplexd.engine.kv.dtypes import KV_DTYPES
from duplexd.engine.models.config import MIMI_PRESETS, PRESET_MIMI, PRESETS, TTS_1_6B, LMConfig
from duplexd.engine.models.int8_weights import WEIGHT_DTYPES, weight_dtypes
from duplexd.engine.models.mimi import MimiModel, MimiStreams
from duplexd.engine.tts.config import tts_config_from_dict
from duplexd.engine.tts.demo import tts_keys
from duplexd.engine.tts.sizing import speech_memory
from duplexd.engine.weights.checkpoint import (
    build_lm,
    checkpoint_ring_rule,
    int8_plan,
    mimi_ring_rule,
    read_lm_config,
)

GiB = 2**30
CUDA_CONTEXT = GiB  # the CUDA context, cuBLAS workspaces and loaded kernels, before the engine sizes its pool
SEARCH_LIMIT = 1 << 16  # sessions: the answer is "at least this" beyond it
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_size(text: str) -> int:
    """`139GiB`, `80GB`, `500MiB` or a number of bytes."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        size = int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise InputRefused(f"{text}: not a size (give e.g. 139GiB, 80GB or a number of bytes)", "gpu_memory") from None
    if size <= 0:
        raise InputRefused(f"{text}: must be more than 0 bytes", "gpu_memory")
    return size


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()])


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The answer and every term of the sum that gives it (bytes)."""

    sessions: int
    model: str
    kv_dtype: str
    lm_weight_dtypes: dict[str, str]  # part -> "int8" or the float dtype (`int8_weights.weight_dtypes`)
    window_frames: int
    page_size: int
    memory: int  # the device's memory (given, or the live device's total)
    free_for_engine: int  # what the engine's rule starts from: memory less context and weights (or measured)
    lm_weights: int
    mimi_weights: int
    cuda_context: int  # estimated; 0 when measured on the live device (its free memory already excludes it)
    headroom: int
    mimi_streams: int  # for `sessions` slots
    kv_page: int
    kv_window: int  # one session's pages
    kv_pages: int  # the pool's pages for `sessions` sessions (a scratch page comes on top)
    kv_pool: int  # bytes the pool allocates, scratch page included
    at_limit: bool  # the search stopped at SEARCH_LIMIT: at least this many fit
    tts_streams: int = 0  # streams of tts-1.6b set aside beside the model (`duplexd serve --tts`)
    tts_memory: int = 0  # their weights, KV windows, voices' keys and values and Mimi streams
    llm_share: float = 0.0  # the GPU's fraction an LLM server beside duplexd takes (vLLM's --gpu-memory-utilization)
    llm_memory: int = 0  # its bytes: llm_share of `memory`
    agents: int = 0  # with --tts-streams beside an STT model: voice agents, each an STT session and a TTS stream

    def lines(self) -> list[str]:
        more = "at least " if self.at_limit else ""
        return (
            [
                f"{self.model}: {more}{self.sessions} sessions of {self.window_frames} frames fit with --kv-dtype "
                f"{self.kv_dtype} in {self.memory / GiB:.1f} GiB",
                f"  weights: LM {self.lm_weights / GiB:.2f} GiB ({formats(self.lm_weight_dtypes)}), Mimi "
                f"{self.mimi_weights / GiB:.2f} GiB; CUDA context "
                + (f"{self.cuda_context / GiB:.2f} GiB (estimate)" if self.cuda_context else "measured"),
                f"  kept free {self.headroom / GiB:.2f} GiB; Mimi streams {self.mimi_streams / GiB:.2f} GiB for "
                f"{self.sessions} slots",
                f"  KV: {self.kv_window / GiB:.3f} GiB per session ({self.kv_window // self.kv_page} pages of "
                f"{self.page_size} frames), pool {self.kv_pool / GiB:.2f} GiB ({self.kv_pages} pages + scratch)",
            ]
            + (
                [f"  beside it: tts-1.6b with {self.tts_streams} streams, {self.tts_memory / GiB:.2f} GiB"]
                if self.tts_streams
                else []
            )
            + (
                [f"  beside it: an LLM server with {self.llm_share:g} of the GPU, {self.llm_memory / GiB:.2f} GiB"]
                if self.llm_memory
                else []
            )
            + ([f"  voice agents (an STT session and a TTS stream each): {self.agents}"] if self.agents else [])
        )


def formats(dtypes: dict[str, str]) -> str:
    """`int8: projections, audio heads; bfloat16: text head, embeddings, norms`, or one dtype alone."""
    parts: dict[str, list[str]] = {}
    for part, dtype in dtypes.items():
        parts.setdefault(dtype, []).append(part.replace("_", " "))
    if len(parts) == 1:
        return next(iter(parts))
    return "; ".join(f"{dtype}: {', '.join(names)}" for dtype, names in parts.items())


def lm_config(args: argparse.Namespace) -> tuple[str, LMConfig, str]:
    """(name, LM config, Mimi preset) from --model or --config. A config file gets the ring rule serving gives its
    checkpoint (`checkpoint_ring_rule`), and, unless --mimi-preset says otherwise, the full-size Mimi with the
    codebooks it reads (all 32 for a speech-to-text LM), as the server picks them."""
    if args.config is not None:
        if args.model is not None:
            raise InputRefused("give --model or --config, not both", "config")
        cfg = checkpoint_ring_rule(read_lm_config(args.config))
        return Path(args.config).name, cfg, args.mimi_preset or ("mimi-32" if cfg.text_only else "mimi")
    model = args.model or "moshi-7b"
    if model not in PRESETS:
        raise InputRefused(f"{model}: not a preset; pick one of {', '.join(sorted(PRESETS))}", "model")
    return model, PRESETS[model], args.mimi_preset or PRESET_MIMI[model]


def capacity(
    name: str,
    cfg: LMConfig,
    mimi_preset: str,
    kv_dtype: str,
    dtype: torch.dtype,
    memory: int | None,
    window: int | None = None,
    page_size: int = 64,
    device: str = "cuda",
    weights_dtype: str = "bf16",
    tts_streams: int = 0,
    tts_weights_dtype: str = "bf16",
    llm_share: float = 0.0,
) -> Capacity:
    """Sessions that fit on `device` with `memory` bytes (None: the live device's free memory now);
    `weights_dtype` "int8": the LM's projections as int8 weights, as `--weights-dtype int8` loads them;
    `tts_streams`: that many streams of tts-1.6b (`duplexd serve --tts`, loaded first) take their share first, its
    projections in `tts_weights_dtype`; `llm_share`: the fraction of the device's memory an LLM server on the same
    GPU takes (vLLM takes `--gpu-memory-utilization` of the total, whatever else is there)."""
    lm = build_lm(cfg, "meta", dtype, int8=int8_plan(cfg, set(), weights_dtype))
    with torch.device("meta"):
        mimi = MimiModel(mimi_ring_rule(MIMI_PRESETS[mimi_preset], cfg))  # as the server builds it
    lm_weights, mimi_weights = weight_bytes(lm), weight_bytes(mimi)
    if memory is None:
        free, total = torch.cuda.mem_get_info(torch.device(device))
        context, memory = 0, total
    else:
        free, context = memory, CUDA_CONTEXT
    tts = tts_memory(tts_streams, dtype, tts_weights_dtype) if tts_streams else 0
    llm = int(llm_share * memory)
    free_for_engine = max(free - context - tts - llm - lm_weights - mimi_weights, 0)
    config = EngineConfig(
        max_sessions=SEARCH_LIMIT, page_size=page_size, max_session_frames=window, device=device, kv_dtype=kv_dtype
    )
    sessions = sessions_that_fit(lm, mimi, config, free_for_engine)
    per_session = session_pages(cfg, config)
    fitted = dataclasses.replace(config, max_sessions=max(sessions, 1))
    pages = pool_pages(lm, mimi, fitted, per_session, free_for_engine) if sessions else 0
    page = kv_page_bytes(lm, config)
    return Capacity(
        sessions=sessions,
        model=name,
        kv_dtype=kv_dtype,
        lm_weight_dtypes=weight_dtypes(lm),
        window_frames=min(window or cfg.context, cfg.context),
        page_size=page_size,
        memory=memory,
        free_for_engine=free_for_engine,
        lm_weights=lm_weights,
        mimi_weights=mimi_weights,
        cuda_context=context,
        headroom=CUDA_HEADROOM,
        mimi_streams=MimiStreams.state_bytes(mimi, sessions, decoder=not cfg.text_only) if sessions else 0,
        kv_page=page,
        kv_window=per_session * page,
        kv_pages=pages,
        kv_pool=(pages + 1) * page if sessions else 0,
        at_limit=sessions == SEARCH_LIMIT,
        tts_streams=tts_streams,
        tts_memory=tts,
        llm_share=llm_share,
        llm_memory=llm,
        agents=min(sessions, tts_streams) if cfg.text_only else 0,
    )


def most_agents(size: Callable[[int], Capacity]) -> Capacity:
    """The sizing with the most voice agents: N streams of tts-1.6b beside at least N sessions of the STT model
    (`size(N)`: the sizing with N streams; sessions only fall as streams grow, so a bisection finds N)."""
    low, high = 0, size(0).sessions
    while low < high:
        mid = (low + high + 1) // 2
        if size(mid).sessions >= mid:
            low = mid
        else:
            high = mid - 1
    return size(low)


def tts_memory(streams: int, dtype: torch.dtype, weights_dtype: str = "bf16") -> int:
    """Bytes of tts-1.6b's speech service with `streams` streams (its 512-wide voices, 5 places of 125 frames)."""
    tts = tts_config_from_dict(tts_keys(512, 16))
    assert tts is not None
    return speech_memory(TTS_1_6B, tts, streams, dtype, weights_dtype=weights_dtype).total


def run(args: argparse.Namespace) -> int:
    name, cfg, mimi_preset = lm_config(args)
    if args.window is not None and args.window < 1:
        raise InputRefused(f"{args.window}: must be at least 1 frame", "window")
    if args.tts_streams < 0:
        raise InputRefused(f"{args.tts_streams}: must be 0 or more", "tts_streams")
    if not 0 <= args.llm_share < 1:
        raise InputRefused(f"{args.llm_share:g}: must be a fraction from 0 up to (not including) 1", "llm_share")
    memory = None if args.gpu_memory is None else parse_size(args.gpu_memory)
    device = "cuda"
    if memory is None:
        if not torch.cuda.is_available():
            raise InputRefused(
                "not given, and this machine has no CUDA device to measure: give e.g. 139GiB", "gpu_memory"
            )
        device = check_device(args.device, "device")
        check_kv_dtype(args.kv_dtype, device)
    if args.agents and not cfg.text_only:
        raise InputRefused(f"voice agents need a speech-to-text model (stt-1b, stt-2.6b), not {name}", "agents")
    if args.agents and args.tts_streams:
        raise InputRefused("give --agents or --tts-streams, not both (--agents picks the streams)", "agents")

    def size(tts_streams: int) -> Capacity:
        return capacity(
            name,
            cfg,
            mimi_preset,
            args.kv_dtype,
            DTYPES[args.dtype],
            memory,
            args.window,
            device=device,
            weights_dtype=args.weights_dtype,
            tts_streams=tts_streams,
            tts_weights_dtype=args.tts_weights_dtype,
            llm_share=args.llm_share,
        )

    result = most_agents(size) if args.agents else size(args.tts_streams)
    if not args.json:
        sys.stdout.write("\n".join(result.lines()) + "\n")
    sys.stdout.write(json.dumps(dataclasses.asdict(result)) + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"LM preset ({', '.join(sorted(PRESETS))}; default moshi-7b)")
    p.add_argument("--config", help="a reference config.json instead of a preset")
    p.add_argument("--mimi-preset", choices=sorted(MIMI_PRESETS), help="Mimi architecture (default: the preset's)")
    p.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="the GPU's memory as the driver reports it, e.g. 139GiB or 80GB (default: the live CUDA device's)",
    )
    p.add_argument("--device", default="cuda:0", help="the live device measured without --gpu-memory")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16", help="KV cache format (bf16: the weights' dtype)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="LM weight dtype")
    p.add_argument(
        "--weights-dtype",
        choices=WEIGHT_DTYPES,
        default="bf16",
        help="LM projections: bf16 (the weight dtype) or int8 (codes with an fp32 scale per output channel)",
    )
    p.add_argument(
        "--tts-streams",
        type=int,
        default=0,
        metavar="N",
        help="set aside N streams of tts-1.6b beside the model, as duplexd serve --tts loads it on the same GPU",
    )
    p.add_argument(
        "--tts-weights-dtype",
        choices=WEIGHT_DTYPES,
        default="bf16",
        help="the TTS LM's projections, as duplexd serve --tts-weights-dtype loads them",
    )
    p.add_argument(
        "--llm-share",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="the GPU's memory an LLM server beside duplexd takes (voice agents: vLLM's --gpu-memory-utilization)",
    )
    p.add_argument(
        "--agents",
        action="store_true",
        help="size voice agents (serve --llm): the most N with N sessions of the STT model and N TTS streams",
    )
    p.add_argument("--window", type=int, metavar="FRAMES", help="session length in frames (default: a full window)")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
