"""Await a blocking completion (a CUDA event) from asyncio, without a core spinning on it.

A GPU copy or an NCCL send finishes on the device; the host learns of it from a CUDA event. Polling
``event.query()`` from the event loop either burns a core (tight loop) or adds latency (sleeps);
blocking in ``event.synchronize()`` on the loop freezes it. A :class:`CompletionBridge` owns one
daemon thread that calls the blocking wait, with the GIL released, in submission order, and
resolves an asyncio future on the loop when it returns. With events created as blocking-sync
(``torch.cuda.Event(blocking=True)``, i.e. ``cudaEventBlockingSync``) that thread sleeps in the
driver instead of spinning, so a transfer of seconds costs no CPU and the loop keeps serving
other tasks.

Anything with ``synchronize()`` (blocking, GIL released) and ``query()`` (non-blocking) can be
waited for; that is what lets the CPU tests exercise the bridge (ordering, cancellation, errors,
shutdown) with waitables that complete when a test says so, and ``tests/gpu`` with real events.

Waits complete in submission order: a bridge serves one ordered queue of work, such as one
channel's CUDA stream, where a later event cannot complete before an earlier one. Waitables of
independent streams belong to separate bridges, or a slow one would hold back the rest.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol, Union

from .errors import EndpointClosedError, TransportError

__all__ = ["CompletionBridge", "CompletionError", "Posted", "Poster", "ThreadDone", "Waitable"]

log = logging.getLogger(__name__)


class Waitable(Protocol):
    """What a bridge waits for: a CUDA event, or anything else that completes on its own."""

    def query(self) -> bool:
        """True if already complete (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Block until complete (releasing the GIL); raise if the work it tracks failed."""
        ...


class CompletionError(TransportError):
    """The work a waitable tracks failed (for a CUDA event: the CUDA error that ``synchronize`` raised)."""


_Target = Union["asyncio.Future[None]", Callable[[BaseException | None], None]]


class CompletionBridge:
    """One thread that turns blocking waits into asyncio futures, in submission order.

    Create and use it from the event loop's thread; :meth:`close` may be called from any thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "transport-completion") -> None:
        self._loop = loop
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[tuple[Waitable, _Target]] = collections.deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def pending(self) -> int:
        """Waits submitted and not yet returned by the thread (including the one it is in)."""
        with self._cond:
            return len(self._queue)

    def wait(self, waitable: Waitable) -> asyncio.Future[None]:
        """A future that completes when ``waitable`` does (event loop thread; never blocks).

        An already complete waitable gives a finished future without a thread hand-off. The
        future fails with :class:`CompletionError` if ``synchronize`` raised, and with
        :class:`EndpointClosedError` if the bridge is closed first. Cancelling the future (or
        the task awaiting it) stops the waiting only: the thread still waits for the waitable
        before taking the next one, so that work queued later is never reported complete
        before it. Bound the wait with ``asyncio.timeout``; this call has no deadline of its own.
        """
        fut: asyncio.Future[None] = self._loop.create_future()
        with self._cond:
            if self._closed:
                fut.set_exception(EndpointClosedError("the completion bridge is closed"))
                return fut
            if not self._queue:
                try:
                    done = waitable.query()
                except Exception as exc:  # a failed CUDA event raises from query too
                    fut.set_exception(CompletionError(f"the awaited work failed: {exc}"))
                    return fut
                if done:
                    fut.set_result(None)
                    return fut
            self._queue.append((waitable, fut))
            self._cond.notify()
        return fut

    def notify(self, waitable: Waitable, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(None)`` once ``waitable`` completed, or ``callback(error)`` (any thread;
        never blocks). The callback runs on the bridge's thread, in submission order with every
        other wait (on the calling thread if the waitable is already complete and nothing is
        queued); it gets :class:`CompletionError` if the work failed and
        :class:`EndpointClosedError` if the bridge closed first. It must not block for long."""
        error: CompletionError | None = None
        with self._cond:
            closed = self._closed
            if not closed:
                done = False
                if not self._queue:
                    try:
                        done = waitable.query()
                    except Exception as exc:  # a failed CUDA event raises from query too
                        done, error = True, CompletionError(f"the awaited work failed: {exc}")
                if not done:
                    self._queue.append((waitable, callback))
                    self._cond.notify()
                    return
        _call(callback, EndpointClosedError("the completion bridge is closed") if closed else error)

    def close(self, timeout: float = 1.0) -> None:
        """Fail the waits not yet started and stop the thread (any thread; bounded by ``timeout``).

        The wait in progress, if any, cannot be interrupted (a hung GPU op keeps its thread, a
        daemon, until the process exits); its future fails with :class:`EndpointClosedError` now.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for _, target in dropped:
            self._resolve_soon(target, EndpointClosedError("the completion bridge was closed before the work completed"))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------- thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                waitable, target = self._queue[0]
            exc: BaseException | None = None
            try:
                waitable.synchronize()
            except Exception as e:  # the tracked work failed: that op fails, the bridge goes on
                exc = CompletionError(f"the awaited work failed: {e}")
            with self._cond:
                if self._queue and self._queue[0][1] is target:
                    self._queue.popleft()
                elif self._closed:  # close() already failed it
                    return
            self._resolve_soon(target, exc)

    def _resolve_soon(self, target: _Target, exc: BaseException | None) -> None:
        if not isinstance(target, asyncio.Future):
            _call(target, exc)
            return
        try:
            self._loop.call_soon_threadsafe(_resolve, target, exc)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


def _call(callback: Callable[[BaseException | None], None], exc: BaseException | None) -> None:
    try:
        callback(exc)
    except Exception:  # a callback's bug must not stop the bridge
        log.exception("a completion callback failed")


def _resolve(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():  # cancelled by its waiter
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


class ThreadDone:
    """A :class:`Waitable` that a worker thread completes: ``finished`` is set when the work is over,
    ``error`` first if it failed (the CPU engines' stand-in for a CUDA event)."""

    __slots__ = ("error", "finished")

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def query(self) -> bool:
        if not self.finished.is_set():
            return False
        if self.error is not None:
            raise RuntimeError(f"the operation failed: {self.error!r}")
        return True

    def synchronize(self) -> None:
        self.finished.wait()
        if self.error is not None:
            raise RuntimeError(f"the operation failed: {self.error!r}")


class Posted:
    """The :class:`~transport.completion.Waitable` :meth:`Poster.submit` returns: complete once its
    job has run on the poster's thread and what the job returned (a waitable: a CUDA event) is."""

    __slots__ = ("error", "ran", "waitable")

    def __init__(self) -> None:
        self.ran = threading.Event()
        self.waitable: Any = None
        self.error: BaseException | None = None

    def query(self) -> bool:
        if not self.ran.is_set():
            return False
        if self.error is not None:
            raise RuntimeError(f"posting the operation failed: {self.error!r}")
        return self.waitable is None or bool(self.waitable.query())

    def synchronize(self) -> None:
        self.ran.wait()
        if self.error is not None:
            raise RuntimeError(f"posting the operation failed: {self.error!r}")
        if self.waitable is not None:
            self.waitable.synchronize()


class Poster:
    """One thread that runs a link's posting jobs in submission order, so that the caller (the
    event loop) never waits for the library: NCCL's non-blocking group end returns
    ``ncclInProgress`` and is polled to completion here. A job returns the waitable of the work it
    queued (or None); a job that raises fails its :class:`Posted` and the ones after it still run
    (each fails on its own: after an abort the library refuses them)."""

    def __init__(self, name: str = "transport-link-post") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> Posted:
        """Queue ``job`` (any thread); returns at once."""
        posted = Posted()
        self._jobs.put((job, posted))
        return posted

    def close(self, timeout: float = 5.0) -> None:
        """Run what is queued, then stop the thread (waits at most ``timeout`` s; idempotent)."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, posted = item
            try:
                posted.waitable = job()
            except BaseException as exc:  # noqa: BLE001 - reported through the waitable
                posted.error = exc
            finally:
                posted.ran.set()
            del item, job, posted
