"""The browser client's static files at `/` (after every API route, so the API always wins).

`auto` serves the bundled web client (`duplexd.clients.WEB_DIR`) when it is installed, `none` serves nothing,
anything else is a directory. Only HTTP reaches the files: a WebSocket to an unknown path is refused (HTTP 403)
instead of reaching StaticFiles, which handles HTTP only.
"""

from __future__ import annotations

import logging
from pathlib import Path

from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)


def static_dir(setting: str) -> Path | None:
    """The directory to serve for the `static` setting, or None."""
    if setting == "none":
        return None
    if setting == "auto":
        try:
            from duplexd.clients import WEB_DIR
        except ImportError:
            return None
        return WEB_DIR if (WEB_DIR / "index.html").is_file() else None
    path = Path(setting)
    if not path.is_dir():
        raise FileNotFoundError(f"static directory not found: {path}")
    return path


class WebClient:
    def __init__(self, directory: Path) -> None:
        self.files = StaticFiles(directory=directory, html=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "no such endpoint"})
            return
        await self.files(scope, receive, send)
