"""`duplexd chat IN --out OUT.wav`: talk to a server with an audio file, save what the model says.

The file is streamed at real-time pace (the server's clock is the listener's), or with `--fast` as quickly as the
server answers: at most `window` frames ahead of its replies, so the server's bounded inbox never drops any.
`--transcribe` (Kyutai protocol) also asks for the transcripts of what the file says and prints them as captions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from duplexd.wire import FRAME_SECONDS, FRAME_SIZE, SAMPLE_RATE, split_frames

from .audio import InputError, read_audio, write_wav
from .cli_args import add_connection_args, connect_options
from .connection import ConnectionFailed, ConnectOptions, describe_server
from .pacing import Pacer
from .protocols import open_connection


@dataclass
class ChatResult:
    pcm: np.ndarray  # the model's speech, 24 kHz float32
    text: str
    frames_sent: int
    frames_received: int
    info: dict = field(default_factory=dict)  # the server's session metadata
    close_code: int | None = None
    errors: list[str] = field(default_factory=list)
    transcripts: list[dict] = field(default_factory=list)  # the server's JSON events about the input's speech


async def chat(
    pcm: np.ndarray,
    options: ConnectOptions,
    *,
    fast: bool = False,
    window: int = 8,
    drain: float = 2.0,
    output_delay: int = 1,
    on_text: Callable[[str], None] | None = None,
    on_transcript: Callable[[dict], None] | None = None,
) -> ChatResult:
    """Stream `pcm` (24 kHz mono) to the server and collect its answer. Raises `ConnectionFailed`/`Refused`.

    The answer is complete once `sent - output_delay` frames are back (Moshi's first input frame only fills
    its acoustic delay) or nothing arrived for `drain` seconds; with `options.transcribe`, also once every
    utterance the server heard start has its transcript (or failed), or none came for `drain` seconds."""
    conn = open_connection(options)
    await conn.open()
    chunks: list[np.ndarray] = []
    text: list[str] = []
    errors: list[str] = []
    transcripts: list[dict] = []
    speaking: set[object] = set()  # utterances started and not yet transcribed
    received = 0
    progress = asyncio.Event()

    async def receive() -> None:
        nonlocal received
        samples = 0
        async for event in conn.events():
            if event.kind == "audio" and event.pcm is not None:
                chunks.append(event.pcm)
                samples += len(event.pcm)
                received = samples // FRAME_SIZE
                progress.set()
            elif event.kind == "text":
                text.append(event.text)
                if on_text:
                    on_text(event.text)
            elif event.kind == "error":
                errors.append(event.text)
            elif event.kind == "transcript" and event.data is not None:
                transcripts.append(event.data)
                kind, item = event.data.get("type"), event.data.get("item")
                if kind == "speech_started":
                    speaking.add(item)
                elif kind in ("transcript_completed", "transcript_failed"):
                    speaking.discard(item)
                progress.set()
                if on_transcript:
                    on_transcript(event.data)

    receiver = asyncio.create_task(receive())
    frame_list = split_frames(pcm)
    sent = 0
    try:
        pacer = Pacer(time.monotonic(), FRAME_SECONDS)
        for frame in frame_list:
            if receiver.done():
                break
            if fast:
                while sent - received >= window and not receiver.done():
                    progress.clear()
                    try:
                        await asyncio.wait_for(progress.wait(), drain)
                    except asyncio.TimeoutError:
                        break  # the server stopped answering: send on, the drain decides
            else:
                await pacer.wait()
                pacer.mark()
            await conn.send(frame)
            sent += 1
        # Drain: until every frame is answered, or no answer for `drain` seconds.
        while received < sent - output_delay and not receiver.done():
            progress.clear()
            try:
                await asyncio.wait_for(progress.wait(), drain)
            except asyncio.TimeoutError:
                break
        while speaking and not receiver.done():  # the last utterance's transcript comes after its audio
            progress.clear()
            try:
                await asyncio.wait_for(progress.wait(), drain)
            except asyncio.TimeoutError:
                break
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.close(), 2.0)
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(receiver, 2.0)
        receiver.cancel()
    out = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    return ChatResult(out, "".join(text), sent, received, conn.info, conn.close_code, errors, transcripts)


def caption(event: dict) -> str | None:
    """A line for the user's speech: a transcript with its times, a failure, or why there are none."""
    kind = event.get("type")
    if kind == "transcript_completed":
        return f"[you {event.get('start_s', 0):.2f}-{event.get('end_s', 0):.2f} s] {event.get('text', '')}"
    if kind == "transcript_failed":
        return f"[you, item {event.get('item')}: not transcribed: {event.get('reason')}]"
    if kind == "transcription_unavailable":
        return f"[{event.get('message')}]"
    return None


def persona_line(info: dict) -> str | None:
    """The persona the server ran the session with (Kyutai metadata or Realtime session), if it had one."""
    voice = info.get("voice_prompt") or info.get("voice")
    text = info.get("text_prompt") or info.get("instructions")
    return f"persona: voice {voice}, role text {text!r}" if voice else None


def run(args: argparse.Namespace) -> int:
    try:
        pcm = read_audio(args.input)
    except InputError as e:
        print(f"duplexd chat: {e}", file=sys.stderr)
        return 2
    if args.transcribe and args.protocol != "kyutai":
        print("duplexd chat: --transcribe needs --protocol kyutai", file=sys.stderr)
        return 2
    options = dataclasses.replace(connect_options(args), transcribe=args.transcribe)
    mode = "as fast as the server answers" if args.fast else "at real-time pace"
    print(
        f"streaming {len(pcm) / SAMPLE_RATE:.1f} s of {args.input} to {options.url} ({options.protocol}) {mode}",
        file=sys.stderr,
    )

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    def show_caption(event: dict) -> None:
        line = caption(event)
        if line:
            print(f"\n{line}", file=sys.stderr)

    try:
        result = asyncio.run(
            chat(pcm, options, fast=args.fast, drain=args.drain, on_text=show, on_transcript=show_caption)
        )
    except ConnectionFailed as e:
        code = f" (close code {e.code})" if e.code else ""
        print(f"\nduplexd chat: {'refused' if code else 'failed'}: {e.message}{code}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    model = describe_server(options) or {}
    if result.info.get("demo") or model.get("demo"):
        print("note: the server runs the demo model (random weights): it speaks noise", file=sys.stderr)
    persona = persona_line(result.info)
    if persona:
        print(persona, file=sys.stderr)
    write_wav(args.out, result.pcm)
    if args.text_out:
        with open(args.text_out, "w", encoding="utf-8") as f:
            f.write(result.text)
    print(
        f"sent {result.frames_sent} frames, received {result.frames_received}; "
        f"wrote {len(result.pcm) / SAMPLE_RATE:.2f} s to {args.out}",
        file=sys.stderr,
    )
    for error in result.errors:
        print(f"server error: {error}", file=sys.stderr)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="input audio (any format soundfile reads; resampled to 24 kHz mono)")
    p.add_argument("--out", required=True, help="output WAV (24 kHz) of the model's speech")
    p.add_argument("--text-out", help="also write the model's text to this file")
    p.add_argument("--fast", action="store_true", help="do not pace: send as fast as the server answers")
    p.add_argument("--drain", type=float, default=2.0, help="seconds to wait for the last answers")
    p.add_argument(
        "--transcribe",
        action="store_true",
        help="also get transcripts of what the input says (server started with --transcribe; --protocol kyutai)",
    )
    add_connection_args(p)
