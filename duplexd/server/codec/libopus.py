"""ctypes bindings to the system libopus (Debian's libopus0), nothing more.

ctypes releases the GIL for every foreign call, so a codec thread encoding or decoding here leaves the event loop
and the other codec threads running, which sphn (it holds the GIL) does not. Every function used is declared with
its argument and result types: an undeclared pointer result is truncated to a C int and crashes later.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

import numpy as np

log = logging.getLogger(__name__)

OPUS_APPLICATION_VOIP = 2048
OPUS_APPLICATION_AUDIO = 2049
OPUS_APPLICATION_RESTRICTED_LOWDELAY = 2051
OPUS_SET_BITRATE_REQUEST = 4002
OPUS_SET_COMPLEXITY_REQUEST = 4010
OPUS_GET_LOOKAHEAD_REQUEST = 4027
MAX_PACKET_BYTES = 4000  # libopus's recommended ceiling for one packet
MAX_PACKET_MS = 120  # the longest packet Opus allows

# find_library first (it follows ldconfig, so a libopus built into /usr/local wins), then Debian's soname.
_FOUND = ctypes.util.find_library("opus")
LIBRARY_NAMES: tuple[str, ...] = tuple(dict.fromkeys(n for n in (_FOUND, "libopus.so.0") if n))

_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # empty until the first load(), then [lib or None]


class OpusError(RuntimeError):
    """libopus refused a call (a bad argument or an allocation failure): a bug here, not bad input."""


def _declare(lib: ctypes.CDLL) -> None:
    c_int, c_int32, c_void_p, c_char_p = ctypes.c_int, ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p
    signatures: dict[str, tuple[list, object]] = {
        "opus_get_version_string": ([], c_char_p),
        "opus_strerror": ([c_int], c_char_p),
        "opus_encoder_create": ([c_int32, c_int, c_int, ctypes.POINTER(c_int)], c_void_p),
        "opus_encode_float": ([c_void_p, c_void_p, c_int, c_void_p, c_int32], c_int32),
        "opus_encoder_destroy": ([c_void_p], None),
        "opus_decoder_create": ([c_int32, c_int, ctypes.POINTER(c_int)], c_void_p),
        "opus_decode_float": ([c_void_p, c_char_p, c_int32, c_void_p, c_int, c_int], c_int),
        "opus_decoder_destroy": ([c_void_p], None),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype


def load() -> ctypes.CDLL | None:
    """The declared library, loaded once per process; None when no libopus can be loaded."""
    with _lock:
        if not _loaded:
            _loaded.append(_open(LIBRARY_NAMES))
        return _loaded[0]


def _open(names: tuple[str, ...]) -> ctypes.CDLL | None:
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            _declare(lib)
        except (OSError, AttributeError) as e:  # AttributeError: a library without a libopus symbol
            log.debug("cannot load %s: %s", name, e)
            continue
        return lib
    return None


def version(lib: ctypes.CDLL) -> str:
    """libopus's own version string, e.g. "libopus 1.3.1"."""
    return lib.opus_get_version_string().decode()


def _check(lib: ctypes.CDLL, code: int, what: str) -> int:
    if code < 0:
        raise OpusError(f"{what}: {lib.opus_strerror(code).decode()} ({code})")
    return code


class Encoder:
    """One mono libopus encoder; `encode` takes exactly one Opus frame (2.5 to 120 ms) of float32 PCM."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        sample_rate: int,
        application: int,
        *,
        complexity: int | None = None,
        bitrate: int | None = None,
    ) -> None:
        self._lib = lib
        err = ctypes.c_int(0)
        handle = lib.opus_encoder_create(sample_rate, 1, application, ctypes.byref(err))
        _check(lib, err.value, "opus_encoder_create")
        if not handle:
            raise OpusError("opus_encoder_create returned NULL")
        self._handle: int | None = handle
        self._out = ctypes.create_string_buffer(MAX_PACKET_BYTES)
        # opus_encoder_ctl is variadic: one typed function object per argument kind (lib[...] makes a fresh one).
        self._ctl_int = lib["opus_encoder_ctl"]
        self._ctl_int.argtypes, self._ctl_int.restype = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int32], ctypes.c_int
        self._ctl_ptr = lib["opus_encoder_ctl"]
        self._ctl_ptr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int32)]
        self._ctl_ptr.restype = ctypes.c_int
        if complexity is not None:
            _check(lib, self._ctl_int(handle, OPUS_SET_COMPLEXITY_REQUEST, complexity), "OPUS_SET_COMPLEXITY")
        if bitrate is not None:
            _check(lib, self._ctl_int(handle, OPUS_SET_BITRATE_REQUEST, bitrate), "OPUS_SET_BITRATE")

    def lookahead(self) -> int:
        """The encoder's delay in samples at its own rate (what a stream's pre-skip must cover)."""
        value = ctypes.c_int32(0)
        code = self._ctl_ptr(self._live(), OPUS_GET_LOOKAHEAD_REQUEST, ctypes.byref(value))
        _check(self._lib, code, "OPUS_GET_LOOKAHEAD")
        return value.value

    def encode(self, pcm: np.ndarray) -> bytes:
        """One Opus packet for `pcm` (float32, C-contiguous, a valid frame size)."""
        n = self._lib.opus_encode_float(self._live(), pcm.ctypes.data, len(pcm), self._out, MAX_PACKET_BYTES)
        return ctypes.string_at(self._out, _check(self._lib, n, "opus_encode_float"))

    def _live(self) -> int:
        if self._handle is None:
            raise OpusError("encoder is closed")
        return self._handle

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.opus_encoder_destroy(handle)


class Decoder:
    """One mono libopus decoder; `decode_into` writes one packet's PCM into a caller's float32 buffer."""

    def __init__(self, lib: ctypes.CDLL, sample_rate: int) -> None:
        self._lib = lib
        err = ctypes.c_int(0)
        handle = lib.opus_decoder_create(sample_rate, 1, ctypes.byref(err))
        _check(lib, err.value, "opus_decoder_create")
        if not handle:
            raise OpusError("opus_decoder_create returned NULL")
        self._handle: int | None = handle
        self.max_samples = sample_rate * MAX_PACKET_MS // 1000

    def decode_into(self, packet: bytes, address: int) -> int:
        """Decode `packet` (no FEC) into the float32 buffer at `address`, which must hold `max_samples`; the sample
        count, or libopus's negative error code (a packet it cannot decode)."""
        if self._handle is None:
            raise OpusError("decoder is closed")
        return self._lib.opus_decode_float(self._handle, packet, len(packet), address, self.max_samples, 0)

    def strerror(self, code: int) -> str:
        return self._lib.opus_strerror(code).decode()

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.opus_decoder_destroy(handle)
