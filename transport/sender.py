"""Ordered sending on one socket: a writer thread plus a fast path.

Frames go out in the order they are submitted. A submission made while
nothing is queued or being sent goes out at once from the calling thread with
one non-blocking ``sendmsg`` of its frame header and at most ``DIRECT_MAX``
bytes of payload (the kernel takes at most what fits in the socket's send
buffer); whatever the kernel did not take is put at the *front* of the queue
for the writer thread, which blocks in ``sendall`` (GIL released), so order
holds and neither the event loop nor a channel's reader ever waits for a slow
peer. The fast path saves a thread hand-off per op, which is most of the cost
of a small op, and a large payload is copied into the kernel by a thread that
is already running while the peer's reader drains it: by the time the send
buffer is full and the writer thread takes over, the writer's wake-up
overlaps with the peer still receiving.

``busy`` marks that someone owns the socket for sending (the writer or a
fast-path caller); the writer waits while it is set. A fast-path send wakes
the writer only if there is something for it to do (a remainder, frames
queued meanwhile) or someone waits in ``flush``: an idle writer woken for
nothing costs a context switch on the other CPU, right when the peer's reader
needs it.

A submission may also be an *iterator* of buffers (the staged path's payload,
produced chunk by chunk): it always goes to the writer, which asks for the
next buffer only after sending the previous one, so nothing else can slip
into the middle of it. If producing a buffer raises, the connection is
unusable (the peer saw part of a payload): ``on_error`` gets the exception;
unless it raised before its first buffer: then nothing of it went out, the
job is dropped (the iterator reports its own failure; :func:`chain`
reports any error there to the op), a warning is logged and sending goes on.
An iterator that is dropped or stopped early is closed (so it can release
what it holds).
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from .errors import StagingError

__all__ = ["DIRECT_MAX", "Sender", "chain"]

log = logging.getLogger(__name__)

# Payload bytes one fast-path sendmsg may carry behind the frame header. A larger submission sends
# the header and its first DIRECT_MAX bytes from the calling thread (the kernel takes at most the
# send buffer's free room) and leaves the rest to the writer thread. Against 64 KiB, measured on
# loopback (2 CPUs) in bench/bench_transport.py's tcp phase with both variants interleaved in the
# same repetitions (put, get, raw-socket reference; 180 repetitions per size): median put 0.41 ms
# instead of 0.46 ms at 1 MiB, 0.97 instead of 1.21 at 4 MiB, 3.66 instead of 3.83 at 16 MiB. A
# handed-over payload waits for the writer thread to wake (tens of microseconds, more on a busy VM)
# while the peer's reader has nothing to drain; a full send buffer hides that wake. The cost: the
# calling thread (the event loop, for a put) spends up to the TCP send path's time for 4 MiB in the
# kernel (about a millisecond on loopback here), and a put to several peers at once copies each
# peer's first segment on that one thread in turn, where 64 KiB left nearly all of it to the
# peers' writer threads in parallel (3 peers, 2 CPUs: 16 MiB each 8.2 ms instead of 7.9; 1 MiB
# each 0.89 ms instead of 0.97).
DIRECT_MAX = 4 << 20
_DIRECT_MAX_PARTS = 64  # and buffers


@dataclass
class _Job:
    frames: list[bytes | memoryview] | Iterator[bytes | memoryview]
    on_sent: Callable[[], None] | None
    on_dropped: Callable[[], None] | None = None  # once it will never be sent whole (after any send of it ended)
    started: bool = False  # part of it went out (a fast-path send's remainder): never dropped by drop_queued

    def drop(self) -> None:
        _close(self.frames)
        if self.on_dropped is not None:
            self.on_dropped()


def _close(frames: object) -> None:
    close = getattr(frames, "close", None)
    if close is not None:
        close()


def _head(frames: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """``frames``' first buffer (the frame header) and up to ``DIRECT_MAX`` bytes behind it, in at
    most ``_DIRECT_MAX_PARTS`` buffers (so a payload of exactly ``DIRECT_MAX`` bytes leaves no tail
    of header size for the writer thread)."""
    out: list[bytes | memoryview] = []
    room = DIRECT_MAX + (len(frames[0]) if frames else 0)
    for f in frames:
        n = len(f)
        if n >= room:
            out.append(memoryview(f)[:room] if n > room else f)
            break
        out.append(f)
        room -= n
        if len(out) == _DIRECT_MAX_PARTS:
            break
    return out


def _remainder(frames: Sequence[bytes | memoryview], sent: int) -> list[bytes | memoryview]:
    out: list[bytes | memoryview] = []
    for f in frames:
        n = len(f)
        if sent >= n:
            sent -= n
            continue
        out.append(memoryview(f)[sent:] if sent else f)
        sent = 0
    return out


class Sender:
    """Sends frames on ``sock`` in submission order. ``on_error`` is called once on a socket error
    (or the error of an iterator submission)."""

    def __init__(self, sock: socket.socket, name: str, on_error: Callable[[Exception], None]) -> None:
        self._sock = sock
        self._on_error = on_error
        self._cond = threading.Condition(threading.Lock())
        self._jobs: collections.deque[_Job] = collections.deque()
        self._busy = False
        self._flushers = 0  # threads waiting in flush()
        self._closed = False
        self.last_tx = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"transport-tx-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, frames: list[bytes | memoryview] | Iterator[bytes | memoryview],
               on_sent: Callable[[], None] | None = None, *, direct: bool = True,
               on_dropped: Callable[[], None] | None = None) -> bool:
        """Send ``frames`` after everything submitted before. Never blocks on the socket.

        ``frames`` is a list, or an iterator that the writer thread drains (see the module
        docstring). ``on_sent`` is called once the last byte went to the kernel; ``on_dropped``
        instead once it never will (the sender closed or the socket failed; called after any
        send of it in progress ended, so the frames' memory is no longer read). Returns False
        if the sender is closed (nothing is sent; an iterator is closed; ``on_dropped`` is
        called).
        """
        lazy = not isinstance(frames, list)
        with self._cond:
            closed = self._closed
            if not closed:
                if lazy or not direct or self._busy or self._jobs:
                    self._jobs.append(_Job(frames, on_sent, on_dropped))
                    self._cond.notify()
                    return True
                self._busy = True
        if closed:
            _Job(frames, on_sent, on_dropped).drop()
            return False
        assert isinstance(frames, list)
        try:
            sent = self._sock.sendmsg(_head(frames), (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            if on_dropped is not None:
                on_dropped()
            self._on_error(exc)
            return True
        rest = _remainder(frames, sent)
        with self._cond:
            self._busy = False
            dropped = bool(rest) and self._closed  # (closed meanwhile: the writer is gone, the rest is dropped)
            if rest and not dropped:
                self._jobs.appendleft(_Job(rest, on_sent, on_dropped, started=sent > 0))
            if self._jobs or self._flushers:
                self._cond.notify_all()
        if dropped and on_dropped is not None:
            on_dropped()
        if not rest:
            self.last_tx = time.monotonic()
            if on_sent is not None:
                on_sent()
        return True

    def flush(self, timeout: float) -> bool:
        """Wait until everything submitted so far has been sent (bounded); True if it was."""
        end = time.monotonic() + timeout
        with self._cond:
            self._flushers += 1
            try:
                while self._jobs or self._busy:
                    left = end - time.monotonic()
                    if left <= 0 or self._closed:
                        return False
                    self._cond.wait(left)
            finally:
                self._flushers -= 1
        return True

    def drop_queued(self) -> None:
        """Drop every submission none of which went out yet (their ``on_dropped`` run); what is
        being sent, and the rest of a submission partly sent, still go (the stream stays whole)."""
        with self._cond:
            keep = [job for job in self._jobs if job.started]
            dropped = [job for job in self._jobs if not job.started]
            self._jobs.clear()
            self._jobs.extend(keep)
        for job in dropped:
            job.drop()

    def close(self) -> None:
        """Drop queued frames and stop the writer (a send in progress ends when the socket is shut down)."""
        with self._cond:
            self._closed = True
            dropped = list(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        for job in dropped:
            job.drop()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while (self._busy or not self._jobs) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._jobs.popleft()
                self._busy = True
            started = False
            try:
                for f in job.frames:
                    started = True
                    self._sock.sendall(f)
            except Exception as exc:  # OSError, or the error of an iterator submission
                job.drop()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                if not started and not isinstance(exc, OSError):
                    # an iterator that failed before its first buffer: nothing went out, the
                    # stream is intact; its producer reports the failure to the op
                    log.warning("%s: a payload failed before its first buffer and was dropped (nothing was sent): "
                                "%s: %s", self._thread.name, type(exc).__name__, exc)
                    continue
                self._on_error(exc)
                return
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            self.last_tx = time.monotonic()
            if job.on_sent is not None:
                job.on_sent()


def chain(head: bytes, payload: Iterator[memoryview],
           early: Callable[[StagingError], None] | None = None) -> Iterator[bytes | memoryview]:
    """A header frame and a lazily produced payload, as one iterator submission (closing it
    closes ``payload``). The payload's first buffer is produced *before* the header goes out:
    if that fails (``early`` is told), nothing was sent and the channel stays in sync. Any
    error there is reported, as a :class:`StagingError` (the original as its cause): one that
    reached the writer unreported would leave the op waiting for its deadline."""
    try:
        first = next(payload, None)
    except Exception as exc:
        if isinstance(exc, StagingError):
            if early is not None:
                early(exc)
            raise
        err = StagingError(f"cannot produce the payload: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        if early is not None:
            early(err)
        raise err from exc
    yield head
    if first is not None:
        yield first
        yield from payload
