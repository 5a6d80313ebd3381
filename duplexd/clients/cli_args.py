"""Command-line options shared by `duplexd chat` and `duplexd loadtest`: where to connect and how to sample."""

from __future__ import annotations

import argparse
import os

from .connection import ConnectOptions, Sampling


def add_connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection")
    g.add_argument(
        "--url",
        default="ws://127.0.0.1:8998",
        help="server address (ws://, wss://, http:// or https://; the protocol's path is added)",
    )
    g.add_argument(
        "--protocol",
        choices=["kyutai", "realtime"],
        default="realtime",
        help="kyutai: /api/chat, Ogg/Opus; realtime: /v1/realtime, base64 pcm16 (default)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("DUPLEXD_API_KEY"),
        help="API key, sent as 'Authorization: Bearer' (default: $DUPLEXD_API_KEY)",
    )
    g.add_argument("--open-timeout", type=float, default=30.0, help="seconds to wait for admission")
    s = p.add_argument_group("sampling (server defaults when not given)")
    s.add_argument("--text-temperature", type=float)
    s.add_argument("--text-topk", type=int)
    s.add_argument("--audio-temperature", type=float)
    s.add_argument("--audio-topk", type=int)
    s.add_argument("--seed", type=int, help="session seed: the same seed and input give the same answer")
    g = p.add_argument_group("persona (a PersonaPlex server with --voices; its defaults when not given)")
    g.add_argument("--text-prompt", help="the role text, e.g. 'You enjoy having a good conversation.'")
    g.add_argument("--voice-prompt", help="the voice: a name from the server's /v1/models voices, e.g. NATF0.pt")


def connect_options(args: argparse.Namespace) -> ConnectOptions:
    sampling = Sampling(args.text_temperature, args.text_topk, args.audio_temperature, args.audio_topk, args.seed)
    return ConnectOptions(
        url=args.url,
        protocol=args.protocol,
        sampling=sampling,
        api_key=args.api_key,
        open_timeout=args.open_timeout,
        text_prompt=args.text_prompt,
        voice_prompt=args.voice_prompt,
    )
