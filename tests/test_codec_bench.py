"""bench/codec.py end to end with --quick: it runs, and its last line is one JSON object with every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from duplexd.server.codec import libopus

BENCH = Path(__file__).resolve().parents[1] / "bench" / "codec.py"
KEYS = (
    "thread_scaling_2",
    "sphn_thread_scaling_2",
    "fast_encode_ms_per_s",
    "kyutai_encode_ms_per_s",
    "sphn_encode_ms_per_s",
    "fast_encode_vs_sphn",
    "kyutai_encode_vs_sphn",
    "decode_browser_ms_per_s",
    "decode_sphn_ms_per_s",
    "sphn_decode_browser_ms_per_s",
    "sphn_decode_sphn_ms_per_s",
    "decode_browser_vs_sphn",
    "decode_sphn_vs_sphn",
    "cpus_used_2",
    "sphn_cpus_used_2",
    "libopus_cpu_share",
    "thread_scaling_2_bound",
    "process_scaling_2",
    "thread_vs_process_scaling",
)


@pytest.mark.skipif(libopus.load() is None, reason="needs libopus (apt-get install libopus0)")
def test_bench_runs_quick():
    done = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bench"] == "codec" and result["streams"] == 8 and result["ticks"] == 10
    assert result["backend"].endswith("(ctypes)")
    for key in KEYS:
        assert result[key] > 0, key
    for name in ("fast", "kyutai", "sphn"):
        assert result[f"{name}_lsd_db"] > 0 and result[f"{name}_snr_db"] > 5, name
    assert result["kyutai_snr_db"] == result["sphn_snr_db"]  # the same bytes, so the same audio
    assert "CPU ms per stream-second" in done.stdout
