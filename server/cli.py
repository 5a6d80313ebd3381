"""`duplexd serve`: flags (each also a `DUPLEXD_*` variable), model loading before the port is bound, uvicorn.

Only argparse is imported at module level, so other `duplexd` commands do not pay for FastAPI and uvicorn.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger("duplexd.server")

# flag -> settings field, for flags whose value is passed through as is
_FIELDS = ("host", "port", "ssl_certfile", "ssl_keyfile", "moshi_weight", "mimi_weight", "tokenizer", "config",
           "hf_repo", "mimi_preset", "random_weights", "dtype", "max_sessions", "kv_memory", "max_pending_frames",
           "max_output_frames", "api_key", "allowed_origins", "max_session_seconds", "idle_timeout", "send_timeout",
           "max_message_bytes", "ws_ping_interval", "ws_ping_timeout", "log_level", "instance_name", "static")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over WebSockets (Kyutai protocol and OpenAI Realtime)",
                       description="Every option can also be set as DUPLEXD_<NAME> (e.g. DUPLEXD_PORT, "
                       "DUPLEXD_API_KEY, DUPLEXD_DEVICES=cuda:0,cuda:1); flags win over the environment.")
    net = p.add_argument_group("network")
    net.add_argument("--host", help="address to bind (default 127.0.0.1)")
    net.add_argument("--port", type=int, help="port (default 8998)")
    net.add_argument("--ssl", metavar="DIR", help="serve HTTPS/WSS with DIR/cert.pem and DIR/key.pem")
    net.add_argument("--ssl-certfile", help="TLS certificate (PEM)")
    net.add_argument("--ssl-keyfile", help="TLS private key (PEM)")
    model = p.add_argument_group("model (default: the demo model, on the CPU)")
    model.add_argument("--moshi-weight", help="LM weights: path, hf://org/repo/file or repo id")
    model.add_argument("--mimi-weight", help="Mimi weights")
    model.add_argument("--tokenizer", help="sentencepiece text tokenizer")
    model.add_argument("--config", help="reference config.json for the LM")
    model.add_argument("--hf-repo", help="take every file not given from this Hugging Face repo")
    model.add_argument("--mimi-preset", choices=("mimi", "demo"), help="Mimi architecture (default mimi)")
    model.add_argument("--random-weights", metavar="PRESET",
                       help="serve an LM preset (moshi-7b, demo) and its Mimi with random weights drawn on the "
                       "device: no files, no download; it speaks noise (for capacity tests)")
    model.add_argument("--device", action="append", dest="devices",
                       help="device to run an engine on; repeat or comma-separate for several (default cpu)")
    model.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                       help="LM weight dtype (default auto: bfloat16 on CUDA, float32 on CPU)")
    model.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None,
                       help="run CUDA steps eagerly")
    cap = p.add_argument_group("capacity and limits")
    cap.add_argument("--max-sessions", type=int, help="session slots per device (default 4)")
    cap.add_argument("--kv-memory", help="KV cache memory per device, e.g. 40GiB (default: engine's choice)")
    cap.add_argument("--max-pending-frames", type=int, help="input frames queued per session (default 25 = 2 s)")
    cap.add_argument("--max-output-frames", type=int, help="output frames queued per session (default 50 = 4 s)")
    cap.add_argument("--max-session-seconds", type=float, help="maximum session length (default 360)")
    cap.add_argument("--idle-timeout", type=float, help="close a session after this many silent seconds (30)")
    cap.add_argument("--send-timeout", type=float, help="close a client whose socket blocks a send this long (10)")
    cap.add_argument("--max-message-bytes", type=int, help="largest client message (default 1048576)")
    cap.add_argument("--ws-ping-interval", type=float, help="keep-alive ping interval in seconds (10)")
    cap.add_argument("--ws-ping-timeout", type=float, help="close when a ping is unanswered this long (20)")
    acc = p.add_argument_group("access")
    acc.add_argument("--api-key", help="require this key (Authorization: Bearer, kyutai-api-key, ?api_key=)")
    acc.add_argument("--allowed-origins", help="comma-separated browser origins allowed to connect (default any)")
    p.add_argument("--static", metavar="DIR", help="serve DIR at / (default auto: the bundled web client; none)")
    p.add_argument("--instance-name", help="name announced in the Kyutai metadata message")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="log level (default info)")
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace):
    """ServerSettings from the flags given (others from DUPLEXD_* or defaults); `ConfigError` when invalid."""
    from pydantic import ValidationError

    from duplexd.engine.config import ConfigError

    from .settings import ServerSettings

    given = {name: getattr(args, name) for name in _FIELDS if getattr(args, name, None) is not None}
    if getattr(args, "devices", None):
        given["devices"] = ",".join(args.devices)
    if getattr(args, "cuda_graphs", None) is not None:
        given["cuda_graphs"] = args.cuda_graphs
    if getattr(args, "ssl", None):
        given.setdefault("ssl_certfile", str(Path(args.ssl) / "cert.pem"))
        given.setdefault("ssl_keyfile", str(Path(args.ssl) / "key.pem"))
    try:
        return ServerSettings(**given)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "settings"
        raise ConfigError(f"bad setting {field}: {err['msg']}") from None


def run(args: argparse.Namespace) -> int:
    """Load the model (errors exit before the port is bound), then serve until interrupted."""
    import uvicorn

    from duplexd.engine.errors import CheckpointError

    from .app import create_app
    from .runtime import load_runtime

    settings = settings_from_args(args)
    logging.getLogger().setLevel(settings.log_level.upper())
    for path in (settings.ssl_certfile, settings.ssl_keyfile):
        if path and not Path(path).is_file():
            raise CheckpointError(f"TLS file not found: {path}")
    if settings.static not in ("auto", "none") and not Path(settings.static).is_dir():
        raise CheckpointError(f"static directory not found: {settings.static}")
    url = f"{settings.scheme}://{settings.host}:{settings.port}"
    if settings.random_weights:
        what = f"the {settings.random_weights} preset with RANDOM weights (no checkpoint: it speaks noise)"
    else:
        what = "the DEMO model (random weights: it speaks noise)" if settings.demo else "the given weights"
    logger.info("duplexd serve: %s on %s, %d sessions per device, at %s", what, ",".join(settings.devices),
                settings.max_sessions, url)
    runtime = load_runtime(settings)
    app = create_app(settings, runtime)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile, log_config=None, log_level=settings.log_level, lifespan="on",
        ws_max_size=max(4 * settings.max_message_bytes, 16 << 20), ws_ping_interval=settings.ws_ping_interval,
        ws_ping_timeout=settings.ws_ping_timeout, timeout_graceful_shutdown=5,
    )
    logger.info("listening on %s (Kyutai: %s/api/chat, Realtime: %s/v1/realtime); warming up", url,
                url.replace("http", "ws", 1), url.replace("http", "ws", 1))
    uvicorn.Server(config).run()
    return 0
