"""Ephemeral client keys (`ek_...`), minted by `POST /v1/realtime/client_secrets` with the server's key.

A web page must not hold the server's API key, and OpenAI's browser SDK refuses any key that does not start with
`ek_`; an app server mints one per page for a few minutes, scoped to a session configuration that the sessions
opened with it start from. A key may open several sessions until it expires (as OpenAI's do). Keys live in this
process's memory: behind a balancer, mint and use them against the same replica (sticky sessions) or run one.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

PREFIX = "ek_"


@dataclass(frozen=True)
class ClientSecret:
    value: str
    expires_at: float  # unix time
    session: dict[str, Any] = field(default_factory=dict)  # the session.update applied to its sessions first


class ClientSecrets:
    """The keys minted and not yet expired."""

    def __init__(self) -> None:
        self._keys: dict[str, ClientSecret] = {}

    def mint(self, seconds: float, session: dict[str, Any] | None = None) -> ClientSecret:
        self._forget_expired()
        key = ClientSecret(PREFIX + secrets.token_urlsafe(24), time.time() + seconds, dict(session or {}))
        self._keys[key.value] = key
        return key

    def get(self, value: str | None) -> ClientSecret | None:
        """The live key `value` names, or None (unknown or expired)."""
        if not value or not value.startswith(PREFIX):
            return None
        key = self._keys.get(value)
        if key is None or key.expires_at <= time.time():
            self._keys.pop(value, None)
            return None
        return key

    def _forget_expired(self) -> None:
        now = time.time()
        for value in [v for v, k in self._keys.items() if k.expires_at <= now]:
            del self._keys[value]
