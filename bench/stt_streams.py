"""Real-time speech-to-text streams on the CPU: duplexd's batched engine against the reference `moshi` serving them.

Usage: python bench/stt_streams.py [--model demo|mid] [--frames 40] [--warmup 5] [--threads 2] [--sessions 1,8,32]
Same random weights on both sides: a Kyutai STT LM (dep_q 0, 32 codebooks in, 4 semantic-VAD heads; `demo`: the
`demo-stt` preset, d 128 x 3 layers; `mid`: d 1024 x 8 layers, the 1B's vocabulary and window) and the demo Mimi
at 32 codebooks, CPU fp32, greedy. One stream-frame is Mimi encode (included on both sides) → temporal step → text
token and the heads' pause probabilities, for one 80 ms frame; 12.5 stream-frames per second hold one real-time
stream. duplexd: N sessions open at once in one `Engine`, each given all its frames, stepped as one batch by the
engine thread. Reference: moshi's Mimi and `LMGen.step_with_extra_heads` (fed frame 0 twice, as
`moshi.run_inference`) at batch N, all N streams in step; and at batch 1, the N streams one after another. Prints
a table and, as its last line, one JSON object.

The main thread stays at one intra-op thread and each side runs on a thread of its own with `--threads`
(`engine.engine` on OpenMP pools per thread), so each gets the machine's cores as it would alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from moshi.models.lm import LMGen as RefLMGen  # noqa: E402

from bench.common import on_own_thread, through_checkpoint, tone_with_noise  # noqa: E402
from duplexd.engine.dialogue.engine import Engine, EngineConfig  # noqa: E402
from duplexd.engine.dialogue.sampling import SamplingParams  # noqa: E402
from duplexd.engine.models.config import DEMO_MIMI_32, DEMO_STT, STT_1B, LMConfig  # noqa: E402
from duplexd.engine.weights.checkpoint import load_lm, load_mimi  # noqa: E402
from tests.ref_models import fused_state_dict, reference_lm, reference_mimi  # noqa: E402

MODELS: dict[str, LMConfig] = {
    "demo": DEMO_STT,
    "mid": dataclasses.replace(STT_1B, dim=1024, num_layers=8),
}
GREEDY = SamplingParams(text_temperature=0.0, text_topk=1, audio_temperature=0.0, audio_topk=1)
MIMI = DEMO_MIMI_32
FS = MIMI.frame_size
FRAME_RATE = MIMI.frame_rate


def duplexd_fps(engine: Engine, sessions: int, frames: int) -> float:
    audio = [tone_with_noise(frames * FS, MIMI.sample_rate, s) for s in range(sessions)]
    started = time.perf_counter()
    opened = [engine.open_session(GREEDY) for _ in range(sessions)]
    for session, pcm in zip(opened, audio, strict=True):
        if session.push(pcm):
            raise RuntimeError("frames were dropped: raise max_pending_frames")
    for session in opened:
        for _ in range(frames):  # a text-only model answers every frame, the first too
            session.get(timeout=600)
    elapsed = time.perf_counter() - started
    for session in opened:
        session.close()
    return sessions * frames / elapsed


@torch.no_grad()
def reference_fps(ref_lm, ref_mimi, sessions: int, frames: int, batch: int) -> float:
    """The reference serving `sessions` streams `batch` at a time (1: one after another)."""
    started = time.perf_counter()
    for first in range(0, sessions, batch):
        rows = range(first, min(first + batch, sessions))
        pcm = torch.from_numpy(np.stack([tone_with_noise(frames * FS, MIMI.sample_rate, s) for s in rows]))
        gen = RefLMGen(ref_lm, temp=0, temp_text=0)
        with gen.streaming(len(rows)), ref_mimi.streaming(len(rows)):
            previous = None
            for f in range(frames):
                codes = ref_mimi.encode(pcm[:, None, f * FS : (f + 1) * FS])
                gen.step_with_extra_heads(codes if previous is None else previous)  # frame 0 twice
                previous = codes
    return sessions * frames / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="demo")
    parser.add_argument("--frames", type=int, default=40, help="frames per stream")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up frames per side before timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sessions", default="1,8,32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    counts = [int(n) for n in args.sessions.split(",")]
    cfg = MODELS[args.model]

    ref_lm = reference_lm(cfg, seed=0)
    ref_mimi = reference_mimi(seed=0, mimi_config=MIMI.to_reference_dict())
    ref_mimi.set_num_codebooks(MIMI.num_codebooks)
    lm = through_checkpoint(fused_state_dict(ref_lm, cfg), lambda path: load_lm(path, cfg))
    mimi = through_checkpoint(ref_mimi.state_dict(), lambda path: load_mimi(path, MIMI))
    engine = Engine(
        lm, mimi, config=EngineConfig(max_sessions=max(counts), threads=args.threads, max_pending_frames=args.frames)
    )
    engine.start()
    on_own_thread(reference_fps, ref_lm, ref_mimi, 1, args.warmup, 1, threads=args.threads)
    duplexd_fps(engine, 1, args.warmup)

    print(
        f"STT streams, CPU fp32, {args.threads} threads, {args.frames} frames per stream; LM {cfg.dim} x "
        f"{cfg.num_layers}, {cfg.n_q} codebooks in, {cfg.extra_heads_num_heads} extra heads, window {cfg.context}; "
        f"demo Mimi at {MIMI.num_codebooks} codebooks (encode included on both sides)"
    )
    # One after another: the rate does not depend on N.
    alone = on_own_thread(reference_fps, ref_lm, ref_mimi, 2, args.frames, 1, threads=args.threads)
    print(
        f"{'streams':>7} {'duplexd fps':>12} {'real-time':>10} {'moshi batched fps':>18} {'moshi 1-by-1 fps':>17} "
        f"{'vs batched':>11} {'vs 1-by-1':>10}"
    )
    result: dict[str, object] = {"bench": "stt_streams", "model": args.model, "reference_fps_one_by_one": alone}
    for n in counts:
        fps = duplexd_fps(engine, n, args.frames)
        batched = on_own_thread(reference_fps, ref_lm, ref_mimi, n, args.frames, n, threads=args.threads)
        print(
            f"{n:>7} {fps:>12.1f} {fps / FRAME_RATE:>10.1f} {batched:>18.1f} {alone:>17.1f} "
            f"{fps / batched:>11.2f} {fps / alone:>10.2f}"
        )
        result[f"duplexd_fps_b{n}"] = round(fps, 1)
        result[f"reference_batched_fps_b{n}"] = round(batched, 1)
    engine.stop()
    top = max(counts)
    result["reference_fps_one_by_one"] = round(alone, 1)
    result["realtime_streams"] = round(float(result[f"duplexd_fps_b{top}"]) / FRAME_RATE, 1)  # type: ignore[arg-type]
    result["ratio_vs_one_by_one"] = round(float(result[f"duplexd_fps_b{top}"]) / alone, 2)  # type: ignore[arg-type]
    result["ratio_vs_batched"] = round(
        float(result[f"duplexd_fps_b{top}"]) / float(result[f"reference_batched_fps_b{top}"]),  # type: ignore[arg-type]
        2,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
