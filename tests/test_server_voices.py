"""`duplexd serve --voices DIR` on a tiny random PersonaPlex checkpoint: a `.pt` preset and a WAV sample loaded at
start-up and listed by `/v1/models`; a bad voice file refuses the start in one line naming `--voices` and the file.
(The refusals that need no model, a missing or empty folder and a model that is not PersonaPlex, are in
`test_startup_errors`.)"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx2
import pytest
import soundfile as sf
import torch

from duplexd.engine.weights.demo import ensure_demo

from .live_server import running_server
from .personaplex_files import PP_DEMO_TEXT, write_personaplex
from .personaplex_ref import preset_from_codes
from .test_infer import speech_like


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The PersonaPlex LM's flags (demo Mimi and tokenizer: same codebooks, a vocabulary large enough), and the
    reference LM its weights hold."""
    root = tmp_path_factory.mktemp("pp_serve")
    weights, ref_lm = write_personaplex(root, PP_DEMO_TEXT, seed=2)
    demo = ensure_demo()
    flags = ["--moshi-weight", str(weights), "--mimi-weight", str(demo.mimi), "--tokenizer", str(demo.tokenizer)]
    flags += ["--config", str(root / "config.json"), "--mimi-preset", "demo", "--max-sessions", "1"]
    return flags, ref_lm


def test_serve_lists_its_voices(checkpoint, tmp_path):
    flags, ref_lm = checkpoint
    voices = tmp_path / "voices"
    voices.mkdir()
    codes = torch.randint(0, PP_DEMO_TEXT.card, (4, 8), generator=torch.Generator().manual_seed(3)).tolist()
    torch.save(preset_from_codes(PP_DEMO_TEXT, ref_lm, codes), voices / "NATF0.pt")
    sf.write(voices / "guest.wav", speech_like(0.6, 16000, seed=5), 16000)
    (voices / "notes.txt").write_text("not a voice: ignored")
    log = tmp_path / "serve.log"
    with running_server(log, *flags, "--voices", str(voices)) as live:
        models = httpx2.get(f"{live.url}/v1/models", timeout=5).json()["data"]
    assert models[0]["persona"] is True and models[0]["voices"] == ["NATF0.pt", "guest.wav"], models
    text = log.read_text()
    assert "2 voices from" in text and "Traceback" not in text, text[-3000:]
    assert "personaplex ring rule)" in text, text[-3000:]  # its Mimi attends as NVIDIA's (test_mimi_window)


def test_a_bad_voice_file_refuses_the_start(checkpoint, tmp_path):
    flags, _ = checkpoint
    voices = tmp_path / "voices"
    voices.mkdir()
    sf.write(voices / "fine.wav", speech_like(0.6, 24000, seed=1), 24000)
    (voices / "broken.pt").write_bytes(b"not a torch file")
    proc = subprocess.run(
        [sys.executable, "-m", "duplexd", "serve", "--port", "0", *flags, "--voices", str(voices)],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("DUPLEXD_") or k == "DUPLEXD_CACHE"},
        timeout=120,
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    expected = f"duplexd serve: error: --voices {voices / 'broken.pt'}: not a PersonaPlex voice preset"
    assert last.startswith(expected), last
