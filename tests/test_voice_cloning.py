"""Voice cloning's engine part (`engine/voice`) and `duplexd voice make`, against moshi-server's `voice.py`.

The oracle is `Processor.run_one` of kyutai-labs/moshi's `rust/moshi-server/voice.py`, composed here (`run_one`
below) from the packages it runs as it runs them: moshi's loaders and Mimi (`_quantizer_kwargs["n_q"] = 16`,
`encode_to_latent(quantize=False)`), Facebook's `denoiser` package's `Demucs(hidden=64)` (the network of `dns64`,
whose offline forward `voice.py` copies), julius's `LowPassFilter(8 / 24)` and `ResampleFrac`, and `voice.py`'s
`normalize_loudness` with torchaudio's `Loudness` measured by pyloudnorm (torchaudio's wheels are built for one torch
each and none loads beside this one; its K-weighting, which clamps each biquad's output to ±1, is checked on its own
against a transcription of torchaudio 2.9.1's code, the version moshi-server's uv.lock pins). The weights are
random: a dns64-shaped Demucs saved as its `.th`, and a full-size 16-codebook Mimi saved as moshi saves one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import time

import julius
import numpy as np
import pytest
import soundfile as sf
import torch
import torch.nn.functional as F
from denoiser.demucs import Demucs
from moshi.models import loaders
from safetensors.torch import load_file, save_file

from duplexd.commands.cli import main
from duplexd.engine.errors import CheckpointError
from duplexd.engine.models.config import DEMO_MIMI, MIMI
from duplexd.engine.models.mimi import MimiModel
from duplexd.engine.tts.demo import demo_tts_folder
from duplexd.engine.tts.model import load_tts
from duplexd.engine.voice.denoiser import Denoiser, load_denoiser
from duplexd.engine.voice.maker import VoiceMaker, VoiceRefused, load_voice_maker
from duplexd.engine.voice.recording import read_recording
from duplexd.engine.voice.signal import LoudnessError, loudness, normalize_loudness
from duplexd.engine.weights.checkpoint import save_mimi_weights
from duplexd.server.core.cloning import MAX_WAITING, CloningBusy, VoiceCloning, check_cloning, load_cloning
from duplexd.server.core.settings import ServerSettings, SettingsError
from duplexd.server.core.speech import load_voices

from .live_server import demo_cache
from .ref_models import reference_mimi

RATE = 24_000
VOICE_MIMI = dataclasses.replace(MIMI, n_q=16, num_codebooks=16)


def recording(seconds: float = 12.0, seed: int = 0, pitch: float = 140.0, rate: int = RATE) -> np.ndarray:
    """Something like a voice: a gliding harmonic series in syllable-long bursts, over a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate)) / rate
    f0 = pitch * (1 + 0.15 * np.sin(2 * np.pi * 0.3 * t + seed))
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    syllables = np.clip(np.sin(2 * np.pi * 2.5 * t + rng.uniform(0, 6)), 0, None) ** 2
    return (0.12 * voiced * syllables + 0.01 * rng.standard_normal(len(t))).astype(np.float32)


# ------------------------------------------------------------------------------------------- the oracle


def pyloudnorm_lufs(wav: np.ndarray, sample_rate: int) -> float:
    """BS.1770-4 integrated loudness by pyloudnorm (imported here, scipy's signal and stats with it: not at
    collection)."""
    import pyloudnorm

    return float(pyloudnorm.Meter(sample_rate).integrated_loudness(wav.astype(np.float64)))


def normalize_loudness_ref(wav: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """voice.py's `normalize_loudness` (headroom 18 dB, energy floor 2e-3), torchaudio's Loudness by pyloudnorm."""
    wav = wav - wav.mean(dim=-1, keepdim=True)
    if wav.std() < 2e-3:
        return wav
    input_loudness_db = pyloudnorm_lufs(wav.reshape(-1).double().numpy(), sample_rate)
    gain = 10.0 ** ((-18 - input_loudness_db) / 20.0)
    output = gain * wav
    assert output.isfinite().all()
    return output


class VoicePy:
    """moshi-server's voice.py `Processor`, from its packages: `run_one(pcm)` the latent of 240000 samples."""

    def __init__(self, mimi_path, demucs_path) -> None:
        saved = loaders._quantizer_kwargs["n_q"]
        loaders._quantizer_kwargs["n_q"] = 16  # as voice.py, for the voice Mimi's 16 codebooks
        try:
            self.mimi = loaders.get_mimi(str(mimi_path), device="cpu")
        finally:
            loaders._quantizer_kwargs["n_q"] = saved
        self.demucs = Demucs(hidden=64)
        self.demucs.load_state_dict(torch.load(demucs_path, map_location="cpu"))
        self.demucs.eval()
        self.lowpass = julius.lowpass.LowPassFilter(8 / 24)
        self.downsample = julius.resample.ResampleFrac(24, 16)
        self.upsample = julius.resample.ResampleFrac(16, 24)

    @torch.no_grad()
    def run_one(self, pcm: np.ndarray, denoise: bool = True) -> np.ndarray:
        wav = torch.from_numpy(pcm[None, None, : 24000 * 10]).float()
        assert wav.shape[-1] == 240000
        low = self.lowpass(wav)
        high = wav - low
        low = self.downsample(low, full=True)
        denoised = self.demucs(low) if denoise else low
        denoised = 0.98 * denoised + 0.02 * low
        denoised = self.upsample(denoised, output_length=wav.shape[-1])
        denoised = denoised + high
        denoised = normalize_loudness_ref(denoised, 24000)
        return self.mimi.encode_to_latent(denoised, quantize=False).numpy()


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A random dns64 (`Demucs(hidden=64)`, its `.th` a plain state dict as Facebook's) and a random voice Mimi
    (full size, 16 codebooks, every constant perturbed), as moshi saves its state dict."""
    root = tmp_path_factory.mktemp("voice-weights")
    torch.manual_seed(0)
    torch.save(Demucs(hidden=64).state_dict(), root / "dns64.th")
    ref = reference_mimi(seed=3, mimi_config=VOICE_MIMI.to_reference_dict())
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(root / "voice_mimi.safetensors"))
    return root / "voice_mimi.safetensors", root / "dns64.th"


@pytest.fixture(scope="module")
def maker(weights) -> VoiceMaker:
    return load_voice_maker(*weights)


@pytest.fixture(scope="module")
def voice_py(weights) -> VoicePy:
    return VoicePy(*weights)


@pytest.fixture(scope="module")
def made(maker, voice_py):
    pcm = recording()
    started = time.perf_counter()
    ours = maker.make(pcm).numpy()
    print(f"duplexd: {time.perf_counter() - started:.1f} s")
    return pcm, ours, voice_py.run_one(pcm)


def test_the_latent_is_voice_pys(made):
    _, ours, want = made
    assert ours.shape == want.shape == (1, 512, 125)
    scale, diff = float(np.abs(want).max()), float(np.abs(ours - want).max())
    print(f"voice latent: max |duplexd - voice.py| = {diff:.3g} (largest value {scale:.3g})")
    assert diff <= 1e-4 * scale


def test_the_latent_follows_the_audio_and_the_denoiser(made, maker, voice_py):
    """Random weights hide nothing: other audio gives another latent, and so does skipping the denoiser (a random
    Demucs is no identity), each by far more than the parity's tolerance."""
    pcm, ours, want = made
    scale = float(np.abs(want).max())
    other = maker.make(recording(seed=1, pitch=210.0)).numpy()
    assert np.abs(other - ours).max() > 0.05 * scale
    undenoised = voice_py.run_one(pcm, denoise=False)
    assert np.abs(undenoised - want).max() > 0.01 * scale


# ------------------------------------------------------------------------------------------- the denoiser


def test_the_denoiser_is_facebooks_demucs(weights, tmp_path):
    """dns64's keys and shapes are duplexd's; a random Demucs (16 wide, an odd length to pad) denoises alike."""
    state = torch.load(weights[1], map_location="cpu")
    # built on the CPU (0.2 s), not the meta device: the sinc kernel's first ops there load torch's decompositions
    ours = Denoiser(hidden=64).state_dict()
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in state.items()}
    torch.manual_seed(5)
    ref = Demucs(hidden=16).eval()
    torch.save(ref.state_dict(), tmp_path / "dns16.th")
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "dns16.safetensors"))
    x = torch.from_numpy(recording(1.3, rate=16_000)[:20_001]).view(1, 1, -1)
    with torch.no_grad():
        want = ref(x)
        for name in ("dns16.th", "dns16.safetensors"):
            got = load_denoiser(tmp_path / name)(x)
            assert got.shape == want.shape
            assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_denoiser_checkpoints_that_do_not_fit_are_named(tmp_path):
    torch.manual_seed(6)
    good = Demucs(hidden=8).state_dict()
    cases = {
        "garbage.th": (b"not a checkpoint", "not a readable denoiser checkpoint"),
        "mimi.safetensors": ({"encoder.model.0.conv.conv.weight": torch.zeros(4, 1, 7)}, "not a Demucs denoiser"),
        "bidirectional.th": (Demucs(hidden=8, causal=False).state_dict(), "non-causal"),
        "missing.th": ({k: v for k, v in good.items() if k != "decoder.1.0.bias"}, "missing denoiser key"),
        "extra.th": ({**good, "decoder.9.0.bias": torch.zeros(3)}, "unexpected denoiser key"),
        "shape.th": ({**good, "decoder.0.2.weight": torch.zeros(2, 2, 2)}, "decoder.0.2.weight is [2, 2, 2]"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif name.endswith(".safetensors"):
            save_file(content, str(path))
        else:
            torch.save(content, path)
        with pytest.raises(CheckpointError, match=re.escape(message)):
            load_denoiser(path)


# ------------------------------------------------------------------------------------------- the loudness


def torchaudio_loudness(wav: torch.Tensor, sample_rate: int) -> float:
    """torchaudio 2.9.1's `functional.loudness` of mono `wav` [T] in float32, with `treble_biquad`,
    `highpass_biquad`, `biquad` and `lfilter` (clamp=True: the FIR part by conv1d, then the IIR recursion sample by
    sample, as `_lfilter_core_generic_loop`), transcribed."""

    def lfilter(x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
        a_coeffs, b_coeffs = torch.cat([c.view(1) for c in a]), torch.cat([c.view(1) for c in b])
        fir = F.conv1d(F.pad(x.view(1, 1, -1), (2, 0)), (b_coeffs / a_coeffs[0]).flip(0).view(1, 1, -1))[0, 0]
        an = a_coeffs / a_coeffs[0]
        y = torch.zeros(len(fir) + 2, dtype=x.dtype)
        for i in range(len(fir)):
            y[i + 2] = fir[i] - an[1] * y[i + 1] - an[2] * y[i]
        return torch.clamp(y[2:], -1.0, 1.0)

    def t(v: float) -> torch.Tensor:
        return torch.as_tensor(v, dtype=torch.float32)

    w0 = 2 * math.pi * t(1500.0) / sample_rate
    alpha = torch.sin(w0) / 2 / t(1 / math.sqrt(2))
    big_a = torch.exp(t(4.0) / 40 * math.log(10))
    temp1, temp2, temp3 = 2 * torch.sqrt(big_a) * alpha, (big_a - 1) * torch.cos(w0), (big_a + 1) * torch.cos(w0)
    b = [
        big_a * ((big_a + 1) + temp2 + temp1),
        -2 * big_a * ((big_a - 1) + temp3),
        big_a * ((big_a + 1) + temp2 - temp1),
    ]
    a = [(big_a + 1) - temp2 + temp1, 2 * ((big_a - 1) - temp3), (big_a + 1) - temp2 - temp1]
    x = lfilter(wav.float(), a, b)
    w0 = 2 * math.pi * t(38.0) / sample_rate
    alpha = torch.sin(w0) / 2.0 / t(0.5)
    b = [(1 + torch.cos(w0)) / 2, -1 - torch.cos(w0), (1 + torch.cos(w0)) / 2]
    a = [1 + alpha, -2 * torch.cos(w0), 1 - alpha]
    x = lfilter(x, a, b)
    gate = int(round(0.4 * sample_rate))
    energy = torch.square(x).unfold(-1, gate, int(round(gate * 0.25))).mean(dim=-1)
    block = -0.691 + 10 * torch.log10(energy)
    gated = block > -70.0
    gamma_rel = -0.691 + 10 * torch.log10((gated * energy).sum() / gated.count_nonzero()) - 10
    gated = gated & (block > gamma_rel)
    return float(-0.691 + 10 * torch.log10((gated * energy).sum() / gated.count_nonzero()))


def test_loudness_is_bs1770_as_pyloudnorm_measures_it():
    rng = np.random.default_rng(7)
    for rate, seconds in ((24_000, 3.0), (16_000, 2.2), (24_000, 0.4)):
        for amplitude in (0.01, 0.2):
            wav = recording(seconds, seed=int(rng.integers(100)), rate=rate) * amplitude / 0.12
            want = pyloudnorm_lufs(wav, rate)
            assert abs(loudness(wav, rate) - want) < 1e-3, (rate, seconds, amplitude)


def test_loudness_clamps_as_torchaudio_filters():
    """Loud audio: the K-weighting's shelf lifts peaks past ±1, which torchaudio's lfilter clamps (pyloudnorm does
    not): duplexd measures what torchaudio does."""
    wav = np.clip(np.random.default_rng(8).normal(0, 0.6, 12_000), -1, 1).astype(np.float32)
    rate = 24_000
    ours, want = loudness(wav, rate), torchaudio_loudness(torch.from_numpy(wav), rate)
    assert abs(ours - want) < 2e-4
    assert abs(pyloudnorm_lufs(wav, rate) - want) > 0.05


def test_normalize_loudness_keeps_voice_pys_fallbacks():
    loud = torch.from_numpy(recording(2.0)).view(1, 1, -1) + 0.05
    out = normalize_loudness(loud, RATE)
    assert abs(loudness(out.reshape(-1).numpy(), RATE) + 18.0) < 1e-3
    assert abs(float(out.mean())) < 1e-6
    quiet = loud * 0.005  # RMS under 2e-3: the mean removed, nothing scaled
    assert torch.equal(normalize_loudness(quiet, RATE), quiet - quiet.mean(dim=-1, keepdim=True))
    short = loud[..., :9_599]  # under one 400 ms block: torchaudio raises, voice.py leaves it
    assert torch.equal(normalize_loudness(short, RATE), short - short.mean(dim=-1, keepdim=True))
    hum = torch.sin(2 * math.pi * 2.0 * torch.arange(RATE * 3) / RATE).view(1, 1, -1) * 0.1  # under the 38 Hz cut
    with pytest.raises(LoudnessError, match="-70 LUFS"):
        normalize_loudness(hum, RATE)


# ------------------------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The demo's voice Mimi (32 wide: the demo TTS's voices) and an 8-wide random Demucs, for quick voices."""
    root = tmp_path_factory.mktemp("voice-small")
    save_mimi_weights(MimiModel(DEMO_MIMI).init_weights_(11), root / "mimi.safetensors")
    torch.manual_seed(12)
    save_file({k: v.contiguous() for k, v in Demucs(hidden=8).state_dict().items()}, str(root / "dns8.safetensors"))
    return root / "mimi.safetensors", root / "dns8.safetensors"


@pytest.fixture(scope="module")
def small_maker(small) -> VoiceMaker:
    return load_voice_maker(*small)


@pytest.fixture(scope="module")
def demo_tts(tmp_path_factory):
    """The demo TTS (32-wide voices), loaded once for the tests that take its config or its voices; from the cache
    conftest points every test at (a module fixture is set up before that function-scoped setting)."""
    return load_tts(demo_tts_folder(demo_cache(tmp_path_factory)))


def test_recordings_no_voice_is_made_of_are_refused(small_maker, tmp_path):
    maker = small_maker
    cases = [
        (recording(0.6), "audio_too_short", "0.60 s long: at least 1 s"),
        (np.zeros(RATE * 4, np.float32), "silent_audio", "silent"),
        (np.full(RATE * 11, 0.3, np.float32), "silent_audio", "silent"),  # a constant is no sound
        (np.where(np.arange(RATE * 4) % 7, 0.1, np.nan).astype(np.float32), "invalid_audio", "not finite"),
    ]
    for pcm, reason, message in cases:
        with pytest.raises(VoiceRefused, match=message) as refused:
            maker.make(pcm)
        assert refused.value.reason == reason
    assert maker.make(recording(3.0)).shape == (1, 32, 125)  # padded to 10 s, as moshi-server pads it
    (tmp_path / "text.wav").write_text("not audio")
    with pytest.raises(VoiceRefused, match="cannot read the recording as audio"):
        read_recording(tmp_path / "text.wav")
    with pytest.raises(VoiceRefused, match="no such file"):
        read_recording(tmp_path / "nothing.wav")


def test_a_recording_is_read_as_moshi_server_reads_an_upload(tmp_path):
    """Its first channel, at 24 kHz, its first 10 s."""
    left, right = recording(11.0, rate=48_000), recording(11.0, seed=4, rate=48_000)
    sf.write(tmp_path / "stereo.flac", np.stack([left, right], axis=1), 48_000)
    pcm = read_recording(tmp_path / "stereo.flac")
    assert pcm.shape == (240_000,)
    want = julius.resample_frac(torch.from_numpy(left), 48, 24).numpy()[:240_000]
    assert np.abs(pcm[1000:-1000] - want[1000:-1000]).max() < 0.01  # soxr's resampler, not julius's: close


def test_voices_are_made_one_at_a_time_and_the_queue_is_bounded():
    """The voice thread takes one voice at a time; past `MAX_WAITING`, a request is refused at once."""

    class Slow:
        running = peak = 0

        def make(self, pcm):
            Slow.running += 1
            Slow.peak = max(Slow.peak, Slow.running)
            time.sleep(0.05)
            Slow.running -= 1
            return torch.zeros(1, 2, 3)

    cloning = VoiceCloning(Slow(), threads=1)  # type: ignore[arg-type]

    async def many():
        return await asyncio.gather(
            *(cloning.make(lambda: np.zeros(1)) for _ in range(MAX_WAITING + 2)), return_exceptions=True
        )

    try:
        results = asyncio.run(many())
    finally:
        cloning.close()
    assert sum(isinstance(r, CloningBusy) for r in results) == 2
    assert sum(isinstance(r, torch.Tensor) for r in results) == MAX_WAITING
    assert Slow.peak == 1


# ------------------------------------------------------------------------------------------- the server's settings


def test_voice_cloning_settings_are_checked_before_anything_loads(weights, small, demo_tts, tmp_path):
    mimi, dns = (str(p) for p in small)
    with pytest.raises(SettingsError, match="needs both --voice-mimi and --voice-denoiser"):
        ServerSettings.from_options({"voice_mimi": mimi, "tts": "demo-tts"})
    with pytest.raises(SettingsError, match="give --tts too"):
        ServerSettings.from_options({"voice_mimi": mimi, "voice_denoiser": dns})
    missing = ServerSettings.from_options(
        {"voice_mimi": str(tmp_path / "no"), "voice_denoiser": dns, "tts": "demo-tts"}
    )
    with pytest.raises(CheckpointError, match="file not found") as error:
        check_cloning(missing)
    assert error.value.option == "voice_mimi"
    not_mimi = ServerSettings.from_options({"voice_mimi": dns, "voice_denoiser": mimi, "tts": "demo-tts"})
    with pytest.raises(CheckpointError, match="not a voice Mimi duplexd knows"):
        check_cloning(not_mimi)
    # the released voice Mimi's 512-wide voices are not the demo TTS's 32-wide ones: refused, naming --voice-mimi
    full = ServerSettings.from_options({"voice_mimi": str(weights[0]), "voice_denoiser": dns, "tts": "demo-tts"})
    tts = demo_tts.tts
    with pytest.raises(CheckpointError, match=r"its voices are \[1, 512, 125\], the text-to-speech model takes") as e:
        load_cloning(full, tts)
    assert e.value.option == "voice_mimi"
    cloning = load_cloning(ServerSettings.from_options({"voice_mimi": mimi, "voice_denoiser": dns, "tts": "x"}), tts)
    assert cloning is not None and cloning.maker.shape == (1, 32, 125)
    cloning.close()


# ------------------------------------------------------------------------------------------- duplexd voice make


def test_voice_make_writes_a_voice_speak_and_the_servers_take(small, small_maker, demo_tts, tmp_path, capsys):
    mimi, dns = (str(p) for p in small)
    sf.write(tmp_path / "me.wav", recording(6.0, rate=44_100), 44_100)
    out = tmp_path / "me.safetensors"
    assert main(["voice", "make", str(tmp_path / "me.wav"), "--out", str(out), "--mimi", mimi, "--denoiser", dns]) == 0
    voice = load_file(str(out))["speaker_wavs"]
    assert voice.shape == (1, 32, 125)
    want = small_maker.make(read_recording(tmp_path / "me.wav"))
    assert torch.allclose(voice, want, atol=1e-6)
    # `duplexd speak --voice FILE` says a text in it, and differently from a voice of the demo's
    for name, chosen in (("cloned.wav", str(out)), ("alice.wav", "demo/alice.wav")):
        assert main(["speak", "Hello there.", "--voice", chosen, "--out", str(tmp_path / name), "--temp", "0"]) == 0
    cloned, alice = sf.read(tmp_path / "cloned.wav")[0], sf.read(tmp_path / "alice.wav")[0]
    assert len(cloned) and not np.array_equal(cloned[: len(alice)], alice[: len(cloned)])
    # a server's voices folder takes it under a name with the model's suffix
    model = demo_tts
    folder = tmp_path / "voices" / "mine"
    folder.mkdir(parents=True)
    (folder / ("me.wav" + model.tts.voice_suffix)).write_bytes(out.read_bytes())
    assert torch.equal(load_voices(tmp_path / "voices", model)["mine/me.wav"], voice[0])
    # a recording no voice is made of: one line naming it, exit 2
    sf.write(tmp_path / "quiet.wav", np.zeros(RATE * 3, np.float32), RATE)
    capsys.readouterr()
    make = ["voice", "make", "--out", str(out), "--denoiser", dns]
    assert main([*make, str(tmp_path / "quiet.wav"), "--mimi", mimi]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("duplexd voice: error: ")
    assert "quiet.wav: the recording is silent" in err[0]
    assert main([*make, str(tmp_path / "me.wav"), "--mimi", dns]) == 2
    assert "duplexd voice: error: --mimi " in capsys.readouterr().err
