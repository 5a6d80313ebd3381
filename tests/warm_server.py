"""`duplexd serve` for the tests without paying its imports each time: one warm interpreter per test process imports
what a server imports (torch, fastapi, uvicorn, duplexd's app: about 1.7 s of CPU, most of a demo server's start)
and forks a child per server, which runs the real entry point (`runpy` on `duplexd.__main__`) with its own argv,
environment and log. The suite starts some thirty servers.

`spawn` returns a `WarmProcess`, which answers as much of `subprocess.Popen` as the tests use (`pid`, `poll`,
`wait`, `send_signal`, `kill`, `returncode`); the warm interpreter reaps its children and writes each exit status
beside the log. Run as `python -m tests.warm_server`: it reads one job a line on stdin and answers each with the
child's pid.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .forked_cli import RUN_IMPORTS, run_and_exit


class WarmProcess:
    """A process forked by the warm interpreter: its exit status comes from `status`, written when it is reaped."""

    def __init__(self, pid: int, status: Path) -> None:
        self.pid = pid
        self.status = status
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.status.exists():  # written whole (renamed into place)
            self.returncode = int(self.status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"duplexd serve (pid {self.pid})", timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Spawner:
    """This test process's warm interpreter, started at its first server."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def spawn(self, job: dict) -> WarmProcess:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.warm_server"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    cwd=Path(__file__).resolve().parents[1],
                    text=True,
                )
            assert self._proc.stdin is not None and self._proc.stdout is not None
            Path(job["status"]).unlink(missing_ok=True)
            self._proc.stdin.write(json.dumps(job) + "\n")
            self._proc.stdin.flush()
            answer = self._proc.stdout.readline()
            if not answer.strip():
                raise RuntimeError(f"the warm interpreter is gone (exit {self._proc.poll()})")
            return WarmProcess(int(answer), Path(job["status"]))


_spawner = _Spawner()


def spawn(argv: list[str], env: dict[str, str], log: Path) -> WarmProcess:
    """`python -m duplexd *argv` with `env`, its stdout and stderr in `log`, forked from the warm interpreter."""
    job = {"argv": argv, "env": env, "stdout": str(log), "stderr": str(log), "status": f"{log}.rc"}
    return _spawner.spawn(job)


def spawn_script(script: Path, argv: list[str], env: dict[str, str], cwd: Path, out: Path, err: Path) -> WarmProcess:
    """`python SCRIPT *argv` in `cwd` with `env`, in a session of its own (its process group is its pid), output
    in `out` and `err`, forked from the warm interpreter: a bench, which imports torch as a server does."""
    job = {"script": str(script), "argv": argv, "env": env, "cwd": str(cwd), "session": True}
    return _spawner.spawn(job | {"stdout": str(out), "stderr": str(err), "status": f"{out}.rc"})


# ------------------------------------------------------------------------------------------- the warm interpreter


def _reap(signum: int, frame: object) -> None:
    """Every child that has ended: its exit status (negative: the signal that ended it) beside its log."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = _statuses.pop(pid, None)
        if path is not None:
            partial = f"{path}.part"
            Path(partial).write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(partial, path)


_statuses: dict[int, str] = {}  # where each child's exit status goes, by pid


def _child(job: dict) -> None:
    if job.get("session"):
        os.setsid()
    if job.get("cwd"):
        os.chdir(job["cwd"])
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    out = os.open(job["stdout"], flags | os.O_TRUNC, 0o644)
    err = out if job["stderr"] == job["stdout"] else os.open(job["stderr"], flags | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.closerange(3, 256)  # the warm interpreter's pipes: a child holds only what it opens
    os.environ.clear()
    os.environ.update(job["env"])
    if job.get("script"):
        sys.argv = [job["script"], *job["argv"]]
        sys.path[0] = str(Path(job["script"]).parent)  # as `python SCRIPT` puts the script's folder first
        run_and_exit(lambda: runpy.run_path(job["script"], run_name="__main__"))
    sys.argv = ["duplexd", *job["argv"]]
    run_and_exit(lambda: runpy.run_module("duplexd", run_name="__main__", alter_sys=True))


def main() -> None:
    from duplexd.commands.cli import COMMANDS

    for module in (*(module for module, _ in COMMANDS.values()), *RUN_IMPORTS):
        importlib.import_module(module)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the servers themselves, not this
    signal.signal(signal.SIGCHLD, _reap)
    for line in sys.stdin:
        job = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # its pid recorded before it can be reaped
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server reaps its own children (codec workers)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            _child(job)
        _statuses[pid] = job["status"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        print(pid, flush=True)


if __name__ == "__main__":
    main()
