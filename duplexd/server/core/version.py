"""The installed duplexd version (for metadata and /v1/models)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("duplexd")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0+unknown"
