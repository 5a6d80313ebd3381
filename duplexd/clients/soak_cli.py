"""`duplexd loadtest --churn`: the soak mode's flags, progress line, printed report and judgement."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from tqdm import tqdm

from .audio import InputError
from .cli_args import connect_options
from .loadtest import LoadTestConfig
from .report import COLUMNS, Thresholds, row, write_json
from .soak import SoakConfig, SoakProgress, memory_line, minute_table, run_soak
from .stats import StatsConfig


def length_range(text: str) -> tuple[float, float]:
    """`2-30` (seconds, uniform) or `10` (always 10 s)."""
    try:
        lo, _, hi = text.partition("-")
        bounds = (float(lo), float(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--session-length takes MIN-MAX seconds like 2-30 (got {text!r})") from None
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError("--session-length needs 0 < MIN <= MAX")
    return bounds


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("churn (soak) mode: sessions of random length come and go for --duration seconds")
    g.add_argument("--churn", action="store_true", help="run the soak mode instead of one fixed set of sessions")
    g.add_argument(
        "--session-length",
        type=length_range,
        default=(2.0, 30.0),
        metavar="MIN-MAX",
        help="seconds of input per session, uniform in this range (default: 2-30)",
    )
    g.add_argument(
        "--occupancy",
        type=float,
        default=0.75,
        help="sessions kept open, as a fraction of the server's slots (default: %(default)s)",
    )
    g.add_argument("--target-sessions", type=int, help="sessions kept open (instead of --occupancy)")
    g.add_argument(
        "--memory-interval",
        type=float,
        default=10.0,
        help="seconds between polls of the server's /metrics (default: %(default)s)",
    )
    g.add_argument(
        "--max-memory-growth",
        type=float,
        help="check: largest relative growth of the server's resident memory from the end of the "
        "first minute to the end, e.g. 0.05",
    )


def _progress(quiet: bool, duration: float):
    bar: list[tqdm] = []

    def update(p: SoakProgress) -> None:
        if quiet:
            return
        if not bar:
            bar.append(tqdm(total=round(duration), unit="s", desc="churn", file=sys.stderr, dynamic_ncols=True))
        bar[0].n = min(round(time.monotonic() - p.start), round(duration))
        bar[0].set_postfix_str(
            f"open {p.open} completed {p.completed} refused {p.refused} errors {p.errors}", refresh=False
        )
        bar[0].refresh()

    def close() -> None:
        if bar:
            bar[0].close()

    return update, close


def run(args: argparse.Namespace, stats: StatsConfig, limits: Thresholds) -> int:
    if args.target_sessions is not None and args.target_sessions < 1:
        print("duplexd loadtest: --target-sessions must be >= 1", file=sys.stderr)
        return 2
    base = LoadTestConfig(
        connect=connect_options(args), drain=args.drain, input=args.input, seed=args.seed or 0, stats=stats
    )
    config = SoakConfig(
        base,
        duration=args.duration,
        session_length=args.session_length,
        occupancy=args.occupancy,
        target=args.target_sessions,
        memory_interval=args.memory_interval,
    )
    update, close = _progress(args.quiet, args.duration)
    try:
        result = asyncio.run(run_soak(config, update))
    except (InputError, ValueError) as e:
        print(f"duplexd loadtest: {e}", file=sys.stderr)
        return 2
    finally:
        close()
    result.thresholds, result.max_memory_growth = limits, args.max_memory_growth
    o = result.overall
    capacity = f"of {result.capacity} slots" if result.capacity else "(capacity unknown)"
    print(
        f"churn: {args.duration:g} s, about {result.target} sessions open {capacity}, lengths "
        f"{config.session_length[0]:g}-{config.session_length[1]:g} s; sessions completed {o.ok}, "
        f"errors {o.errors}, refused (retried) {o.refused}"
    )
    print("  ".join(f"{c}={v}" for c, v in zip(COLUMNS[:-1], row(o)[:-1], strict=True)))
    print(minute_table(result.minutes()))
    print(memory_line(result.memory_summary()))
    for s in result.sessions:
        if s.trace.status != "ok":
            print(
                f"session {s.trace.index} (at {s.start_s:.0f} s): {s.trace.status}: {s.trace.error}"
                + (f" (close {s.trace.close_code})" if s.trace.close_code else "")
            )
    if o.client_slow:
        print(
            f"warning: client send lateness p99 {o.send_lateness_ms['p99']:.0f} ms: this client machine could "
            "not keep the pace; the figures say more about it than about the server",
            file=sys.stderr,
        )
    if args.json:
        write_json(args.json, result.to_dict())
        print(f"report: {args.json}", file=sys.stderr)
    broken = result.failures()
    for failure in broken:
        print(f"FAIL (churn): {failure}", file=sys.stderr)
    if (limits.any or args.max_memory_growth is not None) and not broken:
        print("PASS", file=sys.stderr)
    return 1 if broken else 0
