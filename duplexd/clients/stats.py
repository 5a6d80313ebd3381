"""Load-test statistics from raw timings, kept apart from the network code so they can be tested on made-up data.

Conventions: input paced at 80 ms from a shared start, first-audio latency,
inter-arrival p50/p99/max, deadline misses, frame deficit, underruns with a 100 ms buffer, client send lateness,
refused sessions in the denominator. Definitions, all per session, times in seconds since the shared start:

* output frame k comes out of the step of input frame k + `output_delay_frames`; its *latency* is its arrival
  minus that input's actual send time. It is *late* when its latency exceeds the first frame's by more than
  `late_threshold` (its playback deadline: a steady stream is on time, a client that sent late is not blamed);
* *missing* frames are output frames expected (input frames minus `output_delay_frames`) but not received
  by the end of the drain window: never played on time, so `late_frac` counts them with the late ones (refused
  sessions miss all their frames);
* an *underrun* is a playback stall of a player that starts `jitter_buffer` after the first frame and waits
  (shifting its schedule) whenever the next frame is not there in time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from duplexd.wire import FRAME_SECONDS


@dataclass(frozen=True)
class StatsConfig:
    period: float = FRAME_SECONDS  # seconds of audio per frame
    late_threshold: float = 0.08  # a frame more than this behind its deadline is late
    jitter_buffer: float = 0.1  # the simulated player's buffer before it starts, and the underrun threshold
    lateness_warning: float = 0.08  # send-lateness p99 above this: the client, not the server, was slow
    # Input frames that give no output: Moshi's first frame only fills the acoustic delay, so N frames in give
    # N - 1 out. Frames expected out = frames expected in - this.
    output_delay_frames: int = 1


DEFAULT_STATS = StatsConfig()


@dataclass
class SessionTrace:
    """What one session saw. `status`: ok, refused or error; times in seconds since the shared start."""

    index: int
    frames_expected: int
    status: str = "ok"
    error: str = ""
    close_code: int | None = None
    connect_s: float | None = None  # upgrade + handshake duration
    sent: list[float] = field(default_factory=list)  # actual send time of each input frame
    send_lateness: list[float] = field(default_factory=list)
    received: list[float] = field(default_factory=list)  # arrival time of each whole output frame
    voiced: int = 0  # output frames above -50 dBFS
    text_pieces: int = 0
    text: str = ""


def percentile(values: list[float] | np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def summary_ms(values: list[float] | np.ndarray) -> dict[str, float | None]:
    """p50 / p99 / max (and count) of durations given in seconds, in milliseconds."""
    arr = np.asarray(values, dtype=np.float64) * 1000
    return {
        "count": int(arr.size),
        "p50": percentile(arr, 50),
        "p99": percentile(arr, 99),
        "max": float(arr.max()) if arr.size else None,
    }


def answered(sent: list[float], received: list[float], cfg: StatsConfig) -> tuple[np.ndarray, np.ndarray]:
    """(send time of the input frame that produced each output frame, its arrival), for the pairs both exist.

    Output k comes out of the step of input k + `output_delay_frames`."""
    d = cfg.output_delay_frames
    n = max(min(len(sent) - d, len(received)), 0)
    return np.asarray(sent[d : d + n], dtype=np.float64), np.asarray(received[:n], dtype=np.float64)


def late_flags(sent: list[float], received: list[float], cfg: StatsConfig) -> list[bool]:
    """Per output frame: arrived more than `late_threshold` after its deadline. Frames beyond the paired ones
    (a server with less delay) are measured against the last input."""
    inputs, arrivals = answered(sent, received, cfg)
    if not len(arrivals):
        return [False] * len(received)
    base = arrivals[0] - inputs[0]
    extra = np.asarray(received[len(arrivals) :], dtype=np.float64) - sent[-1]
    latency = np.concatenate([arrivals - inputs, extra])
    return (latency - base > cfg.late_threshold).tolist()


def underruns(received: list[float], cfg: StatsConfig) -> tuple[int, float]:
    """(stalls, total stalled seconds) of a player with a `jitter_buffer` prebuffer that waits on a missing frame."""
    if not received:
        return 0, 0.0
    clock = received[0] + cfg.jitter_buffer  # when frame 0 starts playing
    count, stalled = 0, 0.0
    for arrival in received:
        if arrival > clock + 1e-9:
            count += 1
            stalled += arrival - clock
            clock = arrival
        clock += cfg.period
    return count, stalled


@dataclass
class SessionStats:
    index: int
    status: str
    error: str
    close_code: int | None
    frames_expected: int
    frames_sent: int
    frames_received: int
    frame_deficit: int  # sent - received
    frames_missing: int  # expected - received
    late_frames: int
    voiced_frames: int
    underruns: int
    underrun_s: float
    ttfa_ms: float | None  # first output frame after the shared start
    connect_ms: float | None
    inter_arrival_ms: dict
    frame_latency_ms: dict  # arrival of an output frame - send of the input frame whose step produced it
    send_lateness_ms: dict
    text_pieces: int


def session_stats(trace: SessionTrace, cfg: StatsConfig = DEFAULT_STATS) -> SessionStats:
    sent, received = trace.sent, trace.received
    late = sum(late_flags(sent, received, cfg))
    stalls, stalled = underruns(received, cfg)
    inputs, arrivals = answered(sent, received, cfg)
    return SessionStats(
        index=trace.index,
        status=trace.status,
        error=trace.error,
        close_code=trace.close_code,
        frames_expected=trace.frames_expected,
        frames_sent=len(sent),
        frames_received=len(received),
        frame_deficit=len(sent) - len(received),
        frames_missing=max(trace.frames_expected - cfg.output_delay_frames - len(received), 0),
        late_frames=late,
        voiced_frames=trace.voiced,
        underruns=stalls,
        underrun_s=stalled,
        ttfa_ms=received[0] * 1000 if received else None,
        connect_ms=trace.connect_s * 1000 if trace.connect_s is not None else None,
        inter_arrival_ms=summary_ms(np.diff(received)) if len(received) > 1 else summary_ms([]),
        frame_latency_ms=summary_ms(arrivals - inputs),
        send_lateness_ms=summary_ms(trace.send_lateness),
        text_pieces=trace.text_pieces,
    )


@dataclass
class Overall:
    sessions: int
    ok: int
    refused: int
    errors: int
    frames_expected: int
    frames_sent: int
    frames_received: int
    frame_deficit: int
    frames_missing: int
    late_frames: int
    late_frac: float  # (late + missing) / output frames expected, refused sessions included
    underruns: int
    underrun_s: float
    ttfa_ms: dict
    inter_arrival_ms: dict
    frame_latency_ms: dict
    send_lateness_ms: dict
    client_slow: bool  # send lateness p99 over the warning: the figures say more about the client
    text_pieces: int


def overall(traces: list[SessionTrace], cfg: StatsConfig = DEFAULT_STATS) -> Overall:
    stats = [session_stats(t, cfg) for t in traces]
    expected = sum(s.frames_expected for s in stats)
    expected_out = sum(max(s.frames_expected - cfg.output_delay_frames, 0) for s in stats)
    late = sum(s.late_frames for s in stats)
    missing = sum(s.frames_missing for s in stats)
    gaps = np.concatenate([np.diff(t.received) for t in traces if len(t.received) > 1] or [np.zeros(0)])
    latency = np.concatenate([np.subtract(*answered(t.sent, t.received, cfg)[::-1]) for t in traces] or [np.zeros(0)])
    lateness = np.concatenate([np.asarray(t.send_lateness, dtype=np.float64) for t in traces] or [np.zeros(0)])
    send_summary = summary_ms(lateness)
    return Overall(
        sessions=len(stats),
        ok=sum(s.status == "ok" for s in stats),
        refused=sum(s.status == "refused" for s in stats),
        errors=sum(s.status == "error" for s in stats),
        frames_expected=expected,
        frames_sent=sum(s.frames_sent for s in stats),
        frames_received=sum(s.frames_received for s in stats),
        frame_deficit=sum(s.frame_deficit for s in stats),
        frames_missing=missing,
        late_frames=late,
        late_frac=(late + missing) / expected_out if expected_out else 0.0,
        underruns=sum(s.underruns for s in stats),
        underrun_s=sum(s.underrun_s for s in stats),
        ttfa_ms=summary_ms([s.ttfa_ms / 1000 for s in stats if s.ttfa_ms is not None]),
        inter_arrival_ms=summary_ms(gaps),
        frame_latency_ms=summary_ms(latency),
        send_lateness_ms=send_summary,
        client_slow=(send_summary["p99"] or 0.0) > cfg.lateness_warning * 1000,
        text_pieces=sum(s.text_pieces for s in stats),
    )


def timeline(traces: list[SessionTrace], cfg: StatsConfig = DEFAULT_STATS) -> dict[str, list[int]]:
    """Per second since the shared start: frames sent, received and late (for the plot)."""
    ends = [t for tr in traces for t in (*tr.sent, *tr.received)]
    seconds = max(1, math.ceil(max(ends))) if ends else 1
    sent, received, late = np.zeros(seconds, int), np.zeros(seconds, int), np.zeros(seconds, int)
    for tr in traces:
        for t in tr.sent:
            sent[min(int(max(t, 0)), seconds - 1)] += 1
        for t, is_late in zip(tr.received, late_flags(tr.sent, tr.received, cfg), strict=True):
            second = min(int(max(t, 0)), seconds - 1)
            received[second] += 1
            late[second] += is_late
    return {"sent": sent.tolist(), "received": received.tolist(), "late": late.tolist()}


def as_dict(obj: SessionStats | Overall) -> dict:
    return asdict(obj)
