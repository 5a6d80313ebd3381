"""`duplexd speak TEXT --out OUT.wav`: text to speech with a Kyutai TTS model (or the demo one), offline.

The words go through the same `TTSGen` the engine batches (one slot here), the audio frames after the model's
audio delay through Mimi's decoder, into a 24 kHz wav. `--tokens-out` writes one JSON line per frame as moshi's
`TTSModel.generate` returns `TTSResult.frames`: `{"frame": i, "text": muxed text id, "audio": [n_q codes]}`, the
first rows with -1 audio included.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import soundfile as sf
import torch

from duplexd.engine.devices import check_device
from duplexd.engine.errors import InputRefused
from duplexd.engine.models.mimi import MimiStreams
from duplexd.engine.tts.demo import DEMO_VOICES, demo_tts_folder
from duplexd.engine.tts.generate import TTSGen, Voice, generate
from duplexd.engine.tts.model import load_tts, voice_embedding
from duplexd.engine.tts.words import script_words
from duplexd.engine.weights.model_files import DTYPES

from .arguments import add_weights_dtype

logger = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    if (args.text is None) == (args.text_file is None):
        raise InputRefused("give the text to say, or --text-file, not both", "text")
    try:
        text = args.text if args.text is not None else Path(args.text_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputRefused(f"{args.text_file}: cannot read it ({e})", "text_file") from None
    device = check_device(args.device)
    demo = args.model == "demo-tts"
    folder = demo_tts_folder() if demo else Path(args.model)
    model = load_tts(folder, device=device, dtype=DTYPES[args.dtype], weights_dtype=args.weights_dtype, n_q=args.n_q)
    tts = model.tts
    voices = Path(args.voices) if args.voices else (folder / "voices" if (folder / "voices").is_dir() else None)
    voice = args.voice or (DEMO_VOICES[0] if demo else None)
    if voice is None:
        raise InputRefused("which voice: a name under --voices, or an embedding file", "voice")
    embedding = voice_embedding(voice, voices, tts)
    cfg_value = f"{args.cfg_coef:.1f}"
    if tts.cfg_values and cfg_value not in tts.cfg_values:
        raise InputRefused(f"{args.cfg_coef}: the model takes {', '.join(tts.cfg_values)}", "cfg_coef")
    words = script_words([text], model.tokenizer.encode, padding_between=args.padding_between)
    if not any(word.tokens for word in words):
        raise InputRefused("no words to say", "text")
    temperature = tts.temperature if args.temp is None else args.temp
    if temperature < 0:
        raise InputRefused(f"{temperature}: must be >= 0", "temp")
    gen = TTSGen(model.lm, model.conditioner, tts, num_slots=1, n_q=model.n_q)
    started = time.perf_counter()
    voice_values = (("control", "ok"), ("cfg", cfg_value))
    (result,) = generate(
        gen,
        [words],
        [Voice((embedding.to(device),), voice_values)],
        temperature=temperature,
        seed=args.seed,
        max_steps=args.max_steps,
    )
    elapsed = time.perf_counter() - started
    audio = torch.tensor([row[1:] for row in result.frames[tts.delay_steps :]], dtype=torch.long, device=device)
    streams = MimiStreams(model.mimi, 1)
    with torch.no_grad():
        pcm = streams.decode([0], audio.t()[None]) if len(audio) else torch.zeros(1, 0)
    sf.write(args.out, pcm[0].float().cpu().numpy(), model.mimi.cfg.sample_rate)
    if args.tokens_out:
        with open(args.tokens_out, "w", encoding="utf-8") as f:
            for i, row in enumerate(result.frames):
                f.write(json.dumps({"frame": i, "text": row[0], "audio": row[1:]}) + "\n")
    seconds = pcm.shape[-1] / model.mimi.cfg.sample_rate
    logger.info(
        "%d words, %.2f s of audio in %.2f s (%d frames; ended at step %s) into %s",
        sum(1 for w in words if w.tokens),
        seconds,
        elapsed,
        len(result.frames),
        result.end_step,
        args.out,
    )
    if result.end_step is None:
        logger.warning("the text did not end within %d steps: the audio is cut", args.max_steps)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("text", nargs="?", help="the text to say (or --text-file)")
    p.add_argument("--text-file", help="read the text from this UTF-8 file")
    p.add_argument(
        "--model", default="demo-tts", help="a Kyutai TTS folder (its config.json names its files) or demo-tts"
    )
    p.add_argument("--voice", help="a voice name under --voices (as kyutai/tts-voices names them) or an embedding file")
    p.add_argument("--voices", help="the voices folder (default: the model folder's voices/)")
    p.add_argument("--out", required=True, help="the wav file to write (24 kHz)")
    p.add_argument("--cfg-coef", type=float, default=2.0, help="the distilled model's CFG coefficient (1.0 to 4.0)")
    p.add_argument("--temp", type=float, help="sampling temperature (default: the model's, 0.6); 0 is greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--padding-between", type=int, default=1, help="padding steps forced after each word")
    p.add_argument("--max-steps", type=int, default=30000, help="frames at most (12.5 a second)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    add_weights_dtype(p)
    p.add_argument(
        "--n-q",
        type=int,
        help="audio codebooks to say (default: all the model's, as moshi-server's worker says them; fewer is "
        "quicker, as moshi's TTSModel(n_q=...))",
    )
    p.add_argument("--tokens-out", help="one JSON line per frame: frame, muxed text id, n_q audio codes")
