"""``shm``: same host, CPU. The initiator copies straight into the peer's memory.

Export (target side, at ``register``): the tensor's bytes move into a
``memfd`` segment and the user's tensor object is re-pointed at it in place
(``Tensor.set_``), so the object the caller holds keeps working and now lives
in shared memory. The segment is never named in ``/dev/shm``: it disappears
with the last process that maps it, so a killed process leaks nothing.

Import (initiator side): the peer advertises ``(pid, fd, inode, size)``; the
initiator opens ``/proc/<pid>/fd/<fd>``, checks the inode (so a recycled pid
or fd can never map the wrong memory), maps it once and caches the mapping
for the life of the channel. A put copies into the mapping, then sends the
header as the "done" message; the target validates it and acknowledges.
A get copies out of the mapping and needs no message at all.
"""

from __future__ import annotations

import asyncio
import mmap
import os
from dataclasses import dataclass

import torch

from ..errors import PlaneUnavailableError
from ..hostinfo import same_host
from ..registry import LocalBuffer
from ..wire import HostInfo, Item, Put, ShmHandle, WireBuffer
from .base import DataPlane

__all__ = ["ShmExport", "ShmPlane", "export_buffer"]

# Copies at least this large run on a worker thread so the event loop stays free.
THREAD_COPY_BYTES = 1 << 20


@dataclass
class ShmExport:
    """A registered buffer's segment, owned by the target endpoint."""

    fd: int
    handle: ShmHandle

    def close(self) -> None:
        """Stop exporting: new peers cannot map it; existing mappings stay valid."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def export_buffer(buf: LocalBuffer) -> ShmExport | None:
    """Move ``buf.tensor`` into a memfd segment in place; None for an empty buffer."""
    t = buf.tensor
    nbytes = buf.spec.nbytes
    if nbytes == 0:
        return None
    fd = os.memfd_create(f"transport:{buf.spec.name}"[:200], os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        seg = torch.frombuffer(mm, dtype=torch.uint8).view(t.dtype).view(t.shape)
        with torch.no_grad():
            seg.copy_(t)
            t.set_(seg.untyped_storage(), 0, t.shape, t.stride())
        st = os.fstat(fd)
        return ShmExport(fd, ShmHandle(os.getpid(), fd, st.st_ino, nbytes))
    except BaseException:
        os.close(fd)
        raise


def _map(handle: ShmHandle) -> torch.Tensor:
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise PlaneUnavailableError(f"shm: cannot open the peer's segment {path}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if st.st_ino != handle.inode or st.st_size < handle.size:
            raise PlaneUnavailableError(
                f"shm: {path} is not the peer's segment (inode {st.st_ino} != {handle.inode} "
                f"or size {st.st_size} < {handle.size})"
            )
        mm = mmap.mmap(fd, handle.size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8)


class ShmPlane(DataPlane):
    name = "shm"
    inline_payload = False

    def __init__(self, channel) -> None:
        super().__init__(channel)
        self._maps: dict[str, tuple[int, torch.Tensor]] = {}  # name -> (inode, bytes)

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

    def _view(self, item: Item) -> torch.Tensor:
        wb: WireBuffer | None = self.channel.remote_wire.get(item.name)
        if wb is None or wb.shm is None:
            raise PlaneUnavailableError(f"shm: peer {self.channel.peer_name!r} exports no segment for {item.name!r}")
        cached = self._maps.get(item.name)
        if cached is None or cached[0] != wb.shm.inode:
            cached = (wb.shm.inode, _map(wb.shm))
            self._maps[item.name] = cached
        seg = cached[1]
        itemsize = self.channel.peer_specs[item.name].dtype.itemsize
        start = item.offset * itemsize
        return seg[start : start + item.count * itemsize]

    def _mapped(self, item: Item) -> bool:
        wb = self.channel.remote_wire.get(item.name)
        cached = self._maps.get(item.name)
        return wb is not None and wb.shm is not None and cached is not None and cached[0] == wb.shm.inode

    async def _run_copies(self, pairs: list[tuple[Item, torch.Tensor]], into_peer: bool) -> None:
        """All copies of one op in one go: on a worker thread when they are large or a
        segment still has to be mapped (mapping with MAP_POPULATE takes a while)."""
        jobs = [(item, t) for item, t in pairs if item.count]
        if not jobs:
            return

        def work() -> None:
            for item, t in jobs:
                remote = self._view(item).view(t.dtype)
                if into_peer:
                    remote.copy_(t.reshape(-1))
                else:
                    t.reshape(-1).copy_(remote)

        total = sum(t.numel() * t.element_size() for _, t in jobs)
        if total >= THREAD_COPY_BYTES or not all(self._mapped(it) for it, _ in jobs):
            await asyncio.to_thread(work)
        else:
            work()

    async def put(self, op, pairs: list[tuple[Item, torch.Tensor]], notify: bytes | None) -> None:
        await self._run_copies(pairs, into_peer=True)
        self.channel.send(Put(op.op_id, op.seq, self.name, [it for it, _ in pairs], notify), op=op)

    async def get(self, op, pairs: list[tuple[Item, torch.Tensor]]) -> None:
        await self._run_copies(pairs, into_peer=False)
        op.complete_local()

    def forget(self, name: str) -> None:
        self._maps.pop(name, None)

    def close(self) -> None:
        self._maps.clear()
