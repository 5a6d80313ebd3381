"""Pieces shared by the benchmarks: moving reference weights into duplexd, interleaved timing, the side-by-side
table, and what the 8-bit comparisons share (a sharpened random LM, the per-row relative error)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from safetensors.torch import save_file

from duplexd.engine.kv.dtypes import KV_DTYPES
from duplexd.engine.models.config import LMConfig
from duplexd.engine.models.lm import LMModel

T = TypeVar("T")

# Mid-size LM: d_model 1024 × 8 layers, DepFormer 512 × 2 layers, real vocabularies and context.
MID_LM = LMConfig(
    dim=1024,
    num_heads=16,
    num_layers=8,
    depformer_dim=512,
    depformer_dim_feedforward=int(4.125 * 512),
    depformer_num_heads=8,
    depformer_num_layers=2,
)


def through_checkpoint(state_dict: dict[str, torch.Tensor], load: Callable[[Path], torch.nn.Module]):
    """Save a reference state dict as safetensors and load it with duplexd's loader (the real path)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.safetensors"
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path))
        return load(path)


def add_kv_dtype(parser: argparse.ArgumentParser, default: str = "bf16") -> None:
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default=default, help="KV cache format (bf16: the LM's dtype)")


def cuda_missing(device: str, bench: str, hint: str) -> bool:
    """True when `device` is CUDA and there is none; says so (the JSON line last, as every bench ends), so a GPU
    bench started on the wrong machine exits 0 with a reason rather than a traceback."""
    if not device.startswith("cuda") or torch.cuda.is_available():
        return False
    print(f"no CUDA device: nothing to measure ({hint})")
    print(json.dumps({"bench": bench, "skipped": "no CUDA device"}))
    return True


def side_by_side(run: Callable[[int], tuple[float, float]], result: dict, batches=(1, 4)) -> None:
    """Print duplexd vs reference ms per batch size; add `duplexd_ms_bN`, `reference_ms_bN`, `ratio_bN`."""
    print(f"{'batch':>5} {'duplexd ms':>11} {'reference ms':>13} {'ratio':>7}")
    for batch in batches:
        dx_ms, ref_ms = run(batch)
        ratio = dx_ms / ref_ms
        print(f"{batch:>5} {dx_ms:>11.2f} {ref_ms:>13.2f} {ratio:>7.3f}")
        result.update(
            {
                f"duplexd_ms_b{batch}": round(dx_ms, 3),
                f"reference_ms_b{batch}": round(ref_ms, 3),
                f"ratio_b{batch}": round(ratio, 3),
            }
        )


def parse_args(doc: str, kv_dtype: bool = False, small: bool = False) -> argparse.Namespace:
    """The common flags (--frames, --warmup, --threads; --kv-dtype for a bench that runs the LM's KV cache, --small
    for one that can run the demo model's sizes instead, as its smoke run does); sets torch's thread count."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--frames", type=int, default=30, help="timed frames (after warm-up)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    if kv_dtype:
        add_kv_dtype(parser)
    if small:
        parser.add_argument("--small", action="store_true", help="the demo model's sizes (a smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def median_ms(step: Callable[[T], object], inputs: Iterable[T], warmup: int) -> float:
    """Median wall time of `step(x)` over `inputs`, in ms, skipping the first `warmup` calls."""
    times = []
    for index, x in enumerate(inputs):
        started = time.perf_counter()
        step(x)
        if index >= warmup:
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def interleaved(runs: Sequence[Callable[[], T]], iters: int, warmup: int = 1) -> list[list[T]]:
    """Each run's results over `iters` rounds, the runs interleaved (a, b, a, b, ...) after `warmup` untimed rounds,
    so a burst of load from elsewhere on the machine hits every side alike. A run that returns its own elapsed
    time can keep its set-up off the clock."""
    for _ in range(warmup):
        for run in runs:
            run()
    results: list[list[T]] = [[] for _ in runs]
    for _ in range(iters):
        for run, acc in zip(runs, results, strict=True):
            acc.append(run())
    return results


def clocked(fn: Callable[[], object]) -> Callable[[], float]:
    """`fn` as a run that returns its wall time in seconds."""

    def run() -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    return run


def timed_pair(fn_a: Callable[[], object], fn_b: Callable[[], object], iters: int) -> tuple[float, float]:
    """Median wall times (s) of `iters` calls of each function, interleaved, after one warm-up call each."""
    a, b = interleaved([clocked(fn_a), clocked(fn_b)], iters)
    return statistics.median(a), statistics.median(b)


def sharpened(lm: LMModel, factor: float) -> LMModel:
    """q and k projections of every (float) temporal layer times `factor`: scores `factor`² sharper (random weights
    attend almost uniformly, which would average a quantization error away)."""
    dim = lm.cfg.dim
    for layer in lm.layers:
        layer.wqkv[:, : 2 * dim].mul_(factor)  # type: ignore[index]
    return lm


def relative_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row (the first dim): ||a - b|| / ||b||."""
    return (a - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1).clamp_min(1e-30)


def on_own_thread(fn: Callable[..., T], *args: object, threads: int) -> T:
    """`fn(*args)` on a fresh thread with `threads` intra-op threads (its OpenMP pool goes with it); what it raises is
    raised here, so a failed reference run fails the bench with its own error."""
    result: list[T] = []
    error: list[BaseException] = []

    def body() -> None:
        torch.set_num_threads(threads)
        try:
            result.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            error.append(e)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def tone_with_noise(samples: int, sample_rate: int, seed: int) -> np.ndarray:
    """A session's stand-in speech: a tone of its own pitch (140 + 10 * seed Hz) under a little noise."""
    t = np.arange(samples) / sample_rate
    noise = np.random.default_rng(seed).standard_normal(len(t))
    return (0.2 * np.sin(2 * np.pi * (140 + 10 * seed) * t) + 0.02 * noise).astype(np.float32)
