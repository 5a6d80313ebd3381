"""`duplexd loadtest --churn`: the per-minute and memory arithmetic on made-up data, then a short live churn run."""

from __future__ import annotations

import argparse
import json

import pytest

from duplexd.clients.connection import ConnectOptions
from duplexd.clients.loadtest import LoadTestConfig
from duplexd.clients.report import Thresholds
from duplexd.clients.soak import (
    Churned,
    SoakConfig,
    SoakResult,
    memory_summary,
    metric_value,
    per_minute,
    server_capacity,
)
from duplexd.clients.soak_cli import length_range
from duplexd.clients.stats import SessionTrace
from duplexd.commands.cli import main

from .live_server import demo_cache, running_server


def made_up_sessions() -> list[Churned]:
    # Sends at 0, 80, 160, 240 ms; outputs 0..2 answer inputs 1..3. Latencies 20, 20, 260 ms: the third is late.
    # It starts at 59.8 s, so its first two frames arrive in minute 1 and the late one in minute 2.
    a = SessionTrace(0, 4, sent=[0.0, 0.08, 0.16, 0.24], received=[0.1, 0.18, 0.5])
    # Broken after 3 of 10 frames, 2 outputs on time: 10 - 1 - 2 = 7 missing, in minute 3 where it ended.
    b = SessionTrace(1, 10, status="error", error="closed", sent=[0.0, 0.08, 0.16], received=[0.1, 0.18])
    return [Churned(a, 59.8, 61.0), Churned(b, 125.0, 126.0)]


def test_per_minute_buckets_frames_by_arrival_and_sessions_by_end():
    rows = per_minute(made_up_sessions(), refusals=[5.0, 130.0, 200.0], duration=180)
    got = [
        (
            r["minute"],
            r["frames_received"],
            r["late_frames"],
            r["frames_missing"],
            r["sessions_completed"],
            r["errors"],
            r["refused"],
        )
        for r in rows
    ]
    # The refusal at 200 s (after the last minute) counts in the last one.
    assert got == [(1, 2, 0, 0, 0, 0, 1), (2, 1, 1, 0, 1, 0, 0), (3, 2, 0, 7, 0, 1, 2)]
    assert [r["late_frac"] for r in rows] == pytest.approx([0.0, 1.0, 7 / 9])


def test_memory_growth_is_measured_from_the_first_minute():
    samples = [(190.0, 220.0), (0.0, 100.0), (10.0, 150.0), (60.2, 200.0), (100.0, 300.0), (120.0, 210.0)]
    m = memory_summary(samples, warmup=60)
    assert (m["first_minute_bytes"], m["last_bytes"], m["max_bytes"], m["samples_taken"]) == (200, 220, 300, 6)
    assert m["growth"] == pytest.approx(0.10)
    short = memory_summary([(0.0, 1.0), (30.0, 2.0)], warmup=60)
    assert short["first_minute_bytes"] is None and short["growth"] is None and short["last_bytes"] == 2.0
    assert memory_summary([])["growth"] is None


def test_judgement_checks_memory_growth_and_errors():
    memory = [{"t": t, "rss_bytes": v, "sessions_active": 1.0} for t, v in [(0, 100.0), (60, 200.0), (180, 220.0)]]
    result = SoakResult(
        SoakConfig(LoadTestConfig(), duration=180),
        4,
        3,
        made_up_sessions(),
        [5.0],
        memory,
        "today",
        181.0,
        Thresholds(max_errors=0),
        max_memory_growth=0.05,
    )
    assert result.failures() == ["sessions with errors 1 > 0", "memory growth 0.1000 > 0.05"]
    result.thresholds, result.max_memory_growth = Thresholds(max_errors=1), 0.2
    assert result.failures() == []
    result.memory = memory[:1]
    result.max_memory_growth = 0.2
    assert result.failures() == ["memory growth not measured (no /metrics sample after 60 s)"]
    data = result.to_dict()
    assert data["overall"]["refused"] == 1 and data["overall"]["errors"] == 1 and len(data["minutes"]) == 3


def test_metric_value_and_length_range():
    text = '# HELP x\nprocess_resident_memory_bytes 6.28e+08\nfoo{a="1"} 2.0\nfoo{a="2"} 3.0\nfoobar 9\n'
    assert metric_value(text, "process_resident_memory_bytes") == 6.28e8
    assert metric_value(text, "foo") == 5.0 and metric_value(text, "missing") is None
    assert length_range("2-30") == (2.0, 30.0) and length_range("10") == (10.0, 10.0)
    for bad in ("5-2", "x", "0-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            length_range(bad)


def test_live_churn_run(tmp_path_factory, tmp_path):
    cache = demo_cache(tmp_path_factory)
    env = {"DUPLEXD_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    with running_server(tmp_path / "serve.log", "--max-sessions", "4", env=env) as live:
        assert server_capacity(ConnectOptions(url=live.url)) == 4
        report = tmp_path / "soak.json"
        code = main(
            [
                "loadtest",
                "--churn",
                "--quiet",
                "--url",
                live.url,
                "--duration",
                "10",
                "--session-length",
                "1-3",
                "--target-sessions",
                "2",
                "--memory-interval",
                "2",
                "--json",
                str(report),
                "--max-errors",
                "0",
            ]
        )
    data = json.loads(report.read_text(encoding="utf-8"))
    assert code == 0, data["checks"]
    assert data["mode"] == "churn" and data["capacity"] == 4 and data["target_sessions"] == 2
    o = data["overall"]
    assert o["errors"] == 0 and o["ok"] > 2 * 2  # sessions came and went: more than the occupancy, twice over
    assert o["frames_sent"] > 0 and o["frames_received"] > 0
    starts = sorted(s["start_s"] for s in data["sessions"])
    assert starts[-1] > 5  # sessions kept arriving through the run
    minutes = data["minutes"]
    assert len(minutes) == 1 and minutes[0]["sessions_completed"] == o["ok"]
    assert minutes[0]["frames_received"] == o["frames_received"] and minutes[0]["late_frames"] == o["late_frames"]
    rss = [m["rss_bytes"] for m in data["memory"]["samples"] if m["rss_bytes"]]
    assert len(rss) >= 4 and min(rss) > 10 * 2**20  # every 2 s and once at the end, from /metrics
    assert data["memory"]["last_bytes"] == rss[-1] and data["checks"]["passed"]
