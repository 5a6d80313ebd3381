"""Server settings: one pydantic-settings model, filled from `duplexd serve` flags and `DUPLEXD_*` variables.

Flags win over the environment, the environment over the defaults, so containers can be configured without a
command line and a developer can still override one value.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

FRAME_RATE = 12.5  # Mimi frames per second (80 ms each)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
# The LM presets `--random-weights` serves, each with the Mimi preset its codebooks match.
RANDOM_WEIGHTS_MIMI = {"moshi-7b": "mimi", "demo": "demo"}
_WEIGHT_FILES = ("moshi_weight", "mimi_weight", "tokenizer", "config", "hf_repo")


def parse_bytes(value: str | int | None) -> int | None:
    """`8GiB`, `500MB`, `1.5g` or a plain number of bytes."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 8GiB, 500MB or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class ServerSettings(BaseSettings):
    """Everything `duplexd serve` can be told; each field is also `DUPLEXD_<NAME>` in the environment."""

    model_config = SettingsConfigDict(env_prefix="DUPLEXD_", extra="ignore")

    # network
    host: str = "127.0.0.1"
    port: int = Field(8998, ge=0, le=65535)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # model
    moshi_weight: str | None = None
    mimi_weight: str | None = None
    tokenizer: str | None = None
    config: str | None = None
    hf_repo: str | None = None
    mimi_preset: Literal["mimi", "demo"] = "mimi"
    random_weights: str | None = None  # an LM preset served with random weights (no files, no download)
    devices: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["cpu"])
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    cuda_graphs: bool = True
    # capacity
    max_sessions: int = Field(4, ge=1)
    kv_memory: int | None = None  # bytes of KV cache per device; None: the engine's default
    max_pending_frames: int = Field(25, ge=1)  # engine inbox per session (2 s)
    max_output_frames: int = Field(50, ge=1)  # engine outbox per session (4 s); the oldest is dropped beyond it
    # access
    api_key: str | None = None
    allowed_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)  # empty: any origin
    # limits and timeouts
    max_session_seconds: float = Field(360.0, gt=0)
    idle_timeout: float = Field(30.0, gt=0)  # seconds without a client message
    send_timeout: float = Field(10.0, gt=0)  # a send blocked this long means the client stopped reading
    max_message_bytes: int = Field(1 << 20, ge=1024)
    ws_ping_interval: float = Field(10.0, gt=0)
    ws_ping_timeout: float = Field(20.0, gt=0)
    late_frame_seconds: float = Field(0.08, gt=0)  # input-to-output delay beyond which an output frame is late
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    instance_name: str = "duplexd"
    static: str = "auto"  # browser client at `/`: auto (the bundled one, if installed), none, or a directory

    @field_validator("devices", "allowed_origins", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("kv_memory", mode="before")
    @classmethod
    def _bytes(cls, value: object) -> object:
        return parse_bytes(value) if isinstance(value, str) else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> ServerSettings:
        if not self.devices:
            raise ValueError("give at least one device")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("TLS needs both a certificate and a key file")
        if self.random_weights is not None:
            self._check_random_weights()
        return self

    def _check_random_weights(self) -> None:
        """A preset with random weights takes no files, and only the Mimi its LM's codebooks match."""
        preset = self.random_weights
        if preset not in RANDOM_WEIGHTS_MIMI:
            raise ValueError(f"unknown preset {preset!r} for random weights; choose from {sorted(RANDOM_WEIGHTS_MIMI)}")
        given = [name for name in _WEIGHT_FILES if getattr(self, name)]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(f"random weights need no files; leave out {flags}")
        mimi = RANDOM_WEIGHTS_MIMI[preset]
        if "mimi_preset" in self.model_fields_set and self.mimi_preset != mimi:
            raise ValueError(f"the {preset} LM pairs with Mimi preset {mimi!r}, not {self.mimi_preset!r}")

    @property
    def demo(self) -> bool:
        given = (self.hf_repo, self.moshi_weight, self.mimi_weight, self.tokenizer, self.random_weights)
        return not any(given)

    @property
    def max_session_frames(self) -> int:
        return math.ceil(self.max_session_seconds * FRAME_RATE)

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"
