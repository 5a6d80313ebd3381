"""The reference side of the Gemma 4 transcriber tests: `Gemma4Processor` + `generate` from `transformers`."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from duplexd.engine.transcription.transcriber import DEFAULT_PROMPT

# transformers is imported by the tests that run it, not when the suite is collected (4-6 s of CPU a worker)
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers: pip install 'duplexd[gemma]'"
)


def load_reference(folder: Path) -> tuple[Any, Any]:
    """(the real processor without a video processor, Gemma4ForConditionalGeneration) on a Hugging Face folder."""
    from transformers import (
        AutoTokenizer,
        Gemma4AudioFeatureExtractor,
        Gemma4ForConditionalGeneration,
        Gemma4ImageProcessorPil,
        Gemma4Processor,
    )

    class AudioProcessor(Gemma4Processor):
        """The video processor needs torchvision, which audio never uses."""

        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    tok = AutoTokenizer.from_pretrained(folder)
    proc = AudioProcessor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessorPil(),
        tokenizer=tok,
        video_processor=None,
        chat_template=tok.chat_template,
    )
    model = Gemma4ForConditionalGeneration.from_pretrained(folder).eval()
    return proc, model


def hf_inputs(proc, wave: np.ndarray, prompt: str = DEFAULT_PROMPT):
    messages = [{"role": "user", "content": [{"type": "audio", "audio": wave}, {"type": "text", "text": prompt}]}]
    return proc.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="pt"
    )


def generate(hf, wave: np.ndarray, max_new: int, prompt: str = DEFAULT_PROMPT) -> list[int]:
    """The greedy transcript of a 16 kHz utterance: new tokens up to, not including, the end of turn."""
    proc, model = hf
    inp = hf_inputs(proc, wave, prompt)
    with torch.no_grad():
        out = model.generate(**inp, do_sample=False, max_new_tokens=max_new)
    new = out[0, inp["input_ids"].shape[1] :].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return new[: next((i for i, t in enumerate(new) if t in eos), len(new))]
