"""Load-test statistics, pacing, report and plot on made-up timings, plus the clients' audio and wire helpers.

No server: every number here is computed by hand from the definitions in clients/stats.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from duplexd.clients import audio, report
from duplexd.clients.connection import ConnectOptions, Sampling, endpoint
from duplexd.clients.loadtest import LoadTestConfig, input_frames
from duplexd.clients.loadtest_cli import session_counts
from duplexd.clients.pacing import Pacer
from duplexd.clients.plot import plot
from duplexd.clients.stats import SessionTrace, StatsConfig, late_flags, overall, session_stats, timeline, underruns
from duplexd.wire import FRAME_SIZE, pcm16_base64, pcm_from_base64, split_frames

T = 0.08


def steady(index: int = 0, n: int = 25, latency: float = 0.05, jitter=None) -> SessionTrace:
    """A session sending n frames on time; output k (from input k + 1) arrives `latency` after that input."""
    sent = [i * T for i in range(n)]
    received = [sent[k + 1] + latency + (jitter[k] if jitter else 0.0) for k in range(n - 1)]
    return SessionTrace(index, n, sent=sent, send_lateness=[0.001] * n, received=received, text_pieces=3)


def test_steady_session_is_on_time():
    s = session_stats(steady())
    assert (s.frames_expected, s.frames_sent, s.frames_received, s.frame_deficit, s.frames_missing) == (
        25,
        25,
        24,
        1,
        0,
    )
    assert s.late_frames == 0 and s.underruns == 0
    assert s.ttfa_ms == pytest.approx(130)  # frame 0 only fills the acoustic delay: first audio after input 1
    assert s.inter_arrival_ms["p50"] == pytest.approx(80) and s.inter_arrival_ms["max"] == pytest.approx(80)
    assert s.frame_latency_ms["p50"] == pytest.approx(50) and s.send_lateness_ms["max"] == pytest.approx(1)


def test_late_frames_are_measured_against_the_first_frames_latency():
    jitter = [0.0] * 24
    jitter[10] = 0.081  # 81 ms behind its deadline: late
    jitter[11] = 0.079  # 79 ms: not late
    s = session_stats(steady(jitter=jitter))
    assert s.late_frames == 1
    assert late_flags([0.0, T], [T + 0.5], StatsConfig()) == [False]  # a slow first frame sets the baseline


def test_a_late_client_is_not_blamed_on_the_server():
    """Input 10 goes out 200 ms late and its output 200 ms later: no late output frame, but send lateness shows."""
    trace = steady()
    trace.sent[10] += 0.2
    trace.send_lateness[10] = 0.2
    trace.received[9] += 0.2
    s = session_stats(trace)
    assert s.late_frames == 0
    assert s.send_lateness_ms["max"] == pytest.approx(200)
    assert overall([trace]).client_slow is True
    assert overall([steady()]).client_slow is False


def test_underruns_simulate_a_player_with_a_100ms_buffer():
    cfg = StatsConfig()
    assert underruns([i * T for i in range(10)], cfg) == (0, 0.0)
    arrivals = [i * T for i in range(10)]
    arrivals[5:] = [t + 0.15 for t in arrivals[5:]]  # a 150 ms stall: 50 ms more than the buffer holds
    count, stalled = underruns(arrivals, cfg)
    assert count == 1 and stalled == pytest.approx(0.05)
    arrivals[5:] = [t - 0.06 for t in arrivals[5:]]  # 90 ms: the buffer absorbs it
    assert underruns(arrivals, cfg)[0] == 0


def test_refused_sessions_stay_in_the_denominator():
    refused = SessionTrace(2, 25, status="refused", error="resource_exhausted", close_code=1013)
    o = overall([steady(0), steady(1), refused])
    assert (o.sessions, o.ok, o.refused, o.errors) == (3, 2, 1, 0)
    assert o.frames_expected == 75 and o.frames_sent == 50 and o.frames_received == 48
    assert o.frames_missing == 24 and o.late_frac == pytest.approx(24 / 72)
    assert o.ttfa_ms["count"] == 2
    assert not report.meets_target(o)
    assert report.meets_target(overall([steady(0), steady(1)]))


def test_missing_frames_count_as_late():
    trace = steady()
    trace.received = trace.received[:20]  # the last 4 answers never came
    o = overall([trace])
    assert o.frames_missing == 4 and o.late_frames == 0 and o.late_frac == pytest.approx(4 / 24)


def test_timeline_counts_per_second():
    series = timeline([steady(n=25)])
    assert sum(series["sent"]) == 25 and sum(series["received"]) == 24 and sum(series["late"]) == 0
    assert series["sent"][0] == 13  # frames at 0, 80, ..., 960 ms


def test_thresholds_and_table():
    good, bad = overall([steady()]), overall([SessionTrace(0, 25, status="refused", error="full")])
    limits = report.Thresholds(max_late_frac=0.01, max_ttfa_ms=300, max_refused=0)
    assert report.failures(good, limits) == []
    broken = report.failures(bad, limits)
    assert any("late fraction" in f for f in broken) and any("refused" in f for f in broken)
    assert any("first audio" in f for f in broken)  # no first audio at all fails a TTFA limit
    assert report.failures(bad, report.Thresholds()) == [] and not report.Thresholds().any
    table = report.markdown_table([good, bad])
    assert table.count("\n") == 3 and "| 1 | 1 | 0 | 0 | 130 |" in table
    assert report.capacity([good, bad]) == 1 and report.capacity([bad]) is None


def test_plot_and_json(tmp_path):
    traces = [steady(0), steady(1, jitter=[0.01 * (k % 3) for k in range(24)])]
    plot(traces, tmp_path / "lt.png", "test")
    assert (tmp_path / "lt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report.write_json(tmp_path / "sub" / "r.json", {"overall": session_stats(traces[0]).__dict__})
    assert json.loads((tmp_path / "sub" / "r.json").read_text())["overall"]["frames_sent"] == 25


def test_pacer_keeps_the_schedule_without_bursts():
    pacer = Pacer(start=100.0, period=T)
    assert pacer.next_time() == 100.0
    assert pacer.mark(100.001) == pytest.approx(0.001)
    pacer.mark(100.5)  # frame 1 was due at 100.08: 420 ms late (a stalled client)
    assert pacer.next_time() == pytest.approx(100.54)  # not at once: at most twice real time while catching up
    for _ in range(20):
        pacer.mark(pacer.next_time())
    gaps = np.diff(pacer.sent)
    assert gaps.min() >= T / 2 - 1e-9
    assert pacer.sent[-1] == pytest.approx(pacer.due(len(pacer.sent) - 1))  # back on schedule, no drift


def test_pacer_paces_in_real_time():
    async def go() -> list[float]:
        pacer = Pacer(time.monotonic(), period=0.02)
        for _ in range(10):
            await pacer.wait()
            pacer.mark()
        return pacer.lateness()

    lateness = asyncio.run(go())
    assert max(lateness) < 0.015 and min(lateness) >= 0


def test_audio_helpers(tmp_path):
    pcm = audio.speech_like(2.0, seed=1)
    assert pcm.dtype == np.float32 and len(pcm) == 48000 and np.abs(pcm).max() <= 1
    levels = [audio.level_db(f) for f in split_frames(pcm)]
    assert max(levels) > -30 and min(levels) < -45  # voiced syllables and pauses
    stereo = np.stack([pcm[:16000], pcm[:16000]], axis=1)
    import soundfile as sf

    sf.write(tmp_path / "s.wav", stereo, 16000)
    back = audio.read_audio(str(tmp_path / "s.wav"))
    assert abs(len(back) - 24000) <= 2
    with pytest.raises(audio.InputError, match="too short"):
        audio.read_audio(tmp_path / "s.wav", min_samples=48000)
    with pytest.raises(audio.InputError, match="cannot read audio"):
        audio.read_audio(tmp_path / "missing.wav")
    config = LoadTestConfig(duration=1.0, input=str(tmp_path / "s.wav"))
    frames = input_frames(config)
    assert len(frames) == config.frames == 12 and all(len(f) == 1920 for f in frames)


def test_endpoints_and_pcm16():
    opts = ConnectOptions(url="http://host:1234", protocol="kyutai", sampling=Sampling(text_temperature=0.5, seed=7))
    assert endpoint(opts) == "ws://host:1234/api/chat?text_temperature=0.5&seed=7"
    assert endpoint(ConnectOptions(url="https://h/v1/realtime?x=1")) == "wss://h/v1/realtime?x=1"
    assert endpoint(ConnectOptions(url="127.0.0.1:8998")) == "ws://127.0.0.1:8998/v1/realtime"
    x = np.linspace(-1, 1, 1920, dtype=np.float32)
    assert np.abs(pcm_from_base64(pcm16_base64(x)) - x).max() < 1e-4
    with pytest.raises(ValueError):
        pcm_from_base64("not base64!")
    with pytest.raises(ValueError):
        pcm_from_base64("AAAA")  # three bytes: not pcm16
    assert session_counts("1,2, 4") == [1, 2, 4]


def test_split_frames_pads_the_last_frame():
    assert FRAME_SIZE == 1920
    chunks = split_frames(np.ones(2000, np.float32))
    assert chunks.shape == (2, 1920) and chunks.dtype == np.float32 and chunks[1][79] == 1 and chunks[1][80] == 0
    assert split_frames(np.zeros(0, np.float32)).shape == (1, 1920)  # at least one frame
    batch = split_frames(np.ones((3, 20), np.float32), 8)  # a leading batch axis is kept
    assert batch.shape == (3, 3, 8) and batch[:, 2, 3].tolist() == [1, 1, 1] and batch[:, 2, 4].tolist() == [0, 0, 0]


# A Python without matplotlib (`sys.modules[name] = None` makes every import of it fail), running `duplexd loadtest`
# with the arguments given against an address where a socket listens but nothing answers.
WITHOUT_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None
from duplexd.clients import loadtest_cli
from duplexd.commands.cli import main
assert loadtest_cli.plot_path(None) is None  # the default plot is skipped, not required
sys.exit(main(sys.argv[1:]))
"""


def test_loadtest_plot_without_matplotlib_fails_at_start(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"ws://127.0.0.1:{server.getsockname()[1]}"
        run = subprocess.run(
            [
                sys.executable,
                "-c",
                WITHOUT_MATPLOTLIB,
                "loadtest",
                "--url",
                url,
                "--quiet",
                "--duration",
                "0.2",
                "--json",
                "",
                "--plot",
                str(tmp_path / "lt.png"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected: the run stopped before its first session
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        f"duplexd loadtest: --plot {tmp_path / 'lt.png'}: plotting needs matplotlib: pip install 'duplexd[plot]'"
    ]
    assert not (tmp_path / "lt.png").exists()
