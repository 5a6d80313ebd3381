"""CPU benchmark: duplexd's Gemma 4 audio encoder vs `transformers`, real E2B config (unless `--hidden`/`--layers`
say otherwise), same random weights.

Reports seconds of audio encoded per second of wall time (higher is better):

* whole utterance, one file at a time, and one right-padded batch of files of different lengths: raw 16 kHz
  audio -> tower output, front end included on both sides (HF: `Gemma4AudioFeatureExtractor` +
  `Gemma4AudioModel`; duplexd: `Gemma4AudioEncoder.encode`);
* streaming, 1 and N slots, 80 ms per step: duplexd's `encode_step` (exact, per-slot state). `transformers` has no
  streaming encoder; its baseline is the cheapest thing it can do per step, one stateless forward over the step's
  8 mel frames for all slots (features precomputed, not timed). That baseline is *not* exact (no left context),
  so the streaming ratio is a lower bound on the real advantage.

The last line printed is one JSON object with the figures and ratios.

    python bench/gemma4_audio.py [--seconds 3 10 30] [--batch 2 5 10 20] [--iters 3] [--stream-steps 25]
                                 [--slots 1 8] [--threads N] [--hidden 1024 --layers 12]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import Gemma4AudioConfig as HFAudioConfig  # noqa: E402
from transformers import Gemma4AudioFeatureExtractor, Gemma4AudioModel  # noqa: E402

from bench.common import timed_pair  # noqa: E402
from duplexd.engine.models.gemma4_audio import Gemma4AudioConfig, Gemma4AudioEncoder  # noqa: E402

CHUNK = 1280  # 80 ms at 16 kHz


@torch.no_grad()
def build(hidden: int, layers: int, seed: int = 0) -> tuple[Gemma4AudioModel, Gemma4AudioEncoder]:
    torch.manual_seed(seed)
    hc = HFAudioConfig(hidden_size=hidden, num_hidden_layers=layers)
    hf = Gemma4AudioModel(hc).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in hf.named_parameters():  # realistic, non-trivial values: clamps and scales do work
        if name.endswith("per_dim_scale"):
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    for name, b in hf.named_buffers():
        if name.endswith(("input_min", "output_min")):
            b.fill_(-8.0)
        elif name.endswith(("input_max", "output_max")):
            b.fill_(8.0)
    ours = Gemma4AudioEncoder(Gemma4AudioConfig.from_hf(hc, text_hidden_size=None)).eval()
    ours.load_state_dict({f"audio_tower.{k}": v for k, v in hf.state_dict().items()})
    return hf, ours.prepare()


def audio(seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    t = np.arange(n) / 16000
    return (0.1 * rng.standard_normal(n) + 0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, nargs="+", default=[3.0, 10.0, 30.0], help="utterance lengths")
    ap.add_argument(
        "--batch",
        type=float,
        nargs="*",
        default=[2.0, 5.0, 10.0, 20.0],
        help="lengths of one padded batch of files (nothing = skip the batch case)",
    )
    ap.add_argument("--iters", type=int, default=3, help="timed calls per case (after one warm-up)")
    ap.add_argument("--stream-steps", type=int, default=25, help="80 ms steps per streaming run")
    ap.add_argument("--slots", type=int, nargs="*", default=[1, 8], help="streaming batch sizes (nothing = skip)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=1024, help="tower width (E2B: 1024)")
    ap.add_argument("--layers", type=int, default=12, help="tower depth (E2B: 12)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    t0 = time.perf_counter()
    hf, ours = build(args.hidden, args.layers)
    fe = Gemma4AudioFeatureExtractor()
    print(
        f"built models ({sum(p.numel() for p in hf.parameters()) / 1e6:.1f} M params) "
        f"in {time.perf_counter() - t0:.1f} s"
    )

    rows: list[tuple[str, float, float]] = []
    tower = f"{args.hidden}x{args.layers}"
    result: dict = {
        "bench": "gemma4_audio",
        "tower": tower,
        "threads": torch.get_num_threads(),
        "whole": {},
        "stream": {},
    }
    with torch.inference_mode():
        for sec in args.seconds:
            w = audio(sec)
            wt = torch.from_numpy(w)

            def run_hf(w=w):
                inp = fe([w], return_tensors="pt")
                return hf(inp["input_features"], inp["input_features_mask"]).last_hidden_state

            def run_ours(wt=wt):
                return ours.encode([wt]).hidden

            a, b = run_hf(), run_ours()
            err = float((a - b).abs().max() / a.abs().max())
            t_hf, t_ours = timed_pair(run_hf, run_ours, args.iters)
            rows.append((f"whole {sec:g} s", sec / t_hf, sec / t_ours))
            result["whole"][f"{sec:g}s"] = {
                "hf_audio_s_per_s": round(sec / t_hf, 3),
                "duplexd_audio_s_per_s": round(sec / t_ours, 3),
                "ratio": round(t_hf / t_ours, 3),
                "max_rel_err": float(f"{err:.2e}"),
            }

        if args.batch:
            ws = [audio(sec, seed=i) for i, sec in enumerate(args.batch)]

            def run_hf_batch(ws=ws):
                inp = fe(ws, return_tensors="pt")
                return hf(inp["input_features"], inp["input_features_mask"]).last_hidden_state

            wts = [torch.from_numpy(w) for w in ws]

            def run_ours_batch(wts=wts):
                return ours.encode(wts).hidden

            t_hf, t_ours = timed_pair(run_hf_batch, run_ours_batch, max(1, args.iters - 1))
            sec = sum(args.batch)
            name = "batch " + "+".join(f"{x:g}" for x in args.batch) + " s"
            rows.append((name, sec / t_hf, sec / t_ours))
            result["batch"] = {
                "seconds": args.batch,
                "hf_audio_s_per_s": round(sec / t_hf, 3),
                "duplexd_audio_s_per_s": round(sec / t_ours, 3),
                "ratio": round(t_hf / t_ours, 3),
            }

        steps = args.stream_steps
        for slots in args.slots:
            ws = [audio(steps * CHUNK / 16000, seed=s) for s in range(slots)]
            pcm = torch.from_numpy(np.stack(ws))
            state = ours.new_stream_state(slots)
            idx = torch.arange(slots)

            def run_stream(pcm=pcm, state=state, idx=idx):
                state.reset()
                for i in range(steps):
                    ours.encode_step(state, idx, pcm[:, i * CHUNK : (i + 1) * CHUNK])

            feats = [
                fe([w[i * CHUNK : (i + 1) * CHUNK] for w in ws], return_tensors="pt")["input_features"]
                for i in range(steps)
            ]
            # HF's extractor yields 7 frames for an isolated 1280-sample chunk; pad to the 8 a stream step has.
            feats = [torch.nn.functional.pad(f, (0, 0, 0, 8 - f.shape[1])) for f in feats]

            def run_hf_chunks(feats=feats):
                for f in feats:
                    hf(f)

            sec = slots * steps * CHUNK / 16000
            t_hf, t_ours = timed_pair(run_hf_chunks, run_stream, max(1, args.iters - 1))
            rows.append((f"stream {slots} slot{'s' if slots > 1 else ''}", sec / t_hf, sec / t_ours))
            result["stream"][f"{slots}_slots"] = {
                "hf_audio_s_per_s": round(sec / t_hf, 3),
                "duplexd_audio_s_per_s": round(sec / t_ours, 3),
                "ratio": round(t_hf / t_ours, 3),
                "ms_per_step": round(1000 * t_ours / steps, 1),
            }

    print()
    print(f"{'case':<24}{'transformers':>14}{'duplexd':>12}{'ratio':>9}   (audio seconds per second)")
    for name, h, o in rows:
        print(f"{name:<24}{h:>14.2f}{o:>12.2f}{o / h:>8.2f}x")
    result["whole_ratios"] = {k: v["ratio"] for k, v in result["whole"].items()}
    if "batch" in result:
        result["batch_ratio"] = result["batch"]["ratio"]
    result["stream_ratios"] = {k: v["ratio"] for k, v in result["stream"].items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
