"""The load test's PNG: how output frames were spaced and delayed, and what happened each second.

matplotlib is an optional extra (`duplexd[plot]`): it is imported only when a plot is made, so a load test
without one, and every other client, runs without it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .stats import DEFAULT_STATS, SessionTrace, StatsConfig, answered, timeline

EXTRA = "duplexd[plot]"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message says which extra brings it."""


def require() -> None:
    """`PlotUnavailable` when matplotlib is missing: callers check at start, before any work a plot would end."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(f"plotting needs matplotlib: pip install '{EXTRA}'") from None


def available() -> bool:
    try:
        require()
    except PlotUnavailable:
        return False
    return True


def plot(traces: list[SessionTrace], path: str | Path, title: str, cfg: StatsConfig = DEFAULT_STATS) -> None:
    require()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gaps = np.concatenate([np.diff(t.received) for t in traces if len(t.received) > 1] or [np.zeros(0)]) * 1000
    latency = (
        np.concatenate([np.subtract(*answered(t.sent, t.received, cfg)[::-1]) for t in traces] or [np.zeros(0)]) * 1000
    )
    ttfa = np.array([t.received[0] * 1000 for t in traces if t.received])
    series = timeline(traces, cfg)

    fig, (ax_gap, ax_lat, ax_time) = plt.subplots(3, 1, figsize=(9, 10), constrained_layout=True)
    fig.suptitle(title)
    if gaps.size:
        ax_gap.hist(gaps, bins=60, color="tab:blue")
        ax_gap.set_yscale("log")
    ax_gap.axvline(cfg.period * 1000, color="k", lw=0.8, ls="--", label="80 ms")
    ax_gap.set(xlabel="inter-arrival of output frames (ms)", ylabel="frames", title="output frame spacing")
    ax_gap.legend()
    if latency.size:
        ax_lat.hist(latency, bins=60, color="tab:green", alpha=0.8, label="input → output frame")
    if ttfa.size:
        ax_lat.hist(ttfa, bins=20, color="tab:red", alpha=0.8, label="time to first audio")
    ax_lat.set(xlabel="latency (ms)", ylabel="count", title="latency distribution")
    ax_lat.legend()
    seconds = np.arange(len(series["sent"]))
    ax_time.plot(seconds, series["sent"], label="frames sent", drawstyle="steps-post")
    ax_time.plot(seconds, series["received"], label="frames received", drawstyle="steps-post")
    ax_time.bar(seconds, series["late"], color="tab:red", alpha=0.6, label="late frames", align="edge")
    ax_time.set(xlabel="seconds since the shared start", ylabel="frames per second", title="timeline")
    ax_time.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
