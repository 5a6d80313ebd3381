"""Real-time text-to-speech streams on the CPU: duplexd's batched TTS generation against moshi's `TTSModel`.

Usage: python bench/tts_streams.py [--sessions 1,8] [--words 12] [--threads 2] [--n-q 32,24]
The demo TTS model (Kyutai TTS's layout and every mechanism, tiny: `duplexd speak --model demo-tts`) on both sides,
its files loaded by duplexd and by moshi 0.2.13, fp32, greedy. Each stream says its own script (`--words` words) in
a demo voice. duplexd: N streams in `TTSGen`, stepped as one batch. Reference: `TTSModel.generate` at batch N (the
N scripts in step), and at batch 1, the N scripts one after another, as a server without batching would. A
stream-frame is one 80 ms frame of one stream (temporal step, text, an n_q-step DepFormer; Mimi is not run on
either side); 12.5 stream-frames a second hold one real-time stream. `--n-q`: the codebooks said, each count run
on both sides (moshi's `TTSModel(n_q=...)`; all 32 is what moshi-server's worker says, 24 a quarter fewer DepFormer
steps), the first the baseline of `fps_ratio_q*`. Time to first audio: from the start of a batch to the first frame
that carries audio (the model's audio delay of 16 frames plus the 2-frame codebook delay, computed as fast as the
machine goes), p50 and p99 over the batch's streams. Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from moshi.models import loaders  # noqa: E402
from moshi.models.tts import Entry, TTSModel  # noqa: E402

from bench.common import on_own_thread  # noqa: E402
from duplexd.engine.tts.demo import DEMO_VOICES, demo_tts_folder  # noqa: E402
from duplexd.engine.tts.generate import TTSGen, Voice  # noqa: E402
from duplexd.engine.tts.model import TTSModel as DuplexdTTS  # noqa: E402
from duplexd.engine.tts.model import load_tts, read_config, voice_embedding  # noqa: E402
from duplexd.engine.tts.words import Word, script_words  # noqa: E402
from tests.ref_models import reference_tts  # noqa: E402

FRAME_RATE = 12.5
# What moshi's `CheckpointInfo.from_hf_repo` takes out of config.json before the LM kwargs.
NOT_LM = ("moshi_name", "mimi_name", "tokenizer_name", "model_type", "tts_config", "model_id", "lm_gen_config")
TEXT = (
    "the quick brown fox jumps over the lazy dog while seven bakers sing about bread and summer rain falls on "
    "quiet streets near the old harbour where boats wait for morning light"
).split()


def scripts(model: DuplexdTTS, sessions: int, words: int) -> list[list[Word]]:
    return [
        script_words([" ".join(TEXT[(s * 3 + k) % len(TEXT)] for k in range(words))], model.tokenizer.encode)
        for s in range(sessions)
    ]


def duplexd_run(
    model: DuplexdTTS, voice: torch.Tensor, batch: list[list[Word]], n_q: int
) -> tuple[int, float, list[float], int]:
    """(stream-frames, seconds, time to first audio of each stream, steps) for the batch stepped together to its
    end, saying `n_q` codebooks."""
    gen = TTSGen(model.lm, model.conditioner, model.tts, num_slots=len(batch), n_q=n_q)
    audio_from = model.tts.delay_steps
    started = time.perf_counter()
    for slot, words in enumerate(batch):
        gen.start(slot, words, Voice((voice,)))
    frames = [0] * len(batch)
    first: list[float | None] = [None] * len(batch)
    live = list(range(len(batch)))
    steps = 0
    while live:
        _, valid = gen.step(live)
        steps += 1
        now = time.perf_counter() - started
        for slot, ok in zip(live, valid.tolist(), strict=True):
            if ok:
                frames[slot] += 1
                if frames[slot] == audio_from + 1:
                    first[slot] = now
        live = [slot for slot in live if not gen.done(slot)]  # a slot drops out when its text is said
    seconds = time.perf_counter() - started
    return sum(frames), seconds, [t for t in first if t is not None], steps


def reference_model(folder: Path, n_q: int) -> TTSModel:
    raw = read_config(folder)
    kwargs = {k: v for k, v in raw.items() if k not in NOT_LM}
    lm = loaders.get_moshi_lm(folder / raw["moshi_name"], lm_kwargs=kwargs, device="cpu", dtype=torch.float32)
    return reference_tts(lm.eval(), int(raw["tts_config"]["audio_delay"] * FRAME_RATE), n_q=n_q)


def reference_run(ref: TTSModel, voice_path: Path, batch: list[list[Word]]) -> tuple[int, float, list[float]]:
    entries = [[Entry(list(w.tokens), w.text, w.padding) for w in words] for words in batch]
    attributes = [ref.make_condition_attributes([voice_path], cfg_coef=2.0) for _ in batch]
    first: list[float] = []
    started = time.perf_counter()

    def on_frame(frame: torch.Tensor) -> None:
        if not first and bool((frame[:, 1:] >= 0).all()):
            first.append(time.perf_counter() - started)

    result = ref.generate(entries, attributes, on_frame=on_frame)
    seconds = time.perf_counter() - started
    return len(result.frames) * len(batch), seconds, first * len(batch)


def percentile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, round(q * (len(values) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="1,8", help="batch sizes (comma-separated)")
    parser.add_argument("--words", type=int, default=12, help="words per stream")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-q", default="32,24", help="codebooks said (comma-separated; the first is the baseline)")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sessions.split(",")]
    codebooks = [int(x) for x in args.n_q.split(",")]
    torch.set_num_threads(1)
    rows: list[tuple[int, int, float, float, float, float, float, float, float]] = []
    out: dict[str, object] = {"bench": "tts_streams"}
    baseline: dict[int, float] = {}  # stream-frames/s at the first n_q, by batch size
    with tempfile.TemporaryDirectory() as cache:
        folder = demo_tts_folder(Path(cache))
        model = load_tts(folder)
        voice_path = folder / "voices" / (DEMO_VOICES[0] + model.tts.voice_suffix)
        voice = voice_embedding(DEMO_VOICES[0], folder / "voices", model.tts)
        for q in codebooks:
            ref = reference_model(folder, q)
            for n in sizes:
                batch = scripts(model, n, args.words)
                on_own_thread(duplexd_run, model, voice, batch[:1], q, threads=args.threads)  # warm-up
                d_frames, d_s, d_first, steps = on_own_thread(duplexd_run, model, voice, batch, q, threads=args.threads)
                r_frames, r_s, r_first = on_own_thread(
                    reference_run, copy.deepcopy(ref), voice_path, batch, threads=args.threads
                )
                one_frames, one_s = 0, 0.0
                for words in batch:  # one by one, as an unbatched server would
                    f, s, _ = on_own_thread(
                        reference_run, copy.deepcopy(ref), voice_path, [words], threads=args.threads
                    )
                    one_frames, one_s = one_frames + f, one_s + s
                d_fps, r_fps, one_fps = d_frames / d_s, r_frames / r_s, one_frames / one_s
                p50, p99 = percentile(d_first, 0.5), percentile(d_first, 0.99)
                rows.append((q, n, d_fps, 1000 * d_s / steps, r_fps, one_fps, p50, p99, d_fps / one_fps))
                key = f"b{n}" if q == codebooks[0] else f"b{n}_q{q}"
                out |= {
                    f"duplexd_fps_{key}": round(d_fps, 1),
                    f"step_ms_{key}": round(1000 * d_s / steps, 2),
                    f"reference_fps_{key}": round(r_fps, 1),
                    f"reference_one_by_one_fps_{key}": round(one_fps, 1),
                    f"ratio_vs_one_by_one_{key}": round(d_fps / one_fps, 3),
                    f"ratio_vs_batched_{key}": round(d_fps / r_fps, 3),
                    f"ttfa_ms_p50_{key}": round(1000 * p50, 1),
                    f"ttfa_ms_p99_{key}": round(1000 * p99, 1),
                    f"reference_ttfa_ms_{key}": round(1000 * statistics.median(r_first), 1) if r_first else None,
                }
                if q != codebooks[0]:  # the same batch at the baseline's codebooks, on this machine, this run
                    out[f"fps_ratio_q{q}_vs_q{codebooks[0]}_b{n}"] = round(d_fps / baseline[n], 3)
                else:
                    baseline[n] = d_fps
    print(
        "| n_q | streams | duplexd stream-frames/s | step ms | real-time streams | moshi batched | moshi one by one "
        "| ratio vs one by one | TTFA p50 / p99 ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for q, n, d_fps, step_ms, r_fps, one_fps, p50, p99, ratio in rows:
        print(
            f"| {q} | {n} | {d_fps:.1f} | {step_ms:.1f} | {d_fps / FRAME_RATE:.2f} | {r_fps:.1f} | {one_fps:.1f} "
            f"| {ratio:.2f} | {1000 * p50:.0f} / {1000 * p99:.0f} |"
        )
    largest = max(sizes)
    out["ratio_vs_one_by_one"] = out[f"ratio_vs_one_by_one_b{largest}"]
    out["ttfa_ms_p50_b1"] = out.get("ttfa_ms_p50_b1", out[f"ttfa_ms_p50_b{min(sizes)}"])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
