"""Uploaded audio files: what format a file is (from its first bytes), and its audio as 16 kHz mono.

The container is recognised from its magic bytes, not its name or Content-Type (clients get both wrong), and
only formats this machine's libsndfile decodes are taken: WAV (and RF64, W64), FLAC, Ogg (Vorbis, Opus), MP3
(libsndfile 1.1 and later), AIFF, AU, CAF. Anything else is `unsupported_format`, naming what it looks like when
that is known (MP4/M4A, WebM, AAC...) and the formats that work; a known container that libsndfile cannot read is
`invalid_audio`. Decoding goes block by block (one second), mixing to mono and resampling to 16 kHz as it goes,
so memory follows the 16 kHz result, not the upload's rate and channel count; the duration limit is checked from
the header first and again while decoding (a header may lie).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import soundfile as sf
import soxr

VAD_RATE = 16_000
MIN_RATE, MAX_RATE = 1_000, 384_000  # sample rates taken (soxr resamples any ratio; these bound the work)


def _mpeg_frame(h: bytes) -> bool:
    """An MPEG audio frame header: 11 sync bits, a layer, a valid bitrate and sample-rate index."""
    return (
        len(h) >= 4
        and h[0] == 0xFF
        and h[1] & 0xE0 == 0xE0
        and h[1] & 0x06 != 0
        and h[2] >> 4 != 0xF
        and ((h[2] >> 2) & 3 != 3)
    )


# libsndfile format name -> (the name users know, test on the first 16 bytes)
_KNOWN = {
    "WAV": ("WAV", lambda h: h[:4] == b"RIFF" and h[8:12] == b"WAVE"),
    "RF64": ("WAV (RF64)", lambda h: h[:4] == b"RF64"),
    "W64": ("WAV (W64)", lambda h: h[:4] == b"riff"),
    "FLAC": ("FLAC", lambda h: h[:4] == b"fLaC"),
    "OGG": ("Ogg", lambda h: h[:4] == b"OggS"),
    "MP3": ("MP3", lambda h: h[:3] == b"ID3" or _mpeg_frame(h)),
    "AIFF": ("AIFF", lambda h: h[:4] == b"FORM" and h[8:12] in (b"AIFF", b"AIFC")),
    "AU": ("AU", lambda h: h[:4] == b".snd"),
    "CAF": ("CAF", lambda h: h[:4] == b"caff"),
}
# Formats people send that libsndfile does not read: named in the refusal
_OTHERS = (
    ("MP4/M4A", lambda h: h[4:8] == b"ftyp"),
    ("WebM/Matroska", lambda h: h[:4] == b"\x1a\x45\xdf\xa3"),
    ("AAC (ADTS)", lambda h: h[:1] == b"\xff" and len(h) > 1 and h[1] & 0xF6 == 0xF0),
    ("AMR", lambda h: h[:5] == b"#!AMR"),
)


class UploadError(ValueError):
    """An upload that cannot be transcribed; `code` is the OpenAI-style error code, the message says why."""

    def __init__(self, message: str, code: str, status: int = 400, param: str | None = "file") -> None:
        super().__init__(message)
        self.code, self.status, self.param = code, status, param


@dataclass(frozen=True)
class Decoded:
    pcm: np.ndarray  # 16 kHz mono float32
    format: str  # what the container was, as users name it
    rate: int  # the file's own sample rate
    channels: int

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / VAD_RATE


def readable_formats() -> list[str]:
    """libsndfile names of the known containers this machine decodes (MP3 needs libsndfile 1.1+)."""
    available = sf.available_formats()
    return [name for name in _KNOWN if name in available]


def format_list() -> str:
    names: list[str] = []
    for name in readable_formats():
        label = _KNOWN[name][0]
        if name == "OGG":
            label += f" ({', '.join(sorted(s.capitalize() for s in sf.available_subtypes('OGG')))})"
        if label.split(" ")[0] not in [n.split(" ")[0] for n in names]:
            names.append(label)
    return ", ".join(names)


def sniff(head: bytes) -> str:
    """The libsndfile format of a file from its first bytes; `UploadError` when it is none this machine reads."""
    for name in readable_formats():
        if _KNOWN[name][1](head):
            return name
    what = next((label for label, test in _OTHERS if test(head)), None)
    said = f"{what} is not supported" if what else "not a recognised audio file"
    raise UploadError(f"unsupported audio format: {said}; send one of {format_list()}", "unsupported_format")


def decode(f: BinaryIO, max_seconds: float) -> Decoded:
    """The whole file as 16 kHz mono float32 (blocking: run it off the event loop)."""
    head = f.read(16)
    f.seek(0)
    if not head:
        raise UploadError("the file is empty", "empty_file")
    kind = sniff(head)
    label = _KNOWN[kind][0]
    too_long = f"the audio is longer than the {max_seconds:g} s this server transcribes"
    try:
        with sf.SoundFile(f) as snd:
            rate, channels = int(snd.samplerate), int(snd.channels)
            if not MIN_RATE <= rate <= MAX_RATE:
                raise UploadError(f"sample rate {rate} Hz: {MIN_RATE}-{MAX_RATE} Hz is supported", "invalid_audio")
            if snd.frames > max_seconds * rate:
                raise UploadError(f"{too_long} ({snd.frames / rate:.1f} s)", "audio_too_long")
            resampler = soxr.ResampleStream(rate, VAD_RATE, 1, dtype="float32") if rate != VAD_RATE else None
            out, frames = [], 0
            for block in snd.blocks(blocksize=rate, dtype="float32", always_2d=True):
                frames += len(block)
                if frames > max_seconds * rate:
                    raise UploadError(too_long, "audio_too_long")
                mono = np.nan_to_num(block.mean(axis=1), nan=0.0, posinf=0.0, neginf=0.0)
                out.append(resampler.resample_chunk(mono) if resampler is not None else mono)
            if resampler is not None:
                out.append(resampler.resample_chunk(np.zeros(0, np.float32), last=True))
    except RuntimeError as e:  # sf.LibsndfileError and the like  # soundfile raises RuntimeError subclasses
        why = getattr(e, "error_string", None) or str(e)  # not the message: it names the temporary file object
        raise UploadError(f"cannot decode the file as {label}: {why}", "invalid_audio") from None
    if frames == 0:
        raise UploadError(f"the {label} file holds no audio frames", "no_audio")
    return Decoded(np.concatenate(out).astype(np.float32, copy=False), label, rate, channels)
