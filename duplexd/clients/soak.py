"""Churn (soak) mode of the load tester: sessions of random length come and go for a long time.

A fixed load test opens N sessions once; a server that leaks per session (memory, slots, tasks) only shows it
when sessions keep arriving and leaving. Here `target` workers each run one session after another, so about
`target` sessions are open at any moment; each session is a `loadtest._Session` (same pacing, same frame
accounting). A refusal (server full, e.g. a slot not yet given back) is counted and retried after a pause: a
race at the edge of capacity, not a broken session. Meanwhile the server's `/metrics` is polled for its resident
memory, and the report buckets late frames, completions, errors and refusals per minute.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from duplexd.wire import FRAME_SECONDS

from .connection import ConnectOptions, http_get
from .loadtest import LoadTestConfig, Progress, _Session, input_frames
from .protocols import encode_stream
from .report import Thresholds, failures
from .stats import DEFAULT_STATS, Overall, SessionTrace, StatsConfig, as_dict, late_flags, overall, session_stats

MINUTE = 60.0
RSS_METRIC = "process_resident_memory_bytes"
FULL = (1013, 503)  # close code / HTTP status of "no free slot now"
RETRY_S = 1.0  # pause before retrying a refused session (plus up to as much again, at random)


@dataclass(frozen=True)
class SoakConfig:
    base: LoadTestConfig  # connection, input, drain, stats; its sessions and duration are not used
    duration: float = 600.0  # seconds during which sessions are started
    session_length: tuple[float, float] = (2.0, 30.0)  # seconds, uniform
    occupancy: float = 0.75  # of the server's capacity, when target is not given
    target: int | None = None  # sessions open at once
    memory_interval: float = 10.0  # seconds between /metrics polls
    warmup: float = MINUTE  # memory growth is measured from the first sample after this


@dataclass
class Churned:
    """One session of the soak: its trace and when (seconds since the soak started) it began sending and ended."""

    trace: SessionTrace
    start_s: float
    end_s: float


@dataclass
class SoakProgress:
    """Live counters for the progress line: sessions open now, done, refused, broken since `start`."""

    start: float  # time.monotonic() when the soak began
    open: int = 0
    completed: int = 0
    refused: int = 0
    errors: int = 0


@dataclass
class SoakResult:
    config: SoakConfig
    capacity: int | None
    target: int
    sessions: list[Churned]
    refusals: list[float]  # when (seconds since the start) a session was refused
    memory: list[dict]  # {"t", "rss_bytes", "sessions_active"}
    date: str
    wall_s: float
    thresholds: Thresholds = field(default_factory=Thresholds)
    max_memory_growth: float | None = None

    @property
    def overall(self) -> Overall:
        """The fixed load test's summary over the admitted sessions; `refused` counts refusals (each retried)."""
        o = overall([s.trace for s in self.sessions], self.config.base.stats)
        return replace(o, refused=len(self.refusals))

    def minutes(self) -> list[dict]:
        return per_minute(self.sessions, self.refusals, self.config.duration, self.config.base.stats)

    def memory_summary(self) -> dict:
        return memory_summary(
            [(m["t"], m["rss_bytes"]) for m in self.memory if m["rss_bytes"] is not None], self.config.warmup
        )

    def failures(self) -> list[str]:
        out = failures(self.overall, self.thresholds)
        if self.max_memory_growth is not None:
            growth = self.memory_summary()["growth"]
            if growth is None:
                out.append(f"memory growth not measured (no /metrics sample after {self.config.warmup:g} s)")
            elif growth > self.max_memory_growth:
                out.append(f"memory growth {growth:.4f} > {self.max_memory_growth:g}")
        return out

    def to_dict(self) -> dict:
        cfg = asdict(self.config)
        cfg["base"]["connect"]["api_key"] = "***" if self.config.base.connect.api_key else None
        broken = self.failures()
        return {
            "mode": "churn",
            "date": self.date,
            "wall_s": self.wall_s,
            "config": cfg,
            "capacity": self.capacity,
            "target_sessions": self.target,
            "overall": as_dict(self.overall),
            "minutes": self.minutes(),
            "memory": {**self.memory_summary(), "samples": self.memory},
            "refusals": self.refusals,
            "checks": {"passed": not broken, "failures": broken},
            "sessions": [
                {**as_dict(session_stats(s.trace, self.config.base.stats)), "start_s": s.start_s, "end_s": s.end_s}
                for s in self.sessions
            ],
        }


def _bucket(t: float, n: int, width: float) -> int:
    return min(max(int(t // width), 0), n - 1)


def per_minute(
    sessions: list[Churned],
    refusals: list[float],
    duration: float,
    cfg: StatsConfig = DEFAULT_STATS,
    width: float = MINUTE,
) -> list[dict]:
    """Per minute of the soak: output frames received and late (by arrival), missing frames, sessions completed
    and broken (by their end), refusals. Whatever happens after the last minute (a drain) counts in it."""
    n = max(1, math.ceil(duration / width))
    rows = [
        {
            "minute": i + 1,
            "frames_received": 0,
            "late_frames": 0,
            "frames_missing": 0,
            "late_frac": 0.0,
            "sessions_completed": 0,
            "errors": 0,
            "refused": 0,
        }
        for i in range(n)
    ]
    for s in sessions:
        tr = s.trace
        for t, late in zip(tr.received, late_flags(tr.sent, tr.received, cfg), strict=True):
            row = rows[_bucket(s.start_s + t, n, width)]
            row["frames_received"] += 1
            row["late_frames"] += late
        end = rows[_bucket(s.end_s, n, width)]
        end["frames_missing"] += max(tr.frames_expected - cfg.output_delay_frames - len(tr.received), 0)
        end["sessions_completed" if tr.status == "ok" else "errors"] += 1
    for t in refusals:
        rows[_bucket(t, n, width)]["refused"] += 1
    for row in rows:
        out = row["frames_received"] + row["frames_missing"]
        row["late_frac"] = (row["late_frames"] + row["frames_missing"]) / out if out else 0.0
    return rows


def memory_summary(samples: list[tuple[float, float]], warmup: float = MINUTE) -> dict:
    """Resident memory from (seconds, bytes) samples: the first one at or after `warmup` (allocators and caches
    settle in the first minute, so growth is measured from there), the last, the largest, and the growth
    (last - first after warm-up) / first after warm-up; None where there is no such sample."""
    samples = sorted(samples)
    after = [v for t, v in samples if t >= warmup]
    base = after[0] if after else None
    last = samples[-1][1] if samples else None
    return {
        "first_minute_bytes": base,
        "last_bytes": last,
        "max_bytes": max(v for _, v in samples) if samples else None,
        "growth": (last - base) / base if base and last is not None else None,
        "samples_taken": len(samples),
    }


def metric_value(text: str, name: str) -> float | None:
    """The value of a Prometheus metric in the text format, summed over its label sets (None: absent)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{")
    ]
    return sum(values) if values else None


def server_capacity(options: ConnectOptions, timeout: float = 5.0) -> int | None:
    """Session slots: `/ready`'s capacity (or admissible + open sessions), else `/metrics`'
    duplexd_sessions_capacity; None when the server says neither."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        ready = json.loads(http_get(options, "/ready", timeout))
        if isinstance(ready.get("capacity"), int):
            return ready["capacity"]
        if isinstance(ready.get("admissible_sessions"), int):
            return ready["admissible_sessions"] + int(ready.get("open_sessions") or 0)
    with contextlib.suppress(OSError, ValueError):
        value = metric_value(http_get(options, "/metrics", timeout).decode("utf-8"), "duplexd_sessions_capacity")
        return int(value) if value is not None else None
    return None


async def _sample(options: ConnectOptions, t: float) -> dict:
    try:
        text = (await asyncio.to_thread(http_get, options, "/metrics", 5.0)).decode("utf-8")
    except Exception:  # noqa: BLE001 - a missed sample is a gap in the series, not a reason to stop
        text = ""
    return {
        "t": round(t, 3),
        "rss_bytes": metric_value(text, RSS_METRIC),
        "sessions_active": metric_value(text, "duplexd_sessions_active"),
    }


async def _poll_memory(options: ConnectOptions, start: float, interval: float, out: list[dict]) -> None:
    """A sample every `interval` seconds on a fixed schedule from `start` (so one lands at the first minute)."""
    k = 0
    while True:
        await asyncio.sleep(max(start + k * interval - time.monotonic(), 0))
        out.append(await _sample(options, time.monotonic() - start))
        k += 1


async def run_soak(
    config: SoakConfig, on_progress: Callable[[SoakProgress], None] | None = None, capacity: int | None = None
) -> SoakResult:
    """Churn sessions for `config.duration` seconds and return every session, refusal and memory sample."""
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    if capacity is None:
        capacity = await asyncio.to_thread(server_capacity, config.base.connect)
    target = config.target or (max(1, round(config.occupancy * capacity)) if capacity else None)
    if not target:
        raise ValueError("cannot read the server's capacity from /ready or /metrics: give --target-sessions")
    lo, hi = config.session_length
    base = replace(config.base, duration=hi)
    messages = encode_stream(base.connect.protocol, input_frames(base))
    rng = random.Random(config.base.seed)
    sessions: list[Churned] = []
    refusals: list[float] = []
    memory: list[dict] = []
    counters = Progress(target, 0)  # what `_Session` updates; the soak keeps its own
    index = itertools.count()
    start = time.monotonic()
    progress = SoakProgress(start)
    end = start + config.duration

    async def worker(w: int) -> None:
        await asyncio.sleep(w * min(lo, 2.0) / target)  # spread the first arrivals
        while (left := end - time.monotonic()) >= FRAME_SECONDS * 2:
            frames = max(2, round(min(rng.uniform(lo, hi), left) / FRAME_SECONDS))
            session = _Session(next(index), base, counters, frames)
            await session.admit(0.0)
            if session.trace.status == "refused" and session.trace.close_code not in FULL:
                session.trace.status = "error"  # refused for good (API key, parameters): retrying cannot help
                sessions.append(Churned(session.trace, time.monotonic() - start, time.monotonic() - start))
                progress.errors += 1
                return
            if session.trace.status == "refused":
                refusals.append(time.monotonic() - start)
                progress.refused += 1
                await asyncio.sleep(RETRY_S * (1 + rng.random()))
                continue
            t0 = time.monotonic()
            progress.open += 1
            try:
                await session.run(t0, messages[:frames])
            finally:
                progress.open -= 1
            sessions.append(Churned(session.trace, t0 - start, time.monotonic() - start))
            if session.trace.status == "ok":
                progress.completed += 1
            else:
                progress.errors += 1
                await asyncio.sleep(RETRY_S)  # a server that breaks sessions is not hammered

    async def tick() -> None:
        while on_progress:
            on_progress(progress)
            await asyncio.sleep(0.5)

    poller = asyncio.create_task(_poll_memory(config.base.connect, start, config.memory_interval, memory))
    ticker = asyncio.create_task(tick())
    try:
        await asyncio.gather(*(worker(w) for w in range(target)))
    finally:
        for task in (poller, ticker):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    memory.append(await _sample(config.base.connect, time.monotonic() - start))  # the end state
    sessions.sort(key=lambda s: s.start_s)
    if on_progress:
        on_progress(progress)
    return SoakResult(config, capacity, target, sessions, refusals, memory, date, time.monotonic() - start)


def minute_table(rows: list[dict]) -> str:
    """The per-minute rows as a markdown table."""
    cols = [
        "minute",
        "frames_received",
        "late_frames",
        "frames_missing",
        "late_frac",
        "sessions_completed",
        "errors",
        "refused",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.4f}" if c == "late_frac" else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def _mib(value: float | None) -> str:
    return "–" if value is None else f"{value / 2**20:.1f} MiB"


def memory_line(m: dict) -> str:
    growth = "–" if m["growth"] is None else f"{100 * m['growth']:+.2f} %"
    return (
        f"server resident memory ({m['samples_taken']} samples): after the first minute "
        f"{_mib(m['first_minute_bytes'])}, last {_mib(m['last_bytes'])}, max {_mib(m['max_bytes'])}, "
        f"growth since the first minute {growth}"
    )
