"""Per-frame Mimi encode + decode time, duplexd against the reference `moshi` Mimi, same random weights, CPU fp32.

Usage: python bench/mimi_step.py [--frames 30] [--warmup 5] [--threads 2] [--small]
One step = streaming encode of one 1920-sample frame for every batch row, then streaming decode of the codes; the
real Mimi config, or with `--small` the demo Mimi's (a smoke run: the real one's random weights take seconds to make).
Also times the tiny demo Mimi for 8 slots. Prints a table and, as its last line, one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import median_ms, parse_args, side_by_side, through_checkpoint  # noqa: E402
from duplexd.engine.models.config import DEMO_MIMI, MIMI  # noqa: E402
from duplexd.engine.models.mimi import MimiModel, MimiStreams  # noqa: E402
from duplexd.engine.weights.checkpoint import load_mimi  # noqa: E402
from duplexd.wire import split_frames  # noqa: E402
from tests.ref_models import reference_mimi  # noqa: E402

FS = MIMI.frame_size


def _signal(batch: int, frames: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(batch)
    t = torch.arange(frames * FS) / MIMI.sample_rate
    tone = torch.sin(2 * torch.pi * 180 * t) * (0.6 + 0.4 * torch.sin(2 * torch.pi * 4 * t))
    return 0.2 * tone + 0.02 * torch.randn(batch, frames * FS, generator=gen)


@torch.no_grad()
def run(batch: int, ref, model: MimiModel, frames: int, warmup: int) -> tuple[float, float]:
    """Both sides step the same frames alternately, so load from other processes hits them alike."""
    pcm = torch.from_numpy(split_frames(_signal(batch, frames + warmup).numpy(), FS))  # [batch, frames, FS]
    streams = MimiStreams(model, num_slots=batch)
    slots = torch.arange(batch)
    times: dict[str, list[float]] = {"dx": [], "ref": []}
    with ref.streaming(batch):
        for f in range(frames + warmup):
            x = pcm[:, f]
            for side in ("ref", "dx") if f % 2 else ("dx", "ref"):
                started = time.perf_counter()
                if side == "ref":
                    ref.decode(ref.encode(x[:, None]))
                else:
                    streams.decode(slots, streams.encode(slots, x))
                if f >= warmup:
                    times[side].append(time.perf_counter() - started)
    return 1000 * statistics.median(times["dx"]), 1000 * statistics.median(times["ref"])


@torch.no_grad()
def demo_ms(slots: int, frames: int, warmup: int) -> float:
    model = MimiModel(DEMO_MIMI).init_weights_(seed=0).eval()
    streams = MimiStreams(model, num_slots=slots)
    idx = torch.arange(slots)
    frames_in = _signal(slots, frames + warmup).split(FS, dim=-1)
    return median_ms(lambda x: streams.decode(idx, streams.encode(idx, x)), frames_in, warmup)


def main() -> None:
    args = parse_args(__doc__, small=True)
    config = DEMO_MIMI if args.small else MIMI

    ref = reference_mimi(seed=0, mimi_config=config.to_reference_dict() if args.small else None)
    model = through_checkpoint(ref.state_dict(), lambda path: load_mimi(path, config))

    result: dict[str, object] = {"bench": "mimi_step", "mimi": "demo" if args.small else "real"}
    print(
        f"Mimi encode + decode of one frame, CPU fp32, {args.threads} threads, "
        f"median of {args.frames} frames after {args.warmup} warm-up"
    )
    side_by_side(lambda batch: run(batch, ref, model, args.frames, args.warmup), result)
    demo = demo_ms(8, args.frames, args.warmup)
    print(f"demo Mimi (dim {DEMO_MIMI.dimension}, {DEMO_MIMI.n_filters} filters), 8 slots: {demo:.2f} ms per frame")
    result["demo_ms_8_slots"] = round(demo, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
