"""The batched engine: slots, admission, and the loop thread that steps every waiting session as one batch.

`max_sessions` slots are fixed at start and every per-session tensor (Mimi streams, token ring, position,
sampling parameters) is indexed by slot, so joining and leaving never reallocate. Admission needs a free slot and
the KV pages of a whole window (`engine.kv_cache`); otherwise `open_session` raises `CapacityError` at once.

The loop (one thread per device) waits until some session has a frame, takes one frame from each such session,
and runs Mimi encode → temporal step → DepFormer → Mimi decode for all of them in one batch; a session without
input is not in the batch and does not advance. Slot resets happen on the loop thread before a session's first step; a
closed session's slot and pages come back at once, or after the step when it is in one, so a session closed
from another thread mid-step is simply dropped from the outputs of that step.

All of the engine's torch work (warm-up, graph capture, steps) runs on the loop thread with `threads` intra-op
threads. On CPU, keep other long-lived threads that use torch at one intra-op thread (`torch.set_num_threads(1)`
before their first op): each thread has its own OpenMP pool, and once the pools hold more threads than there
are cores, libgomp stops spin-waiting and every parallel region sleeps and wakes its workers, which made the
engine's steps 1.5-2x slower here (docs/BENCHMARKS.md). Threads that have exited release their pools.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .config import ConfigError, SamplingParams
from .errors import CapacityError
from .graphs import default_buckets
from .kv_cache import PagedKVCache, window_pages
from .models.lm import LMModel
from .models.mimi import MimiModel, MimiStreams
from .pipeline import Pipeline
from .session import Session, SessionOutput
from .tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "EngineStats", "Session", "SessionOutput", "StepRecord"]

GiB = 2**30
CUDA_HEADROOM = 4 * GiB  # left free beside the KV pool and Mimi's streams for activations, graphs and workspaces


@dataclass(frozen=True)
class EngineConfig:
    max_sessions: int = 8
    kv_memory: int | None = None  # bytes for the KV pool; None: a whole window per slot (CPU) or free memory (CUDA)
    page_size: int = 64  # frames per KV page
    max_session_frames: int | None = None  # cap on every session's length; shorter sessions reserve fewer pages
    max_pending_frames: int = 25  # inbox bound per session (2 s of audio)
    max_output_frames: int = 250  # outbox bound per session (20 s); the oldest frame is dropped beyond it
    device: str = "cpu"
    cuda_graphs: bool = True
    pad_batches: bool = False  # pad to buckets without graphs (to run the graph path's padding on CPU)
    buckets: tuple[int, ...] | None = None  # default: 1, 2, 4, ..., max_sessions
    threads: int | None = None  # intra-op threads of the loop thread; default: the usable cores

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ConfigError("max_sessions must be >= 1")
        if self.max_session_frames is not None and self.max_session_frames < 1:
            raise ConfigError("max_session_frames must be >= 1")
        if self.max_pending_frames < 1 or self.max_output_frames < 1:
            raise ConfigError("max_pending_frames and max_output_frames must be >= 1")


@dataclass(frozen=True)
class StepRecord:
    batch_size: int
    bucket: int
    seconds: float


@dataclass(frozen=True)
class EngineStats:
    max_sessions: int
    active_sessions: int
    admissible_sessions: int  # how many more full-length sessions could open right now
    kv_pages_total: int
    kv_pages_used: int
    steps: int
    frames_in: int
    frames_out: int
    refused: int
    device: str


def pool_pages(lm: LMModel, mimi: MimiModel, config: EngineConfig, per_session: int) -> int:
    """Pages in the KV pool: from `kv_memory`, else from free CUDA memory, else one window per slot.

    From CUDA memory: what is free now, less the Mimi streams the engine allocates next and `CUDA_HEADROOM` for
    the frame's activations, graph pools and library workspaces (a frame's activations at 128 sessions are under
    1 GB, nearly all Mimi's: peak RSS of its encode + decode on the CPU; held twice, by the eager warm-up's cached
    blocks and by the graph pool), capped at a whole window per slot. The pool is two allocations: no
    fragmentation.
    """
    cfg = lm.cfg
    page = PagedKVCache.page_bytes(cfg.num_layers, cfg.num_heads, cfg.head_dim, config.page_size, lm.text_emb.dtype)
    wanted = config.max_sessions * per_session
    if config.kv_memory is not None:
        pages = config.kv_memory // page
    elif torch.device(config.device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(config.device))
        streams = MimiStreams.state_bytes(mimi, config.max_sessions)
        pages = min(wanted, max(free - streams - CUDA_HEADROOM, 0) // page)
        logger.info("KV pool from CUDA memory: %.2f GiB free, %.2f GiB for Mimi's streams, %.2f GiB kept free",
                    free / GiB, streams / GiB, CUDA_HEADROOM / GiB)
    else:
        pages = wanted
    if pages < per_session:
        raise ConfigError(
            f"the KV cache memory ({pages * page / GiB:.2f} GiB) cannot hold one session "
            f"({per_session * page / GiB:.2f} GiB); give more --kv-memory or shorten the session length"
        )
    return pages


class Engine:
    def __init__(self, lm: LMModel, mimi: MimiModel, tokenizer: TextTokenizer | None = None,
                 config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.lm, self.mimi, self.tokenizer = lm, mimi, tokenizer
        self.device = torch.device(config.device)
        self.sample_rate, self.frame_size = mimi.cfg.sample_rate, mimi.cfg.frame_size
        cfg = lm.cfg
        page_size = config.page_size
        per_session = window_pages(cfg.context, page_size, config.max_session_frames)
        kv = lm.new_kv_cache(config.max_sessions, pool_pages(lm, mimi, config, per_session), page_size)
        self.kv = kv
        logger.info(
            "KV cache: %d pages of %d frames (%.2f GiB); %d full-length sessions fit, %d slots",
            kv.num_pages, page_size, (kv.keys.nbytes + kv.values.nbytes) / GiB,
            kv.sessions_fit(config.max_session_frames), config.max_sessions,
        )
        self._graphs = config.cuda_graphs and self.device.type == "cuda"
        buckets = config.buckets or default_buckets(config.max_sessions)
        if max(buckets) < config.max_sessions:
            raise ConfigError(f"the largest bucket {max(buckets)} is below max_sessions {config.max_sessions}")
        self.pipeline = Pipeline(lm, mimi, config.max_sessions, kv, buckets=buckets, graphs=self._graphs,
                                 pad=self._graphs or config.pad_batches)
        # A step's outputs come back in one copy each into pinned buffers, then one wait (CUDA).
        pin = self.device.type == "cuda"
        self._host_pcm = torch.zeros(config.max_sessions, self.frame_size, pin_memory=pin)
        self._host_tokens = torch.zeros(config.max_sessions, 1 + cfg.dep_q, dtype=torch.long, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None
        self._silent = {cfg.text_padding_token_id, cfg.end_of_text_padding_id}

        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._free_slots = list(range(config.max_sessions - 1, -1, -1))
        self._sessions: dict[int, Session] = {}  # slot -> session holding it (until released)
        self._ended: list[Session] = []  # closed sessions whose slot the loop has not released yet
        self._fresh: list[Session] = []  # admitted sessions whose slot the loop has not reset yet
        self._retuned: list[Session] = []  # sessions whose sampling changed since the last step
        self._in_flight: set[Session] = set()  # sessions the loop is resetting or stepping now
        self._listeners: list[Callable[[StepRecord], None]] = []
        self._thread: threading.Thread | None = None
        self._threads = config.threads or len(os.sched_getaffinity(0))
        if self.device.type == "cpu" and torch.get_num_threads() > 1:
            logger.warning(
                "this thread uses %d intra-op threads beside the engine's loop thread; on CPU call "
                "torch.set_num_threads(1) before loading models, or the engine's steps slow down (module docs)",
                torch.get_num_threads(),
            )
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._running = False
        self.ready = False
        self._steps = self._frames_in = self._frames_out = self._refused = 0

    # ------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the loop thread and wait until it is warm (a throw-away step, then CUDA graph capture)."""
        if self._thread is not None:
            return
        self._running = True
        self._thread = threading.Thread(target=self._run, name=f"duplexd-engine-{self.device}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            self._thread, self._running = None, False
            raise self._start_error
        self.ready = True
        logger.info("engine ready on %s (%d slots, %d threads)", self.device, self.config.max_sessions,
                    self._threads)

    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        torch.set_grad_enabled(False)  # grad mode is per thread
        try:
            if self.device.type == "cuda":  # per thread: graphs, streams and Triton launch on the current device
                torch.cuda.set_device(self.device)
            self._warm_up()
            if self._graphs:
                self.pipeline.capture(torch.cuda.graph_pool_handle())
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._start_error = e
            return
        finally:
            self._started.set()
        self._loop()

    def _warm_up(self) -> None:
        """Two throw-away steps (the second decodes) at every batch size a step can run at (the buckets when
        padding, else 1..max_sessions), so first-use costs (kernel selection, oneDNN primitives and packed weights,
        allocator growth) are paid before the first session rather than in its first frames."""
        buckets = sorted({self.pipeline.bucket(size) for size in range(1, self.config.max_sessions + 1)})
        for size in buckets:
            slots = self._free_slots[::-1][: min(size, self.kv.pages_free)]
            for slot in slots:
                self.kv.allocate(slot, 2)
                self.pipeline.reset(slot)  # back to position 0: two frames stay inside the page just reserved
            try:
                for _ in range(2):
                    self.pipeline.step(slots, np.zeros((len(slots), self.frame_size), np.float32))
            finally:
                for slot in slots:
                    self.kv.free(slot)

    def stop(self) -> None:
        """End every session ("engine_stopped") and stop the loop thread."""
        with self._lock:
            self._running = False
            self.ready = False
            for session in list(self._sessions.values()):
                if not session.closed:
                    session._end("engine_stopped")
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._release_locked()

    def on_step(self, callback: Callable[[StepRecord], None]) -> Callable[[], None]:
        """Call `callback(StepRecord)` on the loop thread after every step; returns a function that stops it."""
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback)

    # ------------------------------------------------------------------------------------------- sessions

    def open_session(self, params: SamplingParams | None = None, max_frames: int | None = None) -> Session:
        """Admit a conversation, or raise `CapacityError` saying why. Non-blocking; safe on an event loop."""
        params = params or SamplingParams()
        cap = self.config.max_session_frames
        if max_frames is not None and max_frames < 1:
            raise ValueError("max_frames must be >= 1")
        frames = max_frames if cap is None else min(cap, max_frames or cap)
        with self._lock:
            if not self._running:
                raise CapacityError("the engine is not running")
            self._release_locked()  # sessions closed a moment ago count as free unless mid-step
            if not self._free_slots:
                self._refused += 1
                raise CapacityError(f"all {self.config.max_sessions} session slots are in use")
            slot = self._free_slots[-1]
            try:
                self.kv.allocate(slot, frames)
            except CapacityError:
                self._refused += 1
                raise
            self._free_slots.pop()
            session = Session(self, slot, params, frames)
            self._sessions[slot] = session
            self._fresh.append(session)
        logger.debug("session %s admitted in slot %d", session.id, slot)
        return session

    def stats(self) -> EngineStats:
        with self._lock:
            self._release_locked()
            active = sum(not s.closed for s in self._sessions.values())
            fit = self.kv.sessions_fit(self.config.max_session_frames)
            return EngineStats(
                self.config.max_sessions, active, min(len(self._free_slots), fit), self.kv.num_pages,
                self.kv.pages_used, self._steps, self._frames_in, self._frames_out, self._refused, str(self.device),
            )

    # ------------------------------------------------------------------------------------------- the loop

    def _release_locked(self) -> None:
        """Give the slots and pages of ended sessions back, except those the loop is resetting or stepping."""
        keep = []
        for session in self._ended:
            if session in self._in_flight:
                keep.append(session)
                continue
            self.kv.free(session.slot)
            del self._sessions[session.slot]
            self._free_slots.append(session.slot)
            if session in self._fresh:
                self._fresh.remove(session)
        self._ended = keep

    def _gather(self) -> tuple[list[Session], list[Session], list[np.ndarray], list[Session]] | None:
        """Release ended sessions and wait for work; return the sessions to reset, those to re-tune, then the
        batch and one frame each."""
        with self._lock:
            self._release_locked()
            while self._running and not self._fresh and not self._retuned and not any(
                s._inbox for s in self._sessions.values()
            ):
                self._work.wait()
                self._release_locked()
            if not self._running:
                return None
            fresh, self._fresh = self._fresh, []
            retuned, self._retuned = [s for s in self._retuned if not s.closed], []
            batch, frames = [], []
            for session in self._sessions.values():
                frame = session._take_frame()
                if frame is not None:
                    batch.append(session)
                    frames.append(frame)
            self._in_flight = {*fresh, *retuned, *batch}
            return fresh, retuned, frames, batch

    def _loop(self) -> None:
        while True:
            work = self._gather()
            if work is None:
                return
            fresh, retuned, frames, batch = work
            for session in fresh:
                self.pipeline.reset(session.slot, session.params)
            for session in retuned:
                self.pipeline.lm_gen.set_sampling(session.slot, session.params)
            if batch:
                self._step(batch, frames)  # ends the in-flight set as it hands out the outputs
            else:
                with self._lock:
                    self._in_flight = set()

    def _step(self, batch: list[Session], frames: list[np.ndarray]) -> None:
        started = time.perf_counter()
        try:
            out = self.pipeline.step([s.slot for s in batch], np.stack(frames))
            speech, tokens = self._to_host(out.pcm, out.tokens)
            valid = out.valid
        except Exception:
            logger.exception("step of %d sessions failed; ending them", len(batch))
            with self._lock:
                self._in_flight = set()
                for session in batch:
                    if not session.closed:
                        session._end("engine_error")
            return
        seconds = time.perf_counter() - started
        with self._lock:
            self._steps += 1
            self._frames_in += len(batch)
            for row, session in enumerate(batch):
                session.steps += 1
                if valid[row] and not session.closed:
                    self._frames_out += 1
                    text, *audio = tokens[row]
                    session._deliver(SessionOutput(session.frames_out, speech[row], text, self._text(text),
                                                   tuple(audio)))
                if session.max_frames is not None and session.steps >= session.max_frames and not session.closed:
                    session._end("max_frames")
            self._in_flight = set()  # before the lock goes: a receiver may close and reopen at once
        record = StepRecord(len(batch), self.pipeline.bucket(len(batch)), seconds)
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:
                logger.exception("step listener failed")

    def _to_host(self, pcm: torch.Tensor, tokens: torch.Tensor) -> tuple[np.ndarray, list[list[int]]]:
        """The step's outputs on the host: one copy each (pinned, not waiting) and one wait on CUDA."""
        if self._copied is None:
            return pcm.float().numpy().copy(), tokens.tolist()
        batch = pcm.shape[0]
        self._host_pcm[:batch].copy_(pcm, non_blocking=True)
        self._host_tokens[:batch].copy_(tokens, non_blocking=True)
        self._copied.record()
        self._copied.synchronize()
        return self._host_pcm[:batch].numpy().copy(), self._host_tokens[:batch].tolist()

    def _text(self, token: int) -> str:
        if token in self._silent or self.tokenizer is None:
            return ""
        return self.tokenizer.piece(token)
