"""Session-frames per second of the batched engine against the reference serving sessions one after another.

Usage: python bench/engine_throughput.py [--frames 40] [--warmup 5] [--threads 2] [--sessions 1,2,4,8]
           [--kv-dtype bf16|int8|fp8] [--small]
Same random weights on both sides (LM d 512 x 6 layers, DepFormer d 256 x 2, or with `--small` the demo LM, as a
smoke run uses; demo Mimi), CPU fp32. One
session-frame is Mimi encode → temporal step → DepFormer → Mimi decode of one 80 ms frame. duplexd: N sessions
open at once in one `Engine`, each given all its frames, stepped as one batch by the engine thread. Reference:
the `moshi` package's Mimi and LMGen at batch 1, the N sessions one after another (its server holds one
conversation at a time). Prints a table and, as its last line, one JSON object.

The main thread stays at one intra-op thread and the reference runs on a short-lived thread with `--threads`
(see `engine.engine` on OpenMP pools per thread), so each side gets the machine's cores as it would alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from moshi.models.lm import LMGen as RefLMGen  # noqa: E402

from bench.common import add_kv_dtype, on_own_thread, through_checkpoint, tone_with_noise  # noqa: E402
from duplexd.engine.dialogue.engine import Engine, EngineConfig  # noqa: E402
from duplexd.engine.dialogue.sampling import SamplingParams  # noqa: E402
from duplexd.engine.models.config import DEMO, DEMO_MIMI, LMConfig  # noqa: E402
from duplexd.engine.weights.checkpoint import load_lm, load_mimi  # noqa: E402
from duplexd.wire import split_frames  # noqa: E402
from tests.ref_models import reference_lm, reference_mimi  # noqa: E402

CONFIG = LMConfig(
    dim=512,
    num_heads=8,
    num_layers=6,
    depformer_dim=256,
    depformer_dim_feedforward=int(4.125 * 256),
    depformer_num_heads=4,
    depformer_num_layers=2,
)
PARAMS = SamplingParams()  # the reference defaults: text 0.7 / 25, audio 0.8 / 250
FS = DEMO_MIMI.frame_size


def duplexd_fps(engine: Engine, sessions: int, frames: int) -> float:
    audio = [tone_with_noise(frames * FS, DEMO_MIMI.sample_rate, s) for s in range(sessions)]
    started = time.perf_counter()
    opened = [engine.open_session(SamplingParams(seed=s)) for s in range(sessions)]
    for session, pcm in zip(opened, audio, strict=True):
        if session.push(pcm):
            raise RuntimeError("frames were dropped: raise max_pending_frames")
    for session in opened:
        for _ in range(frames - 1):  # the first frame has no output
            session.get(timeout=600)
    elapsed = time.perf_counter() - started
    for session in opened:
        session.close()
    return sessions * frames / elapsed


@torch.no_grad()
def reference_fps(ref_lm, ref_mimi, sessions: int, frames: int, user_codebooks: int) -> float:
    started = time.perf_counter()
    for s in range(sessions):
        pcm = torch.from_numpy(split_frames(tone_with_noise(frames * FS, DEMO_MIMI.sample_rate, s), FS))
        gen = RefLMGen(
            ref_lm,
            temp=PARAMS.audio_temperature,
            top_k=PARAMS.audio_topk,
            temp_text=PARAMS.text_temperature,
            top_k_text=PARAMS.text_topk,
        )
        with gen.streaming(1), ref_mimi.streaming(1):
            for f in range(frames):
                codes = ref_mimi.encode(pcm[None, None, f])
                tokens = gen.step(codes[:, :user_codebooks])
                if tokens is not None:
                    ref_mimi.decode(tokens[:, 1:])
    return sessions * frames / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=40, help="frames per session")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up frames per side before timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sessions", default="1,2,4,8")
    add_kv_dtype(parser)
    parser.add_argument("--small", action="store_true", help="the demo LM's sizes (a smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    counts = [int(n) for n in args.sessions.split(",")]
    config = DEMO if args.small else CONFIG

    ref_lm = reference_lm(config, seed=0)
    ref_mimi = reference_mimi(seed=0, mimi_config=DEMO_MIMI.to_reference_dict())
    lm = through_checkpoint(ref_lm.state_dict(), lambda path: load_lm(path, config))
    mimi = through_checkpoint(ref_mimi.state_dict(), lambda path: load_mimi(path, DEMO_MIMI))
    engine = Engine(
        lm,
        mimi,
        config=EngineConfig(
            max_sessions=max(counts), threads=args.threads, max_pending_frames=args.frames, kv_dtype=args.kv_dtype
        ),
    )
    engine.start()
    codebooks = config.num_user_codebooks
    on_own_thread(reference_fps, ref_lm, ref_mimi, 1, args.warmup, codebooks, threads=args.threads)
    duplexd_fps(engine, 1, args.warmup)

    print(
        f"engine throughput, CPU fp32, KV {args.kv_dtype}, {args.threads} threads, {args.frames} frames per "
        "session; LM "
        f"{config.dim} x {config.num_layers}, DepFormer {config.depformer_dim} x {config.depformer_num_layers}, "
        f"demo Mimi"
    )
    # Sequential, so the rate does not depend on N.
    ref = on_own_thread(reference_fps, ref_lm, ref_mimi, 2, args.frames, codebooks, threads=args.threads)
    print(f"{'sessions':>8} {'duplexd fps':>12} {'reference fps':>14} {'ratio':>7}")
    lm_size = f"{config.dim}x{config.num_layers}"
    result: dict[str, object] = {"bench": "engine_throughput", "lm": lm_size, "kv_dtype": args.kv_dtype}
    for n in counts:
        fps = duplexd_fps(engine, n, args.frames)
        print(f"{n:>8} {fps:>12.1f} {ref:>14.1f} {fps / ref:>7.2f}")
        result[f"duplexd_fps_b{n}"] = round(fps, 1)
    engine.stop()
    result["reference_fps"] = round(ref, 1)
    top = max(counts)
    result[f"ratio_b{top}"] = round(result[f"duplexd_fps_b{top}"] / ref, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
