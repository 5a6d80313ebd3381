"""The batched engine: the KV pool, the pipeline, and one loop thread per device that runs step after step.

`max_sessions` slots are fixed at start and every per-session tensor (Mimi streams, token ring, position,
sampling parameters) is indexed by slot, so joining and leaving never reallocate. The loop is three calls on plain
data: the scheduler plans a step (`Scheduler.plan`: slots to reset, sampling updates, a batch of one frame per
session with input), the runner executes it (`Runner.execute`: Mimi encode → temporal step → DepFormer → Mimi
decode, outputs copied back; a text-only STT model stops after the temporal step and its text token), and the
scheduler hands the result to the sessions (`Scheduler.finish`).

All of the engine's torch work (warm-up, graph capture, steps) runs on the loop thread with `threads` intra-op
threads. On CPU, keep other long-lived threads that use torch at one intra-op thread (`torch.set_num_threads(1)`
before their first op): each thread has its own OpenMP pool, and once the pools hold more threads than there
are cores, libgomp stops spin-waiting and every parallel region sleeps and wakes its workers, which made the
engine's steps 1.5-2x slower here (docs/BENCHMARKS.md). Threads that have exited release their pools.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from duplexd.kernels.decode_attention import check_attention_kernel

from ..devices import check_kv_dtype
from ..errors import DeviceError
from ..graphs import default_buckets
from ..kv.dtypes import KV_DTYPES
from ..kv.paged import PagedKVCache, window_pages
from ..listeners import Listeners
from ..loop_thread import default_threads, start_loop_thread
from ..models.config import ConfigError, LMConfig
from ..models.lm import LMModel
from ..models.mimi import MimiModel, MimiStreams
from ..models.tokenizer import TextTokenizer
from ..persona.prompt import PersonaPrompt
from ..turns import DeviceTurns, maybe_turn
from .pipeline import Pipeline
from .runner import Runner
from .sampling import SamplingParams
from .scheduler import Scheduler
from .session import Session, SessionOutput

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "EngineStats", "Session", "SessionOutput", "StepRecord"]

GiB = 2**30
PROMPT_ALLOWANCE = 256  # frames a capped PersonaPlex session is sized for beside its own (prompts run 170-220)
CUDA_HEADROOM = 4 * GiB  # left free beside the KV pool and Mimi's streams for activations, graphs and workspaces


@dataclass(frozen=True)
class EngineConfig:
    max_sessions: int = 8
    kv_memory: int | None = None  # bytes for the KV pool; None: a whole window per slot (CPU) or free memory (CUDA)
    page_size: int = 64  # frames per KV page
    kv_dtype: str = "bf16"  # the KV pages' format: the model's dtype, or int8 / fp8 codes with scales (engine/kv)
    attention_kernel: str = "split"  # the Triton decode attention (kernels.decode_attention.ATTENTION_KERNELS)
    max_session_frames: int | None = None  # cap on every session's length; shorter sessions reserve fewer pages
    max_pending_frames: int = 25  # inbox bound per session (2 s of audio)
    max_output_frames: int = 250  # outbox bound per session (20 s); the oldest frame is dropped beyond it
    device: str = "cpu"
    cuda_graphs: bool = True
    pad_batches: bool = False  # pad to buckets without graphs (to run the graph path's padding on CPU)
    buckets: tuple[int, ...] | None = None  # default: 1, 2, 4, ..., max_sessions
    threads: int | None = None  # intra-op threads of the loop thread; default: OMP_NUM_THREADS, else the cores
    # Persona prompts (PersonaPlex): frames prefilled per step beside live sessions (None: what fits in half of
    # the time a frame leaves after a full step, timed at warm-up), and per step with no live session.
    prefill_rows: int | None = None
    max_prefill_rows: int = 512

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ConfigError("max_sessions must be >= 1")
        if self.max_session_frames is not None and self.max_session_frames < 1:
            raise ConfigError("max_session_frames must be >= 1")
        if self.max_pending_frames < 1 or self.max_output_frames < 1:
            raise ConfigError("max_pending_frames and max_output_frames must be >= 1")
        if self.max_prefill_rows < 1 or (self.prefill_rows is not None and self.prefill_rows < 1):
            raise ConfigError("prefill_rows and max_prefill_rows must be >= 1")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        try:
            check_attention_kernel(self.attention_kernel)
        except ValueError as e:
            raise ConfigError(str(e)) from None


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
    prompt_frames: int = 0  # persona prompt frames prefilled


def session_pages(cfg: LMConfig, config: EngineConfig) -> int:
    """KV pages one session reserves: a whole window, or fewer under `max_session_frames` (a PersonaPlex session's
    prompt comes on top)."""
    cap = config.max_session_frames
    if cap is not None and cfg.predicts_user_audio:  # a persona prompt's frames come before the session's
        cap += PROMPT_ALLOWANCE
    return window_pages(cfg.context, config.page_size, cap)


def kv_page_bytes(lm: LMModel, config: EngineConfig) -> int:
    cfg = lm.cfg
    return PagedKVCache.page_bytes(
        cfg.num_layers, cfg.num_heads, cfg.head_dim, config.page_size, lm.text_emb.dtype, config.kv_dtype
    )


def pool_pages(lm: LMModel, mimi: MimiModel, config: EngineConfig, per_session: int, free: int | None = None) -> int:
    """Pages in the KV pool: from `kv_memory`, else from free CUDA memory, else one window per slot.

    From CUDA memory: what is free now (or `free` bytes: `duplexd capacity` sizes a GPU it does not have), less the
    Mimi streams the engine allocates next and `CUDA_HEADROOM` for the frame's activations, graph pools and library
    workspaces (a frame's activations at 128 sessions are under 1 GB, nearly all Mimi's: peak RSS of its encode +
    decode on the CPU; held twice, by the eager warm-up's cached blocks and by the graph pool), capped at a whole
    window per slot. The pool is two allocations (four with an 8-bit `kv_dtype`'s scales): no fragmentation.
    """
    page = kv_page_bytes(lm, config)
    wanted = config.max_sessions * per_session
    if config.kv_memory is not None:
        pages = config.kv_memory // page
    elif torch.device(config.device).type == "cuda":
        measured = free is None
        if free is None:
            free, _ = torch.cuda.mem_get_info(torch.device(config.device))
        streams = MimiStreams.state_bytes(mimi, config.max_sessions, decoder=not lm.cfg.text_only)
        pages = min(wanted, max(free - streams - CUDA_HEADROOM, 0) // page)
        logger.log(
            logging.INFO if measured else logging.DEBUG,
            "KV pool from CUDA memory: %.2f GiB free, %.2f GiB for Mimi's streams, %.2f GiB kept free",
            free / GiB,
            streams / GiB,
            CUDA_HEADROOM / GiB,
        )
    else:
        pages = wanted
    if pages < per_session:
        raise ConfigError(
            f"the KV cache memory ({pages * page / GiB:.2f} GiB) cannot hold one session "
            f"({per_session * page / GiB:.2f} GiB); give more --kv-memory or shorten the session length"
        )
    return pages


def sessions_that_fit(lm: LMModel, mimi: MimiModel, config: EngineConfig, free: int | None = None) -> int:
    """The most slots (<= config.max_sessions) whose sessions all fit the KV pool an `Engine` with that many slots
    makes (`pool_pages`; each slot also costs Mimi streams, so fewer slots leave more pages: a bisection)."""
    per_session = session_pages(lm.cfg, config)

    def fits(slots: int) -> bool:
        try:
            pages = pool_pages(lm, mimi, dataclasses.replace(config, max_sessions=slots), per_session, free)
        except ConfigError:
            return False
        return pages >= slots * per_session

    low, high = 0, config.max_sessions
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


class Engine:
    def __init__(
        self, lm: LMModel, mimi: MimiModel, tokenizer: TextTokenizer | None = None, config: EngineConfig | None = None
    ) -> None:
        self.config = config = config or EngineConfig()
        self.device = torch.device(config.device)
        self.sample_rate, self.frame_size = mimi.cfg.sample_rate, mimi.cfg.frame_size
        cfg = lm.cfg
        page_size = config.page_size
        try:
            check_kv_dtype(config.kv_dtype, str(self.device))
        except DeviceError as e:
            raise ConfigError(f"--kv-dtype {e}") from None
        per_session = session_pages(cfg, config)
        pages = pool_pages(lm, mimi, config, per_session)
        kv = lm.new_kv_cache(config.max_sessions, pages, page_size, config.kv_dtype, config.attention_kernel)
        self.kv = kv
        logger.info(
            "KV cache (%s): %d pages of %d frames (%.2f GiB); %d full-length sessions fit, %d slots",
            config.kv_dtype,
            kv.num_pages,
            page_size,
            kv.nbytes / GiB,
            kv.sessions_fit(config.max_session_frames),
            config.max_sessions,
        )
        self._graphs = config.cuda_graphs and self.device.type == "cuda"
        buckets = config.buckets or default_buckets(config.max_sessions)
        if max(buckets) < config.max_sessions:
            raise ConfigError(f"the largest bucket {max(buckets)} is below max_sessions {config.max_sessions}")
        self.pipeline = Pipeline(
            lm,
            mimi,
            config.max_sessions,
            kv,
            buckets=buckets,
            graphs=self._graphs,
            pad=self._graphs or config.pad_batches,
        )
        self._persona = cfg.predicts_user_audio
        self.scheduler = Scheduler(
            kv,
            self.frame_size,
            config.max_pending_frames,
            config.max_output_frames,
            config.max_prefill_rows,
            self._persona,
        )
        self.runner = Runner(self.pipeline, kv, tokenizer, set(cfg.silent_text_ids))
        self._step_listeners: Listeners[[StepRecord]] = Listeners("step")
        self._thread: threading.Thread | None = None
        self._threads = config.threads or default_threads()
        if self.device.type == "cpu" and torch.get_num_threads() > 1:
            logger.warning(
                "this thread uses %d intra-op threads beside the engine's loop thread; on CPU call "
                "torch.set_num_threads(1) before loading models, or the engine's steps slow down (module docs)",
                torch.get_num_threads(),
            )
        self.turns: DeviceTurns | None = None  # set when another model's loop steps on this device (`turns`)
        self.ready = False

    # ------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the loop thread and wait until it is warm (throw-away steps, then CUDA graph capture)."""
        if self._thread is not None:
            return
        name = f"duplexd-engine-{self.device}"
        self._thread = start_loop_thread(name, self.device, self._threads, self._warm_up, self._serve)
        self.ready = True
        logger.info("engine ready on %s (%d slots, %d threads)", self.device, self.config.max_sessions, self._threads)

    def _warm_up(self) -> None:
        step_seconds = self.runner.warm_up(self.scheduler.free_slots(), self._graphs)
        if self._persona:
            self.scheduler.prefill_rows = self._size_prefill(step_seconds)
        self.scheduler.start()

    def _serve(self) -> None:
        while (plan := self.scheduler.plan()) is not None:
            with maybe_turn(self.turns, urgent=True):
                result = self.runner.execute(plan)
            self.scheduler.finish(plan, result)
            if plan.prefill:
                self.scheduler.prefilled(plan, self.runner.prefill(plan.prefill))
            if plan.slots and result.error is None:
                self._step_listeners(StepRecord(len(plan.slots), result.bucket, result.seconds))

    def _size_prefill(self, step_seconds: float) -> int:
        """Prompt frames per step beside live sessions: `prefill_rows`, else what fits in half of the frame's time
        left after a full step (the other half is margin for the host and jitter)."""
        config = self.config
        most = min(config.max_prefill_rows, self.kv.context - 2)
        if config.prefill_rows is not None:
            return min(config.prefill_rows, most)
        frame_seconds = self.frame_size / self.sample_rate
        return self.runner.size_prefill(max(frame_seconds - step_seconds, 0.0) / 2, most)

    def stop(self) -> None:
        """End every session ("engine_stopped") and stop the loop thread."""
        self.ready = False
        self.scheduler.stop("engine_stopped")
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.scheduler.release()

    def on_step(self, callback: Callable[[StepRecord], None]) -> Callable[[], None]:
        """Call `callback(StepRecord)` on the loop thread after every step; returns a function that stops it."""
        return self._step_listeners.add(callback)

    def on_prompted(self, callback: Callable[[float], None]) -> Callable[[], None]:
        """Call `callback(seconds)` on the loop thread each time a persona prompt is in (seconds since it was
        started). Returns a function that stops it."""
        return self.scheduler.prompted.add(callback)

    def on_dropped(self, callback: Callable[[str, int], None]) -> Callable[[], None]:
        """Call `callback(direction, count)` when frames are dropped: "in" when a session's inbox is full (on the
        pushing thread), "out" when its outbox is (on the loop thread). Returns a function that stops it."""
        return self.scheduler.dropped.add(callback)

    # ------------------------------------------------------------------------------------------- sessions

    def open_session(
        self, params: SamplingParams | None = None, max_frames: int | None = None, prompt: PersonaPrompt | None = None
    ) -> Session:
        """Admit a conversation, or raise `CapacityError` saying why. Non-blocking; safe on an event loop.
        With `prompt` (PersonaPlex), it opens with that persona (`Session.start_prompt`, whose errors it raises)."""
        cap = self.config.max_session_frames
        if max_frames is not None and max_frames < 1:
            raise ValueError("max_frames must be >= 1")
        frames = max_frames if cap is None else min(cap, max_frames or cap)
        session = self.scheduler.admit(params or SamplingParams(), frames)
        if prompt is not None:
            try:
                session.start_prompt(prompt)
            except BaseException:
                session.close("refused")
                raise
        logger.debug("session %s admitted in slot %d", session.id, session.slot)
        return session

    def stats(self) -> EngineStats:
        s = self.scheduler.snapshot(self.config.max_session_frames)
        return EngineStats(
            self.config.max_sessions,
            s.active_sessions,
            s.admissible_sessions,
            self.kv.num_pages,
            s.kv_pages_used,
            s.steps,
            s.frames_in,
            s.frames_out,
            s.refused,
            str(self.device),
            s.prompt_frames,
        )
