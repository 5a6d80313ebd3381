"""Which session holds which slot, and what each step does: admission, the step plan, and handing out results.

`max_sessions` slots are fixed at start. Admission needs a free slot and the KV pages of a whole window (host
bookkeeping in `PagedKVCache`); otherwise `admit` raises `CapacityError` at once. `plan` waits until some session
has a frame (or a slot must be reset or re-tuned) and takes one frame from each such session: a session without
input is not in the batch and does not advance. `finish` hands the runner's result to the sessions of the plan.

A session that opens with a persona prompt (`Session.start_prompt`) is prefilled before it takes frames: each plan
carries prompt frames (`StepPlan.prefill`, oldest prompt first) that the runner runs in one forward after the
batch's outputs are handed out. While any session is live, a plan carries at most `prefill_rows` frames, sized so
that the prefill fits in what a frame leaves after the step (`Runner.warm_up`): the live sessions keep their pace.
With no live session it carries up to `max_prefill_rows`.

A closed session's slot and pages come back at once, or after the step when one is running with it, so a session
closed from another thread mid-step is simply dropped from that step's outputs. The scheduler is the sessions'
`SessionHost`: one lock guards its state and theirs.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from ..errors import CapacityError
from ..kv.paged import PagedKVCache
from ..listeners import Listeners
from ..persona.prompt import PersonaPrompt, PromptChunk
from .plan import PrefillResult, StepPlan, StepResult
from .sampling import SamplingParams
from .session import Session, SessionOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerStats:
    active_sessions: int
    admissible_sessions: int
    kv_pages_used: int
    refused: int
    steps: int
    frames_in: int
    frames_out: int
    prompt_frames: int


class Scheduler:
    def __init__(
        self,
        kv: PagedKVCache,
        frame_size: int,
        max_pending_frames: int,
        max_output_frames: int,
        max_prefill_rows: int = 512,
        persona: bool = False,
    ) -> None:
        self.kv, self.frame_size = kv, frame_size
        self.persona = persona  # the model takes persona prompts (PersonaPlex)
        self.max_prefill_rows = self.prefill_rows = max_prefill_rows
        self.max_pending_frames, self.max_output_frames = max_pending_frames, max_output_frames
        self.num_slots = kv.num_slots
        self.lock = threading.Lock()
        self._work = threading.Condition(self.lock)
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._sessions: dict[int, Session] = {}  # slot -> session holding it (until released)
        self._ended: list[Session] = []  # closed sessions whose slot has not been released yet
        self._fresh: list[Session] = []  # admitted sessions whose slot the runner has not reset yet
        self._retuned: list[Session] = []  # sessions whose sampling changed since the last plan
        self._prompting: list[Session] = []  # sessions whose persona prompt is not all prefilled, oldest first
        self._in_flight: set[Session] = set()  # sessions of the plan being executed
        self._running = False
        self.dropped: Listeners[[str, int]] = Listeners("drop")  # (direction, count)
        self.prompted: Listeners[[float]] = Listeners("prompt")  # seconds from `start_prompt` to live
        self.refused = self.steps = self.frames_in = self.frames_out = self.prompt_rows = 0

    # ------------------------------------------------------------------------------------------- SessionHost

    def frames_ready(self) -> None:
        self._work.notify()

    def params_changed(self, session: Session) -> None:
        self._retuned.append(session)
        self._work.notify()

    def session_ended(self, session: Session) -> None:
        self._ended.append(session)
        self._work.notify()

    def prompt_requested(self, session: Session, prompt: PersonaPrompt) -> None:
        if not self.persona:
            raise ValueError("a persona prompt needs a PersonaPlex model, and this engine's model is not one")
        if prompt.calls > self.kv.context:
            raise ValueError(
                f"the persona prompt is {prompt.calls} frames, longer than the model's window of {self.kv.context}"
            )
        frames = None if session.max_frames is None else session.max_frames + prompt.forwards
        self.kv.reserve(session.slot, frames)
        self._prompting.append(session)
        self._work.notify()

    def frames_dropped(self, direction: str, count: int) -> None:
        self.dropped(direction, count)

    # ------------------------------------------------------------------------------------------- admission

    def admit(self, params: SamplingParams, frames: int | None) -> Session:
        """A session in a free slot with its KV pages reserved, or `CapacityError` saying why."""
        with self.lock:
            if not self._running:
                raise CapacityError("the engine is not running")
            self._release()  # sessions closed a moment ago count as free unless mid-step
            if not self._free_slots:
                self.refused += 1
                raise CapacityError(f"all {self.num_slots} session slots are in use")
            slot = self._free_slots[-1]
            try:
                self.kv.allocate(slot, frames)
            except CapacityError:
                self.refused += 1
                raise
            self._free_slots.pop()
            session = Session(self, slot, params, frames)
            self._sessions[slot] = session
            self._fresh.append(session)
            self._work.notify()
        return session

    def free_slots(self) -> list[int]:
        """The free slots, lowest first."""
        with self.lock:
            self._release()
            return sorted(self._free_slots)

    def snapshot(self, session_frames: int | None = None) -> SchedulerStats:
        """Counts at one instant; `admissible`: sessions of `session_frames` frames that could open now."""
        with self.lock:
            self._release()
            active = sum(not s.closed for s in self._sessions.values())
            admissible = min(len(self._free_slots), self.kv.sessions_fit(session_frames))
            return SchedulerStats(
                active,
                admissible,
                self.kv.pages_used,
                self.refused,
                self.steps,
                self.frames_in,
                self.frames_out,
                self.prompt_rows,
            )

    def start(self) -> None:
        """Admit sessions and plan steps from now on."""
        with self.lock:
            self._running = True

    def stop(self, reason: str) -> None:
        """End every session with `reason`; `plan` returns None from now on."""
        with self.lock:
            self._running = False
            for session in list(self._sessions.values()):
                if not session.closed:
                    session.end(reason)
            self._work.notify_all()

    def release(self) -> None:
        with self.lock:
            self._release()

    def _release(self) -> None:
        """Give the slots and pages of ended sessions back, except those of the step being executed."""
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
            if session in self._prompting:
                self._prompting.remove(session)
        self._ended = keep

    # ------------------------------------------------------------------------------------------- steps

    def plan(self) -> StepPlan | None:
        """Wait for work; the next step's plan, or None once stopped."""
        with self.lock:
            self._release()
            while (
                self._running
                and not self._fresh
                and not self._retuned
                and not any(s.prompting for s in self._prompting)
                and not any(s.has_frame() for s in self._sessions.values())
            ):
                self._work.wait()
                self._release()
            if not self._running:
                return None
            fresh, self._fresh = self._fresh, []
            retuned, self._retuned = [s for s in self._retuned if not s.closed], []
            batch, frames, arrivals = [], [], []
            for session in self._sessions.values():
                taken = session.take_frame()
                if taken is not None:
                    batch.append(session)
                    frames.append(taken[0])
                    arrivals.append(taken[1])
            prefill, prompting = self._prefill()
            self._in_flight = {*fresh, *retuned, *batch, *prompting}
            return StepPlan(
                tuple((s.slot, s.params) for s in fresh),
                tuple((s.slot, s.params) for s in retuned),
                tuple(s.slot for s in batch),
                tuple(frames),
                tuple(arrivals),
                prefill,
            )

    def _prefill(self) -> tuple[tuple[PromptChunk, ...], list[Session]]:
        """The next prompt frames, oldest prompt first, within this plan's budget of rows."""
        self._prompting = [s for s in self._prompting if s.prompting]
        live = any(not s.closed and not s.prompting for s in self._sessions.values())
        budget = self.prefill_rows if live else self.max_prefill_rows
        chunks, sessions = [], []
        for session in self._prompting:
            if budget <= 0:
                break
            assert session.prompt is not None
            rows = min(session.prompt.forwards - session.prompted, budget)
            chunks.append(PromptChunk(session.slot, session.prompt, session.prompted, session.prompted + rows))
            sessions.append(session)
            budget -= rows
        return tuple(chunks), sessions

    def finish(self, plan: StepPlan, result: StepResult) -> None:
        """Hand `result` to the sessions of `plan`'s batch; a failed step ends them ("engine_error")."""
        if result.error is not None:
            logger.error("step of %d sessions failed; ending them", len(plan.slots), exc_info=result.error)
        dropped = 0
        with self.lock:
            if plan.slots and result.error is None:
                self.steps += 1
                self.frames_in += len(plan.slots)
            for row, slot in enumerate(plan.slots):
                session = self._sessions[slot]
                if result.error is not None:
                    if not session.closed:
                        session.end("engine_error")
                    continue
                output = None
                if result.valid[row] and not session.closed:
                    text, *audio = result.tokens[row]
                    pause = None if result.pause is None else tuple(float(p) for p in result.pause[row])
                    output = SessionOutput(
                        session.frames_out,
                        result.pcm[row],
                        text,
                        result.texts[row],
                        tuple(audio),
                        plan.arrivals[row],
                        pause,
                    )
                    self.frames_out += 1
                dropped += session.stepped(output)
            # Before the lock goes (a receiver may close and reopen at once); the prompts stay until prefilled.
            self._in_flight = {self._sessions[c.slot] for c in plan.prefill}
        if dropped:
            self.frames_dropped("out", dropped)

    def prefilled(self, plan: StepPlan, result: PrefillResult) -> None:
        """Count `plan`'s prompt frames as run; a failed prefill ends its sessions ("engine_error")."""
        if result.error is not None:
            logger.error("prefill of %d prompts failed; ending them", len(plan.prefill), exc_info=result.error)
        done = []
        with self.lock:
            for chunk in plan.prefill:
                session = self._sessions[chunk.slot]
                if result.error is not None:
                    if not session.closed:
                        session.end("engine_error")
                    continue
                session.prefilled(chunk.stop - chunk.start)
                self.prompt_rows += chunk.stop - chunk.start
                if session.prompt_seconds is not None and chunk.stop == chunk.prompt.forwards:
                    done.append(session.prompt_seconds)
            self._in_flight = set()
        for seconds in done:
            self.prompted(seconds)
