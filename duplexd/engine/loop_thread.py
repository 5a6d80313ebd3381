"""A model's loop thread: all of its torch work (warm-up, graph capture, steps) on one thread of its own.

Grad mode and the intra-op thread count are per thread, and so is the current CUDA device (graphs, streams and
Triton launch on it), so the thread sets them itself before anything runs. `start_loop_thread` returns once the
warm-up is done, raising its error (after the thread ends) if it failed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch


def default_threads() -> int:
    """A loop thread's intra-op threads when none are configured: `OMP_NUM_THREADS` where it is set (as torch
    itself reads it: a process told to keep to one thread, e.g. beside other processes on the same cores, keeps to
    it), else the usable cores."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else len(os.sched_getaffinity(0))


def start_loop_thread(
    name: str, device: torch.device, threads: int, warm: Callable[[], None], loop: Callable[[], None]
) -> threading.Thread:
    """Start a thread on `device` with `threads` intra-op threads that runs `warm()` then `loop()`; return it once
    `warm()` has returned, or raise what `warm()` raised."""
    warmed = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        torch.set_num_threads(threads)
        torch.set_grad_enabled(False)
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            warm()
        except BaseException as e:  # noqa: BLE001 - raised by start_loop_thread
            failed.append(e)
            return
        finally:
            warmed.set()
        loop()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    warmed.wait()
    if failed:
        thread.join()
        raise failed[0]
    return thread
