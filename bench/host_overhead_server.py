"""`duplexd serve` with the model replaced by a zero-cost stand-in of the same shapes (bench only).

`python bench/host_overhead_server.py [--step-ms MS] -- serve ARGS...` patches `Pipeline.step` to hand back, at
once, fixed non-zero speech (speech-like audio, so Opus works as hard as on real output) and a rotating set of
real text ids mixed with padding (so detokenising is exercised), with the first frame of each slot invalid as the
real model's acoustic delay makes it. Everything else (FastAPI/uvicorn, both protocols, the engine's loop thread,
host copies, queues) is the real server, so the process's CPU is the host's overhead and nothing else.

The OS names of the threads that matter are set (`event-loop` for uvicorn's main thread, `engine-loop` for the
engine's loop thread, `codec` for the Kyutai protocol's codec threads), so per-thread CPU can be read from
`/proc/PID/task/*/stat` by name.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from duplexd.engine.dialogue.pipeline import FrameOutput, Pipeline
from duplexd.engine.models.config import DEMO, DEMO_MIMI
from duplexd.wire import split_frames

logger = logging.getLogger("duplexd.bench.host_overhead")

EVENT_LOOP_THREAD = "event-loop"
ENGINE_THREAD = "engine-loop"
CODEC_THREAD = "codec"
TEXT_RATE = 0.35  # share of frames carrying a text piece (a talking model writes a few pieces per second)
COUNTERS_ENV = "HOST_OVERHEAD_COUNTERS"  # file for the stand-in's step counters (int64 steps, frames in, out)
VARIANTS = 16  # distinct output frames (speech and token tables) the stand-in rotates through


def name_thread(name: str) -> None:
    """Set the calling thread's OS name (what /proc/PID/task/TID/comm shows); best effort."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        logger.warning("cannot name thread %s", name)


class StandIn:
    """The state of the stand-in model: output tables, and per slot whether its first frame has passed."""

    def __init__(self, max_rows: int, frame_size: int, step_seconds: float, seed: int = 0) -> None:
        from duplexd.clients.audio import speech_like
        from duplexd.engine.models.tokenizer import TextTokenizer
        from duplexd.engine.weights.demo import ensure_demo

        rng = np.random.default_rng(seed)
        vocab = TextTokenizer(ensure_demo().tokenizer).vocab_size
        speech = speech_like(VARIANTS * frame_size / DEMO_MIMI.sample_rate + 1.0, seed=seed)[: VARIANTS * frame_size]
        frames = split_frames(speech, frame_size)
        # Row r of variant v plays frame (v + r) of the speech, so rows differ and no stream repeats every frame.
        self.pcm = [
            torch.from_numpy(np.stack([frames[(v + r) % VARIANTS] for r in range(max_rows)])) for v in range(VARIANTS)
        ]
        text = np.where(
            rng.random((VARIANTS, max_rows)) < TEXT_RATE,
            rng.integers(4, vocab, (VARIANTS, max_rows)),
            DEMO.text_padding_token_id,
        )
        codes = rng.integers(0, DEMO.card, (VARIANTS, max_rows, DEMO.dep_q))
        self.tokens = [
            torch.from_numpy(np.concatenate([text[v][:, None], codes[v]], axis=1)).long() for v in range(VARIANTS)
        ]
        self.pause = torch.zeros(max_rows, 0)  # the demo model has no pause heads
        self.step_seconds = step_seconds
        # steps, frames in, frames out: read by the bench from this file without going through the event loop
        # (which answers /metrics late, or not at all, once it has fallen behind).
        path = os.environ.get(COUNTERS_ENV)
        self.counters: np.ndarray = np.memmap(path, np.int64, "w+", shape=(3,)) if path else np.zeros(3, np.int64)
        self.started: set[int] = set()  # slots that have had their first (invalid) frame since their reset
        self.steps = 0
        self.named = False

    def step(self, slots: Sequence[int], pcm: np.ndarray | torch.Tensor) -> FrameOutput:
        if not self.named:
            name_thread(ENGINE_THREAD)
            self.named = True
        batch = len(slots)
        valid = [s in self.started for s in slots]
        self.started.update(slots)
        variant = self.steps % VARIANTS
        self.steps += 1
        self.counters += (1, batch, sum(valid))
        if self.step_seconds:
            time.sleep(self.step_seconds)  # the device's time, costing the host no CPU
        speech = self.pcm[variant][:batch]
        if not all(valid):
            speech = speech.clone()
            speech[[i for i, v in enumerate(valid) if not v]] = 0.0
        return FrameOutput(speech, self.tokens[variant][:batch], valid, self.pause[:batch])


def install(max_rows: int, step_seconds: float) -> StandIn:
    """Patch `Pipeline.step` (and wrap `Pipeline.reset`, so a reset slot's first frame is invalid again)."""
    stand_in = StandIn(max_rows, DEMO_MIMI.frame_size, step_seconds)
    reset = Pipeline.reset
    lock = threading.Lock()

    def patched_reset(self, slot: int, params=None) -> None:
        reset(self, slot, params)
        with lock:
            stand_in.started.discard(slot)

    Pipeline.step = lambda self, slots, pcm: stand_in.step(slots, pcm)  # type: ignore[method-assign]
    Pipeline.reset = patched_reset  # type: ignore[method-assign]
    return stand_in


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=0.0, help="hold each step this long (sleeping: no CPU)")
    parser.add_argument("serve", nargs=argparse.REMAINDER, help="-- serve ARGS (duplexd serve's arguments)")
    args = parser.parse_args(argv)
    serve = [a for a in args.serve if a != "--"]
    if not serve or serve[0] != "serve":
        parser.error("give the server's command after --: -- serve --max-sessions N ...")
    rows = 128
    if "--max-sessions" in serve:
        rows = int(serve[serve.index("--max-sessions") + 1])
    install(max(rows, 1) * 2, args.step_ms / 1000)  # warm-up may step a whole bucket, up to 2x the slots
    name_thread(EVENT_LOOP_THREAD)
    from duplexd.commands.cli import main as duplexd_main
    from duplexd.server.codec import batches as codec_batches

    codec_batches.ThreadPoolExecutor = functools.partial(  # type: ignore[misc,assignment]
        ThreadPoolExecutor, initializer=name_thread, initargs=(CODEC_THREAD,)
    )

    return duplexd_main(serve)


if __name__ == "__main__":
    raise SystemExit(main())
