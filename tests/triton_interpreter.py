"""Triton's interpreter, without its per-call re-patching of `triton.language` inside a running kernel.

A kernel run by the interpreter (`GridExecutor.__call__`) patches the language modules its own globals hold for
the whole grid. Every call of a `@triton.jit` device function inside it (ours, and Triton's own `tl.max`, `tl.sum`,
...) patches the language modules of the function's globals again (`InterpretedFunction.__call__` runs
`_patch_lang`, ~3.7 ms a call here, and never undoes it): a third of the interpreter's time in the kernel tests.
Here the first call of a device function from a given module patches as Triton does, and the module's later calls
in the same kernel run skip the repeat (those patches are still in place); a device function called outside a
kernel keeps Triton's own path. The same rewritten functions run on the same patched language.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_state = threading.local()


def install() -> None:
    """Patch the interpreter's classes once, where Triton's interpreter is the one described above (else: nothing)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    executor = getattr(interpreter, "GridExecutor", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    if executor is None or function is None or not hasattr(function, "rewrite"):
        return  # another Triton's interpreter: run it as it is
    if getattr(executor, "_duplexd_tests", False):
        return
    run_grid, call_device = executor.__call__, function.__call__

    @functools.wraps(run_grid)
    def grid_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(_state, "patched", None)
        _state.patched = set()  # the modules whose language this kernel run has patched for a device function
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            _state.patched = outer

    @functools.wraps(call_device)
    def device_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched = getattr(_state, "patched", None)
        module = self.fn.__module__
        if patched is None or module not in patched:
            if patched is not None:
                patched.add(module)
            return call_device(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    executor.__call__ = grid_call
    function.__call__ = device_call
    executor._duplexd_tests = True
