"""`duplexd transcribe FILE`: a whole audio file through the Gemma 4 transcriber, the transcript printed (a Kyutai
speech-to-text model instead: `transcribe_stt`).

The same path as the server's `POST /v1/audio/transcriptions` (`engine.file_transcription`): the file is split at
pauses by the VAD (utterances cut at 30 s, so files of any length work) and each utterance goes through a
`TranscriptionService` of one stream, its streamed audio tower and batched decoder. `--format` prints the
endpoint's response formats.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from duplexd.clients.audio import read_audio
from duplexd.engine.devices import check_device
from duplexd.engine.errors import CheckpointError, InputRefused
from duplexd.engine.transcription.files import RESPONSE_FORMATS, json_body, text_body, transcribe_file, verbose_body
from duplexd.engine.transcription.service import TranscriptionConfig, TranscriptionService
from duplexd.engine.transcription.transcriber import (
    DEFAULT_PROMPT,
    SAMPLE_RATE,
    Transcriber,
    import_transformers,
    model_folder,
)
from duplexd.engine.transcription.vad import VadSegmenter, load_silero
from duplexd.engine.weights.model_files import DTYPES

from . import transcribe_stt
from .transcribe_stt import stt_files

logger = logging.getLogger(__name__)


def run(args: argparse.Namespace) -> int:
    stt = stt_files(args.model)
    if stt is not None:
        return transcribe_stt.run(args, stt)
    if args.tokens_out:
        raise InputRefused("is for speech-to-text models (a Kyutai STT folder or demo-stt)", "tokens_out")
    device = check_device(args.device)
    if args.max_new_tokens < 1:
        raise CheckpointError(f"{args.max_new_tokens}: must be at least 1", "max_new_tokens")
    pcm = read_audio(args.input, sample_rate=SAMPLE_RATE)
    import_transformers()
    folder = model_folder(args.model)
    config = TranscriptionConfig(max_streams=1)  # no live stream; the service needs one slot more for files
    try:
        transcriber = Transcriber.from_pretrained(
            folder,
            device=device,
            dtype=DTYPES[args.dtype],
            max_slots=config.max_streams + 1,
            max_new_tokens=args.max_new_tokens,
        )
    except CheckpointError as e:
        e.option = e.option or "model"
        raise
    silero = load_silero()
    torch.set_num_threads(1)  # Silero's 32 ms windows are too small to split; more threads only contend
    service = TranscriptionService(transcriber, config, VadSegmenter(config.max_streams, config.vad, model=silero))
    started = time.perf_counter()
    service.start()
    try:
        result = transcribe_file(service, pcm, SAMPLE_RATE, args.prompt, model=silero)
    finally:
        service.stop()
    elapsed = time.perf_counter() - started
    if args.format == "json":
        out = json.dumps(json_body(result), ensure_ascii=False) + "\n"
    elif args.format == "verbose_json":
        out = json.dumps(verbose_body(result, "unknown", folder.name), ensure_ascii=False) + "\n"
    else:
        out = text_body(result, args.format)
    sys.stdout.write(out)
    logger.info(
        "%.2f s of audio, %d utterance(s), %d tokens in %.2f s",
        result.duration_s,
        len(result.segments),
        sum(len(s.tokens) for s in result.segments),
        elapsed,
    )
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="input audio (any format soundfile reads, any rate; stereo is down-mixed)")
    p.add_argument(
        "--model",
        default="demo",
        help="Gemma 4 folder in Hugging Face layout, `demo` (default), a Kyutai STT folder (its config.json names "
        "its files) or `demo-stt`: words with their times",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the instruction that follows the audio")
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest transcript of one utterance")
    p.add_argument(
        "--format",
        choices=RESPONSE_FORMATS,
        default="text",
        help="output as the server's response_format: text (default), json, verbose_json, srt, vtt",
    )
    p.add_argument("--tokens-out", help="speech-to-text models: one JSON line per frame (frame, text token, pause)")
