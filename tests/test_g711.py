"""G.711 (`server/codec/g711.py`) against libsndfile's codec, and the Realtime formats that use it."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import soundfile as sf
import soxr

from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.server.codec import g711
from duplexd.server.realtime import events as ev
from duplexd.server.realtime.audio_formats import InputAudio, OutputAudio

SUBTYPES = {"pcmu": "ULAW", "pcma": "ALAW"}


def _sndfile_decode(law: str, data: bytes) -> np.ndarray:
    return sf.read(io.BytesIO(data), samplerate=8000, channels=1, format="RAW", subtype=SUBTYPES[law], dtype="int16")[0]


def _sndfile_encode(law: str, samples: np.ndarray) -> bytes:
    out = io.BytesIO()
    sf.write(out, samples, 8000, format="RAW", subtype=SUBTYPES[law])
    return out.getvalue()


@pytest.mark.parametrize("law", ["pcmu", "pcma"])
def test_every_code_decodes_as_libsndfile_decodes_it(law):
    codes = bytes(range(256))
    assert np.array_equal(g711.decode(law, codes), _sndfile_decode(law, codes))


@pytest.mark.parametrize("law", ["pcmu", "pcma"])
def test_every_sample_encodes_to_libsndfiles_code_or_its_neighbour(law):
    samples = np.arange(-32768, 32768, dtype=np.int16)
    ours = g711.decode(law, g711.encode(law, samples)).astype(np.int32)
    theirs = _sndfile_decode(law, _sndfile_encode(law, samples)).astype(np.int32)
    same = ours == theirs
    assert same.mean() > 0.99  # the codecs round a few boundary samples to the other side
    step = np.abs(np.diff(np.unique(theirs))).max()
    assert np.abs(ours - theirs).max() <= step
    # and a code survives the round trip (mu-law's two zeros, 0x7F and 0xFF, both decode to 0)
    codes = np.arange(256, dtype=np.uint8)
    back = np.frombuffer(g711.encode(law, g711.decode(law, codes.tobytes())), np.uint8)
    assert np.array_equal(back, codes) or (law == "pcmu" and set(np.nonzero(back != codes)[0]) == {0x7F})


def test_telephone_formats_resample_as_one_stream():
    """Input split into events of any size becomes one continuous 24 kHz signal; output likewise at 8 kHz."""
    rng = np.random.default_rng(3)
    call = (0.2 * rng.standard_normal(8000)).astype(np.float32)
    alaw = _sndfile_encode("pcma", call)
    decoder = InputAudio("audio/pcma")
    got = np.concatenate([decoder.decode(alaw[i : i + 331]) for i in range(0, len(alaw), 331)])
    heard = _sndfile_decode("pcma", alaw).astype(np.float32) / 32768
    whole = soxr.ResampleStream(8000, 24000, 1, dtype="float32").resample_chunk(heard)
    assert abs(len(got) - len(whole)) <= 1
    n = min(len(got), len(whole))
    assert np.abs(got[:n] - whole[:n]).max() <= 0.5 / 32768  # on the pcm16 grid
    answer = (0.3 * rng.standard_normal(24000)).astype(np.float32)
    encoder = OutputAudio("audio/pcmu")
    sent = b"".join(base64.b64decode(encoder.base64(answer[i : i + 1920])) for i in range(0, 24000, 1920))
    expected = soxr.ResampleStream(24000, 8000, 1, dtype="float32").resample_chunk(np.clip(answer, -1, 1))
    ours = _sndfile_decode("pcmu", sent).astype(np.float32) / 32768
    n = min(len(ours), len(expected))
    assert n > 7000 and np.all(np.abs(ours[:n] - expected[:n]) <= 0.06 * np.abs(expected[:n]) + 8 / 32768)


def test_session_update_names_the_formats_in_both_dialects():
    def formats(session: dict):
        event = ev.parse_event(json.dumps({"type": "session.update", "session": session}))
        assert isinstance(event, ev.SessionUpdate)
        return event.formats()

    assert formats({"input_audio_format": "g711_ulaw", "output_audio_format": "g711_alaw"}) == (
        "audio/pcmu",
        "audio/pcma",
    )
    ga = {"audio": {"input": {"format": {"type": "audio/pcma"}}, "output": {"format": {"type": "audio/pcm"}}}}
    assert formats(ga) == ("audio/pcma", "audio/pcm")
    assert formats({"audio": {"output": {"format": {"type": "audio/pcmu"}}}, "input_audio_format": "pcm16"}) == (
        "audio/pcm",
        "audio/pcmu",
    )
    assert formats({"instructions": "x"}) == (None, None)
    assert ev.session_object("s", "m", SamplingParams(), 60, formats=("audio/pcmu", "audio/pcm"))["audio"]["input"][
        "format"
    ] == {"type": "audio/pcmu", "rate": 8000}
