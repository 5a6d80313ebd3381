"""`/api/chat` on a server whose model only transcribes (Kyutai STT): refused in the Kyutai protocol's own words, so
a Moshi client pointed at it is told where to go instead of hearing silence."""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from duplexd.server.connection.closing import CloseCode

from . import messages

router = APIRouter()

MESSAGE = "this server runs a speech-to-text model, which does not converse: stream audio to /api/asr-streaming"
REASON = "speech-to-text model: use /api/asr-streaming"  # a close reason: <= 123 bytes


@router.websocket("/api/chat")
async def chat(ws: WebSocket) -> None:
    await ws.accept()
    await ws.send_bytes(messages.error(MESSAGE))
    await ws.close(CloseCode.POLICY_VIOLATION, REASON)
