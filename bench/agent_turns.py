"""Voice agents on the CPU: N agents in one duplexd against the same N agents as one process each.

Usage: python bench/agent_turns.py [--agents 4] [--turns 2] [--max-tokens 12] [--stagger 1.0]
duplexd: one `duplexd serve` with the demo STT (its text head leaning to words, as the tests' `words_model`), the
demo TTS and `--llm demo` (SmolLM2-135M on llama.cpp), N agent sessions at once over real sockets. Reference: the
model-copy-per-session design of the open cascades (Hugging Face's speech-to-speech `--num_pipelines`, one copy of
every model per conversation): N processes of the same server, each with its own models and LLM, one agent each.
Each agent starts `--stagger` seconds after the one before (0: every turn ends at the same moment, and the LLM,
one CPU thread, takes every prompt at once) and says `--turns` espeak-ng sentences at real-time pace, each ended by
a commit and a `response.create`
(turn detection off, so both sides end turns alike), and listens to the reply, the client playing from its first
audio frame. Per turn: commit → `response.created`, commit → first transcript word (the LLM's first word said by
the TTS), commit → first audio; late audio frames (frame i after first audio + i x 80 ms); after the last turn, a
`response.cancel` sent at the reply's first audio → its last audio frame (the cut). Per side: the memory of every
process (servers and LLM servers) at the end, as RSS (shared pages counted in every process: flatters the side with
more processes less than it costs) and PSS (shared pages split: what the side costs the machine), and their CPU
seconds over the run, per agent; and from each server's /metrics, where a reply's time goes (the mean of each
part: waiting for the turn's transcript, the LLM's first token, the first whole word, the TTS's first speech). The
last line (JSON) holds the medians, p99s, those means and the memory ratios. At N agents
the ratio cannot fall below 1/N: one duplexd holds what one per-agent process holds, plus each agent's share.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host_overhead import free_port  # noqa: E402
from bench.processes import descendants, ending_children, stop, wait_ready  # noqa: E402

RATE, FRAME, FRAME_S = 24000, 1920, 0.08
SENTENCES = ["What is the weather like today?", "Please tell me a short joke.", "How far away is the moon?"]


@dataclass
class Turns:
    detected_ms: list[float] = field(default_factory=list)  # commit → response.created
    first_word_ms: list[float] = field(default_factory=list)  # commit → first transcript delta
    first_audio_ms: list[float] = field(default_factory=list)  # commit → first audio delta
    cut_ms: list[float] = field(default_factory=list)  # response.cancel → last audio delta
    frames: int = 0
    late: int = 0
    failed: int = 0


def speech(text: str, tmp: Path) -> np.ndarray:
    """espeak-ng's sentence at 24 kHz, pcm16 bytes padded with 0.3 s of silence each side."""
    import soundfile as sf
    import soxr

    path = tmp / "s.wav"
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
    pcm, rate = sf.read(path, dtype="float32")
    pcm = soxr.resample(pcm, rate, RATE).astype(np.float32)
    pad = np.zeros(int(0.3 * RATE), np.float32)
    return np.concatenate([pad, pcm, pad])


def pcm16(pcm: np.ndarray) -> bytes:
    return (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()


async def agent(port: int, audio: list[np.ndarray], max_tokens: int, turns: Turns, cut: bool) -> None:
    async with connect(f"ws://127.0.0.1:{port}/v1/realtime", max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        session = {"type": "realtime", "max_output_tokens": max_tokens, "audio": {"input": {"turn_detection": None}}}
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        for k, pcm in enumerate([*audio, audio[0]] if cut else audio):  # one more turn, cut at its first audio
            for i in range(0, len(pcm), FRAME):  # the user speaks at real-time pace
                chunk = base64.b64encode(pcm16(pcm[i : i + FRAME])).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
                await asyncio.sleep(FRAME_S)
            committed = time.monotonic()
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))
            cutting = cut and k == len(audio)
            first_audio: float | None = None
            cancelled_at: float | None = None
            last_audio = frames = 0.0
            first_word = False
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), 120))
                now = time.monotonic()
                kind = event["type"]
                if kind == "response.created" and not cutting:
                    turns.detected_ms.append(1000 * (now - committed))
                elif kind == "response.output_audio_transcript.delta" and not cutting and not first_word:
                    first_word = True
                    turns.first_word_ms.append(1000 * (now - committed))
                elif kind == "response.output_audio.delta":
                    last_audio = now
                    if first_audio is None:
                        first_audio = now
                        if not cutting:
                            turns.first_audio_ms.append(1000 * (now - committed))
                        else:
                            cancelled_at = time.monotonic()
                            await ws.send(json.dumps({"type": "response.cancel"}))
                    elif now > first_audio + frames * FRAME_S + FRAME_S:  # a frame's grace: the client's jitter
                        turns.late += 1
                    frames += 1
                elif kind == "response.done":
                    turns.frames += int(frames)
                    if event["response"]["status"] == "failed":
                        turns.failed += 1
                    if cancelled_at is not None:
                        turns.cut_ms.append(max(0.0, 1000 * (last_audio - cancelled_at)))
                    break


@dataclass
class Usage:
    rss: int = 0  # bytes resident, each process's shared pages (libraries, the mmapped GGUF) counted in full
    pss: int = 0  # bytes resident, shared pages split among the processes sharing them: what the side costs
    cpu: float = 0.0  # seconds, user + system


def tree_usage(pid: int) -> Usage:
    """Memory now and CPU so far of `pid` and every process below it."""
    usage = Usage()
    ticks = 100.0  # os.sysconf("SC_CLK_TCK") on Linux
    for p in [pid, *descendants(pid)]:
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        kb = {line.split(":")[0]: int(line.split()[1]) for line in rollup.splitlines()[1:] if line.endswith("kB")}
        usage.rss += kb["Rss"] * 1024
        usage.pss += kb["Pss"] * 1024
        fields = stat[stat.rindex(")") + 2 :].split()
        usage.cpu += (int(fields[11]) + int(fields[12])) / ticks
    return usage


def start(port: int, sessions: int, stt_root: Path, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "duplexd", "serve", "--port", str(port), "--hf-repo", str(stt_root),
        "--tts", "demo-tts", "--tts-temperature", "0", "--tts-streams", str(sessions), "--llm", "demo",
        "--max-sessions", str(sessions), "--static", "none", "--log-level", "warning",
    ]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


async def run_side(ports: list[int], args: argparse.Namespace, audio: list[np.ndarray]) -> Turns:
    turns = Turns()

    async def after(delay: float, port: int) -> None:
        await asyncio.sleep(delay)
        await agent(port, audio, args.max_tokens, turns, cut=True)

    await asyncio.gather(*(after(i * args.stagger, ports[i % len(ports)]) for i in range(args.agents)))
    return turns


@dataclass
class Side:
    turns: Turns
    rss: int  # bytes, every process of the side at the end
    pss: int
    cpu: float  # seconds over the run
    stages: dict[str, float]  # the servers' mean ms of each part of a reply (`reply_stages`)


def side(args: argparse.Namespace, audio: list[np.ndarray], stt_root: Path, tmp: Path, processes: int) -> Side:
    """One side: `processes` servers (1: every agent in one; N: one each), their agents, their memory and CPU."""
    ports = [free_port() for _ in range(processes)]
    per = args.agents // processes
    procs = [start(port, per, stt_root, tmp / f"serve{i}.log") for i, port in enumerate(ports)]
    try:
        for proc, port, i in zip(procs, ports, range(processes), strict=True):
            wait_ready(proc, f"http://127.0.0.1:{port}", tmp / f"serve{i}.log")
        before = [tree_usage(p.pid).cpu for p in procs]
        turns = asyncio.run(run_side(ports, args, audio))
        after = [tree_usage(p.pid) for p in procs]  # every process alive: the shared pages split among them all
        stages = reply_stages(ports)
    finally:
        for proc in procs:
            stop([proc.pid, *descendants(proc.pid)], 10)
    cpu = sum(u.cpu for u in after) - sum(before)
    return Side(turns, sum(u.rss for u in after), sum(u.pss for u in after), cpu, stages)


def reply_stages(ports: list[int]) -> dict[str, float]:
    """The servers' own account of their replies (`duplexd_agent_reply_seconds`): each stage's mean, in ms."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name != "duplexd_agent_reply_seconds":
                continue
            for sample in family.samples:
                stage = sample.labels.get("stage", "")
                if sample.name.endswith("_sum"):
                    sums[stage] = sums.get(stage, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    counts[stage] = counts.get(stage, 0.0) + sample.value
    return {stage: 1000 * sums[stage] / counts[stage] for stage in sums if counts.get(stage)}


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=2, help="spoken turns per agent")
    parser.add_argument("--max-tokens", type=int, default=12, help="the longest reply")
    parser.add_argument(
        "--stagger",
        type=float,
        default=1.0,
        help="seconds between two agents' starts, as users who do not all stop talking at once (0: every turn ends "
        "at the same moment, the worst case)",
    )
    args = parser.parse_args()
    from tests.test_asr_e2e import words_model

    with ending_children(), tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        stt = words_model(tmp / "stt-model")
        audio = [speech(SENTENCES[k % len(SENTENCES)], tmp) for k in range(args.turns)]
        sides = {
            "duplexd": side(args, audio, stt.root, tmp, 1),
            "per_agent": side(args, audio, stt.root, tmp, args.agents),
        }
    out: dict[str, object] = {"bench": "agent_turns", "agents": args.agents, "turns": args.turns}
    out["stagger_s"] = args.stagger
    print(
        f"voice agents on {platform.machine()}: {args.agents} agents x {args.turns} turns, {args.stagger:g} s apart, "
        "demo STT/TTS/LLM, CPU"
    )
    print("side       detect p50 first word p50/p99 first audio p50/p99 late   cut ms  RSS/PSS MB/agent CPU s/agent")
    for name, result in sides.items():
        t = result.turns
        per_agent_mb = result.rss / args.agents / 2**20
        pss_mb = result.pss / args.agents / 2**20
        cpu = result.cpu / args.agents
        late = t.late / max(t.frames, 1)
        cut_ms = statistics.median(t.cut_ms) if t.cut_ms else float("nan")
        word = f"{pct(t.first_word_ms, 0.5):.0f}/{pct(t.first_word_ms, 0.99):.0f}"
        audio_ms = f"{pct(t.first_audio_ms, 0.5):.0f}/{pct(t.first_audio_ms, 0.99):.0f}"
        print(
            f"{name:<10} {pct(t.detected_ms, 0.5):10.0f} {word:>18} {audio_ms:>19} {late:.3f} {cut_ms:7.0f} "
            f"{per_agent_mb:8.0f}/{pss_mb:<7.0f} {cpu:11.1f}"
        )
        print(f"  {name}'s replies, mean ms: " + ", ".join(f"{k} {v:.0f}" for k, v in result.stages.items()))
        out |= {
            f"detected_ms_p50_{name}": round(pct(t.detected_ms, 0.5), 1),
            f"first_word_ms_p50_{name}": round(pct(t.first_word_ms, 0.5), 1),
            f"first_word_ms_p99_{name}": round(pct(t.first_word_ms, 0.99), 1),
            f"first_audio_ms_p50_{name}": round(pct(t.first_audio_ms, 0.5), 1),
            f"first_audio_ms_p99_{name}": round(pct(t.first_audio_ms, 0.99), 1),
            f"late_frac_{name}": round(late, 4),
            f"cut_ms_p50_{name}": round(statistics.median(t.cut_ms), 1) if t.cut_ms else None,
            f"failed_{name}": t.failed,
            f"rss_mb_per_agent_{name}": round(per_agent_mb, 1),
            f"pss_mb_per_agent_{name}": round(pss_mb, 1),
            f"cpu_s_per_agent_{name}": round(cpu, 2),
            **{f"reply_{stage}_ms_mean_{name}": round(ms, 1) for stage, ms in result.stages.items()},
        }
    out["memory_ratio_vs_per_agent"] = round(sides["duplexd"].rss / sides["per_agent"].rss, 3)
    out["pss_ratio_vs_per_agent"] = round(sides["duplexd"].pss / sides["per_agent"].pss, 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
