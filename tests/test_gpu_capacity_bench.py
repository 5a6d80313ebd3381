"""bench/gpu_capacity.py's accounting on CPU: percentiles, the capacity search, refused sessions given back, and a
batch whose steps fail failing the whole run (the tiny demo preset with random weights, or fakes at the boundary)."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from duplexd.engine.dialogue.engine import Engine, EngineConfig
from duplexd.engine.dialogue.pipeline import Pipeline
from duplexd.server.core.runtime import random_models

_PATH = Path(__file__).resolve().parents[1] / "bench" / "gpu_capacity.py"
_spec = importlib.util.spec_from_file_location("gpu_capacity", _PATH)
cap = importlib.util.module_from_spec(_spec)
sys.modules["gpu_capacity"] = cap
_spec.loader.exec_module(cap)

GRID = [1, 8, 32, 48, 64, 72, 80]


def test_percentile_interpolates_like_numpy_and_p99_is_not_the_max():
    rng = random.Random(0)
    for n in (1, 2, 7, 50, 200, 1001):
        values = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert cap.percentile(values, q) == pytest.approx(np.percentile(values, q), abs=1e-9)
    assert cap.percentile([4, 1, 3, 2], 50) == 2.5
    assert cap.percentile(list(range(1, 51)), 99) == pytest.approx(49.51)  # the old code took the max, 50
    assert cap.percentile(list(range(1, 201)), 99) == pytest.approx(198.01)
    with pytest.raises(ValueError):
        cap.percentile([], 50)


def _fake(threshold: float, limit: int, seen: list[int], fail_at: int | None = None):
    """A measure whose p99 is the batch in ms: batches up to `threshold` meet a budget of `threshold` ms."""

    def measure(batch: int):
        assert batch <= limit, "measured a batch the KV pool cannot admit"
        seen.append(batch)
        if batch == fail_at:
            return cap.BatchResult(batch, cap.FAILED, [1.0], batch, "slot 3 ended after 2 of 9 outputs (engine_error)")
        return cap.BatchResult(batch, cap.OK, [batch - 1.0] * 50 + [float(batch)] * 150, batch)

    return measure


@pytest.mark.parametrize(
    "threshold, limit, granularity, want",
    [
        (67, 75, 1, 67),
        (67, 75, 4, 64),
        (72, 75, 1, 72),
        (100, 75, 1, 75),
        (100, 75, 4, 75),
        (100, 90, 1, 90),
        (100, 90, 4, 90),
        (85, 90, 4, 84),
        (0.5, 75, 1, 0),
        (5, 75, 1, 5),
        (40, 75, 4, 40),
        (9, 4, 1, 4),
    ],
)
def test_capacity_search_finds_the_largest_batch_within_budget(threshold, limit, granularity, want):
    seen: list[int] = []
    sweep = cap.find_capacity(_fake(threshold, limit, seen), GRID, limit, threshold, granularity)
    assert sweep.capacity == want and sweep.failed is None
    assert len(seen) == len(set(seen)) <= len(GRID) + 4  # no batch twice; bisection, not a scan
    first_miss = next((b for b in GRID if b > min(threshold, limit)), None)
    assert all(b <= first_miss for b in seen if b in GRID) if first_miss else True  # the grid stops at a miss
    by_batch = {r.batch: r for r in sweep.results}
    if first_miss is not None and first_miss > limit:
        assert by_batch[first_miss].status == cap.NO_FIT


def test_a_failed_batch_fails_the_sweep_and_claims_no_capacity():
    seen: list[int] = []
    sweep = cap.find_capacity(_fake(100, 80, seen, fail_at=32), GRID, 80, 80.0)
    assert sweep.capacity is None and sweep.failed is not None and sweep.failed.batch == 32
    assert seen == [1, 8, 32]  # nothing after the failure
    words = "\n".join(cap.headline(sweep, 80, 80.0, 4))
    assert "FAILED at batch 32" in words and "engine_error" in words and "capacity:" not in words
    report = cap.summary(sweep, {"bench": "gpu_capacity"}, 80.0)
    assert report["status"] == "failed" and report["realtime_sessions"] is None


def test_buckets_cover_every_batch_the_search_may_measure():
    limit, granularity = 73, 4
    buckets = cap.buckets_for(GRID, limit, granularity)
    probes = set(GRID) | set(range(granularity, limit + 1, granularity)) | {limit}
    assert {b for b in probes if b <= limit} <= set(buckets) and max(buckets) == limit


# ------------------------------------------------------------------------------------------------ a real engine


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    lm, mimi = random_models("demo", "cpu", torch.float32)
    frames = 8 + cap.WARM_STEPS + cap.EXTRA_FRAMES
    eng = Engine(
        lm, mimi, config=EngineConfig(max_sessions=3, max_pending_frames=frames, max_output_frames=frames, threads=1)
    )
    eng.start()
    yield eng
    eng.stop()


def _held(engine: Engine) -> tuple[int, int, int]:
    s = engine.stats()
    return s.active_sessions, s.kv_pages_used, s.admissible_sessions


def test_sessions_opened_before_a_refusal_are_closed(engine):
    before = _held(engine)
    result = cap.measure(engine, 5, steps=2, position=100, timeout=30)
    assert result.status == cap.NO_FIT and "slots" in result.error
    assert _held(engine) == before  # the 3 sessions admitted before the refusal gave their slot and pages back
    assert cap.measure(engine, 3, steps=2, position=100, timeout=30).status == cap.OK  # and can be used again


def test_measure_times_full_batches_only(engine):
    before = _held(engine)
    result = cap.measure(engine, 3, steps=5, position=2999, timeout=30)
    assert result.status == cap.OK, result.error
    assert len(result.samples_ms) == 5 and result.bucket == 3 and all(t > 0 for t in result.samples_ms)
    assert _held(engine) == before


def test_failed_steps_fail_the_batch(engine, monkeypatch):
    step = engine.pipeline.step

    def failing(slots, pcm):  # the warm-up frame passes; steps after the seek fail, as a device error would
        if int(engine.pipeline.lm_gen.offsets[slots].min()) > 1000:
            raise RuntimeError("injected failure")
        return step(slots, pcm)

    monkeypatch.setattr(engine.pipeline, "step", failing)
    before = _held(engine)
    result = cap.measure(engine, 2, steps=3, position=2999, timeout=30)
    assert result.status == cap.FAILED and "engine_error" in result.error
    assert not result.meets(1e9)
    assert _held(engine) == before


def test_a_failed_batch_fails_the_dry_run(tmp_path, monkeypatch, capsys):
    """Batch 2's steps fail after the seek: the run exits 1 and claims no capacity (the passing dry run is
    test_bench_smoke's, through bench/gpu_suite.sh)."""
    step = Pipeline.step

    def failing(self, slots, pcm):  # batch 2, after the seek: its sessions end with engine_error
        if len(slots) == 2 and int(self.lm_gen.offsets[slots].min()) > 1000:
            raise RuntimeError("injected failure")
        return step(self, slots, pcm)

    monkeypatch.setattr(Pipeline, "step", failing)
    args = ["--preset", "demo", "--device", "cpu", "--batches", "1", "2", "--steps", "3", "--max-sessions", "2"]
    args += ["--granularity", "1", "--budget-ms", "1e6", "--timeout", "30", "--out", str(tmp_path)]
    rc = cap.main(args)
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "gpu_capacity.json").read_text())
    last = json.loads(out.strip().splitlines()[-1])
    assert rc == 1 and "FAILED at batch 2" in out and "capacity:" not in out
    assert report["status"] == "failed" and report["realtime_sessions"] is None
    assert report["failed"]["batch"] == 2 and "engine_error" in report["failed"]["error"]
    assert last["status"] == "failed" and last["realtime_sessions"] is None


def test_the_kv_pool_bounds_the_sweep(tmp_path):
    from duplexd.engine.kv.paged import PagedKVCache, window_pages
    from duplexd.engine.models.config import DEMO

    page = PagedKVCache.page_bytes(DEMO.num_layers, DEMO.num_heads, DEMO.head_dim, 64, torch.float32)
    two_and_a_half = int(2.5 * window_pages(DEMO.context, 64) * page)
    args = [
        "--preset",
        "demo",
        "--device",
        "cpu",
        "--batches",
        "1",
        "4",
        "--steps",
        "2",
        "--max-sessions",
        "8",
        "--granularity",
        "1",
        "--budget-ms",
        "1e6",
        "--kv-memory",
        str(two_and_a_half),
        "--out",
        str(tmp_path),
    ]
    assert cap.main(args) == 0
    report = json.loads((tmp_path / "gpu_capacity.json").read_text())
    assert report["kv_sessions"] == 2 and report["realtime_sessions"] == 2
    statuses = {b["batch"]: b["status"] for b in report["batches"]}
    assert statuses == {1: cap.OK, 2: cap.OK, 4: cap.NO_FIT}  # the grid's 4 does not fit; bisection finds 2


def test_pool_sessions_counts_mimi_streams_per_slot(monkeypatch):
    """Each slot costs Mimi streams beside its KV pages, so the bench asks the engine's sizing rule for the most
    slots whose sessions all fit (CUDA memory stubbed, checked on the CPU)."""
    from duplexd.engine.dialogue.engine import CUDA_HEADROOM
    from duplexd.engine.kv.paged import PagedKVCache, window_pages
    from duplexd.engine.models.mimi import MimiStreams

    lm, mimi = random_models("demo", "cpu", torch.float32)
    cfg, page_size = lm.cfg, 64
    per = window_pages(cfg.context, page_size)
    session = per * PagedKVCache.page_bytes(cfg.num_layers, cfg.num_heads, cfg.head_dim, page_size, torch.float32)
    streams = MimiStreams.state_bytes(mimi, 1) - MimiStreams.state_bytes(mimi, 0)  # one slot's share
    for n in (1, 5, 12):  # memory for exactly n sessions and their streams
        free = CUDA_HEADROOM + MimiStreams.state_bytes(mimi, n) + n * session + session // 2
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, 2 * free))
        config = EngineConfig(max_sessions=256, page_size=page_size, device="cuda")
        assert cap.pool_sessions(lm, mimi, config) == n
        assert cap.pool_sessions(
            lm, mimi, EngineConfig(max_sessions=n - 1 or 1, page_size=page_size, device="cuda")
        ) == max(n - 1, 1)
    assert streams > 0
