"""Every bench in bench/ runs, at its smallest size: it exits 0, its last line is one JSON object holding its
headline keys, and no process it started outlives it. No figure is bounded: this checks that a bench runs (so a
change elsewhere cannot quietly break one), not how fast.

The GPU benches run through bench/gpu_suite.sh's CPU dry run (GPU_SUITE_DRY=1, tiny stages), which also checks the
suite's own plumbing and bench/gpu_summary.py on what the stages wrote. Each bench runs in a session of its own;
whatever is left in that session when it exits fails its test (and is killed). The runs start together, two at a
time and the suite first (it takes longest), when the first test asks for them, and each test waits for its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.processes import descendants, in_session, stop

from . import system_tools
from .warm_server import WarmProcess, spawn_script

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
LIBRARIES = {"common.py", "processes.py"}  # imported by the benches, not run
STARTED_BY = {"host_overhead_server.py": "host_overhead.py"}  # run only as another bench's child
NOT_RUN = {  # why a script has no smoke run
    "gpu_wheels.sh": "reaches the package index (it downloads wheels; WHEEL_CHECK=1 resolves them there), and the "
    "test suite runs offline",
    "gpu_triton_cache.py": "builds a scratch venv from the package index (Triton 3.6 for Python 3.12, torch) and "
    "compiles every kernel for sm_90 (minutes); tests/test_gpu_triton_cache_bench.py checks its bookkeeping",
}


# OpenMP workers that sleep when idle instead of spinning: the benches' engine threads and the two runs side by side
# would otherwise spin on the cores the others need (half of a stage's CPU in the suite's dry run).
BENCH_ENV = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


@dataclass(frozen=True)
class Smoke:
    args: tuple[str, ...]
    keys: tuple[str, ...]  # the headline keys the last line's JSON object holds
    env: dict[str, str] = field(default_factory=dict)
    check: Callable[[dict, str, Path], None] | None = None  # more than "it ran": (last JSON, stdout, scratch dir)
    timeout: float = 240


def codec_figures(result: dict, out: str, tmp: Path) -> None:
    assert result["streams"] == 8 and result["ticks"] == 10 and result["backend"].endswith("(ctypes)")
    for name in ("fast", "kyutai", "sphn"):
        assert result[f"{name}_lsd_db"] > 0 and result[f"{name}_snr_db"] > 5, name
    assert result["kyutai_snr_db"] == result["sphn_snr_db"]  # the same bytes, so the same audio
    assert "CPU ms per stream-second" in out


def prefill_forwards(result: dict, out: str, tmp: Path) -> None:
    """The prefill engine really ran the prompt in fewer forwards than the frame-by-frame engine (one a frame)."""
    lines = out.strip().splitlines()
    assert json.loads(next(line for line in lines if line.startswith('{"bench"')))["partial"] is True
    assert "partial" not in result
    live = result["live_sessions"]
    assert live == 2
    forwards = result["prompt_frames"] - 1  # the first prompt frame has no forward
    assert result["frame_by_frame_forwards"] == forwards == result[f"forwards_live{live}_frame_by_frame"]
    assert result["prefill_forwards"] == 1  # no live session: the whole prompt in one forward
    assert 1 <= result[f"forwards_live{live}_prefill"] <= forwards  # the chunk size comes from the warm-up's timing
    for mode in ("prefill", "frame_by_frame"):  # how many outputs fall in a window depends on the machine's load
        for window in ("", "baseline_"):
            assert 0 <= result[f"{window}late_frames_live{live}_{mode}"] <= result[f"{window}outputs_live{live}_{mode}"]
    assert "| prefill |" in out and "| frame-by-frame |" in out


def transcribe_tokens(result: dict, out: str, tmp: Path) -> None:
    assert result["tokens_match"] is True and result["audio_tower"] == "64x2"
    for key in ("0.5s", "1.03s"):  # 1.03 s: the last chunk is partial, so `finish` encodes a padded tail
        assert set(result[f"duplexd_ms_{key}"]) == {"last_feed", "finish", "total"}
        assert set(result[f"reference_ms_{key}"]) == {"processor", "generate", "total"}
    assert result["stream"]["sessions"] == 2


def suite_stages(result: dict, out: str, tmp: Path) -> None:
    """Every stage ran and wrote what gpu_summary.py reads, gpu_summary.py read every JSON file a stage wrote, and
    the summary has each stage's section."""
    assert set(result["stages"]) == {
        "install",
        "gpu_kernels",
        "gpu_capacity",
        "gpu_profile",
        "prompt_prefill",
        "loadtest",
        "serve",
        "kv_dtype",
        "weights_dtype",
        "stt_capacity",
        "gpu_tts",
    }
    assert set(result["stages"].values()) == {"ok"}, result["stages"]
    run = tmp / "suite"
    heads = {
        "gpu_kernels.log": ("bench", "skipped"),
        "gpu_capacity.json": ("realtime_sessions", "kv_sessions", "batch1_p99_ms"),
        "gpu_profile.json": ("runs", "copy_gbps", "status"),
        "prompt_prefill.log": ("ttfo_prefill_ms", "ttfo_frame_by_frame_ms", "ratio_prefill", "reference_ttfo_ms"),
        "kv_dtype.json": ("capacity", "agreement", "steps"),
        "weights_dtype.json": ("steps", "agreement", "ok"),
        "stt/gpu_capacity.json": ("realtime_sessions", "kv_sessions"),
        "tts.json": ("realtime_streams", "batches", "ttfa_ms_p50_b1", "bucketed_frames_differing"),
        "loadtest.json": ("overall",),
    }
    for name, keys in heads.items():
        text = (run / name).read_text()
        data = json.loads(text) if name.endswith(".json") else json.loads(text.strip().splitlines()[-1])
        assert set(keys) <= set(data), (name, sorted(data))
    written = {path.relative_to(run).as_posix() for path in run.rglob("*.json")}
    assert written == {name for name in heads if name.endswith(".json")}, "a stage's JSON that no check reads"
    capacity_stage(run)
    profile_stage(run, out)
    kv_stage(run, out)
    prefill = (run / "prompt_prefill.log").read_text()
    prefill_forwards(json.loads(prefill.strip().splitlines()[-1]), prefill, run)
    summary = (run / "summary.md").read_text()
    sections = ("## Triton kernels", "## Capacity", "## Where a step goes", "## Persona prompt prefill", "## Load test")
    sections += ("## 8-bit KV",)
    for section in (*sections, "## 8-bit weights", "## Speech-to-text streams", "## Text-to-speech streams"):
        assert section in summary, section
    assert "| int8 / bf16 |" in summary  # weights_dtype.json's step table, read
    assert "demo-stt on cpu" in summary  # the STT stage's table
    assert "demo-tts on cpu" in summary and "| 1 |" in summary.split("## Text-to-speech")[1]  # the TTS stage's


def capacity_stage(run: Path) -> None:
    """gpu_capacity.py's dry run at one session: its report, its last line and its markdown agree."""
    log = (run / "gpu_capacity.log").read_text()
    assert "capacity: 1 real-time sessions" in log and "batch-1 step: p50" in log
    report = json.loads((run / "gpu_capacity.json").read_text())
    assert report["status"] == "ok" and report["realtime_sessions"] == report["kv_sessions"] == 1
    assert [b["batch"] for b in report["batches"]] == [1] and report["batch1_p99_ms"] > 0
    last = json.loads(log.strip().splitlines()[-1])
    assert last["realtime_sessions"] == 1 and last["p99_ms_b1"] == report["batch1_p99_ms"]
    assert (run / "gpu_capacity.md").read_text().startswith("demo on cpu")


def profile_stage(run: Path, out: str) -> None:
    """gpu_profile.py's dry run: every part of the step measured, the engine's ranges (Mimi, the temporal
    transformer, the DepFormer) among them, floors from the measured bandwidth, its report as its last line and its
    table in the summary."""
    report = json.loads((run / "gpu_profile.json").read_text())
    assert json.loads((run / "gpu_profile.log").read_text().strip().splitlines()[-1]) == report
    assert report["status"] == "ok" and report["copy_gbps"] > 0
    (one,) = report["runs"]
    assert (one["batch"], one["kv_dtype"], one["status"]) == (1, "int8", "ok")
    parts = one["parts"]
    assert all(p["ms"] > 0 for p in parts.values()), parts
    assert all(p["floor_ms"] > 0 for key, p in parts.items() if key != "other"), parts
    assert one["eager_ms"] > 0 and one["graph_ms"] is None and one["floor_ms"] > 0
    assert "| Mimi decode |" in (run / "summary.md").read_text() and "\nprofile: batch 1 int8: eager step" in out


def kv_stage(run: Path, out: str) -> None:
    """kv_dtype.py's dry run: its last line is its report (no store check: that needs CUDA), both pools measured,
    and the summary's table and verdict made from it."""
    report = json.loads((run / "kv_dtype.json").read_text())
    assert json.loads((run / "kv_dtype.log").read_text().strip().splitlines()[-1]) == report
    assert report["kv_dtype"] == "int8" and "write" not in report
    assert set(report["capacity"]) == {"bf16", "int8"} and report["agreement"]["frames"] == 20
    for kv in ("bf16", "int8"):
        assert report["steps"][kv]["fit"] >= 1 and report["steps"][kv]["1"]["p99_ms"] > 0
    summary = (run / "summary.md").read_text()
    assert "| int8 |" in summary and "B=1 p50 / p99 ms" in summary
    assert "\nkv dtype int8:" in out


TINY_SUITE = {
    "GPU_SUITE_DRY": "1",
    "WHEELS": "/nonexistent",  # the device machine's wheels (.whl/, for its Python) are not this Python's
    "PYTHON": sys.executable,
    "LOAD_SECONDS": "2",  # the served load test's realtime seconds (5 in a dry run): it checks that sessions are served
    "CAPACITY_ARGS": "--preset demo --device cpu --batches 1 --steps 3 --max-sessions 1 --granularity 1 "
    "--budget-ms 1e6 --timeout 60",
    "PREFILL_ARGS": "--preset demo --device cpu --quick --threads 1",
    "KV_ARGS": "--preset demo --device cpu --frames 20 --rows 2 --batches 1 --steps 2",
    "W8_ARGS": "--preset demo --device cpu --stages kernel steps agreement --frames 10 --rows 2 --batches 1 "
    "--steps 2 --repeats 2",
    "STT_ARGS": "--preset demo-stt --device cpu --batches 1 --steps 3 --max-sessions 1 --granularity 1 "
    "--budget-ms 1e6 --position 31",
    "TTS_ARGS": "--preset demo-tts --device cpu --dtype float32 --batches 1 --steps 22",
    "PROFILE_ARGS": "--preset demo --device cpu --runs 1:int8 --warmup 1 --steps 1 --timed 1",
}
# Its stages' own limits stop a hung one (bench/gpu_suite.sh); this one is for the script itself.
SUITE = Smoke(
    (),
    ("bench", "stages", "realtime_sessions", "stt_streams", "tts_streams", "step_x_floor"),
    TINY_SUITE,
    suite_stages,
    timeout=1200,
)
ONE = ("--threads", "1")
SMOKE: dict[str, Smoke] = {
    "codec.py": Smoke(
        ("--quick",), ("thread_scaling_2", "process_scaling_2", "fast_encode_vs_sphn"), {}, codec_figures
    ),
    "decode_attention_cpu.py": Smoke(("--reps", "1", *ONE), ("ratio_b1_h8_d64", "ratio_b8_h8_d64")),
    "engine_throughput.py": Smoke(
        ("--small", "--frames", "2", "--warmup", "1", "--sessions", "2", *ONE),
        ("duplexd_fps_b2", "reference_fps", "ratio_b2"),
    ),
    "gemma4_audio.py": Smoke(
        ("--seconds", "1", "--batch", "1", "--iters", "1", "--stream-steps", "2", "--slots", "2", "--hidden", "64")
        + ("--layers", "2", *ONE),
        ("whole", "stream", "batch"),
    ),
    "host_overhead.py": Smoke(
        ("--no-profile", "--protocols", "kyutai", "--sessions", "1", "--duration", "3.5", "--window", "1")
        + ("--settle", "0.5", "--ramp", "0.2"),
        ("cpu_ms_per_session_s_kyutai_1", "served_frac_kyutai_1"),
    ),
    "lm_step.py": Smoke(("--small", "--frames", "1", "--warmup", "1", *ONE), ("ratio_b1", "ratio_b4")),
    "matvec_layout.py": Smoke(
        ("--mbytes", "1", "--repeats", "1", *ONE), ("cpu_matmul_speedup_3072x1024_b1", "x@w_speedup_3072x1024_b1")
    ),
    "mimi_step.py": Smoke(
        ("--small", "--frames", "1", "--warmup", "1", *ONE), ("ratio_b1", "ratio_b4", "demo_ms_8_slots")
    ),
    "speech_mix.py": Smoke(
        ("--streams", "1", "--seconds", "0.3", "--words", "1", "--words-per-second", "20"),
        ("stt_step_ms_together", "tts_step_ms_together", "stt_step_ratio_together_vs_alone"),
    ),
    "webrtc_calls.py": Smoke(
        ("--calls", "1", "--seconds", "1"), ("cpu_ratio_webrtc_vs_websocket", "ttfa_ms_added_by_webrtc")
    ),
    "stt_streams.py": Smoke(("--frames", "2", "--warmup", "1", "--sessions", "2", *ONE), ("duplexd_fps_b2",)),
    "tts_streams.py": Smoke(
        ("--sessions", "1", "--words", "2", "--threads", "1", "--n-q", "32,24"),
        ("ratio_vs_one_by_one", "ttfa_ms_p50_b1", "fps_ratio_q24_vs_q32_b1"),
    ),
    "transcribe_latency.py": Smoke(
        ("--audio-hidden", "64", "--audio-layers", "2", "--text-hidden", "64", "--text-layers", "2")
        + ("--new-tokens", "4", "--iters", "1", *ONE, "--seconds", "0.5", "1.03")
        + ("--stream-sessions", "2", "--stream-steps", "2"),
        ("ratio_0.5s", "ratio_1.03s", "stream"),
        {},
        transcribe_tokens,
    ),
    "vad.py": Smoke(("--sessions", "2", "--seconds", "1", "--repeats", "1"), ("ratio_2",)),
    "agent_turns.py": Smoke(
        ("--agents", "1", "--turns", "1", "--max-tokens", "4"),
        ("memory_ratio_vs_per_agent", "pss_ratio_vs_per_agent", "first_audio_ms_p50_duplexd", "late_frac_duplexd")
        + ("cut_ms_p50_duplexd", "reply_llm_ms_mean_duplexd", "reply_tts_ms_mean_duplexd"),
    ),
    "gpu_suite.sh": SUITE,
}
# Started first: the suite (the longest), then the benches that mostly wait on the wall clock (servers starting,
# sessions paced at real time), so that their waits overlap the CPU-bound runs instead of ending the module alone.
FIRST = ("gpu_suite.sh", "agent_turns.py", "host_overhead.py", "webrtc_calls.py", "speech_mix.py")
VIA_SUITE = {  # run by the dry suite, where suite_stages checks what each wrote
    "gpu_tts.py",
    "gpu_kernels.py",
    "gpu_capacity.py",
    "gpu_profile.py",
    "prompt_prefill.py",
    "kv_dtype.py",
    "weights_dtype.py",
    "gpu_summary.py",
}


@dataclass
class Ran:
    rc: int
    out: str
    err: str
    left: list[int]  # processes of its session still alive when it exited (or when it was stopped)
    tmp: Path
    timed_out: bool


# runs not yet over, by session id: ended if the test session ends first
LIVE: dict[int, subprocess.Popen | WarmProcess] = {}


def run(name: str, smoke: Smoke, tmp: Path) -> Ran:
    """The bench in a session of its own, its output in files: the wait is for the bench itself, so a child left
    holding its stdout neither delays the check nor hides from it."""
    env = {**BENCH_ENV, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OUT": str(tmp / "suite")}
    proc: subprocess.Popen | WarmProcess
    if name.endswith(".sh"):
        with (tmp / "stdout").open("w") as out, (tmp / "stderr").open("w") as err:
            proc = subprocess.Popen(
                ["bash", str(BENCH / name), *smoke.args],
                cwd=ROOT,
                env={**env, **smoke.env},
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
    else:  # forked from the warm interpreter (torch already imported), in a session of its own as above
        proc = spawn_script(BENCH / name, list(smoke.args), {**env, **smoke.env}, ROOT, tmp / "stdout", tmp / "stderr")
    LIVE[proc.pid] = proc
    try:
        proc.wait(smoke.timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        left = end_session(proc)
    return Ran(proc.returncode, (tmp / "stdout").read_text(), (tmp / "stderr").read_text(), left, tmp, timed_out)


def end_session(proc: subprocess.Popen | WarmProcess) -> list[int]:
    """Stop the bench if it still runs and whatever is left in its session; what was left (the bench excluded)."""
    left = in_session(proc.pid)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    stop(left, 2.0)
    LIVE.pop(proc.pid, None)
    return left


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Iterator[dict[str, Future[Ran]]]:
    """The smoke runs this session's selected tests need, started together, two at a time, `FIRST` first."""
    wanted = {
        item.callspec.params.get("name", "host_overhead.py")
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    order = sorted(
        (name for name in SMOKE if name in wanted), key=lambda name: FIRST.index(name) if name in FIRST else len(FIRST)
    )
    pool = ThreadPoolExecutor(2)
    try:
        yield {name: pool.submit(run, name, SMOKE[name], tmp_path_factory.mktemp(name)) for name in order}
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list(LIVE.values()):  # an interrupted test session: no bench outlives it
            end_session(proc)


def test_every_bench_has_a_smoke_run():
    scripts = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py"}
    covered = set(SMOKE) | VIA_SUITE | LIBRARIES | set(STARTED_BY) | set(NOT_RUN)
    assert scripts == covered, f"no smoke run: {sorted(scripts - covered)}; gone: {sorted(covered - scripts)}"
    assert set(STARTED_BY.values()) <= set(SMOKE) and "gpu_suite.sh" in SMOKE
    assert all(f"bench/{name}" in (BENCH / "gpu_suite.sh").read_text() for name in VIA_SUITE)


def test_every_shell_script_parses():
    """What a smoke run cannot reach of a script that has none (NOT_RUN): bash reads it."""
    for script in BENCH.glob("*.sh"):
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"{script.name}: {done.stderr}"


@pytest.mark.parametrize("name", SMOKE)
def test_bench_runs(name, runs):
    if name == "codec.py":
        system_tools.require("libopus")
    if name == "agent_turns.py":  # its turns are espeak-ng's speech
        system_tools.require("espeak-ng")
    ran = runs[name].result()
    tail = f"\n--- stdout ---\n{ran.out[-3000:]}\n--- stderr ---\n{ran.err[-3000:]}"
    assert not ran.timed_out, f"{name} still ran after {SMOKE[name].timeout:g} s{tail}"
    assert ran.rc == 0, tail
    last = json.loads(ran.out.strip().splitlines()[-1])
    bench = name.removesuffix(".py").removesuffix(".sh")
    assert last.get("bench") == bench, tail
    assert not last.get("skipped"), last
    missing = [key for key in SMOKE[name].keys if key not in last]
    assert not missing, f"{missing} not in {sorted(last)}"
    assert not ran.left, f"{name} left processes behind: {ran.left}"
    if SMOKE[name].check is not None:
        SMOKE[name].check(last, ran.out, ran.tmp)


def wait_for_child(pid: int, marker: str, timeout: float = 300) -> None:
    """Until a process below `pid` whose command line holds `marker` is running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in descendants(pid):
            try:
                if marker in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
                    return
            except OSError:
                continue
        time.sleep(0.2)
    raise AssertionError(f"no {marker} below {pid}")


@pytest.mark.parametrize(("sig", "marker"), [(signal.SIGTERM, "loadtest"), (signal.SIGINT, "host_overhead_server.py")])
def test_a_stopped_bench_takes_its_children_with_it(sig, marker, runs, tmp_path):
    """host_overhead.py stopped by a signal to it alone: SIGTERM once its load-test clients stream to its server (its
    own `finally` blocks end them), SIGINT as soon as the server starts (before those blocks are entered: only
    bench/processes.py can end it). Neither leaves a process behind, and the bench ends by the signal."""
    runs["host_overhead.py"].result()  # one server at a time on two cores
    args = ["--no-profile", "--protocols", "kyutai", "--sessions", "1", "--duration", "60", "--window", "1"]
    err = tmp_path / "stderr.log"
    # A test run started in the background of a non-interactive shell ignores SIGINT, and a child inherits an
    # ignored signal (Python then installs no KeyboardInterrupt): the bench starts as from a terminal, SIGINT caught.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with err.open("wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, str(BENCH / "host_overhead.py"), *args],
                cwd=ROOT,
                env=BENCH_ENV,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )
    finally:
        signal.signal(signal.SIGINT, previous)
    LIVE[proc.pid] = proc
    try:
        wait_for_child(proc.pid, marker)
        signalled = time.monotonic()
        os.kill(proc.pid, sig)
        proc.wait(180)  # its server drains for up to 30 s; a loaded box is slow to start and stop Python
    finally:
        left = end_session(proc)
    assert not left, f"left behind after {sig.name}: {left}"
    # SystemExit(128 + SIGTERM), or SIGINT re-raised; what the bench said, for a run that went on
    told = f"exit {proc.returncode} {time.monotonic() - signalled:.1f} s after {sig.name}:\n{err.read_text()[-3000:]}"
    assert proc.returncode in (128 + sig, -sig), told


def test_a_stopped_suite_takes_its_stage_with_it(tmp_path):
    """bench/gpu_suite.sh sent SIGTERM during its first stage (duplexd's import check, a grandchild of the script):
    the stage ends with it and the suite exits by the signal (its later stages, server included, never start)."""
    proc = subprocess.Popen(
        ["bash", str(BENCH / "gpu_suite.sh")],
        cwd=ROOT,
        env={**BENCH_ENV, **TINY_SUITE, "OUT": str(tmp_path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    LIVE[proc.pid] = proc
    try:
        wait_for_child(proc.pid, "import duplexd.server.app")
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(120)
    finally:
        left = end_session(proc)
    assert not left, f"left behind after SIGTERM: {left}"
    assert proc.returncode == 128 + signal.SIGTERM, proc.returncode
    assert not (tmp_path / "gpu_capacity.log").exists()
