"""The batched text-to-speech service: speech streams sharing one `TTSGen` and Mimi, stepped by one thread.

A stream opens with its voice (`SpeechService.open`), takes words as they come (`push`, then `finish` at the end of
its text), and gives back events: each word as the model takes it (`WordTaken`, with its step, which moshi-server
times `Text` messages by) and each 80 ms of speech (`SpeechChunk`, 24 kHz), ending when its text and the audio
delay behind it are said. The loop thread steps every stream that is `ready` (its next words are there), so a
stream waiting for words never holds up the others, and sleeps when none is. A stream that closes frees its slot
at the next step.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CapacityError, SessionClosed
from ..mailbox import Mailbox
from ..models.mimi import MimiStreams
from .generate import TTSGen, Voice
from .model import TTSModel
from .words import Word

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WordTaken:
    text: str
    step: int  # the model's step at which the word started (its `Text` is timed from step + 1)


@dataclass(frozen=True)
class SpeechChunk:
    pcm: np.ndarray  # [frame_size] float32 at the codec's rate
    frame: int  # the audio frame's index in the stream (0 for the first 80 ms of speech)


SpeechEvent = WordTaken | SpeechChunk


class SpeechStream:
    """One stream's handle: words in, events out (`get` from a thread, `recv` from asyncio; None once ended)."""

    def __init__(self, service: SpeechService, slot: int) -> None:
        self._service, self.slot = service, slot
        self.ended = False
        self.events: Mailbox[SpeechEvent] = Mailbox(service.lock, lambda: self.ended)

    def push(self, words: Sequence[Word]) -> None:
        self._service.command(self, lambda gen: gen.push(self.slot, words))

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
    words: int = 0  # words of the transcript already sent
    closing: bool = False


class SpeechService:
    def __init__(self, model: TTSModel, max_streams: int, final_padding: int = 4) -> None:
        self.model = model
        self.gen = TTSGen(model.lm, model.conditioner, model.tts, num_slots=max_streams, final_padding=final_padding)
        self.mimi = MimiStreams(model.mimi, max_streams)
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self._commands: deque[tuple[SpeechStream, Callable[[TTSGen], None]]] = deque()
        self._slots: dict[int, _Slot] = {}
        self._free = list(range(max_streams))
        self._running = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="tts-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self.lock:
            self._running = False
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self.lock:
            for slot in list(self._slots.values()):
                self._end(slot)

    def open(self, voice: Voice, temperature: float = 0.0, seed: int = 0) -> SpeechStream:
        """A new stream in a free slot (`CapacityError` when there is none), its voice's keys and values computed
        on the loop thread before its first step."""
        with self.lock:
            if not self._free:
                raise CapacityError("no free text-to-speech slot")
            stream = SpeechStream(self, self._free.pop(0))
            self._slots[stream.slot] = _Slot(stream)

            def begin(gen: TTSGen) -> None:
                gen.start(stream.slot, [], voice, temperature, seed)
                self.mimi.reset(stream.slot)

            self._commands.append((stream, begin))
            self._wake.notify_all()
        return stream

    def command(self, stream: SpeechStream, fn: Callable[[TTSGen], None]) -> None:
        with self.lock:
            if stream.ended:
                raise SessionClosed("the speech stream has ended")
            self._commands.append((stream, fn))
            self._wake.notify_all()

    def close(self, stream: SpeechStream) -> None:
        with self.lock:
            slot = self._slots.get(stream.slot)
            if slot is not None and slot.stream is stream:
                slot.closing = True
                self._wake.notify_all()

    def _end(self, slot: _Slot) -> None:
        """Lock held: the stream ends (its mailbox says so) and its slot is free again."""
        slot.stream.ended = True
        slot.stream.events.wake()
        del self._slots[slot.stream.slot]
        self.gen.states[slot.stream.slot] = None
        self._free.append(slot.stream.slot)

    def _loop(self) -> None:
        while True:
            with self.lock:
                self._wake.wait_for(lambda: not self._running or self._commands or self._runnable(), timeout=0.5)
                if not self._running:
                    return
                for closing in [s for s in self._slots.values() if s.closing]:
                    self._end(closing)
                commands = [fn for stream, fn in self._commands if not stream.ended]  # a closed one's are dropped
                self._commands.clear()
            for fn in commands:  # the loop thread alone touches the generator's state
                fn(self.gen)
            with self.lock:
                live = self._ready_slots()
            if live:
                try:
                    self._step(live)
                except Exception:  # noqa: BLE001 - every stream ends rather than hangs
                    logger.exception("text-to-speech step failed; ending its streams")
                    with self.lock:
                        for i in live:
                            if i in self._slots:
                                self._end(self._slots[i])

    def _ready_slots(self) -> list[int]:
        """Lock held: the slots whose session has begun and may step (`TTSGen.ready`)."""
        return sorted(i for i in self._slots if self.gen.states[i] is not None and self.gen.ready(i))

    def _runnable(self) -> bool:
        return any(s.closing for s in self._slots.values()) or bool(self._ready_slots())

    def _row(self, slot: int) -> int:
        """The index of the row `slot`'s last step gave (negative while its codebook delays give none)."""
        return self.gen.steps[slot] - 1 - self.gen.cfg.max_delay

    def _step(self, live: list[int]) -> None:
        tts = self.model.tts
        out, _ = self.gen.step(live)
        speaking = [(k, slot) for k, slot in enumerate(live) if self._row(slot) >= tts.delay_steps]
        pcm = None
        if speaking:
            codes = out[[k for k, _ in speaking], 1:, None]
            with torch.no_grad():
                pcm = self.mimi.decode([slot for _, slot in speaking], codes).float().cpu().numpy()
        chunks = {slot: pcm[i] for i, (_, slot) in enumerate(speaking)} if pcm is not None else {}
        with self.lock:
            for slot_id in live:
                slot = self._slots.get(slot_id)
                if slot is None:
                    continue
                state = self.gen.states[slot_id]
                assert state is not None
                for text, step in state.transcript[slot.words :]:
                    slot.stream.events.items.append(WordTaken(text, step))
                slot.words = len(state.transcript)
                if slot_id in chunks:
                    frame = self._row(slot_id) - tts.delay_steps
                    slot.stream.events.items.append(SpeechChunk(chunks[slot_id], frame))
                slot.stream.events.wake()
                if self.gen.done(slot_id):
                    self._end(slot)
