"""What one ``cuda_ipc`` op or mapped view holds while it lasts (:mod:`transport.planes.cuda_ipc`):
a batch of copies on one queue (:class:`Batch`), a one-sided op's locks on the peer's export
words (:class:`SlotGuard`, from the channel's :class:`PeerSlots`), and a mapped view's hold on
the peer's allocation (:class:`Held`). Each gives back what it holds exactly once, on whichever
thread is first to notice."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from ..errors import PeerLostError, StaleBufferError
from ..wire import IpcHandle
from .shm_slots import SLOTS, TableView

__all__ = ["Batch", "Held", "PeerSlots", "SlotGuard"]

log = logging.getLogger("transport.planes.cuda_ipc")


class Batch:
    """The copies of one op on one queue: a Waitable that, once they completed (or failed),
    gives the mappings and exports back exactly once, whoever notices first (the bridge's
    thread, the loop, or the plane's close)."""

    __slots__ = ("_done", "_finish", "_lock", "_over", "waitable")

    def __init__(self, waitable: Any, finish: Any) -> None:
        self.waitable = waitable
        self._finish = finish
        self._lock = threading.Lock()
        self._over = False

    def query(self) -> bool:
        try:
            done = bool(self.waitable.query())
        except Exception:
            self.finish()
            raise
        if done:
            self.finish()
        return done

    def synchronize(self) -> None:
        try:
            self.waitable.synchronize()
        finally:
            self.finish()

    def finish(self) -> None:
        with self._lock:
            if self._over:
                return
            self._over = True
        self._finish()


class SlotGuard:
    """One one-sided op's shared locks on the peer's export words: taken (and checked) before its
    copies are issued; checked again and released exactly once when the last of its copies is
    over (:meth:`over`, on whichever thread notices, before the op's waiter resumes) or when
    nothing was issued. ``stale``: the second check's failure (the export taken back, or the peer's
    process gone: :meth:`TableView.check`), raised by the op (``wrote``: the
    copies wrote the peer's memory: a put; then that error says it must not be retried)."""

    __slots__ = ("_done", "_lock", "slots", "stale", "view", "wrote")

    def __init__(self, view: TableView, slots: list[tuple[int, int]], names: list[str], wrote: bool = False) -> None:
        view.enter(slots, names)  # raises StaleBufferError / BufferMismatchError: nothing held then
        self.view, self.slots, self.wrote = view, slots, wrote
        self.stale: StaleBufferError | PeerLostError | None = None
        self._lock = threading.Lock()
        self._done = False

    def over(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        try:
            self.view.check(self.slots, self.wrote)
        except (StaleBufferError, PeerLostError) as exc:
            self.stale = exc
        finally:
            self.view.leave([s for s, _ in self.slots])


class PeerSlots:
    """One channel's view of the peer's slot tables (by inode), each with a pidfd of its owner
    (:meth:`TableView.owner_exited`).
    Thread-safe."""

    def __init__(self, plane: str, peer: str) -> None:
        self.plane, self.peer = plane, peer
        self._tables: dict[int, TableView] = {}
        self._unusable: set[int] = set()  # tables this process cannot open: their ops keep the header
        self._lock = threading.Lock()
        self._closed = False

    def guard(self, names: list[str], used: Sequence[IpcHandle], wrote: bool = False) -> SlotGuard | None:
        """The shared locks of every export's word, taken and checked (raises
        :class:`~transport.errors.StaleBufferError` or :class:`~transport.errors.BufferMismatchError`
        if one does not hold its export); None if an export has no word, they are in several
        tables, or the table cannot be opened here."""
        inode = used[0].table_inode
        if not all(0 < h.slot < SLOTS and h.pid > 0 and h.table_inode == inode for h in used):
            return None
        view = self._table(used[0])
        if view is None:
            return None
        return SlotGuard(view, [(h.slot, h.export_id) for h in used], names, wrote)

    def _table(self, h: IpcHandle) -> TableView | None:
        """The table, opened at first use (an open and an mmap). None if it cannot be opened
        (another user, a process that is not dumpable, an LSM: /proc/<pid>/fd is refused):
        cuda_ipc, unlike shm, works without it, so that table's ops keep their header (logged once)."""
        with self._lock:
            view = self._tables.get(h.table_inode)
            if view is not None or h.table_inode in self._unusable:
                return view
        try:
            view = TableView(h.pid, h.table_fd, h.table_inode, self.plane)
        except StaleBufferError as exc:
            with self._lock:
                self._unusable.add(h.table_inode)
            log.warning("%s: the slot table of %r cannot be opened (%s): puts and gets to it keep their round trip",
                        self.plane, self.peer, exc)
            return None
        with self._lock:
            have = self._tables.get(h.table_inode)
            if self._closed or have is not None:  # (closed meanwhile, or another op opened it first)
                view.close()
                if have is None:
                    raise PeerLostError(f"channel to {self.peer!r} is closed")
                return have
            self._tables[h.table_inode] = view
        return view

    def close(self) -> None:
        """Close every table (this process's locks on it, and its owner's pidfd, go with it)."""
        with self._lock:
            self._closed = True
            tables, self._tables = list(self._tables.values()), {}
        for view in tables:
            view.close()


class _Mappings(Protocol):
    def release(self, handle: IpcHandle) -> None: ...


class _Plane(Protocol):
    """What :class:`Held` needs of the plane: its mapping cache, and leaving an export."""

    @property
    def cache(self) -> _Mappings: ...

    def _leave(self, handles: Sequence[IpcHandle]) -> None: ...


class Held:
    """A mapped view's hold on the peer's allocation and export: given back (mapping use count,
    export busy count, so ``Unmapped`` may go out) when the last tensor over it dies, on the
    thread that drops it."""

    __slots__ = ("_handle", "_plane", "__weakref__")

    def __init__(self, plane: _Plane, handle: IpcHandle) -> None:
        self._plane: _Plane | None = plane
        self._handle = handle

    def drop(self) -> None:
        plane, self._plane = self._plane, None
        if plane is not None:
            try:
                plane.cache.release(self._handle)
            finally:
                plane._leave([self._handle])

    def __del__(self) -> None:
        try:
            self.drop()
        except Exception:  # noqa: BLE001 - at interpreter exit, or a failed unmap (logged by the cache)
            pass
