"""`duplexd loadtest`: run the load test (or a sweep of session counts), print and save its report, judge it."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from tqdm import tqdm

from . import plot, soak_cli
from .audio import InputError
from .cli_args import add_connection_args, connect_options
from .loadtest import LoadTestConfig, LoadTestResult, Progress, run_load_test
from .report import COLUMNS, Thresholds, capacity, failures, markdown_table, row, write_json
from .stats import StatsConfig

DEFAULT_PLOT = "loadtest.png"
# The checks: Thresholds field, flag, type, help. A broken one exits with status 1.
CHECKS = (
    ("max_late_frac", "--max-late-frac", float, "largest fraction of late or missing frames, e.g. 0.01"),
    ("max_ttfa_ms", "--max-ttfa-ms", float, "largest time-to-first-audio p99"),
    ("max_inter_arrival_p99_ms", "--max-gap-p99-ms", float, "largest inter-arrival p99"),
    ("max_refused", "--max-refused", int, "most refused sessions"),
    ("max_errors", "--max-errors", int, "most sessions ending in an error"),
    ("max_underruns", "--max-underruns", int, "most playback underruns, all sessions together"),
    ("max_deficit", "--max-deficit", int, "most frames sent but not answered, all sessions together"),
)


def session_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sessions takes numbers like 1,2,4,8 (got {text!r})") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("--sessions must be >= 1")
    return counts


def thresholds(args: argparse.Namespace) -> Thresholds:
    return Thresholds(**{name: getattr(args, name) for name, *_ in CHECKS})


def plot_path(requested: str | None) -> str | None:
    """Where the PNG goes ('' or None: nowhere). An asked-for plot needs matplotlib (`PlotUnavailable` at start,
    before any connection); the default one is made only when matplotlib is there."""
    if requested is None:
        return DEFAULT_PLOT if plot.available() else None
    if requested:
        plot.require()
    return requested or None


def _progress_line(quiet: bool):
    bars: dict[int, tqdm] = {}

    def update(p: Progress) -> None:
        if quiet:
            return
        bar = bars.get(id(p))
        if bar is not None and bar.disable:
            return
        if bar is None:
            bar = bars[id(p)] = tqdm(
                total=p.frames_total,
                unit="frame",
                desc=f"{p.sessions} sessions",
                file=sys.stderr,
                leave=True,
                dynamic_ncols=True,
            )
        bar.n = p.sent
        bar.set_postfix_str(
            f"admitted {p.admitted} refused {p.refused} errors {p.errors} sent {p.sent} received {p.received}",
            refresh=False,
        )
        bar.refresh()
        if p.sent >= p.frames_total or (p.started and p.admitted == 0):
            bar.close()
            bar.disable = True

    return update


def _plot_path(base: str, n: int, many: bool) -> str:
    if not many:
        return base
    path = Path(base)
    return str(path.with_name(f"{path.stem}-{n}{path.suffix or '.png'}"))


def run(args: argparse.Namespace) -> int:
    if args.churn:
        return soak_cli.run(
            args,
            StatsConfig(late_threshold=args.late_ms / 1000, jitter_buffer=args.jitter_buffer_ms / 1000),
            thresholds(args),
        )
    try:
        args.plot = plot_path(args.plot)
    except plot.PlotUnavailable as e:
        print(f"duplexd loadtest: --plot {args.plot}: {e}", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except InputError as e:
        print(f"duplexd loadtest: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    stats = StatsConfig(late_threshold=args.late_ms / 1000, jitter_buffer=args.jitter_buffer_ms / 1000)
    base = LoadTestConfig(
        connect=connect_options(args),
        duration=args.duration,
        ramp=args.ramp,
        drain=args.drain,
        input=args.input,
        seed=args.seed or 0,
        stats=stats,
    )
    limits = thresholds(args)
    results: list[LoadTestResult] = []
    progress = _progress_line(args.quiet)
    many = len(args.sessions) > 1
    for n in args.sessions:
        config = LoadTestConfig(**{**base.__dict__, "sessions": n})
        result = asyncio.run(run_load_test(config, progress))
        results.append(result)
        o = result.overall
        if not many:
            _print_single(result)
        if args.plot:
            plot.plot(
                result.traces,
                _plot_path(args.plot, n, many),
                f"duplexd loadtest: {n} sessions, {args.protocol}, {args.duration:g} s ({result.date})",
                stats,
            )
        if o.client_slow:
            print(
                f"warning: client send lateness p99 {o.send_lateness_ms['p99']:.0f} ms > "
                f"{stats.lateness_warning * 1000:.0f} ms: this client "
                "machine could not keep the pace; the figures say more about it than about the server",
                file=sys.stderr,
            )
    overalls = [r.overall for r in results]
    if many:
        print(markdown_table(overalls))
        best = capacity(overalls)
        print(f"largest session count with late+missing < 1% and TTFA p99 < 300 ms: {best if best else 'none'}")
    data = {"runs": [r.to_dict() for r in results]} if many else results[0].to_dict()
    if args.json:
        write_json(args.json, data)
        print(f"report: {args.json}" + (f", plot: {args.plot}" if args.plot else ""), file=sys.stderr)
    broken = [(o.sessions, f) for o in overalls for f in failures(o, limits)]
    for n, failure in broken:
        print(f"FAIL ({n} sessions): {failure}", file=sys.stderr)
    if limits.any and not broken:
        print("PASS", file=sys.stderr)
    return 1 if broken else 0


def _print_single(result: LoadTestResult) -> None:
    o = result.overall
    print("  ".join(f"{c}={v}" for c, v in zip(COLUMNS, row(o), strict=True)))
    print(
        f"frames: expected {o.frames_expected}, sent {o.frames_sent}, received {o.frames_received}, "
        f"missing {o.frames_missing}, late {o.late_frames}; frame latency p50 {o.frame_latency_ms['p50'] or 0:.0f} "
        f"ms, p99 {o.frame_latency_ms['p99'] or 0:.0f} ms; text pieces {o.text_pieces}"
    )
    for s in result.traces:
        if s.status != "ok":
            print(f"session {s.index}: {s.status}: {s.error}" + (f" (close {s.close_code})" if s.close_code else ""))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sessions",
        type=session_counts,
        default=[1],
        help="concurrent sessions, or a sweep like 1,2,4,8,16 (one run each, then a table)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=10.0,
        help="seconds of input per session (with --churn: seconds the soak runs)",
    )
    p.add_argument("--ramp", type=float, default=0.0, help="spread the connections over this many seconds")
    p.add_argument("--drain", type=float, default=1.0, help="seconds to listen after the last input frame")
    p.add_argument("--input", help="input audio (WAV or any soundfile format), looped; default: generated speech")
    p.add_argument("--json", default="loadtest.json", help="report file (default: %(default)s; '' for none)")
    p.add_argument(
        "--plot",
        help=f"PNG plot (default: {DEFAULT_PLOT} when matplotlib, the {plot.EXTRA} extra, is "
        "installed; a sweep writes NAME-N.png; '' for none)",
    )
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    p.add_argument("--late-ms", type=float, default=80.0, help="a frame this far behind its deadline is late")
    p.add_argument("--jitter-buffer-ms", type=float, default=100.0, help="simulated player buffer (underruns)")
    c = p.add_argument_group("checks (a failed one exits with status 1)")
    for name, flag, kind, text in CHECKS:
        c.add_argument(flag, dest=name, type=kind, help=text)
    soak_cli.add_args(p)
    add_connection_args(p)
