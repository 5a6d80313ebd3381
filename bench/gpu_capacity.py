"""Real-time sessions per GPU: per-step time of the whole engine (Mimi + LM + DepFormer) at growing batch sizes.

Usage: python bench/gpu_capacity.py [--batches 1 8 32 64 128] [--steps 50] [--position 2999]
                                    [--session-frames N] [--preset moshi-7b] [--device cuda]

The `moshi-7b` LM with random bf16 weights made on the device (no checkpoint) and the real Mimi config (fp32)
run in one `Engine` with CUDA graphs. For each batch size B that the KV pool can hold, B sessions are opened,
moved to `--position` (by default the last position of a full 3000-frame window, so attention reads a whole
window as in a long conversation; the cached keys are zeros, which costs the same), fed one frame each per step,
and the engine's own step records give p50/p99 in ms (Mimi encode + temporal step + DepFormer + Mimi decode).
Prints a table, the largest batch whose p99 stays under 80 ms (one frame), and as its last line one JSON object.
`--preset demo --device cpu` runs the same script on a CPU as a dry run.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from duplexd.engine.checkpoint import build_lm  # noqa: E402
from duplexd.engine.config import MIMI_PRESETS, PRESETS, SamplingParams  # noqa: E402
from duplexd.engine.errors import CapacityError  # noqa: E402
from duplexd.engine.models.mimi import MimiModel  # noqa: E402
from duplexd.engine.scheduler import Engine, EngineConfig  # noqa: E402

FRAME_MS = 80.0


@torch.no_grad()
def random_models(preset: str, device: str):
    """The LM in bf16 (fp32 on CPU) and Mimi in fp32, random weights drawn on the device."""
    cfg = PRESETS[preset]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    lm = build_lm(cfg, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in lm.named_parameters():
        if name.endswith("norm"):
            p.fill_(1.0)
        else:
            std = 1.0 if "emb" in name else p.shape[-1] ** -0.5
            p.normal_(0.0, std, generator=gen)
    mimi = MimiModel(MIMI_PRESETS["mimi" if preset == "moshi-7b" else "demo"]).init_weights_(0).to(device)
    return lm, mimi


def measure(engine: Engine, batch: int, steps: int, position: int) -> list[float] | None:
    """Step times (s) of `steps` steps at `batch` sessions, or None when they do not fit."""
    try:
        sessions = [engine.open_session(SamplingParams(seed=i)) for i in range(batch)]
    except CapacityError as e:
        print(f"batch {batch}: does not fit ({e})")
        return None
    records: list = []
    unsubscribe = None
    frame = np.zeros(engine.frame_size, np.float32)
    try:
        for s in sessions:  # the warm-up frame resets each slot on the loop thread
            s.push(frame)
        deadline = time.monotonic() + 60
        while any(s.steps < 1 for s in sessions) and time.monotonic() < deadline:
            time.sleep(0.01)
        with engine._lock:  # idle loop: jump every slot to a long-conversation position
            for s in sessions:
                engine.pipeline.seek(s.slot, position)
        unsubscribe = engine.on_step(records.append)
        for s in sessions:  # every session has its frames queued, so every step is a full batch
            s.push(np.zeros((steps + 3) * engine.frame_size, np.float32))
        for s in sessions:
            for _ in range(steps + 3):
                s.get(timeout=120)
    finally:
        if unsubscribe:
            unsubscribe()
        for s in sessions:
            s.close()
    times = [r.seconds for r in records if r.batch_size == batch]
    return times[3:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--position", type=int, default=2999)
    parser.add_argument("--session-frames", type=int, default=None, help="cap session length (fewer KV pages)")
    parser.add_argument("--preset", default="moshi-7b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (try --preset demo --device cpu for a dry run)")
        return

    if not args.device.startswith("cuda"):
        torch.set_num_threads(1)  # CPU dry run: torch work beside the engine's loop thread stays single-threaded
    started = time.perf_counter()
    lm, mimi = random_models(args.preset, args.device)
    engine = Engine(lm, mimi, config=EngineConfig(
        max_sessions=max(args.batches), device=args.device, max_session_frames=args.session_frames,
        max_pending_frames=args.steps + 3,
    ))
    engine.start()
    print(f"models + warm-up: {time.perf_counter() - started:.0f} s; KV pool {engine.kv.num_pages} pages, "
          f"{engine.stats().admissible_sessions} sessions fit")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"{args.preset} on {name}, position {args.position}, {args.steps} steps per batch")
    print(f"{'batch':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'session-frames/s':>17}")
    result: dict[str, object] = {"bench": "gpu_capacity", "device": name, "preset": args.preset}
    realtime = 0
    for batch in args.batches:
        times = measure(engine, batch, args.steps, args.position)
        if not times:
            continue
        ms = sorted(1000 * t for t in times)
        p50, p99 = statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))]
        print(f"{batch:>5} {p50:>8.2f} {p99:>8.2f} {ms[-1]:>8.2f} {1000 * batch / p50:>17.0f}")
        result[f"p50_ms_b{batch}"], result[f"p99_ms_b{batch}"] = round(p50, 2), round(p99, 2)
        if p99 < FRAME_MS:
            realtime = max(realtime, batch)
    engine.stop()
    print(f"largest batch with p99 < {FRAME_MS:.0f} ms: {realtime}")
    result["realtime_sessions"] = realtime
    print(json.dumps(result))


if __name__ == "__main__":
    main()
