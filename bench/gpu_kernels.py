"""Triton decode-step kernels against torch eager on an NVIDIA GPU, at Moshi 7B shapes.

Usage: python bench/gpu_kernels.py [--batches 1 8 32 128] [--lengths 1000 3000] [--reps 100]

For each kernel and shape: correctness against the torch reference first (a failed check is reported and the
timing skipped), then the median time of the Triton kernel and of torch eager, the bytes each call must move, the
achieved bytes/s and its ratio to a measured device-to-device copy bandwidth. Decode attention runs once per kernel
in `ATTENTION_KERNELS` (`decode_attention:<kernel>`, one eager timing for them all), over a bf16 pool and the
engine's int8 one (codes + an fp32 scale per key and head), and each other kernel's time over "split"'s
(`paged/split`: below 1 is faster). Prints a table and, as its last line, one JSON object. On a machine without
CUDA it says so and exits cleanly.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

DIM, HEADS, HEAD_DIM, HIDDEN, TEXT_CARD, CARD = 4096, 32, 128, 11264, 32000, 2048
PAGE_SIZE, WINDOW = 64, 3000  # the engine's page size and Moshi's attention window
BF16 = torch.bfloat16


def _bench_ms(fn: Callable[[], object], reps: int) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=max(reps // 4, 5), rep=reps, return_mode="median")


def copy_bandwidth(reps: int) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 29, dtype=BF16, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src), reps)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max())


def cases(batches: list[int], lengths: list[int], dev: str = "cuda"):
    """Yields (kernel, shape, bytes moved, triton fn, eager fn, check fn -> (ok, detail))."""
    from duplexd.kernels import rms_norm as rn
    from duplexd.kernels import rope, sampling, silu_gate

    for b in batches:
        x, r = torch.randn(b, DIM, device=dev, dtype=BF16), torch.randn(b, DIM, device=dev, dtype=BF16)
        alpha = torch.rand(DIM, device=dev, dtype=BF16) + 0.5
        yield (
            "rms_norm",
            f"B={b}",
            2 * x.numel() * 2,
            lambda x=x, a=alpha: rn.rms_norm_triton(x, a),
            lambda x=x, a=alpha: rn.rms_norm_reference(x, a),
            lambda x=x, a=alpha: _tol(rn.rms_norm_triton(x, a), rn.rms_norm_reference(x.float(), a.float()), 2e-2),
        )
        yield (
            "add_rms_norm",
            f"B={b}",
            4 * x.numel() * 2,
            lambda x=x, r=r, a=alpha: rn.rms_norm_triton(x, a, residual=r),
            lambda x=x, r=r, a=alpha: rn.add_rms_norm_reference(x, r, a),
            lambda x=x, r=r, a=alpha: _tol(
                rn.rms_norm_triton(x, a, residual=r)[0], rn.rms_norm_reference((r.float() + x.float()), a.float()), 5e-2
            ),
        )

        qkv = torch.randn(b, 3, HEADS, HEAD_DIM, device=dev, dtype=BF16)
        cos, sin = rope.rope_angles(torch.randint(0, 5000, (b,), device=dev), HEAD_DIM, 10_000.0)
        yield (
            "rope_qk",
            f"B={b}",
            4 * b * DIM * 2,
            lambda t=qkv, c=cos, s=sin: rope.rope_qk_triton(t[:, 0], t[:, 1], c, s),
            lambda t=qkv, c=cos, s=sin: rope.rope_qk_reference(t[:, 0], t[:, 1], c, s),
            lambda t=qkv, c=cos, s=sin: _tol(
                rope.rope_qk_triton(t[:, 0], t[:, 1], c, s)[0], rope.apply_rope(t[:, 0].float(), c, s), 3e-2
            ),
        )

        gv = torch.randn(b, 2 * HIDDEN, device=dev, dtype=BF16)
        yield (
            "silu_gate",
            f"B={b}",
            3 * b * HIDDEN * 2,
            lambda g=gv: silu_gate.silu_gate_triton(g),
            lambda g=gv: silu_gate.silu_gate_reference(g),
            lambda g=gv: _tol(silu_gate.silu_gate_triton(g), silu_gate.silu_gate_reference(g.float()), 3e-2),
        )

        # The engine's streams: 0 for the text token, 1 + step for the DepFormer's codebooks (1 is the value an
        # int argument is specialised on, so both must launch).
        for vocab, temp, k, stream in ((TEXT_CARD, 0.7, 25, 0), (CARD, 0.8, 250, 1)):
            logits = torch.randn(b, vocab, device=dev) * 3
            args = (
                logits,
                torch.full((b,), temp, device=dev),
                torch.full((b,), k, device=dev),
                torch.arange(b, device=dev),
                torch.full((b,), 17, device=dev),
                stream,
            )
            yield (
                f"sample V={vocab}",
                f"B={b} s={stream}",
                logits.numel() * 4,
                lambda a=args: sampling.sample_triton(*a),
                lambda a=args: sampling.sample_reference(*a),
                lambda a=args: _same(sampling.sample_triton(*a), sampling.sample_reference(*a)),
            )

        for length in lengths:
            yield from attention_cases(b, length, dev)


def attention_cases(b: int, length: int, dev: str):
    """`cases` of decode attention at `b` rows over `length` cached frames: each kernel in ATTENTION_KERNELS over a
    bf16 pool, then over that pool quantized to int8 (`kv_quant.quantize_reference`)."""
    from duplexd.kernels import decode_attention as da
    from duplexd.kernels.kv_quant import quantize_reference

    q = torch.randn(b, HEADS, HEAD_DIM, device=dev, dtype=BF16)
    pages_per_row = -(-WINDOW // PAGE_SIZE)  # the engine's table: a column per page of the window
    num_pages = b * pages_per_row
    kp = torch.randn(num_pages, PAGE_SIZE, HEADS, HEAD_DIM, device=dev, dtype=BF16)
    vp = torch.randn_like(kp)
    table = torch.randperm(num_pages, device=dev).view(b, pages_per_row).to(torch.int32)
    lens = torch.full((b,), length, device=dev)
    ks = vs = None
    for kv in ("bf16", "int8"):
        if kv == "int8":
            (kp, ks), (vp, vs) = quantize_reference(kp, torch.int8), quantize_reference(vp, torch.int8)
            want = da.decode_attention_reference(q.float(), kp, vp, table, lens, WINDOW, None, ks, vs)
        else:
            want = da.decode_attention_reference(q.float(), kp.float(), vp.float(), table, lens, WINDOW)
        call = (q, kp, vp, table, lens, WINDOW, None, ks, vs)  # scale None: head_dim ** -0.5
        per_key = HEAD_DIM * kp.element_size() + (4 if ks is not None else 0)  # codes (and their scale), K and V
        for kernel in da.ATTENTION_KERNELS:
            attend = functools.partial(da.decode_attention, *call, kernel=kernel)
            yield (
                f"decode_attention:{kernel}",
                f"B={b} L={length} {kv}",
                2 * b * length * HEADS * per_key + 2 * b * DIM * 2,
                attend,
                functools.partial(da.decode_attention_reference, *call),
                lambda a=attend, w=want: _tol(a(), w, 2e-2),
            )


def _tol(got: torch.Tensor, want: torch.Tensor, tol: float) -> tuple[bool, str]:
    err = _max_err(got, want) / max(float(want.float().abs().max()), 1.0)
    return err <= tol and bool(torch.isfinite(got).all()), f"rel err {err:.1e}"


def _same(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
    agree = float((got == want).float().mean())
    return agree >= 0.99, f"{100 * agree:.1f}% same tokens"  # near-ties in the fp32 scores may flip a few


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 3000])
    parser.add_argument("--reps", type=int, default=100, help="timing window per measurement, ms (do_bench rep)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_kernels.py needs an NVIDIA GPU (CUDA); none is available here, nothing was measured.")
        print(json.dumps({"bench": "gpu_kernels", "skipped": "no CUDA device"}))
        return 0

    torch.manual_seed(0)
    copy_bw = copy_bandwidth(args.reps)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print(
        f"{'kernel':<22} {'shape':<17} {'check':<22} {'triton us':>10} {'eager us':>10} {'speedup':>8} "
        f"{'GB/s':>7} {'of copy':>8} {'paged/split':>11}"
    )
    rows = []
    eager_ms: dict[tuple[str, str], float] = {}  # one eager timing per kernel and shape, whichever implementation
    split_ms: dict[str, float] = {}  # decode attention's "split" time per shape
    paged_over_split: dict[str, float] = {}
    for name, shape, moved, triton_fn, eager_fn, check in cases(args.batches, args.lengths):
        ok, detail = check()
        row = {"kernel": name, "shape": shape, "ok": ok, "check": detail, "bytes": moved}
        base, _, impl = name.partition(":")
        if ok:
            t_ms = _bench_ms(triton_fn, args.reps)
            if (base, shape) not in eager_ms:
                eager_ms[base, shape] = _bench_ms(eager_fn, args.reps)
            e_ms = eager_ms[base, shape]
            bw = moved / (t_ms * 1e-3)
            row.update(
                triton_us=round(1e3 * t_ms, 2),
                eager_us=round(1e3 * e_ms, 2),
                speedup=round(e_ms / t_ms, 2),
                gbps=round(bw / 1e9, 1),
                of_copy=round(bw / copy_bw, 3),
            )
            if impl == "split":
                split_ms[shape] = t_ms
            if impl == "paged" and shape in split_ms:
                row["paged/split"] = paged_over_split[shape] = round(t_ms / split_ms[shape], 3)
            print(
                f"{name:<22} {shape:<17} {detail:<22} {1e3 * t_ms:>10.1f} {1e3 * e_ms:>10.1f} "
                f"{e_ms / t_ms:>8.2f} {bw / 1e9:>7.0f} {bw / copy_bw:>8.2f} {row.get('paged/split', ''):>11}"
            )
        else:
            print(f"{name:<22} {shape:<17} FAILED {detail}")
        rows.append(row)
        torch.cuda.empty_cache()
    print(
        json.dumps(
            {
                "bench": "gpu_kernels",
                "device": torch.cuda.get_device_name(),
                "copy_gbps": round(copy_bw / 1e9, 1),
                "paged/split": paged_over_split,
                "rows": rows,
            }
        )
    )
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
