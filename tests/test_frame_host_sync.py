"""A whole frame step (Mimi encode → temporal step → DepFormer → Mimi decode) makes no host sync and no CPU
tensor, checked without a GPU: Moshi 7B (bf16 weights, and int8 ones through the W8A16 kernel), Kyutai STT 1B
(encode and temporal step only) and the real Mimi on
the `meta` device with the Triton path forced and its launches made no-ops (a meta tensor has no data, so anything
that reads a value back shows up)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duplexd.engine.dialogue.pipeline import Pipeline
from duplexd.engine.models.config import MIMI_PRESETS, PRESETS
from duplexd.engine.models.int8_weights import Int8Weight, use_int8_kernel
from duplexd.engine.models.mimi import MimiModel
from duplexd.engine.weights.checkpoint import build_lm, int8_plan
from duplexd.kernels.dispatch import force_triton

from .host_sync import HostWork


@pytest.fixture(scope="module")
def meta_models():
    lm = build_lm(PRESETS["moshi-7b"], device="meta", dtype=torch.bfloat16)
    return lm, MimiModel(MIMI_PRESETS["mimi"]).to("meta")


@pytest.fixture(scope="module")
def meta_int8_lm():
    """Moshi 7B as `--weights-dtype int8` loads it: every projection and the text head int8 codes + fp32 scales."""
    cfg = PRESETS["moshi-7b"]
    return build_lm(cfg, device="meta", dtype=torch.bfloat16, int8=int8_plan(cfg, set(), "int8"))


def test_host_work_catches_what_it_should():
    x = torch.arange(6, device="meta")
    setitem = torch.Tensor.__setitem__
    with HostWork() as mode:
        int(x.max())
        x.nonzero()
        x.tolist()
        x[torch.tensor([1, 2])]  # a host index for a device tensor: made on the host, then copied
        torch.tensor([1, 2])
        x[1:3]  # a view: nothing
        x + 1  # device work: nothing
        x[x.argmax()[None]] = 0  # on CUDA the 0 is made on the host and copied: a graph capture fails there
        x[1] = 0  # a fill with a scalar argument: nothing
        x[x.argmax()[None]] = torch.zeros(1, dtype=x.dtype, device=x.device)  # a device value: nothing
    assert [op.kind for op in mode.ops] == ["sync", "sync", "sync", "cpu", "sync", "cpu", "sync"], mode.ops
    assert "= Python scalar" in mode.ops[-1].op
    assert torch.Tensor.__setitem__ is setitem  # the mode puts indexing back on exit
    assert all("test_frame_host_sync" not in op.where for op in mode.ops)  # only duplexd's own lines are named


def host_free_step(lm, mimi, mode: str, kv_dtype: str, positions: tuple[int, ...], attention_kernel: str = "split"):
    """One meta frame step of slots 0, 2, 3, 5 at `positions` (each slot sought there first), in `mode`, with the
    decode attention `attention_kernel`, checked to do no host work; the pipeline and its output. The engine hands
    host audio (staged, then copied); offline callers may hand a device tensor (exact-batch)."""
    pipeline = Pipeline(
        lm,
        mimi,
        num_slots=6,
        buckets=(1, 2, 4, 6),
        pad=mode != "exact-batch",
        graphs=mode == "graphs-before-capture",
        kv_dtype=kv_dtype,
    )
    pipeline.lm_gen.kv.attention_kernel = attention_kernel
    slots = [0, 2, 3, 5]
    for slot, position in zip(slots, positions, strict=True):
        pipeline.seek(slot, position)
    shape = (4, pipeline.frame_size)
    pcm = torch.zeros(shape, device="meta") if mode == "exact-batch" else np.zeros(shape, np.float32)
    with force_triton(), HostWork() as host:
        out = pipeline.step(slots, pcm)
    assert not host.ops, "host work inside the frame step:\n" + "\n".join(map(str, host.ops))
    return pipeline, out


@pytest.mark.parametrize(
    ("kv_dtype", "weights"),
    [
        pytest.param("bf16", "bf16", id="bf16"),
        pytest.param("int8", "bf16", id="int8"),
        pytest.param("fp8", "bf16", id="fp8"),
        pytest.param("bf16", "int8", id="int8-weights"),
    ],
)
@pytest.mark.parametrize("mode", ["exact-batch", "padded-to-bucket", "graphs-before-capture"])
def test_frame_step_makes_no_host_sync_and_no_cpu_tensor(request, meta_models, no_launch, mode, kv_dtype, weights):
    """Also the path of the engine's warm-up on CUDA: graphs on, nothing captured yet (inputs staged on the host
    go through the padded eager call); with an 8-bit KV pool, whose scales are device tensors only; and with int8
    weights, whose codes and scales go to the W8A16 kernel as they are (attribute checks only)."""
    lm, mimi = meta_models
    if weights == "int8":
        lm = request.getfixturevalue("meta_int8_lm")
        assert isinstance(lm.layers[0].wqkv, Int8Weight) and not isinstance(lm.text_head, Int8Weight)
    # warming up, first output, full and wrapped window
    pipeline, out = host_free_step(lm, mimi, mode, kv_dtype, (0, 1, 2999, 7000))
    assert (pipeline.lm_gen.kv.k_scales is None) == (kv_dtype == "bf16")
    # int8 weights: every projection of the temporal step and the DepFormer (each step's 4 per layer, its input
    # projection and head) through the W8A16 kernel (the text head stays float); float weights never launch it
    cfg = lm.cfg
    projections = 4 * cfg.num_layers + cfg.agent_codebooks * (4 * cfg.depformer_num_layers + 2)
    assert no_launch.count("_w8a16_kernel") == (projections if weights == "int8" else 0)
    assert out.valid == [False, True, True, True]  # from the pipeline's own counts, not read back
    assert out.pcm.shape == (4, pipeline.frame_size) and out.tokens.shape == (4, 1 + cfg.dep_q)


def test_frame_step_with_the_paged_attention_kernel(meta_models, no_launch):
    """`--attention-kernel paged` on the CUDA warm-up's path with an int8 pool (its launcher takes the scale pools
    too): no host work, and every layer's attention through `_paged_kernel`, none through `_split_kernel`."""
    lm, mimi = meta_models
    host_free_step(lm, mimi, "graphs-before-capture", "int8", (0, 1, 2999, 7000), attention_kernel="paged")
    assert no_launch.count("_paged_kernel") == lm.cfg.num_layers and "_split_kernel" not in no_launch


def test_frame_step_with_the_gemv_kernel(meta_int8_lm, meta_models, no_launch):
    """`--w8a16-kernel gemv` on int8 weights in a padded bucket of 4 rows: no host work; every projection through
    `_w8a16_gemv_kernel`, none through the tiles, and the DepFormer's longer-K ones (its input projection, each
    layer's w_out: 1024 columns) split along K, their partial sums added by `_w8a16_split_sum_kernel`."""
    lm, cfg = meta_int8_lm, meta_int8_lm.cfg
    use_int8_kernel(lm, "gemv")
    try:
        host_free_step(lm, meta_models[1], "padded-to-bucket", "bf16", (0, 1, 2999, 7000))
    finally:
        use_int8_kernel(lm, "tiles")  # the module's fixture, as the other tests take it
    projections = 4 * cfg.num_layers + cfg.agent_codebooks * (4 * cfg.depformer_num_layers + 2)
    assert no_launch.count("_w8a16_gemv_kernel") == projections and "_w8a16_kernel" not in no_launch
    assert no_launch.count("_w8a16_split_sum_kernel") == cfg.agent_codebooks * (1 + cfg.depformer_num_layers)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("mode", ["exact-batch", "padded-to-bucket", "graphs-before-capture"])
def test_stt_frame_step_makes_no_host_sync_and_runs_no_decoder(monkeypatch, no_launch, mode, kv_dtype):
    """Kyutai STT 1B (dep_q = 0, 32 codebooks in, 4 extra heads) with Mimi at 32 codebooks: the frame is Mimi's
    encoder and the temporal step, host-free; neither the DepFormer nor Mimi's decoder runs (it has no state)."""
    lm = build_lm(PRESETS["stt-1b"], device="meta", dtype=torch.bfloat16)
    mimi = MimiModel(MIMI_PRESETS["mimi-32"]).to("meta")

    def never(*args, **kwargs):
        raise AssertionError("a text-only frame ran Mimi's decoder")

    monkeypatch.setattr(MimiModel, "decode_frame", never)
    # first step, second, full and wrapped window
    pipeline, out = host_free_step(lm, mimi, mode, kv_dtype, (0, 1, 749, 2000))
    assert not pipeline.mimi.has_decoder
    assert out.valid == [True] * 4  # no delays: every step answers, from the first
    assert out.pcm.shape == (4, 0) and out.tokens.shape == (4, 1) and out.pause.shape == (4, 4)
    assert "_split_kernel" in no_launch  # the temporal step ran its paged attention


def test_the_public_mimi_calls_check_their_arguments_the_frame_calls_do_not(meta_models):
    """The checks that read values (`MimiStreams.encode`/`decode`) stay out of the frame path, which uses
    `encode_frame`/`decode_frame`; shown by the checked call making exactly its own syncs."""
    pipeline = Pipeline(*meta_models, num_slots=2)
    with HostWork() as mode:
        pipeline.mimi.decode(torch.tensor([1], device="meta"), torch.zeros(1, 8, 1, dtype=torch.long, device="meta"))
    assert {op.where.split(":")[0] for op in mode.ops if op.kind == "sync"} == {"duplexd/engine/models/mimi.py"}


def test_admission_is_host_bookkeeping_only():
    """`open_session` runs on the server's event loop: it must not touch a tensor (a copy to the device would
    wait for the step in flight). The slot's KV row reaches the device on the loop thread, before its first step."""
    from duplexd.engine.dialogue.engine import Engine, EngineConfig
    from duplexd.engine.dialogue.sampling import SamplingParams
    from duplexd.engine.models.config import DEMO, DEMO_MIMI
    from duplexd.engine.weights.demo import random_lm

    engine = Engine(
        random_lm(DEMO, seed=0),
        MimiModel(DEMO_MIMI).init_weights_(0),
        config=EngineConfig(max_sessions=2, page_size=64),
    )
    engine.start()
    try:
        with HostWork() as host:
            session = engine.open_session(SamplingParams(seed=3))
        assert not host.ops, "\n".join(map(str, host.ops))
        session.push(np.zeros(2 * engine.frame_size, np.float32))
        assert session.get(timeout=30) is not None
        row = engine.kv.host_tables[session.slot]
        assert engine.kv.tables[session.slot].tolist() == row.tolist() and (row != engine.kv.scratch).any()
    finally:
        engine.stop()
