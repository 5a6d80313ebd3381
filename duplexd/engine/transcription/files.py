"""Whole-file transcription: resample to 16 kHz, split at pauses with the VAD, transcribe each utterance.

Shared by `POST /v1/audio/transcriptions` and `duplexd transcribe`. The work is split in two so a server can run
the CPU part off its event loop and await the rest: `plan_file` (resampling and Silero, in the caller's thread)
finds the utterances, `TranscriptionService.transcribe` decodes them on the service's own threads, and
`FilePlan.result` puts the pieces together. `transcribe_file` does all three, blocking.

Utterances are cut as the live path cuts them: the service's `VadConfig` (hysteresis, hang-over), at most 30 s
each (the transcriber's input limit). Each utterance is transcribed from its onset less the pre-roll (never
before the previous utterance's end), as a live `SpeechStopped.audio` is, so the first phoneme is not lost; its
reported start and end are the VAD's onset and offset.

When the VAD hears nothing the result is empty (no text, no segments), not an error, with one exception: a file
of at most 30 s with a part as loud as speech (`LOUD_DBFS` over 100 ms) is transcribed whole, as one segment.
Silero can miss a lone short word (shorter than `min_speech_s`, or trimmed so tight that its recurrent state has
no lead-in); a short loud upload is most likely such a word, and a transcript of noise is easier to spot than a
word silently dropped. Such a segment says so (`vad_speech=False`).

The `*_body` functions render a result in OpenAI's response formats (`json`, `verbose_json`, `text`, `srt`,
`vtt`); fields OpenAI's Whisper fills that this transcriber does not measure are documented at `verbose_body`.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import soxr
import torch

from .service import FileSegment, TranscriptionService
from .transcriber import DEFAULT_PROMPT, MAX_SAMPLES
from .vad import VAD_RATE, VadConfig, segments

LOUD_DBFS = -30.0  # RMS over 100 ms at or above this counts as "as loud as speech" (speech peaks near -20 dBFS)
LOUD_WINDOW = VAD_RATE // 10
MEL_HOP = 160  # samples at 16 kHz per 10 ms frame: the unit of `seek`, as Whisper's
RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


class FileTranscriptionError(RuntimeError):
    """An utterance of the file could not be transcribed (the service's reason: overload, a decoding failure)."""

    def __init__(self, message: str, overloaded: bool) -> None:
        super().__init__(message)
        self.overloaded = overloaded


@dataclass(frozen=True)
class Span:
    """One utterance, in 16 kHz samples: the VAD's onset and offset, and where its transcribed audio starts."""

    start: int
    end: int
    audio_start: int
    vad_speech: bool = True  # False: the whole file, transcribed without the VAD hearing speech (module doc)


@dataclass(frozen=True)
class Segment:
    id: int
    start_s: float
    end_s: float
    audio_start: int  # 16 kHz sample where the transcribed audio starts (the onset less the pre-roll)
    text: str
    tokens: tuple[int, ...]
    vad_speech: bool = True


@dataclass(frozen=True)
class FileTranscript:
    text: str  # the segments' texts, stripped, joined with spaces
    duration_s: float
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class FilePlan:
    """A file ready for the service: its 16 kHz audio and its utterances."""

    pcm: np.ndarray  # 16 kHz mono float32
    spans: tuple[Span, ...]

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / VAD_RATE

    @property
    def service_spans(self) -> list[tuple[int, int]]:
        """The sample ranges to give `TranscriptionService.transcribe`: from the pre-roll to the offset."""
        return [(s.audio_start, s.end) for s in self.spans]

    def result(self, done: Sequence[FileSegment]) -> FileTranscript:
        """The transcript from the service's segments (one per span, in order); `FileTranscriptionError` when one
        failed (a partial transcript would hide a hole)."""
        failed = [(i, s) for i, s in enumerate(done) if s.error is not None]
        if failed:
            i, seg = failed[0]
            reason = seg.error or ""
            raise FileTranscriptionError(
                f"utterance {i + 1} of {len(done)} ({self.spans[i].start / VAD_RATE:.2f}-"
                f"{self.spans[i].end / VAD_RATE:.2f} s) was not transcribed: {reason}",
                overloaded=reason.startswith("transcriber overloaded"),
            )
        out = tuple(
            Segment(i, s.start / VAD_RATE, s.end / VAD_RATE, s.audio_start, seg.text, seg.tokens, s.vad_speech)
            for i, (s, seg) in enumerate(zip(self.spans, done, strict=True))
        )
        text = " ".join(t for t in (seg.text.strip() for seg in out) if t)
        return FileTranscript(text, self.duration_s, out)


def to_16k(pcm: np.ndarray, rate: int) -> np.ndarray:
    """Mono float32 at 16 kHz (soxr, its default high quality); non-finite samples become silence."""
    audio: npt.NDArray[np.float32] = np.asarray(pcm, dtype=np.float32).reshape(-1)
    if rate != VAD_RATE:
        audio = soxr.resample(audio, rate, VAD_RATE)
    audio = np.ascontiguousarray(audio, dtype=np.float32)
    if not np.isfinite(audio).all():
        audio = np.nan_to_num(audio, nan=0.0, posinf=0.0, neginf=0.0)
    return audio


def loud(pcm16k: np.ndarray) -> bool:
    """Some 100 ms of the audio is at least `LOUD_DBFS` (RMS)."""
    if len(pcm16k) == 0:
        return False
    n = len(pcm16k) // LOUD_WINDOW
    windows = pcm16k[: n * LOUD_WINDOW].reshape(n, LOUD_WINDOW) if n else pcm16k[None]
    rms = np.sqrt(np.mean(np.square(windows, dtype=np.float64), axis=1))
    return bool(20 * np.log10(max(float(rms.max()), 1e-9)) >= LOUD_DBFS)


def plan_file(
    pcm: np.ndarray, rate: int, config: VadConfig | None = None, model: torch.jit.ScriptModule | None = None
) -> FilePlan:
    """Resample and segment a whole mono file (CPU work: a server runs it off its event loop). `model`: a Silero
    model of the caller's (one per thread at a time), else one is loaded."""
    audio = to_16k(pcm, rate)
    cfg = config or VadConfig()
    if cfg.max_utterance_s > MAX_SAMPLES / VAD_RATE:
        cfg = dataclasses.replace(cfg, max_utterance_s=MAX_SAMPLES / VAD_RATE)
    preroll = cfg.samples(cfg.preroll_s)
    spans: list[Span] = []
    floor = 0
    # `segments` gives onsets and offsets at window boundaries (multiples of 512 samples), exact in seconds
    for start_s, end_s in segments(audio, VAD_RATE, cfg, model):
        start, end = round(start_s * VAD_RATE), round(end_s * VAD_RATE)
        spans.append(Span(start, end, max(start - preroll, floor, 0)))
        floor = end
    if not spans and 0 < len(audio) <= MAX_SAMPLES and loud(audio):
        spans.append(Span(0, len(audio), 0, vad_speech=False))
    return FilePlan(audio, tuple(spans))


def transcribe_file(
    service: TranscriptionService,
    pcm: np.ndarray,
    rate: int,
    prompt: str = DEFAULT_PROMPT,
    model: torch.jit.ScriptModule | None = None,
    timeout: float | None = None,
) -> FileTranscript:
    """A whole mono file at any rate through the VAD and a started service (blocking)."""
    plan = plan_file(pcm, rate, service.config.vad, model)
    return plan.result(service.transcribe(plan.pcm, plan.service_spans, prompt).result(timeout))


# ------------------------------------------------------------------------------------------ response bodies


def compression_ratio(text: str) -> float:
    """Whisper's repetition measure: UTF-8 bytes over zlib-compressed bytes (0 for no text)."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def json_body(result: FileTranscript) -> dict:
    return {"text": result.text, "usage": {"type": "duration", "seconds": round(result.duration_s, 3)}}


def verbose_body(result: FileTranscript, language: str, model: str) -> dict:
    """OpenAI's `verbose_json`. Per segment: `seek` is where its transcribed audio starts, in 10 ms frames;
    `temperature` is 0.0 (decoding is greedy); `avg_logprob` is 0.0 because greedy decoding keeps no scores
    (not a measured confidence); `compression_ratio` is measured as Whisper does; `no_speech_prob` is the VAD's
    verdict, 0.0 where it heard speech and 1.0 for a whole short file transcribed without it (module doc).
    `model` is an addition: the transcriber that answered."""
    return {
        "task": "transcribe",
        "language": language,
        "duration": round(result.duration_s, 3),
        "text": result.text,
        "segments": [
            {
                "id": s.id,
                "seek": s.audio_start // MEL_HOP,
                "start": round(s.start_s, 3),
                "end": round(s.end_s, 3),
                "text": s.text,
                "tokens": list(s.tokens),
                "temperature": 0.0,
                "avg_logprob": 0.0,
                "compression_ratio": round(compression_ratio(s.text), 4),
                "no_speech_prob": 0.0 if s.vad_speech else 1.0,
            }
            for s in result.segments
        ],
        "usage": {"type": "duration", "seconds": round(result.duration_s, 3)},
        "model": model,
    }


def _clock(seconds: float, sep: str) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def text_body(result: FileTranscript, fmt: str) -> str:
    """`text` (the transcript and a newline), `srt` or `vtt` (one cue per segment with text)."""
    cues = [s for s in result.segments if s.text.strip()]
    if fmt == "text":
        return result.text + "\n"
    if fmt == "srt":
        return "".join(
            f"{i}\n{_clock(s.start_s, ',')} --> {_clock(s.end_s, ',')}\n{s.text.strip()}\n\n"
            for i, s in enumerate(cues, 1)
        )
    if fmt == "vtt":
        return "WEBVTT\n\n" + "".join(
            f"{_clock(s.start_s, '.')} --> {_clock(s.end_s, '.')}\n{s.text.strip()}\n\n" for s in cues
        )
    raise ValueError(f"unknown text format {fmt!r}")
