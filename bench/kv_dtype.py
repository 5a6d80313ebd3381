"""An 8-bit KV cache against the weights' dtype: sessions that fit, step time, and teacher-forced logit agreement.

Usage: python bench/kv_dtype.py [--preset moshi-7b] [--device cuda] [--kv-dtype int8] [--stages capacity write
           agreement steps] [--frames 3100] [--rows 4] [--sharpen 3] [--batches 1 64 128] [--steps 100] [--out DIR]

1. capacity: `duplexd capacity`'s answer (the server's own sizing) for bf16 and `--kv-dtype`, on this device's
   free memory (on a CPU: for `--gpu-memory`, default 139GiB).
2. write (CUDA only): the Triton quantize-and-store kernel against the torch reference, bit for bit, for int8 and
   fp8 (the CPU's Triton interpreter encodes fp8 wrongly, so only a GPU can check the fp8 store).
3. agreement: one LM with random weights whose q and k projections are scaled by `--sharpen` (random weights
   attend almost uniformly, which would average the KV error away), two KV pools, `--rows` sessions fed the same
   tokens frame after frame for `--frames` frames (past a 3000-frame window): the weights' dtype pool's greedy
   text token and random audio codes (teacher-forced, so one early difference does not make every later frame
   differ). Per frame: KL(reference || 8-bit) of the text distribution, top-1 (greedy token) agreement, relative
   L2 error of the logits and of every layer's attention output.
4. steps: an `Engine` per format, sized by the engine's rule, every session at position 2999 (a full window):
   p50/p99 step time at each of `--batches` (bench/gpu_capacity.py's `measure`), or "does not fit".

Prints a table per stage; the last line is one JSON object (`--out DIR` also writes kv_dtype.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import add_kv_dtype, cuda_missing, relative_error, sharpened  # noqa: E402
from bench.gpu_capacity import OK, measure  # noqa: E402
from duplexd.commands.capacity import PRESET_MIMI, capacity, parse_size  # noqa: E402
from duplexd.engine.dialogue.engine import Engine, EngineConfig, sessions_that_fit  # noqa: E402
from duplexd.engine.kv.paged import PagedKVCache, window_pages  # noqa: E402
from duplexd.engine.models.config import PRESETS  # noqa: E402
from duplexd.engine.models.lm import LMModel  # noqa: E402
from duplexd.kernels.kv_quant import store_quantized_reference, store_quantized_triton  # noqa: E402

STAGES = ("capacity", "write", "agreement", "steps")
POSITION = 2999
PAGE = 64


def capacities(preset: str, kv_dtype: str, dtype: torch.dtype, memory: int | None, device: str) -> dict:
    cfg, mimi = PRESETS[preset], PRESET_MIMI[preset]
    out = {}
    for kv in dict.fromkeys(("bf16", kv_dtype)):
        # A given memory size is a GPU's: its sizing rule (a CPU device sets no memory bound at all).
        result = capacity(preset, cfg, mimi, kv, dtype, memory, device="cuda" if memory is not None else device)
        out[kv] = {"sessions": result.sessions, "kv_window_gib": round(result.kv_window / 2**30, 3)}
        print(f"capacity {kv}: {result.sessions} full windows ({result.kv_window / 2**30:.3f} GiB each)")
    return out


def write_check(device: str, rows: int = 128, heads: int = 32, dim: int = 128) -> dict:
    """Codes and scales the Triton store writes against the torch reference's, at Moshi 7B's shapes."""
    out = {}
    g = torch.Generator(device=device).manual_seed(0)
    k, v = (torch.randn(rows, heads, dim, generator=g, device=device) * 4 for _ in range(2))
    k[0, 0] = 0.0
    page = torch.randperm(rows, device=device)
    offset = torch.arange(rows, device=device) % PAGE
    for kv, codes in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        pools = []
        stores: tuple[Callable[..., None], ...] = (store_quantized_triton, store_quantized_reference)
        for store in stores:
            pages = [torch.zeros(rows, PAGE, heads, dim, dtype=codes, device=device) for _ in range(2)]
            scales = [torch.zeros(rows, PAGE, heads, device=device) for _ in range(2)]
            store(k, v, *pages, *scales, page, offset)
            pools.append((pages, scales))
        (tp, ts), (rp, rs) = pools
        code_diff = sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) for a, b in zip(tp, rp, strict=True))
        scale_diff = sum(int((a != b).sum()) for a, b in zip(ts, rs, strict=True))
        out[kv] = {"codes_differing": code_diff, "scales_differing": scale_diff, "codes": 2 * rows * heads * dim}
        print(f"write {kv}: {code_diff} codes and {scale_diff} scales differ from the torch reference")
    return out


class _Recorded:
    """A pool whose `attend_rotary` (what the LM calls) keeps each layer's output of the last step (for the
    attention error)."""

    def __init__(self, pool: PagedKVCache) -> None:
        self.pool = pool
        self.outputs: dict[int, torch.Tensor] = {}
        attend = pool.attend_rotary

        def recording(layer, view, q, k, v, cos, sin):
            out = attend(layer, view, q, k, v, cos, sin)
            self.outputs[layer] = out.float()
            return out

        pool.attend_rotary = recording  # type: ignore[method-assign]


@torch.no_grad()
def agreement(lm: LMModel, kv_dtype: str, frames: int, rows: int, seed: int = 0) -> dict:
    """Teacher-forced comparison of the weights' dtype pool and `kv_dtype` (module docs, stage 3)."""
    cfg, device = lm.cfg, lm.text_emb.device
    pools = [
        _Recorded(lm.new_kv_cache(rows, rows * window_pages(cfg.context, PAGE), PAGE, kv)) for kv in ("bf16", kv_dtype)
    ]
    for recorded in pools:
        for slot in range(rows):
            recorded.pool.allocate(slot)
            recorded.pool.upload(slot)
    g = torch.Generator(device=device).manual_seed(seed)
    slots = torch.arange(rows, device=device)
    text = torch.full((rows,), cfg.text_initial_token_id, device=device)
    kl, top1, logit_err, attn_err = [], [], [], []
    for t in range(frames):
        audio = torch.randint(0, cfg.card, (rows, cfg.n_q), generator=g, device=device)
        tokens = torch.cat([text[:, None], audio], 1)
        positions = torch.full((rows,), t, device=device)
        logits = []
        for recorded in pools:
            _, out = lm.forward_text(tokens, positions, recorded.pool, recorded.pool.batch(slots, positions))
            logits.append(out.float())
        ref, low = logits
        logp_ref, logp_low = ref.log_softmax(-1), low.log_softmax(-1)
        kl.append((logp_ref.exp() * (logp_ref - logp_low)).sum(-1))
        top1.append((ref.argmax(-1) == low.argmax(-1)).float())
        logit_err.append(relative_error(low, ref))
        low_attn, ref_attn = pools[1].outputs, pools[0].outputs
        attn_err.append(torch.stack([relative_error(low_attn[i], ref_attn[i]) for i in range(cfg.num_layers)]).amax(0))
        text = ref.argmax(-1)  # the reference's greedy token, fed to both
    per_frame = {name: torch.stack(values).cpu() for name, values in (("kl", kl), ("top1", top1), ("logit", logit_err))}
    attn = torch.stack(attn_err).cpu()
    late = slice(min(cfg.context, frames - 1), frames)  # past the window
    result: dict[str, Any] = {
        "frames": frames,
        "rows": rows,
        "kl_mean": float(per_frame["kl"].mean()),
        "kl_p99": float(per_frame["kl"].flatten().quantile(0.99)),
        "top1_agreement": float(per_frame["top1"].mean()),
        "top1_agreement_past_window": float(per_frame["top1"][late].mean()) if frames > cfg.context else None,
        "logit_rel_err_mean": float(per_frame["logit"].mean()),
        "logit_rel_err_max": float(per_frame["logit"].max()),
        "attention_rel_err_mean": float(attn.mean()),
        "attention_rel_err_max": float(attn.max()),
    }
    print(
        f"agreement {kv_dtype} vs bf16 over {frames} frames x {rows} rows: KL mean {result['kl_mean']:.2e} "
        f"(p99 {result['kl_p99']:.2e}), top-1 {100 * result['top1_agreement']:.2f} %, logits rel. err. mean "
        f"{result['logit_rel_err_mean']:.2e} (max {result['logit_rel_err_max']:.2e}), attention output rel. err. "
        f"mean {result['attention_rel_err_mean']:.2e} (max {result['attention_rel_err_max']:.2e})"
    )
    return result


def step_times(lm, mimi, kv_dtype: str, batches: list[int], steps: int, device: str) -> dict:
    """p50/p99 step (ms) per batch for the weights' dtype pool and `kv_dtype`, one engine at a time."""
    out: dict[str, dict] = {}
    frames = steps + 8
    for kv in dict.fromkeys(("bf16", kv_dtype)):
        base = EngineConfig(
            max_sessions=max(batches),
            max_pending_frames=frames,
            max_output_frames=frames,
            device=device,
            kv_dtype=kv,
        )
        fit = sessions_that_fit(lm, mimi, base)
        runnable = [b for b in batches if b <= fit]
        rows = out[kv] = {"fit": fit}
        if runnable:
            buckets = tuple(sorted({*runnable, max(runnable)}))
            engine = Engine(lm, mimi, config=dataclasses.replace(base, max_sessions=max(runnable), buckets=buckets))
            engine.start()
            try:
                for batch in runnable:
                    r = measure(engine, batch, steps, POSITION)
                    rows[str(batch)] = (
                        {"p50_ms": round(r.stat(50), 3), "p99_ms": round(r.stat(99), 3)}
                        if r.status == OK
                        else {"error": f"{r.status}: {r.error}"}
                    )
            finally:
                engine.stop()
                del engine
                gc.collect()
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
        for batch in batches:
            cell = rows.get(str(batch), {"error": f"does not fit ({fit} sessions do)"})
            rows[str(batch)] = cell
            shown = f"p50 {cell['p50_ms']:.2f} ms, p99 {cell['p99_ms']:.2f} ms" if "p50_ms" in cell else cell["error"]
            print(f"steps {kv} batch {batch}: {shown}")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="moshi-7b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda")
    add_kv_dtype(parser, default="int8")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--frames", type=int, default=3100, help="teacher-forced frames (agreement)")
    parser.add_argument("--rows", type=int, default=4, help="sessions compared at once (agreement)")
    parser.add_argument("--sharpen", type=float, default=3.0, help="q and k projections scaled by this")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128], help="batches timed (steps)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per batch")
    parser.add_argument("--gpu-memory", help="memory to size for without a CUDA device (default 139GiB)")
    parser.add_argument("--out", type=Path, help="write kv_dtype.json here")
    args = parser.parse_args(argv)
    if args.kv_dtype == "bf16":
        parser.error("--kv-dtype: give the 8-bit format to compare with bf16 (int8 or fp8)")
    if args.frames < 1 or args.rows < 1 or args.steps < 1 or min(args.batches) < 1:
        parser.error("--frames, --rows, --steps and --batches must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from duplexd.server.core.runtime import random_models

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cuda_missing(args.device, "kv_dtype", "try --preset demo --device cpu"):
        return 0
    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)  # CPU dry run: torch work beside the engine's loop thread stays single-threaded
    torch.set_grad_enabled(False)
    dtype = torch.bfloat16 if cuda else torch.float32
    report: dict = {
        "bench": "kv_dtype",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "preset": args.preset,
        "kv_dtype": args.kv_dtype,
        "dtype": str(dtype).removeprefix("torch."),
    }
    started = time.perf_counter()
    if "capacity" in args.stages:
        memory = parse_size(args.gpu_memory) if args.gpu_memory else None if cuda else parse_size("139GiB")
        report["capacity"] = capacities(args.preset, args.kv_dtype, torch.bfloat16, memory, args.device)
    if "write" in args.stages and cuda:
        report["write"] = write_check(args.device)
    if {"agreement", "steps"} & set(args.stages):
        lm, mimi = random_models(args.preset, args.device, dtype)
        if "agreement" in args.stages:
            report["agreement"] = agreement(sharpened(lm, args.sharpen), args.kv_dtype, args.frames, args.rows)
            report["sharpen"] = args.sharpen
            sharpened(lm, 1 / args.sharpen)
        if "steps" in args.stages:
            report["steps"] = step_times(lm, mimi, args.kv_dtype, args.batches, args.steps, args.device)
    report["seconds"] = round(time.perf_counter() - started, 1)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kv_dtype.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
