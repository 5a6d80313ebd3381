"""`duplexd serve`: flags derived from `ServerSettings` (each also a `DUPLEXD_*` variable), checks, model loading
before the port listens, uvicorn.

Each flag is built from its settings field (name, help, default, `Literal` choices), so an option is written once,
in `settings`. Only argparse and the settings model (pydantic) are imported at module level, so other `duplexd`
commands do not pay for FastAPI and uvicorn.
"""

from __future__ import annotations

import argparse
import logging
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import ByteSize
from pydantic.fields import FieldInfo

from .core.settings import ServerSettings, env_name, option_name

logger = logging.getLogger("duplexd.server")


def _choices(annotation: Any) -> tuple[str, ...] | None:
    """The values of a `Literal` annotation (also inside `X | None`)."""
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if (found := _choices(arg)) is not None:
                return found
    return None


def _default(field: FieldInfo) -> str | None:
    value = field.get_default(call_default_factory=True)
    if value is None or value == [] or isinstance(value, bool):
        return None
    if isinstance(value, list):
        return ",".join(value)
    if isinstance(value, ByteSize):
        return value.human_readable(decimal=False, separator="").replace(".0", "")
    return str(value)


def _metavar(name: str, annotation: Any) -> str:
    if annotation in (int, float):
        return "N"
    return name.upper()


def _add_setting(group: argparse._ArgumentGroup, name: str, field: FieldInfo) -> None:
    """One flag for one settings field: name, help and default from the field, choices from its `Literal`."""
    flag = option_name(name)
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    default = _default(field)
    env = env_name(name) + ("=false" if flag.startswith("--no-") else "")
    help_text = (field.description or "") + (f" (default {default})" if default else "") + f"; {env}"
    kwargs: dict[str, Any] = {"dest": name, "default": None, "help": help_text.replace("%", "%%")}
    if field.annotation is bool:
        kwargs["action"] = "store_false" if flag.startswith("--no-") else "store_true"
    else:
        if typing.get_origin(field.annotation) is list:
            kwargs["action"] = "append"  # repeated, or comma-separated, or both
        kwargs["choices"] = _choices(field.annotation)
        kwargs["metavar"] = extra.get("metavar") or (None if kwargs["choices"] else _metavar(name, field.annotation))
    group.add_argument(flag, **kwargs)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Every option can also be set as DUPLEXD_<NAME> (e.g. DUPLEXD_PORT, DUPLEXD_API_KEY, "
        "DUPLEXD_DEVICES=cuda:0,cuda:1); flags win over the environment."
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, field in ServerSettings.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        title = str(extra.get("group") or "server")
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        _add_setting(groups[title], name, field)
    groups["network"].add_argument("--ssl", metavar="DIR", help="serve HTTPS/WSS with DIR/cert.pem and DIR/key.pem")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """ServerSettings from the flags given (others from DUPLEXD_* or defaults); `SettingsError` when invalid."""
    given = {name: getattr(args, name) for name in ServerSettings.model_fields if getattr(args, name, None) is not None}
    if isinstance(given.get("devices"), list):
        given["devices"] = ",".join(given["devices"])
    if isinstance(given.get("allowed_origins"), list):
        given["allowed_origins"] = ",".join(given["allowed_origins"])
    if getattr(args, "ssl", None):
        given.setdefault("ssl_certfile", str(Path(args.ssl) / "cert.pem"))
        given.setdefault("ssl_keyfile", str(Path(args.ssl) / "key.pem"))
    return ServerSettings.from_options(given)


def run(args: argparse.Namespace) -> int:
    """Check everything that needs no model and bind the port, load the model, then serve until interrupted."""
    import uvicorn

    from duplexd.engine.errors import InputRefused

    from .app import create_app
    from .core.drain import DrainingServer
    from .core.front_door import FrontDoor
    from .core.preflight import preflight, refused
    from .core.runtime import load_runtime

    settings = settings_from_args(args)
    logging.getLogger().setLevel(settings.log_level.upper())
    sock = preflight(settings)
    try:
        url = f"{settings.scheme}://{settings.host}:{settings.port}"
        if settings.random_weights:
            what = f"the {settings.random_weights} preset with RANDOM weights (no checkpoint: it speaks noise)"
        else:
            what = "a DEMO model (random weights: its output is noise)" if settings.demo_model else "the given weights"
        logger.info(
            "duplexd serve: %s on %s, %d sessions per device, at %s",
            what,
            ",".join(settings.devices),
            settings.max_sessions,
            url,
        )
        try:
            runtime = load_runtime(settings)
        except InputRefused as e:  # what only loading shows (a file that does not match the model)
            raise refused(settings, e) from None
        app = create_app(settings, runtime)
        door = FrontDoor.from_settings(settings, app.state.context.metrics)  # header timeout, connection caps
        door.check_fd_limit()
        http, ws = door.protocols()
        config = uvicorn.Config(
            app,
            http=http,
            ws=ws,
            host=settings.host,
            port=settings.port,
            ssl_certfile=settings.ssl_certfile,
            ssl_keyfile=settings.ssl_keyfile,
            log_config=None,
            log_level=settings.log_level,
            lifespan="on",
            ws_max_size=max(4 * settings.max_message_bytes, 16 << 20),
            ws_ping_interval=settings.ws_ping_interval,
            ws_ping_timeout=settings.ws_ping_timeout,
            timeout_graceful_shutdown=5,
        )
        logger.info(
            "listening on %s (Kyutai: %s/api/chat, Realtime: %s/v1/realtime); warming up",
            url,
            url.replace("http", "ws", 1),
            url.replace("http", "ws", 1),
        )
        # returns after the drain
        DrainingServer(config, app.state.context.drain, settings.drain_timeout).run(sockets=[sock])
    finally:
        sock.close()
    return 0
