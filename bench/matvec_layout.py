"""Why duplexd stores projection weights as [in, out]: decode-step matmuls in both layouts, side by side.

Usage: python bench/matvec_layout.py [--threads 2] [--mbytes 200]
Each shape is a list of distinct matrices totalling about --mbytes, so the weights stream from memory as in a
real decode step. Last line: one JSON object with the speedups of `x @ w` ([in, out]) over `F.linear(x, w)`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(32000, 1024), (5632, 1024), (3072, 1024), (1536, 512)]  # (out, in): head, MLP in, QKV, DepFormer QKV


def _median_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mbytes", type=float, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result: dict[str, object] = {"bench": "matvec_layout"}
    print(f"{'out x in':>12} {'batch':>5} {'F.linear GB/s':>14} {'x @ w GB/s':>11} {'speedup':>8}")
    for out_f, in_f in SHAPES:
        count = max(1, int(args.mbytes * 1e6 / (out_f * in_f * 4)))
        weights = [torch.randn(out_f, in_f) for _ in range(count)]
        transposed = [w.t().contiguous() for w in weights]
        gbytes = count * out_f * in_f * 4 / 1e9
        for batch in (1, 4):
            x = torch.randn(batch, in_f)
            linear = _median_ms(lambda: [F.linear(x, w) for w in weights])  # noqa: B023
            matmul = _median_ms(lambda: [x @ w for w in transposed])  # noqa: B023
            print(f"{out_f:>6}x{in_f:<5} {batch:>5} {gbytes / linear * 1e3:>14.1f} {gbytes / matmul * 1e3:>11.1f} "
                  f"{linear / matmul:>8.2f}")
            result[f"speedup_{out_f}x{in_f}_b{batch}"] = round(linear / matmul, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
