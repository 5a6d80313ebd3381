"""One conversation as the engine sees it: a bounded inbox of 80 ms frames and a bounded outbox of answers.

Any thread pushes audio; the engine's loop takes one frame per step and hands back one output per frame. Outputs
are received from asyncio (`await recv()`, bound to the loop that first waits) or from a thread (`get()`). A
session knows its engine only through `SessionHost` (a lock to share, its limits, and three notifications), and
the engine drives it only through the methods under "engine side"; neither touches the other's state.

A PersonaPlex session may open with a persona (`start_prompt`): until the engine has prefilled the prompt, its
frames wait in the inbox and `until_live` waits (Kyutai's server sends its handshake after the prompt).

Each frame's arrival time is taken when it is pushed and comes back on the output it produced, so the delay from
input to answer is measured where both ends are known. Frames dropped at either bound are reported to the host as
they happen.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..errors import SessionClosed
from ..mailbox import Mailbox
from ..persona.prompt import PersonaPrompt
from .sampling import SamplingParams


@dataclass(frozen=True)
class SessionOutput:
    """One step's answer. A text-only model (Kyutai STT) gives no speech (`pcm` empty, no `audio_tokens`); its
    output for input frame n is the step that read frame n - 1 (`LMConfig.user_lag`), so output 0 answers no audio
    yet, as moshi-server's first step does."""

    frame: int  # index of the output frame in this session (0, 1, ...)
    pcm: np.ndarray  # float32 [frame_size]: the model's speech for this frame ([0] for a text-only model)
    text_token: int
    text: str  # "" for padding tokens, else the token's text with "▁" as a space (what the reference sends)
    audio_tokens: tuple[int, ...] = ()  # the model's audio codes for this frame (agent_codebooks of them)
    arrival: float = 0.0  # time.monotonic() when the input frame of the step that produced this was pushed
    # Each extra head's probability of a pause (class 0; Kyutai STT 1B's semantic VAD, heads for pauses of 0.5, 1,
    # 2 and 3 s); None for a model without extra heads.
    pause: tuple[float, ...] | None = None


class SessionHost(Protocol):
    """What a session needs from the engine that holds it."""

    lock: threading.Lock  # guards every session's state and the host's
    frame_size: int
    max_pending_frames: int
    max_output_frames: int

    def frames_ready(self) -> None:
        """Frames were queued (lock held)."""

    def params_changed(self, session: Session) -> None:
        """`session.params` changed; apply them from its next step (lock held)."""

    def session_ended(self, session: Session) -> None:
        """`session` ended; give its slot back once no step holds it (lock held)."""

    def prompt_requested(self, session: Session, prompt: PersonaPrompt) -> None:
        """Prefill `prompt` in `session`'s slot before its first frame (lock held); raises `ValueError` for a prompt
        the model cannot take, `CapacityError` when its KV pages are not free."""

    def frames_dropped(self, direction: str, count: int) -> None:
        """`count` frames were dropped: "in" at the inbox bound, "out" at the outbox bound (any thread)."""


class Session:
    def __init__(self, host: SessionHost, slot: int, params: SamplingParams, max_frames: int | None) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.slot, self.params, self.max_frames = slot, params, max_frames
        self._host = host
        self._lock = host.lock
        self._partial: npt.NDArray[np.float32] = np.zeros(0, dtype=np.float32)
        self._inbox: deque[tuple[np.ndarray, float]] = deque()
        self._mailbox: Mailbox[SessionOutput] = Mailbox(self._lock, lambda: self.closed)
        self._outbox = self._mailbox.items
        self.closed = False  # no more input: closed by the client or ended by the engine
        self.close_reason: str | None = None
        self.prompt: PersonaPrompt | None = None  # the persona prompt it opened with
        self.prompted = 0  # the prompt's forwards prefilled so far
        self.prompt_seconds: float | None = None  # from `start_prompt` until the prompt was in
        self._prompt_started = 0.0
        self.steps = self.frames_taken = 0
        self.frames_in = self.frames_out = self.frames_dropped_in = self.frames_dropped_out = 0

    def __repr__(self) -> str:
        return f"Session({self.id}, slot={self.slot}, closed={self.closed})"

    # ------------------------------------------------------------------------------------------- any thread

    def push(self, pcm: np.ndarray) -> int:
        """Queue mono float audio at the engine's rate (any length); returns how many whole frames were dropped
        because the inbox already held `max_pending_frames`. Non-finite samples become 0."""
        samples = np.array(pcm, dtype=np.float32).reshape(-1)  # a copy: callers reuse their buffers
        if not np.isfinite(samples).all():  # checking first: nan_to_num's masks cost more than the check
            np.nan_to_num(samples, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
        host = self._host
        size, limit = host.frame_size, host.max_pending_frames
        now = time.monotonic()
        with self._lock:
            if self.closed:
                raise SessionClosed(f"session {self.id} has ended ({self.close_reason})")
            data = np.concatenate([self._partial, samples]) if len(self._partial) else samples
            whole = len(data) // size
            self._partial = data[whole * size :].copy()
            dropped = 0
            for i in range(whole):
                if len(self._inbox) >= limit:
                    dropped += 1
                    continue
                self._inbox.append((data[i * size : (i + 1) * size], now))
            self.frames_in += whole - dropped
            self.frames_dropped_in += dropped
            if whole > dropped:
                host.frames_ready()
        if dropped:
            host.frames_dropped("in", dropped)
        return dropped

    def update_params(self, params: SamplingParams) -> None:
        """Sample with `params` from the next step on; the conversation keeps its position and history."""
        with self._lock:
            if self.closed:
                raise SessionClosed(f"session {self.id} has ended ({self.close_reason})")
            self.params = params
            self._host.params_changed(self)

    def start_prompt(self, prompt: PersonaPrompt) -> None:
        """Open the conversation with a PersonaPlex persona: the engine prefills `prompt`, then the session goes
        live; audio pushed meanwhile waits in the inbox. Non-blocking. `ValueError` when the session has already
        stepped a frame or has a prompt, or the model cannot take this one; `CapacityError` when the KV pages for
        the prompt's frames are not free."""
        with self._lock:
            if self.closed:
                raise SessionClosed(f"session {self.id} has ended ({self.close_reason})")
            if self.prompt is not None:
                raise ValueError("this session already has a persona prompt")
            if self.frames_taken:
                raise ValueError(f"a persona is set before the conversation starts ({self.frames_taken} frames ran)")
            self._host.prompt_requested(self, prompt)
            self.prompt = prompt
            self._prompt_started = time.monotonic()

    @property
    def prompting(self) -> bool:
        """True until the persona prompt is prefilled (False without one, and once ended)."""
        return self.prompt is not None and self.prompted < self.prompt.forwards and not self.closed

    async def until_live(self) -> bool:
        """Wait until the persona prompt is prefilled (True; at once without one) or the session ends (False)."""
        await self._mailbox.until(lambda: not self.prompting)
        with self._lock:
            return not self.closed

    def close(self, reason: str = "client") -> None:
        """End the session now: pending input and undelivered output are discarded. Idempotent."""
        with self._lock:
            self._outbox.clear()
            if not self.closed:
                self.end(reason)

    async def recv(self) -> SessionOutput | None:
        """The next output frame, or None once the session has ended and its outputs are all received."""
        return await self._mailbox.recv()

    def get(self, timeout: float | None = None) -> SessionOutput | None:
        """Blocking `recv` for threads; `TimeoutError` when nothing arrives within `timeout` seconds."""
        return self._mailbox.get(timeout, f"output from session {self.id}")

    @property
    def pending_frames(self) -> int:
        with self._lock:
            return len(self._inbox)

    # ------------------------------------------------------------------------------------------- engine side
    # Called with the host's lock held.

    def has_frame(self) -> bool:
        return bool(self._inbox) and not self.closed and not self.prompting

    def take_frame(self) -> tuple[np.ndarray, float] | None:
        """The oldest queued frame and its arrival time, or None (also while the prompt is prefilled)."""
        if not self.has_frame():
            return None
        self.frames_taken += 1
        return self._inbox.popleft()

    def prefilled(self, rows: int) -> None:
        """`rows` more of the prompt's forwards ran; once all have, the session is live."""
        assert self.prompt is not None
        self.prompted += rows
        if self.prompted >= self.prompt.forwards:
            self.prompt_seconds = time.monotonic() - self._prompt_started
            self._mailbox.wake()

    def stepped(self, output: SessionOutput | None) -> int:
        """One of this session's frames was stepped; `output` is its answer (None while the model warms up).
        Ends the session at `max_frames`. Returns how many outputs the outbox bound dropped (0 or 1)."""
        self.steps += 1
        dropped = 0
        if output is not None and not self.closed:
            if len(self._outbox) >= self._host.max_output_frames:
                self._outbox.popleft()
                self.frames_dropped_out += 1
                dropped = 1
            self._outbox.append(output)
            self.frames_out += 1
            self._mailbox.wake()
        if self.max_frames is not None and self.steps >= self.max_frames and not self.closed:
            self.end("max_frames")
        return dropped

    def end(self, reason: str) -> None:
        """Close the session for `reason`; the host gets its slot back."""
        self.closed, self.close_reason = True, reason
        self._inbox.clear()
        self._host.session_ended(self)
        self._mailbox.wake()
