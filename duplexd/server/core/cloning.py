"""Voice cloning beside the `--tts` model (`--voice-mimi`, `--voice-denoiser`): the voice maker, loaded at start-up
and checked against the TTS model's voices, and the one thread that makes voices.

moshi-server's voice module makes one voice at a time on a thread of its own; so does this, with `--voice-threads`
intra-op threads (per thread in torch, so the engines' own are untouched), and the event loop only awaits it. At
most `MAX_WAITING` requests wait or are being made; more are refused at once (`CloningBusy`) rather than queued for
minutes as moshi-server queues them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from duplexd.engine.errors import CheckpointError
from duplexd.engine.tts.config import TTSConfig
from duplexd.engine.weights.hub import resolve_file

from .settings import ServerSettings

if TYPE_CHECKING:  # the voice maker (and scipy.signal, ~0.8 s) is imported only by a server that clones voices
    from duplexd.engine.voice.maker import VoiceMaker

logger = logging.getLogger(__name__)

MAX_WAITING = 8  # voices being made or waiting for the voice thread


class CloningBusy(RuntimeError):
    """`MAX_WAITING` voices are already being made or waiting."""


def _voice_thread(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)


class VoiceCloning:
    """The voice maker and its thread; `make` is awaited on the event loop."""

    def __init__(self, maker: VoiceMaker, threads: int = 1) -> None:
        self.maker = maker
        self._pool = ThreadPoolExecutor(1, "duplexd-voice", initializer=_voice_thread, initargs=(threads,))
        self._waiting = 0  # touched on the event loop only

    async def make(self, recording: Callable[[], np.ndarray]) -> torch.Tensor:
        """The voice [1, dim, frames] of the recording `recording()` reads (24 kHz mono), read and made on the voice
        thread after the voices asked for before it. `CloningBusy` when `MAX_WAITING` are ahead; what `recording`
        or `VoiceMaker.make` raise."""
        if self._waiting >= MAX_WAITING:
            raise CloningBusy(f"{MAX_WAITING} voices are being made or waiting; try again in a minute")
        self._waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: self.maker.make(recording()))
        finally:
            self._waiting -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def check_cloning(settings: ServerSettings) -> None:
    """Before any model loads: both files are there (fetched into the Hugging Face cache when they come from the
    hub) and the voice Mimi's header is one duplexd knows; `CheckpointError` naming the option."""
    if not settings.voice_mimi or not settings.voice_denoiser:
        return
    from duplexd.engine.voice.maker import DENOISER_NAME, VOICE_MIMI_NAME, voice_mimi_config

    try:
        voice_mimi_config(resolve_file(settings.voice_mimi, VOICE_MIMI_NAME))
    except CheckpointError as e:
        raise CheckpointError(str(e), "voice_mimi") from None
    try:
        resolve_file(settings.voice_denoiser, DENOISER_NAME)
    except CheckpointError as e:
        raise CheckpointError(str(e), "voice_denoiser") from None


def load_cloning(settings: ServerSettings, tts: TTSConfig | None) -> VoiceCloning | None:
    """The voice maker of `--voice-mimi` and `--voice-denoiser` (None when not given), its voices the shape the
    `--tts` model takes; `CheckpointError` naming the option at fault."""
    if not settings.voice_mimi or not settings.voice_denoiser or tts is None:
        return None
    from duplexd.engine.voice.maker import load_voice_maker

    maker = load_voice_maker(settings.voice_mimi, settings.voice_denoiser)
    expected = (1, tts.speaker_dim, tts.speaker_frames)
    if maker.shape != expected:
        raise CheckpointError(
            f"{settings.voice_mimi}: its voices are {list(maker.shape)}, the text-to-speech model takes "
            f"{list(expected)} (a voice Mimi {tts.speaker_dim} wide)",
            "voice_mimi",
        )
    return VoiceCloning(maker, settings.voice_threads)
