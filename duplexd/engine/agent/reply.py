"""One agent reply: the LLM's streamed answer said by the TTS as its words arrive, as one stream of plain events.

The LLM's text is cut into words as it streams (`WordCutter`) and each word goes to the reply's TTS stream at once,
no waiting for sentences; the TTS stream is opened at the first word (a reply that only calls a tool takes no
speech slot). What comes back, in the order it happens: the LLM's text deltas and tool calls, each word as the
TTS takes it (`Spoken`, with the audio frame it is heard from: a word taken at step c starts c + 1 frames into the
reply's speech, as moshi-server times its `Text` messages), each 80 ms of speech (`Audio`), and last `Done`.
`cancel` (barge-in, `response.cancel`) stops both at once: the LLM's request is closed and the TTS stream freed.

The reply talks to the LLM through `LLMClient` and to the TTS through the stream `open_speech` gives; the protocol
that drives it (`server/realtime/agent.py`) paces the audio and words out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import CapacityError, SessionClosed
from ..tts.service import SpeechChunk, SpeechEnd, SpeechStream, WordTaken
from ..tts.words import Word
from .events import Finish, TextDelta, ToolCallArguments, ToolCallEnd, ToolCallStart, Usage
from .llm import ChatRequest, LLMClient, LLMError
from .words import WordCutter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Speaker:
    """How a reply speaks: `open` gives a new TTS stream begun in the session's voice (`CapacityError` when none is
    free), `split` turns a word of text into the TTS's words (the stream's own splitter)."""

    open: Callable[[], SpeechStream]
    split: Callable[[str], Sequence[Word]]


@dataclass(frozen=True)
class Spoken:
    """The TTS took `text` (a word as the LLM wrote it); it is heard from `frame` (80 ms frames of the reply's
    speech)."""

    text: str
    frame: int


@dataclass(frozen=True)
class Audio:
    pcm: np.ndarray  # [frame_size] float32 at the TTS's rate
    frame: int


@dataclass(frozen=True)
class Done:
    """The reply has ended: the LLM's finish reason, its usage where counted, and `error` if it failed (what was
    said before the failure was said)."""

    reason: str | None
    usage: Usage | None
    error: str | None = None


ReplyEvent = TextDelta | ToolCallStart | ToolCallArguments | ToolCallEnd | Spoken | Audio | Done


@dataclass
class ReplyTimes:
    """When each part of a reply began (`time.monotonic()`; None: it never came): where its latency goes."""

    created: float
    asked: float | None = None  # the LLM request sent (after the turn's transcript, when the reply waited for it)
    first_token: float | None = None  # the LLM's first text or tool call
    first_word: float | None = None  # the first whole word pushed to the TTS
    first_audio: float | None = None  # the TTS's first 80 ms of speech

    def stages(self) -> dict[str, float]:
        """Seconds from each mark to the next, for those that came: `wait` (created → asked), `llm` (→ first
        token), `words` (→ first word), `tts` (→ first audio)."""
        marks = [("wait", self.asked), ("llm", self.first_token), ("words", self.first_word), ("tts", self.first_audio)]
        out, last = {}, self.created
        for name, at in marks:
            if at is None:
                break
            out[name], last = at - last, at
        return out


class Reply:
    """One reply to `request`, said by `speaker` (None: text only). Iterate `events()` once; `cancel` from anywhere
    in the event loop."""

    def __init__(self, client: LLMClient, request: ChatRequest, speaker: Speaker | None) -> None:
        self.client, self.request, self.speaker = client, request, speaker
        self.stream: SpeechStream | None = None
        self._queue: asyncio.Queue[ReplyEvent | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        # the TTS's pieces pushed and not yet taken, in order: (piece, the LLM word it starts, or None)
        self._expected: deque[tuple[str, str | None]] = deque()
        self._speaking: asyncio.Task | None = None
        self._cancelled = False
        self.times = ReplyTimes(time.monotonic())

    async def events(self) -> AsyncIterator[ReplyEvent]:
        self._tasks.append(asyncio.create_task(self._ask(), name="agent-llm"))
        try:
            while (event := await self._queue.get()) is not None:
                yield event
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop now: the LLM's request closes, the TTS stream is freed; `events` ends."""
        if self._cancelled:
            return
        self._cancelled = True
        for task in self._tasks:
            task.cancel()
        if self.stream is not None:
            self.stream.close()
        self._queue.put_nowait(None)

    async def _ask(self) -> None:
        self.times.asked = time.monotonic()
        cutter = WordCutter()
        reason: str | None = None
        usage: Usage | None = None
        error: str | None = None
        try:
            async with contextlib.aclosing(self.client.stream(self.request)) as replies:
                async for event in replies:
                    if self.times.first_token is None and isinstance(event, TextDelta | ToolCallStart):
                        self.times.first_token = time.monotonic()
                    if isinstance(event, TextDelta):
                        self._say(cutter.push(event.text))
                    elif isinstance(event, Finish):
                        reason = event.reason
                        continue
                    elif isinstance(event, Usage):
                        usage = event
                        continue
                    await self._queue.put(event)
        except LLMError as e:
            logger.info("agent reply: the LLM failed: %s", e)
            error = str(e)
        except CapacityError as e:
            error = f"no text-to-speech stream free for the reply: {e}"
        if error is None:
            try:
                self._say(cutter.flush())
            except CapacityError as e:
                error = f"no text-to-speech stream free for the reply: {e}"
        if self.stream is not None:
            with contextlib.suppress(SessionClosed):
                self.stream.finish()
            assert self._speaking is not None
            await self._speaking  # every word said (or the stream ended) before the reply is done
        await self._queue.put(Done(reason, usage, error))
        await self._queue.put(None)

    def _say(self, words: list[str]) -> None:
        """Push `words` to the TTS, opening its stream at the first."""
        speaker = self.speaker
        if speaker is None or not words:
            return
        if self.stream is None:
            self.times.first_word = time.monotonic()
            self.stream = speaker.open()
            self._speaking = asyncio.create_task(self._listen(self.stream), name="agent-tts")
            self._tasks.append(self._speaking)
        for word in words:
            pieces = speaker.split(word)
            # the TTS tells of each piece as it takes it, in order: the first of a word's pieces marks the word
            self._expected.extend((piece.text, word if k == 0 else None) for k, piece in enumerate(pieces))
            if pieces:
                self.stream.push(pieces)

    async def _listen(self, stream: SpeechStream) -> None:
        """The TTS's events as reply events, until its stream ends."""
        while (event := await stream.recv()) is not None:
            if isinstance(event, WordTaken):
                if self._expected:
                    _, word = self._expected.popleft()
                    if word is not None:
                        await self._queue.put(Spoken(word, event.step + 1))
            elif isinstance(event, SpeechChunk):
                if self.times.first_audio is None:
                    self.times.first_audio = time.monotonic()
                await self._queue.put(Audio(event.pcm, event.frame))
            elif isinstance(event, SpeechEnd):
                return
