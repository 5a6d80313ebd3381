"""What every route needs, built once per app and injected with FastAPI's `Depends(get_context)`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends
from starlette.requests import HTTPConnection

from duplexd.server.codec.batches import CodecBatches
from duplexd.server.connection.client_secrets import ClientSecrets
from duplexd.server.connection.pump import Limits

from .drain import Drain
from .metrics import Metrics
from .runtime import Runtime
from .settings import ServerSettings


@dataclass
class ServerContext:
    settings: ServerSettings
    runtime: Runtime
    metrics: Metrics
    drain: Drain = field(default_factory=Drain)
    codec: CodecBatches = field(default_factory=CodecBatches)
    client_secrets: ClientSecrets = field(default_factory=ClientSecrets)  # the ek_ keys minted by this process
    calls: dict[str, Any] = field(default_factory=dict)  # the WebRTC calls in progress, by id (server/realtime/webrtc)

    @property
    def limits(self) -> Limits:
        s = self.settings
        seconds = s.session_seconds(self.runtime.info.speech_to_text)
        length = math.inf if seconds is None else seconds
        return Limits(s.idle_timeout, s.send_timeout, length, s.max_message_bytes, s.late_frame_seconds)


def get_context(conn: HTTPConnection) -> ServerContext:
    return conn.app.state.context


Context = Annotated[ServerContext, Depends(get_context)]
