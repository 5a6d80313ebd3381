"""The text-to-speech model a server serves beside its main one (`--tts`): its speech service and its voices.

Voices are loaded whole at start-up, as moshi-server's worker loads them: every embedding file under the voices
folder (`kyutai/tts-voices`' layout, `NAME` + the model's suffix), checked against the model, so a bad file stops
the start rather than a stream. A stream's voice is one of them, given as moshi-server's worker gives it: the same
embedding twice (`[file, file]`) and the CFG coefficient through the `cfg` table; a name it does not know falls
back to the default voice (logged), as there. A custom voice (the `Voice` message) is one embedding, as there.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from duplexd.engine.errors import CheckpointError, InputRefused
from duplexd.engine.models.tokenizer import TextTokenizer
from duplexd.engine.tts.config import TTSConfig
from duplexd.engine.tts.demo import demo_tts_folder
from duplexd.engine.tts.generate import Voice
from duplexd.engine.tts.model import TTSModel, load_tts, voice_embedding
from duplexd.engine.tts.service import SpeechService, SpeechStream
from duplexd.engine.tts.words import MAIN, StreamWords
from duplexd.engine.weights.hub import hub_folder

from .settings import ServerSettings

logger = logging.getLogger(__name__)

DEMO_TTS = "demo-tts"
UNMUTE_DEFAULT_VOICE = "unmute-prod-website/default_voice.wav"  # moshi-server's default in Kyutai's configs
TTS_FILES = ["*.json", "*.safetensors", "*.model"]  # what a hub TTS repo's snapshot fetches
FINAL_PADDING = 4  # moshi-server's worker's, which ends max_delay steps after generate's (`SpeechModel`)


class VoiceRefused(ValueError):
    """A custom voice that cannot condition the model; the message says why."""


@dataclass
class SpeechModel:
    id: str
    model: TTSModel
    service: SpeechService
    voices: dict[str, torch.Tensor]  # name → embedding [speaker_dim, frames], on the model's device
    default_voice: str
    cfg_value: str | None  # the distilled model's CFG coefficient as its `cfg` table spells it; None: no table
    temperature: float
    demo: bool

    @property
    def device(self) -> torch.device:
        return self.model.lm.text_emb.device

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.model.tokenizer

    @property
    def sample_rate(self) -> int:
        return self.model.mimi.cfg.sample_rate

    @property
    def frame_size(self) -> int:
        return self.model.mimi.cfg.frame_size

    def words(self) -> StreamWords:
        """A new stream's word splitter (moshi-server's: the first word starts with the main speaker's token)."""
        return StreamWords(self.tokenizer.encode, bos=MAIN)

    def begin(self, stream: SpeechStream, voice: Voice) -> None:
        """Start `stream` in `voice` at the server's temperature, with a seed of its own."""
        stream.begin(voice, self.temperature, random.getrandbits(31))

    def _values(self) -> tuple[tuple[str, str | None], ...]:
        return (("control", "ok"), ("cfg", self.cfg_value))

    def voice(self, name: str | None) -> Voice:
        """A named voice; no name or an unknown one gives the default voice (an unknown one is logged)."""
        if name and name not in self.voices:
            logger.info("unknown voice %r: the default voice %r speaks", name[:200], self.default_voice)
        embedding = self.voices.get(name or "", self.voices[self.default_voice])
        return Voice((embedding, embedding), self._values())

    def custom_voice(self, embeddings: list[float], shape: list[int]) -> Voice:
        """A voice sent as its embedding (the `Voice` message): [1, speaker_dim, frames] floats."""
        tts = self.model.tts
        expected = [1, tts.speaker_dim, tts.speaker_frames]
        if list(shape) != expected:
            raise VoiceRefused(f"Voice: `shape` must be {expected}, got {list(shape)[:8]}")
        if len(embeddings) != math.prod(expected):
            raise VoiceRefused(f"Voice: {len(embeddings)} values for a shape of {math.prod(expected)}")
        tensor = torch.tensor(embeddings, dtype=torch.float32).view(expected)[0]
        if not torch.isfinite(tensor).all():
            raise VoiceRefused("Voice: the embedding holds values that are not finite")
        return Voice((tensor.to(self.model.lm.text_emb.device),), self._values())


def load_speech(settings: ServerSettings, device: str, dtype: torch.dtype) -> SpeechModel:
    """The `--tts` model on `device`, its voices and its speech service (not started). `CheckpointError` (option
    `tts` or `tts_voices`) naming the file or voice at fault."""
    assert settings.tts is not None
    demo = settings.tts == DEMO_TTS
    started = time.perf_counter()
    try:
        folder = demo_tts_folder() if demo else hub_folder(settings.tts, TTS_FILES, "a Kyutai TTS model")
        model = load_tts(
            folder, device=device, dtype=dtype, weights_dtype=settings.tts_weights_dtype, n_q=settings.tts_n_q
        )
    except CheckpointError as e:
        raise CheckpointError(str(e), "tts") from None
    except InputRefused as e:  # the only one load_tts raises is for n_q
        raise InputRefused(str(e), "tts_n_q") from None
    try:
        voices_dir = hub_folder(settings.tts_voices, ["*.safetensors"], "voices") if settings.tts_voices else None
    except CheckpointError as e:
        raise CheckpointError(str(e), "tts_voices") from None
    voices = load_voices(voices_dir or folder / "voices", model)
    default = default_voice(settings, list(voices))
    tts = model.tts
    cfg_value = cfg_table_value(settings, tts)
    service = SpeechService(
        model,
        settings.tts_streams,
        final_padding=FINAL_PADDING + model.lm.cfg.max_delay,
        graphs=settings.cuda_graphs,
    )
    model_id = "duplexd-demo-tts" if demo else folder.resolve().name
    logger.info(
        "text to speech: %s on %s (%s), %d codebooks said, %d voices (default %s), %d streams, loaded in %.1f s",
        model_id,
        device,
        dtype,
        model.n_q,
        len(voices),
        default,
        settings.tts_streams,
        time.perf_counter() - started,
    )
    temperature = tts.temperature if settings.tts_temperature is None else settings.tts_temperature
    return SpeechModel(model_id, model, service, voices, default, cfg_value, temperature, demo)


def default_voice(settings: ServerSettings, names: list[str]) -> str:
    """`--tts-default-voice`, else Unmute's default when present, else the first name; `CheckpointError` naming the
    voices when it is not one of them."""
    default = settings.tts_default_voice or (UNMUTE_DEFAULT_VOICE if UNMUTE_DEFAULT_VOICE in names else min(names))
    if default not in names:
        listed = ", ".join(sorted(names)[:8]) + (" …" if len(names) > 8 else "")
        raise CheckpointError(f"{default}: not one of the voices ({listed})", "tts_default_voice")
    return default


def cfg_table_value(settings: ServerSettings, tts: TTSConfig) -> str | None:
    """`--tts-cfg-coef` as the model's `cfg` table spells it (None: no table); `CheckpointError` for a value it
    does not hold."""
    if not tts.cfg_values:
        return None
    value = f"{settings.tts_cfg_coef:.1f}"
    if value not in tts.cfg_values:
        raise CheckpointError(f"{settings.tts_cfg_coef}: the model takes {', '.join(tts.cfg_values)}", "tts_cfg_coef")
    return value


def voice_names(folder: Path, suffix: str) -> list[str]:
    """The voices under `folder`: the embedding files' paths less the model's suffix."""
    return sorted(str(p.relative_to(folder)).removesuffix(suffix) for p in folder.rglob("*" + suffix))


def load_voices(folder: Path, model: TTSModel) -> dict[str, torch.Tensor]:
    """Every voice under `folder` by name, on the model's device; `CheckpointError` for none or a bad one."""
    suffix = model.tts.voice_suffix
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no voices folder (give --tts-voices DIR)", "tts_voices")
    device = model.lm.text_emb.device
    voices = {}
    for name in voice_names(folder, suffix):
        try:
            voices[name] = voice_embedding(str(folder / (name + suffix)), None, model.tts).to(device)
        except CheckpointError as e:
            raise CheckpointError(str(e), "tts_voices") from None
    if not voices:
        raise CheckpointError(f"{folder} holds no voice of this model (*{suffix} files)", "tts_voices")
    return voices
