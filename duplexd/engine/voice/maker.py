"""A TTS voice from a recording, as moshi-server's voice-cloning module (`rust/moshi-server/voice.py`,
`Processor.run_one`) makes one, and as Unmute asks for it (`POST /api/voice`).

The recipe, on the recording's first 10 s at 24 kHz (shorter ones padded with silence, as moshi-server pads them):
the band under 8 kHz, at 16 kHz, through the speech denoiser (`denoiser.py`), mixed with 2 % of itself as it came
in (the dry signal), back at 24 kHz with the band above 8 kHz added back (`signal.BandSplit`); the mean removed and
the loudness brought to -18 LUFS (`signal.normalize_loudness`); then the voice Mimi's encoder latent, unquantized:
[1, 512, 125] for the released voice Mimi (`kyutai/unmute-voice-cloning`'s `e9d43d50_500_mimi_voice.safetensors`,
a full-size Mimi with 16 codebooks), the `speaker_wavs` embedding a Kyutai TTS model cross-attends.

What moshi-server makes a voice of anyway, duplexd refuses (`VoiceRefused`, its message saying why): a recording
under `MIN_SECONDS`, a silent one (RMS under `ENERGY_FLOOR`), and one whose loudness no block of passes the gates.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError, InputRefused
from ..models.config import DEMO_MIMI, MIMI, MimiConfig
from ..models.mimi import MimiModel, MimiStreams
from ..weights.checkpoint import load_mimi, mimi_config_of
from ..weights.hub import resolve_file
from .denoiser import SAMPLE_RATE as DENOISER_RATE
from .denoiser import Denoiser, load_denoiser
from .signal import ENERGY_FLOOR, BandSplit, LoudnessError, normalize_loudness

logger = logging.getLogger(__name__)

SAMPLE_RATE = 24_000
SECONDS = 10  # of the recording used
LENGTH = SAMPLE_RATE * SECONDS
MIN_SECONDS = 1.0  # shorter recordings are refused (moshi-server pads anything to 10 s)
DRY = 0.02  # voice.py's dry_fraction
VOICE_MIMI_NAME = "e9d43d50_500_mimi_voice.safetensors"
DENOISER_NAME = "dns64-a7761ff99a7d5bb6.th"
# The Mimis a voice may be made with: Kyutai's voice Mimi (the released Mimi with 16 codebooks: moshi-server loads
# it with `_quantizer_kwargs["n_q"] = 16`) and the demo's tiny one (its 32-wide latent is the demo TTS's voice).
VOICE_MIMIS: dict[str, MimiConfig] = {
    "mimi-voice": dataclasses.replace(MIMI, n_q=16, num_codebooks=16),
    "demo": DEMO_MIMI,
}


class VoiceRefused(InputRefused):
    """A recording no voice is made of; the message says why, `reason` in a word (`invalid_audio`,
    `audio_too_short`, `silent_audio`, `unmeasurable_loudness`)."""

    def __init__(self, message: str, reason: str = "invalid_audio") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class VoiceMaker:
    """The voice Mimi, the denoiser and the band split, loaded once; `make` is blocking CPU work (seconds)."""

    mimi: MimiModel
    denoiser: Denoiser
    bands: BandSplit

    @property
    def shape(self) -> tuple[int, int, int]:
        """What `make` returns: [1, the voice Mimi's latent width, frames in 10 s]."""
        return (1, self.mimi.cfg.dimension, LENGTH // self.mimi.cfg.frame_size)

    @torch.no_grad()
    def make(self, pcm: np.ndarray) -> torch.Tensor:
        """The voice [1, dimension, 125] (float32, CPU) of mono 24 kHz `pcm` (its first 10 s); `VoiceRefused`."""
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if len(pcm) < MIN_SECONDS * SAMPLE_RATE:
            raise VoiceRefused(
                f"the recording is {len(pcm) / SAMPLE_RATE:.2f} s long: at least {MIN_SECONDS:g} s of speech is needed "
                f"(the first {SECONDS} s are used)",
                "audio_too_short",
            )
        clip = np.zeros(LENGTH, dtype=np.float32)
        clip[: min(len(pcm), LENGTH)] = pcm[:LENGTH]
        if not np.isfinite(clip).all():
            raise VoiceRefused("the recording holds samples that are not finite numbers")
        if float(np.std(clip - clip.mean())) < ENERGY_FLOOR:
            raise VoiceRefused(
                f"the recording is silent (its first {SECONDS} s have an RMS under {ENERGY_FLOOR:g}, -54 dBFS): "
                "no voice to clone",
                "silent_audio",
            )
        wav = torch.from_numpy(clip).view(1, 1, -1)
        low, high = self.bands.split(wav)
        denoised = (1 - DRY) * self.denoiser(low) + DRY * low
        wav = self.bands.join(denoised, high)
        try:
            wav = normalize_loudness(wav, SAMPLE_RATE)
        except LoudnessError as e:
            raise VoiceRefused(f"the recording's loudness cannot be measured: {e}", "unmeasurable_loudness") from None
        cfg = self.mimi.cfg  # the whole clip in one call (250 steps: the context of the released Mimi)
        per_call = max(1, min(LENGTH // cfg.frame_size, cfg.context // cfg.downsample_stride))
        return MimiStreams(self.mimi, 1, decoder=False).encode_latent([0], wav[:, 0], per_call).float()


def voice_mimi_config(path: Path) -> MimiConfig:
    """The Mimi the file at `path` holds, of `VOICE_MIMIS`; `CheckpointError` when none."""
    name = mimi_config_of(path, VOICE_MIMIS)
    if name is None:
        known = ", ".join(f"{n} ({c.dimension} wide, {c.n_q} codebooks)" for n, c in VOICE_MIMIS.items())
        raise CheckpointError(f"{path}: not a voice Mimi duplexd knows ({known})")
    return VOICE_MIMIS[name]


def load_voice_maker(mimi: str | Path, denoiser: str | Path) -> VoiceMaker:
    """The voice maker of the voice Mimi `mimi` (a path, `hf://org/repo/file`...) and the denoiser checkpoint
    `denoiser`, on the CPU as moshi-server runs them; `CheckpointError` with option `voice_mimi` or `voice_denoiser`
    naming the file at fault."""
    started = time.perf_counter()
    try:
        mimi_path = resolve_file(mimi, VOICE_MIMI_NAME)
        model = load_mimi(mimi_path, voice_mimi_config(mimi_path))
    except CheckpointError as e:
        raise CheckpointError(str(e), "voice_mimi") from None
    try:
        network = load_denoiser(resolve_file(denoiser, DENOISER_NAME))
    except CheckpointError as e:
        raise CheckpointError(str(e), "voice_denoiser") from None
    logger.info(
        "voice cloning: Mimi %s (%d wide), denoiser %s (%d wide, %d stages, at %d Hz), loaded in %.1f s",
        mimi_path.name,
        model.cfg.dimension,
        Path(denoiser).name,
        network.hidden,
        network.depth,
        DENOISER_RATE,
        time.perf_counter() - started,
    )
    return VoiceMaker(model, network, BandSplit(SAMPLE_RATE, DENOISER_RATE))
