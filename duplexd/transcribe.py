"""`duplexd transcribe FILE`: a whole audio file as one utterance through the Gemma 4 transcriber, text printed.

The file goes through the same stream a live session uses (80 ms at a time), so this is also a smoke test of it.
Splitting long recordings at pauses (voice activity) is not done here: the reference drops audio past 30 s.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from duplexd.clients.audio import InputError as InputError  # the CLI reports it
from duplexd.clients.audio import read_audio
from duplexd.engine.devices import check_device
from duplexd.engine.errors import CheckpointError
from duplexd.engine.model_files import DTYPES
from duplexd.engine.transcriber import DEFAULT_PROMPT, SAMPLE_RATE, Transcriber, import_transformers, model_folder

logger = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    device = check_device(args.device)
    if args.max_new_tokens < 1:
        raise CheckpointError(f"{args.max_new_tokens}: must be at least 1", "max_new_tokens")
    pcm = read_audio(args.input, sample_rate=SAMPLE_RATE)
    import_transformers()
    folder = model_folder(args.model)
    try:
        transcriber = Transcriber.from_pretrained(
            folder, device=device, dtype=DTYPES[args.dtype], max_slots=1, max_new_tokens=args.max_new_tokens
        )
    except CheckpointError as e:
        e.option = e.option or "model"
        raise
    started = time.perf_counter()
    tokens = transcriber.transcribe(pcm, args.prompt)
    elapsed = time.perf_counter() - started
    sys.stdout.write(transcriber.text(tokens) + "\n")
    logger.info("%.2f s of audio, %d tokens in %.2f s", len(pcm) / SAMPLE_RATE, len(tokens), elapsed)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transcribe", help="transcribe an audio file with Gemma 4 (one utterance, at most 30 s)")
    p.add_argument("input", help="input audio (any format soundfile reads, any rate; stereo is down-mixed)")
    p.add_argument("--model", default="demo", help="Gemma 4 folder in Hugging Face layout, or `demo` (default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the instruction that follows the audio")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.set_defaults(func=run)
