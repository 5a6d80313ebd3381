"""Why duplexd stores projection weights as [in, out] and batches go through `kernels.cpu_matmul`.

Usage: python bench/matvec_layout.py [--threads 2] [--mbytes 200] [--repeats 20]
Each shape is a list of distinct matrices totalling about --mbytes, so the weights stream from memory as in a
real decode step. Columns: `F.linear(x, w)` (w [out, in]), `x @ w` (w [in, out]) and `cpu_matmul.matmul(x, w)`
(oneDNN-packed weights for 2..64 rows). Last line: one JSON object with the speedups over `F.linear`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from duplexd.kernels.cpu_matmul import matmul

SHAPES = [(32000, 1024), (5632, 1024), (3072, 1024), (1536, 512)]  # (out, in): head, MLP in, QKV, DepFormer QKV


def _median_ms(fn, repeats: int) -> float:
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
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per cell (median)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result: dict[str, object] = {"bench": "matvec_layout"}
    print(f"{'out x in':>12} {'batch':>5} {'F.linear GB/s':>14} {'x @ w GB/s':>11} {'cpu_matmul GB/s':>16}")
    for out_f, in_f in SHAPES:
        count = max(1, int(args.mbytes * 1e6 / (out_f * in_f * 4)))
        weights = [torch.randn(out_f, in_f) for _ in range(count)]
        transposed = [w.t().contiguous() for w in weights]
        gbytes = count * out_f * in_f * 4 / 1e9
        for batch in (1, 4, 8):
            x = torch.randn(batch, in_f)
            with torch.no_grad():
                linear = _median_ms(lambda: [F.linear(x, w) for w in weights], args.repeats)  # noqa: B023
                plain = _median_ms(lambda: [x @ w for w in transposed], args.repeats)  # noqa: B023
                packed = _median_ms(lambda: [matmul(x, w) for w in transposed], args.repeats)  # noqa: B023
            print(
                f"{out_f:>6}x{in_f:<5} {batch:>5} {gbytes / linear * 1e3:>14.1f} {gbytes / plain * 1e3:>11.1f} "
                f"{gbytes / packed * 1e3:>16.1f}"
            )
            result[f"x@w_speedup_{out_f}x{in_f}_b{batch}"] = round(linear / plain, 2)
            result[f"cpu_matmul_speedup_{out_f}x{in_f}_b{batch}"] = round(linear / packed, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
