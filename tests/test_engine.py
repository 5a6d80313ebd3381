"""The batched engine: isolation between sessions sharing a batch, admission, lifecycle, no leaks."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time

import numpy as np
import pytest

from duplexd.engine.dialogue.engine import Engine, EngineConfig
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.errors import CapacityError, SessionClosed
from duplexd.engine.loop_thread import default_threads
from duplexd.engine.models.config import DEMO_MIMI, ConfigError, LMConfig
from duplexd.engine.models.mimi import MimiModel
from duplexd.engine.weights.demo import random_lm

# Small but complete: several layers and heads, all 16 streams, short context so windows wrap within a test.
CFG = LMConfig(
    dim=64,
    text_card=97,
    num_heads=4,
    num_layers=3,
    depformer_dim=32,
    depformer_dim_feedforward=132,
    depformer_num_heads=2,
    depformer_num_layers=2,
    context=24,
)
FRAME = DEMO_MIMI.frame_size
GREEDY = SamplingParams(text_temperature=0.0, text_topk=1, audio_temperature=0.0, audio_topk=1)


@pytest.fixture(scope="module")
def models():
    return random_lm(CFG, seed=0), MimiModel(DEMO_MIMI).init_weights_(1)


def _engine(models, **kw) -> Engine:
    engine = Engine(*models, config=EngineConfig(**{"page_size": 8, **kw}))
    engine.start()
    return engine


def _audio(frames: int, seed: int) -> np.ndarray:
    t = np.arange(frames * FRAME) / 24000
    rng = np.random.default_rng(seed)
    return (0.3 * np.sin(2 * np.pi * (150 + 40 * seed) * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


def _run_alone(models, params: SamplingParams, audio: np.ndarray) -> list:
    engine = _engine(models, max_sessions=1)
    try:
        session = engine.open_session(params)
        outs = []
        for i in range(len(audio) // FRAME):
            session.push(audio[i * FRAME : (i + 1) * FRAME])
            if i:
                outs.append(session.get(timeout=30))
        return outs
    finally:
        engine.stop()


@pytest.mark.parametrize("pad", [False, True], ids=["exact-batch", "padded-to-bucket"])
def test_sessions_in_one_batch_match_each_session_alone(models, pad):
    """Four sessions (different seeds and sampling, one greedy) start at different frames, one leaves early; each
    produces exactly the tokens, text and speech it produces alone."""
    plan = {  # session -> (params, first round, rounds)
        0: (SamplingParams(seed=11), 0, 40),
        1: (GREEDY, 2, 30),
        2: (
            SamplingParams(text_temperature=1.0, text_topk=50, audio_temperature=0.6, audio_topk=40, seed=12),
            5,
            12,
        ),  # leaves early
        3: (SamplingParams(seed=13), 9, 31),
    }
    audio = {s: _audio(n, seed=s) for s, (_, _, n) in plan.items()}
    # max_sessions 5 with buckets 1, 2, 4, 5: batches of 3 run padded to 4.
    engine = _engine(models, max_sessions=5, pad_batches=pad)
    sessions, outs = {}, {s: [] for s in plan}
    try:
        for rnd in range(45):
            live = [s for s, (_, start, n) in plan.items() if start <= rnd < start + n]
            for s in live:
                if s not in sessions:
                    sessions[s] = engine.open_session(plan[s][0])
                i = rnd - plan[s][1]
                sessions[s].push(audio[s][i * FRAME : (i + 1) * FRAME])
            for s in live:
                if rnd > plan[s][1]:
                    outs[s].append(sessions[s].get(timeout=30))
            for s, (_, start, n) in plan.items():
                if rnd == start + n - 1:
                    sessions[s].close()
    finally:
        engine.stop()
    scratch = engine.kv.keys[:, engine.kv.scratch].abs().sum()
    assert (scratch > 0) == pad, "padding rows (and only they) write to the scratch page"
    for s, (params, _, n) in plan.items():
        alone = _run_alone(models, params, audio[s])
        together = outs[s]
        assert len(together) == len(alone) == n - 1
        assert [o.audio_tokens for o in together] == [o.audio_tokens for o in alone], f"session {s} audio tokens"
        assert [o.text_token for o in together] == [o.text_token for o in alone], f"session {s} text"
        np.testing.assert_allclose(
            np.stack([o.pcm for o in together]),
            np.stack([o.pcm for o in alone]),
            atol=1e-5,
            err_msg=f"session {s} speech",
        )
    assert len({o.audio_tokens for o in outs[0]}) > 10, "sampling should vary between frames"
    assert outs[0][0].audio_tokens != outs[3][0].audio_tokens


def test_capacity_slots_and_pages(models):
    # Pages for 2 full windows (3 pages each) and 4 slots.
    engine = _engine(models, max_sessions=4, kv_memory=6 * _page_bytes(models[0], 8))
    try:
        a, b = engine.open_session(), engine.open_session()
        assert engine.stats().admissible_sessions == 0
        with pytest.raises(CapacityError, match="not enough KV cache"):
            engine.open_session()
        a.close()
        _wait(lambda: engine.stats().kv_pages_used == 3)
        short = [engine.open_session(max_frames=8) for _ in range(3)]  # a capped session reserves one page
        with pytest.raises(CapacityError, match="all 4 session slots are in use"):
            engine.open_session(max_frames=8)
        assert engine.stats().refused == 2
        for s in (b, *short):
            s.close()
        _wait(lambda: engine.stats().kv_pages_used == 0)
    finally:
        engine.stop()


def test_capacity_plus_one_is_refused(models):
    engine = _engine(models, max_sessions=3)
    try:
        sessions = [engine.open_session() for _ in range(3)]
        with pytest.raises(CapacityError, match="slots are in use"):
            engine.open_session()
        assert {s.slot for s in sessions} == {0, 1, 2}
    finally:
        engine.stop()
    assert all(s.closed and s.close_reason == "engine_stopped" for s in sessions)
    with pytest.raises(SessionClosed):
        sessions[0].push(np.zeros(FRAME, np.float32))


def test_sampling_changes_mid_conversation_from_the_next_step(models):
    """Two greedy sessions on the same audio agree frame for frame until one switches to sampling."""
    engine = _engine(models, max_sessions=2)
    audio, switch = _audio(16, seed=4), 6
    try:
        a, b = engine.open_session(GREEDY), engine.open_session(GREEDY)
        outs: dict = {a: [], b: []}
        for i in range(16):
            if i == switch:
                b.update_params(SamplingParams(text_temperature=1.0, audio_temperature=1.0, seed=5))
            for s in (a, b):
                s.push(audio[i * FRAME : (i + 1) * FRAME])
            if i:
                for s in (a, b):
                    outs[s].append(s.get(timeout=30).audio_tokens)
        b.close()
        with pytest.raises(SessionClosed):
            b.update_params(GREEDY)
    finally:
        engine.stop()
    # Output k comes from input frame k + 1: frames before the switch agree, the switched frame on differs.
    assert outs[a][: switch - 1] == outs[b][: switch - 1]
    assert outs[a][switch - 1] != outs[b][switch - 1]


def test_a_closed_session_frees_its_slot_at_once(models):
    """A client that closes and reconnects right away is admitted, even on a full server, mid-conversation."""
    engine = _engine(models, max_sessions=1)
    try:
        for _ in range(20):
            session = engine.open_session()
            session.push(np.zeros(2 * FRAME, np.float32))
            assert session.get(timeout=30) is not None
            session.close()
    finally:
        engine.stop()


def test_open_push_close_500_times_leaves_nothing_behind(models):
    """500 sessions from 4 threads with random lifetimes, some closed by another thread while their frame is in
    a step: every slot and page comes back, and sessions still running meanwhile get all their outputs."""
    engine = _engine(models, max_sessions=6)
    closer_queue: list = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    refused = [0]

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            opened = 0
            while opened < 125:
                try:
                    session = engine.open_session(SamplingParams(seed=rng.randrange(1000)))
                except CapacityError:
                    refused[0] += 1
                    time.sleep(0.001)
                    continue
                opened += 1
                frames = rng.randrange(0, 4)
                session.push(np.zeros(frames * FRAME + rng.randrange(FRAME), np.float32))
                how = rng.random()
                if how < 0.3:
                    with lock:
                        closer_queue.append(session)  # the closer thread ends it, likely mid-step
                elif how < 0.6 and frames > 1:
                    for _ in range(frames - 1):
                        assert session.get(timeout=30) is not None
                    session.close()
                else:
                    session.close()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def closer(stop: threading.Event) -> None:
        while not stop.is_set() or closer_queue:
            with lock:
                batch, closer_queue[:] = list(closer_queue), []
            for session in batch:
                session.close("closed from another thread")
            time.sleep(0.0005)

    steady = engine.open_session(GREEDY)  # a long session running through all of it
    steady.push(np.zeros(FRAME, np.float32))  # its warm-up frame, which has no output
    stop = threading.Event()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    closing = threading.Thread(target=closer, args=(stop,))
    try:
        closing.start()
        for t in threads:
            t.start()
        received = 0
        while any(t.is_alive() for t in threads):
            steady.push(np.zeros(FRAME, np.float32))
            if steady.get(timeout=30) is not None:
                received += 1
        for t in threads:
            t.join()
        stop.set()
        closing.join()
        assert not errors, errors
        steady.close()
        _wait(lambda: engine.stats().kv_pages_used == 0 and engine.stats().active_sessions == 0)
        stats = engine.stats()
        assert stats.admissible_sessions == 6 and engine.scheduler.free_slots() == list(range(6))
        assert engine.kv.pages_free == engine.kv.num_pages
        assert (engine.kv.host_tables == engine.kv.scratch).all()
        assert received > 0 and stats.frames_in > 150, stats
        assert steady.frames_dropped_out == 0
    finally:
        engine.stop()


def test_session_ends_at_max_frames_and_keeps_its_outputs(models):
    engine = _engine(models, max_sessions=2, max_session_frames=5)
    try:
        session = engine.open_session()
        assert engine.kv.pages_used == 1  # 5 frames fit one page of 8
        session.push(np.zeros(8 * FRAME, np.float32))
        outs = [session.get(timeout=30) for _ in range(4)]
        assert all(o is not None for o in outs) and [o.frame for o in outs] == [0, 1, 2, 3]
        assert session.get(timeout=30) is None and session.close_reason == "max_frames"
        with pytest.raises(SessionClosed, match="max_frames"):
            session.push(np.zeros(FRAME, np.float32))
    finally:
        engine.stop()


def test_bounded_inbox_and_outbox_drop_with_counters_and_events(models):
    engine = _engine(models, max_sessions=1, max_pending_frames=3, max_output_frames=2)
    events: list[tuple[str, int]] = []
    engine.on_dropped(lambda direction, count: events.append((direction, count)))
    try:
        session = engine.open_session()
        dropped = session.push(np.zeros(5 * FRAME, np.float32))  # one push fills the inbox atomically
        assert dropped == 2 and session.frames_dropped_in == 2 and session.frames_in == 3
        assert events == [("in", 2)]
        _wait(lambda: session.steps == 3)
        session.push(np.zeros(3 * FRAME, np.float32))
        _wait(lambda: session.steps == 6)
        assert session.frames_out == 5 and session.frames_dropped_out == 3
        assert events == [("in", 2)] + [("out", 1)] * 3
        assert [session.get(timeout=1).frame for _ in range(2)] == [3, 4]  # the newest two are kept
    finally:
        engine.stop()


def test_each_output_carries_the_arrival_of_the_input_frame_that_made_it(models):
    """Output k comes from the step of input frame k + 1 (the first frame only fills the acoustic delay)."""
    engine = _engine(models, max_sessions=1)
    try:
        session = engine.open_session()
        pushed = []
        for n in range(1, 5):
            before = time.monotonic()
            session.push(np.zeros(FRAME, np.float32))
            pushed.append((before, time.monotonic()))
            _wait(lambda n=n: session.steps == n)
            time.sleep(0.02)
        outs = [session.get(timeout=1) for _ in range(3)]
        for k, out in enumerate(outs):
            before, after = pushed[k + 1]
            assert before <= out.arrival <= after, (k, out.arrival, pushed)
    finally:
        engine.stop()


def test_a_failing_step_ends_its_sessions_and_the_engine_carries_on(models):
    engine = _engine(models, max_sessions=2)
    real_step = engine.pipeline.step
    calls = [0]

    def flaky(slots, pcm):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("boom")
        return real_step(slots, pcm)

    engine.pipeline.step = flaky
    try:
        victim = engine.open_session()
        victim.push(np.zeros(FRAME, np.float32))
        assert victim.get(timeout=30) is None and victim.close_reason == "engine_error"
        survivor = engine.open_session()
        survivor.push(np.zeros(2 * FRAME, np.float32))
        assert survivor.get(timeout=30) is not None
    finally:
        engine.stop()


def test_async_recv_and_step_records(models):
    engine = _engine(models, max_sessions=2)
    records = []
    engine.on_step(records.append)

    async def talk():
        session = engine.open_session(SamplingParams(seed=3))
        session.push(np.zeros(4 * FRAME, np.float32))
        outs = [await asyncio.wait_for(session.recv(), 30) for _ in range(3)]
        session.close()
        return outs, await asyncio.wait_for(session.recv(), 30)

    try:
        outs, end = asyncio.run(talk())
    finally:
        engine.stop()
    assert [o.frame for o in outs] == [0, 1, 2] and end is None
    assert all(o.pcm.shape == (FRAME,) and o.pcm.dtype == np.float32 for o in outs)
    assert len(records) >= 4 and all(r.batch_size == 1 and r.bucket == 1 and r.seconds > 0 for r in records)


def _page_bytes(lm, page_size: int) -> int:
    from duplexd.engine.kv.paged import PagedKVCache

    cfg = lm.cfg
    return PagedKVCache.page_bytes(cfg.num_layers, cfg.num_heads, cfg.head_dim, page_size, lm.text_emb.dtype)


def _wait(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def test_kv_pool_from_cuda_memory_leaves_room_for_mimi_streams_and_headroom(models, monkeypatch):
    """Sizing from free GPU memory, checked on the CPU with the free-memory query stubbed."""
    import torch

    from duplexd.engine.dialogue.engine import CUDA_HEADROOM, pool_pages
    from duplexd.engine.kv.paged import PagedKVCache
    from duplexd.engine.models.mimi import MimiStreams

    lm, mimi = models
    cfg = lm.cfg
    page = PagedKVCache.page_bytes(cfg.num_layers, cfg.num_heads, cfg.head_dim, 8, lm.text_emb.dtype)
    streams = MimiStreams.state_bytes(mimi, 4)
    assert streams > 0
    free = CUDA_HEADROOM + streams + 7 * page + page // 2
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    config = EngineConfig(max_sessions=4, page_size=8, device="cuda")
    assert pool_pages(lm, mimi, config, per_session=3) == 7  # what is left after streams and headroom
    assert pool_pages(lm, mimi, EngineConfig(max_sessions=2, page_size=8, device="cuda"), per_session=3) == 6
    with pytest.raises(ConfigError, match="cannot hold one session"):
        pool_pages(lm, mimi, config, per_session=8)


class _Host:
    """The smallest SessionHost: records nothing, queues up to 8 frames."""

    lock = threading.Lock()
    frame_size, max_pending_frames, max_output_frames = FRAME, 8, 8

    def frames_ready(self) -> None: ...
    def params_changed(self, session) -> None: ...
    def session_ended(self, session) -> None: ...
    def frames_dropped(self, direction: str, count: int) -> None: ...


def test_push_zeroes_non_finite_samples_and_keeps_its_own_copy():
    from duplexd.engine.dialogue.session import Session

    session = Session(_Host(), slot=0, params=SamplingParams(), max_frames=None)
    buffer = np.linspace(-0.5, 0.5, 2 * FRAME, dtype=np.float32)
    buffer[[3, FRAME + 7, FRAME + 9]] = [np.nan, np.inf, -np.inf]
    expected = np.where(np.isfinite(buffer), buffer, 0.0)
    session.push(buffer)
    buffer[:] = 9.0  # the caller reuses its buffer (the Realtime adapter's pcm16 scratch does)
    frames = [session.take_frame() for _ in range(2)]
    assert np.array_equal(np.concatenate([f[0] for f in frames]), expected)
    session.push(buffer[:FRAME])  # all finite: queued as given
    assert np.array_equal(session.take_frame()[0], np.full(FRAME, 9.0, np.float32))


def test_the_loop_threads_default_is_omp_num_threads_else_the_cores(monkeypatch):
    """An engine told nothing keeps to OMP_NUM_THREADS (a process beside others on the same cores: a second
    OpenMP thread would spin-wait on a core another process needs), else takes the usable cores."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == 1
    cores = len(os.sched_getaffinity(0))
    for unset in ("", "many", "0"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert default_threads() == cores
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_threads() == cores
