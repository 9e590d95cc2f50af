"""``shm`` without a round trip: a table of export words in shared memory, guarded by byte-range locks.

Once an shm put's copy into the peer's segment is done the bytes are in the peer's memory, so a
put without a notification, and a get, need no message at all, provided the initiator can tell,
by itself, that the buffer it copies into (or out of) is still the one the peer registered, and
the peer cannot take the buffer back in the middle of the copy. Both come from one small memfd
per target endpoint, its *slot table*:

- Every shm export of the target gets a slot: an 8-byte word that holds the export's id while
  the export is live and 0 once it is revoked (export ids are never reused, so a recycled slot
  never passes for an old export). The table's ``/proc/<pid>/fd`` path, inode and the slot travel
  in the export's :class:`~transport.wire.ShmHandle`.
- The initiator takes a shared open-file-description lock (``F_OFD_SETLK``, ``F_RDLCK``) on the
  slot's 8 bytes, checks that the word is the export id it was told, copies, checks the word
  again and that the table's owner has not exited (a pidfd, opened with the table: a peer
  killed before its channel read the EOF still has its memory kept by our mapping; the op
  then fails with :class:`~transport.errors.PeerLostError`), and unlocks. A lock it cannot get at once means the target is revoking the export right
  now: the op fails with :class:`~transport.errors.StaleBufferError` (the endpoint refreshes its
  copy of the peer's registry and retries once, as for a stale header).
- The target revokes an export (unregister, re-register, close) by or-ing :data:`REVOKING` into
  the word (no op enters from then on: it sees another word and fails stale; the second check of
  a copy in flight accepts the mark, since the target waits for it), taking the exclusive lock on
  the slot (polled, bounded by :data:`REVOKE_WAIT_S`), zeroing the word and unlocking, before it
  moves or drops the tensor. A copy that holds the shared lock therefore lands before the target
  takes the buffer back; one that starts later sees the mark or 0 and fails. (Without the mark, a
  process whose threads put into the slot back to back kept the shared lock held.) If the lock cannot be had within
  the bound (an initiator frozen mid-copy), the word is zeroed anyway (logged): that initiator's
  second check then fails its op, so it is never reported done while its bytes are lost.

Locks are counted per slot within a process (several ops of one process on one slot share one
lock of the table's open file description, which the last of them releases). The kernel drops
the locks of a process that dies. Blocking: the initiator's calls never wait (one syscall each);
:meth:`SlotTable.revoke` may wait up to :data:`REVOKE_WAIT_S` on the thread that unregisters.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import select
import struct
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..errors import BufferMismatchError, PeerLostError, StaleBufferError

__all__ = ["MOVED", "REVOKE_WAIT_S", "SLOTS", "ExportSlots", "SlotTable", "TableView", "new_slot_table", "ofd_locks_work",
           "one_sided_feature"]

log = logging.getLogger(__name__)

SLOTS = 1 << 16  # words per table (512 KiB of sparse memfd; a page appears when its first slot is used)
REVOKE_WAIT_S = 2.0  # how long a revoke waits for the copies in flight on its export
MOVED = 1 << 63  # or-ed into a word: the owner re-pointed the registered tensor (ops fail: re-register it)
# or-ed into a word by a revoke before it waits for the exclusive lock: no new op enters (stale), so a stream of
# peers' ops cannot keep the shared lock held until the bound; a copy already in flight still finishes (done)
REVOKING = 1 << 62
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_WORD = struct.Struct("<Q")  # a slot's word, read in place from the mapped table
_FLOCK = "hhqqi4x"  # struct flock on Linux x86-64 and aarch64: type, whence, start, len, pid (0 for OFD locks)


def _lock(fd: int, kind: int, slot: int, count: int = 1) -> bool:
    """Take (``F_UNLCK``: release) the OFD lock on ``count`` slots' words from ``slot`` on, without waiting;
    False if another open file description holds a conflicting lock on one (none is taken then)."""
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, slot * 8, 8 * count, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """Sorted slots (without repeats) as runs of consecutive slots: ``(first, count)`` each."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


def ofd_locks_work() -> tuple[bool, str]:
    """Whether this kernel has open-file-description locks on a memfd (Linux >= 3.15), and why."""
    if not hasattr(os, "memfd_create"):
        return False, "no memfd_create"
    fd = os.memfd_create("transport:ofd-probe", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 8)
        other = os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            if not _lock(other, fcntl.F_RDLCK, 0):
                return False, "a shared OFD lock on a fresh memfd was refused"
            if _lock(fd, fcntl.F_WRLCK, 0):
                return False, "OFD locks of two open file descriptions did not conflict"
            return True, "OFD byte-range locks on memfd work"
        finally:
            os.close(other)
    except OSError as exc:
        return False, f"OFD locks unavailable: {exc}"
    finally:
        os.close(fd)


def one_sided_feature() -> dict[str, tuple[bool, str]]:
    """The ``one_sided`` feature of a plane whose ops lock words of a slot table (``shm``,
    ``cuda_ipc``), as :meth:`~transport.planes.base.DataPlane.features` reports it."""
    ok, why = ofd_locks_work()
    return {"one_sided": (ok, f"puts without a notification, and gets, need no round trip ({why})" if ok else
                          f"every put and get keeps its round trip: {why}")}


_NO_PIDFD: list[str] = []  # why pidfds are missing here (logged once)


def _pidfd_of(pid: int) -> int:
    """A pidfd of ``pid`` (-1 where pidfds are missing: logged once). :class:`PeerLostError` if
    the process is gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError as exc:
        raise PeerLostError(f"the peer's process {pid} has exited") from exc
    except (AttributeError, OSError) as exc:
        if not _NO_PIDFD:
            _NO_PIDFD.append(str(exc))
            log.warning("no pidfd here (%s): a one-sided op into a peer that died before its channel noticed "
                        "can be reported done", exc)
        return -1


_PROBE: tuple[bool, str] | None = None


def _probe() -> tuple[bool, str]:
    global _PROBE
    if _PROBE is None:
        _PROBE = ofd_locks_work()
        if not _PROBE[0]:
            log.info("shm: puts and gets keep their round trip: %s", _PROBE[1])
    return _PROBE


class SlotTable:
    """Target side: this endpoint's table of export words (made at the first shm export).
    Methods are called on the endpoint's event loop thread."""

    def __init__(self, plane: str = "shm") -> None:
        self.plane = plane  # (the plane named in its warnings)
        self.fd = os.memfd_create("transport:slots", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, SLOTS * 8)
            self._mm = mmap.mmap(self.fd, SLOTS * 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.inode = os.fstat(self.fd).st_ino
        self.pid = os.getpid()
        self._free: list[int] = []
        self._next = 1  # slot 0 is never handed out (a zero slot field reads as "no slot")
        # memory of exports revoked while a peer's copy still held their slot (a frozen peer): that copy may
        # still write there, so a buffer exported over it waits for the slot to be let go (wait_clear):
        # (what memory (the exporter's key), start, end, slot)
        self._tainted: list[tuple[Any, int, int, int]] = []

    @staticmethod
    def usable() -> bool:
        return _probe()[0]

    def alloc(self, export_id: int) -> int:
        """A slot holding ``export_id`` (live), or -1 when the table is full (then the round trip)."""
        if self._free:
            slot = self._free.pop()
        elif self._next < SLOTS:
            slot = self._next
            self._next += 1
        else:
            return -1
        struct.pack_into("<Q", self._mm, slot * 8, export_id)
        return slot

    def mark_moved(self, slot: int, export_id: int, name: str) -> None:
        """The export's tensor was re-pointed: peers' later ops on it fail with
        :class:`~transport.errors.BufferMismatchError` (until it is revoked). Blocking like :meth:`revoke`."""
        self._write(slot, export_id | MOVED, name, True)

    def revoke(self, slot: int, name: str, wait: bool = True, memory: tuple[Any, int, int] | None = None) -> bool:
        """Revoke the export in ``slot``: wait (bounded; not at all without ``wait``) for the copies
        in flight on it, zero its word, and free the slot. Blocking, up to :data:`REVOKE_WAIT_S`.
        False if a peer's copy still held the slot then (a frozen peer: its copy may still write
        the buffer's old memory): the slot stays out of use until :meth:`still_held` finds it
        let go, and ``memory`` (the exporter's ``(key, start, end)`` of the export's bytes, if it
        may be exported again) is marked: :meth:`wait_clear` holds back an export over it."""
        if wait and self.fd >= 0:  # (the owner's own word: no lock needed to mark it)
            word = _WORD.unpack_from(self._mm, slot * 8)[0]
            struct.pack_into("<Q", self._mm, slot * 8, word | REVOKING)
        if self._write(slot, 0, name, wait) or self.fd < 0:
            self._free.append(slot)
            return True
        if memory is not None and wait:
            self._tainted.append((*memory, slot))
        return False

    def wait_clear(self, key: Any, start: int, end: int, name: str) -> None:
        """Before exporting bytes ``[start, end)`` of memory ``key``: wait (bounded by
        :data:`REVOKE_WAIT_S`; polled) for the frozen peers' copies that may still write there
        (:meth:`revoke`) to let their slots go; :class:`BufferMismatchError` if one has not.
        Returns at once when nothing is marked."""
        if not self._tainted:
            return
        deadline = time.monotonic() + REVOKE_WAIT_S
        delay = 1e-3
        while True:
            self._tainted = [m for m in self._tainted if self.still_held(m[3])]
            over = [(a, b) for k, a, b, _ in self._tainted if k == key and a < end and start < b]
            if not over:
                return
            if time.monotonic() >= deadline:
                raise BufferMismatchError(
                    f"buffer {name!r} lies over memory ({self.plane}, bytes {over[0]}) where a buffer was unregistered "
                    "while a peer's copy into or out of it still ran (a frozen peer?): that copy could still write "
                    "it. Register it again later, or elsewhere")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def still_held(self, slot: int) -> bool:
        """Whether a peer's copy still holds ``slot`` (revoked while it did); once let go, the slot is free."""
        if self.fd < 0 or slot in self._free:
            return False
        if not _lock(self.fd, fcntl.F_WRLCK, slot):
            return True
        _lock(self.fd, fcntl.F_UNLCK, slot)
        self._free.append(slot)
        return False

    def _write(self, slot: int, word: int, name: str, wait: bool) -> bool:
        if self.fd < 0:
            return True
        deadline = time.monotonic() + (REVOKE_WAIT_S if wait else 0.0)
        delay = 20e-6
        locked = _lock(self.fd, fcntl.F_WRLCK, slot)
        while not locked and time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)
            locked = _lock(self.fd, fcntl.F_WRLCK, slot)
        struct.pack_into("<Q", self._mm, slot * 8, word)
        if locked:
            _lock(self.fd, fcntl.F_UNLCK, slot)
        elif wait:
            log.warning("%s: a peer's copy into or out of %r still held it after %.1f s (a frozen peer?); the "
                        "buffer was taken back anyway, and that peer's op fails", self.plane, name, REVOKE_WAIT_S)
        return locked

    def close(self) -> None:
        if self.fd >= 0:
            for slot in range(1, self._next):  # every word 0: no later op of a peer passes its check
                struct.pack_into("<Q", self._mm, slot * 8, 0)
            os.close(self.fd)
            self.fd = -1


def new_slot_table(plane: str = "shm") -> SlotTable | None:
    """A slot table for an endpoint's exports over ``plane``, or None where this kernel has no OFD
    locks on a memfd (logged once: every op then keeps its round trip)."""
    return SlotTable(plane) if SlotTable.usable() else None


class ExportSlots:
    """One exporter's slot table, made at its first export (:meth:`table`), and the marking of re-pointed
    exports (:meth:`mark_re_pointed`): what ``shm``'s and ``cuda_ipc``'s exporters share. Event loop thread."""

    def __init__(self, plane: str) -> None:
        self.plane = plane  # the exports' key in ``LocalBuffer.exports`` (and the plane its warnings name)
        self.made: SlotTable | None = None  # (None: not made yet, or OFD locks are missing)
        self._tried = False

    def table(self) -> SlotTable | None:
        """The table (made at the first call; None where OFD locks are missing)."""
        if not self._tried:
            self._tried = True
            self.made = new_slot_table(self.plane)
        return self.made

    def mark_re_pointed(self, endpoint: str, bufs: Iterable[Any]) -> None:
        """Registered tensors re-pointed at other memory since their export (``module.to()``,
        ``t.data =``): peers' one-sided ops carry no header for the owner to check, so each such
        export's slot is marked once (a warning says so), and peers' later ops on it fail with
        :class:`~transport.errors.BufferMismatchError`, as a header op's would. Blocking like
        :meth:`SlotTable.mark_moved`."""
        table = self.made
        if table is None:
            return
        for buf in bufs:
            exp = buf.exports.get(self.plane)
            if exp is None or not exp.handle.slot or exp.moved_marked or buf.moved() is None:
                continue
            exp.moved_marked = True
            table.mark_moved(exp.handle.slot, exp.handle.export_id, buf.spec.name)
            log.warning("endpoint %r: buffer %r was re-pointed at other memory after it was registered: peers' %s "
                        "ops on it fail from now on (re-register it)", endpoint, buf.spec.name, self.plane)

    def close(self) -> None:
        """Every word 0: no peer's later one-sided op passes its check."""
        if self.made is not None:
            self.made.close()


class TableView:
    """Initiator side: a peer's slot table, mapped read-only, with this process's locks on it.
    Thread-safe."""

    def __init__(self, pid: int, fd: int, inode: int, plane: str = "shm") -> None:
        self.plane = plane  # (the plane named in errors)
        self.fd = self._pidfd = -1
        # the owner's pidfd, opened before its table: once the table's inode is checked, the pidfd is
        # known to be that of the process that owns it (not of a later one given the same pid)
        self._pidfd = _pidfd_of(pid)
        self._poll = select.poll()
        if self._pidfd >= 0:
            self._poll.register(self._pidfd, select.POLLIN)
        path = f"/proc/{pid}/fd/{fd}"
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            self._close_pidfd()
            raise StaleBufferError(f"{self.plane}: cannot open the peer's slot table {path}: {exc}") from exc
        try:
            st = os.fstat(self.fd)
            if st.st_ino != inode or st.st_size < SLOTS * 8:  # (a short file would SIGBUS a read past its end)
                raise StaleBufferError(f"{self.plane}: {path} is not the peer's slot table (inode {st.st_ino}, "
                                       f"{st.st_size} bytes)")
            self._mm = mmap.mmap(self.fd, SLOTS * 8, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(self.fd)
            self._close_pidfd()
            raise
        self.inode = inode
        self._held: dict[int, int] = {}  # slot -> ops of this process holding its shared lock
        self._lock = threading.Lock()
        self._closing = False  # close() was called: the last op to leave closes the table (_shut)

    def enter(self, slots: list[tuple[int, int]], names: list[str]) -> None:
        """Lock every ``(slot, export_id)`` shared and check its word; all or nothing. Raises
        :class:`StaleBufferError` if one is being revoked or no longer holds that export, and
        :class:`BufferMismatchError` if its owner re-pointed the tensor (``names``: the buffers').
        The slots this process does not hold yet are locked a run of consecutive slots per
        system call (a state dict registered in order has its slots in one run). Every lock is
        taken before any word is read, so an op with one slot being revoked and another re-pointed
        raises :class:`StaleBufferError` (the caller re-reads the registry, then sees the mismatch)."""
        with self._lock:
            if self.fd < 0 or self._closing:
                raise PeerLostError(f"{self.plane}: the channel to the peer is closed")
            held = self._held
            taken: list[tuple[int, int]] = []
            try:
                for start, count in _runs(sorted({slot for slot, _ in slots if not held.get(slot)})):
                    if not _lock(self.fd, fcntl.F_RDLCK, start, count):
                        raise StaleBufferError(f"{self.plane}: the peer is taking the buffer back (unregister or "
                                               "re-register)")
                    taken.append((start, count))
            except BaseException:
                for run in taken:
                    _lock(self.fd, fcntl.F_UNLCK, *run)
                raise
            for slot, _ in slots:
                held[slot] = held.get(slot, 0) + 1
        for (slot, export_id), name in zip(slots, names, strict=True):
            word = _WORD.unpack_from(self._mm, slot * 8)[0]
            if word != export_id:
                self.leave([s for s, _ in slots])
                if word == export_id | MOVED:
                    raise BufferMismatchError(f"buffer {name!r} was re-pointed at other memory since it was "
                                              "registered; re-register it")
                raise StaleBufferError(f"{self.plane}: export {export_id} was revoked by the peer (unregistered or "
                                       "re-registered)")

    def enter1(self, slot: int, export_id: int, name: str) -> None:
        """:meth:`enter` for one slot (the common case, without the lists)."""
        with self._lock:
            if self.fd < 0 or self._closing:
                raise PeerLostError(f"{self.plane}: the channel to the peer is closed")
            n = self._held.get(slot, 0)
            if n == 0 and not _lock(self.fd, fcntl.F_RDLCK, slot):
                raise StaleBufferError(f"{self.plane}: the peer is taking the buffer back (unregister or re-register)")
            self._held[slot] = n + 1
        word = _WORD.unpack_from(self._mm, slot * 8)[0]
        if word != export_id:
            self.leave1(slot)
            if word == export_id | MOVED:
                raise BufferMismatchError(f"buffer {name!r} was re-pointed at other memory since it was "
                                          "registered; re-register it")
            raise StaleBufferError(f"{self.plane}: export {export_id} was revoked by the peer (unregistered or "
                                   "re-registered)")

    def check(self, slots: list[tuple[int, int]], wrote: bool = False) -> None:
        """With the locks held, after the copy: every word still holds its export (else the peer
        took the buffer back without waiting for us: :class:`StaleBufferError`; ``wrote``: the
        copy wrote the peer's memory, so its bytes may have gone to memory the peer reused, and
        the error says the op must not be retried: ``retry_safe`` False), and the peer's process
        has not exited (:meth:`owner_exited`; else :class:`PeerLostError`: it died before its
        channel noticed, and its memory, kept by our mapping, is nobody's)."""
        for slot, export_id in slots:
            self._check_word(slot, export_id, wrote)
        self._check_owner()

    def check1(self, slot: int, export_id: int, wrote: bool = False) -> None:
        """:meth:`check` for one slot."""
        self._check_word(slot, export_id, wrote)
        self._check_owner()

    def _check_word(self, slot: int, export_id: int, wrote: bool) -> None:
        # (REVOKING: the owner waits for this copy before it takes the buffer back: the copy landed in time)
        if _WORD.unpack_from(self._mm, slot * 8)[0] & ~REVOKING != export_id:
            exc = StaleBufferError(f"{self.plane}: export {export_id} was taken back by the peer while the copy ran "
                                   "(the peer did not wait for it: frozen or slow here)"
                                   + ("; the put is not retried: its bytes may have reached memory the peer reused"
                                      if wrote else ""))
            exc.retry_safe = not wrote
            raise exc

    def _check_owner(self) -> None:
        if self.owner_exited():
            raise PeerLostError(f"{self.plane}: the peer's process has exited (before its channel noticed): the "
                                "op's bytes went nowhere")

    def leave(self, slots: list[int]) -> None:
        """Drop this op's hold of each slot's shared lock (the last holder in this process unlocks;
        a run of consecutive slots per system call)."""
        with self._lock:
            held = self._held
            free: list[int] = []
            for slot in slots:
                n = held.get(slot, 0) - 1
                if n > 0:
                    held[slot] = n
                else:
                    held.pop(slot, None)
                    free.append(slot)
            if self.fd >= 0:
                for run in _runs(sorted(free)):
                    _lock(self.fd, fcntl.F_UNLCK, *run)
            if self._closing and not held:
                self._shut()

    def leave1(self, slot: int) -> None:
        """Drop this op's hold of ``slot``'s shared lock (the last holder in this process unlocks)."""
        with self._lock:
            n = self._held.get(slot, 0) - 1
            if n > 0:
                self._held[slot] = n
                return
            self._held.pop(slot, None)
            if self.fd >= 0:
                _lock(self.fd, fcntl.F_UNLCK, slot)
            if self._closing and not self._held:
                self._shut()

    def owner_exited(self) -> bool:
        """Whether the process that owns the table has exited (its pidfd is readable): called after
        a copy, so that an op into (or out of) the memory of a peer that died before the channel
        noticed is not reported done. False where pidfds are missing (Linux < 5.3, or refused by a
        seccomp filter: logged once; a peer's death is then seen by the channel only). Never
        waits (one ``poll`` with no timeout)."""
        with self._lock:  # (one poll() at a time per poll object; close() cannot close the pidfd under it)
            return self._pidfd >= 0 and bool(self._poll.poll(0))

    def _close_pidfd(self) -> None:
        fd, self._pidfd = self._pidfd, -1
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        """No new op; the table (its locks) closes once the last op left: a copy in flight keeps its slot."""
        with self._lock:
            self._closing = True
            if not self._held:
                self._shut()

    def _shut(self) -> None:  # (under _lock) the mapping holds a duplicate of the descriptor: both go, so do the locks
        if self.fd >= 0:
            self._mm.close()
            os.close(self.fd)
            self.fd = -1
        self._close_pidfd()

    def __del__(self) -> None:  # (a view dropped without close(): its descriptors go with it)
        for attr in ("fd", "_pidfd"):
            fd = getattr(self, attr, -1)
            setattr(self, attr, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
