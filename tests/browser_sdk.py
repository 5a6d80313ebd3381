"""OpenAI's browser SDK (`@openai/agents-realtime` from npm, unchanged) for the Chromium tests that run it: bundled
once into one ES module with esbuild (also from npm) and cached outside the repository, and a web app's origin (a
static server on another port than the API) serving a page that imports it."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from .live_server import free_port
from .system_tools import require

SDK = "@openai/agents-realtime@0.20.0"
ESBUILD = "esbuild@0.28.2"
ENTRY = (
    "export { RealtimeAgent, RealtimeSession, OpenAIRealtimeWebRTC, OpenAIRealtimeWebSocket, tool } "
    "from '@openai/agents-realtime';\n"
)


def sdk_bundle() -> Path:
    """The SDK as one ES module (esbuild), cached under ~/.cache/duplexd-test/npm by version and entry; the test is
    skipped, saying why, where npm or esbuild cannot make it."""
    require("node")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "duplexd-test" / "npm"
    name = SDK.lstrip("@").replace("/", "-").replace("@", "-")
    bundle = cache / f"{name}-{hashlib.sha256(ENTRY.encode()).hexdigest()[:8]}" / "sdk.js"
    if bundle.exists():
        return bundle
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        install = subprocess.run(["npm", "install", "--no-audit", "--no-fund", SDK, ESBUILD], cwd=tmp,
                                 capture_output=True, text=True, timeout=300)  # fmt: skip
        if install.returncode:
            pytest.skip(f"npm install {SDK} failed: {(install.stderr or install.stdout).strip()[-300:]}")
        entry = Path(tmp) / "entry.js"
        entry.write_text(ENTRY)
        built = subprocess.run(
            [str(Path(tmp) / "node_modules/.bin/esbuild"), str(entry), "--bundle", "--format=esm",
             "--platform=browser", f"--outfile={Path(tmp) / 'sdk.js'}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if built.returncode:  # the bundler's own binary (an npm optional dependency) did not come: the machine's
            pytest.skip(f"esbuild could not bundle the SDK: {built.stderr.strip()[-300:]}")
        bundle.parent.mkdir(parents=True, exist_ok=True)
        os.replace(Path(tmp) / "sdk.js", bundle)
    return bundle


@contextlib.contextmanager
def page_origin(root: Path, page: str, bundle: Path) -> Iterator[str]:
    """`page` as `root`/index.html beside the bundle (`sdk.js`) and whatever else `root` holds, served on a port
    of its own; yields the origin."""
    (root / "index.html").write_text(page)
    shutil.copy(bundle, root / "sdk.js")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None  # type: ignore[method-assign]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
