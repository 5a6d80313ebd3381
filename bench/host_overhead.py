"""Server CPU per session-second, model excluded: the real `duplexd serve` over a zero-cost stand-in model.

On a GPU the step for 64-128 sessions takes tens of ms; the Python around it (Opus, WebSocket framing, JSON and
base64, queues, detokenising) grows with sessions and runs on the event loop and the engine's loop thread. This
bench measures that host cost alone:

* the server is `duplexd serve` (demo model, both protocols) started by `bench/host_overhead_server.py`, which
  replaces `Pipeline.step` with a stand-in that returns speech-like PCM and real text ids at once;
* paced `duplexd loadtest` clients in separate processes (`--clients`) drive N sessions of one protocol;
* in a steady window in the middle of each run the server's CPU is read from `/proc/PID/task/*/stat` (per
  thread: the event loop, the engine's loop thread and its OpenMP workers, the rest) and its stacks sampled by
  `py-spy` (other process, non-blocking; idle threads are not sampled), which splits the CPU into codec,
  protocol framing, engine bookkeeping and the rest;
* CPU is divided by the session-seconds of audio the engine consumed in the window (frames in x 80 ms), so a
  server that falls behind is charged per second of audio it actually served; the wall-clock figure is printed
  beside it, and the server's own late-frame counter and the clients' send lateness say whether anyone fell
  behind; the 1-minute load average as the window opens and closes (this bench's server and clients count in it)
  says whether other work shared the machine.

`.venv/bin/python bench/host_overhead.py` (≈ 6 min for 32, 64, 128 sessions x both protocols). The last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.processes import descendants, ending_children, wait_ready  # noqa: E402

FRAME_SECONDS = 0.08
CLOCK_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
GROUPS = ("codec", "framing", "engine", "rest")
THREADS = ("event-loop", "engine-loop", "codec", "other")  # OS thread names (`other`: every thread not named)

# ---------------------------------------------------------------------------------------- CPU accounting


def parse_stat(text: str) -> tuple[str, float]:
    """(comm, user + system CPU seconds) from one `/proc/.../stat` line; comm may hold spaces and parentheses."""
    left, right = text.index("("), text.rindex(")")
    fields = text[right + 2 :].split()  # fields from the 3rd (state) on
    utime, stime = int(fields[11]), int(fields[12])  # 14th and 15th fields
    return text[left + 1 : right], (utime + stime) / CLOCK_TICK


def thread_group(comm: str) -> str:
    """The thread groups reported: the event loop, the engine loop (its OpenMP workers inherit the name), the codec
    threads, other."""
    return comm if comm in THREADS[:3] else "other"


def cpu_snapshot(pid: int) -> dict[str, float]:
    """CPU seconds of the process (`total`, dead threads included) and of each thread group; its child processes
    (codec workers) count in `total` and as codec."""
    out: dict[str, float] = defaultdict(float)
    out["total"] = parse_stat(Path(f"/proc/{pid}/stat").read_text())[1]
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            comm, seconds = parse_stat((task / "stat").read_text())
            out[thread_group(comm)] += seconds
    for child in descendants(pid):  # the server's codec workers, with `--codec-processes`
        with contextlib.suppress(OSError, ValueError):
            seconds = parse_stat(Path(f"/proc/{child}/stat").read_text())[1]
            out["total"] += seconds
            out["codec"] += seconds
    return dict(out)


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per group CPU seconds between two snapshots; `other` absorbs threads that came, went or were renamed, so
    the groups always add up to the process total."""
    delta = {k: max(after.get(k, 0.0) - before.get(k, 0.0), 0.0) for k in THREADS[:3]}
    delta["total"] = after["total"] - before["total"]
    delta["other"] = max(delta["total"] - sum(delta[k] for k in THREADS[:3]), 0.0)
    return delta


def ms_per_session_s(cpu_seconds: float, session_seconds: float) -> float:
    return 1000.0 * cpu_seconds / session_seconds if session_seconds > 0 else math.nan


# ---------------------------------------------------------------------------------------- profile attribution

# (category, file pattern, function pattern or None); the innermost frame of a stack that matches decides.
RULES: tuple[tuple[str, re.Pattern, re.Pattern | None], ...] = tuple(
    (cat, re.compile(path), re.compile(func) if func else None)
    for cat, path, func in (
        ("codec", r"(^|/)server/codec/|(^|/)sphn/|(^|/)ctypes/", None),
        ("codec", r"(^|/)duplexd/wire\.py$", r"^(pcm16|pcm_from_pcm16)$"),
        (
            "framing",
            r"(^|/)(websockets|wsproto|h11|json|orjson)/|(^|/)uvicorn/protocols/|(^|/)starlette/websockets\.py$"
            r"|(^|/)base64\.py$|(^|/)server/(kyutai/messages|realtime/events)\.py$|(^|/)duplexd/wire\.py$",
            None,
        ),
        ("engine", r"(^|/)engine/|(^|/)torch/", None),
        ("metrics", r"(^|/)prometheus_client/|(^|/)server/core/metrics\.py$", None),
        ("asyncio", r"(^|/)(asyncio|uvloop|anyio|concurrent)/|(^|/)threading\.py$", None),
        ("server", r"(^|/)server/", None),
    )
)
REST = ("metrics", "asyncio", "server", "other")

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def classify(frames: list[str], thread: str) -> str:
    """The category of one sampled stack (root first): everything on the engine's loop thread is engine work;
    elsewhere the innermost frame matching a rule decides."""
    if thread == "engine-loop":
        return "engine"
    for frame in reversed(frames):
        m = _FRAME.match(frame)
        func, path = (m["func"], m["file"]) if m else (frame, "")
        for cat, file_re, func_re in RULES:
            if file_re.search(path) and (func_re is None or func_re.search(func)):
                return cat
    return "other"


def python_thread(name: str) -> str:
    """The OS thread name that goes with a Python thread name (when py-spy saw a thread /proc no longer lists)."""
    if name == "MainThread":
        return "event-loop"
    if name.startswith("duplexd-codec"):
        return "codec"
    return "engine-loop" if name.startswith("duplexd-engine") else name


def parse_raw_profile(text: str, thread_names: dict[int, str]) -> dict[str, dict[str, int]]:
    """py-spy `--format raw --threads` output → samples per thread group and category."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = "other"
        if frames and frames[0].startswith("thread ("):
            m = re.match(r"thread \((0x[0-9a-fA-F]+|\d+)\)(?:: (.*))?", frames[0])
            if m:
                tid = int(m.group(1), 0)
                thread = thread_group(thread_names[tid] if tid in thread_names else python_thread(m.group(2) or ""))
            frames = frames[1:]
            if frames and frames[0].startswith("process "):
                frames = frames[1:]
        out[thread][classify(frames, thread)] += int(count)
    return {k: dict(v) for k, v in out.items()}


def attribute(cpu: dict[str, float], samples: dict[str, dict[str, int]]) -> dict[str, float]:
    """CPU seconds per category: each thread group's measured CPU split in proportion to its samples (a group with
    no samples is `rest`; the engine group is all `engine`)."""
    out: dict[str, float] = defaultdict(float)
    for group in THREADS:
        seconds = cpu.get(group, 0.0)
        if not seconds:
            continue
        counts = samples.get(group, {})
        total = sum(counts.values())
        if group == "engine-loop":
            out["engine"] += seconds
        elif total == 0:
            out["other"] += seconds
        else:
            for cat, n in counts.items():
                if n:
                    out[cat] += seconds * n / total
    return dict(out)


def groups(categories: dict[str, float]) -> dict[str, float]:
    """The four reported groups: codec, framing, engine and rest (metrics, asyncio, server glue, other)."""
    out = {g: categories.get(g, 0.0) for g in GROUPS[:3]}
    out["rest"] = sum(categories.get(c, 0.0) for c in REST)
    return out


# ---------------------------------------------------------------------------------------- metrics

_METRIC = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {name or name{labels}: value}."""
    out = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if m:
            key = m["name"] + (f"{{{m['labels']}}}" if m["labels"] else "")
            out[key] = float(m["value"])
    return out


def fetch_metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as r:  # an overloaded loop answers late
        return parse_metrics(r.read().decode())


# ---------------------------------------------------------------------------------------- one run


@dataclass
class Run:
    protocol: str
    sessions: int
    window_s: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    frames_in: float = 0.0
    frames_out: float = 0.0
    steps: float = 0.0
    late: float = 0.0  # server-counted late frames over the whole run (of `run_frames_out`)
    run_frames_out: float = 0.0
    dropped_in: float = 0.0
    dropped_out: float = 0.0
    samples: dict[str, dict[str, int]] = field(default_factory=dict)
    clients: list[dict] = field(default_factory=list)
    load: tuple[float, float] = (math.nan, math.nan)  # 1-minute load average as the window opens and closes

    @property
    def audio_session_s(self) -> float:
        return self.frames_in * FRAME_SECONDS

    @property
    def served_frac(self) -> float:
        """Audio served / audio due in the window (1.0: the server kept up with every session)."""
        return self.audio_session_s / (self.sessions * self.window_s) if self.window_s else math.nan

    def per_session_s(self, seconds: float) -> float:
        return ms_per_session_s(seconds, self.audio_session_s)

    def summary(self) -> dict:
        cats = attribute(self.cpu, self.samples) if self.samples else {}
        lateness = [c["send_lateness_ms"]["p99"] or 0.0 for c in self.clients]
        return {
            "protocol": self.protocol,
            "sessions": self.sessions,
            "window_s": round(self.window_s, 2),
            "cpu_ms_per_session_s": round(self.per_session_s(self.cpu["total"]), 3),
            "cpu_ms_per_session_s_wall": round(ms_per_session_s(self.cpu["total"], self.sessions * self.window_s), 3),
            "cores": round(self.cpu["total"] / self.window_s, 3),
            "threads_ms_per_session_s": {g: round(self.per_session_s(self.cpu.get(g, 0.0)), 3) for g in THREADS},
            "groups_ms_per_session_s": {g: round(self.per_session_s(v), 3) for g, v in groups(cats).items()},
            "categories_ms_per_session_s": {c: round(self.per_session_s(v), 3) for c, v in sorted(cats.items())},
            "profile_samples": sum(sum(v.values()) for v in self.samples.values()),
            "served_frac": round(self.served_frac, 4),
            "steps_per_s": round(self.steps / self.window_s, 2),
            "mean_batch": round(self.frames_in / self.steps, 2) if self.steps else None,
            "server_late_frames": int(self.late),
            "server_late_frac": round(self.late / self.run_frames_out, 5) if self.run_frames_out else None,
            "dropped_in": int(self.dropped_in),
            "dropped_out": int(self.dropped_out),
            "client_late_frac": max((c["late_frac"] for c in self.clients), default=None),
            "client_errors": sum(c["errors"] + c["refused"] for c in self.clients),
            "client_send_late_p99_ms": round(max(lateness), 1) if lateness else None,
            "load_avg": [round(x, 2) for x in self.load],
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_counters(path: Path) -> tuple[int, int, int]:
    """The stand-in's (steps, frames in, frames out) so far, written by the engine thread itself."""
    steps, frames_in, frames_out = (int(x) for x in np.fromfile(path, np.int64, 3))
    return steps, frames_in, frames_out


def start_server(
    port: int, max_sessions: int, step_ms: float, log: Path, counters: Path, serve_args: list[str]
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(HERE / "host_overhead_server.py"),
        "--step-ms",
        str(step_ms),
        "--",
        "serve",
        "--port",
        str(port),
        "--max-sessions",
        str(max_sessions),
        *serve_args,
        "--max-pending-frames",
        "250",
        "--max-output-frames",
        "250",
        "--idle-timeout",
        "120",
        "--send-timeout",
        "60",
        "--static",
        "none",
        "--log-level",
        "warning",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HOST_OVERHEAD_COUNTERS": str(counters)}
        )
    wait_ready(proc, f"http://127.0.0.1:{port}", log)
    return proc


def thread_names(pid: int) -> dict[int, str]:
    names = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            names[int(task.name)] = (task / "comm").read_text().strip()
    return names


def split(total: int, parts: int) -> list[int]:
    """`total` sessions over `parts` client processes, as evenly as possible, none empty."""
    parts = max(1, min(parts, total))
    return [total // parts + (i < total % parts) for i in range(parts)]


def wait_quiet(server: subprocess.Popen, url: str, timeout: float = 180.0) -> None:
    """Until the previous run's sessions are gone and the server idles (a server that fell behind still has
    queued frames to drop and sockets to close), so one run's leftovers never land in the next one's window."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = cpu_snapshot(server.pid)["total"]
        time.sleep(1.0)
        busy = cpu_snapshot(server.pid)["total"] - before
        if fetch_metrics(url).get("duplexd_sessions_active", 1) == 0 and busy < 0.05:
            return
    raise RuntimeError("the server did not go idle between runs")


def run_one(
    args: argparse.Namespace, server: subprocess.Popen, url: str, protocol: str, sessions: int, tmp: Path
) -> Run:
    wait_quiet(server, url)
    m0 = fetch_metrics(url)
    counters = Path(os.environ["HOST_OVERHEAD_COUNTERS"])
    run = Run(protocol, sessions)
    clients = []
    for i, n in enumerate(split(sessions, args.clients or -(-sessions // args.sessions_per_client))):
        report = tmp / f"{protocol}-{sessions}-{i}.json"
        cmd = [
            sys.executable,
            "-m",
            "duplexd",
            "loadtest",
            "--url",
            url.replace("http", "ws", 1),
            "--protocol",
            protocol,
            "--sessions",
            str(n),
            "--duration",
            str(args.duration),
            "--ramp",
            str(args.ramp),
            "--quiet",
            "--json",
            str(report),
            "--plot",
            "",
            "--seed",
            str(i),
        ]
        log = open(tmp / f"{protocol}-{sessions}-{i}.log", "wb")  # noqa: SIM115 - closed below
        clients.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), report, log))
    try:
        # Wait until the sessions stream (at least one frame a second each, on average, through the engine), then
        # let the pace settle before the window opens. The engine's own counters, not /metrics: an event loop that
        # has fallen behind answers HTTP late, and the window would land after the run.
        deadline = time.monotonic() + args.ramp + 120
        last = read_counters(counters)[1]
        while True:
            time.sleep(1.0)
            now = read_counters(counters)[1]
            if now - last >= sessions:
                break
            last = now
            if time.monotonic() > deadline or any(p.poll() is not None for p, _, _ in clients):
                raise RuntimeError(f"{sessions} {protocol} sessions never all streamed (see {tmp})")
        time.sleep(args.settle)
        names = thread_names(server.pid)
        profile = tmp / f"{protocol}-{sessions}.raw"
        spy = None
        if args.profile:
            spy = subprocess.Popen(
                [
                    args.py_spy,
                    "record",
                    "--pid",
                    str(server.pid),
                    "--duration",
                    str(int(args.window)),
                    "--rate",
                    str(args.rate),
                    "--format",
                    "raw",
                    "--threads",
                    "--nonblocking",
                    "-o",
                    str(profile),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        load0 = os.getloadavg()[0]
        k0, c0, t0 = read_counters(counters), cpu_snapshot(server.pid), time.monotonic()
        time.sleep(args.window)
        k1, c1, t1 = read_counters(counters), cpu_snapshot(server.pid), time.monotonic()
        run.load = (load0, os.getloadavg()[0])
        names.update(thread_names(server.pid))
        run.window_s, run.cpu = t1 - t0, cpu_delta(c0, c1)
        run.steps, run.frames_in, run.frames_out = (b - a for a, b in zip(k0, k1, strict=True))
        if spy is not None:
            spy.wait(args.window + 30)
            if profile.is_file():
                run.samples = parse_raw_profile(profile.read_text(), names)
        for proc, report, log in clients:
            proc.wait(args.duration + args.ramp + 300)
            log.close()
            run.clients.append(json.loads(report.read_text())["overall"])
        wait_quiet(server, url)  # the whole run's late and dropped frames (the server's counters), once it idles
        m1 = fetch_metrics(url)

        def d(key: str) -> float:
            return m1.get(key, 0.0) - m0.get(key, 0.0)

        run.late, run.run_frames_out = d("duplexd_frames_late_total"), d("duplexd_frames_out_total")
        run.dropped_in = d('duplexd_frames_dropped_total{direction="in"}')
        run.dropped_out = d('duplexd_frames_dropped_total{direction="out"}')
    finally:
        for proc, _, log in clients:
            if proc.poll() is None:
                proc.kill()
            log.close()
    return run


# ---------------------------------------------------------------------------------------- report


def table(summaries: Iterable[dict]) -> str:
    head = (
        "| protocol | sessions | CPU ms/session-s | (wall) | cores | event loop | engine thread | codec threads "
        "| other threads "
        "| codec | framing | engine | rest | served | steps/s | batch | late (server) | send late p99 | load |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        t, g = s["threads_ms_per_session_s"], s["groups_ms_per_session_s"]
        # without a profile (--no-profile) there is no split by kind of work: no figure rather than zeros
        split = " | ".join(f"{g[k]:.2f}" if s["profile_samples"] else "—" for k in GROUPS)
        lines.append(
            f"| {s['protocol']} | {s['sessions']} | {s['cpu_ms_per_session_s']:.2f} | "
            f"{s['cpu_ms_per_session_s_wall']:.2f} | {s['cores']:.2f} | {t['event-loop']:.2f} | "
            f"{t['engine-loop']:.2f} | {t.get('codec', 0):.2f} | {t['other']:.2f} | {split} | "
            f"{s['served_frac']:.3f} | {s['steps_per_s']:.1f} | "
            f"{s['mean_batch']} | {s['server_late_frames']} ({100 * (s['server_late_frac'] or 0):.2f} %) | "
            f"{s['client_send_late_p99_ms']} | {s['load_avg'][0]:.1f}-{s['load_avg'][1]:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="32,64,128", help="session counts (comma-separated)")
    parser.add_argument("--protocols", default="kyutai,realtime")
    parser.add_argument("--duration", type=float, default=24.0, help="seconds of paced input per session")
    parser.add_argument("--window", type=float, default=14.0, help="seconds measured, in the middle of the run")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after all sessions stream, before it")
    parser.add_argument("--ramp", type=float, default=4.0, help="seconds over which each client connects")
    parser.add_argument("--clients", type=int, default=0, help="client processes per run (0: one per 32 sessions)")
    parser.add_argument("--sessions-per-client", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=0.0, help="hold each stand-in step (sleep, no CPU)")
    parser.add_argument(
        "--codec-processes", type=int, default=0, help="serve with codec worker processes (their CPU counts as codec)"
    )
    parser.add_argument("--opus-profile", default="fast", choices=("fast", "kyutai"), help="the Kyutai downlink")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip py-spy")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--py-spy", default=str(Path(sys.executable).with_name("py-spy")))
    parser.add_argument("--keep", help="keep the raw profiles, client reports and server log in this directory")
    parser.add_argument("--json", help="also write the summaries here")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.sessions.split(",") if x.strip()]
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    if args.window + args.settle + 2 > args.duration:
        parser.error("--duration must leave room for --settle and --window")
    if args.profile and not Path(args.py_spy).is_file():
        parser.error(f"py-spy not found at {args.py_spy} (pip install py-spy, or --no-profile)")

    with ending_children(), contextlib.ExitStack() as stack:
        if args.keep:
            tmp = Path(args.keep)
            tmp.mkdir(parents=True, exist_ok=True)
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="host_overhead-")))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        os.environ["HOST_OVERHEAD_COUNTERS"] = str(tmp / "counters.bin")
        serve_args = ["--opus-profile", args.opus_profile]
        if args.codec_processes:
            serve_args += ["--codec-processes", str(args.codec_processes)]
        server = start_server(port, max(counts), args.step_ms, tmp / "server.log", tmp / "counters.bin", serve_args)
        summaries = []
        try:
            for protocol in protocols:
                for n in counts:
                    print(f"{protocol}, {n} sessions ...", file=sys.stderr, flush=True)
                    summary = run_one(args, server, url, protocol, n, tmp).summary()
                    summaries.append(summary)
                    print(json.dumps(summary), file=sys.stderr, flush=True)
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    print(f"\nserver CPU per session-second of audio served (ms), {os.cpu_count()} cores, step {args.step_ms:g} ms")
    print(table(summaries))
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))
    result: dict = {"bench": "host_overhead"}
    for s in summaries:
        key = f"{s['protocol']}_{s['sessions']}"
        result[f"cpu_ms_per_session_s_{key}"] = s["cpu_ms_per_session_s"]
        result[f"event_loop_ms_per_session_s_{key}"] = s["threads_ms_per_session_s"]["event-loop"]
        result[f"served_frac_{key}"] = s["served_frac"]
        result[f"server_late_frac_{key}"] = s["server_late_frac"]
        result[f"load_avg_{key}"] = s["load_avg"]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
