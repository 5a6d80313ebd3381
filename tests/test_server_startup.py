"""`duplexd serve` refuses to start on a missing or corrupt weight file or a bad setting: one clear line on stderr,
a non-zero exit, and the port is never bound."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from duplexd.engine.weights.demo import ensure_demo

from .live_server import free_port


def test_bad_weights_exit_before_binding_the_port(tmp_path):
    demo = ensure_demo()
    corrupt = tmp_path / "mimi.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + bytes(100))
    files = ["--tokenizer", str(demo.tokenizer), "--config", str(demo.config), "--mimi-preset", "demo"]
    cases = {
        "missing LM": (
            ["--moshi-weight", str(tmp_path / "nope.safetensors"), "--mimi-weight", str(demo.mimi), *files],
            "file not found",
        ),
        "corrupt Mimi": (
            ["--moshi-weight", str(demo.lm), "--mimi-weight", str(corrupt), *files],
            "not a readable safetensors file",
        ),
        "bad setting": (["--max-sessions", "0"], "--max-sessions 0"),
    }
    port = free_port()
    procs = {  # all at once: each pays for importing torch
        name: subprocess.Popen(
            [sys.executable, "-m", "duplexd", "serve", "--port", str(port), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        for name, (args, _) in cases.items()
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        lines = [line for line in err.splitlines() if line.startswith("duplexd serve: error:")]
        assert proc.returncode == 2, (name, out, err)
        assert len(lines) == 1 and cases[name][1] in lines[0], (name, err)
        assert err.rstrip().endswith(lines[0])  # the last thing said, after the loading log
        assert "Traceback" not in err and "Uvicorn running" not in err and "Started server" not in err, err
    with socket.socket() as s:  # nobody ever listened there
        assert s.connect_ex(("127.0.0.1", port)) != 0
