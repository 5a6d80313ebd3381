"""Per-frame LM step time, duplexd against the reference `moshi` LMGen, same random weights, CPU fp32.

Usage: python bench/lm_step.py [--frames 30] [--warmup 5] [--threads 2] [--kv-dtype bf16|int8|fp8]
Prints a table and, as its last line, one JSON object with the figures and ratios (duplexd / reference).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("NO_TORCH_COMPILE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from moshi.models.lm import LMGen as RefLMGen  # noqa: E402

from bench.common import MID_LM, median_ms, parse_args, side_by_side, through_checkpoint  # noqa: E402
from duplexd.engine.dialogue.lm_gen import LMGen  # noqa: E402
from duplexd.engine.dialogue.sampling import SamplingParams  # noqa: E402
from duplexd.engine.models.config import DEMO  # noqa: E402
from duplexd.engine.weights.checkpoint import load_lm  # noqa: E402
from tests.ref_models import reference_lm  # noqa: E402

# The reference LMGen defaults, used on both sides.
PARAMS = SamplingParams(text_temperature=0.7, text_topk=25, audio_temperature=0.8, audio_topk=250)


@torch.no_grad()
def run(batch: int, ref_lm, model, frames: int, warmup: int, kv_dtype: str) -> tuple[float, float]:
    config = model.cfg
    codes = torch.randint(
        0,
        config.card,
        (frames + warmup, batch, config.num_user_codebooks),
        generator=torch.Generator().manual_seed(batch),
    )
    ref = RefLMGen(
        ref_lm,
        temp=PARAMS.audio_temperature,
        top_k=PARAMS.audio_topk,
        temp_text=PARAMS.text_temperature,
        top_k_text=PARAMS.text_topk,
    )
    with ref.streaming(batch):
        ref_ms = median_ms(lambda c: ref.step(c[:, :, None]), codes, warmup)
    gen = LMGen(model, num_slots=batch, kv_dtype=kv_dtype)
    for slot in range(batch):
        gen.reset(slot, PARAMS)
    slots = torch.arange(batch)
    dx_ms = median_ms(lambda c: gen.step(slots, c), codes, warmup)
    return dx_ms, ref_ms


def main() -> None:
    args = parse_args(__doc__, kv_dtype=True, small=True)
    config = DEMO if args.small else MID_LM

    ref_lm = reference_lm(config, seed=0)
    model = through_checkpoint(ref_lm.state_dict(), lambda path: load_lm(path, config))

    result: dict[str, object] = {"bench": "lm_step", "kv_dtype": args.kv_dtype}
    print(
        f"LM step, CPU fp32, KV {args.kv_dtype}, {args.threads} threads, median of {args.frames} frames after "
        f"{args.warmup} warm-up"
    )
    print(
        f"config: dim {config.dim} x {config.num_layers} layers, depformer {config.depformer_dim} x "
        f"{config.depformer_num_layers}, text_card {config.text_card}, context {config.context}"
    )
    side_by_side(lambda batch: run(batch, ref_lm, model, args.frames, args.warmup, args.kv_dtype), result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
