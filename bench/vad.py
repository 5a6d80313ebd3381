"""VAD CPU cost per session-second: duplexd's batched segmenter against Silero's own per-stream loop.

Usage: python bench/vad.py [--sessions 8 32] [--seconds 10] [--repeats 3] [--threads 1]
Both sides take the same 24 kHz audio (speech-like bursts and pauses with a little noise, different per session) in
80 ms frames and resample each stream to 16 kHz with a streaming soxr resampler. duplexd: one `VadSegmenter` with a
slot per session, one `step` per frame for all of them (one batched Silero call per window round). Reference: one
Silero JIT model and one `silero_vad.VADIterator` per session, fed window by window as Silero's README does.
CPU is the process's (all threads), median of the repeats. Prints a table and, as its last line, one JSON object.
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
import soxr  # noqa: E402
import torch  # noqa: E402
from silero_vad import VADIterator  # noqa: E402  (its import sets torch's threads to 1: set ours after)

from duplexd.engine.transcription.vad import VAD_RATE, WINDOW, VadSegmenter, load_silero  # noqa: E402
from duplexd.wire import FRAME_SIZE, SAMPLE_RATE, split_frames  # noqa: E402

log = logging.getLogger("bench.vad")


def _audio(session: int, seconds: float) -> np.ndarray:
    """Harmonic bursts (voiced-like, 4 Hz syllable envelope) of 0.8-2 s with pauses, plus noise."""
    rng = np.random.default_rng(session)
    n = round(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    f0 = 110 + 60 * rng.random()
    voiced = sum(np.sin(2 * np.pi * k * f0 * t) / k for k in range(1, 8))
    gate = np.zeros(n)
    at = int(rng.uniform(0, 0.5) * SAMPLE_RATE)
    while at < n:
        length = int(rng.uniform(0.8, 2.0) * SAMPLE_RATE)
        gate[at : at + length] = 1
        at += length + int(rng.uniform(0.5, 1.5) * SAMPLE_RATE)
    envelope = gate * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2)
    return (0.2 * voiced * envelope + rng.normal(0, 0.003, n)).astype(np.float32)


def _duplexd(frames: np.ndarray, model: torch.jit.ScriptModule) -> int:
    """`frames`: `[sessions, count, 1920]`. Returns the number of events."""
    sessions = frames.shape[0]
    seg = VadSegmenter(sessions, model=model)
    slots = list(range(sessions))
    for slot in slots:
        seg.open(slot)
    events = 0
    for i in range(frames.shape[1]):
        events += len(seg.step(slots, frames[:, i]))
    for slot in slots:
        events += len(seg.close(slot))
    return events


def _reference(frames: np.ndarray, models: list[torch.jit.ScriptModule]) -> int:
    iterators = [VADIterator(model, sampling_rate=VAD_RATE) for model in models]
    resamplers = [soxr.ResampleStream(SAMPLE_RATE, VAD_RATE, 1, dtype="float32") for _ in models]
    pending: list[np.ndarray] = [np.zeros(0, np.float32) for _ in models]
    events = 0
    for i in range(frames.shape[1]):
        for s, (iterator, resampler) in enumerate(zip(iterators, resamplers, strict=True)):
            pending[s] = np.concatenate([pending[s], resampler.resample_chunk(frames[s, i])])
            while len(pending[s]) >= WINDOW:
                events += iterator(torch.from_numpy(pending[s][:WINDOW].copy())) is not None
                pending[s] = pending[s][WINDOW:]
    return events


def _cpu(run, repeats: int) -> tuple[float, float]:
    """Median process CPU and wall seconds of `run()`."""
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        run()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    result: dict[str, object] = {"bench": "vad", "seconds": args.seconds, "threads": args.threads}
    model = load_silero()
    print(f"{'sessions':>8} {'duplexd ms/s':>13} {'reference ms/s':>15} {'ratio':>7} {'duplexd wall/audio':>16}")
    for sessions in args.sessions:
        frames = np.stack([split_frames(_audio(s, args.seconds)) for s in range(sessions)])
        session_s = sessions * frames.shape[1] * FRAME_SIZE / SAMPLE_RATE
        models = [load_silero() for _ in range(sessions)]
        with torch.inference_mode():
            dx_events = _duplexd(frames, model)
            ref_events = _reference(frames, models)
            dx_cpu, dx_wall = _cpu(lambda f=frames: _duplexd(f, model), args.repeats)
            ref_cpu, _ = _cpu(lambda f=frames, m=models: _reference(f, m), args.repeats)
        dx_ms, ref_ms = 1000 * dx_cpu / session_s, 1000 * ref_cpu / session_s
        realtime = dx_wall / (frames.shape[1] * FRAME_SIZE / SAMPLE_RATE)
        print(f"{sessions:>8} {dx_ms:>13.3f} {ref_ms:>15.3f} {dx_ms / ref_ms:>7.3f} {realtime:>16.4f}")
        log.info("  events: duplexd %d, reference %d (its own thresholds and padding)", dx_events, ref_events)
        result.update(
            {
                f"duplexd_cpu_ms_per_session_s_{sessions}": round(dx_ms, 3),
                f"reference_cpu_ms_per_session_s_{sessions}": round(ref_ms, 3),
                f"ratio_{sessions}": round(dx_ms / ref_ms, 3),
            }
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
