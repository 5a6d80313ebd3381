"""WebRTC calls against WebSocket sessions of the Realtime API: server CPU per call-second, time to first audio,
and late frames, on one `duplexd serve`.

Usage: python bench/webrtc_calls.py [--calls 4] [--seconds 10] [--jitter-frames 2]
One server on the CPU (the demo model, `--webrtc-hosts 127.0.0.1`), two phases of `--calls` concurrent sessions
for `--seconds`, one after the other: WebSocket `/v1/realtime` clients (pcm16 appends every 80 ms, the deltas
read), then aiortc callers on `/v1/realtime/calls` (a paced 48 kHz microphone track, the speech track decoded),
both in this process. Measured per phase: the server process's CPU per session-second (from /proc), the time
from the first audio the server takes to the first audio heard (WebSocket: first append → first delta; WebRTC:
the first event, from which the server takes the microphone → the first non-silent decoded frame, so it holds the
uplink jitter buffer, Opus both ways and the downlink), for WebRTC the downlink alone (`output_audio_buffer.started`,
sent as the first speech is queued on the track → that speech decoded: pacing, Opus, RTP, the caller's jitter
buffer), and the server's late frames (`duplexd_frames_late_total`). The reference is the WebSocket path: the
last line (JSON) holds the WebRTC / WebSocket ratio of CPU per call-second and the milliseconds the WebRTC leg
adds to first audio.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from websockets.asyncio.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host_overhead import free_port, ms_per_session_s, parse_stat  # noqa: E402
from bench.processes import ending_children, metric_values, stop, wait_ready  # noqa: E402

RATE, FRAME = 24000, 1920


@dataclass
class Phase:
    ttfa: list[float] = field(default_factory=list)  # seconds, per session
    downlink: list[float] = field(default_factory=list)  # WebRTC: output_audio_buffer.started → first sound heard
    cpu_s: float = 0.0
    session_s: float = 0.0
    late: float = 0.0
    frames_out: float = 0.0


def start_server(port: int, calls: int, jitter: int, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "duplexd", "serve", "--port", str(port), "--max-sessions", str(calls),
        "--webrtc-hosts", "127.0.0.1", "--webrtc-jitter-frames", str(jitter), "--static", "none",
        "--log-level", "warning",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    wait_ready(proc, f"http://127.0.0.1:{port}", log)
    return proc


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        return parse_stat(f.read())[1]


def counters(port: int) -> tuple[float, float]:
    """(late frames, frames out) on the server now."""
    late, out = metric_values(f"http://127.0.0.1:{port}", ["duplexd_frames_late_total", "duplexd_frames_out_total"])
    return late, out


def voice(seconds: float, rate: int, seed: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wobble = 0.5 + 0.5 * np.sin(2 * np.pi * (2 + seed % 3) * t)
    return (0.3 * np.sin(2 * np.pi * (180 + 20 * seed) * t) * wobble).astype(np.float32)


async def ws_session(port: int, seconds: float, seed: int, phase: Phase) -> None:
    pcm = voice(seconds, RATE, seed)
    async with connect(f"ws://127.0.0.1:{port}/v1/realtime", subprotocols=["realtime"]) as ws:  # type: ignore[list-item]
        await ws.recv()  # session.created
        first_sent: list[float] = []

        async def send() -> None:
            start = time.monotonic()
            for i in range(len(pcm) // FRAME):
                await asyncio.sleep(max(start + i * FRAME / RATE - time.monotonic(), 0))
                data = (np.clip(pcm[i * FRAME : (i + 1) * FRAME], -1, 1) * 32767).astype("<i2").tobytes()
                await ws.send(
                    json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(data).decode()})
                )
                if not first_sent:
                    first_sent.append(time.monotonic())

        sender = asyncio.create_task(send())
        heard = False
        while not sender.done() or not heard:
            try:
                message = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
            except asyncio.TimeoutError:
                if sender.done():
                    break
                continue
            if message["type"] == "response.output_audio.delta" and not heard:
                heard = True
                phase.ttfa.append(time.monotonic() - first_sent[0])
        await sender


async def webrtc_call(port: int, seconds: float, seed: int, phase: Phase) -> None:
    from duplexd.clients.webrtc import MIC_RATE, Caller

    caller = Caller(voice(seconds, MIC_RATE, seed))
    try:
        answer = await caller.call(f"http://127.0.0.1:{port}/v1/realtime/calls", strip_candidates=True)
        if answer.status != 201:
            raise RuntimeError(f"call refused: {answer.status} {answer.text}")
        await asyncio.wait_for(caller.opened.wait(), 10)
        await caller.next_event("session.created")
        caller.send({"type": "session.update", "session": {"type": "realtime"}})  # as the SDK does on open
        opened = time.monotonic()  # the server takes the microphone from this event on
        await caller.next_event("output_audio_buffer.started")
        started = time.monotonic()
        await asyncio.sleep(max(seconds - (started - opened), 0))
        if caller.first_sound is not None:
            phase.ttfa.append(caller.first_sound - opened)
            phase.downlink.append(caller.first_sound - started)
    finally:
        await caller.hang_up()


async def run_phase(port: int, pid: int, calls: int, seconds: float, webrtc: bool) -> Phase:
    phase = Phase()
    late0, out0 = counters(port)
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    session = webrtc_call if webrtc else ws_session
    await asyncio.gather(*(session(port, seconds, seed, phase) for seed in range(calls)))
    await asyncio.sleep(0.5)  # the hang-ups reach the server
    phase.cpu_s = cpu_seconds(pid) - cpu0
    phase.session_s = calls * (time.monotonic() - t0)
    late1, out1 = counters(port)
    phase.late, phase.frames_out = late1 - late0, out1 - out0
    return phase


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4, help="concurrent sessions in each phase")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each session")
    parser.add_argument("--jitter-frames", type=int, default=2, help="the server's --webrtc-jitter-frames")
    args = parser.parse_args()
    from duplexd.server.realtime.webrtc import stack

    stack.tune(args.jitter_frames, ("127.0.0.1",))  # this process's callers gather on loopback too
    with ending_children(), tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        server = start_server(port, args.calls, args.jitter_frames, Path(tmp) / "serve.log")
        try:
            asyncio.run(run_phase(port, server.pid, 1, 1.0, True))  # warm: the first call loads aiortc
            phases = {
                "websocket": asyncio.run(run_phase(port, server.pid, args.calls, args.seconds, False)),
                "webrtc": asyncio.run(run_phase(port, server.pid, args.calls, args.seconds, True)),
            }
        finally:
            stop([server.pid], 30.0)
            server.wait()
    print(
        f"webrtc calls on {platform.machine()} ({os.cpu_count()} cores): {args.calls} sessions of {args.seconds:g} s "
        f"a phase, demo model, CPU; jitter buffer {args.jitter_frames} frames"
    )
    print(
        f"{'path':<10} {'cpu ms/s':>9} {'ttfa p50 ms':>11} {'ttfa max ms':>11} {'downlink ms':>11} {'late frac':>9} "
        f"{'frames':>7}"
    )
    result: dict[str, object] = {"bench": "webrtc_calls", "calls": args.calls, "seconds": args.seconds}
    for name, p in phases.items():
        cpu = ms_per_session_s(p.cpu_s, p.session_s)
        ttfa = sorted(p.ttfa)
        p50 = 1000 * ttfa[len(ttfa) // 2] if ttfa else float("nan")
        worst = 1000 * ttfa[-1] if ttfa else float("nan")
        late = p.late / p.frames_out if p.frames_out else float("nan")
        down = 1000 * sorted(p.downlink)[len(p.downlink) // 2] if p.downlink else float("nan")
        print(f"{name:<10} {cpu:>9.1f} {p50:>11.0f} {worst:>11.0f} {down:>11.0f} {late:>9.3f} {int(p.frames_out):>7}")
        if p.downlink:
            result[f"downlink_ms_p50_{name}"] = round(down, 1)
        result[f"cpu_ms_per_s_{name}"] = round(cpu, 2)
        result[f"ttfa_ms_p50_{name}"] = round(p50, 1)
        result[f"late_frac_{name}"] = round(late, 4)
    ws, rtc = result["cpu_ms_per_s_websocket"], result["cpu_ms_per_s_webrtc"]
    if isinstance(ws, float) and isinstance(rtc, float) and ws > 0:
        result["cpu_ratio_webrtc_vs_websocket"] = round(rtc / ws, 2)
        result["calls_per_core_webrtc"] = round(1000 / rtc, 1) if rtc > 0 else None
    a, b = result["ttfa_ms_p50_webrtc"], result["ttfa_ms_p50_websocket"]
    if isinstance(a, float) and isinstance(b, float):
        result["ttfa_ms_added_by_webrtc"] = round(a - b, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
