"""Fixtures' products built once per test run, whichever xdist worker asks first: a session fixture is per worker,
so an expensive oracle (a tuned reference model, a reference generation) asked for by modules on three workers was
built three times. The first asker builds it into a folder of the run's shared temp dir under a file lock; the
others wait on the lock and read what it wrote."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def _run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's temp dir: the workers' base temps are its children (popen-gw0, ...); without xdist, the base."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]) -> Path:
    """The folder `name` of this run, `build(folder)` having filled it (in the first worker that asked)."""
    root = _run_root(tmp_path_factory)
    folder = root / f"built-once-{name}"
    with _locked(root / f"built-once-{name}.lock"):
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)  # a builder that failed half-way
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


def computed_once(folder: Path, key: tuple, compute: Callable[[], T]) -> T:
    """`compute()` for `key`, pickled into `folder` by the first worker that asked; each caller gets its own copy."""
    digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    path = folder / f"computed-{digest}.pickle"
    with _locked(folder / f"computed-{digest}.lock"):
        if not path.exists():
            partial = path.with_suffix(".partial")
            partial.write_bytes(pickle.dumps(compute()))
            partial.rename(path)
    return pickle.loads(path.read_bytes())
