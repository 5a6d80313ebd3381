"""Real-time sessions per GPU: per-step time of the whole engine as the batch grows, up to what the KV pool admits.

Usage: python bench/gpu_capacity.py [--batches 1 8 32 48 64 72 80] [--steps 200] [--position 2999]
           [--granularity 4] [--budget-ms 80] [--session-frames N] [--kv-memory BYTES] [--max-sessions N]
           [--preset moshi-7b] [--device cuda] [--kv-dtype bf16|int8|fp8] [--attention-kernel split|paged]
           [--out DIR]   (CUDA defaults shown)

The preset's LM with random weights drawn on the device (bf16 on CUDA, as `duplexd serve --random-weights`) and
its Mimi (fp32) run in one `Engine` with CUDA graphs. The KV pool is sized by the engine's own rule (what
`duplexd serve` gets with the same `--kv-memory` and session length), and there is a graph bucket for every batch
size measured, so a batch of B steps at bucket B, as a server with B slots does when full.

For each batch size B: B sessions are opened, moved to `--position` (by default the last position of a full
3000-frame window, so attention reads a whole window as in a long conversation; the cached keys are zeros, which
cost the same), and fed `--steps` timed frames each. The engine's own step records (`StepRecord.seconds`: Mimi
encode, temporal step, DepFormer, Mimi decode and the host copies around them) give p50/p99. The grid runs upward
until a batch misses the budget (p99 step <= 80 ms, one frame) or does not fit; then bisection between the
largest batch that met it and the smallest that did not (or one past what the KV pool admits) finds the capacity,
to within `--granularity` sessions (exactly, where the pool is the limit).

A batch whose steps failed (a session ended by the engine, outputs missing, a timeout, slots or pages not given
back) fails the run: exit status 1, the reason printed, no capacity claimed. Prints a table, the headline and the
batch-1 step time, and as its last line one JSON object; `--out DIR` also writes gpu_capacity.json and
gpu_capacity.md there. `--preset demo --device cpu` runs the same script on a CPU as a dry run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import add_kv_dtype, cuda_missing  # noqa: E402
from duplexd.engine.dialogue.engine import (  # noqa: E402
    Engine,
    EngineConfig,
    EngineStats,
    StepRecord,
    sessions_that_fit,
)
from duplexd.engine.dialogue.sampling import SamplingParams  # noqa: E402
from duplexd.engine.errors import CapacityError, SessionClosed  # noqa: E402
from duplexd.engine.models.config import PRESETS
from duplexd.engine.models.lm import LMModel  # noqa: E402
from duplexd.engine.models.mimi import MimiModel  # noqa: E402
from duplexd.kernels.decode_attention import ATTENTION_KERNELS  # noqa: E402

FRAME_MS = 80.0
WARM_STEPS = 3  # full-batch steps after the seek that are not timed (first reads of the whole window)
EXTRA_FRAMES = 2  # frames per session beyond the timed ones: the first session queued runs one step ahead
MIN_P99_SAMPLES = 200  # below this a p99 is little more than the maximum, and the output says so
CPU_STEPS = 30  # the CPU dry run's default: quick, and its p99 is said to be little more than the maximum
OK, NO_FIT, FAILED = "ok", "does not fit", "FAILED"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class BatchResult:
    """One batch size: its step times (ms), or why it was not measured (did not fit) or failed."""

    batch: int
    status: str
    samples_ms: list[float] = field(default_factory=list)
    bucket: int | None = None
    error: str = ""

    def stat(self, q: float) -> float:
        """The q-th percentile of the step times; a batch with none has no statistic (ValueError)."""
        return percentile(self.samples_ms, q)

    def meets(self, budget_ms: float) -> bool:
        return self.status == OK and bool(self.samples_ms) and self.stat(99) <= budget_ms

    def to_dict(self, budget_ms: float) -> dict:
        out: dict[str, object] = {
            "batch": self.batch,
            "status": self.status,
            "bucket": self.bucket,
            "samples": len(self.samples_ms),
        }
        if self.samples_ms:
            p50 = self.stat(50)
            out.update({f"p{q}_ms": round(self.stat(q), 3) for q in (50, 90, 99)})
            out.update(
                {
                    "max_ms": round(max(self.samples_ms), 3),
                    "mean_ms": round(sum(self.samples_ms) / len(self.samples_ms), 3),
                    "session_frames_per_s": round(1000 * self.batch / p50, 1),
                    "meets_budget": self.meets(budget_ms),
                }
            )
        if self.error:
            out["error"] = self.error
        return out


@dataclass
class Sweep:
    """Every batch measured, in the order run, and the capacity (None when a batch failed)."""

    results: list[BatchResult]
    capacity: int | None
    failed: BatchResult | None = None

    def result(self, batch: int) -> BatchResult | None:
        return next((r for r in self.results if r.batch == batch), None)


def find_capacity(
    measure: Callable[[int], BatchResult], grid: Sequence[int], limit: int, budget_ms: float, granularity: int = 1
) -> Sweep:
    """Largest batch whose p99 step meets `budget_ms`: the grid upward until a batch misses or does not fit, then
    bisection between the largest that met it and the smallest that did not (or `limit` + 1: the KV pool admits
    `limit`), over multiples of `granularity` and `limit` itself. Assumes step time grows with the batch. Stops
    at the first failed batch: then there is no capacity to claim."""
    results: list[BatchResult] = []

    def passes(batch: int) -> bool | None:
        if batch > limit:
            result = BatchResult(batch, NO_FIT, error=f"the KV pool admits {limit} sessions")
        else:
            result = measure(batch)
        results.append(result)
        return None if result.status == FAILED else result.meets(budget_ms)

    best, above = 0, limit + 1
    for batch in sorted(set(grid)):
        ok = passes(batch)
        if ok is None:
            return Sweep(results, None, results[-1])
        if not ok:
            above = min(batch, above)
            break
        best = batch
    candidates = [b for b in range(best + 1, above) if b % granularity == 0 or b == limit]
    while candidates:
        batch = candidates[len(candidates) // 2]
        ok = passes(batch)
        if ok is None:
            return Sweep(results, None, results[-1])
        if ok:
            best = batch
            candidates = [b for b in candidates if b > batch]
        else:
            candidates = [b for b in candidates if b < batch]
    return Sweep(results, best)


# ------------------------------------------------------------------------------------------------ the engine side


class _Gate:
    """Holds the engine's loop thread after its next step until opened, so that every session's frames are queued
    before the timed steps: otherwise the first sessions to get frames run ahead in partial batches."""

    def __init__(self, timeout: float) -> None:
        self._opened = threading.Event()
        self._timeout = timeout

    def __call__(self, record: StepRecord) -> None:
        self._opened.wait(self._timeout)

    def open(self) -> None:
        self._opened.set()


def _released(engine: Engine, before: EngineStats, timeout: float) -> str:
    """Wait until the engine holds no more sessions and pages than `before`; the problem in words, or ""."""
    deadline = time.monotonic() + timeout
    while True:
        now = engine.stats()
        if now.active_sessions <= before.active_sessions and now.kv_pages_used <= before.kv_pages_used:
            return ""
        if time.monotonic() > deadline:
            return (
                f"slots or KV pages not given back within {timeout:g} s: {now.active_sessions} sessions and "
                f"{now.kv_pages_used} pages in use, {before.active_sessions} and {before.kv_pages_used} before"
            )
        time.sleep(0.005)


def _drive(engine: Engine, sessions: list, steps: int, position: int, timeout: float, records: list[StepRecord]) -> str:
    """Warm-up frame, seek to `position`, then the timed frames; "" when every output came back, else why not."""
    frame = np.zeros(engine.frame_size, np.float32)
    for s in sessions:  # the first frame resets each slot on the loop thread and only fills the acoustic delay
        s.push(frame)
    deadline = time.monotonic() + timeout
    while not all(s.steps >= 1 or s.closed for s in sessions):
        if time.monotonic() > deadline:
            return f"the first frame was not stepped within {timeout:g} s"
        time.sleep(0.002)
    if ended := [s for s in sessions if s.closed]:
        return f"{len(ended)} sessions ended on their first frame ({ended[0].close_reason})"
    with engine.scheduler.lock:  # nothing queued, so the loop is idle: jump every slot to a long-conversation position
        for s in sessions:
            engine.pipeline.seek(s.slot, position)
    frames = steps + WARM_STEPS + EXTRA_FRAMES
    gate = _Gate(timeout)
    stop_records, stop_gate = engine.on_step(records.append), engine.on_step(gate)
    try:
        pcm = np.zeros(frames * engine.frame_size, np.float32)
        try:
            for s in sessions:
                if dropped := s.push(pcm):
                    return f"{dropped} input frames dropped at a full inbox"
        except SessionClosed as e:
            return str(e)
        finally:
            gate.open()
        for s in sessions:
            for index in range(frames):
                try:
                    out = s.get(timeout=timeout)
                except TimeoutError:
                    return f"slot {s.slot}: no output for frame {index + 1} of {frames} within {timeout:g} s"
                if out is None:
                    return f"slot {s.slot} ended after {index} of {frames} outputs ({s.close_reason})"
    finally:
        stop_gate()
        stop_records()
    return ""


def measure(engine: Engine, batch: int, steps: int, position: int, timeout: float = 120.0) -> BatchResult:
    """`steps` timed steps of `batch` sessions. Every session opened is closed again and the run waits until the
    engine has its slots and pages back, whatever happened (refused at admission, failed, timed out)."""
    before = engine.stats()
    sessions: list = []
    records: list[StepRecord] = []
    result: BatchResult
    try:
        try:
            for i in range(batch):
                sessions.append(engine.open_session(SamplingParams(seed=i)))
        except CapacityError as e:
            result = BatchResult(batch, NO_FIT, error=str(e))
        else:
            error = _drive(engine, sessions, steps, position, timeout, records)
            full = [r for r in records if r.batch_size == batch]
            if not error and len(full) < WARM_STEPS + steps:
                error = (
                    f"only {len(full)} steps of all {batch} sessions ({len(records) - len(full)} partial), "
                    f"{WARM_STEPS + steps} needed"
                )
            timed = full[WARM_STEPS : WARM_STEPS + steps]
            result = BatchResult(
                batch,
                FAILED if error else OK,
                [1000 * r.seconds for r in timed],
                timed[-1].bucket if timed else None,
                error,
            )
    finally:
        for s in sessions:
            s.close()
    if leaked := _released(engine, before, timeout):
        result = BatchResult(
            batch, FAILED, result.samples_ms, result.bucket, "; ".join(filter(None, [result.error, leaked]))
        )
    return result


def pool_sessions(lm: LMModel, mimi: MimiModel, config: EngineConfig) -> int:
    """The most slots (<= config.max_sessions) whose full-length sessions all fit the KV pool: the engine's own rule
    (`sessions_that_fit`, which `duplexd capacity` reports too)."""
    return sessions_that_fit(lm, mimi, config)


def buckets_for(grid: Sequence[int], limit: int, granularity: int) -> tuple[int, ...]:
    """A graph bucket for every batch the sweep may measure (grid, multiples of `granularity`, `limit`)."""
    sizes = {1, 2, 4, limit} | {b for b in grid if b <= limit} | set(range(granularity, limit + 1, granularity))
    return tuple(sorted(b for b in sizes if b <= limit))


# ------------------------------------------------------------------------------------------------ the report


def table(sweep: Sweep, budget_ms: float) -> str:
    head = [
        "batch",
        "bucket",
        "steps",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "max ms",
        "session-frames/s",
        f"p99 <= {budget_ms:g} ms",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * (len(head) - 1) + "---|"]
    for r in sorted(sweep.results, key=lambda r: r.batch):
        if r.samples_ms and r.status == OK:
            cells = [
                str(r.batch),
                str(r.bucket),
                str(len(r.samples_ms)),
                *(f"{r.stat(q):.2f}" for q in (50, 90, 99)),
                f"{max(r.samples_ms):.2f}",
                f"{1000 * r.batch / r.stat(50):.0f}",
                "yes" if r.meets(budget_ms) else "no",
            ]
        else:
            cells = [str(r.batch), "", "", "", "", "", "", "", f"{r.status}: {r.error}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def headline(sweep: Sweep, limit: int, budget_ms: float, granularity: int) -> list[str]:
    """The result in words: capacity and batch-1 step, or the failure (and then no capacity)."""
    if sweep.failed is not None:
        f = sweep.failed
        return [
            f"FAILED at batch {f.batch}: {f.error}",
            "no capacity is claimed: a batch whose steps fail is not real-time, whatever its step times",
        ]
    bound = (
        "the KV pool admits no more: memory, not step time, is the limit"
        if sweep.capacity == limit
        else f"the KV pool admits {limit}; bisected to within {granularity}"
    )
    lines = [
        f"capacity: {sweep.capacity} real-time sessions (largest batch with p99 step <= {budget_ms:g} ms, "
        f"Mimi + LM + host copies; {bound})"
    ]
    one = sweep.result(1)
    if one is not None and one.samples_ms:
        lines.append(f"batch-1 step: p50 {one.stat(50):.2f} ms, p99 {one.stat(99):.2f} ms")
    few = [r.batch for r in sweep.results if r.samples_ms and len(r.samples_ms) < MIN_P99_SAMPLES]
    if few:
        lines.append(
            f"note: fewer than {MIN_P99_SAMPLES} timed steps at batch {', '.join(map(str, few))}: each p99 "
            "there is little more than the maximum of its samples"
        )
    return lines


def summary(sweep: Sweep, meta: dict, budget_ms: float, finished: bool = True) -> dict:
    """The JSON report: the run's settings, every batch, capacity (null when failed or unfinished) and batch-1
    step. Written after every batch too (`finished` False), so a run cut short still leaves what it measured."""
    one = sweep.result(1)
    return {
        **meta,
        "status": "failed" if sweep.failed else "ok" if finished else "incomplete",
        "failed": sweep.failed.to_dict(budget_ms) if sweep.failed else None,
        "realtime_sessions": sweep.capacity,
        "batch1_p50_ms": round(one.stat(50), 3) if one and one.samples_ms else None,
        "batch1_p99_ms": round(one.stat(99), 3) if one and one.samples_ms else None,
        "batches": [r.to_dict(budget_ms) for r in sorted(sweep.results, key=lambda r: r.batch)],
    }


def write_report(out: Path, report: dict, markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_capacity.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "gpu_capacity.md").write_text(markdown + "\n")


def last_line(report: dict) -> str:
    """One flat JSON object (the form docs/BENCHMARKS.md quotes)."""
    flat = {
        k: report[k]
        for k in (
            "bench",
            "device",
            "preset",
            "kv_dtype",
            "attention_kernel",
            "status",
            "realtime_sessions",
            "kv_sessions",
            "batch1_p50_ms",
            "batch1_p99_ms",
        )
    }
    for b in report["batches"]:
        if "p50_ms" in b:
            flat[f"p50_ms_b{b['batch']}"], flat[f"p99_ms_b{b['batch']}"] = b["p50_ms"], b["p99_ms"]
    return json.dumps(flat)


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        help="grid, run upward before the bisection; 1 is always measured (default "
        "1 8 32 48 64 72 80 on CUDA, 1 2 4 on CPU)",
    )
    parser.add_argument(
        "--steps", type=int, help=f"timed steps per batch (default {MIN_P99_SAMPLES} on CUDA, {CPU_STEPS} on CPU)"
    )
    parser.add_argument("--position", type=int, default=2999, help="conversation position of every session")
    parser.add_argument("--granularity", type=int, default=4, help="bisect over multiples of this")
    parser.add_argument("--budget-ms", type=float, default=FRAME_MS, help="p99 step budget")
    parser.add_argument("--session-frames", type=int, default=None, help="cap session length (fewer KV pages)")
    parser.add_argument("--kv-memory", type=int, default=None, help="KV pool bytes (default: the engine's rule)")
    parser.add_argument(
        "--max-sessions",
        type=int,
        default=None,
        help="slots before the KV pool's limit (default 256 on CUDA, the largest grid batch on CPU)",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for any one output")
    parser.add_argument("--preset", default="moshi-7b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda")
    add_kv_dtype(parser)
    parser.add_argument(
        "--attention-kernel", choices=ATTENTION_KERNELS, default="split", help="the Triton decode attention (A/B)"
    )
    parser.add_argument("--out", type=Path, help="write gpu_capacity.json and gpu_capacity.md here")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.batches = args.batches or ([1, 8, 32, 48, 64, 72, 80] if cuda else [1, 2, 4])
    args.steps = args.steps or (MIN_P99_SAMPLES if cuda else CPU_STEPS)
    if args.steps < 1 or args.granularity < 1 or min(args.batches) < 1:
        parser.error("--steps, --granularity and --batches must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from duplexd.server.core.runtime import random_models

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cuda = args.device.startswith("cuda")
    if cuda_missing(args.device, "gpu_capacity", "try --preset demo --device cpu for a dry run"):
        return 0
    if not cuda:
        torch.set_num_threads(1)  # CPU dry run: torch work beside the engine's loop thread stays single-threaded
    grid = sorted({1, *args.batches})
    started = time.perf_counter()
    dtype = torch.bfloat16 if cuda else torch.float32
    lm, mimi = random_models(args.preset, args.device, dtype)
    frames = args.steps + WARM_STEPS + EXTRA_FRAMES
    base = EngineConfig(
        max_sessions=args.max_sessions or (256 if cuda else max(grid)),
        kv_memory=args.kv_memory,
        max_session_frames=args.session_frames,
        max_pending_frames=frames,
        max_output_frames=frames,
        device=args.device,
        kv_dtype=args.kv_dtype,
        attention_kernel=args.attention_kernel,
    )
    fit = pool_sessions(lm, mimi, base)
    buckets = buckets_for(grid, fit, args.granularity) if cuda else None
    engine = Engine(lm, mimi, config=dataclasses.replace(base, max_sessions=fit, buckets=buckets))
    engine.start()
    limit = engine.stats().admissible_sessions
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(
        f"models + warm-up: {time.perf_counter() - started:.0f} s; KV pool {engine.kv.num_pages} pages, "
        f"{limit} sessions fit; buckets {buckets}"
    )
    print(
        f"{args.preset} on {name}, position {args.position}, {args.steps} timed steps per batch, "
        f"p99 budget {args.budget_ms:g} ms"
    )

    meta = {
        "bench": "gpu_capacity",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": name,
        "preset": args.preset,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_dtype": args.kv_dtype,
        "attention_kernel": args.attention_kernel,
        "torch": torch.__version__,
        "position": args.position,
        "steps": args.steps,
        "budget_ms": args.budget_ms,
        "granularity": args.granularity,
        "grid": grid,
        "kv_sessions": limit,
        "kv_pages": engine.kv.num_pages,
        "session_frames": args.session_frames,
    }
    title = (
        f"{args.preset} on {name}, KV {args.kv_dtype}, attention {args.attention_kernel}, {meta['date']}: "
        f"step time (ms) at position {args.position}"
    )
    done: list[BatchResult] = []

    def run(batch: int) -> BatchResult:
        result = measure(engine, batch, args.steps, args.position, args.timeout)
        shown = (
            f"p50 {result.stat(50):.2f} ms, p99 {result.stat(99):.2f} ms"
            if result.status == OK
            else f"{result.status}: {result.error}"
        )
        print(f"batch {batch}: {shown}", flush=True)
        done.append(result)
        if args.out:
            partial = Sweep(done, None)
            write_report(
                args.out,
                summary(partial, meta, args.budget_ms, finished=False),
                "\n\n".join([title + " (unfinished)", table(partial, args.budget_ms)]),
            )
        return result

    try:
        sweep = find_capacity(run, grid, limit, args.budget_ms, args.granularity)
    finally:
        engine.stop()
    report = summary(sweep, meta, args.budget_ms)
    words = headline(sweep, limit, args.budget_ms, args.granularity)
    markdown = "\n\n".join([title, table(sweep, args.budget_ms), "\n".join(words)])
    if args.out:
        write_report(args.out, report, markdown)
    print(markdown)
    print(last_line(report))
    return 1 if sweep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
