"""bench/transcribe_latency.py end to end on a tiny config: both sides agree on the tokens, the JSON is complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "bench" / "transcribe_latency.py"
TINY = "--audio-hidden 64 --audio-layers 2 --text-hidden 64 --text-layers 2 --new-tokens 4 --iters 1 --threads 1"


def test_bench_runs_on_a_tiny_model():
    args = [*TINY.split(), "--seconds", "0.5", "1.03", "--stream-sessions", "2", "--stream-steps", "2"]
    done = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens_match"] is True
    assert result["audio_tower"] == "64x2"
    for key in ("0.5s", "1.03s"):  # 1.03 s: the last chunk is partial, so `finish` encodes a padded tail
        assert result[f"ratio_{key}"] > 0
        assert set(result[f"duplexd_ms_{key}"]) == {"last_feed", "finish", "total"}
        assert set(result[f"reference_ms_{key}"]) == {"processor", "generate", "total"}
    stream = result["stream"]
    assert stream["sessions"] == 2
    assert stream["per_slot_ms_per_session_s"] > 0 and stream["batched_ms_per_session_s"] > 0
