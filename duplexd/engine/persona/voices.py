"""PersonaPlex voices: `.pt` presets and audio files (WAV, FLAC), checked, encoded once and kept by name.

A voice is what a PersonaPlex session says its first frames with, so the model speaks in it from then on:

- a **preset** (`NATF0.pt`, as PersonaPlex ships them) holds the voice phase already run through the model: the
  summed input embeddings of its forwards (`embeddings` [V-1, 1, 1, dim]) and the 17-stream ring the reference's
  LMGen is left with (`cache` [1, 17, max_delay + 3]);
- an **audio voice** is any speech sample; it is prepared exactly as the reference prepares one (resampled to
  the codec's rate, channel 0, normalised to -24 LUFS by ITU-R BS.1770 gated loudness, zero-padded to whole
  frames) and encoded by a fresh Mimi stream into the agent's codes [V, 8].

`VoiceLibrary` scans a folder once (at start-up) so no session waits for an encode, and refuses a bad file then,
by name, rather than in the middle of a conversation.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import sphn
import torch

from ..errors import InputRefused
from ..models.config import LMConfig
from ..models.mimi import MimiModel, MimiStreams, Rows
from .prompt import REFERENCE_RING, SINE_CODES, TARGET_LUFS, TEXT_PAD, Voice

logger = logging.getLogger(__name__)

PRESET_SUFFIX = ".pt"
AUDIO_SUFFIXES = (".wav", ".flac")
MIN_SECONDS = 0.4  # the loudness meter's gating block: a shorter sample has no loudness
MAX_SECONDS = 60.0  # a voice is a few seconds; a long file is a mistake, and its frames would fill the window


class VoiceError(InputRefused):
    """A voice that cannot be used: unknown, unreadable, or not in a format the model takes."""


# --------------------------------------------------------------------------------------------------- presets


def load_preset(path: str | Path, cfg: LMConfig, name: str | None = None) -> Voice:
    """A `.pt` voice preset, checked against the LM it will condition. Raises `VoiceError`."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise VoiceError(f"voice file not found: {path}") from None
    except Exception as e:  # torch.load raises many kinds for a foreign file: pickle, zip, unsafe globals
        raise VoiceError(f"{path}: not a PersonaPlex voice preset ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not {"embeddings", "cache"} <= set(state):
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise VoiceError(f"{path}: a voice preset is a dict with 'embeddings' and 'cache', got {keys}")
    emb, cache = state["embeddings"], state["cache"]
    if not isinstance(emb, torch.Tensor) or not emb.is_floating_point() or emb.dim() != 4 or emb.shape[1:3] != (1, 1):
        raise VoiceError(f"{path}: 'embeddings' must be a float tensor [V-1, 1, 1, {cfg.dim}], got {_describe(emb)}")
    if emb.shape[-1] != cfg.dim:
        raise VoiceError(
            f"{path}: 'embeddings' are {emb.shape[-1]}-wide but the model's are {cfg.dim}: another model's voice"
        )
    if emb.shape[0] < 1:
        raise VoiceError(f"{path}: 'embeddings' holds no frame")
    if not torch.isfinite(emb).all():
        raise VoiceError(f"{path}: 'embeddings' holds non-finite values")
    width = cfg.max_delay + REFERENCE_RING
    shape = (1, cfg.num_codebooks, width)
    if not isinstance(cache, torch.Tensor) or cache.is_floating_point() or tuple(cache.shape) != shape:
        raise VoiceError(f"{path}: 'cache' must be an integer tensor {list(shape)}, got {_describe(cache)}")
    frames = emb.shape[0] + 1
    cache = cache[0].long()
    _check_cache(path, cache, frames, cfg)
    return Voice(name or path.name, path, frames, embeddings=emb[:, 0, 0].clone(), cache=cache)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__


def _check_cache(path: Path, cache: torch.Tensor, frames: int, cfg: LMConfig) -> None:
    """The ring must be the one the voice phase leaves at frame V: token ids in range, the text stream padding at
    column V-1 and the user's stream the tone (a ring from another phase, or another layout, fails here)."""
    width, agent = cache.shape[1], cfg.agent_codebooks
    limits = torch.tensor([cfg.text_card] + [cfg.card] * cfg.n_q)[:, None]
    unset = cache == -2  # a column the voice phase never wrote (a voice shorter than the ring)
    if ((cache < 0) & ~unset).any() or (cache > limits).any():
        raise VoiceError(f"{path}: 'cache' holds token ids out of range")
    last, after = (frames - 1) % width, frames % width
    user0, user_rest = 1 + agent, slice(2 + agent, cfg.num_codebooks)
    expected_text = TEXT_PAD if frames - 1 > cfg.delays[0] else cfg.text_initial_token_id
    sine = torch.tensor(SINE_CODES[1 : cfg.num_user_codebooks])
    ok = int(cache[0, last]) == expected_text and bool((cache[user_rest, after] == sine).all())
    if frames - 1 > cfg.delays[user0]:
        ok = ok and int(cache[user0, last]) == SINE_CODES[0]
    if not ok:
        raise VoiceError(
            f"{path}: 'cache' is not the ring a {frames}-frame voice phase leaves (text padding at its last frame "
            "and the user's tone expected)"
        )


# --------------------------------------------------------------------------------------------------- audio


def read_voice_audio(path: str | Path, sample_rate: int) -> np.ndarray:
    """Channel 0 of an audio file at `sample_rate` (float32). Raises `VoiceError`."""
    try:
        pcm, rate = sphn.read(str(path))
    except FileNotFoundError:
        raise VoiceError(f"voice file not found: {path}") from None
    except Exception as e:  # sphn reports decoding errors as plain exceptions
        raise VoiceError(f"{path}: cannot read audio ({e})") from None
    if pcm.ndim != 2 or pcm.shape[1] == 0:
        raise VoiceError(f"{path}: contains no audio")
    pcm = pcm[:1]
    if rate != sample_rate:
        pcm = sphn.resample(pcm, src_sample_rate=rate, dst_sample_rate=sample_rate)
    return np.ascontiguousarray(pcm[0])


def normalise_loudness(pcm: np.ndarray, sample_rate: int, target: float = TARGET_LUFS) -> np.ndarray:
    """`pcm` scaled to `target` LUFS (ITU-R BS.1770-4 integrated, gated loudness; float64 as the reference's).
    Raises `VoiceError` for audio too short to measure or silent."""
    import pyloudnorm

    if len(pcm) < MIN_SECONDS * sample_rate:
        raise VoiceError(f"the voice sample is {len(pcm) / sample_rate:.2f} s long; at least {MIN_SECONDS} s is needed")
    loudness = pyloudnorm.Meter(sample_rate).integrated_loudness(pcm)
    if not np.isfinite(loudness):
        raise VoiceError("the voice sample is silent")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "possible clipped samples": the reference keeps them too
        return pyloudnorm.normalize.loudness(pcm, loudness, target)


def voice_frames_pcm(pcm: np.ndarray, frame_size: int) -> np.ndarray:
    """Whole frames [V, frame_size] of float32 samples, the last zero-padded."""
    frames = -(-len(pcm) // frame_size)
    padded = np.zeros(frames * frame_size, dtype=np.float64)
    padded[: len(pcm)] = pcm
    return padded.reshape(frames, frame_size).astype(np.float32)


@torch.no_grad()
def encode_voice(mimi: MimiModel, frames: np.ndarray) -> torch.Tensor:
    """Codes [V, num_codebooks] of `frames` [V, frame_size], one at a time through a fresh Mimi stream (on the
    host: the voice is encoded once)."""
    streams = MimiStreams(mimi, 1)
    device = next(mimi.parameters()).device
    rows = Rows(torch.zeros(1, dtype=torch.long, device=device), [0])
    codes = [streams.encode_frame(rows, torch.from_numpy(frame[None]).to(device)) for frame in frames]
    return torch.cat(codes).cpu()


def load_audio_voice(path: str | Path, mimi: MimiModel, cfg: LMConfig, name: str | None = None) -> Voice:
    """An audio file as a voice: read, normalised, framed and encoded. Raises `VoiceError`."""
    path = Path(path)
    rate, size = mimi.cfg.sample_rate, mimi.cfg.frame_size
    pcm = read_voice_audio(path, rate)
    if len(pcm) > MAX_SECONDS * rate:
        raise VoiceError(f"{path}: {len(pcm) / rate:.1f} s of audio; a voice sample is at most {MAX_SECONDS:.0f} s")
    try:
        pcm = normalise_loudness(pcm, rate)
    except VoiceError as e:
        raise VoiceError(f"{path}: {e}") from None
    frames = voice_frames_pcm(pcm, size)
    codes = encode_voice(mimi, frames)[:, : cfg.agent_codebooks]
    return Voice(name or path.name, path, len(frames), codes=codes)


def load_voice(path: str | Path, mimi: MimiModel, cfg: LMConfig, name: str | None = None) -> Voice:
    """A preset or an audio voice, by the file's suffix. Raises `VoiceError`."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == PRESET_SUFFIX:
        return load_preset(path, cfg, name)
    if suffix in AUDIO_SUFFIXES:
        return load_audio_voice(path, mimi, cfg, name)
    raise VoiceError(f"{path}: not a voice file (expected {PRESET_SUFFIX} or {', '.join(AUDIO_SUFFIXES)})")


# --------------------------------------------------------------------------------------------------- library


def voice_files(folder: Path) -> list[Path]:
    """The `.pt`, `.wav` and `.flac` files directly in `folder`, sorted (other files are not voices)."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in (PRESET_SUFFIX, *AUDIO_SUFFIXES))


class VoiceLibrary:
    """The voices of a folder, loaded once and kept by file name (`NATF0.pt`, as PersonaPlex's clients name them);
    a name without its suffix works too when it is unambiguous."""

    def __init__(self, voices: dict[str, Voice]) -> None:
        self.voices = dict(sorted(voices.items()))
        stems: dict[str, list[str]] = {}
        for name in self.voices:
            stems.setdefault(Path(name).stem, []).append(name)
        self._by_stem = {stem: names[0] for stem, names in stems.items() if len(names) == 1}

    @classmethod
    def scan(cls, folder: str | Path, mimi: MimiModel, cfg: LMConfig) -> VoiceLibrary:
        """Every `.pt`, `.wav` and `.flac` file directly in `folder`; any bad one is refused by name. Raises
        `VoiceError`."""
        folder = Path(folder).expanduser()
        if not folder.is_dir():
            raise VoiceError(f"voices folder not found: {folder}", "voices")
        files = voice_files(folder)
        if not files:
            raise VoiceError(f"{folder} holds no voice ({PRESET_SUFFIX}, {', '.join(AUDIO_SUFFIXES)} files)", "voices")
        voices = {}
        for path in files:
            try:
                voices[path.name] = load_voice(path, mimi, cfg)
            except VoiceError as e:
                raise VoiceError(str(e), "voices") from None
        logger.info(
            "%d voices from %s: %s",
            len(voices),
            folder,
            ", ".join(f"{n} ({v.frames} frames)" for n, v in voices.items()),
        )
        return cls(voices)

    @property
    def names(self) -> list[str]:
        return list(self.voices)

    def get(self, name: str) -> Voice:
        """The voice called `name` (a file name, or its stem). Raises `VoiceError` naming the voices there are."""
        voice = self.voices.get(name) or self.voices.get(self._by_stem.get(name, ""))
        if voice is None:
            raise VoiceError(f"unknown voice {name!r}; available: {', '.join(self.voices) or 'none'}")
        return voice
