"""Plain HTTP endpoints: liveness, readiness, Prometheus metrics and the model list.

`/health`, `/ready` and `/metrics` are for the operator's probes and scraper and need no API key; `/v1/models`
does when one is set (it is part of the client-facing API). `/api/build_info` and `/api/modules_info` answer as
moshi-server's (Unmute probes the first for health), without a key as there.
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .connection.access import key_ok
from .core.build_info import BUILD_INFO
from .core.context import Context
from .core.version import VERSION
from .moshi_server.asr import PATH as ASR_PATH
from .moshi_server.tts import PATH as TTS_PATH
from .realtime.webrtc import stack as webrtc_stack

router = APIRouter()


@router.get("/health")
def health(ctx: Context) -> JSONResponse:
    """Live: the process answers. 503 only when the engine failed to warm up (restart it)."""
    runtime = ctx.runtime
    if runtime.failed:
        return JSONResponse({"status": "failed", "error": runtime.failed}, status_code=503)
    return JSONResponse({"status": "ok", "ready": runtime.ready, "version": VERSION})


@router.get("/ready")
def ready(ctx: Context) -> JSONResponse:
    """Ready: warm, not draining, and at least one more session (of any model served) can be admitted now (else
    503, so balancers look elsewhere). `models` says what each model can take."""
    runtime, draining = ctx.runtime, ctx.drain.draining
    admissible = runtime.admissible()
    models = [
        {"id": runtime.info.id, "task": "speech-to-text" if runtime.info.speech_to_text else "dialogue",
         "admissible": admissible, "capacity": runtime.capacity()},
    ]  # fmt: skip
    if runtime.speech is not None:
        service = runtime.speech.service
        free = service.max_streams - service.used_streams if runtime.ready else 0
        models.append(
            {"id": runtime.speech.id, "task": "text-to-speech", "admissible": free, "capacity": service.max_streams}
        )
    ready = runtime.ready and any(m["admissible"] for m in models) and not draining
    body: dict[str, object] = {
        "ready": ready,
        "warm": runtime.ready,
        "admissible_sessions": admissible,
        "capacity": runtime.capacity(),
        "draining": draining,
        "open_sessions": ctx.drain.open_sessions,
        "models": models,
    }
    if draining:
        body["reason"] = "draining"
    elif not runtime.ready:
        body["reason"] = runtime.failed or "warming up"
    elif not ready:
        body["reason"] = "at capacity"
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
def metrics(ctx: Context) -> Response:
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def protocols(speech_to_text: bool, webrtc: bool = False, agent: bool = False) -> list[str]:
    """The endpoints the served model speaks: its WebSockets, and WebRTC calls where they are served (a speech-to-
    text model converses only as a voice agent's ears, with `--llm`)."""
    conversation = ["/v1/realtime", *(["/v1/realtime/calls"] if webrtc else [])]
    if speech_to_text:
        return [ASR_PATH, "/v1/realtime?intent=transcription", *(conversation if agent else [])]
    return ["/api/chat", *conversation]


@router.get("/v1/models")
def models(request: Request, ctx: Context) -> dict:
    if not key_ok(request, ctx.settings.api_key):
        raise HTTPException(status_code=401, detail="missing or wrong API key")
    info = ctx.runtime.info
    webrtc = ctx.settings.webrtc and webrtc_stack.available()
    models: list[dict] = [
        {
            "id": info.id,
            "object": "model",
            "created": info.created,
            "owned_by": "duplexd",
            "demo": info.demo,
            "random_weights": info.random_weights is not None,
            "sample_rate": info.sample_rate,
            "frame_size": info.frame_size,
            "devices": list(info.devices),
            "max_sessions": ctx.runtime.capacity(),
            "protocols": protocols(info.speech_to_text, webrtc, ctx.runtime.agents is not None),
            "persona": info.persona,
            "voices": list(info.voices),
        }
    ]
    default = ctx.runtime.personas.default
    if default is not None:  # what a session that names no persona gets (PersonaPlex's client defaults)
        models[0]["persona_defaults"] = {"text_prompt": default.text, "voice_prompt": default.voice}
    service = ctx.runtime.transcription
    if service is not None and info.transcriber is not None:
        models.append(
            {
                "id": info.transcriber,
                "object": "model",
                "created": info.created,
                "owned_by": "duplexd",
                "demo": info.transcriber_demo,
                "task": "transcription",
                "max_streams": service.config.max_streams,
                "endpoints": ["/v1/audio/transcriptions", "/v1/realtime (input_audio_transcription)"],
            }
        )
    speech = ctx.runtime.speech
    if speech is not None:
        models.append(
            {
                "id": speech.id,
                "object": "model",
                "created": info.created,
                "owned_by": "duplexd",
                "demo": speech.demo,
                "task": "text-to-speech",
                "sample_rate": speech.sample_rate,
                "max_streams": speech.service.max_streams,
                "voices": sorted(speech.voices),
                "default_voice": speech.default_voice,
                "endpoints": [TTS_PATH, "/v1/audio/speech"],
            }
        )
    agents = ctx.runtime.agents
    if agents is not None and speech is not None:
        models.append(
            {
                "id": agents.model_id,
                "object": "model",
                "created": info.created,
                "owned_by": "duplexd",
                "task": "voice-agent",
                "llm": {"url": agents.config.base_url, "model": agents.config.model, "demo": agents.demo is not None},
                "hears_with": info.id,
                "speaks_with": speech.id,
                "voices": sorted(speech.voices),
                "endpoints": ["/v1/realtime", *(["/v1/realtime/calls"] if webrtc else [])],
            }
        )
    return {"object": "list", "data": models}


@router.get("/api/build_info")
def build_info() -> dict:
    """moshi-server's build fields (each true of this duplexd), plus `server` and `version`."""
    return BUILD_INFO


@router.get("/api/modules_info")
def modules_info(ctx: Context) -> list[dict]:
    """moshi-server's module list: the speech-to-text module of an STT model and the text-to-speech module of
    `--tts` (their values strings, as there); nothing for a dialogue model, as moshi-server lists none of its own."""
    runtime = ctx.runtime
    info = runtime.info
    modules = []
    if info.speech_to_text:
        used = sum(s.active_sessions for s in runtime.stats())
        modules.append(
            {
                "type": "batched_asr",
                "path": ASR_PATH,
                "lm": info.lm_file,
                "audio_tokenizer": info.mimi_file,
                "used_slots": str(used),
                "total_slots": str(runtime.capacity()),
            }
        )
    if runtime.speech is not None:  # moshi-server's Python TTS module ("py")
        service = runtime.speech.service
        modules.append(
            {
                "type": "py",
                "path": TTS_PATH,
                "used_slots": str(service.used_streams),
                "total_slots": str(service.max_streams),
            }
        )
    return modules
