"""Triton import shim: Triton ships for Linux only, and the torch references must work without it.

Without Triton the kernels below are defined as plain (never called) functions, so every kernel module still
imports and its dispatcher falls back to the reference.
"""

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on platforms without Triton wheels
    HAS_TRITON = False

    class _NoTriton:
        constexpr = None

        @staticmethod
        def jit(fn=None, **options):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(n - 1, 0).bit_length()

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    triton = tl = _NoTriton()  # type: ignore[assignment, unused-ignore]  # (used where triton is absent)

__all__ = ["HAS_TRITON", "tl", "triton"]
