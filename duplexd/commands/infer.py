"""`duplexd infer IN OUT.wav`: a whole file through the streaming pipeline, frame by frame, as the server does."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from duplexd.clients.audio import InputError, read_audio
from duplexd.engine.devices import check_device, check_kv_dtype
from duplexd.engine.dialogue.pipeline import Pipeline
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.errors import InputRefused
from duplexd.engine.kv.dtypes import KV_DTYPES
from duplexd.engine.models.config import MIMI_PRESETS, ConfigError
from duplexd.engine.models.lm import LMModel
from duplexd.engine.models.mimi import MimiModel
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.persona.prompt import PersonaPrompt, check_persona_model, role_prompt
from duplexd.engine.persona.voices import VoiceError, load_voice
from duplexd.engine.weights.checkpoint import load_lm, load_mimi, mimi_ring_rule
from duplexd.engine.weights.hub import resolve_file
from duplexd.engine.weights.model_files import DTYPES, TOKENIZER_NAME, ModelFiles, check_model_files, model_files
from duplexd.wire import split_frames

from .arguments import add_weights_dtype

logger = logging.getLogger(__name__)


def check_paths(args: argparse.Namespace) -> None:
    """The input readable as audio and the outputs' folders there, before minutes of model loading."""
    try:
        sf.info(str(args.input))
    except (sf.LibsndfileError, RuntimeError, OSError) as e:
        raise InputError(f"cannot read audio from {args.input}: {e}") from None
    for name, path in (("output", args.output), ("--tokens-out", args.tokens_out)):
        if path and not Path(path).expanduser().resolve().parent.is_dir():
            raise InputError(f"{name} {path}: its directory does not exist")


def check_prompt_options(args: argparse.Namespace) -> None:
    """A persona prompt is a voice and a role text, given together; the text not empty, the voice file there."""
    text, voice = args.text_prompt, args.voice_prompt
    if text is None and voice is None:
        return
    if voice is None:
        raise InputRefused("needs --voice-prompt too: a PersonaPlex prompt is a voice and a role text", "text_prompt")
    if text is None:
        raise InputRefused("needs --text-prompt too: a PersonaPlex prompt is a voice and a role text", "voice_prompt")
    if not text.strip():
        raise InputRefused("is empty", "text_prompt")
    if not Path(voice).expanduser().is_file():
        raise InputRefused(f"voice file not found: {voice}", "voice_prompt")


def persona_prompt(
    args: argparse.Namespace, lm: LMModel, mimi: MimiModel, tokenizer: TextTokenizer
) -> PersonaPrompt | None:
    """The session's PersonaPlex prompt from --voice-prompt and --text-prompt (None without them)."""
    cfg = lm.cfg
    if args.text_prompt is None:
        if cfg.predicts_user_audio:
            logger.warning("a PersonaPlex model without --text-prompt and --voice-prompt: no persona prompt is run")
        return None
    check_persona_model(cfg)  # before the voice is read: the model is the first thing wrong
    try:
        voice = load_voice(Path(args.voice_prompt).expanduser(), mimi, cfg)
    except VoiceError as e:
        raise InputRefused(str(e), "voice_prompt") from None
    return role_prompt(cfg, voice, args.text_prompt, tokenizer.encode)


def prepare(args: argparse.Namespace) -> tuple[str, ModelFiles, SamplingParams]:
    """Every check that needs no model: the device, the input and output paths, sampling, the model files."""
    device = check_device(args.device)
    check_kv_dtype(args.kv_dtype, device)
    check_paths(args)
    check_prompt_options(args)
    try:
        params = SamplingParams(args.temp_text, args.topk_text, args.temp, args.topk, args.seed)
    except ConfigError as e:
        raise ConfigError(f"--temp, --temp-text, --topk, --topk-text: {e}") from None
    files = model_files(
        moshi_weight=args.moshi_weight,
        mimi_weight=args.mimi_weight,
        tokenizer=args.tokenizer,
        config=args.config,
        hf_repo=args.hf_repo,
        mimi_preset=args.mimi_preset,
    )
    check_model_files(files)
    return device, files, params


def run(args: argparse.Namespace) -> int:
    device, files, params = prepare(args)
    lm = load_lm(files.moshi, files.config, device=device, dtype=DTYPES[args.dtype], weights_dtype=args.weights_dtype)
    mimi_cfg = mimi_ring_rule(MIMI_PRESETS[files.mimi_preset], lm.cfg)  # a PersonaPlex LM's Mimi: NVIDIA's rule
    mimi = load_mimi(files.mimi, mimi_cfg, device=device, dtype=torch.float32)
    tokenizer = TextTokenizer(resolve_file(files.tokenizer, TOKENIZER_NAME))
    prompt = persona_prompt(args, lm, mimi, tokenizer)
    pipeline = Pipeline(lm, mimi, num_slots=1, kv_dtype=args.kv_dtype)
    pipeline.reset(0, params)
    if prompt is not None:  # prefilled in one forward, no outputs: the JSONL and OUT start at the first live frame
        pipeline.prompt(0, prompt, chunk=prompt.forwards)
        logger.info("persona prompt: %d frames", prompt.calls)

    frame = pipeline.frame_size
    pcm = read_audio(args.input, mimi.cfg.sample_rate, min_samples=frame)
    frames = split_frames(pcm, frame)  # the last partial frame is zero-padded, not dropped
    silent = set(lm.cfg.silent_text_ids)
    speech = []
    tokens_out = open(args.tokens_out, "w") if args.tokens_out else None  # noqa: SIM115
    try:
        for index in range(len(frames)):
            out = pipeline.step([0], frames[index : index + 1])
            if not out.valid[0]:
                continue
            speech.append(out.pcm[0].float().cpu().clone())  # the next step reuses the output buffer on CUDA
            text, audio = int(out.tokens[0, 0]), out.tokens[0, 1:].tolist()
            if tokens_out:
                tokens_out.write(json.dumps({"frame": index, "text": text, "audio": audio}) + "\n")
            if text not in silent:
                sys.stdout.write(tokenizer.piece(text))
                sys.stdout.flush()
    finally:
        if tokens_out:
            tokens_out.close()
    sys.stdout.write("\n")
    audio_out = torch.cat(speech).numpy() if speech else np.zeros(0, np.float32)
    sf.write(str(args.output), audio_out, mimi.cfg.sample_rate)
    logger.info(
        "%d frames in, %.2f s of speech written to %s", len(frames), len(audio_out) / mimi.cfg.sample_rate, args.output
    )
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="input audio (any format soundfile reads, any rate; stereo is down-mixed)")
    p.add_argument("output", help="output WAV (24 kHz) of the model's speech")
    p.add_argument("--moshi-weight", help="LM weights: path, hf://org/repo/file or repo id")
    p.add_argument("--mimi-weight", help="Mimi weights")
    p.add_argument("--tokenizer", help="sentencepiece text tokenizer")
    p.add_argument("--config", help="reference config.json for the LM")
    p.add_argument("--hf-repo", help="take every file not given from this Hugging Face repo")
    p.add_argument(
        "--mimi-preset",
        choices=sorted(MIMI_PRESETS),
        help="Mimi architecture (default: the codebooks the LM reads, at the size of a local Mimi file)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="LM weight dtype")
    p.add_argument(
        "--kv-dtype", choices=KV_DTYPES, default="bf16", help="KV cache format (bf16: the weights' dtype), int8, fp8"
    )
    add_weights_dtype(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temp", type=float, default=0.8, help="audio temperature (0 = greedy)")
    p.add_argument("--temp-text", type=float, default=0.7, help="text temperature (0 = greedy)")
    p.add_argument("--topk", type=int, default=250, help="audio top-k")
    p.add_argument("--topk-text", type=int, default=25, help="text top-k")
    p.add_argument("--tokens-out", help="write one JSON line per frame: frame, text token, 8 audio tokens")
    p.add_argument("--text-prompt", help="PersonaPlex role text (wrapped in <system>); needs --voice-prompt")
    p.add_argument(
        "--voice-prompt", help="PersonaPlex voice: a .pt preset or a WAV/FLAC speech sample; needs --text-prompt"
    )
