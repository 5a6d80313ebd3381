"""CPU benchmark: time from the end of speech to the finished transcript, duplexd's streamed Gemma 4 against
`transformers` on the whole utterance, and the streaming tower's cost per session-second.

Why: duplexd's `Transcriber` runs the audio tower while the user speaks (`feed`, one 80 ms step at a time), so when
speech stops only the last step or two, the prompt prefill and the decoding remain. `transformers` has to start
from the raw audio then. This measures that difference on the real tower size.

Model: a random `Gemma4ForConditionalGeneration` with the E2B audio tower (transformers' `Gemma4AudioConfig()`
defaults, as bench/gemma4_audio.py: 12 x 1024 conformer), a small text decoder (256 x 4 layers by default) and the
demo tokenizer, perturbed as the demo (`gemma4_demo.perturb_`), saved with `save_pretrained` to a temporary folder
and loaded from it by both sides, fp32. Audio: `clients.audio.speech_like` (voiced syllables with a gliding pitch,
three formants, pauses, a little noise), 16 kHz.

Latency, per utterance length, median of --iters interleaved rounds after one untimed round:

* duplexd: all chunks but the last are fed before the clock starts (that happens while the user speaks); timed
  are the `feed` of the final 80 ms chunk (it encodes the step held back until a sample after it existed) and
  `finish` (encode the tail, build the prompt, greedy decoding).
* reference: `Gemma4Processor.apply_chat_template` on the whole utterance (feature extractor, chat template, audio
  token expansion) and `generate(do_sample=False)`, which runs the tower on all of it.

Both decode exactly --new-tokens tokens: no token ends the transcript on either side (`generate(eos_token_id=None)`,
the transcriber's `eos_token_ids = []`), so decoding costs the same and the ratio isolates the encoder. Every round
checks that both sides produced the same token ids.

Streaming: --stream-sessions streams fed in lockstep 80 ms steps, either one `Transcriber.feed` per stream and
step, or one batched `encoder.encode_step` per step for all of them; reported as ms of wall time per
session-second of audio.

The last line printed is one JSON object.

    python bench/transcribe_latency.py [--seconds 2 5 10] [--iters 3] [--threads 2] [--new-tokens 16]
                                       [--stream-sessions 8] [--stream-steps 12]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    Gemma4AudioConfig,
    Gemma4AudioFeatureExtractor,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessorPil,
    Gemma4Processor,
    Gemma4TextConfig,
)

from bench.common import clocked, interleaved  # noqa: E402
from duplexd.clients.audio import speech_like  # noqa: E402
from duplexd.engine.transcription.transcriber import DEFAULT_PROMPT, SAMPLE_RATE, STEP_SAMPLES, Transcriber  # noqa: E402
from duplexd.engine.weights.gemma4_demo import build_tokenizer, perturb_, tiny_config  # noqa: E402

STEP_S = STEP_SAMPLES / SAMPLE_RATE


class AudioProcessor(Gemma4Processor):
    """The real processor without a video processor (that one needs torchvision; audio never uses it)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)


def write_model(folder: Path, args: argparse.Namespace, seed: int = 0) -> None:
    """The random Gemma 4 (E2B audio tower, small text decoder), tokenizer and feature extractor, HF layout."""
    corpus = (resources.files("duplexd.engine.weights") / "data" / "demo_corpus.txt").read_text(encoding="utf-8")
    tokenizer = build_tokenizer(corpus.splitlines())
    config = tiny_config(tokenizer)  # the demo's special tokens; its towers are replaced below
    demo_text = config.text_config
    heads = 4
    config.text_config = Gemma4TextConfig(
        vocab_size=demo_text.vocab_size,
        vocab_size_per_layer_input=demo_text.vocab_size,
        hidden_size=args.text_hidden,
        intermediate_size=4 * args.text_hidden,
        num_hidden_layers=args.text_layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=args.text_hidden // heads,
        global_head_dim=args.text_hidden // heads,  # type: ignore[call-arg]  # read by __post_init__
        hidden_size_per_layer_input=16,
        layer_types=["sliding_attention"] * (args.text_layers - 1) + ["full_attention"],
        pad_token_id=demo_text.pad_token_id,
        eos_token_id=demo_text.eos_token_id,
        bos_token_id=demo_text.bos_token_id,
    )
    # E2B's audio tower is transformers' default (12 x 1024); the sizes are explicit so a test can shrink them.
    config.audio_config = Gemma4AudioConfig(hidden_size=args.audio_hidden, num_hidden_layers=args.audio_layers)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).eval()
    perturb_(model, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Gemma4AudioFeatureExtractor().save_pretrained(folder)


def load_reference(folder: Path) -> tuple[AudioProcessor, Any]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = AudioProcessor(
        feature_extractor=Gemma4AudioFeatureExtractor.from_pretrained(folder),
        image_processor=Gemma4ImageProcessorPil(),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )
    model = Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return processor, model


Parts = dict[str, float]


@torch.inference_mode()
def reference_latency(processor: AudioProcessor, model: Any, wave: np.ndarray, new_tokens: int) -> tuple[Parts, list]:
    """Processor + `generate` on the whole utterance: (seconds per part, new token ids)."""
    content = [{"type": "audio", "audio": wave}, {"type": "text", "text": DEFAULT_PROMPT}]
    messages: Any = [{"role": "user", "content": content}]  # transformers' annotation allows text content only
    t0 = time.perf_counter()
    inputs: Any = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="pt"
    )
    t1 = time.perf_counter()
    out = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens, eos_token_id=None)
    t2 = time.perf_counter()
    tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
    return {"processor": t1 - t0, "generate": t2 - t1, "total": t2 - t0}, tokens


def duplexd_latency(tr: Transcriber, wave: np.ndarray) -> tuple[Parts, list]:
    """All chunks but the last fed off the clock; the last `feed` and `finish` timed: (seconds per part, ids)."""
    chunks = [wave[i : i + STEP_SAMPLES] for i in range(0, len(wave), STEP_SAMPLES)]
    slot = tr.open_stream()
    try:
        for chunk in chunks[:-1]:
            tr.feed(slot, chunk)
        t0 = time.perf_counter()
        tr.feed(slot, chunks[-1])
        t1 = time.perf_counter()
        tokens = tr.finish(slot)
        t2 = time.perf_counter()
    finally:
        tr.close(slot)
    return {"last_feed": t1 - t0, "finish": t2 - t1, "total": t2 - t0}, tokens


def mismatch(seconds: float, ours: list, ref: list) -> str | None:
    """A line describing where the two sides' token ids differ, or None."""
    if ours == ref:
        return None
    first = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))
    return f"TOKEN MISMATCH at {seconds:g} s (first at index {first}): duplexd {ours} reference {ref}"


def latency(tr: Transcriber, processor: AudioProcessor, model: Any, seconds: float, new_tokens: int, iters: int):
    """Median seconds of each part per side over the interleaved rounds, and the rounds' token mismatches."""
    wave = speech_like(seconds, seed=round(seconds * 10), sample_rate=SAMPLE_RATE)
    ours, ref = interleaved(
        [lambda: duplexd_latency(tr, wave), lambda: reference_latency(processor, model, wave, new_tokens)], iters
    )
    problems = {m for (_, a), (_, b) in zip(ours, ref, strict=True) if (m := mismatch(seconds, a, b))}
    medians = [{k: statistics.median(parts[k] for parts, _ in side) for k in side[0][0]} for side in (ours, ref)]
    return medians[0], medians[1], sorted(problems)


def streaming(tr: Transcriber, sessions: int, steps: int, iters: int) -> tuple[float, float]:
    """Wall seconds for `steps` 80 ms steps of `sessions` streams: (one `feed` per stream, one batched step)."""
    waves = np.stack([speech_like((steps + 1) * STEP_S, seed=s, sample_rate=SAMPLE_RATE) for s in range(sessions)])
    waves = waves[:, : (steps + 1) * STEP_SAMPLES]
    encoder = tr.encoder

    def per_slot() -> None:
        slots = [tr.open_stream() for _ in range(sessions)]
        # steps + 1 chunks: `feed` holds each step back until the next chunk, so this encodes `steps` steps.
        for i in range(steps + 1):
            for row, slot in enumerate(slots):
                tr.feed(slot, waves[row, i * STEP_SAMPLES : (i + 1) * STEP_SAMPLES])
        for slot in slots:
            tr.close(slot)

    state = encoder.new_stream_state(sessions)
    pcm = torch.from_numpy(waves)
    slots = list(range(sessions))

    def batched() -> None:
        state.reset()
        for i in range(steps):
            encoder.encode_step(state, slots, pcm[:, i * STEP_SAMPLES : (i + 1) * STEP_SAMPLES])

    a, b = interleaved([clocked(per_slot), clocked(batched)], iters)
    return statistics.median(a), statistics.median(b)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, nargs="+", default=[2.0, 5.0, 10.0], help="utterance lengths")
    ap.add_argument("--iters", type=int, default=3, help="timed rounds per case (after one untimed round)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens decoded by both sides")
    ap.add_argument("--stream-sessions", type=int, default=8, help="streams fed in lockstep (0 = skip)")
    ap.add_argument("--stream-steps", type=int, default=12, help="80 ms steps per streaming run")
    ap.add_argument("--audio-hidden", type=int, default=1024, help="audio tower width (E2B: 1024)")
    ap.add_argument("--audio-layers", type=int, default=12, help="audio tower depth (E2B: 12)")
    ap.add_argument("--text-hidden", type=int, default=256)
    ap.add_argument("--text-layers", type=int, default=4)
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    with tempfile.TemporaryDirectory(prefix="transcribe-latency-") as tmp:
        return run(Path(tmp), args)


def run(folder: Path, args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    write_model(folder, args)
    processor, model = load_reference(folder)
    tr = Transcriber.from_pretrained(folder, max_slots=max(args.stream_sessions, 1), max_new_tokens=args.new_tokens)
    tr.eos_token_ids = []  # as generate(eos_token_id=None): exactly --new-tokens tokens
    n_audio = sum(p.numel() for p in model.model.audio_tower.parameters()) / 1e6
    print(f"model written and loaded in {time.perf_counter() - t0:.1f} s (audio tower {n_audio:.1f} M params)")

    mismatches: list[str] = []
    result: dict[str, Any] = {
        "bench": "transcribe_latency",
        "threads": args.threads,
        "iters": args.iters,
        "new_tokens": args.new_tokens,
        "audio_tower": f"{args.audio_hidden}x{args.audio_layers}",
        "text_decoder": f"{args.text_hidden}x{args.text_layers}",
    }
    rows = []
    for sec in args.seconds:
        dx, ref, problems = latency(tr, processor, model, sec, args.new_tokens, args.iters)
        for line in problems:
            print(line, flush=True)
        mismatches += problems
        key = f"{sec:g}s"
        rows.append((key, dx, ref))
        result[f"ratio_{key}"] = round(dx["total"] / ref["total"], 3)
        result[f"duplexd_ms_{key}"] = {k: round(1000 * v, 1) for k, v in dx.items()}
        result[f"reference_ms_{key}"] = {k: round(1000 * v, 1) for k, v in ref.items()}

    print()
    print(
        f"{'utterance':>9} {'duplexd ms':>11} {'(last feed + finish)':>21} {'reference ms':>13} "
        f"{'(processor + generate)':>23} {'ratio':>6}"
    )
    for key, dx, ref in rows:
        split_dx = f"{1000 * dx['last_feed']:.0f} + {1000 * dx['finish']:.0f}"
        split_ref = f"{1000 * ref['processor']:.0f} + {1000 * ref['generate']:.0f}"
        print(
            f"{key:>9} {1000 * dx['total']:>11.0f} {split_dx:>21} {1000 * ref['total']:>13.0f} {split_ref:>23} "
            f"{dx['total'] / ref['total']:>6.3f}"
        )

    if args.stream_sessions:
        sessions, steps = args.stream_sessions, args.stream_steps
        per_slot, batched = streaming(tr, sessions, steps, args.iters)
        session_s = sessions * steps * STEP_S
        print()
        print(f"streaming, {sessions} sessions x {steps} steps: ms wall per session-second (ms per 80 ms step)")
        for name, wall in (("one feed per session", per_slot), ("one batched encode_step", batched)):
            print(f"  {name:<24} {1000 * wall / session_s:>8.1f}   ({1000 * wall / steps:.0f})")
        result["stream"] = {
            "sessions": sessions,
            "steps": steps,
            "per_slot_ms_per_session_s": round(1000 * per_slot / session_s, 1),
            "batched_ms_per_session_s": round(1000 * batched / session_s, 1),
            "per_slot_ms_per_step": round(1000 * per_slot / steps, 1),
            "batched_ms_per_step": round(1000 * batched / steps, 1),
        }

    result["tokens_match"] = not mismatches
    print(json.dumps(result))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
