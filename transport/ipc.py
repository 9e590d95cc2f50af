"""The ``cuda_ipc`` plane's shared parts: the engine interface, mapping cache and export retention.

The plane (:mod:`transport.planes.cuda_ipc`) moves bytes between two processes of one host by
copying straight into (put) or out of (get) the peer's registered GPU buffer, mapped into the
initiator's address space; the peer's code takes no part. What only a GPU can do is an
:class:`IpcEngine`: export the allocation that holds a buffer, map a peer's export, record the
caller's stream, run copies on an ordered queue (a CUDA stream) and report their completion. The
CUDA engine is :class:`transport.cuda.ipc.CudaIpcEngine`. Everything else lives here and in the
plane and is the same for every engine, so the CPU tests run the whole protocol (export ids,
stale exports, mapping cache, retention, completion through a bridge, header after the copy) with
:class:`MemfdIpcEngine`, whose "device memory" is CPU memory in ``memfd`` segments
(``Endpoint(ipc_engine=MemfdIpcEngine)``, both sides).

Lifetime of peer memory, the trap of this plane: a registered GPU tensor is a block inside a
larger segment of torch's caching allocator, and a peer maps the whole segment. Once the owner
unregisters the buffer and drops the tensor, the allocator may give that block to another tensor
while a peer still holds a mapping and might copy into it. So the owner *retains* the memory of
every unregistered export (:class:`Retention`) until each same-host peer that could have mapped
it confirmed that it no longer will (the ``Unmapped(epoch)`` frame: nothing absent from the owner's
registry at that epoch is mapped or in use there, sent once no copy of its uses such an export),
or its process is gone. Initiator side, :class:`MappingCache` maps each peer allocation once per
process (CUDA refuses to open one handle twice in a process) and unmaps it when no export of it
is live and no copy uses it.

Blocking: :meth:`IpcEngine.export` and :meth:`IpcEngine.open` may block (the CUDA driver, an
``mmap``); the plane opens new mappings on a worker thread. Everything else here is non-blocking
and thread-safe.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import select
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import torch

from .errors import PlaneUnavailableError
from .wire import IpcHandle, ShmHandle

__all__ = [
    "IpcEngine",
    "IpcExport",
    "IpcMapping",
    "IpcQueue",
    "MappingCache",
    "MemfdIpcEngine",
    "Retention",
    "export_ids",
    "mapping_cache",
]

log = logging.getLogger(__name__)

export_ids = itertools.count(1 << 40)  # distinct from shm's export ids, for readable logs


class IpcMapping(Protocol):
    """A peer's allocation, mapped into this process."""

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """``uint8`` tensor over bytes ``[offset, offset + nbytes)`` of the allocation."""
        ...

    def close(self) -> None:
        """Unmap (no copy may use it any more)."""
        ...


class IpcQueue(Protocol):
    """An ordered copy queue (for CUDA: a dedicated stream of one device)."""

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Any) -> Any:
        """Issue ``dst.copy_(src)`` for every pair behind ``after`` (a mark, or None) without waiting;
        return a :class:`~transport.completion.Waitable` that completes with the last copy."""
        ...

    def synchronize(self) -> None:
        """Block until every copy issued so far has completed."""
        ...

    def close(self) -> None:
        """No more copies will be issued (after :meth:`synchronize`); free the queue."""
        ...


class IpcEngine(Protocol):
    """What the ``cuda_ipc`` plane needs from the memory it moves."""

    name: str

    def handles(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory is this engine's to export (CUDA: a CUDA tensor)."""
        ...

    def export(self, tensor: torch.Tensor, segments: list[Any]) -> tuple[str, bytes, int, int, Any]:
        """Export the allocation holding ``tensor``: ``(device, handle, size, offset, keep)``;
        ``keep`` is released with :meth:`release` once the export is over. Raises
        :class:`~transport.errors.PlaneUnavailableError` if it cannot (e.g. expandable segments)."""
        ...

    def release(self, keep: Any) -> None:
        """The export is over (its memory is no longer retained for peers)."""
        ...

    def reachable(self, handle: IpcHandle) -> str | None:
        """Why ``handle`` cannot be mapped here (None if it can); cheap, no mapping."""
        ...

    def open(self, handle: IpcHandle) -> IpcMapping:
        """Map the allocation of ``handle`` (blocking). Raises ``PlaneUnavailableError``."""
        ...

    def mark(self, tensors: Sequence[torch.Tensor]) -> Any:
        """In the caller's thread: what the op's copies must wait for (the caller's queued work on
        its current stream), or None."""
        ...

    def queue(self, device: str) -> IpcQueue:
        """A new ordered copy queue for copies touching ``device`` (one per channel and device)."""
        ...


@dataclass
class IpcExport:
    """A registered buffer's ``cuda_ipc`` export (target side): what peers are told, and what keeps it."""

    handle: IpcHandle
    keep: Any = None


# ---------------------------------------------------------------------------------- retention
class Retention:
    """Target side: the memory of unregistered ``cuda_ipc`` exports, held for peers that may map it.

    Peers are tracked by *holder* keys (a channel id, or a handshake still in progress), each with
    the newest registry epoch it has confirmed: ``Unmapped(epoch)`` says "nothing absent from your
    registry at that epoch is mapped or used by a copy of mine"; a holder starts at the epoch of
    the Hello we sent it (what it may have mapped from). An export unregistered at epoch ``E`` is
    released (``release(keep)``) once every holder has confirmed an epoch >= ``E``. A holder whose
    channel closed while its process lives on the same host may still have copies in flight: it
    keeps holding (a *zombie*) until that process exits (watched through a pidfd). Only same-host
    peers that offer ``cuda_ipc`` are holders. Thread-safe.
    """

    def __init__(self, release: Callable[[Any], None]) -> None:
        self._release = release
        self._lock = threading.Lock()
        self._held: dict[int, tuple[Any, int]] = {}  # export id -> (keep, epoch it left the registry)
        self._acked: dict[str, int] = {}  # holder -> newest epoch it confirmed
        self._zombies: dict[str, int] = {}  # holder whose channel closed -> pidfd of its process
        self._watcher: threading.Thread | None = None
        self._closed = False

    def watch(self, holder: str, epoch: int) -> None:
        """``holder`` may map exports of registries up to ``epoch`` (its Hello)."""
        with self._lock:
            self._acked[holder] = min(epoch, self._acked.get(holder, epoch))

    def forget(self, holder: str) -> None:
        """``holder`` maps nothing of ours (a failed handshake, a channel that needs no tracking)."""
        with self._lock:
            self._acked.pop(holder, None)
            fd = self._zombies.pop(holder, None)
        if fd is not None:
            os.close(fd)
        self._sweep()

    def acked(self, holder: str, epoch: int) -> None:
        """``Unmapped(epoch)`` from ``holder``."""
        with self._lock:
            if holder not in self._acked:
                return
            self._acked[holder] = max(self._acked[holder], epoch)
        self._sweep()

    def closed(self, holder: str, pid: int | None) -> None:
        """``holder``'s channel closed; ``pid`` is its process if on this host (None: nothing to wait for)."""
        with self._lock:
            if holder not in self._acked:
                return
            if pid is None or self._closed:
                fd = None
            else:
                try:
                    fd = os.pidfd_open(pid)
                except (OSError, AttributeError):  # gone already (or no pidfd: assume gone)
                    fd = None
            if fd is None:
                del self._acked[holder]
            else:
                self._zombies[holder] = fd
                if self._watcher is None:
                    self._watcher = threading.Thread(target=self._watch_zombies, name="transport-ipc-zombies",
                                                     daemon=True)
                    self._watcher.start()
        self._sweep()

    def retire(self, export_id: int, keep: Any, epoch: int) -> None:
        """An export left the registry at ``epoch``: hold ``keep`` until every holder confirmed it."""
        with self._lock:
            self._held[export_id] = (keep, epoch)
        self._sweep()

    def _sweep(self) -> None:
        done = []
        with self._lock:
            floor = min(self._acked.values(), default=None)
            for eid, (keep, epoch) in list(self._held.items()):
                if floor is None or floor >= epoch:
                    del self._held[eid]
                    done.append(keep)
        for keep in done:
            self._release(keep)

    def _watch_zombies(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._zombies:
                    self._watcher = None
                    return
                fds = dict(self._zombies)
            try:
                ready, _, _ = select.select(list(fds.values()), [], [], 1.0)
            except (OSError, ValueError):  # one was closed meanwhile (forgotten): look again
                continue
            for holder, fd in fds.items():
                if fd in ready:
                    self.forget(holder)

    def release_all(self) -> None:
        """The endpoint is closing: release everything (its process's mappings of ours end with it)."""
        with self._lock:
            self._closed = True
            held, self._held = [k for k, _ in self._held.values()], {}
            fds, self._zombies = list(self._zombies.values()), {}
            self._acked.clear()
        for fd in fds:
            os.close(fd)
        for keep in held:
            self._release(keep)

    @property
    def held(self) -> dict[int, int]:
        """Export id -> the epoch it left the registry (a copy; for tests and the doctor)."""
        with self._lock:
            return {eid: epoch for eid, (_, epoch) in self._held.items()}

    @property
    def holders(self) -> dict[str, int]:
        """Holder -> the newest epoch it confirmed (zombies included)."""
        with self._lock:
            return dict(self._acked)


# ------------------------------------------------------------------------------ mapping cache
class _Entry:
    __slots__ = ("exports", "mapping", "users")

    def __init__(self, mapping: IpcMapping) -> None:
        self.mapping = mapping
        self.exports: set[int] = set()
        self.users = 0


_caches: dict[int, tuple[Any, MappingCache]] = {}
_caches_lock = threading.Lock()


def mapping_cache(engine: IpcEngine) -> MappingCache:
    """The process's :class:`MappingCache` of ``engine`` (one per engine object)."""
    with _caches_lock:
        hit = _caches.get(id(engine))
        if hit is None or hit[0] is not engine:
            hit = _caches[id(engine)] = (engine, MappingCache(engine))
        return hit[1]


class MappingCache:
    """Initiator side, per process and engine: each peer allocation mapped once, by handle.

    An allocation stays mapped while one of its exports is live (named by a peer's registry as
    last seen by some channel) or a copy uses it. :meth:`acquire` counts a copy in,
    :meth:`release` out; :meth:`retire` ends an export. Unmapping happens on the thread that
    dropped the last reason, outside the lock.
    """

    def __init__(self, engine: IpcEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._maps: dict[bytes, _Entry] = {}
        self._opening: dict[bytes, threading.Lock] = {}
        self._refused: dict[bytes, str] = {}  # allocations that could not be mapped here, and why

    def refusal(self, handle: IpcHandle) -> str | None:
        """Why ``handle``'s allocation could not be mapped here (None if it was not refused)."""
        return self._refused.get(handle.handle)

    def mapped(self, handle: IpcHandle) -> bool:
        with self._lock:
            return handle.handle in self._maps

    def acquire(self, handle: IpcHandle) -> IpcMapping:
        """Map (if needed, blocking) and count one user in; pair with :meth:`release`."""
        key = handle.handle
        while True:
            with self._lock:
                entry = self._maps.get(key)
                if entry is not None:
                    entry.exports.add(handle.export_id)
                    entry.users += 1
                    return entry.mapping
                gate = self._opening.setdefault(key, threading.Lock())
            with gate:  # one opener per allocation; the others wait for its mapping
                with self._lock:
                    if key in self._maps:
                        continue
                try:
                    mapping = self.engine.open(handle)  # may raise: nothing was counted
                except PlaneUnavailableError as exc:  # ops on it go staged from now on (logged)
                    with self._lock:
                        self._refused[key] = str(exc)
                    raise
                with self._lock:
                    self._opening.pop(key, None)
                    entry = self._maps[key] = _Entry(mapping)
                    entry.exports.add(handle.export_id)
                    entry.users += 1
                    return mapping

    def release(self, handle: IpcHandle) -> None:
        self._settle(handle.handle, users=-1)

    def retire(self, handle: IpcHandle) -> None:
        """The export left the peer's registry: the allocation is unmapped once nothing uses it."""
        self._settle(handle.handle, retired=handle.export_id)

    def _settle(self, key: bytes, users: int = 0, retired: int | None = None) -> None:
        with self._lock:
            entry = self._maps.get(key)
            if entry is None:
                return
            entry.users += users
            if retired is not None:
                entry.exports.discard(retired)
            if entry.users > 0 or entry.exports:
                return
            del self._maps[key]
        try:
            entry.mapping.close()
        except Exception:  # noqa: BLE001 - an unmap failure must not break the channel
            log.exception("cuda_ipc: unmapping a peer allocation failed")

    def close(self) -> None:
        with self._lock:
            entries, self._maps = list(self._maps.values()), {}
        for e in entries:
            try:
                e.mapping.close()
            except Exception:  # noqa: BLE001
                log.exception("cuda_ipc: unmapping a peer allocation failed")

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)


# ------------------------------------------------------------------------------- CPU engine
class _ThreadDone:
    """Completion of copies on a :class:`_ThreadQueue` (a Waitable)."""

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


class _ThreadQueue:
    """Copies run in issue order on one worker thread: the CPU stand-in for a CUDA stream."""

    def __init__(self, name: str, delay: float = 0.0) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._delay = delay
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Any) -> _ThreadDone:
        done = _ThreadDone()
        self._jobs.put((list(pairs), done))
        return done

    def synchronize(self) -> None:
        done = _ThreadDone()
        self._jobs.put(([], done))
        done.finished.wait()

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            pairs, done = job
            try:
                if self._delay and pairs:
                    threading.Event().wait(self._delay)
                for dst, src in pairs:
                    dst.copy_(src)
            except BaseException as exc:  # reported through the waitable
                done.error = exc
            finally:
                done.finished.set()
            del pairs, done, job


class _MemfdMapping:
    def __init__(self, data: torch.Tensor) -> None:
        self._data: torch.Tensor | None = data

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        if self._data is None:
            raise PlaneUnavailableError("cuda_ipc(memfd): the mapping was closed")
        return self._data[offset : offset + nbytes]

    def close(self) -> None:
        self._data = None


class MemfdIpcEngine:
    """The ``cuda_ipc`` plane's protocol on CPU memory: exports are ``memfd`` segments (the
    ``shm`` plane's, shared with it), mappings are ``mmap`` s through ``/proc/<pid>/fd``, copies
    run in order on a worker thread per queue. For tests and debugging on machines without a GPU
    (``Endpoint(ipc_engine=MemfdIpcEngine)`` on both sides: CPU buffers then travel over
    ``cuda_ipc`` instead of ``shm``). ``copy_delay`` slows every copy (tests of timeouts)."""

    name = "memfd"

    def __init__(self, copy_delay: float = 0.0) -> None:
        self.copy_delay = copy_delay

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        from .planes.shm import ShmPlane

        ok, why = ShmPlane.probe()
        return ok, f"memfd test engine: {why}"

    def handles(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def export(self, tensor: torch.Tensor, segments: list[Any]) -> tuple[str, bytes, int, int, Any]:
        from .planes.shm import export_buffer
        from .registry import BufferSpec, LocalBuffer

        exp = export_buffer(LocalBuffer(BufferSpec.of("ipc", tensor), tensor), segments)
        if exp is None:
            raise PlaneUnavailableError("cuda_ipc(memfd): an empty buffer has nothing to export")
        h = exp.handle
        key = msgspec.msgpack.encode(ShmHandle(h.pid, h.fd, h.inode, exp.segment.size, 0, 0))
        return f"host:{os.uname().nodename}", key, exp.segment.size, h.offset, exp

    def release(self, keep: Any) -> None:
        keep.close()

    def reachable(self, handle: IpcHandle) -> str | None:
        return None if handle.engine == self.name else f"exported by engine {handle.engine!r}, this side runs memfd"

    def open(self, handle: IpcHandle) -> IpcMapping:
        from .planes.shm import _map

        h = msgspec.msgpack.decode(handle.handle, type=ShmHandle)
        return _MemfdMapping(_map(h))

    def mark(self, tensors: Sequence[torch.Tensor]) -> Any:
        return None

    def queue(self, device: str) -> IpcQueue:
        return _ThreadQueue(f"transport-ipc-{device}", self.copy_delay)
