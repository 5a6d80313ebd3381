"""bench/host_overhead.py's accounting: /proc stat parsing, per-thread CPU deltas, profile attribution."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "host_overhead.py"
_spec = importlib.util.spec_from_file_location("host_overhead", _PATH)
ho = importlib.util.module_from_spec(_spec)
sys.modules["host_overhead"] = ho
_spec.loader.exec_module(ho)


def test_parse_stat_reads_comm_with_spaces_and_parentheses():
    tick = ho.CLOCK_TICK
    line = f"1234 (weird ) name)) S 1 2 3 4 5 6 7 8 9 10 {3 * tick} {tick} 0 0 20 0 4 0 100 0 0"
    assert ho.parse_stat(line) == ("weird ) name)", 4.0)


def test_parse_stat_of_this_process_counts_cpu():
    comm, seconds = ho.parse_stat(Path(f"/proc/{os.getpid()}/stat").read_text())
    assert comm and seconds >= 0
    snapshot = ho.cpu_snapshot(os.getpid())
    assert snapshot["total"] >= snapshot.get("other", 0.0) - 0.05  # this process's threads are all "other"


def test_cpu_delta_keeps_groups_adding_up_to_the_total():
    before = {"total": 10.0, "event-loop": 6.0, "engine-loop": 3.0, "other": 1.0}
    after = {"total": 13.0, "event-loop": 8.0, "engine-loop": 3.5, "other": 0.2}  # an "other" thread exited
    delta = ho.cpu_delta(before, after)
    assert delta == pytest.approx({"total": 3.0, "event-loop": 2.0, "engine-loop": 0.5, "codec": 0.0, "other": 0.5})
    assert ho.cpu_delta({"total": 1.0}, {"total": 2.0, "engine-loop": 0.4})["other"] == pytest.approx(0.6)


def test_classify_takes_the_innermost_matching_frame():
    root = ["<module> (host_overhead_server.py:121)", "Runner.run (asyncio/runners.py:118)"]
    encode = root + [
        "Pump._write (server/connection/pump.py:150)",
        "KyutaiAdapter.send_output (server/kyutai/chat.py:55)",
        "CodecBatches.encode (server/codec/batches.py:95)",
    ]
    assert ho.classify(encode, "event-loop") == "codec"
    send = root + [
        "KyutaiAdapter.send_output (server/kyutai/chat.py:58)",
        "WebSocket.send (starlette/websockets.py:90)",
        "write_frame (websockets/legacy/protocol.py:1)",
    ]
    assert ho.classify(send, "event-loop") == "framing"
    pcm16 = root + [
        "RealtimeAdapter.send_output (server/realtime/conversation.py:214)",
        "pcm16_base64 (duplexd/wire.py:100)",
        "pcm16 (duplexd/wire.py:82)",
    ]
    assert ho.classify(pcm16, "event-loop") == "codec"
    b64 = pcm16[:-1]  # base64 of the audio is framing: only the pcm16 conversion is the codec
    assert ho.classify(b64, "event-loop") == "framing"
    push = root + ["Pump.push (server/connection/pump.py:125)", "Session.push (engine/dialogue/session.py:80)"]
    assert ho.classify(push, "event-loop") == "engine"
    assert ho.classify(root + ["Pump._write (server/connection/pump.py:140)"], "event-loop") == "server"
    assert ho.classify(root + ["Histogram.observe (prometheus_client/metrics.py:600)"], "event-loop") == "metrics"
    assert ho.classify(root, "event-loop") == "asyncio"
    assert ho.classify(["mystery (libfoo.so)"], "event-loop") == "other"
    assert ho.classify(encode, "engine-loop") == "engine"  # all the loop thread's work is the engine's


def test_parse_raw_profile_and_attribution():
    raw = "\n".join(
        [
            "thread (100): MainThread;main (x.py:1);CodecBatches.encode (server/codec/batches.py:95) 30",
            "thread (105): duplexd-codec_0;_run (server/codec/batches.py:40);encode (server/codec/streams.py:1) 7",
            "thread (100): MainThread;main (x.py:1);write_frame (websockets/legacy/protocol.py:1) 10",
            "thread (0x65): duplexd-engine;Engine._step (engine/dialogue/scheduler.py:340) 20",
            "thread (102): other;run (threading.py:1) 5",
            "thread (103): MainThread;main (x.py:1);Pump.push (server/connection/pump.py:1) 0",
            "thread (104): duplexd-engine-cpu;Engine._step (engine/dialogue/scheduler.py:340) 0",
            "garbage line",
        ]
    )
    samples = ho.parse_raw_profile(raw, {100: "event-loop", 101: "engine-loop", 102: "python"})
    assert samples == {
        "event-loop": {"codec": 30, "framing": 10, "server": 0},
        "engine-loop": {"engine": 20},
        "codec": {"codec": 7},  # a codec thread /proc no longer lists, known by its Python name
        "other": {"asyncio": 5},
    }
    samples.pop("codec")
    cpu = {"total": 6.0, "event-loop": 4.0, "engine-loop": 1.5, "other": 0.5}
    cats = ho.attribute(cpu, samples)
    assert cats == pytest.approx({"codec": 3.0, "framing": 1.0, "engine": 1.5, "asyncio": 0.5})
    assert sum(cats.values()) == pytest.approx(cpu["total"])
    assert ho.groups(cats) == pytest.approx({"codec": 3.0, "framing": 1.0, "engine": 1.5, "rest": 0.5})
    # a group without samples is not guessed at: its CPU is "other"
    assert ho.attribute(cpu, {"event-loop": {"codec": 1}}) == pytest.approx({"codec": 4.0, "engine": 1.5, "other": 0.5})


def test_per_session_second_maths_and_split():
    run = ho.Run(
        "kyutai",
        4,
        window_s=10.0,
        cpu={"total": 0.5, "event-loop": 0.4, "engine-loop": 0.1},
        frames_in=250.0,
        frames_out=240.0,
        steps=125.0,
        late=12.0,
        run_frames_out=240.0,
    )
    assert run.audio_session_s == pytest.approx(20.0)  # 250 frames of 80 ms
    assert run.served_frac == pytest.approx(0.5)  # 4 sessions x 10 s were due
    summary = run.summary()
    assert summary["cpu_ms_per_session_s"] == pytest.approx(25.0)  # per second of audio served
    assert summary["cpu_ms_per_session_s_wall"] == pytest.approx(12.5)  # per session-second of wall clock
    assert summary["mean_batch"] == 2.0 and summary["server_late_frac"] == pytest.approx(0.05)
    assert math.isnan(ho.ms_per_session_s(1.0, 0.0))
    assert ho.split(128, 3) == [43, 43, 42] and ho.split(2, 5) == [1, 1] and sum(ho.split(127, 4)) == 127


def test_parse_metrics():
    text = (
        '# HELP x\nduplexd_frames_in_total 12.0\nduplexd_frames_dropped_total{direction="in"} 3.0\n'
        'duplexd_step_batch_size_bucket{le="+Inf"} 7.0\n'
    )
    m = ho.parse_metrics(text)
    assert m["duplexd_frames_in_total"] == 12.0 and m['duplexd_frames_dropped_total{direction="in"}'] == 3.0
    assert m['duplexd_step_batch_size_bucket{le="+Inf"}'] == 7.0
