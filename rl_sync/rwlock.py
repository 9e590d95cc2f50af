"""A readers-writer lock shared by event-loop tasks and plain threads.

Readers are the application's ``hold()`` blocks (on the loop, or on any
thread for the blocking subscriber); the one writer is a commit. Writers are
preferred: once a commit waits, new readers wait behind it, so a stream of
readers cannot starve the weight update. Blocking waits take a timeout;
the asyncio side waits on a worker thread, so the loop never blocks.
"""

from __future__ import annotations

import asyncio
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

    def release_write(self) -> None:
        with self._cond:
            if not self._writer:
                raise RuntimeError("release_write without the writer")
            self._writer = False
            idle = self._readers == 0
            self._cond.notify_all()
        hook = self.on_idle
        if idle and hook is not None:
            hook()

    async def acquire_read_async(self, timeout: float | None = None) -> bool:
        if self.try_acquire_read():
            return True
        return await _in_thread(self.acquire_read, self.release_read, timeout)

    async def acquire_write_async(self, timeout: float | None = None) -> bool:
        if self.try_acquire_write():  # (no reader: the usual commit takes no worker thread)
            return True
        return await _in_thread(self.acquire_write, self.release_write, timeout)

    @property
    def readers(self) -> int:
        return self._readers


async def _in_thread(acquire, release, timeout: float | None) -> bool:  # type: ignore[no-untyped-def]
    """Wait on a worker thread; if the waiting task is cancelled, a late acquisition is released."""
    fut = asyncio.ensure_future(asyncio.to_thread(acquire, timeout))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(lambda f: release() if not f.cancelled() and f.exception() is None and f.result() else None)
        raise
