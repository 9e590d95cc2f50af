"""The ``cuda_ipc`` plane's shared parts: the engine interface, mapping cache and export retention.

The plane (:mod:`transport.planes.cuda_ipc`) moves bytes between two processes of one host by
copying straight into (put) or out of (get) the peer's registered GPU buffer, mapped into the
initiator's address space; the peer's code takes no part. What only a GPU can do is an
:class:`IpcEngine`: export the allocation that holds a buffer, map a peer's export, record the
caller's stream, run copies on an ordered queue (a CUDA stream) and report their completion. The
CUDA engine is :class:`transport.cuda.ipc.CudaIpcEngine`. Everything else lives here and in the
plane and is the same for every engine, so the CPU tests run the whole protocol (export ids,
stale exports, mapping cache, retention, completion through a bridge, header after the copy) with
:class:`~transport.planes.cuda_ipc_memfd.MemfdIpcEngine`, whose "device memory" is CPU memory in ``memfd`` segments
(``Endpoint(engines={"cuda_ipc": MemfdIpcEngine})``, both sides).

Lifetime of peer memory, the trap of this plane: a registered GPU tensor is a block inside a
larger segment of torch's caching allocator, and a peer maps the whole segment. Once the owner
unregisters the buffer and drops the tensor, the allocator may give that block to another tensor
while a peer still holds a mapping and might copy into it. So the owner *retains* the memory of
every unregistered export (:class:`~transport.planes.cuda_ipc_retention.Retention`) until each same-host peer that could have mapped
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
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import PlaneUnavailableError
from ..wire import IpcHandle

__all__ = [
    "IpcEngine",
    "IpcExport",
    "IpcMapping",
    "IpcQueue",
    "MappingCache",
    "export_ids",
    "mapping_cache",
]

log = logging.getLogger(__name__)

export_ids = itertools.count(1 << 40)  # distinct from shm's export ids, for readable logs


class IpcMapping(Protocol):
    """A peer's allocation, mapped into this process."""

    def view(self, offset: int, nbytes: int, keep: object = None) -> torch.Tensor:
        """``uint8`` tensor over bytes ``[offset, offset + nbytes)`` of the allocation. ``keep``
        (if not None) lives as long as the memory of the returned tensor and of every view of it
        (:meth:`transport.Endpoint.map` ties the mapping's use count to it)."""
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
    moved_marked: bool = False  # its slot says the owner re-pointed the tensor


# ------------------------------------------------------------------------------ mapping cache
class _Entry:
    __slots__ = ("exports", "mapping", "users")

    def __init__(self, mapping: IpcMapping) -> None:
        self.mapping = mapping
        self.exports: set[int] = set()
        self.users = 0


_UNMAP_WAIT_S = 10.0  # how long an acquire waits for the unmapping of the same allocation to end
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
        self._closing: dict[bytes, threading.Event] = {}  # being unmapped: not to be opened again until done
        self._refused: dict[bytes, str] = {}  # allocations that could not be mapped here, and why
        self._unmap_refused: set[bytes] = set()  # refused only while their unmapping lasts

    def refusal(self, handle: IpcHandle) -> str | None:
        """Why ``handle``'s allocation could not be mapped here (None if it was not refused)."""
        return self._refused.get(handle.handle)

    def acquire(self, handle: IpcHandle, *, block: bool = True) -> IpcMapping | None:
        """Map (if needed, blocking) and count one user in; pair with :meth:`release`. With
        ``block=False``: only an allocation mapped right now is counted in, else None (nothing
        counted): for callers that must not wait (the event loop)."""
        key = handle.handle
        while True:
            with self._lock:
                entry = self._maps.get(key)
                if entry is not None:
                    entry.exports.add(handle.export_id)
                    entry.users += 1
                    return entry.mapping
                if not block:
                    return None
                refused = self._refused.get(key)
                if refused is not None:
                    raise PlaneUnavailableError(refused)
                closing = self._closing.get(key)
                if closing is None:
                    gate = self._opening.setdefault(key, threading.Lock())
            if closing is not None:  # the driver may refuse a handle whose unmapping is still under way
                if not closing.wait(_UNMAP_WAIT_S):
                    why = (f"cuda_ipc: the peer allocation is still being unmapped after {_UNMAP_WAIT_S:g} s; "
                           "ops on it go staged until that ends")
                    with self._lock:
                        if self._closing.get(key) is closing:  # (lifted once the unmap ends: see _unmap)
                            self._refused[key] = why
                            self._unmap_refused.add(key)
                    raise PlaneUnavailableError(why)
                continue
            with gate:  # one opener per allocation; the others wait for its mapping
                with self._lock:
                    if key in self._maps or key in self._closing or self._opening.get(key) is not gate:
                        continue  # mapped, being unmapped, or opened and already unmapped since: look again
                    refused = self._refused.get(key)
                if refused is not None:  # the opener before us was refused
                    raise PlaneUnavailableError(refused)
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
            done = self._closing[key] = threading.Event()
        self._unmap(key, entry, done)

    def _unmap(self, key: bytes, entry: _Entry, done: threading.Event) -> None:
        try:
            entry.mapping.close()
        except Exception:  # noqa: BLE001 - an unmap failure must not break the channel
            log.exception("cuda_ipc: unmapping a peer allocation failed")
        finally:
            with self._lock:
                if self._closing.get(key) is done:
                    del self._closing[key]
                if key in self._unmap_refused:  # the unmap ended: the allocation can be mapped again
                    self._unmap_refused.discard(key)
                    self._refused.pop(key, None)
            done.set()

    def close(self) -> None:
        with self._lock:
            entries, self._maps = dict(self._maps), {}
            dones = {}
            for key in entries:
                dones[key] = self._closing[key] = threading.Event()
        try:
            for key, e in entries.items():
                self._unmap(key, e, dones.pop(key))
        finally:  # (an unmap interrupted by a BaseException: never leave the others waited for forever)
            with self._lock:
                for key, done in dones.items():
                    if self._closing.get(key) is done:
                        del self._closing[key]
            for done in dones.values():
                done.set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)
