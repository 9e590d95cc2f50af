"""Shared weight banks: subscribers on the publisher's host read the publisher's memory, no copy.

Theory of operation (``WeightSubscriber(..., mode="shared")``):

* The publisher keeps ``shared_banks`` *banks* per layout (default 2), each a
  full copy of the subscribers' arenas, registered on its endpoint, on the
  device the trainer's weights are packed on: CPU banks live in shared memory,
  GPU banks are allocations of their own that CUDA IPC exports. A push packs
  (and casts) every bucket straight into one bank; at the commit each shared
  subscriber maps that bank (:meth:`transport.Endpoint.map`: read-only over
  shm, read-write over cuda_ipc) and re-points its live tensors into it. Four
  local subscribers then cost the trainer one pass over the weights, and the
  subscribers no copy at all. On a GPU the publisher seals a bank only once
  its packing copies are done, and a subscriber lets go of the bank it left
  only once the GPU work its readers queued inside ``hold()`` is done.
* A bank is rewritten only when no subscriber's weights point into it. That is
  kept by the kernel, with one lock file per bank (``flock``): a subscriber
  holds a shared lock on the bank its weights use; the publisher takes the
  exclusive lock (without waiting) on a bank before it writes it, and gives it
  up once the bank holds the whole version, right before the commits go out.
  A subscriber that dies lets go of its lock with its process; one that is
  frozen, or keeps readers in ``hold()`` past its commit timeout, keeps its old
  bank and the publisher writes another. When every bank is held, the publisher
  adds one (logged), so a stuck subscriber never holds the others back and
  catches up at a later push; the extra banks go once they are let go. Memory
  is therefore bounded by the number of distinct versions subscribers hold,
  plus one: never more than one copy per subscriber plus one. (A subscriber
  keeps the banks it mapped while they are registered, to commit without a
  registry round trip; one the publisher dropped is unmapped at that
  subscriber's next commit, so its memory goes one push later.)
* Each lock file carries a *stamp*: the version and push id the bank holds,
  cleared when the publisher takes the bank and written when it gives it up. A
  subscriber checks the stamp once it holds the shared lock, so a commit that
  arrives late can never adopt a bank that was rewritten meanwhile.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import stat
import tempfile
import threading
import weakref

import torch

import transport

from .plan import Bucket

__all__ = ["BankLease", "BankSet", "StaleBankError", "make_lock_dir", "remove_lock_dir"]

_STAMP = 64  # bytes at the start of a lock file: b"<version> <push_id>\n", space padded
# bank indices, process-wide: a bank's buffer names (and lock file) are never those of an earlier bank, even
# of a BankSet made again for the same layout, so a subscriber may keep a bank mapped by its names
_BANK_INDICES = itertools.count()


class StaleBankError(Exception):
    """The bank a commit names no longer holds that commit's version (or is being written)."""


def _stamp(version: int, push_id: int) -> bytes:
    return f"{version} {push_id}\n".encode().ljust(_STAMP)


class _Bank:
    """One bank: its registered arenas and its lock file (kept open)."""

    def __init__(self, endpoint: transport.Endpoint, prefix: str, key: str, index: int, arenas: tuple[int, ...],
                 lock_dir: str, device: torch.device) -> None:
        self.names = [f"{prefix}{key}/bank{index}/{i}" for i in range(len(arenas))]
        self.path = os.path.join(lock_dir, f"{key}-{index}.lock")
        self.tensors: list[torch.Tensor] = []
        with _FORK_LOCK:  # a fork between the open and the add would leave the child a lock it keeps
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            _OPEN_FDS.add(self)
        try:
            os.pwrite(self.fd, _stamp(0, 0), 0)
            for name, n in zip(self.names, arenas, strict=True):
                # CPU: made in shared memory at once (no copy on the event loop, pages appear as packing writes
                # them); GPU: an allocation of its own that CUDA IPC exports whatever torch's allocator is set to
                self.tensors.append(endpoint.new_buffer(name, (n,), device=device))
        except BaseException:
            self.close(endpoint)
            raise

    def try_lock(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def close(self, endpoint: transport.Endpoint) -> None:
        for n in self.names:
            with contextlib.suppress(transport.TransportError):
                if n in endpoint.buffers:
                    endpoint.unregister(n, discard=True)  # subscribers mapping it keep their mapping
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.tensors.clear()


class BankSet:
    """The publisher's banks for one layout: ``keep`` of them, more while subscribers pin old ones.

    :meth:`acquire` takes the least recently written bank that no subscriber
    holds; when every bank is held (subscribers stuck on older versions), it
    adds one, so a push never waits for, or fails because of, a slow
    subscriber. Banks beyond ``keep`` are dropped again once more than one
    bank is free. Not thread-safe; used from the publisher's event loop
    (packing into a bank happens on a worker thread between :meth:`acquire`
    and :meth:`seal`).
    """

    def __init__(self, endpoint: transport.Endpoint, prefix: str, key: str, arenas: tuple[int, ...], keep: int,
                 lock_dir: str, device: torch.device | None = None) -> None:
        self.endpoint = endpoint
        self.device = device if device is not None else torch.device("cpu")  # where the banks are
        self.prefix = prefix  # of the buffer names: unique to one publisher
        self.key = key
        self.arenas = arenas
        self.keep = keep
        self.lock_dir = lock_dir
        self._banks: dict[int, _Bank] = {}
        self._order: list[int] = []  # least recently sealed first
        try:
            for _ in range(keep):
                self._add()
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self._banks)

    def _add(self) -> int:
        index = next(_BANK_INDICES)  # (never reused in this process: a name always means one memory)
        self._banks[index] = _Bank(self.endpoint, self.prefix, self.key, index, self.arenas, self.lock_dir,
                                   self.device)
        self._order.insert(0, index)
        return index

    def acquire(self) -> tuple[int, bool]:
        """Take a bank exclusively, without waiting: ``(bank, added)``; ``added`` is True when every
        bank was held and a new one was made. Raises what allocating a bank raises."""
        free = [b for b in self._order if self._banks[b].try_lock()]
        while len(free) > 1 and len(self._banks) > self.keep:  # pinned banks were let go: shrink back
            drop = free.pop(0)
            self._order.remove(drop)
            self._banks.pop(drop).close(self.endpoint)
        for b in free[1:]:
            fcntl.flock(self._banks[b].fd, fcntl.LOCK_UN)
        added = not free
        bank = self._add() if added else free[0]
        if added and not self._banks[bank].try_lock():  # (a fresh file: nobody else has it open)
            raise RuntimeError(f"could not lock the new bank {self._banks[bank].path}")
        os.pwrite(self._banks[bank].fd, _stamp(0, 0), 0)  # from here on it holds no version
        return bank, added

    def names(self, bank: int) -> list[str]:
        return self._banks[bank].names

    def path(self, bank: int) -> str:
        return self._banks[bank].path

    def arena(self, bank: int, bucket: Bucket) -> torch.Tensor:
        """The arena of ``bank`` that ``bucket`` lies in (the same tensor object every time)."""
        return self._banks[bank].tensors[bucket.arena]

    def seal(self, bank: int, version: int, push_id: int) -> None:
        """``bank`` holds every byte of ``version``: stamp it and let subscribers take it."""
        b = self._banks[bank]
        os.pwrite(b.fd, _stamp(version, push_id), 0)
        fcntl.flock(b.fd, fcntl.LOCK_UN)
        self._order.remove(bank)
        self._order.append(bank)

    def release(self, bank: int) -> None:
        """Give ``bank`` up unsealed (a failed or cancelled push): its stamp says it holds nothing."""
        b = self._banks.get(bank)
        if b is not None and b.fd >= 0:
            fcntl.flock(b.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Unregister the banks and remove the lock files. Subscribers that map a bank keep it
        (the memory lives until its last mapping goes)."""
        for b in self._banks.values():
            b.close(self.endpoint)
        self._banks.clear()
        self._order.clear()


def make_lock_dir(owner: str) -> str:
    """A private directory for one publisher's lock files, named after its process id. The
    folders of publishers whose process is gone (killed before their close) are removed first."""
    _remove_dead_lock_dirs()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in owner)[:40]
    return tempfile.mkdtemp(prefix=f"rl_sync-{os.getpid()}-{safe}-")


def _remove_dead_lock_dirs() -> None:
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            parts = entry.name.split("-", 2)
            if len(parts) < 3 or parts[0] != "rl_sync" or not parts[1].isdigit() or not entry.is_dir():
                continue
            try:
                os.kill(int(parts[1]), 0)
                continue  # alive (or another user's process): not ours to touch
            except ProcessLookupError:
                pass
            except OSError:
                continue
            remove_lock_dir(entry.path)


def remove_lock_dir(path: str) -> None:
    """Remove a publisher's lock folder and its lock files (a subscriber still holding one keeps
    its inode; the publisher writes none of its banks again)."""
    with contextlib.suppress(OSError):
        for f in os.scandir(path):
            if f.name.endswith(".lock"):
                os.unlink(f.path)
        os.rmdir(path)


class BankLease:
    """A subscriber's shared lock on the bank its weights point into."""

    def __init__(self, path: str, version: int, push_id: int) -> None:
        """Lock ``path`` shared and check it holds ``version`` of push ``push_id``; never waits.

        Raises :class:`StaleBankError` if the bank is being written or holds
        something else, ``OSError`` if the lock file cannot be opened.
        """
        self.path = path
        with _FORK_LOCK:  # (non-blocking: a path a peer names may be a FIFO, whose open() waits for a writer)
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
            _OPEN_FDS.add(self)
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):
                raise StaleBankError(f"{path} is not a bank's lock file (not a regular file)")
            try:
                fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise StaleBankError(f"bank {path} is being rewritten by a newer push") from exc
            got = os.pread(self.fd, _STAMP, 0).decode(errors="replace").split()
            if got != [str(version), str(push_id)]:
                raise StaleBankError(f"bank {path} holds {' '.join(got) or 'nothing'}, "
                                     f"not version {version} of push {push_id}")
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise

    def release(self) -> None:
        """Let the publisher write this bank again (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)  # the last descriptor of the open file: the lock goes with it
            self.fd = -1


def _close_in_child() -> None:
    """After a fork, the child closes its copies of the lock files' descriptors: a forked child
    (a DataLoader worker, a forking server) must not keep a bank locked, nor unlock one."""
    global _FORK_LOCK
    _FORK_LOCK = threading.Lock()  # (the parent's was held across the fork)
    for obj in list(_OPEN_FDS):
        if obj.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(obj.fd)
        obj.fd = -1


_OPEN_FDS: weakref.WeakSet[_Bank | BankLease] = weakref.WeakSet()
_FORK_LOCK = threading.Lock()  # held around opening a lock file and around fork()
os.register_at_fork(before=lambda: _FORK_LOCK.acquire(), after_in_parent=lambda: _FORK_LOCK.release(),
                    after_in_child=_close_in_child)
