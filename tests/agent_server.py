"""The voice agent server the stock-client tests talk to: `duplexd serve` with the words-leaning demo STT, the demo TTS
at temperature 0 and `--llm demo` (llama.cpp's server with SmolLM2-135M), so espeak's speech makes turns that the
STT's pause heads end. One per test module (module fixtures), since each client's tests share one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from .live_server import LiveServer, running_server
from .test_asr_e2e import words_model


@contextlib.contextmanager
def running_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The agent server, ready; on the way out its log may hold no traceback."""
    stt = words_model(tmp_path_factory.mktemp("agent-stt"))
    log = tmp_path_factory.mktemp("agent-server") / "serve.log"
    args = ["--hf-repo", str(stt.root), "--tts", "demo-tts", "--tts-temperature", "0", "--llm", "demo"]
    with running_server(log, *args) as live:
        yield live
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]
