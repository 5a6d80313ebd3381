"""Collect a bench/gpu_suite.sh run folder into summary.md, and print the short version (the run's last words).

Usage: python bench/gpu_summary.py DIR

Reads what the stages left in DIR (stages.tsv, gpu_kernels.log's JSON line, gpu_capacity.json/.md, loadtest.json,
serve_basis.txt) and tolerates any of them missing: a stage that failed or timed out says so instead of its table.
Standard library only, so it runs whatever else went wrong.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _json_line(path: Path) -> dict | None:
    """The last line of a log that is a JSON object (what the benchmarks print last)."""
    if not path.is_file():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stages(run: Path) -> list[list[str]]:
    path = run / "stages.tsv"
    return [line.split("\t") for line in path.read_text().splitlines() if line] if path.is_file() else []


def kernels_table(data: dict | None) -> tuple[str, str]:
    """(markdown table, one-line verdict) from gpu_kernels.py's JSON line."""
    if data is None:
        return "no result (see gpu_kernels.log)", "kernels: no result"
    if data.get("skipped"):
        return f"skipped: {data['skipped']}", f"kernels: skipped ({data['skipped']})"
    rows = data.get("rows", [])
    lines = [
        f"{data.get('device')}, copy bandwidth {data.get('copy_gbps')} GB/s",
        "",
        "| kernel | shape | check | triton us | eager us | speedup | GB/s | of copy |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("ok"):
            lines.append(
                f"| {r['kernel']} | {r['shape']} | {r['check']} | {r['triton_us']} | {r['eager_us']} | "
                f"{r['speedup']} | {r['gbps']} | {r['of_copy']} |"
            )
        else:
            lines.append(f"| {r['kernel']} | {r['shape']} | FAILED {r['check']} | | | | | |")
    failed = sum(not r.get("ok") for r in rows)
    slower = sum(1 for r in rows if r.get("ok") and r["speedup"] < 1)
    return "\n".join(lines), f"kernels: {len(rows)} cases, {failed} failed checks, {slower} slower than eager"


def capacity_verdict(data: dict | None) -> str:
    if data is None:
        return "capacity: no result (see gpu_capacity.log)"
    if data.get("status") == "failed":
        f = data["failed"] or {}
        return f"capacity: FAILED at batch {f.get('batch')}: {f.get('error')} (no capacity claimed)"
    if data.get("status") != "ok":
        return f"capacity: sweep unfinished ({data.get('status')}); see the table"
    return (
        f"capacity: {data['realtime_sessions']} sessions with p99 step <= {data['budget_ms']:g} ms "
        f"(KV pool admits {data['kv_sessions']}); batch-1 step p50 {data['batch1_p50_ms']} ms, "
        f"p99 {data['batch1_p99_ms']} ms"
    )


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def loadtest_table(data: dict | None) -> tuple[str, str]:
    if data is None:
        return "no result (see serve.log, loadtest.log)", "loadtest: no result"
    o = data["overall"]
    head = [
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
        "latency p50",
        "latency p99",
        "send late p99",
    ]
    cells = [
        o["sessions"],
        o["ok"],
        o["refused"],
        o["errors"],
        _ms(o["ttfa_ms"]["p50"]),
        _ms(o["ttfa_ms"]["p99"]),
        _ms(o["inter_arrival_ms"]["p50"]),
        _ms(o["inter_arrival_ms"]["p99"]),
        _ms(o["inter_arrival_ms"]["max"]),
        f"{100 * o['late_frac']:.2f}",
        o["underruns"],
        _ms(o["frame_latency_ms"]["p50"]),
        _ms(o["frame_latency_ms"]["p99"]),
        _ms(o["send_lateness_ms"]["p99"]),
    ]
    table = "\n".join(
        ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head), "| " + " | ".join(map(str, cells)) + " |"]
    )
    meets = (
        o["refused"] == 0
        and o["errors"] == 0
        and o["late_frac"] < 0.01
        and o["ttfa_ms"]["p99"] is not None
        and o["ttfa_ms"]["p99"] < 300
    )
    verdict = (
        f"loadtest: {o['sessions']} sessions, {data['config']['duration']:g} s: late+missing "
        f"{100 * o['late_frac']:.2f} %, TTFA p99 {_ms(o['ttfa_ms']['p99'])} ms, gap p99 "
        f"{_ms(o['inter_arrival_ms']['p99'])} ms, refused {o['refused']}, errors {o['errors']}: "
        f"{'meets' if meets else 'MISSES'} the target (< 1 %, TTFA p99 < 300 ms)"
    )
    return table, verdict


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    run = Path(argv[0])
    steps = stages(run)
    kernels, kernels_line = kernels_table(_json_line(run / "gpu_kernels.log"))
    capacity = _load(run / "gpu_capacity.json")
    capacity_md = (run / "gpu_capacity.md").read_text() if (run / "gpu_capacity.md").is_file() else "no result"
    load, load_line = loadtest_table(_load(run / "loadtest.json"))
    basis = (run / "serve_basis.txt").read_text().strip() if (run / "serve_basis.txt").is_file() else ""
    machine = (run / "machine.txt").read_text().strip() if (run / "machine.txt").is_file() else ""
    stage_table = "\n".join(
        [
            "| stage | status | rc | seconds |",
            "|---|---|---:|---:|",
            *(f"| {s[0]} | {s[3]} | {s[1]} | {s[2]} |" for s in steps),
        ]
    )
    doc = (
        "\n\n".join(
            [
                "# GPU suite",
                f"```\n{machine}\n```",
                "## Stages",
                stage_table,
                "## Triton kernels (bench/gpu_kernels.py)",
                kernels,
                "## Capacity (bench/gpu_capacity.py)",
                capacity_md.strip(),
                f"## Load test against `duplexd serve --random-weights` ({basis or 'not run'})",
                load,
            ]
        )
        + "\n"
    )
    (run / "summary.md").write_text(doc)
    print(f"summary: {run / 'summary.md'}")
    print(stage_table)
    for line in (kernels_line, capacity_verdict(capacity), load_line):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
