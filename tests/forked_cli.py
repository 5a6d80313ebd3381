"""Run many `python -m duplexd ARGS` command lines cheaply: one interpreter imports duplexd (and torch) once, then
forks a child per command line (one per core at a time) that runs the real entry point (`runpy` on
`duplexd.__main__`) with its own argv, environment, stdout and stderr, and exit code. Each is a separate process;
only the import is shared.

Usage: `python -m tests.forked_cli < jobs.json`, jobs a list of {"argv", "env", "out"}; writes out.stdout,
out.stderr and out.rc per job. Forks happen before anything touches CUDA, so a child may use it.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from duplexd.commands.cli import COMMANDS

# What `duplexd serve` imports only once it runs (its app: fastapi, the routes, uvicorn): imported here too, or each
# child imports them again (~0.4 s of CPU a case, most of what a case costs).
RUN_IMPORTS = (
    "uvicorn",
    "duplexd.server.app",
    "duplexd.server.core.drain",
    "duplexd.server.core.front_door",
    "duplexd.server.core.preflight",
    "duplexd.server.core.runtime",
)


def _child(argv: list[str], env: dict[str, str], out: str) -> None:
    for fd, suffix in ((1, "stdout"), (2, "stderr")):
        handle = os.open(f"{out}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["duplexd", *argv]
    run_and_exit(lambda: runpy.run_module("duplexd", run_name="__main__", alter_sys=True))


def run_and_exit(run: Callable[[], object]) -> NoReturn:
    """A forked child's end: `run()`, then exit as the interpreter would (SystemExit's code, 1 after a traceback),
    its output flushed, nothing of the parent's cleanup run."""
    code = 1
    try:
        run()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    """The jobs, as many at a time as there are cores (each child is a separate process)."""
    for module in (*(module for module, _ in COMMANDS.values()), *RUN_IMPORTS):  # the warm import every child
        importlib.import_module(module)  # shares (the command line's own is lazy)
    jobs = json.load(sys.stdin)
    running: dict[int, str] = {}  # pid -> its out prefix
    for job in [*jobs, None]:
        while running and (job is None or len(running) >= (os.cpu_count() or 1)):
            pid, status = os.wait()
            with open(f"{running.pop(pid)}.rc", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
        if job is None:
            break
        pid = os.fork()
        if pid == 0:
            _child(job["argv"], job["env"], job["out"])
        running[pid] = job["out"]


if __name__ == "__main__":
    main()
