"""Admission of a text-to-speech stream, for every protocol that says text (`/api/tts_streaming`, `/v1/audio/speech`):
a slot of the `--tts` model's speech service, unless the server drains, warms up or has none free; a whole text
said at once; and its speech, frame by frame, for the protocols that want only that."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import numpy as np

from duplexd.engine.errors import CapacityError
from duplexd.engine.tts.generate import Voice
from duplexd.engine.tts.service import SpeechChunk, SpeechStream
from duplexd.engine.tts.words import Word
from duplexd.server.core.context import ServerContext
from duplexd.server.core.speech import SpeechModel


def speech_of(ctx: ServerContext) -> SpeechModel:
    assert ctx.runtime.speech is not None  # the routes are mounted only with a TTS model
    return ctx.runtime.speech


def open_speech(ctx: ServerContext) -> SpeechStream:
    """A slot for a new stream: `CapacityError` when the server is draining, warming up or full."""
    if ctx.drain.draining:
        raise CapacityError("server draining (shutting down): connect to another replica")
    if not ctx.runtime.ready:
        raise CapacityError("the model is still warming up" if ctx.runtime.failed is None else "the model failed")
    return speech_of(ctx).service.open()


def say(ctx: ServerContext, words: Sequence[Word], voice: Voice) -> SpeechStream:
    """A new stream (`open_speech`) given its whole text at once, in `voice`."""
    stream = open_speech(ctx)
    speech_of(ctx).begin(stream, voice)
    stream.push(words)
    stream.finish()
    return stream


async def spoken(stream: SpeechStream) -> AsyncIterator[np.ndarray]:
    """A stream's speech, frame by frame, closing it however the iteration ends."""
    try:
        while (event := await stream.recv()) is not None:
            if isinstance(event, SpeechChunk):
                yield event.pcm
    finally:
        stream.close()
