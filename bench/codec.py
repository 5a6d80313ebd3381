"""Ogg/Opus CPU per stream-second, duplexd.server.codec against sphn, and proof that the codec releases the GIL.

Usage: python bench/codec.py [--streams 128] [--ticks 50] [--repeats 3] [--quick] [--no-quality]

Why: every `/api/chat` session encodes one 80 ms frame and decodes one client frame per tick. sphn (what the server
used) costs ~10 ms of CPU per stream-second and holds the GIL while it codes, so at 128 sessions the codec alone
fills more than a core and more threads do not help. This measures, for N streams x T ticks of espeak-ng speech
(each stream from its own offset, with its own noise), the streams interleaved tick by tick as a server runs them:

* encode: the "fast" and "kyutai" profiles, and sphn's `OpusStreamWriter` as the reference (ratio printed);
* decode: a browser-style uplink (opus-recorder: libopus AUDIO, 20 ms packets, two a page) and a sphn-style uplink
  (moshi's Python client), each by `OggOpusDecoder` and by sphn's `OpusStreamReader`;
* the server's path (`CodecBatches`, what `duplexd serve` runs): the same tick's decodes and encodes submitted from
  an event loop, with 2 codec threads against 1 (`batches_thread_scaling_2`) and with 2 codec worker processes
  (`--codec-processes`) against 1 (`worker_scaling_2`), and the server process's own CPU per stream-second in each
  (`server_process_ms_per_s_*`: the event loop and couriers; with threads, the coding too);
* thread scaling: wall-clock throughput of a codec worker's tick (decode the uplink frame, encode the downlink
  frame, "fast" profile) with 2 threads each taking half the streams against 1 thread taking all of them:
  `thread_scaling_2` (2.0 is perfect on two free cores), and the same for sphn (`sphn_thread_scaling_2`); beside
  them the CPU the 2-thread run got per wall second (`cpus_used_2`: sphn, holding the GIL, never gets above 1),
  and the share of the worker's CPU inside the libopus calls (`libopus_cpu_share`), which bounds the scaling on two
  free cores (`thread_scaling_2_bound`, Amdahl) whatever else the machine runs; and, as the control, the same
  split over 2 forked processes against 1 (`process_scaling_2`: no GIL between them, so what the cores give this
  work) and the threads' share of it (`thread_vs_process_scaling`);
* quality (unless --no-quality): SNR and log-spectral distance (LSD) of each profile and of sphn after our decode,
  against the input, after a lag search: a stand-in for PESQ, which is not installed (measured PESQ-WB: fast 4.00,
  sphn 4.06).

CPU is process CPU time (sphn's threads included) divided by the stream-seconds coded (streams x ticks x 80 ms);
median of the repeats, which alternate the sides so load from elsewhere hits each alike. The uplink messages are
made before timing from at most 8 distinct streams (each decoder still has its own state). Prints a table and, as
its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
import sphn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.processes import ending_children  # noqa: E402
from duplexd.server.codec import libopus, streams  # noqa: E402
from duplexd.server.codec.ogg import PageReader, PageWriter  # noqa: E402

RATE = 24000
FRAME = 1920
TICK_S = 0.08
TEXT = (
    "The quick brown fox jumps over the lazy dog. Please call me back tomorrow morning. Seven bright kites were "
    "flying above the river. A conversation is a stream of short frames, each one heard while the next is spoken."
)

# ------------------------------------------------------------------------------------------------------ audio


def speech(seconds: float) -> np.ndarray:
    """espeak-ng speech at 24 kHz, repeated to `seconds`; harmonic bursts when espeak-ng is not installed."""
    n = round(seconds * RATE)
    if shutil.which("espeak-ng"):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "s.wav"
            subprocess.run(["espeak-ng", "-w", str(path), TEXT], check=True, capture_output=True)
            pcm, rate = sf.read(path, dtype="float32")
        pcm = soxr.resample(pcm, rate, RATE).astype(np.float32)
    else:
        print("espeak-ng not found: synthetic harmonic bursts instead of speech")
        t = np.arange(4 * RATE) / RATE
        gate = (np.sin(2 * np.pi * 0.7 * t) > 0) * np.sin(2 * np.pi * 4 * t) ** 2
        pcm = (0.2 * gate * sum(np.sin(2 * np.pi * k * 140 * t) / k for k in range(1, 8))).astype(np.float32)
    return np.resize(pcm, n).astype(np.float32)


def stream_frames(base: np.ndarray, streams_n: int, ticks: int) -> list[list[np.ndarray]]:
    """Per stream, `ticks` frames of `base` from its own offset plus its own noise (σ 1e-3)."""
    out = []
    for s in range(streams_n):
        rng = np.random.default_rng(s)
        offset = (s * 7 * FRAME) % (len(base) - ticks * FRAME)
        pcm = base[offset : offset + ticks * FRAME] + rng.normal(0, 1e-3, ticks * FRAME).astype(np.float32)
        out.append([pcm[i * FRAME : (i + 1) * FRAME] for i in range(ticks)])
    return out


def browser_uplink(frames: list[np.ndarray], lib) -> list[bytes]:
    """One message per tick as opus-recorder sends it (the header pages as their own first two messages; here
    prepended to the first tick's message so that there is one message a tick)."""
    encoder = libopus.Encoder(lib, RATE, libopus.OPUS_APPLICATION_AUDIO)
    writer = PageWriter(0x5EED)
    head = writer.page([streams.opus_head(encoder.lookahead() * 2)], 0, bos=True)
    head += writer.page([streams.opus_tags()], 0)
    messages, granule = [], 0
    for frame in frames:
        pages = []
        for at in (0, 960):
            packets = [encoder.encode(frame[at : at + 480]), encoder.encode(frame[at + 480 : at + 960])]
            granule += 1920
            pages.append(writer.page(packets, granule))
        messages.append(b"".join(pages))
    encoder.close()
    messages[0] = head + messages[0]
    return messages


def sphn_uplink(frames: list[np.ndarray]) -> list[bytes]:
    writer = sphn.OpusStreamWriter(RATE)
    return [writer.append_pcm(f) for f in frames]


# ------------------------------------------------------------------------------------------------------ timing


def cpu_of(run: Callable[[], None]) -> float:
    started = time.process_time()
    run()
    return time.process_time() - started


def encode_run(kind: str, frames: list[list[np.ndarray]]) -> Callable[[], None]:
    """A run that makes fresh encoders (untimed set-up is small next to the ticks) and codes every tick."""

    def run() -> None:
        if kind == "sphn":
            writers = [sphn.OpusStreamWriter(RATE) for _ in frames]
            encode = [w.append_pcm for w in writers]
        else:
            encoders = [streams.OggOpusEncoder(kind) for _ in frames]
            encode = [e.encode for e in encoders]
        for tick in range(len(frames[0])):
            for s, fn in enumerate(encode):
                fn(frames[s][tick])
        if kind != "sphn":
            for e in encoders:
                e.close()

    return run


def decode_run(kind: str, uplinks: list[list[bytes]], streams_n: int) -> Callable[[], None]:
    def run() -> None:
        if kind == "sphn":
            decode = [sphn.OpusStreamReader(RATE).append_bytes for _ in range(streams_n)]
        else:
            decoders = [streams.OggOpusDecoder(RATE) for _ in range(streams_n)]
            decode = [d.decode for d in decoders]
        for tick in range(len(uplinks[0])):
            for s, fn in enumerate(decode):
                fn(uplinks[s % len(uplinks)][tick])

    return run


def worker_tick(kind: str, frames: list[list[np.ndarray]], uplinks: list[list[bytes]], first: int, count: int):
    """A codec worker for streams [first, first + count): per tick, decode each one's uplink and encode its
    downlink. Returns (set up, run)."""
    state: dict = {}

    def setup() -> None:
        if kind == "sphn":
            state["dec"] = [sphn.OpusStreamReader(RATE).append_bytes for _ in range(count)]
            state["enc"] = [sphn.OpusStreamWriter(RATE).append_pcm for _ in range(count)]
        else:
            state["dec"] = [streams.OggOpusDecoder(RATE).decode for _ in range(count)]
            state["enc"] = [streams.OggOpusEncoder("fast").encode for _ in range(count)]

    def run() -> None:
        dec, enc = state["dec"], state["enc"]
        for tick in range(len(frames[0])):
            for i in range(count):
                s = first + i
                dec[i](uplinks[s % len(uplinks)][tick])
                enc[i](frames[s][tick])

    return setup, run


def wall_with_threads(kind: str, frames, uplinks, threads: int) -> tuple[float, float]:
    """Wall and process CPU seconds for all streams' ticks, split over `threads` threads started together."""
    n = len(frames)
    bounds = [(n * t // threads, n * (t + 1) // threads) for t in range(threads)]
    workers = [worker_tick(kind, frames, uplinks, a, b - a) for a, b in bounds]
    for setup, _ in workers:
        setup()
    barrier = threading.Barrier(threads + 1)

    def body(run: Callable[[], None]) -> None:
        barrier.wait()
        run()

    pool = [threading.Thread(target=body, args=(run,)) for _, run in workers]
    for t in pool:
        t.start()
    barrier.wait()
    started, cpu = time.perf_counter(), time.process_time()
    for t in pool:
        t.join()
    return time.perf_counter() - started, time.process_time() - cpu


def wall_with_processes(frames, uplinks, processes: int) -> float:
    """The same split over forked processes, each with its own GIL (the machine's own scaling for this work: the
    control that tells the GIL's cost from the cores'): the slowest worker's run, timed from a common start."""
    context = multiprocessing.get_context("fork")  # the children inherit the frames: nothing is pickled
    n = len(frames)
    bounds = [(n * p // processes, n * (p + 1) // processes) for p in range(processes)]
    barrier, results = context.Barrier(processes), context.Queue()

    def body(first: int, count: int) -> None:
        setup, run = worker_tick("ours", frames, uplinks, first, count)
        setup()
        barrier.wait()
        started = time.perf_counter()
        run()
        results.put(time.perf_counter() - started)

    pool = [context.Process(target=body, args=(a, b - a)) for a, b in bounds]
    for proc in pool:
        proc.start()
    walls = [results.get(timeout=600) for _ in pool]
    for proc in pool:
        proc.join()
    return max(walls)


def wall_through_batches(frames, uplinks, threads: int, processes: int, groups: int = 4) -> tuple[float, float]:
    """The server's own path (`CodecBatches`, codec threads or worker processes) driven from an event loop: the
    streams in `groups` that tick independently, as a server's sessions do (their messages do not all arrive at
    once), each tick's decodes and encodes of a group submitted together and awaited, ticks back to back. Wall
    seconds and this process's CPU seconds (the event loop and couriers; the coding too with codec threads)."""
    from duplexd.server.codec.batches import CodecBatches

    codec = CodecBatches(threads, processes, uplink_window=0.0)  # throughput: no waiting for stragglers
    try:
        decoders, encoders = zip(*(codec.streams("fast", RATE) for _ in frames), strict=True)

        async def group(g: int, ticks: range) -> None:
            members = range(g, len(frames), groups)
            for tick in ticks:
                work: list[Awaitable[object]] = [
                    codec.decode(decoders[s], uplinks[s % len(uplinks)][tick]) for s in members
                ]
                work += [codec.encode(encoders[s], frames[s][tick]) for s in members]
                await asyncio.gather(*work)

        async def run() -> tuple[float, float]:
            # the first tick untimed: the workers' start-up and the streams' creation are not throughput
            await asyncio.gather(*(group(g, range(1)) for g in range(groups)))
            wall, cpu = time.perf_counter(), time.process_time()
            await asyncio.gather(*(group(g, range(1, len(frames[0]))) for g in range(groups)))
            return time.perf_counter() - wall, time.process_time() - cpu

        wall, cpu = asyncio.run(run())
        scale = len(frames[0]) / (len(frames[0]) - 1)  # per the whole run's ticks, as the other measures
        return wall * scale, cpu * scale
    finally:
        codec.shutdown()


def libopus_share(frames, uplinks, lib) -> float:
    """The share of a codec worker's CPU (one thread, "fast" profile) spent in the libopus calls themselves, where
    the GIL is released: what bounds thread scaling (Amdahl) whatever else runs on the machine."""
    _, full = wall_with_threads("ours", frames, uplinks, 1)
    packets = [[[p for p in PageReader().feed(m) if not p.startswith(b"Opus")] for m in u] for u in uplinks]
    out = np.empty(2880, np.float32)
    address = out.ctypes.data
    decoders = [libopus.Decoder(lib, RATE) for _ in frames]
    encoders = [
        libopus.Encoder(lib, RATE, libopus.OPUS_APPLICATION_RESTRICTED_LOWDELAY, complexity=0, bitrate=48000)
        for _ in frames
    ]
    started = time.process_time()
    for tick in range(len(frames[0])):
        for s, (decoder, encoder) in enumerate(zip(decoders, encoders, strict=True)):
            for packet in packets[s % len(packets)][tick]:
                decoder.decode_into(packet, address)
            encoder.encode(frames[s][tick])
    raw = time.process_time() - started
    for decoder in decoders:
        decoder.close()
    for encoder in encoders:
        encoder.close()
    return min(raw / full, 1.0)


# ----------------------------------------------------------------------------------------------------- quality


def align(reference: np.ndarray, test: np.ndarray, max_lag: int = 800) -> tuple[np.ndarray, np.ndarray, int]:
    """`test` shifted by the lag (0..max_lag, test late) that best matches `reference`, both cut to one length."""
    n = min(len(reference), len(test)) - max_lag
    ref = reference[:n].astype(np.float64)
    size = 1 << (n + max_lag).bit_length()
    corr = np.fft.irfft(np.fft.rfft(test[: n + max_lag], size) * np.conj(np.fft.rfft(ref, size)), size)
    lag = int(np.argmax(corr[: max_lag + 1]))
    return ref, test[lag : lag + n].astype(np.float64), lag


def snr_db(ref: np.ndarray, test: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((ref - test) ** 2), 1e-20)))


def lsd_db(ref: np.ndarray, test: np.ndarray, n_fft: int = 512, hop: int = 256) -> float:
    """Log-spectral distance (dB RMS over frequency, mean over frames) on frames within 50 dB of the loudest."""
    window = np.hanning(n_fft)
    frames = range(0, len(ref) - n_fft, hop)
    spec = [np.abs(np.fft.rfft(window * x[i : i + n_fft])) ** 2 for x in (ref, test) for i in frames]
    p_ref, p_test = np.array(spec[: len(frames)]), np.array(spec[len(frames) :])
    energy = p_ref.sum(axis=1)
    keep = energy > energy.max() * 1e-5
    floor = p_ref[keep].max() * 1e-10
    diff = 10 * np.log10((p_ref[keep] + floor) / (p_test[keep] + floor))
    return float(np.mean(np.sqrt(np.mean(diff**2, axis=1))))


def quality(base: np.ndarray) -> dict[str, dict[str, float]]:
    pcm = base + np.random.default_rng(99).normal(0, 1e-3, len(base)).astype(np.float32)
    frames = [pcm[i : i + FRAME] for i in range(0, len(pcm) - FRAME + 1, FRAME)]
    out = {}
    for name in ("fast", "kyutai", "sphn"):
        if name == "sphn":
            writer = sphn.OpusStreamWriter(RATE)
            messages = [writer.append_pcm(f) for f in frames]
        else:
            encoder = streams.OggOpusEncoder(name)
            messages = [encoder.encode(f) for f in frames]
            encoder.close()
        decoder = streams.OggOpusDecoder(RATE)
        decoded = np.concatenate([decoder.decode(m) for m in messages])
        ref, test, lag = align(np.concatenate(frames), decoded)
        out[name] = {"snr_db": round(snr_db(ref, test), 2), "lsd_db": round(lsd_db(ref, test), 2), "lag": lag}
    return out


# --------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--ticks", type=int, default=50, help="80 ms ticks per stream")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quality", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--quick", action="store_true", help="tiny settings for a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.ticks, args.repeats = 8, 10, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lib = libopus.load()
    if lib is None:
        print("libopus not found: nothing to compare sphn with (apt-get install libopus0)")
        print(json.dumps({"bench": "codec", "skipped": "libopus not found"}))
        return 0
    stream_s = args.streams * args.ticks * TICK_S
    base = speech(max(20.0, args.ticks * TICK_S + 10))
    frames = stream_frames(base, args.streams, args.ticks)
    distinct = min(args.streams, 8)
    browser = [browser_uplink(frames[s], lib) for s in range(distinct)]
    moshi = [sphn_uplink(frames[s]) for s in range(distinct)]
    print(
        f"Ogg/Opus codec: {args.streams} streams x {args.ticks} ticks ({stream_s:.0f} stream-s), "
        f"{streams.backend()} vs sphn, median of {args.repeats}"
    )
    runs: dict[str, Callable[[], None]] = {
        "fast_encode": encode_run("fast", frames),
        "kyutai_encode": encode_run("kyutai", frames),
        "sphn_encode": encode_run("sphn", frames),
        "decode_browser": decode_run("ours", browser, args.streams),
        "sphn_decode_browser": decode_run("sphn", browser, args.streams),
        "decode_sphn": decode_run("ours", moshi, args.streams),
        "sphn_decode_sphn": decode_run("sphn", moshi, args.streams),
    }
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            cpu[name].append(cpu_of(run))
    ms = {k: 1000 * statistics.median(v) / stream_s for k, v in cpu.items()}
    out: dict = {"bench": "codec", "backend": streams.backend(), "streams": args.streams, "ticks": args.ticks}
    # a shared machine: work from elsewhere takes the second core, which thread scaling needs free
    out["load_avg_start"] = round(os.getloadavg()[0], 2)
    out["cpus"] = os.cpu_count()
    print(f"\n{'CPU ms per stream-second':<34} {'duplexd':>9} {'sphn':>9} {'ratio':>7}")
    for label, ours, theirs in (
        ("encode, fast profile", "fast_encode", "sphn_encode"),
        ("encode, kyutai profile", "kyutai_encode", "sphn_encode"),
        ("decode, browser uplink", "decode_browser", "sphn_decode_browser"),
        ("decode, sphn uplink", "decode_sphn", "sphn_decode_sphn"),
    ):
        ratio = ms[ours] / ms[theirs]
        print(f"{label:<34} {ms[ours]:>9.3f} {ms[theirs]:>9.3f} {ratio:>7.3f}")
        out[f"{ours}_ms_per_s"] = round(ms[ours], 4)
        out[f"{ours}_vs_sphn"] = round(ratio, 4)
    for name in ("sphn_encode", "sphn_decode_browser", "sphn_decode_sphn"):
        out[f"{name}_ms_per_s"] = round(ms[name], 4)

    # thread scaling: the best of the repeats for each side (a scheduler hiccup only ever slows a run down)
    walls: dict[tuple[str, int], list[tuple[float, float]]] = {(k, t): [] for k in ("ours", "sphn") for t in (1, 2)}
    for _ in range(args.repeats):
        for side, threads in walls:
            walls[(side, threads)].append(wall_with_threads(side, frames, browser, threads))
    header = f"{'1 thread s':>10} {'2 threads s':>12} {'scaling':>8} {'CPUs used':>10}"
    print(f"\n{'codec worker tick (decode + encode)':<34} {header}")
    for kind, label, key in (
        ("ours", "duplexd, fast profile", "thread_scaling_2"),
        ("sphn", "sphn", "sphn_thread_scaling_2"),
    ):
        one, (two, two_cpu) = min(walls[(kind, 1)])[0], min(walls[(kind, 2)])
        print(f"{label:<34} {one:>10.3f} {two:>12.3f} {one / two:>8.2f} {two_cpu / two:>10.2f}")
        out[key] = round(one / two, 3)
        out[key.replace("thread_scaling", "cpus_used")] = round(two_cpu / two, 3)
    procs = {k: min(wall_with_processes(frames, browser, k) for _ in range(args.repeats)) for k in (1, 2)}
    out["process_scaling_2"] = round(procs[1] / procs[2], 3)
    out["thread_vs_process_scaling"] = round(out["thread_scaling_2"] / out["process_scaling_2"], 3)
    print(f"{'duplexd, 2 processes (control)':<34} {procs[1]:>10.3f} {procs[2]:>12.3f} {procs[1] / procs[2]:>8.2f}")
    # the server's path: CodecBatches with 1 and 2 codec threads, and with 1 and 2 worker processes
    served: dict[tuple[int, int], list[tuple[float, float]]] = {k: [] for k in ((1, 0), (2, 0), (1, 1), (1, 2))}
    for _ in range(args.repeats):
        for threads, processes in served:
            served[(threads, processes)].append(wall_through_batches(frames, browser, threads, processes))
    best = {k: min(v) for k, v in served.items()}
    for label, key, single, doubled in (
        ("server path, codec threads", "batches_thread_scaling_2", (1, 0), (2, 0)),
        ("server path, worker processes", "worker_scaling_2", (1, 1), (1, 2)),
    ):
        a, b = best[single][0], best[doubled][0]
        print(f"{label:<34} {a:>10.3f} {b:>12.3f} {a / b:>8.2f}")
        out[key] = round(a / b, 3)
    # what coding costs the server's own process per stream-second (event loop + couriers; threads included)
    for key, setting in (("server_process_ms_per_s_threads_2", (2, 0)), ("server_process_ms_per_s_workers_2", (1, 2))):
        out[key] = round(1000 * best[setting][1] / stream_s, 4)
    share = statistics.median(libopus_share(frames, browser, lib) for _ in range(args.repeats))
    bound = 1 / ((1 - share) + share / 2)
    out["libopus_cpu_share"], out["thread_scaling_2_bound"] = round(share, 3), round(bound, 3)
    print(
        f"libopus calls (GIL released) are {100 * share:.0f}% of duplexd's worker CPU: 2 threads on two free cores "
        f"scale by at most {bound:.2f}x (sphn: 1.00x); 'CPUs used' is the CPU the 2-thread run got per wall second "
        f"(load average {out['load_avg_start']} on {out['cpus']} CPUs at the start: other work takes cores too)"
    )

    if args.quality:
        q = quality(base[: round(10 * RATE)])
        print(f"\n{'quality vs the input (our decode)':<34} {'SNR dB':>8} {'LSD dB':>8} {'lag':>5}")
        for name, row in q.items():
            print(f"{name:<34} {row['snr_db']:>8.2f} {row['lsd_db']:>8.2f} {row['lag']:>5}")
            out[f"{name}_snr_db"], out[f"{name}_lsd_db"] = row["snr_db"], row["lsd_db"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    with ending_children():  # the forked workers and the codec worker processes
        raise SystemExit(main())
