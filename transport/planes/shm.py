"""``shm``: same host, CPU. The initiator copies straight into the peer's memory.

Export (target side, at ``register``): the tensor's bytes move into a
``memfd`` segment and the user's tensor object is re-pointed at it in place
(``Tensor.set_``), so the object the caller holds keeps working and now lives
in shared memory. A tensor that already lies inside an exported segment (a
tied weight registered under a second name, a view of a registered arena) is
not moved again: it shares that segment at an offset. Segments are never
named in ``/dev/shm``: one disappears with the last process that maps it, so a
killed process leaks nothing.

Import (initiator side): the peer advertises ``(pid, fd, inode, size,
offset, export_id)``; the initiator opens ``/proc/<pid>/fd/<fd>``, checks the
inode (so a recycled pid or fd can never map the wrong memory), maps the
segment once and caches it by inode until the peer's registry stops naming
it. A put copies into the mapping, then sends the header, naming the export
ids it wrote, as the "done" message; a get copies out, then sends a header
naming the export ids it read. The target checks that those are still the
buffers' (a buffer re-registered meanwhile is answered with ``stale``, and
the endpoint retries once after refreshing its copy of the peer's registry)
and acknowledges. A put that raced a re-registration has then written into
the old place: harmless when that memory was the unregistered tensor's alone
(``unregister`` moves such a tensor out of the segment), but if the old place
still belongs to another registered buffer (a view of an arena), that
buffer's bytes there were overwritten.
"""

from __future__ import annotations

import asyncio
import itertools
import mmap
import os
from dataclasses import dataclass

import torch

from ..errors import PlaneUnavailableError, StaleBufferError
from ..hostinfo import same_host
from ..registry import LocalBuffer
from ..wire import Get, HostInfo, Item, Put, ShmHandle
from .base import DataPlane

__all__ = ["Segment", "ShmExport", "ShmPlane", "export_buffer"]

# Copies of at least this many bytes per op run on a worker thread so the event loop stays free.
THREAD_COPY_BYTES = 1 << 20
_CHUNK = 64 << 20  # a cancelled copy stops at the next chunk boundary


_export_ids = itertools.count(1)


@dataclass
class Segment:
    """One memfd segment of the target endpoint, shared by the buffers inside it.

    It holds its storage while any buffer exports it, so its addresses can never
    be reused by another allocation that a later registration might mistake for it.
    """

    fd: int
    inode: int
    size: int
    storage: torch.UntypedStorage | None
    refs: int = 1

    def holds(self, t: torch.Tensor) -> bool:
        return self.storage is not None and t.untyped_storage().data_ptr() == self.storage.data_ptr()


@dataclass
class ShmExport:
    """A registered buffer's place in a segment."""

    segment: Segment
    handle: ShmHandle

    def close(self) -> bool:
        """Stop exporting; the segment's fd closes with its last buffer (then True is returned).
        Existing mappings stay valid."""
        seg = self.segment
        seg.refs -= 1
        if seg.refs == 0 and seg.fd >= 0:
            os.close(seg.fd)
            seg.fd = -1
            seg.storage = None
            return True
        return False


def export_buffer(buf: LocalBuffer, segments: list[Segment]) -> ShmExport | None:
    """Make ``buf`` reachable through shared memory (None for an empty buffer).

    Reuses a live segment in ``segments`` whose storage the tensor already views
    (a tied weight, a view of a registered arena); otherwise moves the tensor into
    a new segment in place and appends it.
    """
    t = buf.tensor
    nbytes = buf.spec.nbytes
    if nbytes == 0:
        return None
    for seg in segments:
        if seg.fd >= 0 and seg.holds(t):
            seg.refs += 1
            offset = t.data_ptr() - seg.storage.data_ptr()  # type: ignore[union-attr]
            return ShmExport(seg, ShmHandle(os.getpid(), seg.fd, seg.inode, seg.size, offset, next(_export_ids)))
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
    segments[:] = [s for s in segments if s.fd >= 0]
    segments.append(seg)
    return ShmExport(seg, ShmHandle(os.getpid(), fd, seg.inode, nbytes, 0, next(_export_ids)))


def _caller_marks(tensors: list[torch.Tensor]) -> dict[torch.device, torch.cuda.Event]:
    """An event per CUDA device of ``tensors``, recorded on the calling thread's current stream."""
    marks: dict[torch.device, torch.cuda.Event] = {}
    for t in tensors:
        if t.is_cuda and t.device not in marks:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            marks[t.device] = event
    return marks


def _map(handle: ShmHandle) -> torch.Tensor:
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
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
        mm = mmap.mmap(fd, handle.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)


class ShmPlane(DataPlane):
    name = "shm"
    inline_payload = False

    def __init__(self, channel) -> None:
        super().__init__(channel)
        self._maps: dict[int, torch.Tensor] = {}  # segment inode -> its bytes, mapped

    @classmethod
    def probe(cls) -> tuple[bool, str]:
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

    @classmethod
    def reaches(cls, local: HostInfo, remote: HostInfo) -> tuple[bool, str]:
        return same_host(local, remote)

    def _handle(self, item: Item) -> ShmHandle:
        wb = self.channel.remote_wire.get(item.name)
        if wb is None or wb.shm is None:
            raise PlaneUnavailableError(f"shm: peer {self.channel.peer_name!r} exports no segment for {item.name!r}")
        return wb.shm

    def _view(self, item: Item, h: ShmHandle, itemsize: int) -> torch.Tensor:
        seg = self._maps.get(h.inode)
        if seg is None:
            seg = self._maps[h.inode] = _map(h)
        start = h.offset + item.offset * itemsize
        return seg[start : start + item.count * itemsize]

    async def _copy(self, op, pairs: list[tuple[Item, torch.Tensor]], into_peer: bool) -> list[int]:
        """Copy every item of one op; return the export id of each item's buffer (0 if empty).

        Runs on a worker thread when the op is large or a segment still has to be
        mapped; a cancelled or timed-out op stops at the next chunk boundary. A CUDA
        tensor of ours (the peer's buffer is CPU memory) is copied with synchronous
        ``copy_`` calls on the copying thread's current stream, which first waits (on the
        GPU) for the work queued on the caller's current stream at the call: bytes a side
        stream writes just before a put are the ones sent, and a get's bytes land after
        the caller's queued work on the destination.
        """
        handles = [self._handle(it) if it.count else None for it, _ in pairs]
        ids = [h.export_id if h is not None else 0 for h in handles]
        jobs = [(it, t, h) for (it, t), h in zip(pairs, handles, strict=True) if h is not None]
        if not jobs:
            return ids
        marks = _caller_marks([t for _, t, _ in jobs])  # here, in the caller's thread, before any await

        def work() -> None:
            for device, mark in marks.items():  # the copies (on this thread's stream) follow the caller's work
                torch.cuda.current_stream(device).wait_event(mark)
            views = [self._view(item, h, t.element_size()).view(t.dtype) for item, t, h in jobs]  # maps first
            if not into_peer:  # about to write into the caller's tensors: tell _abandon
                with op.lock:
                    if op.abandoned:
                        return
                    op.busy = True
            try:
                for (_, t, _), remote in zip(jobs, views, strict=True):
                    local = t.reshape(-1)
                    step = max(1, _CHUNK // t.element_size())
                    for i in range(0, local.numel(), step):
                        if op.abandoned:
                            return
                        if into_peer:
                            remote[i : i + step].copy_(local[i : i + step])
                        else:
                            local[i : i + step].copy_(remote[i : i + step])
            finally:
                op.quiet.set()

        total = sum(t.numel() * t.element_size() for _, t, _ in jobs)
        if total >= THREAD_COPY_BYTES or any(h.inode not in self._maps for _, _, h in jobs):
            await asyncio.get_running_loop().run_in_executor(None, work)
        else:
            work()
        return ids

    async def put(self, op, pairs: list[tuple[Item, torch.Tensor]], notify: bytes | None) -> None:
        ids = await self._copy(op, pairs, into_peer=True)
        self.channel.send(Put(op.op_id, op.seq, self.name, [it for it, _ in pairs], notify, ids), op=op)

    async def get(self, op, pairs: list[tuple[Item, torch.Tensor]]) -> None:
        ids = await self._copy(op, pairs, into_peer=False)
        self.channel.send(Get(op.op_id, op.seq, [it for it, _ in pairs], self.name, ids), op=op)

    def registry_changed(self) -> None:
        live = {wb.shm.inode for wb in self.channel.remote_wire.values() if wb.shm is not None}
        for inode in [i for i in list(self._maps) if i not in live]:
            self._maps.pop(inode, None)

    def close(self) -> None:
        self._maps.clear()
