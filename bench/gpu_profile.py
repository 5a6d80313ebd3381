"""Where a step's time goes: each part of the engine's frame against the least time its bytes allow.

Usage: python bench/gpu_profile.py [--preset moshi-7b] [--device cuda] [--runs 1:bf16 80:bf16 128:int8]
           [--position N] [--attention-kernel split] [--warmup 3] [--steps 2] [--timed 20] [--kernels]
           [--out DIR]   (CUDA defaults shown)
       python bench/gpu_profile.py --device meta [--preset moshi-7b]   (kernels per step only, no GPU needed)

On an H200 a Moshi 7B step takes 2-3x what its memory traffic needs (docs/GPU.md), and one figure cannot say where
the rest goes. Each run (BATCH:KV, KV being the pool's format) builds an `Engine` as bench/gpu_capacity.py does
(the preset's LM with random weights drawn on the device, bf16 on CUDA, and its Mimi), with every session at
`--position` (by default the window's last, so attention reads a full window), and after warm-up steps:

- profiles the eager step (no CUDA graph) with the torch profiler. A kernel belongs to the range the engine opened
  around it (`step_part`: temporal, depformer, mimi_encode, mimi_decode) and, in the temporal transformer, to the
  kind its own or its op's name says: matmuls → projections; the decode attention → attention; RMSNorm and the
  SiLU gate → norms; RoPE and the KV store → RoPE, KV store. Sampling and the repetition penalty are sampling
  wherever they run; the rest of the DepFormer and of Mimi is theirs, and anything else copies, other.
- times the same step as the engine runs it, captured as a CUDA graph, with CUDA events: a graph's kernels cannot
  be attributed, so the table shows both totals (the eager one is what launch gaps add).

A part's floor is the bytes it must move at least over the copy bandwidth measured here (a device-to-device copy,
read and write counted, as bench/gpu_kernels.py): projections, the temporal layers' weights and the text head;
attention, every session's keys and values (and 8-bit scales) of a full window; norms, the activations each RMSNorm
and SiLU gate reads and writes; RoPE, KV store, q, k, v read, q written and the new key and value stored; the
DepFormer, its weights; sampling, the logits; Mimi, the encoder's or decoder's weights and each session's streaming
state. Weights and KV are docs/GPU.md's floor; the small parts' floors show how launch-bound they are.

On the CPU (`--device cpu --preset demo`, the dry run) the times are the ops' CPU time (each torch reference of a
kernel labelled with its name) and the bandwidth a torch copy's on the CPU; with `--kernels` the kernel counts are
those of the same step on the `meta` device with the Triton path forced: what CUDA would launch, counted without a
GPU (Triton's launches, and one for each torch op that computes; seconds more, as meta's first use imports much).
`--device meta` prints only those counts, at the preset's real shapes.

Prints a table per run and, as its last line, the report as one JSON object; `--out DIR` writes gpu_profile.json and
gpu_profile.md there after every run, so a run cut short keeps the batches it finished.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib
import importlib.util
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.autograd.profiler import profile, record_function  # noqa: E402

# The meta device's kernel counts run Triton's interpreter, which is chosen when Triton is first imported (by
# duplexd's kernels, below): on a machine without CUDA, where nothing else runs Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.common import clocked, cuda_missing  # noqa: E402
from duplexd.engine.dialogue.engine import (  # noqa: E402
    Engine,
    EngineConfig,
    kv_page_bytes,
    session_pages,
    sessions_that_fit,
)
from duplexd.engine.kv.dtypes import KV_DTYPES  # noqa: E402
from duplexd.engine.kv.paged import PagedKVCache  # noqa: E402
from duplexd.engine.models.config import MIMI_PRESETS, PRESET_MIMI, PRESETS  # noqa: E402
from duplexd.engine.models.mimi import MimiModel, MimiStreams  # noqa: E402
from duplexd.engine.weights.checkpoint import build_lm, mimi_ring_rule  # noqa: E402
from duplexd.kernels.decode_attention import ATTENTION_KERNELS  # noqa: E402

if TYPE_CHECKING:
    from torch.autograd.profiler_util import FunctionEvent

    from duplexd.engine.models.lm import LMModel

PARTS = {  # key: what the table calls it
    "attention": "attention",
    "projections": "projections (matmuls)",
    "norms": "norms, SiLU gate",
    "rope_kv": "RoPE, KV store",
    "depformer": "DepFormer",
    "sampling": "sampling",
    "mimi_encode": "Mimi encode",
    "mimi_decode": "Mimi decode",
    "other": "copies, other",
}
RANGES = ("temporal", "depformer", "mimi_encode", "mimi_decode")  # the engine's `step_part` ranges
KINDS = (  # a kernel's or op's part by its name (lower case): the first that one of its names holds
    ("sampling", ("sample", "repetition_penalty")),
    ("attention", ("_split_kernel", "_combine_kernel", "_paged_kernel", "attention", "attn", "decode")),
    # not "store" alone: torch's elementwise kernels are named with their StoreWithCast template arguments
    ("rope_kv", ("rope", "_store_kv", "store_quantized", "index_put", "aten::cos", "aten::sin")),
    ("norms", ("rms_norm", "silu")),
    ("projections", ("_w8a16", "matmul", "gemm", "gemv", "nvjet", "aten::mm", "aten::addmm", "aten::bmm")),
)
# Torch ops that launch no kernel on CUDA (views, allocations, no-op casts); one that computes launches about one.
NO_KERNEL = {
    f"aten::{name}"
    for name in (
        "view _unsafe_view _reshape_alias reshape as_strided alias select slice narrow unsqueeze squeeze flatten "
        "unflatten transpose t permute expand expand_as detach unbind split chunk unfold resolve_conj resolve_neg "
        "empty empty_like empty_strided new_empty new_empty_strided to contiguous lift_fresh view_as"
    ).split()
}
TIMES = {  # what a part's time is, by device
    "cuda": "each kernel's device time over the profiled eager steps",
    "cpu": "each op's CPU time under the profiler, whose overhead they include (they add up to more than the step)",
    "meta": "none, kernels counted on the meta device with the Triton path forced",
}
CUDA_RUNS, CPU_RUNS = ("1:bf16", "80:bf16", "128:int8"), ("1:bf16", "2:int8")
# The kernels modules whose torch references a CPU step runs, labelled in its profile.
REFERENCE_MODULES = (
    *("rms_norm", "rope", "rope_kv_store", "decode_attention", "kv_quant", "sampling", "silu_gate"),
    *("text_penalties", "w8a16_matmul"),
)


# ------------------------------------------------------------------------------------------------ attribution


def profiler(cuda: bool) -> profile:
    """torch.profiler's own backend, CUDA's kernels included on CUDA: `torch.profiler.profile` would import
    torch._inductor as it starts (seconds of CPU) for a setting of Inductor's graphs alone."""
    return profile(use_kineto=True, use_device="cuda" if cuda else None)


def kind_of(names: list[str]) -> str | None:
    """The kind (`KINDS`) of the first of `names` that names one."""
    lower = [name.lower() for name in names]
    return next((kind for name in lower for kind, keys in KINDS if any(key in name for key in keys)), None)


def part_of(event: FunctionEvent, kernel: str = "") -> str:
    """The part an event (or a kernel it launched) belongs to: its range's, or in the temporal transformer the kind
    its names say (the events from the range inwards, then the kernel's); sampling wherever it runs."""
    chain = []  # the event and the events around it, innermost first
    around: FunctionEvent | None = event
    while around is not None:
        chain.append(around.name)
        around = around.cpu_parent
    where = next((name for name in chain if name in RANGES), None)
    if where in ("mimi_encode", "mimi_decode"):
        return where
    inner = chain[: chain.index(where)] if where else chain
    kind = kind_of([*reversed(inner), kernel])
    if kind == "sampling":
        return kind
    if where == "depformer":
        return where
    return kind if where == "temporal" and kind else "other"


def launches(event: FunctionEvent) -> bool:
    """Whether a torch op launches a kernel on CUDA: it computes, or something it calls does."""
    return event.name not in NO_KERNEL or any(launches(child) for child in event.cpu_children)


def top_level(event: FunctionEvent) -> bool:
    """A torch op not called by another (what Python called)."""
    around = event.cpu_parent
    while around is not None:
        if around.name.startswith("aten::"):
            return False
        around = around.cpu_parent
    return event.name.startswith("aten::")


def device_parts(events: list[FunctionEvent], steps: int) -> tuple[dict[str, dict[str, Any]], float]:
    """CUDA: each part's kernel time (ms) and kernels per step, from the kernels the profiler tied to the op or range
    that launched them (a kernel launched outside both, as the text's sampling is, is tied to none: it goes by its
    name alone); and the time of those tied to none (ms per step). A range's shadow on the device (a GPU user
    annotation spanning its kernels) is no kernel."""
    parts: dict[str, dict[str, Any]] = {key: {"ms": 0.0, "kernels": 0.0} for key in PARTS}
    loose: dict[str, list[float]] = {}  # kernel name: [us, count] of the device's, less those tied to an event
    for event in events:
        shadow = getattr(event, "is_user_annotation", False) or event.name in RANGES
        if event.device_type == DeviceType.CUDA and not shadow:
            entry = loose.setdefault(event.name, [0.0, 0])
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
    for event in events:
        for kernel in event.kernels:
            if kernel.name in RANGES:
                continue
            part = parts[part_of(event, kernel.name)]
            part["ms"] += kernel.duration / 1000 / steps
            part["kernels"] += 1 / steps
            entry = loose.setdefault(kernel.name, [0.0, 0])
            entry[0] -= kernel.duration
            entry[1] -= 1
    untied = 0.0
    for name, (us, count) in loose.items():
        if count > 0:
            part = parts[kind_of([name]) or "other"]
            part["ms"] += us / 1000 / steps
            part["kernels"] += count / steps
            untied += us / 1000 / steps
    return parts, untied


def cpu_parts(events: list[FunctionEvent], steps: int) -> dict[str, dict[str, Any]]:
    """CPU: each part's op time (ms per step, each op's own time, not its callees'); the ranges' own time (Python
    between ops) stays out, as launch gaps do on a GPU."""
    parts: dict[str, dict[str, Any]] = {key: {"ms": 0.0, "kernels": None} for key in PARTS}
    for event in events:
        if event.device_type == DeviceType.CPU and event.name not in RANGES:
            parts[part_of(event)]["ms"] += event.self_cpu_time_total / 1000 / steps
    return parts


def kernel_counts(events: list[FunctionEvent]) -> dict[str, int]:
    """Meta: kernels per part of one step, Triton's launches (labelled `triton::name`) and a kernel per top-level
    torch op that computes."""
    counts = dict.fromkeys(PARTS, 0)
    for event in events:
        if event.name.startswith("triton::") or (top_level(event) and launches(event)):
            counts[part_of(event)] += 1
    return counts


@contextlib.contextmanager
def labelled_references() -> Iterator[None]:
    """Each torch reference of a kernel (`*_reference`, `*_torch`) a CPU step runs wrapped in a profiler range of its
    own name, so that its ops are named as the kernel's would be (rms_norm_reference → norms)."""
    saved = []
    for short in REFERENCE_MODULES:
        module = importlib.import_module(f"duplexd.kernels.{short}")
        for name, fn in list(vars(module).items()):
            if name.endswith(("_reference", "_torch")) and getattr(fn, "__module__", None) == module.__name__:
                saved.append((module, name, fn))
                setattr(module, name, _labelled(name, fn))
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def _labelled(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def triton_labels() -> Iterator[None]:
    """Triton launches (the interpreter's) as no-ops that leave a profiler event `triton::<kernel>`: a meta tensor
    has no data to run them on."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def label(self, *args, **kwargs) -> None:
        with record_function(f"triton::{self.__name__}"):
            pass

    InterpretedFunction.run = label
    try:
        yield
    finally:
        InterpretedFunction.run = run


# ------------------------------------------------------------------------------------------------ floors


def copy_bandwidth(device: str) -> tuple[float, str]:
    """Bytes/s of a copy on `device` (read and write counted), and how it was measured."""
    cuda = device.startswith("cuda")
    src = torch.empty(1 << (29 if cuda else 24), dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = min(timed_ms(lambda: dst.copy_(src), 10, cuda)) / 1000
    how = "a 1 GiB device-to-device copy" if cuda else "a 64 MiB torch copy on the CPU"
    return 2 * src.nbytes / seconds, f"measured: {how}"


def floor_bytes(lm: LMModel, mimi: MimiModel, batch: int, kv_dtype: str, position: int) -> dict[str, float]:
    """Bytes each part must move at least in one step of `batch` sessions (the module's docstring says which)."""
    cfg = lm.cfg
    elt = lm.text_emb.element_size()
    token_kv = PagedKVCache.page_bytes(cfg.num_layers, cfg.num_heads, cfg.head_dim, 1, lm.text_emb.dtype, kv_dtype)
    tokens = min(position + 1, cfg.attention_window)

    def matrices(module: torch.nn.Module) -> int:  # its layers' projection weights
        names = ("wqkv", "wo", "w_in", "w_out")
        return sum(p.nbytes for name, p in module.named_parameters() if name.rsplit(".", 1)[-1] in names)

    def params(modules: list[torch.nn.Module]) -> int:
        return sum(p.nbytes for m in modules for p in m.parameters())

    def state(decoder: bool) -> float:  # the batch's rows of Mimi's streams, the scratch row left out
        return MimiStreams.state_bytes(mimi, batch, decoder=decoder) * batch / (batch + 1)

    out: dict[str, float] = {
        "attention": batch * tokens * token_kv,
        "projections": matrices(lm.layers) + lm.text_head.nbytes,
        "norms": batch * elt * (2 * cfg.dim + cfg.num_layers * (8 * cfg.dim + 3 * cfg.hidden)),
        "rope_kv": batch * (cfg.num_layers * 4 * cfg.dim * elt + token_kv),
        "sampling": batch * elt * (cfg.text_card + cfg.agent_codebooks * cfg.card),
        "mimi_encode": params(mimi.encoder_modules) + state(False),
    }
    if not cfg.text_only:  # a text-only model (Kyutai STT) runs neither the DepFormer nor Mimi's decoder
        out["mimi_decode"] = params(mimi.decoder_modules) + state(True) - state(False)
        out["depformer"] = matrices(lm.dep_layers) + lm.dep_in.nbytes + lm.dep_heads.nbytes
    return out


# ------------------------------------------------------------------------------------------------ the engine side


def timed_ms(fn: Callable[[], object], n: int, cuda: bool) -> list[float]:
    """Each of `n` calls' milliseconds: CUDA events around it on CUDA (each call ends waiting for the device), the
    wall clock elsewhere."""
    if not cuda:
        run = clocked(fn)
        return [1000 * run() for _ in range(n)]
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def build(lm: LMModel, mimi: MimiModel, batch: int, kv_dtype: str, args: argparse.Namespace) -> Engine:
    """An engine of `batch` slots with a KV pool of as many whole windows and one bucket (graphs on CUDA), every slot
    reset and moved to `--position`. Not started: its steps run here, on this thread."""
    device = str(lm.text_emb.device)
    base = EngineConfig(
        max_sessions=batch, device=device, kv_dtype=kv_dtype, buckets=(batch,), attention_kernel=args.attention_kernel
    )
    memory = batch * session_pages(lm.cfg, base) * kv_page_bytes(lm, base)
    engine = Engine(lm, mimi, config=dataclasses.replace(base, kv_memory=memory))
    for slot in range(batch):
        engine.kv.allocate(slot)
        engine.pipeline.reset(slot)
        engine.pipeline.seek(slot, args.position)
    return engine


def stepper(engine: Engine) -> Callable[[], None]:
    """One step of every slot, its outputs copied to the host as the engine's runner does (pinned, one wait)."""
    pipeline = engine.pipeline
    slots = list(range(pipeline.num_slots))
    pcm = np.zeros((len(slots), pipeline.frame_size), np.float32)
    cuda = pipeline.device.type == "cuda"
    host: dict[str, torch.Tensor] = {}

    def step() -> None:
        out = pipeline.step(slots, pcm)
        if cuda:
            for name, t in (("pcm", out.pcm), ("tokens", out.tokens)):
                host.setdefault(name, torch.empty(t.shape, dtype=t.dtype, pin_memory=True)).copy_(t, non_blocking=True)
            torch.cuda.synchronize()

    return step


def meta_counts(args: argparse.Namespace, batch: int, kv_dtype: str) -> dict[str, int] | None:
    """Kernels per part of the same step on the `meta` device, the Triton path forced (None where Triton cannot be
    interpreted: a machine with CUDA imports the real one)."""
    from duplexd.kernels.dispatch import force_triton

    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        return None
    lm, mimi = meta_models(args.preset)
    step = stepper(build(lm, mimi, batch, kv_dtype, args))
    with force_triton(), triton_labels():
        step()  # what only a first step makes (Mimi's first call on meta makes more) stays out of the count
        with profiler(cuda=False) as prof:
            step()
    return kernel_counts(list(prof.function_events))


@functools.cache
def meta_models(preset: str) -> tuple[LMModel, MimiModel]:
    lm = build_lm(PRESETS[preset], device="meta", dtype=torch.bfloat16)
    return lm, MimiModel(mimi_ring_rule(MIMI_PRESETS[PRESET_MIMI[preset]], lm.cfg)).to("meta")


def models(preset: str, device: str) -> tuple[LMModel, MimiModel]:
    """The preset's LM and Mimi: random weights drawn on the device (bf16 on CUDA, fp32 on the CPU), or no data on
    `meta`."""
    from duplexd.server.core.runtime import random_models

    if device == "meta":
        return meta_models(preset)
    return random_models(preset, device, torch.bfloat16 if device.startswith("cuda") else torch.float32)


def measure(
    args: argparse.Namespace, lm: LMModel, mimi: MimiModel, batch: int, kv_dtype: str, bandwidth: float | None
) -> dict:
    """One run: its parts, totals and floors (ms per step), or why it was not measured."""
    device = args.device
    cuda, meta = device.startswith("cuda"), device == "meta"
    result: dict[str, object] = {"batch": batch, "kv_dtype": kv_dtype}
    fit = sessions_that_fit(lm, mimi, EngineConfig(max_sessions=batch, device=device, kv_dtype=kv_dtype))
    if fit < batch:
        return {**result, "status": "does not fit", "error": f"{fit} sessions' full windows fit"}
    floors = floor_bytes(lm, mimi, batch, kv_dtype, args.position)
    if meta:
        counts = meta_counts(args, batch, kv_dtype)
        if counts is None:
            return {**result, "status": "FAILED", "error": "Triton's interpreter is needed: run without CUDA"}
        only = {key: {"ms": None, "kernels": counts[key]} for key in PARTS}
        return {**result, "status": "ok", "parts": only, "kernels": sum(counts.values())}
    assert bandwidth is not None, "measured on every device but meta"
    engine = build(lm, mimi, batch, kv_dtype, args)
    step = stepper(engine)
    for _ in range(args.warmup):
        step()
    eager = statistics.median(timed_ms(step, args.timed, cuda))
    with labelled_references() if not cuda else contextlib.nullcontext(), profiler(cuda) as prof:
        for _ in range(args.steps):
            step()
    events = list(prof.function_events)
    if cuda:
        parts, loose = device_parts(events, args.steps)
        result["unattributed_ms"] = round(loose, 4)
        engine.pipeline.capture()
        for _ in range(2):
            step()
        graph: float | None = statistics.median(timed_ms(step, args.timed, cuda))
    else:
        parts, graph = cpu_parts(events, args.steps), None
        counts = meta_counts(args, batch, kv_dtype) if args.kernels else None
        for key, part in parts.items():
            part["kernels"] = None if counts is None else counts[key]
    del engine, step
    busy = sum(p["ms"] for p in parts.values())
    for key, part in parts.items():
        floor = floors.get(key)
        part["floor_ms"] = None if floor is None else round(1000 * floor / bandwidth, 6)
        part["share"] = round(part["ms"] / busy, 4) if busy else None
        part["ms"] = round(part["ms"], 4)
        if part["kernels"] is not None:
            part["kernels"] = round(part["kernels"])
    floor_ms = 1000 * sum(floors.values()) / bandwidth
    counted = [p["kernels"] for p in parts.values()]
    return {
        **result,
        "status": "ok",
        "parts": parts,
        "kernels": None if None in counted else sum(counted),
        "busy_ms": round(busy, 4),
        "eager_ms": round(eager, 4),
        "graph_ms": None if graph is None else round(graph, 4),
        "floor_ms": round(floor_ms, 4),
    }


# ------------------------------------------------------------------------------------------------ the report


def _cell(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _ratio(ms: float | None, floor: float | None) -> float | None:
    return ms / floor if ms is not None and floor else None


def run_table(run: dict) -> str:
    """One run's markdown: a row per part, then the totals (every part, the eager step, the graph step)."""
    title = f"batch {run['batch']}, KV {run['kv_dtype']}"
    if run["status"] != "ok":
        return f"{title}: {run['status']} ({run.get('error', '')})"
    lines = [
        title,
        "",
        "| part | kernels | ms/step | share % | floor ms | x floor |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, label in PARTS.items():
        p = run["parts"][key]
        share = None if p.get("share") is None else 100 * p["share"]
        cells = [_cell(p["kernels"], "d"), _cell(p["ms"], ".3f"), _cell(share, ".1f"), _cell(p.get("floor_ms"), ".3f")]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_cell(_ratio(p['ms'], p.get('floor_ms')), '.1f')} |")
    floor = run.get("floor_ms")
    for label, ms, kernels in (
        ("all parts (eager, busy)", run.get("busy_ms"), run["kernels"]),
        ("eager step", run.get("eager_ms"), None),
        ("graph step (what the engine runs)", run.get("graph_ms"), None),
    ):
        if ms is None and kernels is None:
            continue
        cells = [_cell(kernels, "d"), _cell(ms, ".3f"), "", _cell(floor, ".3f"), _cell(_ratio(ms, floor), ".1f")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if run.get("unattributed_ms"):
        lines.append(f"\nkernels tied to no op or range, placed by their names alone: {run['unattributed_ms']} ms")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    head = (
        f"{report['preset']} on {report['device']}, {report['dtype']} weights, attention "
        f"{report['attention_kernel']}, position {report['position']}, "
    )
    if report["copy_gbps"] is None:
        head += f"{report['date']}: {report['times']}."
    else:
        head += (
            f"profiled eager steps {report['steps']}, timed steps {report['timed']}; copy bandwidth "
            f"{report['copy_gbps']:.0f} GB/s ({report['bandwidth']}); {report['date']}. Times: {report['times']}."
        )
    return "\n\n".join([head, *(run_table(run) for run in report["runs"])])


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_profile.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_profile.md").write_text(markdown(report) + "\n")


# ------------------------------------------------------------------------------------------------ main


def run_spec(text: str) -> tuple[int, str]:
    """BATCH:KV, e.g. 80:bf16."""
    batch, _, kv = text.partition(":")
    if not batch.isdigit() or int(batch) < 1 or kv not in KV_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not BATCH:KV with KV one of {', '.join(KV_DTYPES)}")
    return int(batch), kv


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="moshi-7b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda", help="cuda, cpu (the dry run) or meta (kernels per step only)")
    parser.add_argument(
        "--runs",
        nargs="+",
        type=run_spec,
        help=f"BATCH:KV of each run (default {' '.join(CUDA_RUNS)}; on the CPU {' '.join(CPU_RUNS)})",
    )
    parser.add_argument("--position", type=int, help="every session's position (default: the window's last)")
    parser.add_argument(
        "--attention-kernel", choices=ATTENTION_KERNELS, default="split", help="the Triton decode attention"
    )
    parser.add_argument("--warmup", type=int, default=3, help="steps before anything is measured")
    parser.add_argument("--steps", type=int, default=2, help="eager steps profiled")
    parser.add_argument("--timed", type=int, help="steps timed for each total (default 20 on CUDA, 5 on the CPU)")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="on the CPU, count each run's kernels on the meta device too (seconds: meta's first use imports much)",
    )
    parser.add_argument("--out", type=Path, help="write gpu_profile.json and gpu_profile.md here")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.runs = args.runs or [run_spec(r) for r in (CPU_RUNS if args.device == "cpu" else CUDA_RUNS)]
    args.timed = args.timed or (20 if cuda else 5)
    if min(args.warmup + 1, args.steps, args.timed) < 1:
        parser.error("--steps and --timed must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cuda_missing(args.device, "gpu_profile", "try --preset demo --device cpu for a dry run"):
        return 0
    cuda, meta = args.device.startswith("cuda"), args.device == "meta"
    if not cuda:
        torch.set_num_threads(1)  # as the engine's loop thread on a small CPU
    started = time.perf_counter()
    lm, mimi = models(args.preset, args.device)
    if args.position is None:
        args.position = lm.cfg.context - 1
    bandwidth, how = (None, "none: the meta device has no data") if meta else copy_bandwidth(args.device)
    print(f"models and copy bandwidth: {time.perf_counter() - started:.0f} s")
    report = {
        "bench": "gpu_profile",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(args.device) if cuda else args.device,
        "preset": args.preset,
        "dtype": str(lm.text_emb.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "position": args.position,
        "attention_kernel": args.attention_kernel,
        "steps": args.steps,
        "timed": args.timed,
        "copy_gbps": None if bandwidth is None else round(bandwidth / 1e9, 1),
        "bandwidth": how,
        "times": TIMES["cuda" if cuda else args.device],
        "status": "incomplete",
        "runs": [],
    }
    print(markdown(report), flush=True)
    for batch, kv_dtype in args.runs:
        try:
            run = measure(args, lm, mimi, batch, kv_dtype, bandwidth)
        except Exception as e:  # noqa: BLE001 - reported as the run's failure; the next run is still measured
            run = {"batch": batch, "kv_dtype": kv_dtype, "status": "FAILED", "error": f"{type(e).__name__}: {e}"}
        if cuda:  # the engine's pools go back before the next run's (a pipeline's graphs hold it in a cycle)
            gc.collect()
            torch.cuda.empty_cache()
        report["runs"].append(run)
        print(f"\n{run_table(run)}", flush=True)
        if args.out:
            write_report(args.out, report)
    failed = any(run["status"] == "FAILED" for run in report["runs"])
    report["status"] = "failed" if failed else "ok"
    if args.out:
        write_report(args.out, report)
    print(json.dumps(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
