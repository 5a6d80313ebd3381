"""duplexd.server.codec against the real decoders and encoders of Kyutai's clients, no stand-ins:

* downlink: the "kyutai" profile is sphn's bytes; the "fast" profile decodes in sphn's reader (moshi's Python client)
  and in opus-recorder 8.0.5's decoderWorker (Kyutai's web client) run under Node;
* uplink: what the browser and moshi's client send decodes exactly as sphn's reader decodes it, however the bytes
  are cut into messages;
* without libopus everything falls back to sphn, logged once.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pytest
import sphn

from duplexd.server.codec import libopus, ogg, streams
from duplexd.server.codec.errors import AudioError

from . import system_tools
from .opus_fixtures import (
    FRAME,
    browser_stream,
    frames,
    needs_libopus,
    our_decode,
    speech_pcm,
    sphn_stream,
    split_pages,
)
from .speech import needs_espeak

pytestmark = [needs_libopus, needs_espeak]

OPUS_RECORDER = "opus-recorder@8.0.5"


def encode_all(profile: str, pcm: np.ndarray) -> list[bytes]:
    encoder = streams.OggOpusEncoder(profile)
    try:
        return [encoder.encode(f) for f in frames(pcm)]
    finally:
        encoder.close()


def sphn_decode(messages: list[bytes]) -> list[np.ndarray]:
    reader = sphn.OpusStreamReader(24000)
    return [reader.append_bytes(m) for m in messages]


def ours_per_call(messages: list[bytes]) -> list[np.ndarray]:
    decoder = streams.OggOpusDecoder(24000)
    try:
        return [decoder.decode(m) for m in messages]
    finally:
        decoder.close()


# ------------------------------------------------------------------------------------------------- downlink


def test_kyutai_profile_is_sphns_bytes_call_by_call():
    lib = libopus.load()
    assert lib is not None
    if libopus.version(lib) != "libopus 1.3.1":
        pytest.skip(f"byte equality holds for libopus 1.3.1 (sphn's), this is {libopus.version(lib)}")
    writer = sphn.OpusStreamWriter(24000)
    encoder = streams.OggOpusEncoder("kyutai")
    for index, frame in enumerate(frames(speech_pcm())):
        assert encoder.encode(frame) == writer.append_pcm(frame), f"tick {index}"
    encoder.close()


def test_fast_profile_decodes_in_sphns_reader_like_ours():
    messages = encode_all("fast", speech_pcm())
    theirs = sphn_decode(messages)
    assert [len(x) for x in theirs] == [FRAME] * len(messages)  # one whole tick per message, from the first
    ours = our_decode(messages)
    assert np.array_equal(np.concatenate(theirs), ours)


def test_encoder_api():
    with pytest.raises(ValueError, match="unknown Opus profile"):
        streams.OggOpusEncoder("slow")
    encoder = streams.OggOpusEncoder("fast")
    with pytest.raises(ValueError, match="multiples of 1920"):
        encoder.encode(np.zeros(960, np.float32))
    two = encoder.encode(np.zeros(2 * FRAME, np.float64))  # any float dtype, whole frames
    assert len(split_pages(two)) == 2 + 2
    encoder.close()
    encoder.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        encoder.encode(np.zeros(FRAME, np.float32))
    decoder = streams.OggOpusDecoder()
    assert decoder.decode(b"").shape == (0,)
    decoder.close()
    decoder.close()
    assert streams.backend().endswith("(ctypes)")


# ------------------------------------------------------------------------------ the browser's decoder under Node

HARNESS = r"""
// opus-recorder's decoderWorker as a web worker sees it: postMessage/onmessage/close globals.
const fs = require("fs"), path = require("path"), vm = require("vm");
const [dist, input, output] = process.argv.slice(2);
process.on("unhandledRejection", (e) => { console.error("decoder error: " + e); process.exit(3); });
const posted = [];
let decoded = -1;
globalThis.require = require;  // Emscripten's Node branch asks for fs and path
globalThis.__dirname = dist;
// the .wasm handed over up front: Node 20 has fetch, which Emscripten would try on a file path
globalThis.Module = { wasmBinary: fs.readFileSync(path.join(dist, "decoderWorker.min.wasm")) };
globalThis.close = () => {};
globalThis.postMessage = (message) => {
  if (message === null) {  // the end of "done": write what the decode commands produced
    const out = Buffer.alloc(4 * decoded);
    let at = 0;
    for (const buffer of posted) for (const x of buffer) { if (at < decoded) out.writeFloatLE(x, 4 * at); at++; }
    fs.writeFileSync(output, out);
    return;
  }
  posted.push(Float32Array.from(message[0]));
};
const file = path.join(dist, "decoderWorker.min.js");
vm.runInThisContext(fs.readFileSync(file, "utf8"), { filename: file });
const data = fs.readFileSync(input), messages = [];
for (let at = 0; at < data.length; ) {
  const n = data.readUInt32LE(at);
  messages.push(new Uint8Array(data.subarray(at + 4, at + 4 + n)));  // a copy: the worker reads .buffer whole
  at += 4 + n;
}
const send = (data) => globalThis.onmessage({ data });
// Kyutai's web client's settings
send({ command: "init", decoderSampleRate: 24000, outputBufferSampleRate: 24000, bufferLength: 960,
       resampleQuality: 0 });
for (const pages of messages) send({ command: "decode", pages });
Module.mainReady.then(() => { decoded = posted.reduce((n, b) => n + b.length, 0); });  // after the decodes
send({ command: "done" });  // flushes a zero-padded last buffer, which `decoded` leaves out
"""


@pytest.fixture(scope="session")
def opus_recorder_dist() -> Path:
    """opus-recorder's dist/ (decoderWorker.min.js and .wasm) from `npm pack`, cached outside the repository."""
    system_tools.require("node")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "duplexd-test" / "npm"
    dist = cache / OPUS_RECORDER.replace("@", "-") / "dist"
    names = ("decoderWorker.min.js", "decoderWorker.min.wasm")
    if all((dist / n).exists() for n in names):
        return dist
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        run = subprocess.run(["npm", "pack", OPUS_RECORDER], cwd=tmp, capture_output=True, text=True, timeout=180)
        tarballs = list(Path(tmp).glob("*.tgz"))
        if run.returncode or not tarballs:
            pytest.skip(f"npm pack {OPUS_RECORDER} failed: {(run.stderr or run.stdout).strip()[-300:]}")
        staged = Path(tmp) / "dist"
        staged.mkdir()
        with tarfile.open(tarballs[0]) as tar:
            for name in names:
                member = tar.extractfile(f"package/dist/{name}")
                assert member is not None
                (staged / name).write_bytes(member.read())
        dist.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(staged, dist)
        except OSError:  # another run put it there first
            pass
    return dist


def browser_decode(dist: Path, messages: list[bytes], tmp: Path) -> np.ndarray:
    (tmp / "harness.js").write_text(HARNESS)
    (tmp / "in.bin").write_bytes(b"".join(len(m).to_bytes(4, "little") + m for m in messages))
    run = subprocess.run(
        ["node", str(tmp / "harness.js"), str(dist), str(tmp / "in.bin"), str(tmp / "out.f32")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if run.returncode:
        raise RuntimeError(f"the browser decoder failed (exit {run.returncode}): {run.stderr.strip()[-500:]}")
    return np.fromfile(tmp / "out.f32", dtype="<f4")


def best_snr_db(reference: np.ndarray, test: np.ndarray, max_lag: int = 200) -> tuple[float, int]:
    """The highest SNR of `test` against `reference` over lags 0..max_lag (test late by lag samples)."""
    best = (-np.inf, 0)
    n = min(len(reference), len(test)) - max_lag
    ref = reference[:n].astype(np.float64)
    for lag in range(max_lag + 1):
        err = ref - test[lag : lag + n]
        snr = 10 * np.log10(np.sum(ref**2) / max(np.sum(err**2), 1e-20))
        best = max(best, (snr, lag))
    return best


def test_fast_profile_plays_in_the_browsers_decoder(opus_recorder_dist, tmp_path):
    messages = encode_all("fast", speech_pcm())
    pcm = browser_decode(opus_recorder_dist, messages, tmp_path)
    assert len(pcm) == len(messages) * FRAME
    snr, lag = best_snr_db(our_decode(messages), pcm)
    assert snr >= 30, f"{snr:.1f} dB at lag {lag}"


def test_the_browsers_decoder_needs_the_header_pages(opus_recorder_dist, tmp_path):
    messages = encode_all("fast", speech_pcm())
    first = split_pages(messages[0])
    headerless = [b"".join(first[2:]), *messages[1:]]
    with pytest.raises(RuntimeError, match="browser decoder failed .*TypeError"):
        browser_decode(opus_recorder_dist, headerless, tmp_path)


# --------------------------------------------------------------------------------------------------- uplink


def cut_randomly(messages: list[bytes], seed: int, pieces: int = 150) -> list[bytes]:
    data = b"".join(messages)
    cuts = sorted(random.Random(seed).sample(range(1, len(data)), pieces))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


UPLINK_VARIANTS = [
    "browser", "browser-headerless", "browser-split", "browser-joined",
    "sphn", "sphn-headerless", "sphn-split", "sphn-one-message",
]  # fmt: skip


def uplink_variants() -> dict[str, list[bytes]]:
    """Each way a client may cut its Ogg stream into messages (built in the test: it needs espeak-ng and libopus)."""
    pcm = speech_pcm(seconds=3.0)
    browser, moshi = browser_stream(pcm), sphn_stream(pcm)
    moshi_pages = [p for m in moshi for p in split_pages(m)]
    return {
        "browser": browser,
        "browser-headerless": browser[2:],
        "browser-split": cut_randomly(browser, 1),
        "browser-joined": [b"".join(browser[:7]), *browser[7:]],
        "sphn": moshi,
        "sphn-headerless": moshi_pages[2:],
        "sphn-split": cut_randomly(moshi, 2),
        "sphn-one-message": [b"".join(moshi)],
    }


@pytest.mark.parametrize("variant", UPLINK_VARIANTS)
def test_uplink_decodes_exactly_as_sphn(variant):
    variants = uplink_variants()
    assert list(variants) == UPLINK_VARIANTS
    messages = variants[variant]
    theirs, ours = sphn_decode(messages), ours_per_call(messages)
    assert [len(x) for x in ours] == [len(x) for x in theirs]
    assert np.array_equal(np.concatenate(ours), np.concatenate(theirs))
    assert sum(len(x) for x in ours) >= 2.9 * 24000


def test_uplink_garbage_is_an_audio_error_and_stays_one():
    browser = browser_stream(speech_pcm(seconds=1.0))
    decoder = streams.OggOpusDecoder()
    assert len(decoder.decode(b"".join(browser[:4]))) == 2 * 960
    with pytest.raises(AudioError, match="not an Ogg page"):
        decoder.decode(b"this is not Ogg, not at all")
    with pytest.raises(AudioError):  # sticky, as in sphn: the connection ends on it
        decoder.decode(browser[4])
    with pytest.raises(ValueError):  # what sphn does with the same bytes
        sphn_decode([b"".join(browser[:4]), b"this is not Ogg, not at all"])
    bad_opus = streams.OggOpusDecoder()
    bad_page = ogg.PageWriter(5).page([b"\xff\xff\xff"], 0)  # code 3, 63 frames: no valid Opus packet
    with pytest.raises(AudioError, match="malformed Opus packet"):
        bad_opus.decode(bad_page)


def test_uplink_bad_crc_is_logged_and_decoded(caplog):
    messages = browser_stream(speech_pcm(seconds=1.0))
    corrupt = bytearray(messages[5])
    corrupt[23] ^= 0x40
    damaged = [*messages[:5], bytes(corrupt), *messages[6:]]
    with caplog.at_level(logging.WARNING, logger="duplexd.server.codec.ogg"):
        ours = ours_per_call(damaged)
    assert any("CRC mismatch" in r.getMessage() for r in caplog.records)
    assert np.array_equal(np.concatenate(ours), our_decode(messages))  # the page is used as it came
    assert [len(x) for x in ours] == [len(x) for x in sphn_decode(damaged)]  # sphn decodes it too


def test_uplink_truncated_page_waits_for_the_rest():
    messages = browser_stream(speech_pcm(seconds=1.0))
    decoder = streams.OggOpusDecoder()
    assert len(decoder.decode(b"".join(messages[:3]))) == 960  # a page: two 20 ms packets
    page = messages[3]
    assert len(decoder.decode(page[:20])) == 0  # not even its header yet
    assert len(decoder.decode(page[20:-1])) == 0  # all but its last byte
    assert len(decoder.decode(page[-1:])) == 960


# ------------------------------------------------------------------------------------------------- fallback


def test_without_libopus_sphn_codes_and_says_so_once(monkeypatch, caplog):
    pcm = speech_pcm(seconds=1.0)
    messages = browser_stream(pcm)
    # the codec as on a machine without libopus: the loader finds nothing, the module's state is fresh
    monkeypatch.setattr(libopus, "load", lambda: None)
    monkeypatch.setattr(streams, "_state", {})
    with caplog.at_level(logging.WARNING, logger="duplexd.server.codec.streams"):
        assert streams.backend() == "sphn (libopus not found)"
        fast, kyutai = streams.OggOpusEncoder("fast"), streams.OggOpusEncoder("kyutai")
        streams.OggOpusEncoder("fast").close()
        writer = sphn.OpusStreamWriter(24000)
        for frame in frames(pcm):
            reference = writer.append_pcm(frame)
            assert fast.encode(frame) == reference and kyutai.encode(frame) == reference
        decoder = streams.OggOpusDecoder()
        ours = [decoder.decode(m) for m in messages]
        assert np.array_equal(np.concatenate(ours), np.concatenate(sphn_decode(messages)))
        with pytest.raises(AudioError, match="malformed Ogg/Opus"):
            streams.OggOpusDecoder().decode(b"this is not Ogg, not at all")
        assert streams.backend() == "sphn (libopus not found)"
    lines = [r.getMessage() for r in caplog.records]
    assert len([m for m in lines if "apt-get install libopus0" in m]) == 1
    assert len([m for m in lines if "profile 'fast' cannot apply" in m]) == 1
    assert len(lines) == 2
