"""The conversation endpoints on a server whose model only transcribes (Kyutai STT): refused in each protocol's own
words, so a Moshi client pointed at it is told where to go instead of hearing silence. A Realtime client that asks
for a transcription session (`?intent=transcription`) gets one (`transcription_session`)."""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from . import protocol
from . import realtime_events as ev
from .closing import CloseCode

router = APIRouter()

MESSAGE = "this server runs a speech-to-text model, which does not converse: stream audio to /api/asr-streaming"
REALTIME_MESSAGE = (
    "this server runs a speech-to-text model, which does not converse: open a transcription session "
    "(/v1/realtime?intent=transcription) or stream audio to /api/asr-streaming"
)
REASON = "speech-to-text model: use ?intent=transcription or /api/asr-streaming"  # a close reason: <= 123 bytes


@router.websocket("/api/chat")
async def chat(ws: WebSocket) -> None:
    await ws.accept()
    await ws.send_bytes(protocol.error(MESSAGE))
    await ws.close(CloseCode.POLICY_VIOLATION, REASON)


async def refuse_realtime(ws: WebSocket) -> None:
    """A Realtime conversation asked of a speech-to-text model."""
    await ws.accept()
    await ws.send_text(ev.error_event("model_not_conversational", REALTIME_MESSAGE))
    await ws.close(CloseCode.POLICY_VIOLATION, REASON)
