"""What every speech-to-text session needs, whichever protocol it speaks (`/api/asr-streaming`, Realtime
transcription): its sampling, its stream's bookkeeping and the feeder of its audio."""

from __future__ import annotations

import dataclasses

from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.dialogue.session import Session
from duplexd.server.connection.pump import Pump
from duplexd.server.core.context import ServerContext

from .feeder import Feeder
from .stream import AsrStream

GREEDY = SamplingParams(text_temperature=0.0)  # moshi-server's default ASR temperature
BACKLOG_SECONDS = 60.0  # audio read ahead of the model before the client is held back (moshi-server: no limit)
# Frames of a stream in the engine at once: the engine steps one a step, so a few keep it busy while the event loop
# refills them, and a fast client's frames wait here rather than in the inbox (where they would count as late).
FRAMES_AHEAD = 4


def asr_parameters() -> tuple[SamplingParams, int | None]:
    """Greedy text, no frame limit: speech to text takes no parameters (as moshi-server's)."""
    return GREEDY, None


def new_stream(ctx: ServerContext) -> AsrStream:
    """The bookkeeping of one stream of the served speech-to-text model."""
    runtime = ctx.runtime
    assert runtime.info.asr_delay_tokens is not None and runtime.tokenizer is not None
    return AsrStream(runtime.info.asr_delay_tokens, runtime.tokenizer.decode, runtime.info.frame_size)


def admitted(ctx: ServerContext, pump: Pump) -> Feeder:
    """A stream admitted: moshi-server's idle rule (`--asr-idle-timeout`), its clock restarted by each answer too,
    so a client that sent a file ahead (up to `BACKLOG_SECONDS` of audio are read ahead) waits for its words
    however slowly they come; and the feeder of its audio."""
    pump.limits = dataclasses.replace(pump.limits, idle_timeout=ctx.settings.asr_idle_timeout, idle_after_answers=True)
    return new_feeder(ctx, pump.session)


def new_feeder(ctx: ServerContext, session: Session, backlog_seconds: float = BACKLOG_SECONDS) -> Feeder:
    """The feeder of an admitted session: at most `FRAMES_AHEAD` frames in the engine (within both of the
    session's bounds), `backlog_seconds` read ahead before the client is held back."""
    info, settings = ctx.runtime.info, ctx.settings
    ahead = min(FRAMES_AHEAD, settings.max_pending_frames, settings.max_output_frames)
    return Feeder(session, info.frame_size, ahead, round(backlog_seconds * info.sample_rate))
