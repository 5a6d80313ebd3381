"""`duplexd transcribe IN --model STT`: a whole file through a Kyutai speech-to-text model, its words with times.

The file goes frame by frame through the engine's own pipeline, as a live `/api/asr-streaming` stream does, with
the reference's padding: `audio_silence_prefix_seconds` of silence first (the 2.6B wants 1 s), then the audio, then
the model's text delay plus a second of silence so that its last words come out. Words and their times follow
moshi-server's rules (`engine/stt/words.py`); times count from the start of the file.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from duplexd.clients.audio import read_audio
from duplexd.engine.devices import check_device
from duplexd.engine.dialogue.pipeline import Pipeline
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.errors import CheckpointError, InputRefused
from duplexd.engine.models.config import MIMI_PRESETS
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.stt.delay import delay_tokens
from duplexd.engine.stt.words import EndWord, Word, WordTimer
from duplexd.engine.weights.checkpoint import (
    CONFIG_NAME,
    checkpoint_names,
    load_lm,
    load_mimi,
    mimi_ring_rule,
    read_stt_settings,
)
from duplexd.engine.weights.demo import ensure_demo_stt
from duplexd.engine.weights.model_files import DTYPES, model_files
from duplexd.wire import split_frames

logger = logging.getLogger(__name__)

DEMO = "demo-stt"
STT_FORMATS = ("text", "json", "verbose_json")


@dataclass(frozen=True)
class SttFiles:
    lm: Path
    mimi: Path
    tokenizer: Path
    config: Path
    mimi_preset: str


def stt_files(model: str) -> SttFiles | None:
    """The files of a Kyutai STT folder, or of the demo STT model; None when `model` is not a speech-to-text model
    (a Gemma 4 folder). A folder is read as `duplexd serve --hf-repo FOLDER` reads it (`model_files`): the files
    its config.json names, and its Mimi preset."""
    if model == DEMO:
        demo = ensure_demo_stt()
        return SttFiles(demo.lm, demo.mimi, demo.tokenizer, demo.config, demo.mimi_preset)
    folder = Path(model).expanduser()
    config = folder / CONFIG_NAME
    if not config.is_file() or not checkpoint_names(config).stt:
        return None
    found = model_files(hf_repo=str(folder))
    files = SttFiles(Path(found.moshi), Path(found.mimi), Path(found.tokenizer), config, found.mimi_preset)
    for path in (files.lm, files.mimi, files.tokenizer):
        if not path.is_file():
            raise CheckpointError(f"{model}: {path.name} not found in the STT folder", "model")
    return files


def run(args: argparse.Namespace, files: SttFiles) -> int:
    if args.format not in STT_FORMATS:
        raise InputRefused(f"{args.format}: a speech-to-text model writes one of {', '.join(STT_FORMATS)}", "format")
    device = check_device(args.device)
    settings = read_stt_settings(files.config)
    assert settings is not None
    lm = load_lm(files.lm, files.config, device=device, dtype=DTYPES[args.dtype])
    mimi_cfg = mimi_ring_rule(MIMI_PRESETS[files.mimi_preset], lm.cfg)
    mimi = load_mimi(files.mimi, mimi_cfg, device=device, dtype=torch.float32)
    tokenizer = TextTokenizer(files.tokenizer)
    rate = mimi.cfg.sample_rate
    pcm = read_audio(args.input, rate)
    prefix = round(settings.audio_silence_prefix_seconds * rate)
    suffix = round((settings.audio_delay_seconds + 1.0) * rate)
    padded = np.concatenate([np.zeros(prefix, np.float32), pcm, np.zeros(suffix, np.float32)])
    pipeline = Pipeline(lm, mimi, num_slots=1)
    pipeline.reset(0, SamplingParams(text_temperature=settings.text_temperature, text_topk=max(settings.text_topk, 1)))
    timer = WordTimer(delay_tokens(settings.audio_delay_seconds), tokenizer.decode)
    shift = prefix / rate
    words: list[dict] = []
    tokens_out = open(args.tokens_out, "w") if args.tokens_out else None  # noqa: SIM115 - closed below
    try:
        for index, frame in enumerate(split_frames(padded, pipeline.frame_size)):
            out = pipeline.step([0], frame[None])
            token = int(out.tokens[0, 0])
            if tokens_out:
                pause = [round(float(p), 6) for p in out.pause[0]] or None  # None: a model without VAD heads
                tokens_out.write(json.dumps({"frame": index, "text": token, "pause": pause}) + "\n")
            for event in timer.step(token):
                if isinstance(event, Word):
                    words.append({"word": event.text, "start": round(max(event.start_time - shift, 0.0), 3)})
                elif isinstance(event, EndWord) and words and "end" not in words[-1]:
                    words[-1]["end"] = round(max(event.stop_time - shift, 0.0), 3)
    finally:
        if tokens_out:
            tokens_out.close()
    text = " ".join(w["word"] for w in words)
    if args.format == "text":
        sys.stdout.write(text + "\n")
    else:
        body: dict = {"text": text}
        if args.format == "verbose_json":
            body.update(duration=round(len(pcm) / rate, 3), words=words)
        sys.stdout.write(json.dumps(body, ensure_ascii=False) + "\n")
    logger.info("%.2f s of audio, %d words", len(pcm) / rate, len(words))
    return 0
