"""``cuda_ipc``: same host, GPU memory. The initiator copies straight into (or out of) the peer's buffer.

The ``shm`` protocol with device memory (see :mod:`transport.ipc` for the engine and the memory's
lifetime):

- The target exports each registered GPU buffer once, at ``register``: the IPC handle of the
  allocation holding it, the device's UUID and the buffer's offset (:class:`~transport.wire.IpcHandle`
  in its registry entries).
- put: in the caller's thread the engine marks the caller's current stream; the plane maps the
  peer's allocation (once per process, on a worker thread), issues the copies on the channel's own
  queue (a CUDA stream per channel and device) behind that mark, awaits their completion event on
  the event loop through a :class:`~transport.completion.CompletionBridge` (no core spins, the loop
  keeps serving), and only then sends the ``Put`` header, naming the exports it wrote, as the
  "done" message. The target checks they are still the buffers' and acknowledges: ``put`` returns
  once the bytes are in the peer's memory and the peer knows it.
- get: the same copies the other way (into the caller's tensors), then a ``Get`` header that the
  target checks and acknowledges.

A stale export (the peer re-registered the buffer meanwhile) is answered ``stale`` and the endpoint
retries once after refreshing the peer's registry, as for ``shm``. When exports leave the peer's
registry, the plane unmaps them once no copy of its uses them and sends ``Unmapped``, which lets the
peer free that memory.

Cancellation and timeouts: the op's deadline bounds the wait for the copies; copies already issued
still complete (their tensors stay referenced until then). A get abandoned mid-copy is waited for
(bounded) before ``get`` raises, so nothing is written into the caller's tensors after it returned.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..completion import CompletionBridge, CompletionError
from ..errors import PeerLostError, PlaneUnavailableError, StaleBufferError, TransportError
from ..hostinfo import same_host
from ..ipc import IpcMapping, IpcQueue, mapping_cache
from ..wire import Get, HostInfo, IpcHandle, Item, Put, Unmapped
from .base import DataPlane

if TYPE_CHECKING:
    from ..channel import Channel, Op

__all__ = ["CudaIpcPlane"]

log = logging.getLogger(__name__)


class _Batch:
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


class CudaIpcPlane(DataPlane):
    name = "cuda_ipc"
    inline_payload = False
    sends_at_once = False  # the header waits for the copies: later ops stay behind it (call order)

    def __init__(self, channel: Channel) -> None:
        super().__init__(channel)
        engine = channel.core.ipc_engine
        if engine is None:
            raise PlaneUnavailableError("cuda_ipc: this endpoint has no IPC engine")
        self.engine = engine
        self.cache = mapping_cache(engine)
        self._lock = threading.Lock()
        self._busy: dict[int, int] = {}  # export id -> copies of ours in flight
        self._gone: dict[int, IpcHandle] = {}  # exports that left the peer's registry, awaiting our copies
        self._queues: dict[str, tuple[IpcQueue, CompletionBridge]] = {}
        self._batches: set[_Batch] = set()
        self._closed = False

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return True, "decided per endpoint by its IPC engine"

    @classmethod
    def reaches(cls, local: HostInfo, remote: HostInfo) -> tuple[bool, str]:
        return same_host(local, remote)

    # ------------------------------------------------------------------ bookkeeping
    def _enter(self, pairs: Sequence[tuple[Item, torch.Tensor]]) -> list[IpcHandle | None]:
        """The export of each item's buffer, counted in (None for an empty item). Checked against
        the peer's registry as it is now, under the lock that :meth:`retire` takes: an export that
        left it is refused (stale), one still in it cannot be unmapped until we are done."""
        wire = self.channel.remote_wire
        out: list[IpcHandle | None] = []
        with self._lock:
            if self._closed:
                raise PeerLostError(f"channel to {self.channel.peer_name!r} is closed")
            for it, _ in pairs:
                if not it.count:
                    out.append(None)
                    continue
                wb = wire.get(it.name)
                if wb is None or wb.ipc is None:
                    for h in out:
                        if h is not None:
                            self._leave_locked(h)
                    raise StaleBufferError(f"cuda_ipc: {self.channel.peer_name!r} no longer exports {it.name!r}")
                self._busy[wb.ipc.export_id] = self._busy.get(wb.ipc.export_id, 0) + 1
                out.append(wb.ipc)
        return out

    def _leave_locked(self, h: IpcHandle) -> IpcHandle | None:
        n = self._busy.get(h.export_id, 0) - 1
        if n > 0:
            self._busy[h.export_id] = n
            return None
        self._busy.pop(h.export_id, None)
        return self._gone.pop(h.export_id, None)

    def _leave(self, handles: Sequence[IpcHandle]) -> None:
        with self._lock:
            ready = [g for h in handles if (g := self._leave_locked(h)) is not None]
        self._unmap(ready)

    def retire(self, handles: Sequence[IpcHandle]) -> None:
        """Any thread: these exports left the peer's registry. Each is unmapped (and ``Unmapped``
        sent) now if no copy of ours uses it, else when the last one completes."""
        ready = []
        with self._lock:
            for h in handles:
                if self._busy.get(h.export_id):
                    self._gone[h.export_id] = h
                else:
                    ready.append(h)
        self._unmap(ready)

    def _unmap(self, handles: Sequence[IpcHandle]) -> None:
        if not handles:
            return
        for h in handles:
            self.cache.retire(h)
        try:
            self.channel.send(Unmapped([h.export_id for h in handles]))
        except PeerLostError:
            pass  # the peer releases everything held for a closed channel

    # ------------------------------------------------------------------ copies
    def _queue(self, device: str) -> tuple[IpcQueue, CompletionBridge]:
        q = self._queues.get(device)
        if q is None:
            q = self._queues[device] = (self.engine.queue(device),
                                        CompletionBridge(self.channel.loop, f"transport-ipc-{self.channel.peer_name}"))
        return q

    def _opened_late(self, handles: list[IpcHandle], fut: asyncio.Future[list[IpcMapping]]) -> None:
        """The op left while its mappings were being opened: give them back when they are."""
        if not fut.cancelled() and fut.exception() is None:
            for h in handles:
                self.cache.release(h)

    def _acquire(self, handles: Sequence[IpcHandle]) -> list[IpcMapping]:
        """Map every allocation (blocking the first time); all or nothing."""
        got: list[IpcHandle] = []
        maps = []
        try:
            for h in handles:
                maps.append(self.cache.acquire(h))
                got.append(h)
        except BaseException:
            for h in got:
                self.cache.release(h)
            raise
        return maps

    async def _copy(self, op: Op, pairs: list[tuple[Item, torch.Tensor]], into_peer: bool) -> list[int]:
        """Copy every item of one op; return the export id of each item's buffer (0 if empty)."""
        jobs = [(it, t) for it, t in pairs if it.count]
        after = self.engine.mark([t for _, t in jobs]) if jobs else None  # the caller's stream, before any await
        handles = self._enter(pairs)
        ids = [h.export_id if h is not None else 0 for h in handles]
        used = [h for h in handles if h is not None]
        if not used:
            return ids
        try:
            if all(self.cache.mapped(h) for h in used):
                maps = self._acquire(used)
            else:  # opening a mapping blocks (driver call, mmap): off the loop
                opening = asyncio.ensure_future(asyncio.to_thread(self._acquire, used))
                try:
                    maps = await asyncio.shield(opening)
                except BaseException:
                    opening.add_done_callback(functools.partial(self._opened_late, used))
                    raise
        except BaseException:
            self._leave(used)
            raise
        groups: dict[str, list[tuple[torch.Tensor, torch.Tensor, IpcHandle]]] = {}
        try:
            for (it, t), h, m in zip(jobs, used, maps, strict=True):
                size = t.element_size()
                remote = m.view(h.offset + it.offset * size, it.count * size)
                local = t.detach().reshape(-1).view(torch.uint8)
                pair = (remote, local) if into_peer else (local, remote)
                groups.setdefault(h.device, []).append((*pair, h))
        except BaseException:
            for h in used:
                self.cache.release(h)
            self._leave(used)
            raise
        if not into_peer:  # about to write into the caller's tensors: _abandon waits for op.quiet
            with op.lock:
                op.busy = True
        left = [len(groups)]
        futs = []
        for device, group in groups.items():
            futs.append(self._issue(op, device, group, after, left, into_peer))
        for fut in futs:
            try:
                await fut
            except CompletionError as exc:
                raise TransportError(f"{op.kind.value} #{op.op_id}: a cuda_ipc copy with {self.channel.peer_name!r} "
                                     f"failed: {exc}") from exc
        return ids

    def _issue(self, op: Op, device: str, group: list[tuple[torch.Tensor, torch.Tensor, IpcHandle]], after: Any,
               left: list[int], into_peer: bool) -> asyncio.Future[None]:
        queue, bridge = self._queue(device)
        hs = [h for _, _, h in group]

        def finish() -> None:  # any thread, once: the copies are over
            for h in hs:
                self.cache.release(h)
            self._leave(hs)
            with self._lock:
                self._batches.discard(batch)
                left[0] -= 1
                last = left[0] == 0
            if last and not into_peer:
                op.quiet.set()

        try:
            waitable = queue.copy([(dst, src) for dst, src, _ in group], after)
        except BaseException:
            batch = None
            finish()
            raise
        batch = _Batch(waitable, finish)
        with self._lock:
            self._batches.add(batch)
        return bridge.wait(batch)

    # ------------------------------------------------------------------ ops
    async def put(self, op: Op, pairs: list[tuple[Item, torch.Tensor]], notify: bytes | None) -> None:
        op.keep = [t for _, t in pairs]
        ids = await self._copy(op, pairs, into_peer=True)
        self.channel.send(Put(op.op_id, op.seq, self.name, [it for it, _ in pairs], notify, ids), op=op)

    async def get(self, op: Op, pairs: list[tuple[Item, torch.Tensor]]) -> None:
        op.keep = [t for _, t in pairs]
        ids = await self._copy(op, pairs, into_peer=False)
        self.channel.send(Get(op.op_id, op.seq, [it for it, _ in pairs], self.name, ids), op=op)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """The channel is gone (event loop): on a worker thread, wait for the copies already
        issued, give their mappings back and unmap what only this channel used."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        queues, self._queues = list(self._queues.values()), {}
        live = [wb.ipc for wb in self.channel.remote_wire.values() if wb.ipc is not None]

        def drain() -> None:
            for q, bridge in queues:
                try:
                    q.synchronize()
                except Exception:  # noqa: BLE001 - a failed copy already failed its op
                    log.debug("cuda_ipc: synchronizing a queue at close failed", exc_info=True)
                bridge.close()
                q.close()
            with self._lock:
                batches = list(self._batches)
            for b in batches:
                b.finish()
            with self._lock:
                gone, self._gone = list(self._gone.values()), {}
            for h in [*live, *gone]:
                self.cache.retire(h)

        threading.Thread(target=drain, name="transport-ipc-close", daemon=True).start()
