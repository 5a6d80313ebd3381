"""Turning load-test results into words: pass/fail checks, the sweep table, the JSON file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .stats import Overall

# The capacity target of docs/BENCHMARKS.md: a session count "holds" when under 1% of frames are late or
# missing, the first audio comes within 300 ms (p99), and nobody is refused or dropped.
TARGET_LATE_FRAC = 0.01
TARGET_TTFA_P99_MS = 300.0


@dataclass(frozen=True)
class Thresholds:
    """Limits that turn a load test into a check (None: not checked)."""

    max_late_frac: float | None = None
    max_ttfa_ms: float | None = None  # p99 of the sessions' first-audio latency
    max_inter_arrival_p99_ms: float | None = None
    max_refused: int | None = None
    max_errors: int | None = None
    max_underruns: int | None = None
    max_deficit: int | None = None  # total frames sent - received

    @property
    def any(self) -> bool:
        return any(v is not None for v in self.__dict__.values())


def failures(o: Overall, t: Thresholds) -> list[str]:
    """What broke the thresholds, in words (empty: passed)."""
    out = []

    def over(name: str, value: float | None, limit: float | None, fmt: str = "{:g}") -> None:
        if limit is not None and (value is None or value > limit):
            shown = "none" if value is None else fmt.format(value)
            out.append(f"{name} {shown} > {fmt.format(limit)}")

    over("late fraction", o.late_frac, t.max_late_frac, "{:.4f}")
    over("time to first audio p99 (ms)", o.ttfa_ms["p99"], t.max_ttfa_ms, "{:.1f}")
    over("inter-arrival p99 (ms)", o.inter_arrival_ms["p99"], t.max_inter_arrival_p99_ms, "{:.1f}")
    over("refused sessions", o.refused, t.max_refused)
    over("sessions with errors", o.errors, t.max_errors)
    over("underruns", o.underruns, t.max_underruns)
    over("frame deficit", o.frame_deficit, t.max_deficit)
    return out


def meets_target(o: Overall) -> bool:
    ttfa = o.ttfa_ms["p99"]
    return (
        o.refused == 0
        and o.errors == 0
        and o.late_frac < TARGET_LATE_FRAC
        and ttfa is not None
        and ttfa < TARGET_TTFA_P99_MS
    )


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


COLUMNS = [
    "sessions",
    "ok",
    "refused",
    "errors",
    "TTFA p50",
    "TTFA p99",
    "gap p50",
    "gap p99",
    "gap max",
    "late+missing %",
    "underruns",
    "deficit",
    "send late p99",
    "target",
]


def row(o: Overall) -> list[str]:
    return [
        str(o.sessions),
        str(o.ok),
        str(o.refused),
        str(o.errors),
        _ms(o.ttfa_ms["p50"]),
        _ms(o.ttfa_ms["p99"]),
        _ms(o.inter_arrival_ms["p50"]),
        _ms(o.inter_arrival_ms["p99"]),
        _ms(o.inter_arrival_ms["max"]),
        f"{100 * o.late_frac:.2f}",
        str(o.underruns),
        str(o.frame_deficit),
        _ms(o.send_lateness_ms["p99"]),
        "yes" if meets_target(o) else "no",
    ]


def markdown_table(results: list[Overall]) -> str:
    """One row per session count (times in ms), ready for docs/BENCHMARKS.md."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(o)) + " |" for o in results]
    return "\n".join(lines)


def capacity(results: list[Overall]) -> int | None:
    """The largest session count that meets the target (None when none does)."""
    good = [o.sessions for o in results if meets_target(o)]
    return max(good) if good else None


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
