"""``shm``: same host, CPU. The initiator copies straight into the peer's memory.

Export (target side, at ``register``): the tensor's bytes move into a ``memfd`` segment and the
user's tensor object is re-pointed at it in place (``Tensor.set_``), so the object the caller holds
keeps working and now lives in shared memory. A tensor that already lies inside an exported segment
(a tied weight registered under a second name, a view of a registered arena) is not moved again: it
shares that segment at an offset. Segments are never named in ``/dev/shm``: one disappears with the
last process that maps it, so a killed process leaks nothing.

Import (initiator side): the peer advertises ``(pid, fd, inode, size, offset, export_id)``; the
initiator opens ``/proc/<pid>/fd/<fd>``, checks the inode (so a recycled pid or fd can never map
the wrong memory), maps the segment once and caches it by inode until the peer's registry stops
naming it. Puts without a notification, and gets, into exports with a slot need no message
(:mod:`.shm_slots`). Otherwise a put copies into the mapping, then sends the header naming the
export ids it wrote as the "done" message; a get copies out, then sends one naming those it read.
The target checks that they are still the buffers' (else it answers ``stale``: the endpoint
refreshes its copy of the peer's registry and retries once) and acknowledges. With slots the copy
runs under their locks too, so a put never lands in a buffer the peer took back and registered again
at the same place (a view of an arena); without (the table full, no OFD locks), a put that raced a
re-registration has written into the old place: harmless when that memory was the unregistered
tensor's alone (``unregister`` moves it out of the segment, unless another endpoint of the process
still exports it: then the tensor stays there).

Cancellation and timeouts: the copy stops at its next chunk boundary (64 MiB, or one bounce buffer
when staged) and sends no header, and the call raises only once it stopped, for puts and gets
alike: nothing of a cancelled op writes into the peer's segment or the caller's tensors after it
raised. The peer's buffer (put) or the caller's tensors (get) may then hold a mix of old and new bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from ctypes import memmove

import torch
from torch.autograd.graph import increment_version

from ..bounce import stage_out
from ..errors import PeerLostError, PlaneUnavailableError, ProtocolError, StaleBufferError
from ..flight_recorder import OpKind
from ..hostinfo import same_host
from ..ranges import item_fits
from ..wire import Get, HostInfo, Item, Message, Put, ShmHandle
from .base import DataPlane, closed_error
from .shm_export import map_segment, memfd_probe
from .shm_slots import SLOTS, TableView, one_sided_feature
from .staged import await_callers_work

__all__ = ["ShmPlane", "StagedShmPlane"]

# Copies of at least this many bytes per op run on a worker thread so the event loop stays free; smaller
# ones run on the loop (under 1 ms at memcpy speed: a thread hand-off costs more than a 1 MiB copy here).
THREAD_COPY_BYTES = 8 << 20
_CHUNK = 64 << 20  # a cancelled copy stops at the next chunk boundary
_SHAPED_MAX = 4096  # whole-buffer views kept per mapped segment (ShmPlane._remote; then it starts afresh)
_ABANDON_S = 10.0  # the longest a cancelled op waits for its copy to reach that boundary (a badly overloaded host)


def _slots_of(jobs: list[tuple[Item, torch.Tensor, ShmHandle]]) -> list[tuple[int, int]] | None:
    """``(slot, export_id)`` of each job's export, or None unless every one has a slot in one table."""
    ok = all(0 < h.slot < SLOTS for _, _, h in jobs) and len({h.table_inode for _, _, h in jobs}) <= 1
    return [(h.slot, h.export_id) for _, _, h in jobs] if ok else None


def _move(into_peer: bool, remote: int, t: torch.Tensor, n: int) -> None:
    """Copy ``n`` bytes between the contiguous CPU tensor ``t`` and address ``remote`` in a peer's mapped
    segment (the range checked by the caller); a write into ``t`` bumps its version counter, as ``copy_``
    would, so autograd sees it."""
    if into_peer:
        memmove(remote, t.data_ptr(), n)
    else:
        memmove(t.data_ptr(), remote, n)
        increment_version(t)


class ShmPlane(DataPlane):
    name = "shm"
    inline_payload = False
    answers_on_loop = True  # (a registry update left to the thread waits at most the stall bound: ops check words)

    def __init__(self, channel) -> None:
        super().__init__(channel)
        self._maps: dict[int, torch.Tensor] = {}  # segment inode -> its bytes, mapped
        # segment inode -> (its mapping in _maps, views of it typed and shaped like the tensors of ops on
        # it, by (start, dtype, shape)): a state dict's put makes no new view per tensor (see _remote)
        self._shaped: dict[int, tuple[torch.Tensor, dict[tuple[int, torch.dtype, torch.Size], torch.Tensor]]] = {}
        self._ro_maps: dict[int, torch.Tensor] = {}  # the same, mapped read-only (Endpoint.map)
        self._tables: dict[int, TableView] = {}  # the peer's slot table (by inode): one-sided puts and gets
        self._closed = False  # the channel is gone: no table may be opened (and kept) any more

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return memfd_probe()

    @classmethod
    def reaches(cls, local: HostInfo, remote: HostInfo) -> tuple[bool, str]:
        return same_host(local, remote)

    def _handle(self, item: Item) -> ShmHandle:
        wb = self.channel.remote_wire.get(item.name)  # (a registry newer than the op's plan may have come since:
        if wb is None or not item_fits(item, wb) or (wb.shm is None and wb.device != "cpu"):  # re-planned on retry)
            raise StaleBufferError(f"shm: peer {self.channel.peer_name!r} unregistered or re-registered {item.name!r}")
        if wb.shm is None:
            raise PlaneUnavailableError(f"shm: peer {self.channel.peer_name!r} exports no segment for {item.name!r}")
        return wb.shm

    def _view(self, item: Item, h: ShmHandle, itemsize: int) -> torch.Tensor:
        seg = self._maps.get(h.inode)
        if seg is None:
            seg = self._maps[h.inode] = map_segment(h)
        start = h.offset + item.offset * itemsize
        end = start + item.count * itemsize
        if h.offset < 0 or start < 0 or end > seg.numel():  # (a hostile handle: specs_from_wire refuses these)
            raise ProtocolError(f"shm: peer {self.channel.peer_name!r} exports {item.name!r} at bytes "
                                f"[{start}, {end}) of a {seg.numel()}-byte segment")
        return seg[start:end]

    def _remote(self, item: Item, h: ShmHandle, t: torch.Tensor) -> torch.Tensor:
        """The peer's bytes of ``item`` for :meth:`_copy_one` to copy to or from ``t``: for a copy of
        one chunk, a view of the mapping typed and shaped like ``t``; for a whole buffer (the state
        dict case) that view is made once and kept while the segment stays mapped (at a few
        microseconds per view, a state dict of small tensors otherwise spends more making views than
        copying). A bigger copy gets the bytes (:meth:`_view`). Any thread."""
        size = t.element_size()
        if item.count * size > _CHUNK:
            return self._view(item, h, size)
        if item.shape is None:  # a range: its views are not kept (an op per offset would fill the cache)
            return self._view(item, h, size).view(t.dtype).view(t.shape)
        key = (h.offset, t.dtype, t.shape)
        seg = self._maps.get(h.inode)
        entry = self._shaped.get(h.inode)
        if seg is not None and entry is not None and entry[0] is seg:
            view = entry[1].get(key)
            if view is not None:
                return view
        view = self._view(item, h, size).view(t.dtype).view(t.shape)  # (maps the segment; checks the range)
        seg = self._maps.get(h.inode)
        if seg is not None:
            if entry is None or entry[0] is not seg:
                entry = self._shaped[h.inode] = (seg, {})
            if len(entry[1]) >= _SHAPED_MAX:  # (a segment whose buffers the peer re-registers over and over)
                entry[1].clear()
            entry[1][key] = view
            if self._maps.get(h.inode) is not seg:  # (registry_changed dropped the segment meanwhile: so do we)
                self._shaped.pop(h.inode, None)
        return view

    async def _copy(self, op, pairs: list[tuple[Item, torch.Tensor]], into_peer: bool,
                    header: Callable[[list[int]], Message]) -> None:
        """Copy every item of one op, then send ``header(ids)`` (the export id of each item's buffer, 0
        if empty) from the copying thread, unless the op was abandoned meanwhile.

        Runs on a worker thread when the op is large or a segment still has to be mapped (that
        thread sends the header as soon as the copy is over: no trip back through the event loop).
        Cancellation and timeouts: the op's copy stops at the next chunk boundary and sends nothing,
        and the call raises only once it stopped (the channel's abandon waits for ``op.quiet``, off
        the loop, up to ``op.abandon_bound``), a put's as well as a get's: nothing of a cancelled op
        writes into the peer's segment or the caller's tensors after it raised, so an op that
        follows never races it.
        """
        handles = [self._handle(it) if it.count else None for it, _ in pairs]
        ids = [h.export_id if h is not None else 0 for h in handles]
        jobs = [(it, t, h) for (it, t), h in zip(pairs, handles, strict=True) if h is not None]
        # with slots in one table (as usual) the copy runs under their locks, as a one-sided op's does (staged too)
        slots = _slots_of(jobs) if jobs else None
        slotted, table = slots is not None, self._tables.get(jobs[0][2].table_inode) if slots else None

        def work() -> None:
            view_of = table if table is not None or not slotted else self._table(jobs[0][2])
            views = [self._remote(item, h, t) for item, t, h in jobs]  # maps first
            with op.lock:  # about to write (the peer's segment, or the caller's tensors): tell _abandon
                if op.abandoned:
                    return
                op.abandon_bound = self._abandon_bound
                op.busy = True
            try:
                if not self._copy_all(op, jobs, views, into_peer, view_of, slots or []):
                    return
            finally:
                op.quiet.set()
            with op.lock:  # atomic with _abandon_now: once it returns, the header went out or never will
                if not op.abandoned:
                    self.channel.send(header(ids), op=op)

        total = sum(t.numel() * t.element_size() for _, t, _ in jobs)
        if jobs and (self.always_threaded or total >= THREAD_COPY_BYTES or (slotted and table is None)
                     or any(h.inode not in self._maps for _, _, h in jobs)):
            await self.threaded(work, hold=into_peer)  # (a put's bytes and header first; a get holds nothing)
        else:
            work()

    def _copy_all(self, op, jobs: list, views: list[torch.Tensor], into_peer: bool, view_of: TableView | None,
                  slots: list[tuple[int, int]]) -> bool:
        """Copy every job's bytes, under the slots' shared locks with ``view_of`` (checked before and
        after: :class:`StaleBufferError`); False if the op was abandoned meanwhile."""
        if view_of is not None:
            try:
                view_of.enter(slots, [it.name for it, _, _ in jobs])
            except PeerLostError as exc:  # (its table closed with the channel: say why it closed)
                raise exc if self.channel.is_open else closed_error(self.channel) from exc
        try:
            for (_, t, _), remote in zip(jobs, views, strict=True):
                if op.abandoned or not self._copy_one(op, t, remote, into_peer):
                    return False
            if view_of is not None:
                view_of.check(slots, into_peer)
            return True
        finally:
            if view_of is not None:
                view_of.leave([s for s, _ in slots])

    #: copy on a worker thread whatever the size (a copy that waits for a device)
    always_threaded = False
    @property
    def _abandon_bound(self) -> float:
        """How long an abandoned op's copy may take to reach its next chunk boundary (seconds)."""
        return _ABANDON_S

    def _copy_one(self, op, t: torch.Tensor, remote: torch.Tensor, into_peer: bool) -> bool:
        """Copy between ``t`` and ``remote`` (its bytes in the peer's segment, or a view of them
        shaped like ``t``: :meth:`_remote`), in chunks; False if the op was abandoned meanwhile
        (the copy stopped)."""
        step = max(1, _CHUNK // t.element_size())
        if remote.dtype == t.dtype and remote.shape == t.shape and t.numel() <= step:
            local = t  # (one chunk, viewed as t already: no reshaping)
        else:
            local, remote = t.reshape(-1), remote.view(t.dtype)
        dst, src = (remote, local) if into_peer else (local, remote)
        if local.numel() <= step:  # one chunk (small ops: no slicing)
            if op.abandoned:
                return False
            dst.copy_(src)
            return True
        channel = self.channel
        for i in range(0, local.numel(), step):
            if op.abandoned or not channel.is_open:  # (a lost channel: the peer's memory is nobody's any more)
                return False
            dst[i : i + step].copy_(src[i : i + step])
        return True

    async def put(self, op, pairs: list[tuple[Item, torch.Tensor]], notify: bytes | None) -> None:
        if notify is None and self.one_sided and await self._one_sided(op, pairs, True):
            return
        items = [it for it, _ in pairs]
        await self._copy(op, pairs, True, lambda ids: Put(op.op_id, op.seq, self.name, items, notify, ids))

    async def get(self, op, pairs: list[tuple[Item, torch.Tensor]]) -> None:
        if self.one_sided and await self._one_sided(op, pairs, False):
            return
        items = [it for it, _ in pairs]
        await self._copy(op, pairs, False, lambda ids: Get(op.op_id, op.seq, items, self.name, ids))

    #: puts without a notification, and gets, into exports that have a slot: no message at all
    one_sided = True

    async def _one_sided(self, op, pairs: list[tuple[Item, torch.Tensor]], into_peer: bool) -> bool:
        """The op without a round trip (:mod:`transport.planes.shm_slots`): lock each export's
        slot shared, check it still holds the export, copy, check again, unlock, and finish the op
        here. False (nothing done) if an export has no slot: the op then takes the header and
        acknowledgement. Cancellation and timeouts as for :meth:`_copy`: the copy stops at its next
        chunk and the call raises once it stopped; the slot locks are released either way."""
        jobs = [(it, t, self._handle(it)) for it, t in pairs if it.count]
        if (slots := _slots_of(jobs)) is None:  # (an export without a slot, or a hostile one: the header path's)
            return False
        table = self._tables.get(jobs[0][2].table_inode) if jobs else None

        def work() -> bool:
            view_of = table if table is not None else (self._table(jobs[0][2]) if jobs else None)
            views = [self._remote(item, h, t) for item, t, h in jobs]  # maps first
            with op.lock:  # about to write (the peer's segment, or the caller's tensors): tell _abandon
                if op.abandoned:
                    return False
                op.abandon_bound = self._abandon_bound
                op.busy = True
            try:
                if view_of is None:
                    return True
                # (a channel lost during the copy: the peer died, its bytes went nowhere; lose() failed the op)
                return self._copy_all(op, jobs, views, into_peer, view_of, slots) and self.channel.is_open
            finally:
                op.quiet.set()

        total = sum(t.numel() * t.element_size() for _, t, _ in jobs)
        if jobs and (self.always_threaded or total >= THREAD_COPY_BYTES or table is None
                     or any(h.inode not in self._maps for _, _, h in jobs)):
            done = await self.threaded(work, hold=into_peer)
        else:
            done = work()
        if done:
            self.channel.finish_here(op)
        return True

    def run_here(self, kind, pairs: list[tuple[Item, torch.Tensor]]) -> bool:
        """A one-sided put or get done synchronously on the loop (see :meth:`DataPlane.run_here`):
        when every export has a slot, the slot table and every segment are mapped already and the
        copy is under :data:`THREAD_COPY_BYTES`. No op object, no future, no timeout scope: the
        copy cannot wait, so nothing can cancel it halfway; the flight recorder still gets the op.
        The bytes move with one ``memmove`` per item between the caller's tensor and the mapping
        (both contiguous CPU memory; the range is checked against the mapping's length first), not
        through tensor views: at 4 KiB the views cost more than the copy."""
        ch = self.channel
        if not self.one_sided or not ch.is_open:
            return False
        wire, maps, tables = ch.remote_wire, self._maps, self._tables
        table = None
        total = 0
        jobs = []
        for it, t in pairs:
            if not it.count:
                continue
            wb = wire.get(it.name)  # (as for _handle: the item must fit the buffer the peer announces now)
            if wb is None or (h := wb.shm) is None or not 0 < h.slot < SLOTS or not t.is_cpu or not item_fits(it, wb):
                return False
            seg = maps.get(h.inode)
            view = tables.get(h.table_inode)
            if seg is None or view is None or (table is not None and view is not table):
                return False
            table = view
            n = it.count * t.element_size()
            start = h.offset + it.offset * t.element_size()
            if h.offset < 0 or start < 0 or start + n > seg.numel():  # (a hostile handle: _view raises)
                return False
            total += n
            if total >= THREAD_COPY_BYTES:  # (as soon as it is known: a state dict need not be walked to its end)
                return False
            jobs.append((h.slot, h.export_id, it.name, seg, start, t, n))
        t_posted = time.time()
        try:
            if table is not None:
                try:  # (a table closed with the channel raises: say why it closed)
                    if len(jobs) == 1:
                        slot, export_id, name, seg, start, t, n = jobs[0]
                        table.enter1(slot, export_id, name)
                        try:
                            _move(kind is OpKind.PUT, seg.data_ptr() + start, t, n)
                            table.check1(slot, export_id, kind is OpKind.PUT)
                        finally:
                            table.leave1(slot)
                    else:
                        slots = [(slot, export_id) for slot, export_id, *_ in jobs]
                        table.enter(slots, [name for _, _, name, *_ in jobs])
                        try:
                            into_peer = kind is OpKind.PUT
                            for _, _, _, seg, start, t, n in jobs:
                                _move(into_peer, seg.data_ptr() + start, t, n)
                            table.check(slots, into_peer)
                        finally:
                            table.leave([s for s, _ in slots])
                except PeerLostError as exc:  # (not the peer's exit found by a check: the channel is open then)
                    raise exc if ch.is_open else closed_error(ch) from exc
            if not ch.is_open:  # the peer died (or the channel broke) during the copy: its bytes went nowhere
                raise closed_error(ch, "was lost during the copy")
        except BaseException as exc:
            ch.record_here(kind, [it.name for it, _ in pairs], total, self.name, t_posted, exc)
            raise
        ch.record_here(kind, [it.name for it, _ in pairs], total, self.name, t_posted)
        return True

    def staged_twin(self) -> DataPlane | None:
        return StagedShmPlane(self.channel, self)

    @classmethod
    def features(cls) -> dict[str, tuple[bool, str]]:
        return one_sided_feature()

    def _table(self, h: ShmHandle) -> TableView:
        """The peer's slot table, opened once per channel (a worker thread, the first time)."""
        view = self._tables.get(h.table_inode)
        if view is None:
            view = TableView(h.pid, h.table_fd, h.table_inode)
            have = self._tables.setdefault(h.table_inode, view)
            if have is not view:
                view.close()
                view = have
            if self._closed:  # the channel closed while this was being opened: nothing may keep it
                self._tables.pop(h.table_inode, None)
                view.close()
                raise closed_error(self.channel)
        return view

    maps_peer_memory = True

    async def map(self, name: str) -> torch.Tensor:
        spec = self.channel.peer_specs.get(name)
        if spec is not None and spec.device != "cpu":
            raise PlaneUnavailableError(f"shm: {name!r} is on {spec.device}; only CPU buffers can be mapped over shm")
        return self.map_readonly(name)

    def map_readonly(self, name: str) -> torch.Tensor:
        """The peer's buffer ``name`` as a read-only tensor of its dtype and shape, aliasing its
        memory. One mapping per segment, cached like the copy path's (so its pages fault in once)."""
        wb = self.channel.remote_wire.get(name)
        spec = self.channel.peer_specs.get(name)
        if wb is None or spec is None:
            raise StaleBufferError(f"shm: peer {self.channel.peer_name!r} no longer exports {name!r}")
        if spec.nbytes == 0:
            return torch.empty(spec.shape, dtype=spec.dtype)
        h = wb.shm
        if h is None:
            raise PlaneUnavailableError(f"shm: peer {self.channel.peer_name!r} exports no segment for {name!r} "
                                        f"(a {spec.device} buffer)")
        seg = self._ro_maps.get(h.inode)
        if seg is None:
            seg = self._ro_maps[h.inode] = map_segment(h, writable=False)
        return seg[h.offset : h.offset + spec.nbytes].view(spec.dtype).view(spec.shape)

    def registry_changed(self) -> None:
        live = {wb.shm.inode for wb in self.channel.remote_wire.values() if wb.shm is not None}
        for maps in (self._maps, self._ro_maps, self._shaped):
            for inode in [i for i in list(maps) if i not in live]:
                maps.pop(inode, None)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._closed = True
        self._maps.clear()
        self._ro_maps.clear()
        self._shaped.clear()
        tables, self._tables = list(self._tables.values()), {}
        for view in tables:
            view.close()


class StagedShmPlane(ShmPlane):
    """``shm`` for ops whose tensors on this side are staged (on a GPU), with the peer's buffers
    in its CPU segments: the bytes go through this endpoint's pinned bounce buffers
    (:mod:`transport.staging`), in pipelined chunks with bounded memory, between the device and
    the peer's mapped segment. A put copies chunk after chunk device -> bounce buffer
    (asynchronously, up to the ring's size ahead) and bounce buffer -> segment; a get copies
    segment -> bounce buffer, then bounce buffer -> device. Before any of it, the caller's
    queued GPU work is awaited on the event loop (:func:`~transport.planes.staged.await_callers_work`),
    as on the staged plane: the op is *gated* (later ops on the channel go out after it), and
    its copies wait for nothing. The wire is ``shm``'s: the header follows the copy. A copy that
    fails or stalls fails the op with :class:`~transport.errors.StagingError`; nothing was sent,
    the channel stays usable, and a put may have written part of the peer's buffer (as any
    failed or cancelled ``shm`` put). It shares the channel's ``shm`` plane's mappings."""

    sends_at_once = False
    always_threaded = True
    one_sided = False  # (its copies wait for the staging engine: kept on the header's path)

    def __init__(self, channel, base: ShmPlane) -> None:
        super().__init__(channel)
        self._maps = base._maps  # one mapping per segment for both (the base drops stale ones)

    def _remote(self, item: Item, h: ShmHandle, t: torch.Tensor) -> torch.Tensor:
        return self._view(item, h, t.element_size())  # (its copies go by bytes, through the bounce buffers)

    @property
    def _abandon_bound(self) -> float:  # (a chunk may wait for the staging engine, up to its stall bound)
        cfg = self.channel.staging.config
        return cfg.stall_timeout + 0.1 * cfg.buffers + 1.0 + _ABANDON_S

    async def _copy(self, op, pairs: list[tuple[Item, torch.Tensor]], into_peer: bool,
                    header: Callable[[list[int]], Message]) -> None:
        await await_callers_work(self.channel, op, [t for _, t in pairs])
        if not into_peer:
            op.staged = True  # an abandoned get waits for its copies up to the staging bound
        await super()._copy(op, pairs, into_peer, header)

    def _copy_one(self, op, t: torch.Tensor, remote: torch.Tensor, into_peer: bool) -> bool:
        staging = self.channel.staging
        if not staging.stages(t.device):
            return super()._copy_one(op, t, remote, into_peer)
        flat = t.detach().reshape(-1).view(torch.uint8)
        if into_peer:
            ring = staging.ring(staging.engine(t.device), flat.numel())
            chunks = stage_out(flat, ring, staging.config.stall_timeout)
            try:
                pos = 0
                for view in chunks:
                    if op.abandoned:
                        return False
                    chunk = torch.frombuffer(view, dtype=torch.uint8)
                    remote[pos : pos + chunk.numel()].copy_(chunk)
                    pos += chunk.numel()
            finally:
                chunks.close()  # waits for the copies in flight (bounded)
                ring.release()
            return True
        pos, halted = 0, False

        def fill(view: memoryview, more: int) -> None:
            nonlocal pos
            n = len(view)
            if not halted:  # once no more is written, the rest needs no reading: no stream to keep in step
                torch.frombuffer(view, dtype=torch.uint8).copy_(remote[pos : pos + n])
            pos += n

        def halt() -> None:
            nonlocal halted
            halted = True

        def stuck() -> None:
            op.stuck = True
            halt()

        return staging.receive(flat, fill, stop=lambda: op.abandoned, on_stop=halt, on_stuck=stuck)
