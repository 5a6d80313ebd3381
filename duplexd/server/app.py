"""The FastAPI app factory. Models are loaded before (by the caller); the engines warm up in the background
after the port is bound, so `/health` answers at once and `/ready` turns 200 only when they are warm."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from . import routes
from .codec.batches import CodecBatches
from .codec.streams import backend
from .core.api_error import ApiError
from .core.context import ServerContext
from .core.drain import Drain
from .core.metrics import Metrics
from .core.runtime import Runtime
from .core.settings import ServerSettings
from .core.static import WebClient, static_dir
from .core.version import VERSION
from .kyutai import chat, stt_refusal
from .moshi_server import asr, asr_upload, tts
from .openai_audio import speech, transcriptions
from .realtime import agent, conversation, transcription
from .realtime.webrtc import calls

logger = logging.getLogger(__name__)


async def _warm_up(runtime: Runtime) -> None:
    try:
        await asyncio.to_thread(runtime.start)
    except Exception as e:  # noqa: BLE001 - reported by /health, the process stays up for the probe to see it
        runtime.failed = f"engine warm-up failed: {e}"
        logger.exception("engine warm-up failed; /health reports 503")
        return
    logger.info("ready: accepting sessions (%d slots)", runtime.capacity())


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return exc.response()


def create_app(settings: ServerSettings, runtime: Runtime) -> FastAPI:
    """An app serving `runtime` (built, not started: the app starts and stops it)."""
    drain = Drain()
    metrics = Metrics(runtime, lambda: drain.draining)
    codec = CodecBatches(settings.codec_threads, settings.codec_processes)
    logger.info(
        "Kyutai protocol audio: %s; downlink profile %s; %s",
        backend(),
        settings.opus_profile,
        f"{settings.codec_processes} codec worker process(es) {codec.worker_pids}"
        if settings.codec_processes
        else f"{settings.codec_threads} codec thread(s)",
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        unsubscribe = metrics.subscribe(runtime)
        warm = asyncio.create_task(_warm_up(runtime))
        try:
            yield
        finally:
            if not warm.done():
                await asyncio.shield(warm)  # engines cannot stop in the middle of warming up
            await calls.end_calls(app.state.context)
            if runtime.agents is not None:
                await runtime.agents.aclose()
            await asyncio.to_thread(runtime.stop)
            await asyncio.to_thread(codec.shutdown)
            unsubscribe()

    app = FastAPI(title="duplexd", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.context = ServerContext(settings, runtime, metrics, drain, codec)
    app.add_exception_handler(ApiError, _api_error)  # OpenAI's JSON error shape
    app.add_middleware(
        CORSMiddleware,  # web apps on other origins call the HTTP API (the WebRTC routes above all)
        allow_origins=settings.allowed_origins or ["*"],
        allow_methods=["GET", "POST", "OPTIONS"],
        allow_headers=["authorization", "content-type", "x-openai-agents-sdk", "openai-beta", "x-api-key"],
        expose_headers=["Location"],
        max_age=600,
    )
    app.include_router(routes.router)
    app.include_router(transcriptions.router)
    if runtime.info.speech_to_text:  # moshi-server's /api/asr-streaming and transcription sessions
        app.include_router(asr.router)
        app.include_router(asr_upload.router)
        app.include_router(stt_refusal.router)
        # with --llm a conversation is a voice agent's (its route serves transcription sessions too), on calls too
        app.include_router(agent.router if runtime.agents is not None else transcription.router)
        if runtime.agents is not None:
            app.include_router(calls.router)
    else:
        app.include_router(chat.router)
        app.include_router(conversation.router)
        app.include_router(calls.router)
    if runtime.speech is not None:  # --tts: moshi-server's /api/tts_streaming and OpenAI's speech endpoint
        app.include_router(tts.router)
        app.include_router(speech.router)
    if runtime.cloning is not None:  # --voice-mimi: moshi-server's /api/voice
        from .moshi_server import voice  # the voice maker's scipy.signal (~0.8 s) only in a server that clones

        app.include_router(voice.router)
    web = static_dir(settings.static)
    if web is not None:
        app.mount("/", WebClient(web), name="web")
        logger.info("serving the web client from %s at /", web)
    return app
