"""`duplexd chat` and `duplexd loadtest` against a real `duplexd serve` (demo model, CPU, 2 slots), short runs.

The report's fields are checked for consistency: frames sent = frames expected, received = sent - 1 (the first
input frame only fills Moshi's acoustic delay), deficit = sent - received, refusals in the denominator.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
import soundfile as sf

from duplexd.clients.audio import SAMPLE_RATE, speech_like, write_wav
from duplexd.commands.cli import main

from .live_server import demo_cache, running_server

SLOTS = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    cache = demo_cache(tmp_path_factory)
    log = tmp_path_factory.mktemp("clients-server") / "serve.log"
    env = {"DUPLEXD_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    with running_server(log, "--max-sessions", str(SLOTS), env=env) as live:
        yield live.url


def wait_idle(url: str) -> None:
    """The previous test's sessions have given their slots back."""
    deadline = time.monotonic() + 10
    while httpx2.get(f"{url}/ready", timeout=2).json().get("admissible_sessions") != SLOTS:
        assert time.monotonic() < deadline, "slots did not come back"
        time.sleep(0.05)


@pytest.fixture
def talk(tmp_path) -> Path:
    path = tmp_path / "talk.wav"
    write_wav(str(path), speech_like(1.6, seed=2))  # 20 frames
    return path


def test_chat_realtime_paced(server, talk, tmp_path, capsys):
    wait_idle(server)
    out = tmp_path / "answer.wav"
    started = time.monotonic()
    assert main(["chat", str(talk), "--out", str(out), "--url", server, "--text-out", str(tmp_path / "t.txt")]) == 0
    assert time.monotonic() - started >= 1.5  # real-time pace: 20 frames take 1.6 s
    pcm, rate = sf.read(out)
    assert rate == SAMPLE_RATE and len(pcm) == 19 * 1920
    err = capsys.readouterr().err
    assert "sent 20 frames, received 19" in err and "demo model" in err
    assert (tmp_path / "t.txt").read_text(encoding="utf-8")  # the demo model writes word pieces


def test_chat_fast_is_deterministic_per_seed(server, talk, tmp_path, capsys):
    wait_idle(server)
    texts = []
    for i, protocol in enumerate(["kyutai", "kyutai", "realtime"]):
        out = tmp_path / f"a{i}.wav"
        args = [
            "chat",
            str(talk),
            "--out",
            str(out),
            "--url",
            server,
            "--protocol",
            protocol,
            "--fast",
            "--seed",
            "11",
            "--text-temperature",
            "0.7",
            "--audio-topk",
            "100",
        ]
        started = time.monotonic()
        assert main(args) == 0
        assert time.monotonic() - started < 6
        wait_idle(server)
        assert len(sf.read(out)[0]) == 19 * 1920
        texts.append(capsys.readouterr().out.strip())
    assert texts[0] == texts[1] and texts[0]  # the same seed and input: the same answer


def test_chat_refused_with_a_clear_message(server, talk, tmp_path, capsys):
    wait_idle(server)
    args = ["chat", str(talk), "--out", str(tmp_path / "x.wav"), "--url", server, "--text-topk", "0"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "refused" in err and "top-k" in err and "1007" in err
    assert not (tmp_path / "x.wav").exists()


def run_loadtest(tmp_path: Path, *args: str) -> tuple[int, dict]:
    report = tmp_path / "lt.json"
    code = main(["loadtest", "--quiet", "--json", str(report), "--plot", str(tmp_path / "lt.png"), *args])
    return code, json.loads(report.read_text())


@pytest.mark.parametrize("protocol", ["realtime", "kyutai"])
def test_loadtest_report_is_consistent(server, tmp_path, protocol, capsys):
    wait_idle(server)
    code, data = run_loadtest(
        tmp_path,
        "--url",
        server,
        "--protocol",
        protocol,
        "--sessions",
        str(SLOTS),
        "--duration",
        "2",
        "--max-late-frac",  # how late frames are is the bench's question; on a loaded box most may be
        "1",
        "--max-refused",
        "0",
        "--max-errors",
        "0",
    )
    assert code == 0, capsys.readouterr().err
    o, sessions = data["overall"], data["sessions"]
    assert (o["sessions"], o["ok"], o["refused"], o["errors"]) == (SLOTS, SLOTS, 0, 0)
    assert len(sessions) == SLOTS
    for s in sessions:
        assert s["frames_expected"] == s["frames_sent"] == 25
        assert s["frames_received"] == 24 and s["frame_deficit"] == 1 and s["frames_missing"] == 0
        assert s["inter_arrival_ms"]["count"] == 23 and s["frame_latency_ms"]["count"] == 24
        assert s["send_lateness_ms"]["count"] == 25 and s["send_lateness_ms"]["p99"] >= 0
        assert 80 <= s["ttfa_ms"] < 5000 and s["connect_ms"] > 0 and s["text_pieces"] > 0
        assert s["inter_arrival_ms"]["p50"] <= s["inter_arrival_ms"]["p99"] <= s["inter_arrival_ms"]["max"]
    assert o["frames_expected"] == o["frames_sent"] == 25 * SLOTS and o["frames_received"] == 24 * SLOTS
    assert o["frame_deficit"] == SLOTS and o["ttfa_ms"]["count"] == SLOTS
    assert sum(data["timeline"]["sent"]) == 25 * SLOTS and sum(data["timeline"]["received"]) == 24 * SLOTS
    assert data["config"]["connect"]["protocol"] == protocol
    assert (tmp_path / "lt.png").read_bytes()[:4] == b"\x89PNG"
    assert "PASS" in capsys.readouterr().err


def test_loadtest_refusals_stay_in_the_denominator_and_fail_the_check(server, tmp_path, capsys):
    wait_idle(server)
    code, data = run_loadtest(
        tmp_path, "--url", server, "--sessions", str(SLOTS + 1), "--duration", "1", "--max-refused", "0"
    )
    assert code == 1
    o = data["overall"]
    assert (o["sessions"], o["ok"], o["refused"]) == (SLOTS + 1, SLOTS, 1)
    assert o["frames_expected"] == 12 * (SLOTS + 1) and o["frames_sent"] == 12 * SLOTS
    assert o["late_frac"] >= 11 / (11 * (SLOTS + 1))  # the refused session's frames all count as missing
    refused = [s for s in data["sessions"] if s["status"] == "refused"]
    assert refused[0]["close_code"] == 1013 and refused[0]["frames_sent"] == 0
    assert "FAIL" in capsys.readouterr().err


def test_loadtest_sweep_prints_a_table(server, tmp_path, capsys):
    wait_idle(server)
    code, data = run_loadtest(
        tmp_path, "--url", server, "--sessions", "1,2", "--duration", "1", "--max-ttfa-ms", "0.001"
    )
    assert code == 1  # nobody hears anything within a microsecond
    assert [run["overall"]["sessions"] for run in data["runs"]] == [1, 2]
    out = capsys.readouterr()
    assert "| sessions |" in out.out and out.out.count("\n| ") == 2 and "largest session count" in out.out
    assert (tmp_path / "lt-1.png").exists() and (tmp_path / "lt-2.png").exists()
