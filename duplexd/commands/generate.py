"""`duplexd generate`: the LM alone on random user audio codes, printing the text it writes."""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from duplexd.engine.devices import check_device
from duplexd.engine.dialogue.lm_gen import LMGen
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.models.config import ConfigError
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.weights.checkpoint import load_lm
from duplexd.engine.weights.demo import ensure_demo
from duplexd.engine.weights.model_files import check_lm_files, check_tokenizer_file

logger = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    """Run the LM for N frames on random user codes and print the text it writes."""
    if args.weights is None:
        demo = ensure_demo()
        args.weights, args.config, args.tokenizer = demo.lm, args.config or demo.config, demo.tokenizer
        logger.warning("using the demo model: random weights, its text is a jumble of word pieces")
    if args.frames < 1:
        raise ConfigError(f"--frames {args.frames}: must be at least 1")
    device = check_device(args.device)
    try:
        params = SamplingParams(
            args.text_temperature, args.text_topk, args.audio_temperature, args.audio_topk, args.seed
        )
    except ConfigError as e:
        raise ConfigError(f"--text-temperature, --text-topk, --audio-temperature, --audio-topk: {e}") from None
    cfg = check_lm_files(str(args.weights), args.config and str(args.config), option="weights")
    if args.tokenizer:
        check_tokenizer_file(str(args.tokenizer), cfg)
    model = load_lm(args.weights, args.config, device=device)
    tokenizer = TextTokenizer(args.tokenizer) if args.tokenizer else None
    gen = LMGen(model, num_slots=1)
    gen.reset(0, params)
    codes = torch.randint(
        0,
        model.cfg.card,
        (args.frames, model.cfg.num_user_codebooks),
        generator=torch.Generator().manual_seed(args.seed),
        device="cpu",
    ).to(device)
    slot = torch.tensor([0], device=device)
    started = time.perf_counter()
    pad = set(model.cfg.silent_text_ids)
    for frame in range(args.frames):
        out = gen.step(slot, codes[frame : frame + 1])
        if out.valid[0]:
            text = int(out.tokens[0, 0])
            if text not in pad:
                sys.stdout.write(tokenizer.piece(text) if tokenizer else f"<{text}>")
                sys.stdout.flush()
    elapsed = time.perf_counter() - started
    sys.stdout.write("\n")
    logger.info("%d frames in %.2f s (%.1f ms/frame)", args.frames, elapsed, 1000 * elapsed / args.frames)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", help="LM weights: path, hf://org/repo/file or repo id (default: demo model)")
    p.add_argument("--config", help="reference config.json (default: the one beside the weights)")
    p.add_argument("--tokenizer", help="sentencepiece model to print text with")
    p.add_argument("--frames", type=int, default=50, help="frames of 80 ms to generate")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text-temperature", type=float, default=0.7)
    p.add_argument("--text-topk", type=int, default=25)
    p.add_argument("--audio-temperature", type=float, default=0.8)
    p.add_argument("--audio-topk", type=int, default=250)
