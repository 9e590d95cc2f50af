"""The readers' side of a :class:`~rl_sync.WeightSubscriber`: :meth:`~Holding.hold` (the
weights do not change inside it) and waiting for a version to be committed.

:class:`Holding` is a base of the subscriber: it takes the read side of the subscriber's lock and
reads its version and torn state; the subscriber's serving and its commit mode change them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from .device import ReaderMarks
from .errors import CommitTimeoutError, RlSyncError
from .rwlock import RWLock

__all__ = ["Holding"]


class Holding:
    """``hold()``, ``hold_blocking()`` and ``wait_for_version[_blocking]()`` of a subscriber."""

    _lock: RWLock  # readers hold its read side; a commit (direct: a whole push) its write side
    _readers: ReaderMarks  # GPU: where readers left hold()
    _version: int
    _version_cond: threading.Condition  # notified when the version changes, torn heals, or at close
    _torn: bool
    _closed: bool

    async def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Wait until a version >= ``version`` is committed; return the committed version.

        Raises :class:`rl_sync.CommitTimeoutError` (a
        :class:`transport.TransportTimeoutError`, phase ``"commit"``) at the
        deadline; ``timeout=None`` waits as long as it takes. Cancelling it
        only stops the wait.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._version < version:
            if deadline is not None and time.monotonic() >= deadline:
                raise CommitTimeoutError(
                    f"version {version} was not committed within {timeout} s (holding {self._version})")
            await asyncio.sleep(0.005)
        return self._version

    def wait_for_version_blocking(self, version: int, timeout: float | None = None) -> int:
        """:meth:`wait_for_version` for a thread that is not the event loop's."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._version_cond:
            while self._version < version:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CommitTimeoutError(
                        f"version {version} was not committed within {timeout} s (holding {self._version})")
                self._version_cond.wait(left)
            return self._version

    @contextlib.asynccontextmanager
    async def hold(self, timeout: float | None = None, *, streams: Sequence[Any] = ()) -> AsyncIterator[int]:
        """Keep the weights from changing inside the block; yields the version held.

        Many holders may overlap; a commit waits until all have left, and
        holders that arrive while a commit waits queue behind it. Raises
        :class:`rl_sync.CommitTimeoutError` (a :class:`transport.TransportTimeoutError`)
        if the lock is not had within ``timeout``. Direct mode: while the weights are torn (a push
        failed after writing them) it waits for the next commit, and raises
        :class:`rl_sync.RlSyncError` if the subscriber is closed meanwhile.

        Weights on a GPU: the GPU work queued inside the block on this
        thread's current stream, and on each of ``streams`` (side streams, a
        stream a CUDA graph is replayed on), is part of the read: leaving the
        block records an event on each of them, and a commit (or a swap or
        direct push's Begin) waits until those events are done before it
        overwrites or re-points what the work reads (bounded by
        ``commit_timeout``; past it the commit fails and nothing changes).
        Work queued after a commit returned sees the new version on any
        stream: the commit's own copies are done before it lets readers in.
        Queue GPU work that reads the weights only inside the block, or on a
        stream named here. Swap and direct re-point the tensors (direct: at
        the first push), so a CUDA graph captured before a re-point keeps
        reading the old memory: capture graphs over staged weights, or after
        a direct subscriber's first commit.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not await self._lock.acquire_read_async(left):
                raise CommitTimeoutError(f"hold() waited {timeout} s for a commit to finish")
            if self._readable():
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise CommitTimeoutError(
                    f"hold() waited {timeout} s: the weights are torn by a failed direct push")
            await asyncio.sleep(0.005)
        try:
            yield self._version
        finally:
            try:
                self._readers.leave(streams)
            finally:
                self._lock.release_read()

    def _readable(self) -> bool:
        """With the read lock had: True if the weights may be read (keep the lock); else (torn by a
        failed direct push) give the lock back and return False, or raise if closed."""
        if not self._torn:
            return True
        self._lock.release_read()
        if self._closed:
            raise RlSyncError("the subscriber is closed and its weights are torn by a failed direct push")
        return False

    @contextlib.contextmanager
    def hold_blocking(self, timeout: float | None = None, *, streams: Sequence[Any] = ()) -> Any:
        """:meth:`hold` for a thread that is not the event loop's (``streams`` likewise)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._lock.acquire_read(left):
                raise CommitTimeoutError(f"hold() waited {timeout} s for a commit to finish")
            if self._readable():
                break
            with self._version_cond:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CommitTimeoutError(
                        f"hold() waited {timeout} s: the weights are torn by a failed direct push")
                if self._torn and not self._closed:
                    self._version_cond.wait(left)
        try:
            yield self._version
        finally:
            try:
                self._readers.leave(streams)
            finally:
                self._lock.release_read()
