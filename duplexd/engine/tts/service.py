"""The batched text-to-speech service: speech streams sharing one `TTSGen` and Mimi, stepped by one thread.

A stream takes a free slot (`SpeechService.open`), starts with its voice (`begin`, or `open(voice)`), takes words
as they come (`push`, then `finish` at the end of its text), and gives back events: each word or pause as the model
takes it (`WordTaken`, with its step, which moshi-server times `Text` messages by), each 80 ms of speech
(`SpeechChunk`, 24 kHz, clamped to ±0.99 as moshi-server's worker clamps it) and, once its text and the audio delay
behind it are said, `SpeechEnd` with its step count. The loop thread steps every stream that is `ready` (its next
words are there), so a stream waiting for words never holds up the others, and sleeps when none is; streams still
inside their audio delay also take cheap steps alone between those (`TEXT_ONLY_STEPS`). A stream that
closes frees its slot at the next step. With `graphs` (CUDA) each half of the step is a captured graph a batch
bucket (`TTSGen`), captured on the loop thread before `start` returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import CapacityError, SessionClosed
from ..listeners import Listeners
from ..loop_thread import start_loop_thread
from ..mailbox import Mailbox
from ..models.mimi import MimiStreams
from ..turns import DeviceTurns, maybe_turn
from .generate import TTSGen, Voice
from .model import TTSModel
from .words import Word

logger = logging.getLogger(__name__)


PCM_LIMIT = 0.99  # moshi-server's worker clamps the decoded speech to this
# Streams still inside their audio delay take this many steps alone (no DepFormer, no Mimi: cheap) between two steps
# of every stream, as moshi-server's worker interleaves them (`interleaved_text_only`): a new stream reaches its first
# audio in fewer full steps while the others keep speaking.
TEXT_ONLY_STEPS = 2


@dataclass(frozen=True)
class WordTaken:
    text: str  # the word's text (a pause's, as it was pushed)
    step: int  # the model's step at which the word started (its `Text` is timed from step + 1)


@dataclass(frozen=True)
class SpeechChunk:
    pcm: np.ndarray  # [frame_size] float32 at the codec's rate
    frame: int  # the audio frame's index in the stream (0 for the first 80 ms of speech)


@dataclass(frozen=True)
class SpeechEnd:
    steps: int  # the steps the stream took, its last frame included


SpeechEvent = WordTaken | SpeechChunk | SpeechEnd


class SpeechStream:
    """One stream's handle: words in, events out (`get` from a thread, `recv` from asyncio; None once ended)."""

    def __init__(self, service: SpeechService, slot: int) -> None:
        self._service, self.slot = service, slot
        self.ended = False
        self.events: Mailbox[SpeechEvent] = Mailbox(service.lock, lambda: self.ended)

    def begin(self, voice: Voice, temperature: float = 0.0, seed: int = 0) -> None:
        """Start saying (before the first `push`): the voice's keys and values are computed on the loop thread."""
        self._service.begin(self, voice, temperature, seed)

    def push(self, words: Sequence[Word]) -> None:
        self._service.push(self, words)

    def finish(self) -> None:
        self._service.command(self, lambda gen: gen.finish(self.slot))

    def close(self) -> None:
        self._service.close(self)

    def get(self, timeout: float | None = None) -> SpeechEvent | None:
        return self.events.get(timeout, "speech event")

    async def recv(self) -> SpeechEvent | None:
        return await self.events.recv()


@dataclass
class _Slot:
    stream: SpeechStream
    texts: list[str] = field(default_factory=list)  # the words and pauses pushed, in order (loop thread)
    taken: int = 0  # of them, those the model has taken and the stream was told of
    closing: bool = False


class SpeechService:
    def __init__(
        self, model: TTSModel, max_streams: int, final_padding: int = 4, threads: int = 1, graphs: bool = False
    ) -> None:
        self.model, self.max_streams, self.threads = model, max_streams, threads
        graphs = graphs and model.lm.text_emb.device.type == "cuda"  # `graphs` asks; only CUDA has them
        self.gen = TTSGen(
            model.lm,
            model.conditioner,
            model.tts,
            num_slots=max_streams,
            final_padding=final_padding,
            graphs=graphs,
            pad=graphs,
            n_q=model.n_q,
        )
        self.mimi = MimiStreams(model.mimi, max_streams)
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self._commands: deque[tuple[SpeechStream, Callable[[TTSGen], None]]] = deque()
        self._slots: dict[int, _Slot] = {}
        self._free = list(range(max_streams))
        self._running = False
        self._text_only_left = TEXT_ONLY_STEPS
        self._thread: threading.Thread | None = None
        self.on_step: Listeners[[float, int]] = Listeners("speech step")  # (seconds, streams stepped)
        self.turns: DeviceTurns | None = None  # set when another model's loop steps on this device (`turns`)

    def start(self) -> None:
        """Start the loop thread and wait until it is warm (its graphs captured, with `graphs`)."""
        self._running = True
        self._thread = start_loop_thread("tts-loop", self.gen.offsets.device, self.threads, self._capture, self._loop)

    def stop(self) -> None:
        with self.lock:
            self._running = False
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self.lock:
            for slot in list(self._slots.values()):
                self._end(slot)

    def open(self, voice: Voice | None = None, temperature: float = 0.0, seed: int = 0) -> SpeechStream:
        """A new stream in a free slot (`CapacityError` when there is none), begun in `voice` when one is given."""
        with self.lock:
            if not self._free:
                raise CapacityError("no free text-to-speech slot")
            stream = SpeechStream(self, self._free.pop(0))
            self._slots[stream.slot] = _Slot(stream)
        if voice is not None:
            stream.begin(voice, temperature, seed)
        return stream

    @property
    def used_streams(self) -> int:
        with self.lock:
            return len(self._slots)

    def begin(self, stream: SpeechStream, voice: Voice, temperature: float, seed: int) -> None:
        def begin(gen: TTSGen) -> None:
            gen.start(stream.slot, [], voice, temperature, seed)
            self.mimi.reset(stream.slot)

        self.command(stream, begin)

    def push(self, stream: SpeechStream, words: Sequence[Word]) -> None:
        def push(gen: TTSGen) -> None:
            gen.push(stream.slot, words)  # first: it refuses a stream that has not begun
            self._slots[stream.slot].texts.extend(word.text for word in words)

        self.command(stream, push)

    def command(self, stream: SpeechStream, fn: Callable[[TTSGen], None]) -> None:
        with self.lock:
            if stream.ended:
                raise SessionClosed("the speech stream has ended")
            self._commands.append((stream, fn))
            self._wake.notify_all()

    def close(self, stream: SpeechStream) -> None:
        with self.lock:
            slot = self._slot_of(stream)
            if slot is not None:
                slot.closing = True
                self._wake.notify_all()

    def _slot_of(self, stream: SpeechStream) -> _Slot | None:
        """Lock held: `stream`'s slot, while it still holds one."""
        slot = self._slots.get(stream.slot)
        return slot if slot is not None and slot.stream is stream else None

    def _end(self, slot: _Slot) -> None:
        """Lock held: the stream ends (its mailbox says so) and its slot is free again."""
        slot.stream.ended = True
        slot.stream.events.wake()
        del self._slots[slot.stream.slot]
        self.gen.states[slot.stream.slot] = None
        self._free.append(slot.stream.slot)

    def _capture(self) -> None:
        with self._turn():  # no step of the engine sharing the device runs inside the capture
            self.gen.capture()

    def _loop(self) -> None:
        while True:
            with self.lock:
                self._wake.wait_for(lambda: not self._running or self._commands or self._runnable(), timeout=0.5)
                if not self._running:
                    return
                for closing in [s for s in self._slots.values() if s.closing]:
                    self._end(closing)
                commands = [(s, fn) for s, fn in self._commands if not s.ended]  # a closed one's are dropped
                self._commands.clear()
            for stream, fn in commands:  # the loop thread alone touches the generator's state
                try:
                    fn(self.gen)
                except Exception:  # noqa: BLE001 - a stream used out of order ends alone
                    logger.exception("text-to-speech stream in slot %d failed; ending it", stream.slot)
                    with self.lock:
                        if (slot := self._slot_of(stream)) is not None:
                            self._end(slot)
            with self.lock:
                live = self._chosen(self._ready_slots())
            if live:
                try:
                    started = time.perf_counter()
                    self._step(live)
                    self.on_step(time.perf_counter() - started, len(live))
                except Exception:  # noqa: BLE001 - every stream ends rather than hangs
                    logger.exception("text-to-speech step failed; ending its streams")
                    with self.lock:
                        for i in live:
                            if i in self._slots:
                                self._end(self._slots[i])

    def _turn(self) -> AbstractContextManager[None]:
        """One part of a step (listen, speak, Mimi) on the device, between the engine's steps when it shares it."""
        return maybe_turn(self.turns, urgent=False)

    def _ready_slots(self) -> list[int]:
        """Lock held: the slots whose session has begun and may step (`TTSGen.ready`)."""
        return sorted(i for i in self._slots if self.gen.states[i] is not None and self.gen.ready(i))

    def _chosen(self, ready: list[int]) -> list[int]:
        """The slots to step: those inside their audio delay alone for `TEXT_ONLY_STEPS` steps, then every one."""
        waiting = [i for i in ready if self.gen.steps[i] < self.model.tts.delay_steps]
        if waiting and len(waiting) < len(ready) and self._text_only_left > 0:
            self._text_only_left -= 1
            return waiting
        self._text_only_left = TEXT_ONLY_STEPS
        return ready

    def _runnable(self) -> bool:
        return any(s.closing for s in self._slots.values()) or bool(self._ready_slots())

    def _row(self, slot: int) -> int:
        """The index of the row `slot`'s last step gave (negative while its codebook delays give none)."""
        return self.gen.steps[slot] - 1 - self.gen.cfg.max_delay

    def _step(self, live: list[int]) -> None:
        tts = self.model.tts
        out, _ = self.gen.step(live, self._turn)
        speaking = [(k, slot) for k, slot in enumerate(live) if self._row(slot) >= tts.delay_steps]
        pcm = None
        if speaking:
            codes = out[[k for k, _ in speaking], 1:, None]
            with torch.no_grad(), self._turn():
                decoded = self.mimi.decode([slot for _, slot in speaking], codes).float()
            pcm = decoded.clamp_(-PCM_LIMIT, PCM_LIMIT).cpu().numpy()
        chunks = {slot: pcm[i] for i, (_, slot) in enumerate(speaking)} if pcm is not None else {}
        with self.lock:
            for slot_id in live:
                slot = self._slots.get(slot_id)
                if slot is None:
                    continue
                state = self.gen.states[slot_id]
                assert state is not None
                events = slot.stream.events.items
                for step in state.consumed_at[slot.taken :]:
                    events.append(WordTaken(slot.texts[slot.taken], step))
                    slot.taken += 1
                if slot_id in chunks:
                    frame = self._row(slot_id) - tts.delay_steps
                    events.append(SpeechChunk(chunks[slot_id], frame))
                if self.gen.done(slot_id):
                    events.append(SpeechEnd(self.gen.steps[slot_id]))
                    self._end(slot)
                slot.stream.events.wake()
