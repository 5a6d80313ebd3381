"""`duplexd capacity` and the pool sizing it shares with the engine: the answer matches what a CPU engine actually
allocates, the pool's bytes are sessions x the per-window bytes, the issue's H200 figure, `--kv-dtype` reaching
the engine (and fp8 refused on a GPU below compute capability 8.9), `--weights-dtype int8` (a 24 GB card's dozen
sessions, the int8 weight bytes counted from the config, which parts are int8 as the served model holds them), and
bad input as one line, exit 2."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from duplexd.commands.capacity import CUDA_CONTEXT, capacity, lm_config
from duplexd.commands.cli import main
from duplexd.engine.devices import check_kv_dtype
from duplexd.engine.dialogue.engine import CUDA_HEADROOM, Engine, EngineConfig
from duplexd.engine.errors import DeviceError
from duplexd.engine.models.config import DEMO, DEMO_MIMI, MOSHI_7B, PERSONAPLEX_7B, PRESETS, ConfigError, LMConfig
from duplexd.engine.models.int8_weights import Int8Weight, weight_dtypes
from duplexd.engine.models.mimi import MimiModel, MimiStreams
from duplexd.engine.weights.checkpoint import build_lm, int8_plan, quantize_lm_
from duplexd.engine.weights.demo import random_lm
from duplexd.server.core.settings import ServerSettings

GiB = 2**30


def _capacity_json(capsys, *args: str) -> dict:
    assert main(["capacity", "--json", *args]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[-1])


def test_moshi_7b_on_an_h200_fits_128_full_windows_in_int8_and_80_in_bf16(capsys):
    int8 = _capacity_json(capsys, "--model", "moshi-7b", "--gpu-memory", "139GiB", "--kv-dtype", "int8")
    bf16 = _capacity_json(capsys, "--model", "moshi-7b", "--gpu-memory", "139GiB")
    assert int8["sessions"] >= 128 and 75 <= bf16["sessions"] < 90
    assert int8["kv_window"] == 32 * 2 * 47 * 64 * 32 * (128 + 4)  # 47 pages of 64 frames, an fp32 scale per head
    assert bf16["kv_window"] == 32 * 2 * 47 * 64 * 4096 * 2
    for r in (int8, bf16):  # the terms add up, and one session more would not fit
        assert r["free_for_engine"] == r["memory"] - r["cuda_context"] - r["lm_weights"] - r["mimi_weights"]
        assert r["kv_pages"] == r["sessions"] * r["kv_window"] // r["kv_page"]
        spent = r["headroom"] + r["mimi_streams"] + r["kv_pages"] * r["kv_page"]
        assert spent <= r["free_for_engine"] < spent + r["kv_window"] + r["mimi_streams"] // r["sessions"]
    assert int8["lm_weights"] == pytest.approx(14.32 * GiB, rel=0.01) and int8["cuda_context"] == CUDA_CONTEXT


def lm_weight_bytes(cfg: LMConfig, float_bytes: int, weights_dtype: str) -> int:
    """The LM's weight bytes from its config alone: embeddings, norms and the text head in the float dtype; each
    projection (temporal and DepFormer layers, the DepFormer's input projections and audio heads) in it too, or,
    int8, a byte per element plus an fp32 absmax and an fp32 scale (8 bytes) per output row."""
    d, dd, q = cfg.dim, cfg.depformer_dim, cfg.agent_codebooks
    floats = (cfg.text_card + 1) * d + cfg.n_q * (cfg.card + 1) * d + d  # embeddings, out_norm
    floats += d * cfg.text_card  # the text head
    floats += cfg.num_layers * 2 * d + cfg.depformer_num_layers * 2 * dd  # attention and MLP norms
    floats += (cfg.text_card + 1) * dd + (q - 1) * (cfg.card + 1) * dd  # the DepFormer's embeddings
    projections = [  # (weight sets, inputs, outputs)
        *[(1, d, 3 * d), (1, d, d), (1, d, 2 * cfg.hidden), (1, cfg.hidden, d)] * cfg.num_layers,
        (q, d, dd),
        *[(q, dd, 3 * dd), (q, dd, dd), (q, dd, 2 * cfg.depformer_hidden), (q, cfg.depformer_hidden, dd)]
        * cfg.depformer_num_layers,
        (q, dd, cfg.card),
    ]
    if weights_dtype == "int8":
        return floats * float_bytes + sum(n * (i * o + 8 * o) for n, i, o in projections)
    return (floats + sum(n * i * o for n, i, o in projections)) * float_bytes


def test_int8_weights_fit_a_dozen_full_windows_on_a_24_gb_card(capsys):
    """A 24 GB card (23028 MiB as the driver reports an A10G or L4, the sizing table's figure) with an int8 KV
    pool: 12 full-window sessions with int8 weights, 3 with bf16 (measured; with 22 GiB: 11 and 2). The int8 LM
    is 7.59 GiB against 14.32 (the text head stays bf16): the codes and per-row scales counted from the config,
    about half."""
    args = ("--model", "moshi-7b", "--gpu-memory", "23028MiB", "--kv-dtype", "int8")
    int8 = _capacity_json(capsys, *args, "--weights-dtype", "int8")
    bf16 = _capacity_json(capsys, *args, "--weights-dtype", "bf16")
    assert int8["sessions"] >= 12 and bf16["sessions"] < int8["sessions"]
    parts = ("projections", "audio_heads", "text_head", "embeddings", "norms")
    assert bf16["lm_weight_dtypes"] == dict.fromkeys(parts, "bfloat16")
    assert int8["lm_weight_dtypes"] == {
        "projections": "int8",
        "audio_heads": "int8",
        "text_head": "bfloat16",
        "embeddings": "bfloat16",
        "norms": "bfloat16",
    }
    assert int8["lm_weights"] == lm_weight_bytes(MOSHI_7B, 2, "int8")
    assert bf16["lm_weights"] == lm_weight_bytes(MOSHI_7B, 2, "bf16")
    assert 0.45 < int8["lm_weights"] / bf16["lm_weights"] < 0.55
    assert int8["kv_window"] == bf16["kv_window"] and int8["mimi_weights"] == bf16["mimi_weights"]
    assert int8["free_for_engine"] - bf16["free_for_engine"] == bf16["lm_weights"] - int8["lm_weights"]
    gib_22 = _capacity_json(capsys, "--gpu-memory", "22GiB", "--kv-dtype", "int8", "--weights-dtype", "int8")
    assert gib_22["sessions"] >= 11


def test_the_int8_parts_are_named_in_both_outputs(capsys):
    """The human lines say which parts are int8 and which stay in the float dtype; an STT model has no audio heads
    but extra heads, which stay float; a q8 file's int8 text head is named int8; a weight in no part is refused."""
    assert main(["capacity", "--model", "moshi-7b", "--gpu-memory", "139GiB", "--weights-dtype", "int8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "LM 7.59 GiB (int8: projections, audio heads; bfloat16: text head, embeddings, norms)" in lines[1]
    assert main(["capacity", "--model", "moshi-7b", "--gpu-memory", "139GiB"]) == 0
    assert "LM 14.32 GiB (bfloat16), Mimi" in capsys.readouterr().out.splitlines()[1]
    stt = _capacity_json(capsys, "--model", "stt-1b", "--gpu-memory", "139GiB", "--weights-dtype", "int8")
    assert stt["lm_weight_dtypes"] == {
        "projections": "int8",
        "text_head": "bfloat16",
        "extra_heads": "bfloat16",
        "embeddings": "bfloat16",
        "norms": "bfloat16",
    }
    q8 = build_lm(DEMO, "meta", int8=int8_plan(DEMO, set(), "int8", text_head=True))
    assert weight_dtypes(q8) == {
        "projections": "int8",
        "audio_heads": "int8",
        "text_head": "int8",
        "embeddings": "float32",
        "norms": "float32",
    }
    q8.register_parameter("stray", torch.nn.Parameter(torch.zeros(1, device="meta")))
    with pytest.raises(ValueError, match="stray: in no part"):
        weight_dtypes(q8)


@pytest.mark.parametrize(
    ("kv_dtype", "weights_dtype"),
    [("bf16", "bf16"), ("int8", "bf16"), ("fp8", "bf16"), ("bf16", "int8"), ("int8", "int8")],
)
def test_capacity_agrees_with_what_a_cpu_engine_allocates(kv_dtype, weights_dtype):
    """The demo config (fp32 weights, a CPU engine's dtype) on a made-up 0.4 GiB GPU: an engine with that many
    slots allocates exactly the pool capacity reports, and its weights are the bytes capacity counted; with int8
    weights, the quantized model's codes and scales (buffers) are those bytes."""
    mimi = MimiModel(DEMO_MIMI).init_weights_(0)
    lm = quantize_lm_(random_lm(DEMO, seed=0), weights_dtype)
    got = capacity(
        "demo",
        DEMO,
        "demo",
        kv_dtype,
        torch.float32,
        int(0.4 * GiB) + CUDA_CONTEXT + CUDA_HEADROOM,
        weights_dtype=weights_dtype,
    )
    int8_parts = {part for part, dtype in got.lm_weight_dtypes.items() if dtype == "int8"}
    assert int8_parts == ({"projections", "audio_heads"} if weights_dtype == "int8" else set())
    assert set(got.lm_weight_dtypes.values()) - {"int8"} == {"float32"}
    # as the served model holds them: every temporal and DepFormer projection and audio head int8, nothing else
    assert isinstance(lm.layers[0].w_out, Int8Weight) == isinstance(lm.dep_heads, Int8Weight) == bool(int8_parts)
    assert isinstance(lm.text_head, torch.Tensor) and lm.text_head.dtype == torch.float32
    assert 1 < got.sessions < 1000
    engine = Engine(lm, mimi, config=EngineConfig(max_sessions=got.sessions, kv_dtype=kv_dtype))
    kv = engine.kv
    assert kv.keys.dtype == {"bf16": torch.float32, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_dtype]
    assert kv.num_pages == got.kv_pages and kv.nbytes == got.kv_pool == (got.kv_pages + 1) * got.kv_page
    assert kv.nbytes == got.sessions * got.kv_window + got.kv_page  # sessions x one window, and the scratch page
    assert kv.sessions_fit() == got.sessions
    assert got.lm_weights == sum(t.nbytes for t in [*lm.parameters(), *lm.buffers()])
    assert got.lm_weights == lm_weight_bytes(DEMO, 4, weights_dtype)
    assert got.mimi_streams == MimiStreams.state_bytes(mimi, got.sessions)


def test_an_int8_engine_serves_sessions(tmp_path):
    mimi = MimiModel(DEMO_MIMI).init_weights_(0)
    engine = Engine(random_lm(DEMO, seed=0), mimi, config=EngineConfig(max_sessions=2, kv_dtype="int8", threads=1))
    engine.start()
    try:
        session = engine.open_session()
        session.push(np.zeros(4 * engine.frame_size, np.float32))
        outputs = [session.get(timeout=30) for _ in range(3)]
        assert all(o is not None for o in outputs)
        assert engine.kv.k_scales is not None and engine.kv.k_scales.any(), "the step wrote scales"
    finally:
        engine.stop()


def test_kv_dtype_from_the_settings_and_refusals(monkeypatch):
    monkeypatch.setenv("DUPLEXD_KV_DTYPE", "int8")
    assert ServerSettings().kv_dtype == "int8"
    with pytest.raises(ConfigError, match="kv_dtype 'int4'"):
        EngineConfig(kv_dtype="int4")
    check_kv_dtype("fp8", "cpu")  # the torch path runs fp8 on a CPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10G")
    with pytest.raises(DeviceError, match=r"fp8 needs compute capability 8.9 or newer; cuda:0 \(NVIDIA A10G\) is 8.6"):
        check_kv_dtype("fp8", "cuda:0")
    check_kv_dtype("int8", "cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_kv_dtype("fp8", "cuda:0")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu-memory", "lots"], "--gpu-memory lots: not a size"),
        (["--gpu-memory", "80GB", "--window", "0"], "--window 0: must be at least 1 frame"),
        (["--gpu-memory", "80GB", "--model", "moshi-13b"], "--model moshi-13b: not a preset"),
        (["--gpu-memory", "80GB", "--model", "demo", "--config", "c.json"], "--config give --model or --config"),
        ([], "--gpu-memory not given, and this machine has no CUDA device"),
        (["--gpu-memory", "80GB", "--model", "stt-1b", "--llm-share", "1.5"], "--llm-share 1.5: must be a fraction"),
        (["--gpu-memory", "80GB", "--agents"], "--agents voice agents need a speech-to-text model"),
        (["--gpu-memory", "80GB", "--model", "stt-1b", "--agents", "--tts-streams", "4"], "--agents give --agents or"),
    ],
)
def test_bad_input_is_one_line_naming_the_option(capsys, args, message):
    if not args and torch.cuda.is_available():
        pytest.skip("a live CUDA device answers without --gpu-memory")
    assert main(["capacity", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize(
    ("cfg", "rule", "mimi"),
    [(PERSONAPLEX_7B, "personaplex", "mimi"), (PRESETS["stt-1b"], "moshi", "mimi-32")],
    ids=["personaplex-7b", "stt-1b"],
)
def test_a_config_file_is_read_as_the_server_reads_its_checkpoint(tmp_path, cfg, rule, mimi):
    """`--config`: the ring rule the server gives a checkpoint of it (`checkpoint_ring_rule`: NVIDIA's for a
    PersonaPlex LM, which its config.json cannot say) and, without --mimi-preset, the Mimi the server picks."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_reference_json()))
    _, read, picked = lm_config(argparse.Namespace(config=str(path), model=None, mimi_preset=None))
    assert (read.ring_rule, picked) == (rule, mimi)


def test_a_config_file_is_sized_as_its_preset(capsys, tmp_path):
    """`--config` alone, with no --mimi-preset, sizes what the same preset does (the Mimi is the server's pick)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MOSHI_7B.to_reference_json()))
    by_file = _capacity_json(capsys, "--gpu-memory", "80GB", "--config", str(path))
    assert by_file["sessions"] == _capacity_json(capsys, "--gpu-memory", "80GB", "--model", "moshi-7b")["sessions"]


def test_a_shorter_window_fits_more_sessions(capsys):
    full = _capacity_json(capsys, "--gpu-memory", "80GB", "--kv-dtype", "int8")
    short = _capacity_json(capsys, "--gpu-memory", "80GB", "--kv-dtype", "int8", "--window", "750")
    assert short["kv_window"] == -(-750 // 64) * full["kv_window"] // 47 and short["sessions"] > 3 * full["sessions"]


def test_tts_streams_beside_the_model_are_what_the_speech_service_allocates(capsys, tmp_path):
    """`--tts-streams N` sets aside tts-1.6b's share first; its terms are the speech service's own allocations
    (checked on the demo TTS, on the CPU: its KV windows, its voices' keys and values, its weights)."""
    from duplexd.engine.tts.demo import demo_tts_folder
    from duplexd.engine.tts.model import load_tts
    from duplexd.engine.tts.service import SpeechService
    from duplexd.engine.tts.sizing import speech_memory

    model = load_tts(demo_tts_folder(tmp_path))
    service = SpeechService(model, 3)
    counted = speech_memory(model.lm.cfg, model.tts, 3, torch.float32, mimi_preset="demo-32")
    assert counted.kv == service.gen.kv.nbytes
    assert counted.voices == service.gen.voices.nbytes
    assert counted.weights == sum(t.nbytes for m in (model.lm, model.mimi) for t in [*m.parameters(), *m.buffers()])
    assert main(["capacity", "--model", "stt-1b", "--gpu-memory", "48GiB", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert main(["capacity", "--model", "stt-1b", "--gpu-memory", "48GiB", "--tts-streams", "16", "--json"]) == 0
    mixed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert mixed["tts_streams"] == 16 and 5 * 2**30 < mixed["tts_memory"] < 8 * 2**30
    assert alone["free_for_engine"] - mixed["free_for_engine"] == mixed["tts_memory"]
    assert mixed["sessions"] < alone["sessions"]
    # int8 projections (`serve --tts-weights-dtype int8`): as the service holds them, a smaller share
    int8_model = load_tts(demo_tts_folder(tmp_path), weights_dtype="int8")
    int8_counted = speech_memory(model.lm.cfg, model.tts, 3, torch.float32, "demo-32", weights_dtype="int8")
    assert int8_counted.weights == sum(
        t.nbytes for m in (int8_model.lm, int8_model.mimi) for t in [*m.parameters(), *m.buffers()]
    )
    assert int8_counted.weights < counted.weights
    int8_mix = ["capacity", "--model", "stt-1b", "--gpu-memory", "48GiB", "--tts-streams", "16", "--json"]
    assert main([*int8_mix, "--tts-weights-dtype", "int8"]) == 0
    int8_mixed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert int8_mixed["tts_memory"] < mixed["tts_memory"] and int8_mixed["sessions"] >= mixed["sessions"]


def test_an_llm_beside_takes_its_share_and_agents_are_the_most_that_fit(capsys):
    """`--llm-share F` sets aside F of the GPU (vLLM's --gpu-memory-utilization) before the engine's pool;
    `--agents` finds the most N with N STT sessions and N TTS streams: one more stream and they no longer fit."""
    base = ["--model", "stt-1b", "--gpu-memory", "80GB", "--tts-streams", "16"]
    alone = _capacity_json(capsys, *base)
    shared = _capacity_json(capsys, *base, "--llm-share", "0.3")
    assert shared["llm_memory"] == int(0.3 * 80e9) and shared["llm_share"] == 0.3
    assert alone["free_for_engine"] - shared["free_for_engine"] == shared["llm_memory"]
    assert shared["sessions"] < alone["sessions"] and shared["agents"] == 16
    best = _capacity_json(capsys, "--model", "stt-1b", "--gpu-memory", "80GB", "--llm-share", "0.3", "--agents")
    n = best["agents"]
    assert n == best["tts_streams"] and best["sessions"] >= n > 16
    more = _capacity_json(
        capsys, "--model", "stt-1b", "--gpu-memory", "80GB", "--llm-share", "0.3", "--tts-streams", str(n + 1)
    )
    assert more["sessions"] < n + 1
    assert main(["capacity", "--model", "stt-1b", "--gpu-memory", "80GB", "--llm-share", "0.3", "--agents"]) == 0
    assert f"voice agents (an STT session and a TTS stream each): {n}" in capsys.readouterr().out
