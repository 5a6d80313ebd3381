"""Who may connect: an optional API key and an optional browser-origin allow-list.

The key can come as `Authorization: Bearer KEY`, a `kyutai-api-key` or `x-api-key` header, an `api_key` or
`auth_id` (moshi-server's) query parameter (browsers cannot set WebSocket headers) or the
`openai-insecure-api-key.KEY` subprotocol (what OpenAI's browser SDK sends). The Realtime API also takes the
ephemeral `ek_` keys minted from the server's key (`client_secrets.py`). Requests without an `Origin` header are not
from a browser page and pass the origin check.
"""

from __future__ import annotations

import hmac

from starlette.requests import HTTPConnection

from .client_secrets import ClientSecrets

KEY_SUBPROTOCOL = "openai-insecure-api-key."


def offered_subprotocols(conn: HTTPConnection) -> list[str]:
    header = conn.headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in header.split(",") if p.strip()]


def presented_key(conn: HTTPConnection) -> str | None:
    auth = conn.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    for header in ("kyutai-api-key", "x-api-key"):
        if conn.headers.get(header):
            return conn.headers[header]
    for param in ("api_key", "auth_id"):  # auth_id: moshi-server's name
        if conn.query_params.get(param):
            return conn.query_params[param]
    for proto in offered_subprotocols(conn):
        if proto.startswith(KEY_SUBPROTOCOL):
            return proto[len(KEY_SUBPROTOCOL) :]
    return None


def key_ok(conn: HTTPConnection, api_key: str | None, minted: ClientSecrets | None = None) -> bool:
    """The server's key, or (where `minted` is given: the Realtime API) a live ephemeral key minted from it."""
    if not api_key:
        return True
    given = presented_key(conn)
    if given is None:
        return False
    if minted is not None and minted.get(given) is not None:
        return True
    return hmac.compare_digest(given.encode(), api_key.encode())


def origin_ok(conn: HTTPConnection, allowed: list[str]) -> bool:
    origin = conn.headers.get("origin")
    if not allowed or origin is None or "*" in allowed:
        return True
    return origin.rstrip("/") in {a.rstrip("/") for a in allowed}


def access_denied(
    conn: HTTPConnection, api_key: str | None, allowed: list[str], minted: ClientSecrets | None = None
) -> tuple[str, str] | None:
    """(error code, message) saying why this connection may not proceed, or None."""
    if not key_ok(conn, api_key, minted):
        return "invalid_api_key", "missing or wrong API key"
    if not origin_ok(conn, allowed):
        return "origin_not_allowed", f"origin {conn.headers.get('origin')} is not allowed"
    return None
