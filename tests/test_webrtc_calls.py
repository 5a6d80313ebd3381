"""WebRTC calls of the Realtime API, end to end: aiortc callers (what OpenAI's WebRTC clients do) against a real
`duplexd serve` over loopback: audio both ways, the events on `oai-events`, both hang-ups, an offer without
candidates, the multipart form with a session, ephemeral keys, bad offers, capacity, and a call that never connects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import numpy as np
import pytest

from .live_server import demo_cache, running_server

pytest.importorskip("aiortc")
from duplexd.clients.webrtc import MIC_RATE, Caller, post  # noqa: E402
from duplexd.server.realtime.webrtc import stack  # noqa: E402

stack.tune(2, ("127.0.0.1",))  # the callers gather on loopback too (aioice leaves it out)

KEY = "rtc-key"
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("webrtc") / "serve.log"
    env = {"DUPLEXD_CACHE": str(demo_cache(tmp_path_factory))}
    args = ("--max-sessions", "2", "--api-key", KEY, "--allowed-origins", ORIGIN, "--webrtc-hosts", "127.0.0.1",
            "--webrtc-connect-timeout", "3", "--webrtc-jitter-frames", "1")  # fmt: skip
    with running_server(log, *args, env=env) as live:
        yield live
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


def speech(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * MIC_RATE)) / MIC_RATE
    return (0.3 * np.sin(2 * np.pi * 220 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def metric(server, name: str) -> float:
    import re  # noqa: PLC0415

    text = post_get(server, "/metrics")
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def post_get(server, path: str) -> str:
    import urllib.request  # noqa: PLC0415

    with urllib.request.urlopen(f"{server.url}{path}", timeout=10) as r:
        return r.read().decode()


def wait_idle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, "duplexd_sessions_active") != 0:
        assert time.monotonic() < deadline, "sessions still open"
        time.sleep(0.05)


@pytest.mark.realtime
def test_a_call_talks_both_ways_and_the_client_hangs_up(server):
    frames_in = metric(server, "duplexd_frames_in_total")

    async def main():
        caller = Caller(speech(3.0))
        answer = await caller.call(f"{server.url}/v1/realtime/calls", KEY, strip_candidates=True)
        assert answer.status == 201, answer.text
        assert answer.headers["content-type"].startswith("application/sdp")
        assert answer.headers["location"] == f"/v1/realtime/calls/{caller.call_id}" and caller.call_id.startswith(
            "rtc_"
        )
        assert "a=candidate" in answer.text and "127.0.0.1" in answer.text
        created = await caller.next_event("session.created")
        assert created["event_id"] and created["session"]["object"] == "realtime.session"
        # what OpenAI's browser SDK sends first: names this server does not serve are accepted and reported
        caller.send({"type": "session.update", "session": {
            "type": "realtime", "model": "gpt-realtime-2.1", "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": 24000}, "transcription": None,
                "turn_detection": {"type": "semantic_vad"}, "noise_reduction": None}},
            "sampling": {"seed": 9}}})  # fmt: skip
        opened = time.monotonic()  # the server takes the microphone from this first event on
        updated = await caller.next_event("session.updated")
        assert updated["session"]["sampling"]["seed"] == 9
        started = await caller.next_event("output_audio_buffer.started")
        caller.send({"type": "session.update", "session": {}})  # more events: the microphone stays taken
        kinds = []
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            with contextlib.suppress(asyncio.TimeoutError):
                kinds.append((await asyncio.wait_for(caller.events.get(), 0.2))["type"])
        assert "response.output_audio.delta" not in kinds  # the speech is on the track
        talked = time.monotonic() - opened
        heard = np.concatenate(caller.heard)
        # what the server's sender reports (RTCP): its own Opus, 32 kb/s mono, under 80 bytes a 20 ms packet
        # (aiortc's own encoder, 96 kb/s stereo, sent ~160 here)
        sent = next(s for s in (await caller.pc.getStats()).values() if s.type == "remote-outbound-rtp")
        assert sent.packetsSent > 50 and sent.bytesSent / sent.packetsSent < 120
        # the tuned jitter buffer, on a live receiver (aiortc's own default holds 4 frames)
        receiver = next(r for r in caller.pc.getReceivers() if r.track.kind == "audio")
        assert receiver._RTCRtpReceiver__jitter_buffer._prefetch == 2
        # what the SDK sends to interrupt the model: its item is truncated to what went out; then retrieved
        caller.send({"type": "output_audio_buffer.clear"})
        await caller.next_event("output_audio_buffer.cleared")
        truncated = await caller.next_event("conversation.item.truncated")
        caller.send({"type": "conversation.item.retrieve", "item_id": truncated["item_id"]})
        retrieved = await caller.next_event("conversation.item.retrieved")
        await caller.hang_up()
        return started, kinds, heard, caller.first_sound is not None, talked, truncated, retrieved["item"]

    started, kinds, heard, sounded, talked, truncated, item = run(main())
    # the caller's microphone reached the model all along (80 ms frames; the jitter buffer and the last frame aside)
    assert metric(server, "duplexd_frames_in_total") - frames_in >= 0.8 * talked / 0.08 - 3
    assert started["response_id"]
    assert "response.output_audio_transcript.delta" in kinds
    assert sounded and len(heard) > MIC_RATE and np.abs(heard).max() > 0.01  # the model's speech arrived
    assert truncated["audio_end_ms"] > 1000 and item["id"] == truncated["item_id"] and item["role"] == "assistant"
    wait_idle(server)  # the client's hang-up freed the slot
    assert metric(server, 'duplexd_sessions_total{protocol="webrtc"}') >= 1


def test_the_server_hangs_up_with_a_last_event_and_a_second_call_follows(server):
    async def main():
        caller = Caller(speech(5.0))
        session = {"type": "realtime", "model": "duplexd", "sampling": {"seed": 4}}
        answer = await caller.call(f"{server.url}/v1/realtime/calls", KEY, session=session)
        assert answer.status == 201, answer.text
        created = await caller.next_event("session.created")
        assert created["session"]["sampling"]["seed"] == 4  # the form's session, applied before the greeting
        await caller.next_event("output_audio_buffer.started")
        hung = await asyncio.to_thread(post, f"{server.url}/v1/realtime/calls/{caller.call_id}/hangup", b"",
                                       {"Authorization": f"Bearer {KEY}"})  # fmt: skip
        assert hung.status == 200
        while (event := await asyncio.wait_for(caller.events.get(), 5))["type"] != "error":
            pass
        await asyncio.wait_for(caller.closed.wait(), 5)
        await caller.hang_up()
        again = await asyncio.to_thread(post, f"{server.url}/v1/realtime/calls/{caller.call_id}/hangup", b"",
                                        {"Authorization": f"Bearer {KEY}"})  # fmt: skip
        second = Caller(speech(2.0))
        assert (await second.call(f"{server.url}/v1/realtime/calls", KEY)).status == 201
        await second.next_event("session.created")
        await second.next_event("output_audio_buffer.started")
        await second.hang_up()
        return event, again

    event, again = run(main())
    assert event["error"]["code"] == "hangup"
    assert again.status == 404 and again.json()["error"]["code"] == "call_id_not_found"
    wait_idle(server)


def test_ephemeral_keys_open_calls_and_carry_their_session(server):
    async def main():
        minted = await asyncio.to_thread(
            post, f"{server.url}/v1/realtime/client_secrets",
            json.dumps({"expires_after": {"anchor": "created_at", "seconds": 60},
                        "session": {"type": "realtime", "sampling": {"seed": 77}}}).encode(),
            {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )  # fmt: skip
        assert minted.status == 200, minted.text
        key = minted.json()
        assert key["value"].startswith("ek_") and key["expires_at"] > time.time() + 50
        caller = Caller(speech(2.0))
        answer = await caller.call(f"{server.url}/v1/realtime/calls", key["value"])
        assert answer.status == 201, answer.text
        created = await caller.next_event("session.created")
        await caller.hang_up()
        refused = await asyncio.to_thread(
            post, f"{server.url}/v1/realtime/client_secrets", b"{}", {"Authorization": f"Bearer {key['value']}"}
        )  # an ephemeral key cannot mint another
        beta = await asyncio.to_thread(
            post, f"{server.url}/v1/realtime/sessions", b'{"model": "gpt-4o-realtime-preview", "voice": "verse"}',
            {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )  # fmt: skip
        return created, refused, beta

    created, refused, beta = run(main())
    assert created["session"]["sampling"]["seed"] == 77
    assert refused.status == 401
    assert beta.status == 200 and beta.json()["client_secret"]["value"].startswith("ek_")
    wait_idle(server)


def test_bad_offers_and_keys_get_openai_errors_and_the_server_keeps_serving(server):
    url = f"{server.url}/v1/realtime/calls"
    auth = {"Authorization": f"Bearer {KEY}"}
    cases = [
        (post(url, b"v=0\r\nthis is not sdp\r\n", {**auth, "Content-Type": "application/sdp"}), 400, "invalid_offer"),
        (post(url, b"", {**auth, "Content-Type": "application/sdp"}), 400, "invalid_offer"),
        (post(url, b"{}", {**auth, "Content-Type": "application/json"}), 415, "unsupported_content_type"),
        (post(url, b"v=0\r\n", {"Authorization": "Bearer ek_forged", "Content-Type": "application/sdp"}), 401,
         "invalid_api_key"),
        (post(url, b"v=0\r\n", {**auth, "Content-Type": "application/sdp", "Origin": "http://evil.example"}), 403,
         "origin_not_allowed"),
    ]  # fmt: skip
    for answer, status, code in cases:
        assert answer.status == status, answer.text
        assert answer.json()["error"]["code"] == code
    wait_idle(server)


def test_cors_preflight_lets_a_web_app_post_its_offer_and_read_location(server):
    import urllib.request  # noqa: PLC0415

    request = urllib.request.Request(
        f"{server.url}/v1/realtime/calls",
        method="OPTIONS",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-openai-agents-sdk",
        },
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        headers = {k.lower(): v for k, v in r.headers.items()}
    assert headers["access-control-allow-origin"] == ORIGIN
    allowed = headers["access-control-allow-headers"].lower()
    assert all(h in allowed for h in ("authorization", "content-type", "x-openai-agents-sdk"))
    answer = post(f"{server.url}/v1/realtime/calls", b"", {"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert answer.headers.get("access-control-expose-headers", "").lower() == "location"


def test_a_call_that_never_connects_expires_and_frees_its_slot(server):
    async def main():
        caller = Caller(speech(1.0))
        offer = await caller.offer()
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/sdp"}
        answer = await asyncio.to_thread(post, f"{server.url}/v1/realtime/calls", offer.encode(), headers)
        await caller.pc.close()  # gives up before setting the answer: never connects, never hangs up
        return answer

    answer = run(main())
    assert answer.status == 201
    assert metric(server, "duplexd_sessions_active") >= 1
    wait_idle(server, timeout=10)  # --webrtc-connect-timeout 3


def test_a_sideband_socket_controls_the_call_and_hears_its_events(server):
    from websockets.asyncio.client import connect  # noqa: PLC0415

    ws_url = server.url.replace("http://", "ws://") + "/v1/realtime"
    auth = {"Authorization": f"Bearer {KEY}"}

    async def main():
        caller = Caller(speech(6.0))
        assert (await caller.call(f"{server.url}/v1/realtime/calls", KEY)).status == 201
        await caller.next_event("session.created")
        caller.send({"type": "session.update", "session": {"type": "realtime"}})
        await caller.next_event("session.updated")
        async with connect(f"{ws_url}?call_id={caller.call_id}", additional_headers=auth) as side:
            created = json.loads(await side.recv())
            assert created["type"] == "session.created"
            await side.send(json.dumps({"type": "session.update", "session": {"sampling": {"text_topk": 3}}}))
            on_call = await caller.next_event("session.updated")  # the caller sees what the sideband changed
            seen = set()
            while not {"session.updated", "response.output_audio_transcript.delta"} <= seen:
                seen.add(json.loads(await asyncio.wait_for(side.recv(), 10))["type"])
            await caller.hang_up()  # the call ends: so does its sideband
            await asyncio.wait_for(side.wait_closed(), 10)
            code = side.close_code
        async with connect(f"{ws_url}?call_id=rtc_nope", additional_headers=auth) as unknown:
            refused = json.loads(await unknown.recv())
            await asyncio.wait_for(unknown.wait_closed(), 5)
        return on_call, code, refused, unknown.close_code

    on_call, code, refused, unknown_code = run(main())
    assert on_call["session"]["sampling"]["text_topk"] == 3
    assert code == 1000
    assert refused["error"]["code"] == "call_id_not_found" and unknown_code == 1008
    wait_idle(server)


def test_ice_servers_as_aiortc_takes_them():
    servers = stack.ice_servers(["stun:stun.example.com:3478", "turn:al%40ce:s3cr%3At@turn.example.com:3478"])
    assert [(s.urls, s.username, s.credential) for s in servers] == [
        ("stun:stun.example.com:3478", None, None),
        ("turn:turn.example.com:3478", "al@ce", "s3cr:t"),  # the user part, percent-decoded
    ]


def test_a_caller_that_only_listens_hears_the_model(server):
    """A receive-only offer (no microphone): the model steps on silence at real-time pace, so it still speaks."""

    async def main():
        caller = Caller(None)
        answer = await caller.call(f"{server.url}/v1/realtime/calls", KEY)
        assert answer.status == 201, answer.text
        assert "a=sendonly" in answer.text  # the server only sends on this call
        await caller.next_event("session.created")
        caller.send({"type": "session.update", "session": {}})
        await caller.next_event("output_audio_buffer.started")
        await asyncio.sleep(1.5)
        await caller.hang_up()
        return caller.first_sound is not None, sum(len(h) for h in caller.heard)

    sounded, samples = run(main())
    assert sounded and samples > MIC_RATE
    wait_idle(server)
