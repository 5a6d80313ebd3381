"""`duplexd voice make AUDIO --out VOICE.safetensors`: a TTS voice cloned from a recording, offline.

The recording is read as `duplexd serve`'s `POST /api/voice` reads an upload (its first channel at 24 kHz, the first
10 s used) and made into a voice by the same recipe (`engine/voice/maker.py`, moshi-server's `voice.py`): denoised,
loudness-normalised, encoded by the voice Mimi. The file holds `speaker_wavs` [1, 512, 125], as `kyutai/tts-voices`'
files do: `duplexd speak --voice VOICE.safetensors` takes it, and so does a server's `--tts-voices` folder under a name
ending in the model's suffix (`NAME.wav.1e68beda@240.safetensors` for `kyutai/tts-1.6b-en_fr`).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from duplexd.engine.errors import CheckpointError, InputRefused
from duplexd.engine.voice.maker import SECONDS, load_voice_maker
from duplexd.engine.voice.recording import read_recording

logger = logging.getLogger(__name__)

VOICE_MIMI = "hf://kyutai/unmute-voice-cloning/e9d43d50_500_mimi_voice.safetensors"  # Unmute's voice-cloning config's


def make(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if not out.parent.is_dir():
        raise InputRefused(f"{out.parent}: no such folder", "out")
    if out.suffix != ".safetensors":
        raise InputRefused(f"{out}: a voice file ends in .safetensors", "out")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        pcm = read_recording(args.audio)
    except InputRefused as e:
        raise InputRefused(f"{args.audio}: {e}") from None
    try:
        maker = load_voice_maker(args.mimi, args.denoiser)
    except CheckpointError as e:  # named by the server's settings (voice_mimi, voice_denoiser): here --mimi, --denoiser
        raise CheckpointError(str(e), (e.option or "").removeprefix("voice_") or None) from None
    started = time.perf_counter()
    try:
        voice = maker.make(pcm)
    except InputRefused as e:
        raise InputRefused(f"{args.audio}: {e}") from None
    save_file({"speaker_wavs": voice.contiguous()}, str(out))
    logger.info(
        "voice %s from the first %.1f s of %s in %.1f s, written to %s",
        list(voice.shape),
        min(len(pcm) / 24_000, SECONDS),
        args.audio,
        time.perf_counter() - started,
        out,
    )
    return 0


ACTIONS = {"make": make}


def run(args: argparse.Namespace) -> int:
    return ACTIONS[args.action](args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    m = actions.add_parser(
        "make",
        help="clone a voice from a recording into a voice file",
        description="Clone a voice from a recording (its first 10 s) into a speaker_wavs file for a Kyutai TTS, "
        "as moshi-server's /api/voice makes one: denoised (Demucs dns64), loudness-normalised, encoded by the voice "
        "Mimi.",
    )
    m.add_argument("audio", help="the recording (any format libsndfile reads, any rate; its first channel is used)")
    m.add_argument("--out", required=True, help="the voice file to write (.safetensors)")
    m.add_argument(
        "--mimi",
        default=VOICE_MIMI,
        help=f"the voice Mimi: a path, hf://org/repo/file or a repo id (default {VOICE_MIMI})",
    )
    m.add_argument(
        "--denoiser",
        required=True,
        help="the Demucs denoiser checkpoint (dns64-a7761ff99a7d5bb6.th from Facebook's denoiser, or a safetensors "
        "copy of it)",
    )
    m.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
