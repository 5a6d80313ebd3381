"""The metadata message's `build_info`: the Rust server's ten string fields, true of this duplexd, plus its own.

Kyutai's web client checks that the fields are there. Computed once at import (a few `git` calls when the
package runs from a git checkout); anything that cannot be found is "unknown", and nothing here ever raises.
"""

from __future__ import annotations

import logging
import platform
import subprocess
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path

from .version import VERSION

logger = logging.getLogger(__name__)
UNKNOWN = "unknown"
_HERE = Path(__file__).resolve().parent


def _git(*args: str) -> str:
    """A git command's output in this package's directory, or "" on any failure."""
    try:
        proc = subprocess.run(["git", "-C", str(_HERE), *args], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def git_fields() -> dict[str, str]:
    """Branch, commit time and date, hash and `describe` of the checkout this package runs from, if it is one
    (this package tracked there, not some unrelated repository around an install)."""
    fields = dict.fromkeys(("git_branch", "git_timestamp", "git_date", "git_hash", "git_describe"), UNKNOWN)
    if not _git("ls-files", "--error-unmatch", "__init__.py"):
        return fields
    commit = _git("log", "-1", "--format=%H%n%cI%n%cs").splitlines()
    if len(commit) == 3:
        fields.update(git_hash=commit[0], git_timestamp=commit[1], git_date=commit[2])
    fields["git_branch"] = _git("rev-parse", "--abbrev-ref", "HEAD") or UNKNOWN
    fields["git_describe"] = _git("describe", "--always", "--dirty", "--tags") or UNKNOWN
    return fields


def build_time() -> datetime | None:
    """When this duplexd was built (installed): the time its package metadata was written."""
    try:
        dist = distribution("duplexd")
        metadata = next((f for f in dist.files or () if f.name in ("METADATA", "PKG-INFO")), None)
        if metadata is None:
            return None
        return datetime.fromtimestamp(Path(str(dist.locate_file(metadata))).stat().st_mtime, timezone.utc)
    except (PackageNotFoundError, OSError, ValueError):
        return None


def _versions() -> str:
    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = UNKNOWN
    return f"python {platform.python_version()} / torch {torch}"


def collect() -> dict[str, str]:
    """All the fields; never raises."""
    try:
        built = build_time()
        triple = f"{platform.machine() or UNKNOWN}-{platform.system().lower() or UNKNOWN}"
        return {
            "build_timestamp": built.isoformat() if built else UNKNOWN,
            "build_date": built.date().isoformat() if built else UNKNOWN,
            **git_fields(),
            "rustc_host_triple": triple,
            "rustc_version": _versions(),
            "cargo_target_triple": triple,
            "server": "duplexd",
            "version": VERSION,
        }
    except Exception:  # a metadata message must never fail a connection
        logger.exception("build info unavailable")
        keys = (
            "build_timestamp",
            "build_date",
            "git_branch",
            "git_timestamp",
            "git_date",
            "git_hash",
            "git_describe",
            "rustc_host_triple",
            "rustc_version",
            "cargo_target_triple",
        )
        return {**dict.fromkeys(keys, UNKNOWN), "server": "duplexd", "version": VERSION}


BUILD_INFO = collect()
