"""``cuda_ipc``: same host, GPU memory. The initiator copies straight into (or out of) the peer's buffer.

The ``shm`` protocol with device memory (see :mod:`transport.planes.cuda_ipc_engine` for the engine and the memory's
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
- **One-sided** (as for ``shm``, :mod:`transport.planes.shm_slots`): a put without a notification,
  and a get, whose exports all have a word in the peer's slot table send no message at all. The
  op locks those words shared and checks them before its copies are issued, and checks them
  again and unlocks once the copies completed (on the thread that sees their completion, before
  ``put``/``get`` returns); the peer revokes a word (unregister, re-register) under the exclusive
  lock, waiting for copies in flight, so a copy either lands before the peer takes the buffer
  back or its op fails with :class:`~transport.errors.StaleBufferError`, never reported done
  while its bytes are lost. A registered tensor re-pointed by its owner is marked in its word
  (the owner's heartbeat tick): later ops fail with
  :class:`~transport.errors.BufferMismatchError`, as the header's check would.
  A put with a notification copies under the same locks (then sends its header): a take-back
  waits for its copy too, so it never lands in a view of an arena registered later at the old place.

A stale export (the peer re-registered the buffer meanwhile) is answered ``stale`` and the endpoint
retries once after refreshing the peer's registry, as for ``shm``. When exports leave the peer's
registry, the plane unmaps them once no copy of its uses them and sends ``Unmapped``, which lets the
peer free that memory.

Cancellation and timeouts: the op's deadline bounds the wait for the copies; copies already issued
cannot be called back and still complete (their tensors stay referenced until then). An op abandoned
once its copies were issued, a put's as well as a get's, waits for them (up to 30 s, off the event
loop) before ``put``/``get`` raises, so nothing is written into the caller's tensors or the peer's
buffer after it raised; no header is sent for it. (Past that bound, which only a stuck device
reaches, the error is logged and the copies that are left still run first on the channel's queue.)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..completion import CompletionBridge, CompletionError
from ..errors import EndpointClosedError, PeerLostError, PlaneUnavailableError, StaleBufferError, TransportError
from ..hostinfo import same_host
from ..op import Op
from ..ranges import item_fits
from ..wire import Get, HostInfo, IpcHandle, Item, Put, Unmapped
from .base import ChannelPort, DataPlane, closed_error
from .cuda_ipc_engine import IpcMapping, IpcQueue, mapping_cache
from .cuda_ipc_export import ipc_engine_of
from .cuda_ipc_holds import Batch, Held, PeerSlots, SlotGuard
from .shm_slots import one_sided_feature

__all__ = ["CudaIpcPlane"]

log = logging.getLogger(__name__)


class CudaIpcPlane(DataPlane):
    name = "cuda_ipc"
    inline_payload = False
    staged_on_unavailable = True
    sends_at_once = False  # the header waits for the copies: later ops stay behind it (call order)

    def __init__(self, channel: ChannelPort) -> None:
        super().__init__(channel)
        engine, _ = ipc_engine_of(channel.core)
        if engine is None:
            raise PlaneUnavailableError("cuda_ipc: this endpoint has no IPC engine")
        self.engine = engine
        self.cache = mapping_cache(engine)
        self._lock = threading.Lock()
        self._busy: dict[int, int] = {}  # export id -> copies of ours in flight
        self._gone: dict[int, IpcHandle] = {}  # exports that left the peer's registry, awaiting our copies
        self._acks: list[tuple[int, set[int]]] = []  # registry epochs to confirm, with the exports still busy
        self._queues: dict[str, tuple[IpcQueue, CompletionBridge]] = {}
        self._marks: CompletionBridge | None = None  # awaits a get caller's stream before the copy
        self._batches: set[Batch] = set()
        self._closed = False  # the channel is gone
        self._quiet = False  # an orderly close: no new copies
        self._slots = PeerSlots(self.name, channel.peer_name)  # the peer's slot tables: one-sided puts and gets

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return True, "decided per endpoint by its IPC engine"

    @classmethod
    def reaches(cls, local: HostInfo, remote: HostInfo) -> tuple[bool, str]:
        return same_host(local, remote)

    # ------------------------------------------------------------------ bookkeeping
    def _enter(self, pairs: Sequence[tuple[Item, torch.Tensor]]) -> list[IpcHandle | None]:
        """The export of each item's buffer, counted in (None for an empty item). Read from the
        peer's registry as it is now, under the lock that :meth:`retire` takes after the reader
        replaced it: an export that left it is refused (stale); one still in it is not confirmed
        unmapped until we are done with it."""
        out: list[IpcHandle | None] = []
        with self._lock:
            wire = self.channel.remote_wire
            if self._closed or self._quiet:
                raise closed_error(self.channel)
            for it, _ in pairs:
                wb = wire.get(it.name) if it.count else None
                if it.count and (wb is None or wb.ipc is None or not item_fits(it, wb)):  # (a newer registry: shm's _handle)
                    for h in out:
                        if h is not None:
                            self._leave_locked(h)
                    raise StaleBufferError(f"cuda_ipc: {self.channel.peer_name!r} no longer exports {it.name!r}")
                if wb is None or wb.ipc is None:
                    out.append(None)
                    continue
                self._busy[wb.ipc.export_id] = self._busy.get(wb.ipc.export_id, 0) + 1
                out.append(wb.ipc)
        return out

    def _leave_locked(self, h: IpcHandle) -> IpcHandle | None:
        n = self._busy.get(h.export_id, 0) - 1
        if n > 0:
            self._busy[h.export_id] = n
            return None
        self._busy.pop(h.export_id, None)
        gone = self._gone.pop(h.export_id, None)
        if gone is not None:
            for _, waiting in self._acks:
                waiting.discard(h.export_id)
        return gone

    def _leave(self, handles: Sequence[IpcHandle]) -> None:
        with self._lock:
            ready = [g for h in handles if (g := self._leave_locked(h)) is not None]
            epoch = self._ackable_locked()
        self._unmap(ready, epoch)

    def _ackable_locked(self) -> int | None:
        """The newest epoch whose exports gone, and all before it, no copy of ours uses any more."""
        epoch = None
        while self._acks and not self._acks[0][1]:
            epoch = self._acks.pop(0)[0]
        return epoch

    def retire(self, handles: Sequence[IpcHandle], epoch: int) -> None:
        """Any thread (the reader, after replacing the peer's registry with ``epoch``): these exports
        left it. Each is unmapped once no copy of ours uses it; ``Unmapped(epoch)`` goes out once
        that holds for all of them (and for the epochs before)."""
        ready = []
        with self._lock:
            waiting = set()
            for h in handles:
                if self._busy.get(h.export_id):
                    self._gone[h.export_id] = h
                    waiting.add(h.export_id)
                else:
                    ready.append(h)
            self._acks.append((epoch, waiting))
            ack = self._ackable_locked()
        self._unmap(ready, ack)

    def _unmap(self, handles: Sequence[IpcHandle], epoch: int | None) -> None:
        for h in handles:
            self.cache.retire(h)
        if epoch is not None:
            self.channel.send_quietly(Unmapped(epoch))  # (a closed channel: the peer watches our process)

    # ------------------------------------------------------------------ copies
    def _queue(self, device: str) -> tuple[IpcQueue, CompletionBridge]:
        with self._lock:
            if self._closed:
                raise closed_error(self.channel)
            q = self._queues.get(device)
        if q is None:
            q = (self.engine.queue(device), CompletionBridge(self.channel.loop, f"transport-ipc-{self.channel.peer_name}"))
            with self._lock:
                if self._closed:
                    q[1].close()
                    q[0].close()
                    raise closed_error(self.channel)
                self._queues[device] = q
        return q

    def _acquire(self, handles: Sequence[IpcHandle], block: bool = True) -> list[IpcMapping] | None:
        """Map every allocation (blocking the first time); all or nothing. ``block=False``: None
        unless every allocation is mapped right now (nothing counted then)."""
        got: list[IpcHandle] = []
        maps = []
        try:
            for h in handles:
                m = self.cache.acquire(h, block=block)
                if m is None:
                    for g in got:
                        self.cache.release(g)
                    return None
                maps.append(m)
                got.append(h)
        except BaseException:
            for h in got:
                self.cache.release(h)
            raise
        return maps

    def _opened_late(self, handles: list[IpcHandle], fut: asyncio.Future[list[IpcMapping]]) -> None:
        """The op left while its mappings were being opened: give them back once they are, then
        leave (so an export retired meanwhile is unmapped and confirmed only now)."""
        if not fut.cancelled() and fut.exception() is None:
            for h in handles:
                self.cache.release(h)
        self._leave(handles)

    #: puts without a notification, and gets, into exports that all have a slot: no message at all
    one_sided = True

    def _guard(self, jobs: list[tuple[Item, torch.Tensor]], used: list[IpcHandle], wrote: bool) -> SlotGuard | None:
        """The op's slot locks if every export has a word in one table of the peer that this
        process can open (None: the op keeps its header and acknowledgement); ``wrote``: a put."""
        return self._slots.guard([it.name for it, _ in jobs], used, wrote)

    async def _copy(self, op: Op, pairs: list[tuple[Item, torch.Tensor]], into_peer: bool,
                    one_sided: bool = False) -> tuple[list[int], bool]:
        """Copy every item of one op; return the export id of each item's buffer (0 if empty) and
        whether the op is complete here (``one_sided`` asked for and every export has a slot:
        the copies were done under the slots' locks and the words still hold the exports)."""
        jobs = [(it, t) for it, t in pairs if it.count]
        after = self.engine.mark([t for _, t in jobs]) if jobs else None  # the caller's stream, before any await
        if after and (not into_peer or self.one_sided):
            # a get writes into the caller's tensors: wait for its stream here, so that the copy
            # itself is short and an abandoned get can wait for it (bounded) before it raises; a
            # put under slot locks likewise, so that the peer's export words are locked for the copy only,
            # not for the caller's queued work (an unregister waits for the locks, up to 2 s)
            await self._await_marks(op, after)
            after = None
        handles = self._enter(pairs)
        ids = [h.export_id if h is not None else 0 for h in handles]
        used = [h for h in handles if h is not None]
        if not used:
            return ids, False
        try:
            maps = self._acquire(used, block=False)  # all mapped already: no wait, here on the loop
        except BaseException:
            self._leave(used)
            raise
        if maps is None:  # opening a mapping blocks (driver call, mmap): off the loop
            opening = asyncio.ensure_future(asyncio.to_thread(self._acquire, used))
            try:
                maps = await asyncio.shield(opening)
            except BaseException:
                if opening.done():
                    self._leave(used)
                else:
                    opening.add_done_callback(functools.partial(self._opened_late, used))
                raise
        assert maps is not None  # (blocking acquires return the mappings or raise)
        groups: dict[str, list[tuple[torch.Tensor, torch.Tensor, IpcHandle]]] = {}
        guard = None
        try:
            for (it, t), h, m in zip(jobs, used, maps, strict=True):
                size = t.element_size()
                remote = m.view(h.offset + it.offset * size, it.count * size)
                local = t.detach().reshape(-1).view(torch.uint8)
                pair = (remote, local) if into_peer else (local, remote)
                groups.setdefault(h.device, []).append((*pair, h))
            if self.one_sided:  # the words locked from here until the last copy is over (a header op's too: a
                guard = self._guard(jobs, used, into_peer)  # take-back waits for it, never reuses memory under it)
        except BaseException:
            for h in used:
                self.cache.release(h)
            self._leave(used)
            raise
        # about to write (the caller's tensors, or the peer's buffer): an op abandoned from here on raises
        # only once its copies are over (op.quiet, bounded), so nothing of it writes after it raised (not
        # even into a buffer that a later op over another channel writes); a get's copies wait for
        # nothing, a put's only for the work queued on the caller's stream before the call
        with op.lock:
            op.busy = True
        op.abandon_bound = 30.0
        futs = self._issue_all(op, groups, after, into_peer, guard)
        for fut in futs:
            try:
                await fut
            except EndpointClosedError as exc:  # the channel closed (its bridges with it) meanwhile
                raise PeerLostError(f"{op.kind.value} #{op.op_id}: the channel to {self.channel.peer_name!r} closed "
                                    f"while its cuda_ipc copy was in flight: {self.channel.error}") from exc
            except CompletionError as exc:
                raise TransportError(f"{op.kind.value} #{op.op_id}: a cuda_ipc copy with {self.channel.peer_name!r} "
                                     f"failed: {exc}") from exc
        if guard is None:
            return ids, False
        guard.over()  # (done already by the last copy's completion; idempotent)
        # the peer took a buffer back while the copy ran (it did not wait for us), or it exited (before the channel
        # noticed: our mapping kept its memory)
        if guard.stale is not None:
            raise guard.stale
        if not self.channel.is_open:  # the peer died (or the channel broke) during the copy: its bytes went nowhere
            raise PeerLostError(f"{op.kind.value} #{op.op_id}: the channel to {self.channel.peer_name!r} closed while "
                                f"its cuda_ipc copy ran: {self.channel.error}")
        return ids, one_sided

    async def _await_marks(self, op: Op, marks: Any) -> None:
        if self._marks is None:
            self._marks = CompletionBridge(self.channel.loop, f"transport-ipc-mark-{self.channel.peer_name}")
        for mark in marks:
            try:
                await self._marks.wait(mark)
            except EndpointClosedError as exc:
                raise PeerLostError(f"{op.kind.value} #{op.op_id}: the channel to {self.channel.peer_name!r} closed: "
                                    f"{self.channel.error}") from exc
            except CompletionError as exc:
                raise TransportError(f"{op.kind.value} #{op.op_id}: the work queued on the caller's stream before "
                                     f"the call failed: {exc}") from exc

    def _issue_all(self, op: Op, groups: dict[str, list[tuple[torch.Tensor, torch.Tensor, IpcHandle]]], after: Any,
                   into_peer: bool, guard: SlotGuard | None = None) -> list[asyncio.Future[None]]:
        """Issue each device's copies on its queue; a group that cannot be issued (and every one
        after it) gives its mappings and exports back at once, then the error is raised. The
        slot locks of ``guard`` are checked and released when the last group is over."""
        left = [len(groups)]
        futs: list[asyncio.Future[None]] = []
        items = list(groups.items())
        for i, (device, group) in enumerate(items):
            try:
                futs.append(self._issue(op, device, group, after, left, into_peer, guard))
            except BaseException:
                for _, rest in items[i:]:
                    self._finish_group(op, [h for _, _, h in rest], left, into_peer, guard=guard)
                raise
        return futs

    def _finish_group(self, op: Op, hs: list[IpcHandle], left: list[int], into_peer: bool,
                      batch: Batch | None = None, guard: SlotGuard | None = None) -> None:
        """Any thread, once per group: its copies are over (or were never issued)."""
        with self._lock:
            if batch is not None:
                self._batches.discard(batch)
            left[0] -= 1
            last = left[0] == 0
        try:
            if last and guard is not None:  # every copy of the op is over: check the words, then unlock them
                guard.over()
        finally:
            try:
                for h in hs:
                    self.cache.release(h)
                self._leave(hs)
            finally:
                if last:
                    op.quiet.set()

    def _issue(self, op: Op, device: str, group: list[tuple[torch.Tensor, torch.Tensor, IpcHandle]], after: Any,
               left: list[int], into_peer: bool, guard: SlotGuard | None = None) -> asyncio.Future[None]:
        queue, bridge = self._queue(device)
        hs = [h for _, _, h in group]
        try:
            waitable = queue.copy([(dst, src) for dst, src, _ in group], after)
        except BaseException:  # part of the group may be queued already: over only once the queue is idle
            with contextlib.suppress(Exception):
                queue.synchronize()
            raise
        batch: Batch = Batch(waitable, lambda: self._finish_group(op, hs, left, into_peer, batch, guard))
        with self._lock:
            self._batches.add(batch)
        return bridge.wait(batch)

    # ------------------------------------------------------------------ ops
    async def put(self, op: Op, pairs: list[tuple[Item, torch.Tensor]], notify: bytes | None) -> None:
        op.keep = [t for _, t in pairs]
        ids, alone = await self._copy(op, pairs, into_peer=True, one_sided=notify is None)
        if alone:
            self.channel.finish_here(op)
            return
        self.channel.send(Put(op.op_id, op.seq, self.name, [it for it, _ in pairs], notify, ids), op=op)

    async def get(self, op: Op, pairs: list[tuple[Item, torch.Tensor]]) -> None:
        op.keep = [t for _, t in pairs]
        ids, alone = await self._copy(op, pairs, into_peer=False, one_sided=True)
        if alone:
            self.channel.finish_here(op)
            return
        self.channel.send(Get(op.op_id, op.seq, [it for it, _ in pairs], self.name, ids), op=op)

    @classmethod
    def features(cls) -> dict[str, tuple[bool, str]]:
        return one_sided_feature()

    # ------------------------------------------------------------------ mapping
    maps_peer_memory = True

    async def map(self, name: str) -> torch.Tensor:
        """The peer's buffer ``name`` aliased here (see :meth:`map_blocking`); the mapping is opened
        on a worker thread if it is not open yet. Cancelled: the tensor, once made, is dropped,
        which gives the mapping back."""
        spec = self.channel.peer_specs.get(name)
        if spec is not None and spec.nbytes == 0:
            return torch.empty(spec.shape, dtype=spec.dtype)
        return await asyncio.to_thread(self.map_blocking, name)

    def map_blocking(self, name: str) -> torch.Tensor:
        """Blocking (it may open the peer's allocation): a tensor of the buffer's dtype and shape
        over the peer's memory. While that tensor, or a view of it, lives, the allocation stays
        mapped here and the export counts as in use: the peer's memory is retained for us even
        once it unregisters the buffer, and ``Unmapped`` confirms it only after the last view died.
        CUDA maps peer memory read-write: writes through the tensor change the peer's buffer."""
        spec = self.channel.peer_specs.get(name)
        with self._lock:
            if self._closed or self._quiet:
                raise closed_error(self.channel)
            wb = self.channel.remote_wire.get(name)
            if spec is None or wb is None or wb.ipc is None:
                raise StaleBufferError(f"cuda_ipc: {self.channel.peer_name!r} no longer exports {name!r}")
            h = wb.ipc
            self._busy[h.export_id] = self._busy.get(h.export_id, 0) + 1
        try:
            mapping = self.cache.acquire(h)
        except BaseException:
            self._leave([h])
            raise
        assert mapping is not None  # (a blocking acquire maps or raises)
        held = Held(self, h)
        try:
            raw = mapping.view(h.offset, spec.nbytes, held)
        except BaseException:
            held.drop()
            raise
        return raw.view(spec.dtype).view(spec.shape)

    # ------------------------------------------------------------------ teardown
    def quiesce(self, timeout: float) -> bool:
        """An orderly close (blocking, any thread but the loop's): take no new copies and wait, at
        most ``timeout`` s, until those issued are over; True if they are."""
        with self._lock:
            self._quiet = True
            queues = list(self._queues.values())
        if not queues:
            return True
        done = threading.Event()

        def sync() -> None:
            try:
                for q, _ in queues:
                    q.synchronize()
            except Exception:  # noqa: BLE001 - a failed copy is over too
                pass
            done.set()

        threading.Thread(target=sync, name="transport-ipc-quiesce", daemon=True).start()
        return done.wait(timeout)

    def close(self) -> None:
        """The channel is gone (event loop): on a worker thread, wait for the copies already
        issued, give their mappings back and unmap what only this channel used."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            queues, self._queues = list(self._queues.values()), {}
        live = [wb.ipc for wb in self.channel.remote_wire.values() if wb.ipc is not None]
        if self._marks is not None:
            self._marks.close()

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
            self._slots.close()  # (after the copies: their slot locks go with the views' descriptors)

        threading.Thread(target=drain, name="transport-ipc-close", daemon=True).start()
