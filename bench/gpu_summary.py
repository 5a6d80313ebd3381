"""Collect a bench/gpu_suite.sh run folder into summary.md, and print the short version (the run's last words).

Usage: python bench/gpu_summary.py DIR

Reads what the stages left in DIR (stages.tsv, gpu_kernels.log's JSON line, gpu_capacity.json/.md,
gpu_profile.json/.md, prompt_prefill.log's last JSON line, loadtest.json, serve_basis.txt, kv_dtype.json,
weights_dtype.json, stt/gpu_capacity.json/.md, tts.json/.md, and a second call's int8/ and paged/ capacity
sweeps) and tolerates any of them missing: a stage that failed or timed out says so instead of its table (the prompt
prefill bench prints a partial line after batch 1, so a run cut short still shows that).
The last line printed is one JSON object, `{"bench": "gpu_suite", ...}`: each stage's status and the headline
figures. Standard library only, so it runs whatever else went wrong.
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


def _step_x_floor(run: dict) -> float | None:
    """A profiled run's step (captured where there is a graph, else eager) over its floor."""
    step = run.get("graph_ms") or run.get("eager_ms")
    return round(step / run["floor_ms"], 2) if step and run.get("floor_ms") else None


def profile_table(run: Path) -> tuple[str, str, dict | None]:
    """(markdown, one-line verdict, report) from bench/gpu_profile.py: each part of a step against its floor. Its
    JSON file is rewritten after every batch, so a stage cut short still shows the batches it finished."""
    data = _load(run / "gpu_profile.json") or _json_line(run / "gpu_profile.log")
    if data is None:
        return "no result (see gpu_profile.log)", "profile: no result", None
    if data.get("skipped"):
        return f"skipped: {data['skipped']}", f"profile: skipped ({data['skipped']})", data
    md = run / "gpu_profile.md"
    words = []
    for r in data.get("runs", []):
        if r.get("status") != "ok":
            words.append(f"batch {r['batch']} {r['kv_dtype']}: {r['status']}")
            continue
        what = "graph" if r.get("graph_ms") else "eager"
        largest = max(r["parts"], key=lambda key: r["parts"][key]["ms"] or 0)
        share = r["parts"][largest].get("share")
        words.append(
            f"batch {r['batch']} {r['kv_dtype']}: {what} step {r[f'{what}_ms']:.2f} ms = {_step_x_floor(r)}x its "
            f"floor {r['floor_ms']:.2f} ms, most in {largest}" + ("" if share is None else f" ({100 * share:.0f} %)")
        )
    unfinished = " (unfinished)" if data.get("status") == "incomplete" else ""
    table = md.read_text().strip() if md.is_file() else "no table (see gpu_profile.log)"
    return table, f"profile{unfinished}: " + ("; ".join(words) or "nothing measured"), data


def capacity_verdict(data: dict | None, what: str = "capacity", log: str = "gpu_capacity.log") -> str:
    if data is None:
        return f"{what}: no result (see {log})"
    if data.get("status") == "failed":
        f = data["failed"] or {}
        return f"{what}: FAILED at batch {f.get('batch')}: {f.get('error')} (no capacity claimed)"
    if data.get("status") != "ok":
        return f"{what}: sweep unfinished ({data.get('status')}); see the table"
    return (
        f"{what}: {data['realtime_sessions']} sessions with p99 step <= {data['budget_ms']:g} ms "
        f"(KV pool admits {data['kv_sessions']}); batch-1 step p50 {data['batch1_p50_ms']} ms, "
        f"p99 {data['batch1_p99_ms']} ms"
    )


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def _cell(data: dict, key: str) -> str:
    value = data.get(key)
    return "–" if value is None else str(value)


def prefill_table(data: dict | None) -> tuple[str, str]:
    """(markdown, one-line verdict) from bench/prompt_prefill.py's last JSON line: time to the first live output of
    a persona session (200-frame prompt), prefilled against one frame per step; goal <= 150 ms on a GPU."""
    if data is None:
        return "no result (see prompt_prefill.log)", "prompt prefill: no result"
    if data.get("skipped"):
        return f"skipped: {data['skipped']}", f"prompt prefill: skipped ({data['skipped']})"
    live = data.get("live_sessions", 0)
    key = f"live{live}"
    lines = [
        f"{data.get('preset')} ({data.get('model')}), {data.get('dtype')} on {data.get('device')}, "
        f"{data.get('prompt_frames')}-frame prompt, median of {data.get('repeats')}"
        + (" (PARTIAL: the live part did not finish)" if data.get("partial") else ""),
        "",
        "| sessions | TTFO prefill ms | TTFO frame-by-frame ms | ratio | prompt forwards (prefill / frame-by-frame) |",
        "|---|---:|---:|---:|---:|",
        f"| 1 | {_cell(data, 'ttfo_prefill_ms')} | {_cell(data, 'ttfo_frame_by_frame_ms')} | "
        f"{_cell(data, 'ratio_prefill')} | {_cell(data, 'prefill_forwards')} / "
        f"{_cell(data, 'frame_by_frame_forwards')} |",
    ]
    has_live = f"ttfo_prefill_{key}_ms" in data
    if has_live:
        lines.append(
            f"| {live} live + 1 | {_cell(data, f'ttfo_prefill_{key}_ms')} | "
            f"{_cell(data, f'ttfo_frame_by_frame_{key}_ms')} | {_cell(data, f'ratio_prefill_{key}')} | "
            f"{_cell(data, f'forwards_{key}_prefill')} / {_cell(data, f'forwards_{key}_frame_by_frame')} |"
        )
        lines += [
            "",
            f"Live sessions' late frames (delay > 80 ms) while the prompt ran / in a baseline window with no prompt "
            f"(prefill engine: {_cell(data, 'prefill_rows')} prompt frames per step beside live sessions):",
            "",
            "| engine | late | outputs | delay p99 ms | delay max ms | baseline late | baseline outputs |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for mode in ("prefill", "frame_by_frame"):
            lines.append(
                f"| {mode.replace('_', '-')} | {_cell(data, f'late_frames_{key}_{mode}')} | "
                f"{_cell(data, f'outputs_{key}_{mode}')} | {_cell(data, f'delay_p99_{key}_{mode}_ms')} | "
                f"{_cell(data, f'delay_max_{key}_{mode}_ms')} | {_cell(data, f'baseline_late_frames_{key}_{mode}')} | "
                f"{_cell(data, f'baseline_outputs_{key}_{mode}')} |"
            )
    ttfo = data.get("ttfo_prefill_ms")
    goal = data.get("ttfo_goal_ms")
    verdict = f"prompt prefill: TTFO {_cell(data, 'ttfo_prefill_ms')} ms at batch 1 (frame by frame " + (
        f"{_cell(data, 'ttfo_frame_by_frame_ms')} ms, ratio {_cell(data, 'ratio_prefill')})"
    )
    if goal is not None and ttfo is not None:
        verdict += f": {'meets' if ttfo <= goal else 'MISSES'} the goal (<= {goal:g} ms)"
    if has_live:
        verdict += (
            f"; beside {live} live sessions TTFO {_cell(data, f'ttfo_prefill_{key}_ms')} ms, "
            f"{_cell(data, f'late_frames_{key}_prefill')} late frames (baseline "
            f"{_cell(data, f'baseline_late_frames_{key}_prefill')})"
        )
    elif data.get("partial"):
        verdict += "; the live part did not finish"
    return "\n".join(lines), verdict


def kv_table(data: dict | None) -> tuple[str, str]:
    """(markdown, one-line verdict) from bench/kv_dtype.py's kv_dtype.json: capacity, the store check, logit
    agreement and step times, 8-bit KV against the weights' dtype."""
    if data is None:
        return "no result (see kv_dtype.log)", "kv dtype: no result"
    if data.get("skipped"):
        return f"skipped: {data['skipped']}", f"kv dtype: skipped ({data['skipped']})"
    kv = data.get("kv_dtype")
    lines = [f"{data.get('preset')}, {data.get('dtype')} weights on {data.get('device')}, KV bf16 against {kv}", ""]
    words: list[str] = []
    cap = data.get("capacity") or {}
    if cap:
        lines += ["| KV | full windows that fit | GiB per window |", "|---|---:|---:|"]
        lines += [f"| {name} | {c['sessions']} | {c['kv_window_gib']} |" for name, c in cap.items()]
        words.append(
            f"{_cell(cap.get(kv, {}), 'sessions')} sessions fit (bf16 {_cell(cap.get('bf16', {}), 'sessions')})"
        )
    for name, w in (data.get("write") or {}).items():
        lines.append(
            f"\nstore {name}: {w['codes_differing']} of {w['codes']} codes, {w['scales_differing']} scales differ"
        )
        words.append(f"store {name} {'exact' if not w['codes_differing'] + w['scales_differing'] else 'DIFFERS'}")
    agree = data.get("agreement")
    if agree:
        lines.append(
            f"\nteacher-forced over {agree['frames']} frames x {agree['rows']} rows (q, k x{data.get('sharpen')}): "
            f"KL mean {agree['kl_mean']:.2e}, p99 {agree['kl_p99']:.2e}; top-1 {100 * agree['top1_agreement']:.2f} %; "
            f"logits rel. err. mean {agree['logit_rel_err_mean']:.2e}; attention rel. err. mean "
            f"{agree['attention_rel_err_mean']:.2e}"
        )
        words.append(f"KL {agree['kl_mean']:.1e}, top-1 {100 * agree['top1_agreement']:.2f} %")
    steps = data.get("steps") or {}
    if steps:
        batches = sorted({int(b) for s in steps.values() for b in s if b != "fit"})
        lines += ["", "| KV | " + " | ".join(f"B={b} p50 / p99 ms" for b in batches) + " |"]
        lines.append("|---|" + "---:|" * len(batches))
        for name, s in steps.items():
            cells = [
                f"{s[str(b)]['p50_ms']} / {s[str(b)]['p99_ms']}" if "p50_ms" in s.get(str(b), {}) else "does not fit"
                for b in batches
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines), f"kv dtype {kv}: " + (", ".join(words) or "nothing measured")


def weights_table(data: dict | None) -> tuple[str, str]:
    """(markdown, one-line verdict) from bench/weights_dtype.py's weights_dtype.json: the W8A16 kernel's check, step
    times with int8 against float weights, and the logit agreement of int8 weights (text head int8 and float)."""
    if data is None:
        return "no result (see weights_dtype.log)", "weights int8: no result"
    if data.get("skipped") and not isinstance(data["skipped"], dict):
        return f"skipped: {data['skipped']}", f"weights int8: skipped ({data['skipped']})"
    lines = [f"{data.get('preset')}, {data.get('dtype')} against int8 weights on {data.get('device')}", ""]
    words: list[str] = []
    for stage, why in (data.get("skipped") or {}).items():
        lines.append(f"{stage}: skipped ({why})")
    kernel = data.get("kernel")
    if kernel:
        lines.append(f"W8A16 kernel against the torch reference: {'ok' if kernel.get('ok') else 'FAILED'}")
        words.append(f"kernel {'ok' if kernel.get('ok') else 'FAILED'}")
    steps = data.get("steps") or {}
    ratio = steps.get("ratio") or {}
    if ratio:
        batches = sorted(ratio, key=int)
        lines += ["", "| weights | " + " | ".join(f"B={b} p50 / p99 ms" for b in batches) + " |"]
        lines.append("|---|" + "---:|" * len(batches))
        for name in ("bf16", "int8"):
            row = steps.get(name) or {}
            cells = [
                f"{row[b]['p50_ms']} / {row[b]['p99_ms']}" if "p50_ms" in row.get(b, {}) else "does not fit"
                for b in batches
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("| int8 / bf16 | " + " | ".join(f"{ratio[b]['p50']} / {ratio[b]['p99']}" for b in batches) + " |")
        b1 = ratio.get("1", {}).get("p50")
        goal = steps.get("goal_ratio_b1")
        words.append(f"step ratio at batch 1 {b1} (goal <= {goal}: {'met' if steps.get('met') else 'NOT met'})")
    agree = data.get("agreement") or {}
    for head in ("text_head_int8", "text_head_float"):
        if head in agree:
            text = agree[head]["text"]
            lines.append(
                f"\n{head.replace('_', ' ')}: text KL mean {text['kl_mean']:.2e}, top-1 "
                f"{100 * text['top1_agreement']:.2f} % over {agree['frames']} frames x {agree['rows']} rows"
            )
    if "text_head_int8" in agree:
        words.append(f"text top-1 {100 * agree['text_head_int8']['text']['top1_agreement']:.2f} %")
    return "\n".join(lines), "weights int8: " + (", ".join(words) or "nothing measured")


def headline(steps: list[list[str]], reports: dict[str, dict | None]) -> dict:
    """The run in one JSON object: each stage's status and the figures a reader looks for first."""
    capacity, stt, profiled = reports["capacity"] or {}, reports["stt"] or {}, reports.get("profile") or {}
    prefill, load = reports["prefill"] or {}, (reports["load"] or {}).get("overall") or {}
    kv, weights = reports["kv"] or {}, reports["weights"] or {}
    return {
        "bench": "gpu_suite",
        "device": capacity.get("device") or kv.get("device") or weights.get("device"),
        "stages": {s[0]: s[3] for s in steps},
        "realtime_sessions": capacity.get("realtime_sessions"),
        "stt_streams": stt.get("realtime_sessions"),
        "prefill_ttfo_ms": prefill.get("ttfo_prefill_ms"),
        "loadtest_sessions": load.get("sessions"),
        "kv_int8_top1": (kv.get("agreement") or {}).get("top1_agreement"),
        "weights_int8_step_ratio_b1": ((weights.get("steps") or {}).get("ratio") or {}).get("1", {}).get("p50"),
        "tts_streams": (reports.get("tts") or {}).get("realtime_streams"),
        "tts_ttfa_ms_p50_b1": (reports.get("tts") or {}).get("ttfa_ms_p50_b1"),
        "step_x_floor": {
            f"{r['batch']}:{r['kv_dtype']}": _step_x_floor(r) for r in profiled.get("runs", []) if r["status"] == "ok"
        },
    }


def tts_verdict(data: dict | None) -> str:
    if data is None:
        return "tts streams: no result (see gpu_tts.log)"
    first, differing = data.get("ttfa_ms_p50_b1"), data.get("bucketed_frames_differing")
    return (
        f"{data.get('preset')} streams: {data.get('realtime_streams')} with p99 step <= 80 ms; first audio p50 at "
        f"batch 1 {first} ms (goal: >= 128 streams, <= 150 ms); graphs against eager: {differing} frames differ"
    )


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
    profiled, profile_line, profile_data = profile_table(run)
    capacity = _load(run / "gpu_capacity.json")
    capacity_md = (run / "gpu_capacity.md").read_text() if (run / "gpu_capacity.md").is_file() else "no result"
    prefill, prefill_line = prefill_table(_json_line(run / "prompt_prefill.log"))  # printed partial lines too
    load_data, prefill_data = _load(run / "loadtest.json"), _json_line(run / "prompt_prefill.log")
    load, load_line = loadtest_table(load_data)
    kv_data, weights_data = _load(run / "kv_dtype.json"), _load(run / "weights_dtype.json")
    kv, kv_line = kv_table(kv_data)
    weights, weights_line = weights_table(weights_data)
    stt = _load(run / "stt" / "gpu_capacity.json")
    stt_md_path = run / "stt" / "gpu_capacity.md"
    stt_md = stt_md_path.read_text() if stt_md_path.is_file() else "no result"
    second = {name: _load(run / name / "gpu_capacity.json") for name in ("int8", "paged")}  # a second call's
    second_md = {
        name: (run / name / "gpu_capacity.md").read_text() if (run / name / "gpu_capacity.md").is_file() else "not run"
        for name in second
    }
    tts = _load(run / "tts.json")
    tts_md = (run / "tts.md").read_text() if (run / "tts.md").is_file() else "no result"
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
                "## Where a step goes (bench/gpu_profile.py: each part against the least its bytes take)",
                profiled,
                "## Persona prompt prefill (bench/prompt_prefill.py)",
                prefill,
                f"## Load test against `duplexd serve --random-weights` ({basis or 'not run'})",
                load,
                "## 8-bit KV cache (bench/kv_dtype.py)",
                kv,
                "## 8-bit weights (bench/weights_dtype.py)",
                weights,
                "## Speech-to-text streams (bench/gpu_capacity.py, Kyutai STT 1B; goal >= 600 with p99 step <= 80 ms)",
                stt_md.strip(),
                "## Text-to-speech streams (bench/gpu_tts.py, Kyutai TTS 1.6B; goal >= 128, first audio <= 150 ms)",
                tts_md.strip(),
                "## Capacity with int8 KV, up to 160 sessions (a second call's `capacity_int8`)",
                second_md["int8"].strip(),
                "## Capacity with the paged decode attention (a second call's `capacity_paged`; A/B against split)",
                second_md["paged"].strip(),
            ]
        )
        + "\n"
    )
    (run / "summary.md").write_text(doc)
    print(f"summary: {run / 'summary.md'}")
    print(stage_table)
    stt_line = capacity_verdict(stt, f"{(stt or {}).get('preset', 'stt-1b')} streams", "stt_capacity.log")
    lines = (kernels_line, capacity_verdict(capacity), profile_line, prefill_line, load_line, kv_line, weights_line)
    for line in (*lines, stt_line, tts_verdict(tts)):
        print(line)
    for name, what in (("int8", "capacity, int8 KV"), ("paged", "capacity, paged attention")):
        if second[name] is not None or (run / f"capacity_{name}.log").is_file():
            print(capacity_verdict(second[name], what, f"capacity_{name}.log"))
    reports = {"capacity": capacity, "stt": stt, "prefill": prefill_data, "load": load_data, "tts": tts}
    reports["profile"] = profile_data
    last = headline(steps, {**reports, "kv": kv_data, "weights": weights_data})
    last["int8_kv_realtime_sessions"] = (second["int8"] or {}).get("realtime_sessions")
    last["paged_attention_realtime_sessions"] = (second["paged"] or {}).get("realtime_sessions")
    print(json.dumps(last))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
