"""Live: `duplexd serve` drains on SIGTERM. A session opened during the drain is refused with 1013 and its message;
a second signal ends the drain at once: the open session gets 1001 and the reason, and the process exits 0 without
a traceback, long before the drain timeout."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx2
import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from duplexd.clients.realtime import AUDIO_DELTAS, append_event

from .live_server import running_server

DRAIN = 60.0  # far longer than the test: only the second signal can end the drain this soon


async def open_session(url: str):
    ws = await connect(url, subprotocols=["realtime"])  # type: ignore[list-item]
    return ws, json.loads(await ws.recv())


async def scenario(server) -> None:
    url = server.url.replace("http", "ws", 1) + "/v1/realtime"
    ws, created = await open_session(url)
    assert created["type"] == "session.created", created
    frame = append_event(np.zeros(1920, dtype=np.float32))
    for _ in range(3):
        await ws.send(frame)
    while json.loads(await ws.recv())["type"] not in AUDIO_DELTAS:  # talking
        pass

    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while True:  # the signal handler runs between two of the server's bytecodes: at once, but not synchronously
        ready = await asyncio.to_thread(httpx2.get, f"{server.url}/ready", timeout=5)
        if ready.json().get("draining"):
            break
        assert time.monotonic() < deadline, ready.text
        await asyncio.sleep(0.05)
    assert ready.status_code == 503 and ready.json()["reason"] == "draining" and ready.json()["open_sessions"] == 1
    assert (await asyncio.to_thread(httpx2.get, f"{server.url}/health", timeout=5)).status_code == 200
    metrics = (await asyncio.to_thread(httpx2.get, f"{server.url}/metrics", timeout=5)).text
    assert "\nduplexd_draining 1.0\n" in metrics

    refused, error = await open_session(url)  # refused: error event, then 1013
    assert error["type"] == "error" and error["error"]["code"] == "server_draining", error
    try:
        await refused.recv()
    except ConnectionClosed:
        pass
    assert refused.close_code == 1013 and "draining" in (refused.close_reason or ""), refused.close_reason

    await ws.send(frame)  # the open session still talks during the drain
    while json.loads(await ws.recv())["type"] not in AUDIO_DELTAS:
        pass
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)  # the second signal: close now
    last_error = None
    try:
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), 15))
            if event["type"] == "error":
                last_error = event["error"]
    except ConnectionClosed:
        pass
    assert ws.close_code == 1001 and "server going away" in (ws.close_reason or ""), (ws.close_code, ws.close_reason)
    assert last_error and last_error["code"] == "server_shutdown", last_error
    assert await asyncio.to_thread(server.proc.wait, 20) == 0
    assert time.monotonic() - started < 15


def test_sigterm_drains_refuses_new_sessions_and_a_second_signal_ends_it(tmp_path):
    log = tmp_path / "serve.log"
    env = {"DUPLEXD_CACHE": str(tmp_path / "cache")}
    with running_server(log, "--max-sessions", "2", "--drain-timeout", str(DRAIN), env=env) as server:
        asyncio.run(asyncio.wait_for(scenario(server), 90))
    text = log.read_text()
    assert "again: ending the drain now" in text and "drain cut short" in text, text[-3000:]
    assert "Traceback" not in text and "Finished server process" in text, text[-3000:]
