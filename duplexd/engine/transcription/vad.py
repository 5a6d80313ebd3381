"""Voice-activity segmentation per session with Silero VAD: live utterance boundaries for a transcriber.

Sessions send 24 kHz audio in 80 ms frames; each is resampled to 16 kHz (a streaming soxr resampler per slot, so
the 16 kHz timeline is the session's own, sample for sample) and cut into Silero's 32 ms windows of 512 samples.
Silero's JIT model keeps an LSTM state `[2, batch, 128]` and a 64-sample context per stream, and its inner
`_model(x, state)` takes both explicitly, so all slots that have a window ready run in one batched call; a slot's
state is two small tensors, gathered and scattered by index.

Decisions (shared by the streaming segmenter and the offline `segments`): a start needs the probability at or
above `threshold` for `min_speech_s` (a dip below `neg_threshold` cancels it); a stop needs `hangover_s` of
probability below `neg_threshold` (hysteresis: between the two thresholds nothing changes). Event times are the
detected onset and offset; the utterance's 16 kHz audio also keeps `preroll_s` before the onset, so the first
phoneme is not cut. An utterance longer than `max_utterance_s` is cut there (a stop with `cut=True`, then a new
start at the same sample if speech goes on), which bounds each slot's memory.

The model file is read from the `silero-vad` wheel without importing the package: its `__init__` calls
`torch.set_num_threads(1)`, which would change the whole server's torch threading.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import soxr
import torch

from duplexd.wire import FRAME_SIZE, SAMPLE_RATE

log = logging.getLogger(__name__)

VAD_RATE = 16000  # Hz: Silero's rate
WINDOW = 512  # samples at 16 kHz, 32 ms: the only window Silero takes at 16 kHz
CONTEXT = 64  # samples of the previous window that Silero prepends to each one
STATE_SIZE = 128


@dataclass(frozen=True)
class VadConfig:
    """Thresholds and durations of the segmenter; Silero's usual 0.5 / 0.35 hysteresis."""

    threshold: float = 0.5
    neg_threshold: float = 0.35
    min_speech_s: float = 0.25  # shorter bursts (clicks, coughs) are not utterances
    hangover_s: float = 0.4  # silence before a stop: pauses between words do not split an utterance
    preroll_s: float = 0.25  # audio kept before the onset so the first phoneme is not cut
    max_utterance_s: float = 30.0  # bounds memory and the transcriber's input: longer speech is cut

    def samples(self, seconds: float) -> int:
        return round(seconds * VAD_RATE)


@dataclass(frozen=True)
class SpeechStarted:
    """Speech began at `sample` (24 kHz, the session's audio timeline)."""

    slot: int
    sample: int

    @property
    def t(self) -> float:
        return self.sample / SAMPLE_RATE


@dataclass(frozen=True)
class SpeechStopped:
    """Speech ended at `sample` (24 kHz); `audio` is the utterance at 16 kHz from `audio_start` (its onset less
    the pre-roll) to the end. `cut`: stopped at the maximum length, not by silence."""

    slot: int
    sample: int
    start: int  # the onset, 24 kHz
    audio_start: int  # 24 kHz
    audio: np.ndarray = field(repr=False)
    cut: bool = False

    @property
    def t(self) -> float:
        return self.sample / SAMPLE_RATE


VadEvent = SpeechStarted | SpeechStopped


def _to_session(n16: int) -> int:
    """A 16 kHz sample index as a 24 kHz one (the streaming resampler keeps the two timelines aligned)."""
    return n16 * SAMPLE_RATE // VAD_RATE


def load_silero() -> torch.jit.ScriptModule:
    """Silero's JIT model from the installed wheel, found without executing the package (see the module doc)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("silero-vad is not installed: pip install silero-vad")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.jit"
    with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript loading; Silero ships only this format
        warnings.simplefilter("ignore", DeprecationWarning)
        model = torch.jit.load(str(path), map_location="cpu")
    model.eval()
    return model


class _Decider:
    """One stream's start/stop logic over window probabilities, and its 16 kHz audio since the pre-roll."""

    def __init__(self, config: VadConfig) -> None:
        self.cfg = config
        self.min_speech = config.samples(config.min_speech_s)
        self.hangover = config.samples(config.hangover_s)
        self.preroll = config.samples(config.preroll_s)
        self.max_len = config.samples(config.max_utterance_s)
        self.reset()

    def reset(self) -> None:
        self.pos = 0  # 16 kHz samples seen
        self.chunks: list[np.ndarray] = []
        self.buf_start = 0  # 16 kHz index of chunks[0][0]
        self.buf_len = 0
        self.candidate: int | None = None  # onset of speech not yet long enough
        self.onset: int | None = None  # onset of the current utterance (triggered)
        self.audio_start = 0
        self.silence: int | None = None  # start of the current run of silence while triggered
        self.floor = 0  # no pre-roll before the previous utterance's end

    def _audio(self, start: int, end: int) -> np.ndarray:
        buf = np.concatenate(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks = [buf]
        return buf[start - self.buf_start : end - self.buf_start].copy()

    def _slice(self, start: int, end: int) -> np.ndarray:
        """Audio [start, end) from the newest chunks backwards, without joining the whole buffer."""
        parts, at = [], self.buf_start + self.buf_len
        for chunk in reversed(self.chunks):
            first = at - len(chunk)
            if first < end and at > start:
                parts.append(chunk[max(start - first, 0) : min(end - first, len(chunk))])
            if first <= start:
                break
            at = first
        return np.concatenate(parts[::-1]) if parts else np.zeros(0, np.float32)

    def committed(self, since: int) -> np.ndarray:
        """The running utterance's 16 kHz audio from offset `since` (from its `audio_start`) up to where it is
        sure to belong to it: the start of the current silence, else all heard so far."""
        if self.onset is None:
            return np.zeros(0, np.float32)
        end = self.silence if self.silence is not None else self.pos
        return self._slice(self.audio_start + since, end)

    def _trim(self, keep_from: int) -> None:
        """Drop audio before `keep_from`: only the pre-roll is kept while idle."""
        drop = keep_from - self.buf_start
        if drop <= 0:
            return
        buf = np.concatenate(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks = [buf[drop:]]
        self.buf_start, self.buf_len = keep_from, self.buf_len - drop

    def _stop(self, slot: int, end: int, cut: bool) -> SpeechStopped:
        assert self.onset is not None
        event = SpeechStopped(
            slot,
            _to_session(end),
            _to_session(self.onset),
            _to_session(self.audio_start),
            self._audio(self.audio_start, end),
            cut,
        )
        self.onset, self.silence, self.floor = None, None, end
        return event

    def _start(self, slot: int, onset: int) -> SpeechStarted:
        self.onset, self.silence = onset, None
        self.audio_start = max(onset - self.preroll, self.floor, self.buf_start)
        return SpeechStarted(slot, _to_session(onset))

    def feed(self, slot: int, window: np.ndarray, prob: float) -> list[VadEvent]:
        """Take one 512-sample window and its speech probability; return the events it completes."""
        cfg, at = self.cfg, self.pos
        self.chunks.append(window)
        self.buf_len += len(window)
        self.pos = end = at + len(window)
        events: list[VadEvent] = []
        if self.onset is None:
            if prob >= cfg.threshold and self.candidate is None:
                self.candidate = at
            elif prob < cfg.neg_threshold:
                self.candidate = None
            if self.candidate is not None and end - self.candidate >= self.min_speech:
                events.append(self._start(slot, self.candidate))
                self.candidate = None
        else:
            if prob >= cfg.threshold:
                self.silence = None
            elif prob < cfg.neg_threshold and self.silence is None:
                self.silence = at
            if self.silence is not None and end - self.silence >= self.hangover:
                events.append(self._stop(slot, self.silence, cut=False))
            elif end + WINDOW - self.audio_start > self.max_len:  # the next window would not fit
                silence = self.silence
                events.append(self._stop(slot, end if silence is None else silence, cut=True))
                if silence is None:  # still speaking: the next utterance starts here, with no pre-roll
                    events.append(self._start(slot, end))
        if self.onset is None:
            keep = (self.candidate if self.candidate is not None else end) - self.preroll
            self._trim(max(keep, self.floor, 0))
        return events

    def finish(self, slot: int) -> list[VadEvent]:
        """End of the stream: a running utterance stops where the audio ends (or where its silence began)."""
        if self.onset is None:
            return []
        return [self._stop(slot, self.silence if self.silence is not None else self.pos, cut=False)]


class VadSegmenter:
    """Streaming segmenter for up to `max_slots` sessions: `step` takes each active slot's next 24 kHz frame and
    runs every ready 32 ms window of all slots through one batched Silero call per round (2 or 3 rounds per
    80 ms frame: a frame is 1280 samples at 16 kHz, 2.5 windows)."""

    def __init__(
        self, max_slots: int, config: VadConfig | None = None, model: torch.jit.ScriptModule | None = None
    ) -> None:
        self.config = config or VadConfig()
        self.model = model if model is not None else load_silero()
        self.max_slots = max_slots
        self.state = torch.zeros(2, max_slots, STATE_SIZE)
        self.context = torch.zeros(max_slots, CONTEXT)
        self.deciders = [_Decider(self.config) for _ in range(max_slots)]
        self.resamplers: list[soxr.ResampleStream | None] = [None] * max_slots
        self.pending: list[npt.NDArray[np.float32]] = [np.zeros(0, np.float32) for _ in range(max_slots)]

    def open(self, slot: int) -> None:
        """Start a session's timeline at sample 0 in `slot` (fresh model state, resampler and decisions)."""
        self.state[:, slot] = 0
        self.context[slot] = 0
        self.deciders[slot].reset()
        self.resamplers[slot] = soxr.ResampleStream(SAMPLE_RATE, VAD_RATE, 1, dtype="float32")
        self.pending[slot] = np.zeros(0, np.float32)

    def close(self, slot: int) -> list[VadEvent]:
        """End a session: flush its resampler and stop a running utterance."""
        resampler = self.resamplers[slot]
        events: list[VadEvent] = []
        if resampler is not None:
            tail = resampler.resample_chunk(np.zeros(0, np.float32), last=True)
            self.pending[slot] = np.concatenate([self.pending[slot], tail])
            events = self._run([slot])
            events += self.deciders[slot].finish(slot)
        self.resamplers[slot] = None
        return events

    def committed(self, slot: int, since: int) -> np.ndarray:
        """The 16 kHz audio of `slot`'s running utterance from offset `since` that is sure to be part of it (speech
        so far, less a trailing silence that may end it): a transcriber can encode it while the user speaks. At
        the stop, `SpeechStopped.audio[since:]` is the rest. Empty when no utterance is running."""
        return self.deciders[slot].committed(since)

    def step(self, slots: list[int], frames: np.ndarray) -> list[VadEvent]:
        """Feed `frames[i]` (float32, `[len(slots), 1920]` at 24 kHz) to `slots[i]`; return the events, in order
        per slot."""
        frames = np.asarray(frames, dtype=np.float32)
        if frames.shape != (len(slots), FRAME_SIZE):
            raise ValueError(f"expected frames of shape {(len(slots), FRAME_SIZE)}, got {frames.shape}")
        for slot, frame in zip(slots, frames, strict=True):
            resampler = self.resamplers[slot]
            if resampler is None:
                raise KeyError(f"VAD slot {slot} is not open")
            self.pending[slot] = np.concatenate([self.pending[slot], resampler.resample_chunk(frame)])
        return self._run(slots)

    @torch.inference_mode()
    def _run(self, slots: list[int]) -> list[VadEvent]:
        events: list[VadEvent] = []
        while True:
            ready = [s for s in slots if len(self.pending[s]) >= WINDOW]
            if not ready:
                return events
            windows = np.stack([self.pending[s][:WINDOW] for s in ready])
            for s in ready:
                self.pending[s] = self.pending[s][WINDOW:]
            probs = self._probs(ready, windows)
            for s, window, prob in zip(ready, windows, probs, strict=True):
                events += self.deciders[s].feed(s, window, float(prob))

    def _probs(self, slots: list[int], windows: np.ndarray) -> np.ndarray:
        """One batched Silero call over the `slots`' next windows, carrying each slot's state and context."""
        index = torch.tensor(slots)
        x = torch.cat([self.context[index], torch.from_numpy(windows)], dim=1)
        out, state = self.model._model(x, self.state[:, index])
        self.state[:, index] = state
        self.context[index] = x[:, -CONTEXT:]
        return out[:, 0].numpy()


def segments(
    pcm: np.ndarray, rate: int, config: VadConfig | None = None, model: torch.jit.ScriptModule | None = None
) -> list[tuple[float, float]]:
    """Utterances `(start_s, end_s)` of a whole mono file, with the streaming segmenter's decisions (one
    resampling of the whole file, then Silero window by window)."""
    config = config or VadConfig()
    model = model if model is not None else load_silero()
    audio = np.asarray(pcm, dtype=np.float32)
    if rate != VAD_RATE:
        audio = soxr.resample(audio, rate, VAD_RATE).astype(np.float32)
    decider = _Decider(config)
    state = torch.zeros(2, 1, STATE_SIZE)
    context = torch.zeros(1, CONTEXT)
    events: list[VadEvent] = []
    with torch.inference_mode():
        for at in range(0, len(audio) - WINDOW + 1, WINDOW):
            window = audio[at : at + WINDOW]
            x = torch.cat([context, torch.from_numpy(window)[None]], dim=1)
            out, state = model._model(x, state)
            context = x[:, -CONTEXT:]
            events += decider.feed(0, window, float(out[0, 0]))
    events += decider.finish(0)
    return [(e.start / SAMPLE_RATE, e.t) for e in events if isinstance(e, SpeechStopped)]
