"""bench/prompt_prefill.py end to end with tiny settings: the JSON line is complete, and the prefill engine really
ran the prompt in fewer forwards than the frame-by-frame engine (one forward per prompt frame)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "prompt_prefill.py"


def test_bench_runs_quick():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--threads", "1"], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert json.loads(next(line for line in lines if line.startswith('{"bench"')))["partial"] is True
    assert "partial" not in result
    live = result["live_sessions"]
    assert live == 2
    forwards = result["prompt_frames"] - 1  # the first prompt frame has no forward
    assert result["frame_by_frame_forwards"] == forwards == result[f"forwards_live{live}_frame_by_frame"]
    assert result["prefill_forwards"] == 1  # no live session: the whole prompt in one forward
    # Beside live sessions the chunk size comes from the warm-up's timing (1 on a machine too loaded to fit more).
    assert 1 <= result[f"forwards_live{live}_prefill"] <= forwards
    assert result["prefill_rows"] >= 1
    for key in ("ratio_prefill", "ttfo_prefill_ms", "ttfo_frame_by_frame_ms", f"ratio_prefill_live{live}"):
        assert result[key] > 0, key
    for mode in ("prefill", "frame_by_frame"):
        assert result[f"outputs_live{live}_{mode}"] > 0
        assert result[f"baseline_outputs_live{live}_{mode}"] > 0
        assert result[f"late_frames_live{live}_{mode}"] >= 0
    assert result["reference_ttfo_ms"] > 0
    assert isinstance(result["goal_met"], bool)
    assert "| prefill |" in done.stdout and "| frame-by-frame |" in done.stdout
