"""The system programs and libraries some tests need, each with the Debian package that brings it.

`scripts/test.sh` installs them (as root or through sudo). A test marked `needs("espeak-ng")` skips, naming the
tool and its install command, where one is missing; where the script could install them it sets
`DUPLEXD_SYSTEM_TOOLS=required` and a missing tool fails the test instead, so a green run never hides one.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import pytest

from duplexd.server.codec import libopus

from .browser import CHROMIUM


def _programs(*names: str) -> bool:
    return all(shutil.which(name) is not None for name in names)


# tool -> (Debian package, whether it is there: found as the tests call it)
TOOLS = {
    "espeak-ng": ("espeak-ng", lambda: _programs("espeak-ng")),
    "libopus": ("libopus0", lambda: libopus.load() is not None),
    "chromium": ("chromium", lambda: Path(CHROMIUM).exists()),
    "haproxy": ("haproxy", lambda: _programs("haproxy")),
    "node": ("nodejs npm", lambda: _programs("node", "npm")),
}


@functools.cache
def present(tool: str) -> bool:
    return TOOLS[tool][1]()


def needs(*tools: str) -> pytest.MarkDecorator:
    """Mark a test (or a module, as `pytestmark`) as needing these system tools (keys of TOOLS)."""
    unknown = set(tools) - set(TOOLS)
    assert not unknown, f"unknown system tools {sorted(unknown)}"
    return pytest.mark.needs_system(*tools)


def require(*tools: str) -> None:
    """Skip the running test (or fixture) where one of `tools` is missing, naming each and the command that installs
    it; fail it instead where the run requires every tool."""
    missing = [tool for tool in tools if not present(tool)]
    if not missing:
        return
    packages = " ".join(dict.fromkeys(TOOLS[tool][0] for tool in missing))
    message = f"needs {', '.join(missing)}: apt-get install {packages} (scripts/test.sh installs it)"
    if os.environ.get("DUPLEXD_SYSTEM_TOOLS") == "required":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def check(item: pytest.Item) -> None:
    """What `require` does for the tools `item`'s `needs` marks name."""
    require(*(tool for mark in item.iter_markers("needs_system") for tool in mark.args))
