"""8-bit weights against the weights' dtype: sessions that fit, the W8A16 kernel, step time, and teacher-forced
logit agreement.

Usage: python bench/weights_dtype.py [--preset moshi-7b|demo] [--device cuda|cpu] [--stages capacity kernel steps
           agreement] [--gpu-memory 22GiB 23028MiB] [--repeats 100] [--batches 1 8 64] [--steps 100]
           [--w8a16-kernels tiles gemv] [--kv-dtype bf16] [--frames 300] [--rows 4] [--sharpen 3] [--out DIR]

Defaults follow the device: CUDA when there is one (moshi-7b, bf16), else the CPU (demo, fp32). The stages run in
the order below; the CUDA-only ones say they were skipped on a CPU.

1. capacity: `duplexd capacity`'s answer (the server's own sizing rule) for moshi-7b with bf16 and int8 weights,
   each with a bf16 and an int8 KV cache, on the live device's memory (CUDA, no `--gpu-memory`) or for each
   `--gpu-memory`, and always for a 24 GB card: 22 GiB and 23028 MiB (what an A10G or L4's driver reports). The
   headline is int8 weights + int8 KV on that card against the goal of 12 full-window sessions.
2. kernel (CUDA only): at each Moshi 7B decode shape (K, N) and M in {1, 8, 64} rows, `int8_matmul` on bf16 x
   with each W8A16 kernel of `--w8a16-kernels` (a row each) against the bf16 `x @ w` of the same shape and a device
   copy of the codes' bytes (the copy-bandwidth ceiling: bytes read + written per second). Each is captured
   `--repeats` times in a CUDA graph (no launch gaps, as the engine's graphs run them) over enough weight copies to
   stream from memory rather than L2, and timed with CUDA events, the median of 5 replays. Prints weight GB/s
   (codes + scales read), its share of the copy bandwidth, the speedup against bf16 and the time against the tiles
   kernel's (gemv / tiles: below 1 is faster; "gemv" runs the tiles past 8 rows); checks each kernel against
   `int8_matmul_reference` first and fails the stage (exit 1) past 2e-2 max relative error.
3. steps: an `Engine` per weights format (random weights in the device's dtype; int8 by `quantize_lm_`, the text
   head float as `--weights-dtype int8` leaves it) and, for int8, per W8A16 kernel of `--w8a16-kernels`, one at a
   time, every session at position 2999 (a full window): p50/p99 step at each of `--batches`
   (bench/gpu_capacity.py's `measure`), and int8 / bf16 per kernel (goal on a GPU: batch 1 <= 0.75; "int8" and
   "ratio" are the first kernel's). On a CPU the int8 path is the torch reference whatever the kernel, which
   converts each weight to fp32 per call: a correctness path, its cost recorded once (the first kernel).
4. agreement: one LM of `--preset` with random weights whose q and k projections are scaled by `--sharpen` (random
   weights attend almost uniformly), and two int8 copies of it (`quantize_lm_`: the text head int8, and float),
   each with its own KV pool, `--rows` sessions fed the same tokens for `--frames` frames: the float model's greedy
   text token and random audio codes (teacher-forced). Per frame, for each copy against the float model: KL(float
   || int8) of the text distribution, top-1 agreement and relative L2 error of the text logits; the same for the
   DepFormer's first-codebook logits (`forward_depformer` from each model's own hidden state and the shared text
   token, stopped after its first step; later codebooks would follow each model's own samples).

Prints a table per stage; the last line is one JSON object (`--out DIR` also writes weights_dtype.json, rewritten
after each stage with "partial": true, so a stage cut short leaves the earlier ones).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import itertools
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import MID_LM, add_kv_dtype, cuda_missing, relative_error, sharpened  # noqa: E402
from bench.gpu_capacity import OK, measure  # noqa: E402
from duplexd.commands.capacity import PRESET_MIMI, capacity, parse_size, weight_bytes
from duplexd.engine.dialogue.engine import Engine, EngineConfig, sessions_that_fit  # noqa: E402
from duplexd.engine.kv.paged import window_pages  # noqa: E402
from duplexd.engine.models.config import PRESETS  # noqa: E402
from duplexd.engine.models.int8_weights import int8_names, use_int8_kernel  # noqa: E402
from duplexd.engine.models.lm import LMModel  # noqa: E402
from duplexd.engine.weights.checkpoint import build_lm, quantize_lm_  # noqa: E402
from duplexd.engine.weights.demo import draw_random_  # noqa: E402
from duplexd.kernels.w8a16_matmul import W8A16_KERNELS, int8_matmul, int8_matmul_reference  # noqa: E402

STAGES = ("capacity", "kernel", "steps", "agreement")
CUDA_ONLY = ("kernel",)
FORMATS = ("bf16", "int8")
CAPACITY_MODEL = "moshi-7b"
CARD_24GB = ("22GiB", "23028MiB")  # a 24 GB card: a round figure, and what an A10G or L4's driver reports
GOAL_SESSIONS = 12
GOAL_RATIO_B1 = 0.75
POSITION = 2999
PAGE = 64
# Moshi 7B's decode projections (K, N): temporal wqkv, wo, w_in, w_out, the text head; DepFormer wqkv, wo, w_in,
# w_out, dep_in, dep_heads.
SHAPES = (
    (4096, 12288),
    (4096, 4096),
    (4096, 22528),
    (11264, 4096),
    (4096, 32000),
    (1024, 3072),
    (1024, 1024),
    (1024, 5632),
    (2816, 1024),
    (4096, 1024),
    (1024, 2048),
)
ROWS = (1, 8, 64)
MAX_REL_ERR = 2e-2
STREAMED = 256 * 2**20  # bytes of weight copies cycled through per timing: several times an H200's 60 MB L2
GiB = 2**30
# `--preset` for the agreement: the LM presets, and bench/common.py's mid-size LM (1024 x 8 layers, the real
# vocabularies), which a CPU runs in minutes.
AGREEMENT_LMS = {**PRESETS, "mid": MID_LM}


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------- capacity


def capacities(sizes: list[str | None], device: str) -> dict:
    """Sessions that fit for every weights x KV format, at each memory size (None: the live CUDA device's)."""
    cfg, mimi = PRESETS[CAPACITY_MODEL], PRESET_MIMI[CAPACITY_MODEL]
    by_memory: dict[str, dict] = {}
    print(f"capacity {CAPACITY_MODEL} (bf16 dtype): full-window sessions that fit, by `duplexd capacity`'s rule")
    print(f"capacity {'memory':>10} {'weights':>7} {'kv':>5} {'LM GiB':>7} {'KV GiB/session':>15} {'sessions':>9}")
    for size in dict.fromkeys(sizes):
        memory = None if size is None else parse_size(size)
        label = size or "live device"
        cells: dict[str, dict] = {}
        for weights in FORMATS:
            for kv in FORMATS:
                r = capacity(
                    CAPACITY_MODEL,
                    cfg,
                    mimi,
                    kv,
                    torch.bfloat16,
                    memory,
                    device=device if size is None else "cuda",  # a given size is sized as a GPU (the CPU has no rule)
                    weights_dtype=weights,
                )
                cells.setdefault(weights, {})[kv] = {
                    "sessions": r.sessions,
                    "lm_weights_gib": round(r.lm_weights / GiB, 3),
                    "kv_window_gib": round(r.kv_window / GiB, 3),
                }
                print(
                    f"capacity {label:>10} {weights:>7} {kv:>5} {r.lm_weights / GiB:>7.2f} "
                    f"{r.kv_window / GiB:>15.3f} {r.sessions:>9}"
                )
        by_memory[label] = {"memory_gib": round(r.memory / GiB, 2), **cells}
    card = {size: by_memory[size]["int8"]["int8"]["sessions"] for size in CARD_24GB}
    headline = {
        "weights": "int8",
        "kv": "int8",
        "goal": GOAL_SESSIONS,
        "sessions": card,
        "met": {size: n >= GOAL_SESSIONS for size, n in card.items()},
    }
    print(
        "capacity headline: int8 weights + int8 KV on a 24 GB card: "
        + ", ".join(f"{n} sessions at {size}" for size, n in card.items())
        + f" (goal >= {GOAL_SESSIONS})"
    )
    return {"model": CAPACITY_MODEL, "by_memory": by_memory, "headline": headline}


# ----------------------------------------------------------------------------------------------------- kernel


def _timed_ms(fn: Callable[[], object], repeats: int, device: str, rounds: int = 5) -> tuple[float, str]:
    """Median ms per call of `fn`, and how it was timed. CUDA: `repeats` calls captured in one CUDA graph (eager
    launches when capture fails), replays timed with CUDA events; elsewhere wall time of `repeats` calls."""
    if not device.startswith("cuda"):
        fn()
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(repeats):
                fn()
            times.append(1000 * (time.perf_counter() - started) / repeats)
        return statistics.median(times), "wall clock"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the Triton kernel, picks the cuBLAS algorithm: before capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    def eager() -> None:
        for _ in range(repeats):
            fn()

    graph = torch.cuda.CUDAGraph()
    run: Callable[[], object] = graph.replay
    how = "cuda graph"
    try:
        with torch.cuda.graph(graph):
            eager()
    except RuntimeError as e:
        logging.getLogger(__name__).warning("CUDA graph capture failed (%s): timing eager launches", e)
        run, how = eager, "eager"
        torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / repeats)
    del run, graph  # the graph and its memory pool go now
    return statistics.median(times), how


def _cycled(fn: Callable, sets: list[tuple]) -> Callable[[], object]:
    """`fn(*args)` over the argument sets in turn (each call reads a different weight copy)."""
    turn = itertools.cycle(sets)
    return lambda: fn(*next(turn))


def _kernel_row(cell: dict) -> str:
    head = f"kernel {cell['K']:>6} {cell['N']:>6} {cell['M']:>3} {cell['kernel']:>6}"
    if not cell["ok"]:
        return f"{head} FAILED: max rel. err. {cell['max_rel_err']:.2e} > {MAX_REL_ERR:g}, not timed"
    vs_tiles = f"{cell['vs_tiles']:>8.2f}" if "vs_tiles" in cell else f"{'-':>8}"
    return (
        f"{head} {cell['int8_ms']:>8.4f} {cell['bf16_ms']:>8.4f} {cell['copy_ms']:>8.4f} {cell['int8_gbps']:>10.0f} "
        f"{cell['bf16_gbps']:>10.0f} {cell['copy_gbps']:>10.0f} {cell['of_copy']:>8.2f} {cell['speedup']:>8.2f} "
        f"{vs_tiles} {cell['max_rel_err']:>8.1e}"
    )


def kernel_table(
    device: str,
    repeats: int,
    shapes=SHAPES,
    rows=ROWS,
    streamed: int = STREAMED,
    seed: int = 0,
    kernels: tuple[str, ...] = W8A16_KERNELS,
) -> dict:
    """Each W8A16 kernel against bf16 and the codes' copy at each (K, N) x M (module docs, stage 2)."""
    g = torch.Generator(device=device).manual_seed(seed)
    cases: list[dict] = []
    worst, hows = 0.0, set()
    print(
        f"kernel {'K':>6} {'N':>6} {'M':>3} {'kernel':>6} {'int8 ms':>8} {'bf16 ms':>8} {'copy ms':>8} "
        f"{'int8 GB/s':>10} {'bf16 GB/s':>10} {'copy GB/s':>10} {'of copy':>8} {'speedup':>8} {'/ tiles':>8} "
        f"{'rel err':>8}"
    )
    for k, n in shapes:
        codes = torch.randint(-127, 128, (n, k), generator=g, device=device, dtype=torch.int8)
        scale = torch.rand(n, generator=g, device=device) * (4.0 / 127 / math.sqrt(k)) + 1e-4
        weight = torch.randn(k, n, generator=g, device=device, dtype=torch.bfloat16) * k**-0.5
        copies = max(1, min(repeats, math.ceil(streamed / codes.nbytes)))
        codes_sets = [codes] + [codes.clone() for _ in range(copies - 1)]
        weights = [weight] + [
            weight.clone() for _ in range(max(1, min(repeats, math.ceil(streamed / weight.nbytes))) - 1)
        ]
        targets = [torch.empty_like(codes) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, generator=g, device=device, dtype=torch.bfloat16)
            want = int8_matmul_reference(x, codes, scale).float()
            here: dict[str, dict] = {}
            for kernel in kernels:
                got = int8_matmul(x, codes, scale, kernel).float()
                err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
                worst = max(worst, err)
                here[kernel] = {"K": k, "N": n, "M": m, "kernel": kernel, "max_rel_err": float(f"{err:.3g}")}
                here[kernel]["ok"] = err <= MAX_REL_ERR
            cases += here.values()
            if any(c["ok"] for c in here.values()):
                bf16_ms, how_b = _timed_ms(_cycled(torch.matmul, [(x, w) for w in weights]), repeats, device)
                pairs = list(zip(targets, codes_sets, strict=True))
                copy_ms, how_c = _timed_ms(_cycled(torch.Tensor.copy_, pairs), repeats, device)
                hows |= {how_b, how_c}
            for kernel, cell in here.items():
                if not cell["ok"]:
                    continue
                sets = [(x, c, scale, kernel) for c in codes_sets]
                int8_ms, how = _timed_ms(_cycled(int8_matmul, sets), repeats, device)
                hows.add(how)
                int8_gbps = (codes.nbytes + scale.nbytes) / (int8_ms * 1e-3) / 1e9
                copy_gbps = 2 * codes.nbytes / (copy_ms * 1e-3) / 1e9  # read + written
                cell.update(
                    int8_ms=round(int8_ms, 5),
                    bf16_ms=round(bf16_ms, 5),
                    copy_ms=round(copy_ms, 5),
                    int8_gbps=round(int8_gbps, 1),
                    bf16_gbps=round(weight.nbytes / (bf16_ms * 1e-3) / 1e9, 1),
                    copy_gbps=round(copy_gbps, 1),
                    of_copy=round(int8_gbps / copy_gbps, 3),
                    speedup=round(bf16_ms / int8_ms, 3),
                )
            tiles = here.get("tiles", {}).get("int8_ms")
            for cell in here.values():
                if tiles and "int8_ms" in cell:
                    cell["vs_tiles"] = round(cell["int8_ms"] / tiles, 3)
                print(_kernel_row(cell))
        del codes_sets, weights, targets, codes, weight
        _free(device)
    timed = [c for c in cases if "speedup" in c]
    ok = all(c["ok"] for c in cases)
    out: dict[str, Any] = {
        "repeats": repeats,
        "timing": sorted(hows),
        "kernels": list(kernels),
        "cases": cases,
        "max_rel_err": float(f"{worst:.3g}"),
        "ok": ok,
    }

    def geomean(values: list[float]) -> float:
        return round(math.exp(statistics.fmean(math.log(v) for v in values)), 3)

    out["by_kernel"] = {}
    for kernel in kernels:
        summary = out["by_kernel"][kernel] = {}
        for m in rows:
            mine = [c for c in timed if c["M"] == m and c["kernel"] == kernel]
            for field in ("speedup", "of_copy", "vs_tiles"):
                values = [c[field] for c in mine if field in c]
                if values and (field, kernel) != ("vs_tiles", "tiles"):
                    summary[f"{field}_geomean_m{m}"] = geomean(values)
    print(
        f"kernel: {'ok' if ok else 'FAILED'} (max rel. err. {worst:.2e}, limit {MAX_REL_ERR:g}); timed by "
        f"{', '.join(sorted(hows)) or 'nothing'}; geometric means over the shapes:"
    )
    for kernel, summary in out["by_kernel"].items():
        shown = "; ".join(
            f"M={m} speedup {summary[f'speedup_geomean_m{m}']:.2f}, of copy {summary[f'of_copy_geomean_m{m}']:.2f}"
            + (f", / tiles {summary[f'vs_tiles_geomean_m{m}']:.2f}" if f"vs_tiles_geomean_m{m}" in summary else "")
            for m in rows
            if f"speedup_geomean_m{m}" in summary
        )
        print(f"kernel {kernel}: {shown or 'nothing timed'}")
    return out


# ------------------------------------------------------------------------------------------------------ steps


def _engine_steps(lm, mimi, base: EngineConfig, batches: list[int], steps: int) -> dict[str, Any]:
    """Sessions that fit, the LM's weight GiB and p50/p99 step per batch (an error where one does not fit)."""
    fit = sessions_that_fit(lm, mimi, base)
    runnable = [b for b in batches if b <= fit]
    rows: dict[str, Any] = {"fit": fit, "lm_weights_gib": round(weight_bytes(lm) / GiB, 3)}
    if runnable:
        buckets = tuple(sorted(set(runnable)))
        engine = Engine(lm, mimi, config=dataclasses.replace(base, max_sessions=max(runnable), buckets=buckets))
        engine.start()
        try:
            for batch in runnable:
                r = measure(engine, batch, steps, POSITION)
                p50, p99 = r.stat(50), r.stat(99)
                rows[str(batch)] = (
                    {"p50_ms": round(p50, 3), "p99_ms": round(p99, 3)}
                    if r.status == OK and p50 is not None and p99 is not None
                    else {"error": f"{r.status}: {r.error}"}
                )
        finally:
            engine.stop()
            del engine
    for batch in batches:
        rows.setdefault(str(batch), {"error": f"does not fit ({fit} sessions do)"})
    return rows


def step_times(
    preset: str,
    kv_dtype: str,
    batches: list[int],
    steps: int,
    device: str,
    dtype: torch.dtype,
    kernels: tuple[str, ...] = W8A16_KERNELS,
) -> dict:
    """p50/p99 step (ms) per batch for bf16 weights and for int8 weights with each W8A16 kernel, one model and
    engine at a time (module docs, stage 3)."""
    from duplexd.server.core.runtime import random_models

    if not device.startswith("cuda"):
        kernels = kernels[:1]  # the torch reference runs whatever the kernel
    out: dict[str, Any] = {"kv_dtype": kv_dtype, "kernels": list(kernels)}
    frames = steps + 8
    base = EngineConfig(
        max_sessions=max(batches),
        max_pending_frames=frames,
        max_output_frames=frames,
        device=device,
        kv_dtype=kv_dtype,
    )
    runs: dict[str, dict] = {}
    for weights in FORMATS:
        lm, mimi = random_models(preset, device, dtype, weights_dtype=weights)
        for kernel in kernels if weights == "int8" else ("",):
            if kernel:
                use_int8_kernel(lm, kernel)
            name = f"{weights} ({kernel})" if kernel else weights
            rows = runs[name] = _engine_steps(lm, mimi, base, batches, steps)
            for batch in batches:
                cell = rows[str(batch)]
                shown = (
                    f"p50 {cell['p50_ms']:.2f} ms, p99 {cell['p99_ms']:.2f} ms" if "p50_ms" in cell else cell["error"]
                )
                print(f"steps {name} weights, {kv_dtype} KV, batch {batch}: {shown}")
        del lm, mimi
        _free(device)
    out["bf16"] = runs["bf16"]
    out["int8_by_kernel"] = {kernel: runs[f"int8 ({kernel})"] for kernel in kernels}
    out["int8"] = out["int8_by_kernel"][kernels[0]]
    out["goal_ratio_b1"] = GOAL_RATIO_B1
    out["ratio_by_kernel"], out["met_by_kernel"] = {}, {}
    for kernel, int8 in out["int8_by_kernel"].items():
        ratios: dict[str, dict] = {}
        for batch in batches:
            a, b = int8[str(batch)], out["bf16"][str(batch)]
            if "p50_ms" in a and "p50_ms" in b:
                ratios[str(batch)] = {q: round(a[f"{q}_ms"] / b[f"{q}_ms"], 3) for q in ("p50", "p99")}
                shown = ", ".join(f"{q} {r:.3f}" for q, r in ratios[str(batch)].items())
                print(f"steps int8 ({kernel}) / bf16 at batch {batch}: {shown}")
        b1 = ratios.get("1", {}).get("p50")
        out["ratio_by_kernel"][kernel] = ratios
        out["met_by_kernel"][kernel] = None if b1 is None else b1 <= GOAL_RATIO_B1
        if b1 is not None:
            verdict = "met" if b1 <= GOAL_RATIO_B1 else "NOT met"
            print(f"steps: int8 ({kernel}) / bf16 p50 at batch 1 {b1:.3f} (goal <= {GOAL_RATIO_B1}): {verdict}")
    out["ratio"] = out["ratio_by_kernel"][kernels[0]]
    out["met"] = out["met_by_kernel"][kernels[0]]
    return out


# -------------------------------------------------------------------------------------------------- agreement


class _FirstStep(Exception):
    """Raised by the sampler to stop `forward_depformer` after its first sub-step."""


def first_audio_logits(lm: LMModel, hidden: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """The DepFormer's first-codebook logits [B, card] from `hidden` and the text token (its first sub-step only)."""
    seen: list[torch.Tensor] = []

    def sample(step: int, logits: torch.Tensor) -> torch.Tensor:
        seen.append(logits)
        raise _FirstStep

    try:
        lm.forward_depformer(hidden, text, sample)
    except _FirstStep:
        pass
    return seen[0].float()


def _kl(ref: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Per row: KL(softmax(ref) || softmax(low))."""
    logp_ref, logp_low = ref.log_softmax(-1), low.log_softmax(-1)
    return (logp_ref.exp() * (logp_ref - logp_low)).sum(-1).clamp_min(0.0)


def _summary(kl: list, top1: list, rel: list) -> dict:
    k, t, r = (torch.stack(v).cpu() for v in (kl, top1, rel))
    return {
        "kl_mean": float(k.mean()),
        "kl_p99": float(k.flatten().quantile(0.99)),
        "top1_agreement": float(t.mean()),
        "logit_rel_err_mean": float(r.mean()),
        "logit_rel_err_max": float(r.max()),
    }


VARIANTS = {"text_head_int8": True, "text_head_float": False}


@torch.no_grad()
def agreement(lm: LMModel, frames: int, rows: int, seed: int = 0) -> dict:
    """Teacher-forced comparison of `lm` (float) and its int8 copies, the text head int8 and float (module docs,
    stage 4)."""
    cfg, device = lm.cfg, lm.text_emb.device
    models = {"float": lm}
    for name, text_head in VARIANTS.items():
        models[name] = quantize_lm_(copy.deepcopy(lm), "int8", text_head=text_head)
    pools = {}
    for name, model in models.items():
        pool = model.new_kv_cache(rows, rows * window_pages(cfg.context, PAGE, frames), PAGE, "bf16")
        for slot in range(rows):
            pool.allocate(slot, frames)
            pool.upload(slot)
        pools[name] = pool
    g = torch.Generator(device=device).manual_seed(seed)
    slots = torch.arange(rows, device=device)
    text = torch.full((rows,), cfg.text_initial_token_id, device=device)
    acc: dict[str, dict[str, tuple[list, list, list]]] = {
        name: {part: ([], [], []) for part in ("text", "audio")} for name in VARIANTS
    }
    for t in range(frames):
        audio = torch.randint(0, cfg.card, (rows, cfg.n_q), generator=g, device=device)
        tokens = torch.cat([text[:, None], audio], 1)
        positions = torch.full((rows,), t, device=device)
        outs = {}
        for name, model in models.items():
            pool = pools[name]
            outs[name] = model.forward_text(tokens, positions, pool, pool.batch(slots, positions))
        hidden, ref = outs["float"]
        text = ref.argmax(-1)  # the float model's greedy token: fed to every model, now and as the next input
        ref_audio = first_audio_logits(lm, hidden, text)
        for name in VARIANTS:
            hidden_q, logits_q = outs[name]
            for part, a, b in (
                ("text", logits_q.float(), ref.float()),
                ("audio", first_audio_logits(models[name], hidden_q, text), ref_audio),
            ):
                kl, top1, rel = acc[name][part]
                kl.append(_kl(b, a))
                top1.append((a.argmax(-1) == b.argmax(-1)).float())
                rel.append(relative_error(a, b))
    result: dict = {"frames": frames, "rows": rows, "lm_weights_gib": {}}
    print(
        f"agreement {'weights':>15} {'LM GiB':>7} {'part':>6} {'KL mean':>9} {'KL p99':>9} {'top-1 %':>8} "
        f"{'rel err':>9} {'rel max':>9}"
    )
    for name, model in [("float", lm), *((n, models[n]) for n in VARIANTS)]:
        result["lm_weights_gib"][name] = round(weight_bytes(model) / GiB, 4)
    for name in VARIANTS:
        result[name] = {part: _summary(*acc[name][part]) for part in ("text", "audio")}
        result[name]["int8_projections"] = len(int8_names(models[name]))
        for part in ("text", "audio"):
            s = result[name][part]
            shown = "text" if part == "text" else "cb0"
            print(
                f"agreement {name:>15} {result['lm_weights_gib'][name]:>7.3f} {shown:>6} {s['kl_mean']:>9.2e} "
                f"{s['kl_p99']:>9.2e} {100 * s['top1_agreement']:>8.2f} {s['logit_rel_err_mean']:>9.2e} "
                f"{s['logit_rel_err_max']:>9.2e}"
            )
    a, b = result["text_head_int8"]["text"], result["text_head_float"]["text"]
    extra = result["lm_weights_gib"]["text_head_float"] - result["lm_weights_gib"]["text_head_int8"]
    print(
        f"agreement text head switch ({frames} frames x {rows} rows): int8 head text KL {a['kl_mean']:.2e}, top-1 "
        f"{100 * a['top1_agreement']:.2f} %; float head KL {b['kl_mean']:.2e}, top-1 {100 * b['top1_agreement']:.2f} "
        f"% (+{1024 * extra:.1f} MiB of weights)"
    )
    return result


# ------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset",
        choices=sorted(AGREEMENT_LMS),
        help="LM (default: moshi-7b on CUDA, demo on a CPU; mid: bench/common.py's MID_LM, agreement only)",
    )
    parser.add_argument("--device", help="default: cuda when there is one, else cpu")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument(
        "--gpu-memory",
        nargs="+",
        metavar="SIZE",
        help=f"memory sizes to size for (default: the live CUDA device's; on a CPU {' '.join(CARD_24GB)})",
    )
    parser.add_argument("--repeats", type=int, default=100, help="calls per timing (kernel)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="batches timed (steps)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per batch (steps)")
    parser.add_argument(
        "--w8a16-kernels",
        nargs="+",
        choices=W8A16_KERNELS,
        default=list(W8A16_KERNELS),
        help="the W8A16 kernels timed (kernel) and stepped with (steps; the first one only on a CPU, where the "
        "torch reference runs); the first is the one `int8` and `ratio` report",
    )
    add_kv_dtype(parser, default="bf16")
    parser.add_argument("--frames", type=int, default=300, help="teacher-forced frames (agreement)")
    parser.add_argument("--rows", type=int, default=4, help="sessions compared at once (agreement)")
    parser.add_argument("--sharpen", type=float, default=3.0, help="q and k projections scaled by this (agreement)")
    parser.add_argument("--out", type=Path, help="write weights_dtype.json here")
    args = parser.parse_args(argv)
    if min(args.frames, args.rows, args.steps, args.repeats, *args.batches) < 1:
        parser.error("--frames, --rows, --steps, --repeats and --batches must be >= 1")
    if args.sharpen <= 0:
        parser.error("--sharpen must be > 0")
    args.w8a16_kernels = tuple(dict.fromkeys(args.w8a16_kernels))
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.preset = args.preset or ("moshi-7b" if args.device.startswith("cuda") else "demo")
    if args.preset not in PRESETS and "steps" in args.stages and args.device.startswith("cuda"):
        parser.error(f"--preset {args.preset}: the steps stage needs a served preset ({', '.join(sorted(PRESETS))})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cuda_missing(args.device, "weights_dtype", "try --preset demo --device cpu"):
        return 0
    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)  # as bench/kv_dtype.py: torch work beside an engine's loop thread stays single
    torch.set_grad_enabled(False)
    dtype = torch.bfloat16 if cuda else torch.float32
    stages = [s for s in STAGES if s in args.stages]
    report: dict = {
        "bench": "weights_dtype",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(args.device) if cuda else "cpu",
        "preset": args.preset,
        "dtype": str(dtype).removeprefix("torch."),
        "stages": stages,
        "skipped": {},
    }
    started = time.perf_counter()

    def save(partial: bool) -> None:
        report.pop("seconds", None)
        report["seconds"] = round(time.perf_counter() - started, 1)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            shown = {**report, "partial": True} if partial else report
            (args.out / "weights_dtype.json").write_text(json.dumps(shown, indent=2) + "\n")

    failed = False
    for stage in stages:
        if stage in CUDA_ONLY and not cuda:
            report["skipped"][stage] = "needs CUDA"
            print(f"{stage}: skipped (needs CUDA; this run is on {args.device})")
            continue
        if stage == "capacity":
            sizes: list[str | None] = list(args.gpu_memory or ([None] if cuda else []))
            report["capacity"] = capacities([*sizes, *CARD_24GB], args.device)
        elif stage == "kernel":
            report["kernel"] = kernel_table(args.device, args.repeats, kernels=args.w8a16_kernels)
            failed |= not report["kernel"]["ok"]
        elif stage == "steps":
            report["steps"] = step_times(
                args.preset, args.kv_dtype, args.batches, args.steps, args.device, dtype, args.w8a16_kernels
            )
        elif stage == "agreement":
            lm = draw_random_(build_lm(AGREEMENT_LMS[args.preset], args.device, dtype), seed=0)  # random_models' LM
            report["agreement"] = agreement(sharpened(lm, args.sharpen), args.frames, args.rows)
            report["agreement"]["sharpen"] = args.sharpen
            del lm
            _free(args.device)
        save(partial=True)
    report["ok"] = not failed
    save(partial=False)  # "seconds" last
    print(json.dumps(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
