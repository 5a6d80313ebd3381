"""Codec worker processes: Ogg/Opus streams whose libopus state lives in a child process of the server.

Why processes: libopus releases the GIL, but a codec tick is many short calls (about five per stream), and every
one hands the GIL over and back. Two codec threads on two cores therefore code only 1.29x what one does, while
the same work split over two processes codes 1.89x (bench/codec.py). A worker process has its own GIL, so N
workers scale with the cores; sphn, the fallback without libopus, holds the GIL and scales only this way.

A worker is a fresh interpreter (`python -m duplexd.server.codec.workers FD`, importing only the codec: not the
server's `__main__`, as multiprocessing's spawn would) running `serve` on one end of a socket pair. Each request
is one batch: ops (encode or decode) for streams it owns, then the ids of streams to free; each reply is the ops'
results in order. A stream is made in its worker by its first op and stays there (`RemoteStream` pins it); its
handle going away frees it with the worker's next batch. A worker that dies fails the batch in flight and every
stream it held with `CodecWorkerError` (an `AudioError`: those sessions end with an error message, the others go
on) and is started afresh for new streams.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from .errors import AudioError
from .streams import OggOpusDecoder, OggOpusEncoder

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0


class CodecWorkerError(AudioError):
    """The codec worker process holding a stream's state exited: the stream cannot go on."""


@dataclass(eq=False)
class RemoteStream:
    """A stream in a worker process: an encoder (`profile` set) or a decoder, at `sample_rate`."""

    worker: CodecWorker
    generation: int  # the worker's incarnation that holds it
    id: int
    sample_rate: int
    profile: str | None = None  # an encoder's Opus profile; None for a decoder
    closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        """Free the stream's state in its worker (with the worker's next batch); idempotent. Safe while a batch
        with its op is in flight: a worker runs a message's ops before its frees."""
        if not self.closed:
            self.closed = True
            self.worker.forget(self)

    def __del__(self) -> None:
        self.close()


# A reply per op: (True, value) or (False, (message, is_audio_error)).
Reply = tuple[bool, Any]


def serve(conn: Connection) -> None:
    """A worker's life: batches in, results out, until the server closes the pipe or sends an empty message."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server drains, then ends us
    streams: dict[int, OggOpusEncoder | OggOpusDecoder] = {}
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not request:
            return
        ops, freed = pickle.loads(request)
        replies: list[Reply] = []
        for stream_id, profile, sample_rate, payload in ops:
            try:
                stream = streams.get(stream_id)
                if stream is None:
                    stream = OggOpusDecoder(sample_rate) if profile is None else OggOpusEncoder(profile, sample_rate)
                    streams[stream_id] = stream
                if isinstance(stream, OggOpusEncoder):
                    replies.append((True, stream.encode(payload)))
                else:
                    replies.append((True, stream.decode(payload)))
            except Exception as e:  # noqa: BLE001 - handed back to the one request that made it
                replies.append((False, (str(e), isinstance(e, AudioError))))
        for stream_id in freed:  # after the ops: a stream closed while its last op was on the way
            stream = streams.pop(stream_id, None)
            if stream is not None:
                stream.close()
        conn.send_bytes(pickle.dumps(replies, pickle.HIGHEST_PROTOCOL))


class CodecWorker:
    """One worker process and its pipe; `run` sends it one batch at a time (from the codec courier threads)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.generation = 0
        self.streams = 0  # streams alive in it, for placing new ones
        self._lock = threading.Lock()  # one batch on the pipe at a time
        self._freed: deque[int] = deque()  # appended from any thread, taken by `run`
        self._ids = itertools.count()
        self._start()

    def _start(self) -> None:
        # a new interpreter, not a fork: the server has threads (torch's among them)
        ours, theirs = socket.socketpair()
        with theirs:
            fd = theirs.fileno()
            command = [sys.executable, "-m", __name__, str(fd)]
            self._process = subprocess.Popen(command, pass_fds=(fd,), stdin=subprocess.DEVNULL)
        self._conn = Connection(ours.detach())

    @property
    def pid(self) -> int:
        return self._process.pid

    def open(self, sample_rate: int, profile: str | None) -> RemoteStream:
        self.streams += 1
        return RemoteStream(self, self.generation, next(self._ids), sample_rate, profile)

    def forget(self, stream: RemoteStream) -> None:
        """A stream's handle went away: free its state with the next batch (from any thread, even a finaliser)."""
        if stream.generation == self.generation:
            self.streams -= 1
            self._freed.append(stream.id)

    def run(self, ops: Sequence[tuple[RemoteStream, Any]]) -> list[tuple[bool, Any]]:
        """One batch of (stream, payload): each op's result, or the exception for its caller alone.

        Pickling happens outside the pipe's lock, so while the worker codes one batch the next is made ready."""
        generation = self.generation
        out: list[tuple[bool, Any]] = [(False, None)] * len(ops)
        live = []
        for i, (stream, _) in enumerate(ops):
            if stream.closed:
                out[i] = (False, ValueError("the audio stream is closed"))
            elif stream.generation != generation:
                out[i] = (False, CodecWorkerError("the codec worker holding this audio stream exited"))
            else:
                live.append(i)
        request = [(ops[i][0].id, ops[i][0].profile, ops[i][0].sample_rate, ops[i][1]) for i in live]
        freed = [self._freed.popleft() for _ in range(len(self._freed))]  # after the ops (see RemoteStream.close)
        message = pickle.dumps((request, freed), pickle.HIGHEST_PROTOCOL)
        with self._lock:
            try:
                if self.generation != generation:
                    raise EOFError("restarted while this batch was made")
                self._conn.send_bytes(message)
                reply = self._conn.recv_bytes()
            except (EOFError, OSError) as e:
                why = self._restart(e) if self.generation == generation else "restarted"
                error = CodecWorkerError(f"the codec worker exited ({why})")
                for i in live:
                    out[i] = (False, error)
                return out
        replies: list[Reply] = pickle.loads(reply)
        for i, (ok, value) in zip(live, replies, strict=True):
            if ok:
                out[i] = (True, value)
            else:
                message_, is_audio = value
                out[i] = (False, AudioError(message_) if is_audio else RuntimeError(message_))
        return out

    def _restart(self, cause: BaseException) -> str:
        """Replace a dead worker; its streams fail from now on (their generation is gone). Why it died."""
        code = self._end()
        why = f"exit code {code}" if code is not None else repr(cause)
        logger.error("codec worker %d (pid %s) died: %s; starting a new one", self.index, self._process.pid, why)
        self._conn.close()
        self.generation += 1
        self.streams = 0
        self._freed.clear()
        self._start()
        return why

    def _end(self) -> int | None:
        """Wait for the process to exit (killed if it does not): its exit code."""
        try:
            return self._process.wait(JOIN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            return self._process.wait(JOIN_TIMEOUT_S)

    def close(self) -> None:
        with self._lock:
            try:
                self._conn.send_bytes(b"")  # the end
            except OSError:
                pass
            self._end()
            self._conn.close()


class CodecWorkers:
    """`count` worker processes; a new stream goes to the one holding the fewest."""

    def __init__(self, count: int) -> None:
        self.workers = [CodecWorker(i) for i in range(count)]

    def emptiest(self) -> CodecWorker:
        """The worker for a new session's streams: the one holding the fewest."""
        return min(self.workers, key=lambda w: w.streams)

    def pids(self) -> list[int]:
        return [pid for w in self.workers if (pid := w.pid) is not None]

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
