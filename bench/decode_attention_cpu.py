"""CPU paged decode attention: the per-position-gather reference against the whole-page-gather + SDPA path.

Usage: python bench/decode_attention_cpu.py [--reps 10] [--threads 2] [--kv-dtype bf16|int8|fp8]
Rows at position 2999 of a 3000-frame window in pages of 64 frames handed out in random order (the engine's
pool). With an 8-bit `--kv-dtype`, the torch path over the same keys and values quantized (codes and scales) is
timed too, against the fp32 pool. Prints a table and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import add_kv_dtype  # noqa: E402
from duplexd.engine.kv.dtypes import quantized, storage_dtype  # noqa: E402
from duplexd.kernels.decode_attention import decode_attention_reference, decode_attention_torch  # noqa: E402
from duplexd.kernels.kv_quant import quantize_reference  # noqa: E402

SHAPES = [(1, 8, 64), (8, 4, 32), (8, 8, 64)]  # (rows, heads, head dim)
CONTEXT, PAGE = 3000, 64


def _ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1000 * (time.perf_counter() - started) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    add_kv_dtype(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    eight_bit = quantized(args.kv_dtype)
    extra = f" {args.kv_dtype + ' ms':>9} {'vs fp32':>7}" if eight_bit else ""
    print(f"{'rows':>4} {'heads':>5} {'dim':>4} {'reference ms':>13} {'torch path ms':>14} {'ratio':>6}{extra}")
    result: dict[str, object] = {"bench": "decode_attention_cpu", "kv_dtype": args.kv_dtype}
    for rows, heads, dim in SHAPES:
        pages = rows * -(-CONTEXT // PAGE)
        g = torch.Generator().manual_seed(rows * heads)
        k, v = (torch.randn(pages + 1, PAGE, heads, dim, generator=g) for _ in range(2))
        table = torch.randperm(pages, generator=g).view(rows, -1).to(torch.int32)
        lengths, q = torch.full((rows,), CONTEXT, dtype=torch.int32), torch.randn(rows, heads, dim, generator=g)
        inputs = (q, k, v, table, lengths, CONTEXT)
        torch.testing.assert_close(decode_attention_torch(*inputs), decode_attention_reference(*inputs))
        ref = _ms(lambda: decode_attention_reference(*inputs), args.reps)  # noqa: B023 - called right here
        fast = _ms(lambda: decode_attention_torch(*inputs), args.reps)  # noqa: B023
        cells = ""
        if eight_bit:
            (kc, ks), (vc, vs) = (quantize_reference(x, storage_dtype(args.kv_dtype, x.dtype)) for x in (k, v))
            low = _ms(lambda: decode_attention_torch(q, kc, vc, table, lengths, CONTEXT, None, ks, vs), args.reps)  # noqa: B023
            cells = f" {low:>9.2f} {low / fast:>7.3f}"
            result[f"{args.kv_dtype}_vs_fp32_b{rows}_h{heads}_d{dim}"] = round(low / fast, 3)
        print(f"{rows:>4} {heads:>5} {dim:>4} {ref:>13.2f} {fast:>14.2f} {fast / ref:>6.3f}{cells}")
        result[f"ratio_b{rows}_h{heads}_d{dim}"] = round(fast / ref, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
