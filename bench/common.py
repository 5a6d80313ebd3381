"""Pieces shared by the CPU benchmarks: moving reference weights into duplexd, and the side-by-side table."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file


def through_checkpoint(state_dict: dict[str, torch.Tensor], load: Callable[[Path], torch.nn.Module]):
    """Save a reference state dict as safetensors and load it with duplexd's loader (the real path)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.safetensors"
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path))
        return load(path)


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


def parse_args(doc: str) -> argparse.Namespace:
    """The common flags (--frames, --warmup, --threads); sets torch's thread count."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--frames", type=int, default=30, help="timed frames (after warm-up)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def median_ms(step: Callable[[object], object], inputs: Iterable, warmup: int) -> float:
    """Median wall time of `step(x)` over `inputs`, in ms, skipping the first `warmup` calls."""
    times = []
    for index, x in enumerate(inputs):
        started = time.perf_counter()
        step(x)
        if index >= warmup:
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)
