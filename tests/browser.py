"""Headless Debian Chromium for the browser tests: its path, and its flags for a fake microphone fed by a WAV file
(so a page really captures, streams and plays) with no sandbox, GPU or background traffic."""

from __future__ import annotations

import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def launch_args(mic_wav: Path) -> list[str]:
    return [
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--use-fake-device-for-media-stream",
        "--use-fake-ui-for-media-stream",
        f"--use-file-for-fake-audio-capture={mic_wav}",
        "--autoplay-policy=no-user-gesture-required",
        "--allow-loopback-in-peer-connection",  # WebRTC calls to a server on 127.0.0.1 (its --webrtc-hosts)
    ]
