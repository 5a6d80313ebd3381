"""Every start-up misconfiguration of `duplexd serve`, `infer` and `generate`, each its own process running the
`python -m duplexd` entry point: exit 2, one line on stderr naming the option, no traceback, and nothing loaded
first (the cases would take minutes otherwise).

The processes are forked from one interpreter that imported duplexd once (`tests.forked_cli`), so forty cases
cost seconds, not forty torch imports; two cases also go through the installed `duplexd` command itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from duplexd.engine.tts.demo import demo_tts_folder
from duplexd.engine.weights.demo import ensure_demo, ensure_demo_stt

from .live_server import demo_cache

# name: (command line after `duplexd`, text the error line must hold, extra environment)
CASES: dict[str, tuple[list[str], str, dict[str, str]]] = {
    "unknown device": (["serve", "--device", "tpu9"], "--device tpu9: not a device name; pick one of cpu", {}),
    "CUDA device beyond the count": (["serve", "--device", "cuda:3"], "--device cuda:3: this machine", {}),
    "cuda among several": (["serve", "--device", "cpu,cuda:7"], "--device cuda:7:", {}),
    "mps absent": (["serve", "--device", "mps"], "--device mps: this machine has no MPS device", {}),
    "device twice": (["serve", "--device", "cpu", "--device", "cpu"], "--device cpu: given twice", {}),
    "device from the environment": (["serve"], "DUPLEXD_DEVICES cuda:5:", {"DUPLEXD_DEVICES": "cuda:5"}),
    "TURN without credentials": (
        ["serve", "--webrtc-ice-servers", "turn:turn.example.com:3478"],
        "--webrtc-ice-servers turn:turn.example.com:3478: 'turn:turn.example.com:3478' is not a stun:HOST:PORT URL",
        {},
    ),
    "missing LM": (
        [
            "serve",
            "--moshi-weight",
            "{tmp}/nope.safetensors",
            "--mimi-weight",
            "{demo.mimi}",
            "--tokenizer",
            "{demo.tokenizer}",
            "--config",
            "{demo.config}",
            "--mimi-preset",
            "demo",
        ],
        "--moshi-weight {tmp}/nope.safetensors: file not found",
        {},
    ),
    "corrupt Mimi": (
        [
            "serve",
            "--moshi-weight",
            "{demo.lm}",
            "--mimi-weight",
            "{tmp}/corrupt.safetensors",
            "--tokenizer",
            "{demo.tokenizer}",
            "--config",
            "{demo.config}",
            "--mimi-preset",
            "demo",
        ],
        "--mimi-weight {tmp}/corrupt.safetensors: not a readable safetensors file",
        {},
    ),
    "config not JSON": (["serve", "--config", "{tmp}/bad.json"], "--config {tmp}/bad.json: not valid JSON", {}),
    "config not an object": (["serve", "--config", "{tmp}/list.json"], "--config {tmp}/list.json: must hold", {}),
    "config not supported": (
        ["serve", "--config", "{tmp}/layer_norm.json"],
        "--config {tmp}/layer_norm.json: bad config: config key 'norm'",
        {},
    ),
    "tokenizer not sentencepiece": (
        [
            "serve",
            "--moshi-weight",
            "{demo.lm}",
            "--mimi-weight",
            "{demo.mimi}",
            "--tokenizer",
            "{tmp}/bad.json",
            "--mimi-preset",
            "demo",
        ],
        "--tokenizer {tmp}/bad.json: not a sentencepiece model",
        {},
    ),
    "Mimi preset short of an STT LM's codebooks": (
        ["serve", "--hf-repo", "{stt.root}", "--mimi-preset", "demo"],
        "--mimi-preset demo: Mimi with 8 codebooks of 2048, and the LM reads 32 of 2048 (a speech-to-text LM",
        {},
    ),
    "files half given": (["serve", "--moshi-weight", "{demo.lm}"], "error: --mimi-weight, --tokenizer: missing", {}),
    "hf repo offline": (["serve", "--hf-repo", "kyutai/no-such-repo"], "--hf-repo hf://kyutai/no-such-repo/", {}),
    "hf repo malformed": (["serve", "--hf-repo", "not a/repo id"], "--hf-repo", {}),
    "zero sessions": (["serve", "--max-sessions", "0"], "--max-sessions 0: Input should be greater than", {}),
    "sessions from the environment": (["serve"], "DUPLEXD_MAX_SESSIONS 0:", {"DUPLEXD_MAX_SESSIONS": "0"}),
    "negative queue": (["serve", "--max-pending-frames", "-1"], "--max-pending-frames -1:", {}),
    "negative timeout": (["serve", "--idle-timeout", "-5"], "--idle-timeout -5:", {}),
    "port out of range": (["serve", "--port", "70000"], "--port 70000:", {}),
    "not a size": (["serve", "--kv-memory", "lots"], "--kv-memory lots: could not parse", {}),
    "message limit too small": (["serve", "--max-message-bytes", "100"], "--max-message-bytes 100:", {}),
    "bad dtype": (["serve", "--dtype", "float8"], "argument --dtype: invalid choice", {}),
    "certificate missing": (
        ["serve", "--ssl-certfile", "{tmp}/cert.pem", "--ssl-keyfile", "{tmp}/key.pem"],
        "--ssl-certfile {tmp}/cert.pem: file not found",
        {},
    ),
    "certificate without key": (["serve", "--ssl-certfile", "{tmp}/bad.json"], "--ssl-keyfile", {}),
    "codec threads and processes": (
        ["serve", "--codec-threads", "2", "--codec-processes", "2"],
        "--codec-threads and --codec-processes: choose one",
        {},
    ),
    "negative codec processes": (["serve", "--codec-processes", "-1"], "--codec-processes", {}),
    "certificate not PEM": (
        ["serve", "--ssl-certfile", "{tmp}/bad.json", "--ssl-keyfile", "{tmp}/bad.json"],
        "--ssl-certfile {tmp}/bad.json / --ssl-keyfile {tmp}/bad.json: not a PEM",
        {},
    ),
    "static folder missing": (["serve", "--static", "{tmp}/web"], "--static {tmp}/web: directory not found", {}),
    "host unknown": (["serve", "--host", "no-such-host.invalid"], "--host no-such-host.invalid: not a known host", {}),
    "host not this machine's": (["serve", "--host", "192.0.2.1"], "--host 192.0.2.1: cannot bind", {}),
    "port in use": (["serve", "--port", "{busy}"], "--port {busy}: 127.0.0.1:{busy} is already in use", {}),
    "unknown random-weights preset": (
        ["serve", "--random-weights", "moshi-70b"],
        "--random-weights moshi-70b: unknown preset",
        {},
    ),
    "random weights with files": (
        ["serve", "--random-weights", "demo", "--tokenizer", "{demo.tokenizer}"],
        "leave out --tokenizer",
        {},
    ),
    "infer on a missing device": (
        ["infer", "{tmp}/in.wav", "{tmp}/out.wav", "--device", "cuda:3"],
        "--device cuda:3: this machine",
        {},
    ),
    "infer of a missing file": (["infer", "{tmp}/none.wav", "{tmp}/out.wav"], "cannot read audio from", {}),
    "infer into a missing folder": (["infer", "{tmp}/in.wav", "{tmp}/no/out.wav"], "its directory does not", {}),
    "infer with a corrupt LM": (
        [
            "infer",
            "{tmp}/in.wav",
            "{tmp}/out.wav",
            "--moshi-weight",
            "{tmp}/corrupt.safetensors",
            "--mimi-weight",
            "{demo.mimi}",
            "--tokenizer",
            "{demo.tokenizer}",
        ],
        "--moshi-weight {tmp}/corrupt.safetensors: not a readable safetensors",
        {},
    ),
    "infer with negative top-k": (["infer", "{tmp}/in.wav", "{tmp}/out.wav", "--topk", "-1"], "--topk", {}),
    "generate on a missing device": (["generate", "--device", "cuda"], "--device cuda: this machine", {}),
    "generate from a missing file": (
        ["generate", "--weights", "{tmp}/nope.safetensors"],
        "--weights {tmp}/nope.safetensors: file not found",
        {},
    ),
    "generate with a bad config": (["generate", "--config", "{tmp}/bad.json"], "--config {tmp}/bad.json", {}),
    "generate zero frames": (["generate", "--frames", "0"], "--frames 0: must be at least 1", {}),
    "transcriber folder missing": (
        ["serve", "--transcribe", "{tmp}/no-gemma"],
        "--transcribe {tmp}/no-gemma: not a folder, a Hugging Face repo id or demo",
        {},
    ),
    "transcriber folder not Gemma 4": (
        ["serve", "--transcribe", "{tmp}"],
        "--transcribe {tmp}: not a Gemma 4 checkpoint: no config.json",
        {},
    ),
    "transcriber config not Gemma 4": (
        ["serve", "--transcribe", "{tmp}/llama"],
        "--transcribe {tmp}/llama: not a Gemma 4 checkpoint: config.json has model_type 'llama'",
        {},
    ),
    "transcribe device unknown": (
        ["serve", "--transcribe", "demo", "--transcribe-device", "tpu9"],
        "--transcribe-device tpu9: not a device name",
        {},
    ),
    "transcribe device beyond the count": (
        ["serve", "--transcribe", "demo", "--transcribe-device", "cuda:5"],
        "--transcribe-device cuda:5: this machine",
        {},
    ),
    "voices folder missing": (
        ["serve", "--voices", "{tmp}/no-voices"],
        "--voices {tmp}/no-voices: folder not found",
        {},
    ),
    "voices folder empty": (
        ["serve", "--voices", "{tmp}/no-voice-files"],
        "--voices {tmp}/no-voice-files: the folder holds no voice (.pt, .wav, .flac files)",
        {},
    ),
    "voices for a model not PersonaPlex": (
        ["serve", "--voices", "{tmp}/voices"],
        "--voices {tmp}/voices: voices need a PersonaPlex model, and the demo model is not one (its DepFormer",
        {},
    ),
    "voices for random weights": (
        ["serve", "--random-weights", "demo", "--voices", "{tmp}/voices"],
        "--voices {tmp}/voices: voices need a PersonaPlex model, and the demo preset is not one",
        {},
    ),
    "tts not a folder": (["serve", "--tts", "{tmp}/nope"], "--tts {tmp}/nope is not a folder (a Kyutai TTS", {}),
    "tts not a TTS model": (
        ["serve", "--tts", "{tmp}/llama"],
        "--tts {tmp}/llama is not a Kyutai TTS model (its config.json has no model_type tts)",
        {},
    ),
    "tts voices missing": (
        ["serve", "--tts", "demo-tts", "--tts-voices", "{tmp}/nope"],
        "--tts-voices {tmp}/nope: not a folder or a Hugging Face repo id",
        {},
    ),
    "tts default voice unknown": (
        ["serve", "--tts", "demo-tts", "--tts-default-voice", "demo/carol.wav"],
        "--tts-default-voice demo/carol.wav: not one of the voices (demo/alice.wav, demo/bob.wav)",
        {},
    ),
    "tts codebooks": (
        ["serve", "--tts", "demo-tts", "--tts-n-q", "33"],
        "--tts-n-q 33: demo-tts-v1 says 1 to 32 codebooks",
        {},
    ),
    "llm without tts": (
        ["serve", "--llm", "demo"],
        "a voice agent (--llm) speaks through a text-to-speech model: give --tts too",
        {},
    ),
    "llm on a conversation model": (
        ["serve", "--llm", "demo", "--tts", "demo-tts"],
        "--llm demo: a voice agent hears through a Kyutai STT model, and the main model (the demo model) is a "
        "conversation model",
        {},
    ),
    "tts cfg coefficient": (
        ["serve", "--tts", "demo-tts", "--tts-cfg-coef", "2.2"],
        "--tts-cfg-coef 2.2: the model takes 1.0, 1.5",
        {},
    ),
}
# Cases on a real (tiny) Gemma 4 checkpoint, rewritten: they need transformers to write it.
GEMMA_CASES: dict[str, tuple[list[str], str, dict[str, str]]] = {
    "transcriber without audio weights": (
        ["serve", "--transcribe", "{gemma}/no-audio"],
        "--transcribe {gemma}/no-audio: its weights hold no audio tower (model.audio_tower.*)",
        {},
    ),
    "transcriber with a tensor missing": (  # passes the checks by name; loading finds it
        ["serve", "--transcribe", "{gemma}/one-missing"],
        "--transcribe {gemma}/one-missing: missing keys (1): audio_tower.",
        {},
    ),
}


def _files(tmp: Path) -> None:
    (tmp / "llama").mkdir()
    (tmp / "llama" / "config.json").write_text('{"model_type": "llama"}')
    (tmp / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + bytes(100))
    (tmp / "bad.json").write_text("{not json")
    (tmp / "list.json").write_text("[1, 2]")
    (tmp / "layer_norm.json").write_text('{"norm": "layer_norm"}')
    sf.write(tmp / "in.wav", np.zeros(4800, np.float32), 24000)
    (tmp / "no-voice-files").mkdir()
    (tmp / "no-voice-files" / "README.txt").write_text("not a voice")
    (tmp / "voices").mkdir()
    sf.write(tmp / "voices" / "voice.wav", np.zeros(4800, np.float32), 24000)  # never read: the model is refused


def _gemma_variants(cache: Path, out: Path) -> Path:
    """Copies of the Gemma 4 demo: without its audio tower's tensors, and without one of them."""
    from safetensors.torch import load_file, save_file

    from duplexd.engine.weights.gemma4_demo import ensure_gemma4_demo

    demo = ensure_gemma4_demo(cache)
    weights = load_file(demo / "model.safetensors")
    tower = sorted(k for k in weights if k.startswith("model.audio_tower."))
    for name, drop in (("no-audio", set(tower)), ("one-missing", {tower[0]})):
        shutil.copytree(demo, out / name)
        kept = {k: v for k, v in weights.items() if k not in drop}
        save_file(kept, out / name / "model.safetensors", metadata={"format": "pt"})
    return out


def _forked(
    jobs: dict[str, tuple[list[str], str, dict[str, str]]], tmp: Path, env: dict[str, str]
) -> dict[str, subprocess.CompletedProcess]:
    """Each job's command line run by `tests.forked_cli`, as if by `subprocess.run`."""
    root = Path(__file__).resolve().parents[1]
    spec = [
        {"argv": argv, "env": case_env, "out": str(tmp / f"job{i}")}
        for i, (argv, _, case_env) in enumerate(jobs.values())
    ]
    subprocess.run(
        [sys.executable, "-m", "tests.forked_cli"],
        input=json.dumps(spec),
        text=True,
        env=env,
        cwd=root,
        check=True,
        timeout=120,
    )
    return {
        name: subprocess.CompletedProcess(
            argv,
            int(Path(f"{job['out']}.rc").read_text()),
            Path(f"{job['out']}.stdout").read_text(),
            Path(f"{job['out']}.stderr").read_text(),
        )
        for (name, (argv, _, _)), job in zip(jobs.items(), spec, strict=True)
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, str]]:
    tmp = tmp_path_factory.mktemp("startup")
    cache = demo_cache(tmp_path_factory)
    env = {**os.environ, "DUPLEXD_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("DUPLEXD_") or k == "DUPLEXD_CACHE"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DUPLEXD_CACHE", str(cache))
        demo, stt = ensure_demo(), ensure_demo_stt()  # written once here, so no case writes them (or pays for it)
        demo_tts_folder()  # the demo TTS too (~1.4 s a write): five cases start from `--tts demo-tts`
    _files(tmp)
    cases = dict(CASES)
    gemma = None
    if importlib.util.find_spec("transformers") is not None:
        gemma = _gemma_variants(cache, tmp_path_factory.mktemp("gemma"))
        cases.update(GEMMA_CASES)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        fill = {"tmp": tmp, "demo": demo, "stt": stt, "busy": busy.getsockname()[1], "gemma": gemma}
        jobs = {
            name: ([arg.format(**fill) for arg in argv], expected.format(**fill), {**env, **extra})
            for name, (argv, expected, extra) in cases.items()
        }
        procs = _forked(jobs, tmp, env)
    return {name: (procs[name], jobs[name][1]) for name in jobs}


@pytest.mark.parametrize("name", [*CASES, *GEMMA_CASES])
def test_startup_error(results, name):
    if name not in results:
        pytest.skip("needs transformers (the gemma extra) to write a Gemma 4 checkpoint")
    proc, expected = results[name]
    err = proc.stderr
    lines = [line for line in err.splitlines() if ": error: " in line]
    command = {**CASES, **GEMMA_CASES}[name][0][0]
    assert proc.returncode == 2, (proc.returncode, err)
    assert len(lines) == 1 and lines[0].startswith(f"duplexd {command}: error: "), err
    assert expected in lines[0], (expected, lines[0])
    assert err.rstrip().endswith(lines[0]), err  # the last thing said
    assert "Traceback" not in err + proc.stdout, err
    assert "loading the LM" not in err and "loaded LM" not in err, err  # refused before any model is loaded
    assert "Uvicorn running" not in err and "Started server" not in err, err  # nor any port bound


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["serve", "--device", "cuda:3", "--max-sessions", "2"], "duplexd serve: error: --device cuda:3: this machine"),
        (["infer", "in.wav", "out.wav", "--device", "npu"], "duplexd infer: error: --device npu: not a device name"),
    ],
)
def test_the_installed_command(tmp_path, argv, expected):
    """The console script itself, as a user runs it."""
    command = shutil.which("duplexd", path=str(Path(sys.executable).parent)) or "duplexd"
    proc = subprocess.run([command, *argv], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(expected), proc.stderr
    assert "Traceback" not in proc.stderr


def test_transcribe_without_transformers(tmp_path):
    """`--transcribe` where transformers cannot be imported (a package on the path that fails to import, as a
    missing one does): the one line names the flag and the extra, before anything is loaded."""
    stub = tmp_path / "stub" / "transformers"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('No module named transformers (simulated)')\n")
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEXD_")}
    env.update(PYTHONPATH=str(tmp_path / "stub"), DUPLEXD_CACHE=str(cache), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "duplexd", "serve", "--transcribe", "demo", "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        timeout=120,
    )
    last = proc.stderr.strip().splitlines()[-1]
    expected = "--transcribe demo: the Gemma 4 transcriber needs transformers: pip install 'duplexd[gemma]'"
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert last == f"duplexd serve: error: {expected}", proc.stderr
    assert not cache.exists()  # nothing written, nothing loaded
