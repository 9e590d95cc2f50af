"""``shm``'s target side: the memfd segments that registered CPU tensors live in, their exports,
the slot table that makes peers' puts and gets one-sided, and mapping a peer's segment.

The plane itself (:class:`~transport.planes.shm.ShmPlane`, the initiator side) is in
:mod:`transport.planes.shm`; see its docstring for the protocol.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from ..errors import PlaneUnavailableError, StaleBufferError
from ..registry import LocalBuffer
from ..wire import ShmHandle
from .base import Exporter
from .shm_slots import ExportSlots, SlotTable, new_slot_table

__all__ = ["Segment", "ShmExport", "ShmExporter", "SlotTable", "export_buffer", "map_segment", "memfd_probe",
           "new_segment", "new_slot_table"]

log = logging.getLogger(__name__)

# Every live segment of this process, by its storage's address, whichever endpoint made it: a tensor
# that lies in one already (registered with another endpoint of this process) is exported from it by
# the next endpoint too, never moved again (which would leave the first endpoint's export on memory
# the tensor no longer uses). Segments' ``exports`` list the exports of all endpoints; the lock guards
# them and this index (endpoints may run on different threads). ``_MOVES`` is held (outside
# ``_LIVE_LOCK``) across every move of a tensor into or out of a segment, with the look for a segment
# before it: an export's last release and its copy back to private memory are one step to another
# endpoint exporting the same tensor at the same time (which would otherwise move it into a segment
# of its own while the copy back moved it out again).
_LIVE: dict[int, Segment] = {}
_LIVE_LOCK = threading.Lock()
_MOVES = threading.Lock()


def _after_fork() -> None:  # (a forked child's endpoints are its own: nothing shared with the parent's)
    global _LIVE_LOCK, _MOVES
    _LIVE.clear()
    _LIVE_LOCK, _MOVES = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def memfd_probe() -> tuple[bool, str]:
    """Whether memfd segments can be made and reopened through ``/proc`` here, and why."""
    if not hasattr(os, "memfd_create"):
        return False, "os.memfd_create is missing (not Linux?)"
    try:
        fd = os.memfd_create("transport-probe", os.MFD_CLOEXEC)
    except OSError as exc:
        return False, f"memfd_create failed: {exc}"
    try:
        os.ftruncate(fd, 4096)
        fd2 = os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR)
        os.close(fd2)
    except OSError as exc:
        return False, f"cannot reopen a memfd through /proc: {exc}"
    finally:
        os.close(fd)
    return True, "memfd segments can be shared through /proc/<pid>/fd"


_export_ids = itertools.count(1)


@dataclass(eq=False)  # (identity: a segment is one memfd)
class Segment:
    """One memfd segment of the target endpoint, shared by the buffers inside it.

    It holds its storage while any buffer exports it, so its addresses can never
    be reused by another allocation that a later registration might mistake for it.
    """

    fd: int
    inode: int
    size: int
    storage: torch.UntypedStorage | None
    exports: list[ShmExport] = field(default_factory=list)  # its live exports, every endpoint's (under _LIVE_LOCK)
    # tensors whose unregister asked for the copy back while only exports of that same tensor (another
    # endpoint's) kept the segment: the last export moves them out (ShmExport.close)
    copy_back: list[weakref.ref[torch.Tensor]] = field(default_factory=list)

    def holds(self, t: torch.Tensor) -> bool:
        return self.storage is not None and t.untyped_storage().data_ptr() == self.storage.data_ptr()

    def close(self, *, drop_storage: bool = True) -> None:
        """Close the fd (idempotent); existing mappings stay valid. ``drop_storage``: also let go
        of the storage (a failed registration keeps it: the caller's tensor still lies in it)."""
        with _LIVE_LOCK:
            self.close_locked(drop_storage=drop_storage)

    def close_locked(self, *, drop_storage: bool = True) -> None:
        """:meth:`close`, with ``_LIVE_LOCK`` held by the caller (so that no other endpoint starts
        to export the segment between the caller's look at :attr:`exports` and the close)."""
        if self.storage is not None and _LIVE.get(self.storage.data_ptr()) is self:
            del _LIVE[self.storage.data_ptr()]
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if drop_storage:
            self.storage = None


@dataclass(eq=False)
class ShmExport:
    """A registered buffer's place in a segment (and its word in the slot table, if any)."""

    segment: Segment
    handle: ShmHandle
    table: SlotTable | None = None
    name: str = ""
    moved_marked: bool = False  # its slot says the owner re-pointed the tensor
    tensor: weakref.ref[torch.Tensor] | None = None  # the tensor exported

    def close(self, wait: bool = True, nbytes: int = 0, copy_back: bool = False) -> bool:
        """Stop exporting (an endpoint's unregister or close, on its event loop thread): first
        revoke the export's slot (waiting, if ``wait``, up to
        :data:`~transport.planes.shm_slots.REVOKE_WAIT_S` for peers' copies in flight on it), so
        no copy of a peer lands after this returns; the segment's fd closes with its last buffer
        (then True is returned). Existing mappings stay valid. A copy that still held the slot
        past the bound (a frozen peer) may still write the export's ``nbytes``: that range is marked
        (the segment stays open while another export shares it), and a buffer registered over it here waits for the slot
        (:func:`export_buffer`); another endpoint that exports the same segment does not know
        of that copy. ``copy_back`` (an unregister asking for the copy back into private memory):
        the tensor is moved out once no export of the segment is left, if the others left now are
        all of this same tensor (another endpoint's); if another tensor (a view, an alias) still
        exports it, it stays where it is. If this close is the segment's last, it makes the copies
        back that the segment owes before any endpoint of this process can export the tensor again."""
        return self._close(wait, nbytes, copy_back, move=True)

    def release(self) -> bool:
        """Let go of an export made without a slot, from any thread (``cuda_ipc``'s memfd
        stand-in's retention): like :meth:`close`, but it moves no tensor out of the segment, not
        even ones an unregister left to the last export (re-pointing a tensor is its owner's
        event loop's to do); such a tensor stays in the segment."""
        return self._close(True, 0, False, move=False)

    def _close(self, wait: bool, nbytes: int, copy_back: bool, move: bool) -> bool:
        table, self.table = self.table, None
        seg = self.segment
        if table is not None and self.handle.slot:
            # always marked: whether another endpoint exports the segment (so that it stays open and
            # may be exported here again) can change until the count below, and a frozen copy keeps
            # the segment's file, hence its inode, alive: a mark never matches other memory
            table.revoke(self.handle.slot, self.name, wait, (("shm", seg.inode), self.handle.offset,
                                                            self.handle.offset + nbytes))
        with _MOVES:
            with _LIVE_LOCK:  # (no other endpoint starts to export it between the count and the close)
                seg.exports = [e for e in seg.exports if e is not self]
                mine = self.tensor() if self.tensor is not None else None
                if copy_back and mine is not None and all(e.tensor is not None and e.tensor() is mine
                                                          for e in seg.exports):
                    seg.copy_back.append(weakref.ref(mine))
                last = not seg.exports and seg.fd >= 0
                where = seg.storage.data_ptr() if last and seg.storage is not None else None
                if last:
                    seg.close_locked()
            if last and move and where is not None:
                for ref in seg.copy_back:
                    t = ref()
                    if t is not None and t.untyped_storage().data_ptr() == where:  # (not discarded, not moved yet)
                        _move_to_private(t)
            if last:
                seg.copy_back.clear()
        return last


def _move_to_private(t: torch.Tensor) -> None:
    """Copy ``t``'s bytes into private memory and re-point ``t`` (in place) there."""
    private = torch.empty_like(t)
    with torch.no_grad():
        private.copy_(t)
        t.set_(private.untyped_storage(), 0, t.shape, t.stride())


def export_buffer(buf: LocalBuffer, segments: list[Segment], table: SlotTable | None = None) -> ShmExport | None:
    """Make ``buf`` reachable through shared memory (None for an empty buffer).

    Reuses a live segment in ``segments`` whose storage the tensor already views
    (a tied weight, a view of a registered arena); otherwise moves the tensor into
    a new segment in place and appends it. With ``table``, the export gets a slot in it
    (peers then put and get without a round trip). A buffer over the place of an export
    revoked while a frozen peer's copy held its slot waits (up to
    :data:`~transport.planes.shm_slots.REVOKE_WAIT_S`, polling) for that copy to let go, then
    raises :class:`~transport.errors.BufferMismatchError` if it has not: that copy could still
    write the new buffer.
    """
    exp = _export_buffer(buf, segments, table)
    if exp is not None and table is not None:
        export_id = exp.handle.export_id
        slot = table.alloc(export_id)
        if slot > 0:
            h = exp.handle
            exp.handle = ShmHandle(h.pid, h.fd, h.inode, h.size, h.offset, export_id, slot, table.fd, table.inode)
            exp.table, exp.name = table, buf.spec.name
    return exp


def _export_buffer(buf: LocalBuffer, segments: list[Segment], table: SlotTable | None) -> ShmExport | None:
    t = buf.tensor
    nbytes = buf.spec.nbytes
    if nbytes == 0:
        return None
    seg, offset = _segment_of(t, segments)
    if seg is not None and table is not None:  # (outside _MOVES: it may wait up to REVOKE_WAIT_S)
        table.wait_clear(("shm", seg.inode), offset, offset + nbytes, buf.spec.name)
    with _MOVES:
        seg, offset = _segment_of(t, segments)  # (again: another endpoint may have moved it meanwhile)
        if seg is not None:
            with _LIVE_LOCK:  # (an unused one, e.g. ep.new_buffer's, may be closed by another endpoint meanwhile)
                exp = None
                if seg.fd >= 0:
                    exp = ShmExport(seg, ShmHandle(os.getpid(), seg.fd, seg.inode, seg.size, offset,
                                                   next(_export_ids)), tensor=weakref.ref(t))
                    seg.exports.append(exp)
            if exp is not None:
                if seg not in segments:  # another endpoint's: ours to close too once no export is left
                    segments.append(seg)
                return exp
        return _move_into_new_segment(buf, t, nbytes, segments)


def _move_into_new_segment(buf: LocalBuffer, t: torch.Tensor, nbytes: int, segments: list[Segment]) -> ShmExport:
    fd = os.memfd_create(f"transport:{buf.spec.name}"[:200], os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        shared = torch.frombuffer(mm, dtype=torch.uint8).view(t.dtype).view(t.shape)
        with torch.no_grad():
            shared.copy_(t)
            t.set_(shared.untyped_storage(), 0, t.shape, t.stride())
        seg = Segment(fd, os.fstat(fd).st_ino, nbytes, t.untyped_storage())
    except BaseException:
        os.close(fd)
        raise
    exp = ShmExport(seg, ShmHandle(os.getpid(), fd, seg.inode, nbytes, 0, next(_export_ids)), tensor=weakref.ref(t))
    seg.exports.append(exp)  # (before the index: no other endpoint sees it unexported)
    segments[:] = [s for s in segments if s.fd >= 0]
    segments.append(_indexed(seg))
    return exp


def _segment_of(t: torch.Tensor, segments: list[Segment]) -> tuple[Segment | None, int]:
    """The live segment ``t``'s storage is, among ``segments`` (the endpoint's) or any other
    endpoint's of this process (a tied weight, a view of a registered arena, a tensor registered
    with two endpoints), and ``t``'s offset in it; or (None, 0)."""
    with _LIVE_LOCK:
        for seg in [*segments, _LIVE.get(t.untyped_storage().data_ptr())]:
            if seg is not None and seg.fd >= 0 and seg.holds(t):
                return seg, t.data_ptr() - seg.storage.data_ptr()  # type: ignore[union-attr]
    return None, 0


def _indexed(seg: Segment) -> Segment:
    with _LIVE_LOCK:
        if seg.storage is not None:
            _LIVE[seg.storage.data_ptr()] = seg
    return seg


def new_segment(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Segment, torch.Tensor]:
    """A zero-filled tensor that lives in a new memfd segment from the start (no copy: the kernel
    provides zero pages on first touch). The segment has no export yet: a
    registration of the tensor shares it (:func:`export_buffer`)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    fd = os.memfd_create(f"transport:{name}"[:200], os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        t = torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape)
        return _indexed(Segment(fd, os.fstat(fd).st_ino, nbytes, t.untyped_storage())), t
    except BaseException:
        os.close(fd)
        raise


def handle_fault(handle: ShmHandle, nbytes: int) -> str | None:
    """What is wrong with a peer's announced shm ``handle`` for a buffer of ``nbytes`` bytes (its
    bytes must lie inside the segment), or None (the handshake's and registry's checks)."""
    if handle.size < nbytes or handle.offset < 0 or handle.offset + nbytes > handle.size:
        return f"lies at bytes [{handle.offset}, {handle.offset + nbytes}) of a {handle.size}-byte segment"
    return None


def map_segment(handle: ShmHandle, writable: bool = True) -> torch.Tensor:
    """Map the peer's segment: its bytes as a uint8 tensor (``writable=False``: a read-only
    mapping; a write through it is a SIGSEGV, so no reader can corrupt what others read)."""
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise StaleBufferError(f"shm: the peer closed its segment {path} (it unregistered the buffer)") from exc
    except OSError as exc:
        raise PlaneUnavailableError(f"shm: cannot open the peer's segment {path}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if st.st_ino != handle.inode or st.st_size < handle.size:
            raise StaleBufferError(
                f"shm: {path} is no longer the peer's segment (inode {st.st_ino} != {handle.inode}"
                f" or size {st.st_size} < {handle.size}); the peer re-registered or closed it"
            )
        # no MAP_POPULATE: CPython holds the GIL through mmap(); pages fault in during the
        # first copy instead, which runs on a worker thread without the GIL
        prot = mmap.PROT_READ | mmap.PROT_WRITE if writable else mmap.PROT_READ
        mm = mmap.mmap(fd, handle.size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)
    if writable:
        return torch.frombuffer(mm, dtype=torch.uint8)
    with warnings.catch_warnings():  # torch warns that it cannot make the tensor read-only: the mapping is
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)




class ShmExporter(Exporter):
    """``shm``'s :class:`~transport.planes.base.Exporter`: a registered CPU tensor's bytes move
    into a memfd segment (or share the one it already lies in) and its export gets a word in the
    endpoint's slot table, made at the first export (one-sided puts and gets; see
    :mod:`transport.planes.shm_slots`). ``segments`` is the endpoint's list of memfd segments,
    shared with the planes that export CPU memory through them (``cuda_ipc``'s CPU stand-in)."""

    plane = "shm"
    wire_field = "shm"

    def __init__(self, endpoint: str, segments: list[Segment]) -> None:
        self.endpoint = endpoint
        self.segments = segments
        self.slot_table = ExportSlots("shm")

    def export(self, buf: LocalBuffer) -> None:
        if "shm" in buf.exports or buf.tensor.device.type != "cpu":
            return
        exp = export_buffer(buf, self.segments, self.slot_table.table())
        if exp is not None:
            buf.exports["shm"] = exp

    def unexport(self, buf: LocalBuffer, *, detach: bool, closing: bool, epoch: int) -> None:
        """Revoke the export's slot (waiting up to :data:`~transport.planes.shm_slots.REVOKE_WAIT_S`
        for peers' copies in flight, unless ``closing``); with ``detach``, a tensor that lived
        alone in its segment has its bytes copied back into private memory (blocking for the
        copy; the tensor object is re-pointed in place), so a peer with a stale mapping can
        never write into it again. While another endpoint of this process still exports the same
        tensor, that copy is left to the last one (its unregister or close makes it, whatever it
        asked: :meth:`ShmExport.close`)."""
        exp = buf.exports.pop("shm", None)
        if exp is None:
            return
        exp.close(wait=not closing, nbytes=buf.spec.nbytes, copy_back=detach)

    def new_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor | None:
        if device.type != "cpu" or torch.Size(shape).numel() == 0:
            return None
        seg, tensor = new_segment(name, shape, dtype)
        self.segments[:] = [s for s in self.segments if s.fd >= 0]
        self.segments.append(seg)  # the tensor lies in it: registering shares it, without a copy
        return tensor

    def new_buffer_failed(self, tensor: torch.Tensor) -> None:
        with _LIVE_LOCK:  # (no other endpoint starts to export it between the look and the close)
            for seg in [s for s in self.segments if not s.exports and s.holds(tensor)]:
                self.segments.remove(seg)
                seg.close_locked(drop_storage=False)  # (a failed registration may have closed it already)

    def forget_unexported(self, tensor: torch.Tensor | None, live: list[torch.Tensor]) -> None:
        for seg in self.segments:
            with _LIVE_LOCK:  # (no export of any endpoint of this process; a view of it still registered keeps it)
                if (not seg.exports and seg.fd >= 0 and (tensor is None or seg.holds(tensor))
                        and not any(seg.holds(t) for t in live)):
                    seg.close_locked()
        self.segments[:] = [s for s in self.segments if s.fd >= 0]

    def tick(self, bufs: list[LocalBuffer]) -> None:
        """Registered CPU tensors re-pointed at other memory since (``module.to()``, ``t.data =``):
        peers put into and get from shm segments without a message, so they cannot be told at
        their op; every heartbeat interval the owner looks, and marks those exports' slots
        (:meth:`~transport.planes.shm_slots.ExportSlots.mark_re_pointed`)."""
        self.slot_table.mark_re_pointed(self.endpoint, bufs)

    def close(self) -> None:
        self.forget_unexported(None, [])
        self.slot_table.close()
