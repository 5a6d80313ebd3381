"""Real-time Kyutai TTS streams on one GPU: `TTSGen` with the 1.6B's config and random weights, words streamed.

Usage: python bench/gpu_tts.py [--preset tts-1.6b|demo-tts] [--device cuda:0] [--dtype bfloat16]
                               [--batches 1 32 64 128] [--steps 120] [--words-per-s 10] [--no-graphs] [--out DIR]
Every stream says its own text in its own random voice: its first three words at once (the next word and the two
the lookahead stream needs: an LLM's first tokens come fast), then `--words-per-s` more a second, as an LLM streams
them, and it steps only when it has them (`TTSGen.ready`). For each batch B, B streams start together and step
together; a step is the whole TTS step (temporal step with cross-attention, the host's words, the 32-step
DepFormer) timed on the host, which waits for the device at the step's copy back; on CUDA each half is a captured
graph at the batch's bucket (`--no-graphs`: eager), as the speech service runs it, and elsewhere the same padded
halves run eagerly. Mimi's decoder is not run. Per batch: p50/p99 step; the split's cost (the step's p50 less the
two halves replayed back to back with no host part between, the text left on the device); time to first audio
(from a stream's start to its first frame that carries audio: the 16-frame audio delay and the 2-frame codebook
delay, computed as fast as the batch goes), p50/p99 over the streams. A batch is real-time when its p99 step is
<= 80 ms. First a correctness check: two sessions' frames through the bucketed halves (CUDA graphs on a GPU)
against the same bucket run eagerly (unpadded on a CPU); any frame that differs fails the run. Goal on an H200:
>= 128 real-time streams with time to first audio p50 <= 150 ms (Kyutai: 32 at 350 ms on an L40S). Writes
tts.json (and tts.md) into --out; the last line printed is one JSON object. On a CPU with the demo model it is
the suite's dry run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from duplexd.engine.devices import check_device  # noqa: E402
from duplexd.engine.models.config import TTS_1_6B  # noqa: E402
from duplexd.engine.tts.conditioning import Conditioner  # noqa: E402
from duplexd.engine.tts.config import tts_config_from_dict  # noqa: E402
from duplexd.engine.tts.demo import DEMO_TTS, SPEAKER_DIM, tts_keys  # noqa: E402
from duplexd.engine.tts.generate import TTSGen, Voice  # noqa: E402
from duplexd.engine.tts.words import Word  # noqa: E402
from duplexd.engine.weights.checkpoint import build_lm  # noqa: E402
from duplexd.engine.weights.demo import draw_random_  # noqa: E402

PRESETS = {"tts-1.6b": (TTS_1_6B, 512), "demo-tts": (DEMO_TTS, SPEAKER_DIM)}
FRAME_S = 0.08
BUDGET_MS = 80.0


def percentile(values: Sequence[float], q: float) -> float | None:
    return sorted(values)[min(len(values) - 1, round(q * (len(values) - 1)))] if values else None


def words(stream: int, count: int, text_card: int) -> list[Word]:
    """`count` words of 1 to 3 text tokens (ids 4 .. text_card - 1), the stream's own."""
    gen = torch.Generator().manual_seed(stream)
    out = []
    for k in range(count):
        n = 1 + int(torch.randint(0, 3, (1,), generator=gen))
        tokens = tuple(int(t) for t in torch.randint(4, text_card, (n,), generator=gen))
        out.append(Word(tokens, f"w{k}", 1 + n - 1))
    return out


def run_batch(gen: TTSGen, batch: int, steps: int, rate: float, voices: list[torch.Tensor]) -> dict:
    scripts = [words(s, 4 + int(rate * steps * FRAME_S * 4), gen.cfg.text_card) for s in range(batch)]
    for slot in range(batch):
        gen.start(slot, scripts[slot][:3], Voice((voices[slot % len(voices)],)))
    given = [3] * batch
    started = time.perf_counter()
    times: list[float] = []
    first: list[float | None] = [None] * batch
    frames = [0] * batch
    for _ in range(steps):
        now = time.perf_counter() - started
        due = 3 + int(now * rate)
        for slot in range(batch):
            if given[slot] < due:
                gen.push(slot, scripts[slot][given[slot] : due])
                given[slot] = due
        live = [slot for slot in range(batch) if gen.ready(slot)]
        if not live:
            time.sleep(0.001)
            continue
        t0 = time.perf_counter()
        _, valid = gen.step(live)  # the step's copy back waits for the device
        times.append(time.perf_counter() - t0)
        done = time.perf_counter() - started
        for slot, ok in zip(live, valid.tolist(), strict=True):
            frames[slot] += ok
            if ok and frames[slot] == gen.tts.delay_steps + 1 and first[slot] is None:
                first[slot] = done
    ms = [1000 * t for t in times[2:]] or [1000 * t for t in times]  # the first steps warm the caches up
    ttfa = [1000 * t for t in first if t is not None]
    p50, p99 = percentile(ms, 0.5) or 0.0, percentile(ms, 0.99)
    halves = halves_ms(gen, list(range(batch)))
    return {
        "batch": batch,
        "steps": len(ms),
        "p50_ms": round(p50, 2),
        "p99_ms": round(p99 or 0, 2),
        "halves_ms": round(halves, 2),
        "split_ms": round(p50 - halves, 2),
        "ttfa_ms_p50": round(percentile(ttfa, 0.5) or 0, 1) if ttfa else None,
        "ttfa_ms_p99": round(percentile(ttfa, 0.99) or 0, 1) if ttfa else None,
        "realtime": p99 is not None and p99 <= BUDGET_MS,
    }


def halves_ms(gen: TTSGen, slots: list[int], repeats: int = 20) -> float:
    """Mean ms of the step's two halves replayed back to back for `slots`, the text staying on the device (no copy
    back, no words): the step without its split."""
    device = gen.offsets.device
    index = torch.tensor(slots, dtype=torch.long, device=device)
    text = torch.zeros(len(slots), dtype=torch.long, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    started = time.perf_counter()
    with torch.no_grad():
        for _ in range(repeats):
            hidden, _, _ = gen.bucketed_listen(index)
            gen.bucketed_speak(index, text, hidden)
    sync()
    return 1000 * (time.perf_counter() - started) / repeats


def check_bucketed(gens: tuple[TTSGen, TTSGen], voices: list[torch.Tensor], steps: int = 40) -> int:
    """Frames of the bucketed halves (`gens[0]`: CUDA graphs on a GPU) against a reference run (`gens[1]`: the same
    bucket eagerly on a GPU, where the shapes and so the kernels are the same; unpadded on a CPU): two sessions at
    different positions, one greedy and one sampled, the second starting 5 steps after the first. Returns the
    number of frames that differ (0 when they match)."""
    script = words(7, 40, gens[0].cfg.text_card)
    frames: list[list[list[int]]] = []
    for gen in gens:
        rows = []
        for step in range(steps):
            for slot, start, temperature in ((0, 0, 0.0), (1, 5, 0.6)):
                if step == start:
                    gen.start(slot, script, Voice((voices[slot],)), temperature, seed=slot)
                    gen.finish(slot)
            out, _ = gen.step([0, 1] if step >= 5 else [0])
            rows.append(out.tolist())
        frames.append(rows)
    return sum(a != b for a, b in zip(*frames, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tts-1.6b")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64, 128])
    parser.add_argument("--steps", type=int, default=120, help="steps a batch (enough past the audio delay)")
    parser.add_argument("--words-per-s", type=float, default=10.0)
    parser.add_argument("--no-graphs", action="store_true", help="run the halves eagerly on CUDA")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    device = torch.device(check_device(args.device))
    cfg, speaker_dim = PRESETS[args.preset]
    dtype = getattr(torch, args.dtype)
    tts = tts_config_from_dict({**cfg.to_reference_json(), **tts_keys(speaker_dim, cfg.dim)})
    assert tts is not None
    torch.manual_seed(0)
    lm = draw_random_(build_lm(cfg, device=device, dtype=dtype), seed=0).eval()
    conditioner = Conditioner(tts, cfg.dim)
    with torch.no_grad():
        for p in conditioner.parameters():
            p.normal_(0.0, p.shape[0] ** -0.5)
    voices = [torch.randn(speaker_dim, tts.speaker_frames, generator=torch.Generator().manual_seed(k)) for k in (1, 2)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    graphs = device.type == "cuda" and not args.no_graphs
    print(
        f"{args.preset} on {name} ({args.dtype}): words at {args.words_per_s:g}/s, {args.steps} steps a batch, "
        f"{'CUDA graphs' if graphs else 'eager'}"
    )
    checked = TTSGen(lm, conditioner, tts, num_slots=3, buckets=(4,), graphs=graphs, pad=True)
    checked.capture()
    reference = TTSGen(lm, conditioner, tts, num_slots=3, buckets=(4,), pad=graphs)
    mismatched = check_bucketed((checked, reference), voices)
    del checked, reference
    against = "the same bucket eagerly" if graphs else "unpadded"
    print(f"bucketed halves{' as CUDA graphs' if graphs else ''} against {against}: {mismatched} of 40 frames differ")
    results = []
    for batch in args.batches:
        gen = TTSGen(lm, conditioner, tts, num_slots=batch, buckets=(batch,), graphs=graphs, pad=True)
        t0 = time.perf_counter()
        gen.capture()
        capture_s = time.perf_counter() - t0
        result = {**run_batch(gen, batch, args.steps, args.words_per_s, voices), "capture_s": round(capture_s, 1)}
        results.append(result)
        late = "" if result["realtime"] else " (NOT real-time)"
        print(
            f"batch {batch}: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms (halves alone {result['halves_ms']} "
            f"ms, split {result['split_ms']} ms), first audio p50 {result['ttfa_ms_p50']} ms, p99 "
            f"{result['ttfa_ms_p99']} ms{late}; captured in {capture_s:.1f} s"
        )
        del gen
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ok = [r["batch"] for r in results if r["realtime"]]
    report = {
        "bench": "gpu_tts",
        "device": name,
        "preset": args.preset,
        "graphs": graphs,
        "bucketed_frames_differing": mismatched,
        "realtime_streams": max(ok) if ok else 0,
        "batches": results,
        "ttfa_ms_p50_b1": next((r["ttfa_ms_p50"] for r in results if r["batch"] == 1), None),
    }
    lines = [
        f"{args.preset} on {name}, words at {args.words_per_s:g}/s, {'CUDA graphs' if graphs else 'eager'}",
        "",
        "| streams | p50 ms | p99 ms | halves alone ms | split ms | first audio p50 ms | p99 ms | p99 step <= 80 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
        *(
            f"| {r['batch']} | {r['p50_ms']} | {r['p99_ms']} | {r['halves_ms']} | {r['split_ms']} | "
            f"{r['ttfa_ms_p50']} | {r['ttfa_ms_p99']} | {'yes' if r['realtime'] else 'no'} |"
            for r in results
        ),
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tts.json").write_text(json.dumps(report, indent=2))
    (out / "tts.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(report))
    if mismatched:
        print(f"FAILED: the bucketed halves differ from the reference in {mismatched} frames")
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
