"""Real-time text-to-speech streams on the CPU: duplexd's batched TTS generation against moshi's `TTSModel`.

Usage: python bench/tts_streams.py [--sessions 1,8] [--words 12] [--threads 2]
The demo TTS model (Kyutai TTS's layout and every mechanism, tiny: `duplexd speak --model demo-tts`) on both sides,
its files loaded by duplexd and by moshi 0.2.13, fp32, greedy. Each stream says its own script (`--words` words) in
a demo voice. duplexd: N streams in `TTSGen`, stepped as one batch. Reference: `TTSModel.generate` at batch N (the
N scripts in step), and at batch 1, the N scripts one after another, as a server without batching would. A
stream-frame is one 80 ms frame of one stream (temporal step, text, 32-step DepFormer; Mimi is not run on either
side); 12.5 stream-frames a second hold one real-time stream. Time to first audio: from the start of a batch to
the first frame that carries audio (the model's audio delay of 16 frames plus the 2-frame codebook delay, computed
as fast as the machine goes), p50 and p99 over the batch's streams. Prints a table and, last, one JSON object.
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


def duplexd_run(model: DuplexdTTS, voice: torch.Tensor, batch: list[list[Word]]) -> tuple[int, float, list[float]]:
    """(stream-frames, seconds, time to first audio of each stream) for the batch stepped together to its end."""
    gen = TTSGen(model.lm, model.conditioner, model.tts, num_slots=len(batch))
    audio_from = model.tts.delay_steps
    started = time.perf_counter()
    for slot, words in enumerate(batch):
        gen.start(slot, words, Voice((voice,)))
    frames = [0] * len(batch)
    first: list[float | None] = [None] * len(batch)
    live = list(range(len(batch)))
    while live:
        _, valid = gen.step(live)
        now = time.perf_counter() - started
        for slot, ok in zip(live, valid.tolist(), strict=True):
            if ok:
                frames[slot] += 1
                if frames[slot] == audio_from + 1:
                    first[slot] = now
        live = [slot for slot in live if not gen.done(slot)]  # a slot drops out when its text is said
    seconds = time.perf_counter() - started
    return sum(frames), seconds, [t for t in first if t is not None]


def reference_model(folder: Path) -> TTSModel:
    raw = read_config(folder)
    kwargs = {k: v for k, v in raw.items() if k not in NOT_LM}
    lm = loaders.get_moshi_lm(folder / raw["moshi_name"], lm_kwargs=kwargs, device="cpu", dtype=torch.float32)
    return reference_tts(lm.eval(), int(raw["tts_config"]["audio_delay"] * FRAME_RATE))


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
    args = parser.parse_args()
    sizes = [int(x) for x in args.sessions.split(",")]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        folder = demo_tts_folder(Path(cache))
        model = load_tts(folder)
        voice_path = folder / "voices" / (DEMO_VOICES[0] + model.tts.voice_suffix)
        voice = voice_embedding(DEMO_VOICES[0], folder / "voices", model.tts)
        ref = reference_model(folder)
        rows: list[tuple[int, float, float, float, float, float]] = []
        out: dict[str, object] = {"bench": "tts_streams"}
        for n in sizes:
            batch = scripts(model, n, args.words)
            on_own_thread(duplexd_run, model, voice, batch[:1], threads=args.threads)  # warm-up
            d_frames, d_s, d_first = on_own_thread(duplexd_run, model, voice, batch, threads=args.threads)
            r_frames, r_s, r_first = on_own_thread(
                reference_run, copy.deepcopy(ref), voice_path, batch, threads=args.threads
            )
            one_frames, one_s = 0, 0.0
            for words in batch:  # one by one, as an unbatched server would
                f, s, _ = on_own_thread(reference_run, copy.deepcopy(ref), voice_path, [words], threads=args.threads)
                one_frames, one_s = one_frames + f, one_s + s
            d_fps, r_fps, one_fps = d_frames / d_s, r_frames / r_s, one_frames / one_s
            rows.append((n, d_fps, r_fps, one_fps, percentile(d_first, 0.5), percentile(d_first, 0.99)))
            out |= {
                f"duplexd_fps_b{n}": round(d_fps, 1),
                f"reference_fps_b{n}": round(r_fps, 1),
                f"reference_one_by_one_fps_{n}": round(one_fps, 1),
                f"ratio_vs_one_by_one_b{n}": round(d_fps / one_fps, 3),
                f"ratio_vs_batched_b{n}": round(d_fps / r_fps, 3),
                f"ttfa_ms_p50_b{n}": round(1000 * percentile(d_first, 0.5), 1),
                f"ttfa_ms_p99_b{n}": round(1000 * percentile(d_first, 0.99), 1),
                f"reference_ttfa_ms_b{n}": round(1000 * statistics.median(r_first), 1) if r_first else None,
            }
    print(
        "| streams | duplexd stream-frames/s | real-time streams | moshi batched | moshi one by one "
        "| ratio vs one by one | TTFA p50 / p99 ms |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, d_fps, r_fps, one_fps, p50, p99 in rows:
        print(
            f"| {n} | {d_fps:.1f} | {d_fps / FRAME_RATE:.2f} | {r_fps:.1f} | {one_fps:.1f} | {d_fps / one_fps:.2f} "
            f"| {1000 * p50:.0f} / {1000 * p99:.0f} |"
        )
    largest = max(sizes)
    out["ratio_vs_one_by_one"] = out[f"ratio_vs_one_by_one_b{largest}"]
    out["ttfa_ms_p50_b1"] = out.get("ttfa_ms_p50_b1", out[f"ttfa_ms_p50_b{min(sizes)}"])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
