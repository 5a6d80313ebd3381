"""What `duplexd serve` checks before it loads a model: devices, files, TLS, the static folder, the voices, the port.

Each refusal is a `SettingsError` naming the flag (or `DUPLEXD_*` variable) and the fix, raised in seconds rather
than after minutes of loading. The port is bound here and the socket handed to uvicorn, so "in use" is known before
loading and cannot change afterwards.
"""

from __future__ import annotations

import errno
import json
import socket
import ssl
from pathlib import Path

from safetensors import SafetensorError, safe_open

from duplexd.engine.agent.demo_llm import check_demo_llm
from duplexd.engine.devices import check_devices, check_kv_dtype
from duplexd.engine.errors import CheckpointError, InputRefused
from duplexd.engine.models.config import ConfigError, LMConfig
from duplexd.engine.persona.voices import AUDIO_SUFFIXES, PRESET_SUFFIX, voice_files
from duplexd.engine.transcription.transcriber import import_transformers
from duplexd.engine.tts.config import tts_config_from_dict
from duplexd.engine.tts.demo import demo_tts_folder
from duplexd.engine.tts.model import read_config
from duplexd.engine.weights.hub import hub_repo
from duplexd.engine.weights.model_files import check_model_files

from .agents import DEMO as DEMO_LLM
from .agents import not_an_stt_model
from .cloning import check_cloning
from .runtime import resolve_files
from .settings import ServerSettings, SettingsError
from .speech import DEMO_TTS, cfg_table_value, default_voice, voice_names

AUDIO_TOWER = ("model.audio_tower.", "audio_tower.")  # as engine.gemma4_checkpoint reads them


def refused(settings: ServerSettings, error: InputRefused) -> SettingsError:
    """An engine's refusal of an input, named as this server was given it (flag or variable)."""
    return SettingsError(f"{settings.option_name(error.option)} {error}" if error.option else str(error))


def check_transcriber(ref: str) -> None:
    """The transcriber needs transformers, and its model must be `demo`, a hub repo id, or a folder holding a
    Gemma 4 checkpoint with an audio tower (checked from config.json and the weights' names: no tensor is read).
    The reference first, then the import (seconds)."""
    folder = Path(ref).expanduser()
    if ref == "demo":
        pass
    elif folder.is_dir():
        why = _not_gemma4_with_audio(folder)
        if why:
            raise CheckpointError(f"{ref}: {why}", "transcribe")
    elif hub_repo(ref) is None:
        raise CheckpointError(f"{ref}: not a folder, a Hugging Face repo id or demo", "transcribe")
    try:
        import_transformers()
    except CheckpointError as e:
        raise CheckpointError(f"{ref}: {e}", "transcribe") from None


def check_tts(settings: ServerSettings) -> None:
    """`--tts` is demo-tts, a hub repo id, or a folder holding a Kyutai TTS config; `--tts-voices` a folder or a
    hub repo id; and for a local model, its `cfg` table holds `--tts-cfg-coef` and its voices the default voice
    (from config.json and the file names: no tensor is read; a hub model's are checked as it loads)."""
    voices = settings.tts_voices
    if voices is not None and not Path(voices).is_dir() and hub_repo(voices) is None:
        raise CheckpointError(f"{voices}: not a folder or a Hugging Face repo id", "tts_voices")
    ref = settings.tts
    if ref is None or (ref != DEMO_TTS and hub_repo(ref) is not None):
        return
    folder = demo_tts_folder() if ref == DEMO_TTS else Path(ref)
    try:
        tts = tts_config_from_dict(read_config(folder))
    except ConfigError as e:
        raise CheckpointError(f"{folder}: {e}", "tts") from None
    except CheckpointError as e:
        raise CheckpointError(str(e), "tts") from None
    assert tts is not None
    cfg_table_value(settings, tts)
    if voices is None or hub_repo(voices) is None:
        folder = Path(voices) if voices is not None else folder / "voices"
        names = voice_names(folder, tts.voice_suffix) if folder.is_dir() else []
        if not names:
            raise CheckpointError(f"{folder} holds no voice of this model (*{tts.voice_suffix} files)", "tts_voices")
        default_voice(settings, names)


def _not_gemma4_with_audio(folder: Path) -> str | None:
    """Why `folder` is not a Gemma 4 checkpoint with an audio tower in Hugging Face layout, or None."""
    config = folder / "config.json"
    if not config.is_file():
        return "not a Gemma 4 checkpoint: no config.json in the folder"
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        return f"not a Gemma 4 checkpoint: cannot read config.json ({e})"
    kind = cfg.get("model_type") if isinstance(cfg, dict) else None
    if not isinstance(kind, str) or not kind.startswith("gemma4"):
        return f"not a Gemma 4 checkpoint: config.json has model_type {kind!r}"
    if not cfg.get("audio_config"):
        return "this Gemma 4 has no audio tower (config.json has no audio_config); E2B and E4B have one"
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = list(json.loads(index.read_text()).get("weight_map", {}))
        else:
            shards = sorted(folder.glob("*.safetensors"))
            if not shards:
                return "no weights: neither model.safetensors nor model.safetensors.index.json in the folder"
            names = []
            for shard in shards:
                with safe_open(str(shard), framework="pt") as f:
                    names += list(f.keys())
    except (OSError, ValueError, AttributeError, SafetensorError) as e:
        return f"cannot read the weights' names ({type(e).__name__}: {e})"
    if not any(name.startswith(AUDIO_TOWER) for name in names):
        return f"its weights hold no audio tower ({AUDIO_TOWER[0]}*): not a Gemma 4 E2B or E4B?"
    return None


def check_tls(settings: ServerSettings) -> None:
    cert, key = settings.ssl_certfile, settings.ssl_keyfile
    if not cert or not key:
        return
    for field, path in (("ssl_certfile", cert), ("ssl_keyfile", key)):
        if not Path(path).is_file():
            raise SettingsError(f"{settings.option_name(field)} {path}: file not found")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as e:
        raise SettingsError(
            f"{settings.option_name('ssl_certfile')} {cert} / {settings.option_name('ssl_keyfile')} "
            f"{key}: not a PEM certificate and its private key ({e.strerror or e})"
        ) from None


def check_static(settings: ServerSettings) -> None:
    if settings.static not in ("auto", "none") and not Path(settings.static).is_dir():
        raise SettingsError(
            f"{settings.option_name('static')} {settings.static}: directory not found (give a directory, auto or none)"
        )


def check_voices_folder(settings: ServerSettings) -> None:
    """`--voices` must be a folder holding at least one voice file (each file is checked when it is loaded)."""
    if settings.voices is None:
        return
    flag, folder = settings.option_name("voices"), Path(settings.voices).expanduser()
    if not folder.is_dir():
        raise SettingsError(f"{flag} {settings.voices}: folder not found")
    if not voice_files(folder):
        kinds = ", ".join((PRESET_SUFFIX, *AUDIO_SUFFIXES))
        raise SettingsError(f"{flag} {settings.voices}: the folder holds no voice ({kinds} files)")


def check_voices_model(settings: ServerSettings, cfg: LMConfig | None) -> None:
    """Voices condition a PersonaPlex model only (`cfg` None: random weights, whose presets are not one)."""
    if settings.voices is None or (cfg is not None and cfg.predicts_user_audio):
        return
    if settings.demo:
        model = "the demo model"
    else:
        model = f"the {settings.random_weights} preset" if settings.random_weights else "the LM"
    why = "" if cfg is None else f" (its DepFormer predicts {cfg.dep_q} of its {cfg.n_q} audio codebooks, not all)"
    raise SettingsError(
        f"{settings.option_name('voices')} {settings.voices}: voices need a PersonaPlex model, and {model} is "
        f"not one{why}"
    )


def check_agents_model(settings: ServerSettings, cfg: LMConfig | None) -> None:
    """Voice agents hear through a Kyutai STT main model (`cfg` None: random weights, a preset's)."""
    if settings.llm is None or (cfg is not None and cfg.text_only):
        return
    model = "the demo model" if settings.demo else (settings.random_weights or "the LM")
    raise not_an_stt_model(settings.llm, model)


def bind(settings: ServerSettings) -> socket.socket:
    """The server's socket, bound (not yet listening) to host and port."""
    host, port = settings.host, settings.port
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)  # as uvicorn does
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart despite connections in TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if isinstance(e, socket.gaierror):
            raise SettingsError(
                f"{settings.option_name('host')} {host}: not a known host name or address ({e.strerror})"
            ) from None
        if e.errno == errno.EADDRINUSE:
            raise SettingsError(
                f"{settings.option_name('port')} {port}: {host}:{port} is already in use; stop what "
                "listens there or pick another port"
            ) from None
        if e.errno == errno.EACCES:
            raise SettingsError(
                f"{settings.option_name('port')} {port}: not allowed to bind {host}:{port}; pick a port above 1023"
            ) from None
        raise SettingsError(
            f"{settings.option_name('host')} {host}: cannot bind {host}:{port} ({e.strerror})"
        ) from None
    sock.set_inheritable(True)
    return sock


def preflight(settings: ServerSettings) -> socket.socket:
    """Every check that needs no model, cheapest first; returns the bound socket. Raises `SettingsError`."""
    try:
        for device in check_devices(settings.devices, "devices"):
            check_kv_dtype(settings.kv_dtype, device)
        if settings.transcribe_device is not None:
            check_devices([settings.transcribe_device], "transcribe_device")
        if settings.transcribe is not None:
            check_transcriber(settings.transcribe)
        if settings.tts_device is not None:
            check_devices([settings.tts_device], "tts_device")
        check_tts(settings)
        check_cloning(settings)
        if settings.llm == DEMO_LLM:
            check_demo_llm()
    except InputRefused as e:
        raise refused(settings, e) from None
    check_tls(settings)
    check_static(settings)
    check_voices_folder(settings)
    sock = bind(settings)
    try:
        cfg = None if settings.random_weights is not None else check_model_files(resolve_files(settings))
        if cfg is not None and cfg.speaks_text:
            raise CheckpointError("the model is a text-to-speech model (Kyutai TTS): duplexd does not serve those yet")
        check_voices_model(settings, cfg)
        check_agents_model(settings, cfg)
    except BaseException as e:
        sock.close()
        if isinstance(e, InputRefused):
            raise refused(settings, e) from None
        raise
    return sock
