"""`POST /api/voice`: moshi-server's voice cloning, its `PyPost` module running `voice.py`, which Unmute's
`unmute/tts/voice_cloning.py` calls and whose answer it sends, byte for byte, to `/api/tts_streaming` as the
stream's `Voice` message.

As moshi-server (`py_module_post.rs`, `py_router_post` in `main.rs`): the body is the audio file itself (any
Content-Type; Unmute sends `application/octet-stream`), decoded to its first channel at 24 kHz; its first 10 s make
the voice (`engine/voice/maker.py`); the answer is 200, `application/octet-stream`, the MessagePack map rmp_serde
writes for `OutMsg::Voice`: `{"type": "Voice", "embeddings": [f32, ...], "shape": [1, 512, 125]}` (the embedding
flattened in C order, each value a float 32). No API key is asked for, as there (Unmute sends none). A body over
16 MiB is 413, as there.

Where moshi-server answers 500 with an empty body, or makes a voice of nothing, this says why in JSON (`{"error",
"message"}`, as `POST /api/asr-streaming`): 400 for an empty body, a file that is not audio or cannot be decoded
(`empty_file`, `unsupported_format`, `invalid_audio`), one under a second long (`audio_too_short`, where moshi-server
pads it with silence), a silent one (`silent_audio`) or one whose loudness cannot be measured
(`unmeasurable_loudness`); 503 while the server drains (`server_draining`) or when `cloning.MAX_WAITING` voices are
already in hand (`busy`); 500 if the model fails (`voice_failed`, logged). Voices are made one at a time on the
voice thread (`core/cloning.py`), never on the event loop.
"""

from __future__ import annotations

import io
import logging
import time

import msgpack
import numpy as np
import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from duplexd.engine.voice.maker import VoiceRefused
from duplexd.engine.voice.recording import read_recording
from duplexd.server.codec.upload import UploadError, sniff
from duplexd.server.core.cloning import CloningBusy
from duplexd.server.core.context import Context

from .asr_upload import Refused, read_body

logger = logging.getLogger(__name__)
router = APIRouter()

PATH = "/api/voice"
MAX_BODY_BYTES = 16 << 20  # moshi-server's RequestBodyLimitLayer on this route
_PACKER = msgpack.Packer(use_single_float=True)  # Vec<f32> as rmp_serde writes it: float 32s


def voice_message(voice: torch.Tensor) -> bytes:
    """`OutMsg::Voice{embeddings, shape}` as moshi-server writes it (a struct map, the tag first)."""
    values = voice.detach().cpu().numpy().astype(np.float32, copy=False)
    return _PACKER.pack({"type": "Voice", "embeddings": values.reshape(-1).tolist(), "shape": list(values.shape)})


def _recording(data: bytes) -> np.ndarray:
    """The body's recording (on the voice thread): its format told from its first bytes, then decoded."""
    try:
        sniff(data[:16])
    except UploadError as e:
        raise VoiceRefused(str(e), e.code) from None
    return read_recording(io.BytesIO(data))


@router.post(PATH)
async def make_voice(request: Request, ctx: Context) -> Response:
    cloning = ctx.runtime.cloning
    assert cloning is not None  # routed only with voice cloning
    started = time.perf_counter()
    try:
        if ctx.drain.draining:
            raise Refused(503, "server_draining", "the server is shutting down; try another replica")
        data = await read_body(request, MAX_BODY_BYTES)
        if not data:
            raise Refused(400, "empty_file", "the body is empty: send an audio file (its first 10 s make the voice)")
        voice = await cloning.make(lambda: _recording(data))
    except Refused as e:
        ctx.metrics.refused.labels(e.error).inc()
        return e.response()
    except VoiceRefused as e:
        ctx.metrics.refused.labels(e.reason).inc()
        return Refused(400, e.reason, str(e)).response()
    except CloningBusy as e:
        ctx.metrics.refused.labels("busy").inc()
        return Refused(503, "busy", str(e)).response()
    except Exception:  # noqa: BLE001 - answered, and logged with its traceback
        logger.exception("making a voice failed")
        return Refused(500, "voice_failed", "making the voice failed; the server's log says why").response()
    ctx.metrics.sessions.labels("voice").inc()
    logger.info("voice %s made in %.1f s", list(voice.shape), time.perf_counter() - started)
    return Response(voice_message(voice), media_type="application/octet-stream")
