"""The audio formats `/v1/audio/speech` answers in, each written as the speech is made, frame by frame.

`pcm` is raw 16-bit little-endian samples at 24 kHz (OpenAI's); `wav` the same behind a header of unknown sizes;
`opus` Ogg Opus pages from the server's Opus encoder; `mp3` comes from libsndfile (through soundfile) at a constant
bit rate, its bytes sent as it writes them (the Info frame it rewrites at the end is already sent; at a constant
rate a reader that sizes the stream from its first frame, as libsndfile does, still finds its length). `flac` is
libsndfile's too, but sent whole once the speech is said: a streamed FLAC's header cannot hold its length, and
readers such as libsndfile then take it for endless. `aac` has no encoder here and is refused.
"""

from __future__ import annotations

import io
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import soundfile as sf

from duplexd.server.codec.streams import OggOpusEncoder
from duplexd.server.codec.wav import pcm16, wav_header

MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
REFUSED = {"aac": "no AAC encoder in this server"}
MP3_COMPRESSION = 0.5  # libsndfile's 0 (best) to 1: about 80 kb/s for 24 kHz mono


class AudioWriter(ABC):
    """Speech frames in, the format's bytes out as soon as they exist (`finish` gives what is left)."""

    @abstractmethod
    def write(self, pcm: np.ndarray) -> bytes: ...

    def finish(self) -> bytes:
        return b""


class Pcm16Writer(AudioWriter):
    def __init__(self, sample_rate: int, header: bool) -> None:
        self._header = wav_header(sample_rate) if header else b""

    def write(self, pcm: np.ndarray) -> bytes:
        out, self._header = self._header + pcm16(pcm), b""
        return out

    def finish(self) -> bytes:
        return self._header  # a stream with no speech is still a WAV


class OpusWriter(AudioWriter):
    def __init__(self, sample_rate: int) -> None:
        self._encoder = OggOpusEncoder("fast", sample_rate)

    def write(self, pcm: np.ndarray) -> bytes:
        return self._encoder.encode(pcm)

    def finish(self) -> bytes:
        self._encoder.close()
        return b""


class _Tail(io.RawIOBase):
    """A file libsndfile writes into that hands on what it appends; writes over bytes already handed on are
    dropped."""

    def __init__(self) -> None:
        self.sent = 0  # bytes handed on
        self.buffer = bytearray()  # bytes from `sent` on
        self.position = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        end = self.sent + len(self.buffer)
        self.position = {io.SEEK_SET: offset, io.SEEK_CUR: self.position + offset, io.SEEK_END: end + offset}[whence]
        return self.position

    def write(self, data: bytes) -> int:  # type: ignore[override]
        at, size = self.position - self.sent, len(data)
        self.position += size
        if at + size <= 0:
            return size
        data = bytes(data)[max(0, -at) :]
        at = max(at, 0)
        self.buffer[at : at + len(data)] = data
        return size

    def take(self) -> bytes:
        out = bytes(self.buffer)
        self.sent += len(out)
        self.buffer.clear()
        return out


class SoundFileWriter(AudioWriter):
    def __init__(self, sample_rate: int, fmt: str, subtype: str, stream: bool = True, **options: Any) -> None:
        self._tail, self._stream = _Tail(), stream
        self._file = sf.SoundFile(
            self._tail, mode="w", samplerate=sample_rate, channels=1, format=fmt, subtype=subtype, **options
        )

    def write(self, pcm: np.ndarray) -> bytes:
        self._file.write(np.asarray(pcm, dtype=np.float32))
        return self._tail.take() if self._stream else b""

    def finish(self) -> bytes:
        self._file.close()
        return self._tail.take()


def audio_writer(fmt: str, sample_rate: int) -> AudioWriter:
    """The writer of a `response_format` (one of `MEDIA_TYPES`)."""
    if fmt in ("pcm", "wav"):
        return Pcm16Writer(sample_rate, header=fmt == "wav")
    if fmt == "opus":
        return OpusWriter(sample_rate)
    if fmt == "mp3":
        return SoundFileWriter(
            sample_rate, "MP3", "MPEG_LAYER_III", bitrate_mode="CONSTANT", compression_level=MP3_COMPRESSION
        )
    if fmt == "flac":
        return SoundFileWriter(sample_rate, "FLAC", "PCM_16", stream=False)
    raise ValueError(f"unknown response format {fmt!r}")
