"""The WebRTC stack (aiortc, the `webrtc` extra), imported only when a call comes, and how duplexd tunes it.

aiortc is the one in-process WebRTC stack for Python: pure Python over PyAV (Opus) and libsrtp. Three of its
defaults do not suit a voice server, and are changed here through names the pinned minor (1.16) is known to have:
- the audio receiver's jitter buffer waits for 4 packets (60 ms added to every word the user says); it holds
  `--webrtc-jitter-frames` instead;
- aioice never offers a loopback address and offers every interface's; `--webrtc-hosts` names the addresses a
  browser can reach (a public or NAT-mapped one, or 127.0.0.1 for a call on the same machine);
- with no ICE servers given aiortc gathers through Google's public STUN server; duplexd uses exactly the ones
  `--webrtc-ice-servers` gives (none by default: host candidates, and the browser's peer-reflexive ones).
"""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from typing import Any
from urllib.parse import unquote

EXTRA_MISSING = (
    "WebRTC calls need the webrtc extra on the server: pip install 'duplexd[webrtc]' (aiortc); the WebSocket "
    "/v1/realtime serves without it"
)
_TURN = re.compile(r"^(?P<scheme>turns?):(?P<user>[^:@]+):(?P<password>[^@]+)@(?P<rest>.+)$")


def available() -> bool:
    return importlib.util.find_spec("aiortc") is not None


@cache
def tune(jitter_frames: int, hosts: tuple[str, ...]) -> None:
    """Patch aiortc and aioice once per process (the settings are the server's, the same for every call)."""
    import aioice.ice  # noqa: PLC0415 - the optional extra
    import aiortc.rtcrtpreceiver  # noqa: PLC0415

    plain = aiortc.rtcrtpreceiver.JitterBuffer

    def jitter_buffer(capacity: int, prefetch: int = 0, is_video: bool = False) -> Any:
        return plain(capacity, prefetch if is_video else jitter_frames, is_video)

    aiortc.rtcrtpreceiver.JitterBuffer = jitter_buffer  # type: ignore[misc,assignment]
    if hosts:
        aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: [
            h for h in hosts if (":" in h and use_ipv6) or (":" not in h and use_ipv4)
        ]


def ice_servers(urls: list[str]) -> list[Any]:
    """`RTCIceServer`s of `--webrtc-ice-servers` (credentials of a TURN URL in its user part)."""
    from aiortc import RTCIceServer  # noqa: PLC0415

    servers = []
    for url in urls:
        turn = _TURN.match(url)
        if turn:
            servers.append(
                RTCIceServer(
                    f"{turn['scheme']}:{turn['rest']}",
                    username=unquote(turn["user"]),
                    credential=unquote(turn["password"]),
                )
            )
        else:
            servers.append(RTCIceServer(url))
    return servers
