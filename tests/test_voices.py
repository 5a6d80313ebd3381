"""Voices: `.pt` presets in PersonaPlex's format and audio voices prepared as the reference prepares them."""

from __future__ import annotations

import numpy as np
import pyloudnorm
import pytest
import soundfile as sf
import sphn
import torch
from safetensors.torch import save_file

from duplexd.engine.errors import InputRefused
from duplexd.engine.models.config import DEMO_MIMI
from duplexd.engine.models.mimi import MimiStreams
from duplexd.engine.persona.voices import (
    VoiceError,
    VoiceLibrary,
    load_audio_voice,
    load_preset,
    normalise_loudness,
    read_voice_audio,
    voice_frames_pcm,
)
from duplexd.engine.weights.checkpoint import load_mimi

from .personaplex_files import PP_SMALL
from .personaplex_ref import preset_from_codes
from .ref_models import reference_lm, reference_mimi
from .test_mimi import reference_stream, speech_like

CFG = PP_SMALL
V = 6
VOICE = [[(37 * f + 11 * k) % CFG.card for k in range(8)] for f in range(V)]


@pytest.fixture(scope="module")
def preset():
    return preset_from_codes(CFG, reference_lm(CFG, seed=2), VOICE)


@pytest.fixture(scope="module")
def mimi_pair(tmp_path_factory):
    ref = reference_mimi(seed=5, mimi_config=DEMO_MIMI.to_reference_dict())
    path = tmp_path_factory.mktemp("mimi") / "mimi.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    return ref, load_mimi(path, DEMO_MIMI)


def _set(cache: torch.Tensor, row: int, column: int, value: int) -> torch.Tensor:
    cache = cache.clone()
    cache[0, row, column] = value
    return cache


def _save(tmp_path, state, name="v.pt"):
    path = tmp_path / name
    torch.save(state, path)
    return path


def test_preset_loads(tmp_path, preset):
    voice = load_preset(_save(tmp_path, preset), CFG)
    assert voice.is_preset and voice.frames == V and voice.name == "v.pt"
    assert torch.equal(voice.embeddings, preset["embeddings"][:, 0, 0])
    assert torch.equal(voice.cache, preset["cache"][0])
    bf16 = {**preset, "embeddings": preset["embeddings"].to(torch.bfloat16)}  # as the released presets are stored
    assert load_preset(_save(tmp_path, bf16), CFG).embeddings.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: {"embeddings": p["embeddings"]}, "a dict with 'embeddings' and 'cache'"),
        (lambda p: [p["embeddings"]], "a dict with 'embeddings' and 'cache'"),
        (lambda p: {**p, "embeddings": p["embeddings"][..., :-1]}, "are 47-wide but the model's are 48"),
        (lambda p: {**p, "embeddings": p["embeddings"][:, 0]}, r"must be a float tensor \[V-1, 1, 1, 48\]"),
        (lambda p: {**p, "embeddings": p["embeddings"][:0]}, "holds no frame"),
        (lambda p: {**p, "embeddings": p["embeddings"] * float("nan")}, "non-finite"),
        (lambda p: {**p, "cache": p["cache"][..., :3]}, r"'cache' must be an integer tensor \[1, 17, 4\]"),
        (lambda p: {**p, "cache": p["cache"].float()}, "'cache' must be an integer tensor"),
        (lambda p: {**p, "cache": p["cache"] + 5000}, "out of range"),
        (lambda p: {**p, "cache": _set(p["cache"], 0, (V - 1) % 4, 5)}, "not the ring a 6-frame voice phase leaves"),
        (lambda p: {**p, "cache": _set(p["cache"], 12, V % 4, 7)}, "not the ring a 6-frame voice phase leaves"),
    ],
)
def test_bad_presets_are_refused(tmp_path, preset, change, message):
    with pytest.raises(VoiceError, match=message):
        load_preset(_save(tmp_path, change(preset)), CFG)


def test_foreign_files_are_refused(tmp_path):
    (tmp_path / "notes.pt").write_text("hello")
    with pytest.raises(VoiceError, match="not a PersonaPlex voice preset"):
        load_preset(tmp_path / "notes.pt", CFG)
    with pytest.raises(VoiceError, match="voice file not found"):
        load_preset(tmp_path / "missing.pt", CFG)
    (tmp_path / "bad.wav").write_bytes(b"RIFF....WAVEnonsense")
    with pytest.raises(VoiceError, match="cannot read audio"):
        read_voice_audio(tmp_path / "bad.wav", 24000)


def _reference_frames(path) -> np.ndarray:
    """The reference's preparation, step for step: read, resample all channels, normalise (channels, samples)
    squeezed to mono, frames with the last zero-padded, channel 0, float32."""
    pcm, rate = sphn.read(str(path))
    pcm = sphn.resample(pcm, src_sample_rate=rate, dst_sample_rate=24000)
    wav = pcm[0] if pcm.ndim == 2 and pcm.shape[0] == 1 else pcm
    meter = pyloudnorm.Meter(24000)
    wav = pyloudnorm.normalize.loudness(wav, meter.integrated_loudness(wav), -24.0)[None]
    frames = []
    while wav.shape[-1] > 0:
        sample, wav = wav[:, :1920], wav[:, 1920:]
        if wav.shape[-1] == 0:
            sample = np.concatenate([sample, np.zeros((1, 1920 - sample.shape[-1]))], axis=1)
        frames.append(torch.tensor(sample[0:1], dtype=torch.float32))
    return torch.cat(frames).numpy()


@pytest.mark.parametrize("rate, fmt", [(16000, "FLAC"), (44100, "WAV")])
def test_audio_voice_is_prepared_as_the_reference_prepares_it(tmp_path, mimi_pair, rate, fmt):
    ref, mimi = mimi_pair
    seconds = 0.93
    pcm = speech_like(15, seed=rate % 7).numpy()[: int(seconds * 24000)]
    pcm = np.interp(np.arange(int(seconds * rate)) * 24000 / rate, np.arange(len(pcm)), pcm) * 0.3
    path = tmp_path / f"voice.{fmt.lower()}"
    sf.write(str(path), pcm.astype(np.float32), rate, format=fmt, subtype="PCM_16")

    expected = _reference_frames(path)
    mono = normalise_loudness(read_voice_audio(path, 24000), 24000)
    assert mono.dtype == np.float64
    assert pyloudnorm.Meter(24000).integrated_loudness(mono) == pytest.approx(-24.0, abs=1e-6)
    frames = voice_frames_pcm(mono, 1920)
    assert np.array_equal(frames, expected)  # bit for bit: the codes depend on the exact samples

    voice = load_audio_voice(path, mimi, CFG)
    assert not voice.is_preset and voice.frames == len(expected) == -(-len(mono) // 1920)
    ours = MimiStreams(mimi, 1).encode(torch.tensor([0]), torch.from_numpy(expected.reshape(1, -1)))[0].T
    assert torch.equal(voice.codes, ours[:, :8])
    ref_codes, _ = reference_stream(ref, torch.from_numpy(expected.reshape(-1)))
    assert (voice.codes == ref_codes[0].T).float().mean() >= 0.95
    assert len(voice.codes.unique()) > 10


def test_stereo_keeps_channel_0_and_a_changed_sample_changes_the_codes(tmp_path, mimi_pair):
    _, mimi = mimi_pair
    left = speech_like(8, seed=1).numpy() * 0.3
    right = speech_like(8, seed=2).numpy() * 0.3
    sf.write(str(tmp_path / "st.wav"), np.stack([left, right], 1), 24000, subtype="FLOAT")
    sf.write(str(tmp_path / "l.wav"), left, 24000, subtype="FLOAT")
    stereo, mono = load_audio_voice(tmp_path / "st.wav", mimi, CFG), load_audio_voice(tmp_path / "l.wav", mimi, CFG)
    assert torch.equal(stereo.codes, mono.codes)
    changed = left.copy()
    changed[5 * 1920 : 6 * 1920] *= -1
    sf.write(str(tmp_path / "c.wav"), changed, 24000, subtype="FLOAT")
    other = load_audio_voice(tmp_path / "c.wav", mimi, CFG).codes
    assert torch.equal(other[:5], mono.codes[:5]) and not torch.equal(other[5:], mono.codes[5:])


def test_short_silent_and_long_audio_are_refused(tmp_path, mimi_pair):
    _, mimi = mimi_pair
    sf.write(str(tmp_path / "short.wav"), np.full(4000, 0.1, np.float32), 24000)
    with pytest.raises(VoiceError, match=r"short.wav: the voice sample is 0.17 s long; at least 0.4 s"):
        load_audio_voice(tmp_path / "short.wav", mimi, CFG)
    sf.write(str(tmp_path / "silent.wav"), np.zeros(24000, np.float32), 24000)
    with pytest.raises(VoiceError, match="silent"):
        load_audio_voice(tmp_path / "silent.wav", mimi, CFG)
    sf.write(str(tmp_path / "long.wav"), np.zeros(61 * 8000, np.float32), 8000)
    with pytest.raises(VoiceError, match="at most 60 s"):
        load_audio_voice(tmp_path / "long.wav", mimi, CFG)


def test_library_scans_a_folder(tmp_path, preset, mimi_pair):
    _, mimi = mimi_pair
    _save(tmp_path, preset, "NATF0.pt")
    sf.write(str(tmp_path / "mine.flac"), speech_like(6, seed=3).numpy() * 0.3, 24000)
    (tmp_path / "README.txt").write_text("not a voice")
    library = VoiceLibrary.scan(tmp_path, mimi, CFG)
    assert library.names == ["NATF0.pt", "mine.flac"]
    assert library.get("NATF0.pt") is library.get("NATF0") and library.get("NATF0").is_preset
    assert library.get("mine").frames == 6
    with pytest.raises(VoiceError, match=r"unknown voice 'NATM1'; available: NATF0.pt, mine.flac"):
        library.get("NATM1")
    (tmp_path / "broken.pt").write_bytes(b"\x00" * 10)
    with pytest.raises(VoiceError, match="broken.pt: not a PersonaPlex voice preset") as info:
        VoiceLibrary.scan(tmp_path, mimi, CFG)
    assert isinstance(info.value, InputRefused) and info.value.option == "voices"
    with pytest.raises(VoiceError, match="voices folder not found"):
        VoiceLibrary.scan(tmp_path / "nope", mimi, CFG)
