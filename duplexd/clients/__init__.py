"""Clients of a running duplexd server: the browser page (`web/`), `duplexd chat` and `duplexd loadtest`.

They talk to the server over the wire only (WebSocket), so they run against any duplexd or Kyutai server and
never import torch or the engine.
"""

from pathlib import Path

WEB_DIR = Path(__file__).parent / "web"  # static files of the browser voice chat, served at `/`
