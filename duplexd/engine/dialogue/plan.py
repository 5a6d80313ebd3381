"""Plain data between the scheduler and the runner: what one step does and what it gave.

The scheduler decides (`Scheduler.plan`), the runner executes (`Runner.execute`), the scheduler hands the result
to the sessions (`Scheduler.finish`); neither looks into the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..persona.prompt import PromptChunk
from .sampling import SamplingParams


@dataclass(frozen=True)
class StepPlan:
    """Slots to start afresh, slots whose sampling changed, then the batch (may be empty): one frame per slot; then
    persona prompt frames to prefill (after the batch's outputs are handed out)."""

    resets: tuple[tuple[int, SamplingParams], ...] = ()
    retunes: tuple[tuple[int, SamplingParams], ...] = ()
    slots: tuple[int, ...] = ()
    frames: tuple[np.ndarray, ...] = ()  # float32 [frame_size] each
    arrivals: tuple[float, ...] = ()  # time.monotonic() when each frame was pushed
    prefill: tuple[PromptChunk, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """Row i answers `plan.slots[i]`; all empty when the step failed (`error`) or the plan had no batch."""

    pcm: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # [B, frame_size]; [B, 0]: text only
    tokens: list[list[int]] = field(default_factory=list)  # [B][1 + agent_codebooks]: text token, then audio codes
    texts: list[str] = field(default_factory=list)  # the text token's piece ("" for padding)
    valid: list[bool] = field(default_factory=list)  # False while a slot warms up: no output for that row
    pause: np.ndarray | None = None  # float32 [B, extra heads]: their class-0 probabilities; None without heads
    bucket: int = 0  # the batch size the step ran at
    seconds: float = 0.0  # wall time of the step, the copies to the host included
    error: BaseException | None = None


@dataclass(frozen=True)
class PrefillResult:
    """How `plan.prefill` went: its wall time (launches only on CUDA: it is not waited for), or the error."""

    rows: int = 0
    seconds: float = 0.0
    error: BaseException | None = None
