"""A readers-writer lock shared by event-loop tasks and plain threads.

Readers are the application's ``hold()`` blocks (on the loop, or on any
thread for the blocking subscriber); the one writer is a commit. Writers are
preferred: once a commit waits, new readers wait behind it, so a stream of
readers cannot starve the weight update. Blocking waits take a timeout.
The asyncio side waits on a future of its own loop, woken (thread-safely)
whenever the lock changes hands: it never parks on a worker thread, so any
number of tasks queued behind a commit cannot take the loop's default
executor from the copies that commit (and the pulls' shm copies) run on.
A waiting writer whose commit can no longer apply (``abandoned``) leaves
the queue as soon as :meth:`RWLock.wake` is called, letting readers in.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

__all__ = ["RWLock"]


class RWLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        # tasks waiting in acquire_*_async: their loop and a future set (thread-safely) at every change
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        # called (outside the lock, in the releasing thread) when the last reader or the writer leaves
        self.on_idle: Callable[[], None] | None = None

    def try_acquire_read(self) -> bool:
        with self._cond:
            if self._writer or self._writers_waiting:
                return False
            self._readers += 1
            return True

    def acquire_read(self, timeout: float | None = None) -> bool:
        """Blocks until no writer holds or waits for the lock; False at the timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._writer or self._writers_waiting:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            self._readers += 1
            return True

    def release_read(self) -> None:
        with self._cond:
            if self._readers <= 0:
                raise RuntimeError("release_read without a reader")
            self._readers -= 1
            idle = self._readers == 0
            if idle:
                self._cond.notify_all()
                self._wake()
        hook = self.on_idle
        if idle and hook is not None:
            hook()

    def try_acquire_write(self) -> bool:
        """Take the write lock if nobody holds the lock (no reader, no writer); never waits."""
        with self._cond:
            if self._writer or self._readers:
                return False
            self._writer = True
            return True

    def acquire_write(self, timeout: float | None = None) -> bool:
        """Blocks until every reader has left; False at the timeout (the lock is then not held)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                self._writer = True
                return True
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()
                self._wake()

    def release_write(self) -> None:
        with self._cond:
            if not self._writer:
                raise RuntimeError("release_write without the writer")
            self._writer = False
            idle = self._readers == 0
            self._cond.notify_all()
            self._wake()
        hook = self.on_idle
        if idle and hook is not None:
            hook()

    def wake(self) -> None:
        """Wake every task waiting in an ``acquire_*_async`` to check again (a writer's
        ``abandoned`` turned true: it leaves the queue). Any thread."""
        with self._cond:
            self._wake()

    def _wake(self) -> None:
        """With ``_cond`` held: wake every task waiting in an ``acquire_*_async`` (it checks again)."""
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # (its loop is closed: nobody waits there any more)
                pass

    async def _wait_async(self, take: Callable[[], bool], timeout: float | None, writer: bool,
                          abandoned: Callable[[], bool] | None = None) -> bool:
        """Take the lock with ``take()`` (under ``_cond``; True: had) as soon as it can, waiting on
        this loop (no thread) up to ``timeout``, or until ``abandoned()`` (checked at every wake-up);
        a cancelled, timed-out or abandoned wait holds nothing."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = False
        try:
            while True:
                with self._cond:
                    if writer and not waiting:
                        self._writers_waiting += 1  # (new readers queue behind this writer from now on)
                        waiting = True
                    if abandoned is not None and abandoned():
                        return False
                    if take():
                        return True
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    fut: asyncio.Future[None] = loop.create_future()
                    self._waiters.append((loop, fut))
                try:
                    async with asyncio.timeout(left):
                        await fut
                except TimeoutError:
                    pass
                finally:
                    if not fut.done():
                        with self._cond, contextlib.suppress(ValueError):
                            self._waiters.remove((loop, fut))
        finally:
            if waiting:
                with self._cond:
                    self._writers_waiting -= 1
                    self._cond.notify_all()
                    self._wake()

    def _take_read(self) -> bool:
        if self._writer or self._writers_waiting:
            return False
        self._readers += 1
        return True

    def _take_write_waiting(self) -> bool:  # (this writer is counted in _writers_waiting)
        if self._writer or self._readers:
            return False
        self._writer = True
        return True

    async def acquire_read_async(self, timeout: float | None = None) -> bool:
        if self.try_acquire_read():
            return True
        return await self._wait_async(self._take_read, timeout, writer=False)

    async def acquire_write_async(self, timeout: float | None = None,
                                  abandoned: Callable[[], bool] | None = None) -> bool:
        """Take the write lock, waiting up to ``timeout``; False at the timeout, or at once when
        ``abandoned()`` is true (checked first and whenever :meth:`wake` or a change of hands wakes
        the wait): a writer that can no longer use the lock stops keeping new readers out."""
        if abandoned is not None and abandoned():
            return False
        if self.try_acquire_write():  # (no reader: the usual commit waits for nothing)
            return True
        return await self._wait_async(self._take_write_waiting, timeout, writer=True, abandoned=abandoned)

    @property
    def readers(self) -> int:
        return self._readers


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
