"""Speech to text and text to speech in one server: each model's streams alone, then both at once, over real sockets.

Usage: python bench/speech_mix.py [--streams 2] [--seconds 10] [--words-per-second 10] [--words 18]
One `duplexd serve` on the CPU with the demo STT (Kyutai STT's layout, tiny) as its main model and `--tts demo-tts`
beside it, as Unmute would use it: `--streams` speech-to-text streams on `/api/asr-streaming` (80 ms of audio a
message at real-time pace, Unmute's `SpeechToText` messages back) and `--streams` text-to-speech streams on
`/api/tts_streaming` (`PcmMessagePack`, one reply after another: words at `--words-per-second`, as an LLM streams
them, then `Eos`, read until the close). Three phases of `--seconds`: STT alone, TTS alone, both.

Measured per phase: STT, the time from sending a frame to its `Step` (p50, p99) and the fraction later than 80 ms;
TTS, the time from connecting to `Ready` (the longest: Unmute gives up after 0.5 s), from a reply's first word to
its first audio (p50, p99) and its late frames (audio frame i arriving
after first audio + i x 80 ms: a client that starts playing at the first frame would run dry); each model's mean
step time from the server's `/metrics` histograms. The reference of each model is that model alone: the last line
(JSON) holds the together/alone ratios of the step times.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host_overhead import free_port  # noqa: E402
from bench.processes import ending_children, metric_values, stop, wait_ready  # noqa: E402

RATE, FRAME, FRAME_S = 24000, 1920, 0.08
REPLY = "Sure, here is what I found about that: it should be ready by tomorrow morning, if all goes well.".split()


@dataclass
class Phase:
    stt_latency: list[float] = field(default_factory=list)
    ttfa: list[float] = field(default_factory=list)
    ready: list[float] = field(default_factory=list)  # TTS: from connecting to `Ready` (Unmute waits 0.5 s)
    tts_frames: int = 0
    tts_late: int = 0
    replies: int = 0
    steps: dict[str, tuple[float, float]] = field(default_factory=dict)  # metric → (sum, count) over the phase


def start_server(port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    from duplexd.engine.weights.demo import ensure_demo_stt

    stt = ensure_demo_stt()
    cmd = [
        sys.executable, "-m", "duplexd", "serve", "--port", str(port), "--moshi-weight", str(stt.lm),
        "--mimi-weight", str(stt.mimi), "--tokenizer", str(stt.tokenizer), "--config", str(stt.config),
        "--max-sessions", str(args.streams), "--tts", "demo-tts", "--tts-streams", str(args.streams),
        "--static", "none", "--log-level", "warning",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    wait_ready(proc, f"http://127.0.0.1:{port}", log)
    return proc


def step_sums(port: int) -> dict[str, tuple[float, float]]:
    """(sum, count) of each model's step-duration histogram on the server now."""
    stt, tts = "duplexd_step_duration_seconds", "duplexd_tts_step_duration_seconds"
    values = metric_values(f"http://127.0.0.1:{port}", [f"{stt}_sum", f"{stt}_count", f"{tts}_sum", f"{tts}_count"])
    return {"stt": (values[0], values[1]), "tts": (values[2], values[3])}


async def stt_stream(port: int, until: float, phase: Phase, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sent: dict[int, float] = {}
    async with connect(f"ws://127.0.0.1:{port}/api/asr-streaming", max_size=None) as ws:
        assert msgpack.unpackb(await ws.recv())["type"] == "Ready"

        async def talk() -> None:
            start, k = time.monotonic(), 0
            while time.monotonic() < until:
                pcm = (0.1 * rng.standard_normal(FRAME)).astype(np.float32)
                sent[k] = time.monotonic()
                await ws.send(msgpack.packb({"type": "Audio", "pcm": pcm.tolist()}, use_single_float=True))
                k += 1
                await asyncio.sleep(max(0.0, start + k * FRAME_S - time.monotonic()))
            await ws.close()

        sender = asyncio.create_task(talk())
        with contextlib.suppress(ConnectionClosed):
            async for raw in ws:
                message = msgpack.unpackb(raw)
                if message["type"] == "Step" and message["step_idx"] in sent:
                    phase.stt_latency.append(time.monotonic() - sent[message["step_idx"]])
        await sender


async def tts_stream(port: int, until: float, phase: Phase, words_per_second: float, words: list[str]) -> None:
    while time.monotonic() < until:
        opened = time.monotonic()
        async with connect(f"ws://127.0.0.1:{port}/api/tts_streaming?format=PcmMessagePack", max_size=None) as ws:
            assert msgpack.unpackb(await ws.recv())["type"] == "Ready"
            first_word = time.monotonic()
            phase.ready.append(first_word - opened)

            async def send() -> None:
                for word in words:
                    await ws.send(msgpack.packb({"type": "Text", "text": word}))
                    await asyncio.sleep(1 / words_per_second)
                await ws.send(msgpack.packb({"type": "Eos"}))

            sender = asyncio.create_task(send())
            first_audio, frames = None, 0
            with contextlib.suppress(ConnectionClosed):
                async for raw in ws:
                    if msgpack.unpackb(raw)["type"] != "Audio":
                        continue
                    now = time.monotonic()
                    if first_audio is None:
                        first_audio = now
                        phase.ttfa.append(now - first_word)
                    elif now > first_audio + frames * FRAME_S:
                        phase.tts_late += 1
                    frames += 1
            sender.cancel()
            phase.tts_frames += frames
            phase.replies += 1


async def run_phase(port: int, args: argparse.Namespace, stt: bool, tts: bool) -> Phase:
    phase = Phase()
    before = step_sums(port)
    until = time.monotonic() + args.seconds
    jobs = [stt_stream(port, until, phase, k) for k in range(args.streams if stt else 0)]
    reply = REPLY[: args.words]
    jobs += [tts_stream(port, until, phase, args.words_per_second, reply) for _ in range(args.streams if tts else 0)]
    await asyncio.gather(*jobs)
    after = step_sums(port)
    phase.steps = {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}
    return phase


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def mean_step_ms(phase: Phase, model: str) -> float:
    total, count = phase.steps[model]
    return total / count * 1000 if count else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=2, help="streams of each model")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--words-per-second", type=float, default=10.0, help="the LLM's pace, in words")
    parser.add_argument("--words", type=int, default=len(REPLY), help="words in a reply (at most 18)")
    args = parser.parse_args()
    with ending_children(), tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        server = start_server(port, args, Path(tmp) / "serve.log")
        try:
            warm = argparse.Namespace(**{**vars(args), "seconds": min(1.0, args.seconds)})
            asyncio.run(run_phase(port, warm, True, True))
            phases = {
                "stt alone": asyncio.run(run_phase(port, args, True, False)),
                "tts alone": asyncio.run(run_phase(port, args, False, True)),
                "together": asyncio.run(run_phase(port, args, True, True)),
            }
        finally:
            stop([server.pid], 30.0)
            server.wait()
    print(
        f"speech mix on {platform.machine()} ({os.cpu_count()} cores): {args.streams} STT + {args.streams} TTS "
        f"streams, {args.seconds:g} s a phase, words at {args.words_per_second:g}/s; demo STT and demo TTS, CPU fp32"
    )
    print(
        f"{'phase':<10} {'stt p50 ms':>10} {'stt p99 ms':>10} {'stt late':>8} {'ttfa p50':>8} {'ttfa p99':>8} "
        f"{'tts late':>8} {'replies':>7} {'stt step ms':>11} {'tts step ms':>11}"
    )
    result: dict[str, object] = {"bench": "speech_mix", "streams": args.streams}
    for name, p in phases.items():
        late = sum(x > FRAME_S for x in p.stt_latency) / len(p.stt_latency) if p.stt_latency else float("nan")
        tts_late = p.tts_late / p.tts_frames if p.tts_frames else float("nan")
        print(
            f"{name:<10} {pct(p.stt_latency, 50):>10.1f} {pct(p.stt_latency, 99):>10.1f} {late:>8.3f} "
            f"{pct(p.ttfa, 50):>8.0f} {pct(p.ttfa, 99):>8.0f} {tts_late:>8.3f} {p.replies:>7} "
            f"{mean_step_ms(p, 'stt'):>11.2f} {mean_step_ms(p, 'tts'):>11.2f}"
        )
        key = name.replace(" alone", "").replace(" ", "_")
        if p.stt_latency:
            result[f"stt_late_frac_{key}"] = round(late, 4)
            result[f"stt_ms_p99_{key}"] = round(pct(p.stt_latency, 99), 1)
            result[f"stt_step_ms_{key}"] = round(mean_step_ms(p, "stt"), 2)
        if p.ttfa:
            result[f"ready_ms_max_{key}"] = round(max(p.ready) * 1000, 1)
            result[f"tts_late_frac_{key}"] = round(tts_late, 4)
            result[f"ttfa_ms_p50_{key}"] = round(pct(p.ttfa, 50), 1)
            result[f"tts_step_ms_{key}"] = round(mean_step_ms(p, "tts"), 2)
    for model in ("stt", "tts"):
        alone, together = result.get(f"{model}_step_ms_{model}"), result.get(f"{model}_step_ms_together")
        if isinstance(alone, float) and isinstance(together, float) and alone > 0:
            result[f"{model}_step_ratio_together_vs_alone"] = round(together / alone, 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
