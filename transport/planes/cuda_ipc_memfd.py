"""``MemfdIpcEngine``: the ``cuda_ipc`` plane's protocol on CPU memory, for tests and debugging.

Its exports are the ``shm`` plane's ``memfd`` segments, its mappings ``mmap`` s through
``/proc/<pid>/fd``, its copy queues worker threads: everything of :mod:`transport.planes.cuda_ipc`
and :mod:`transport.planes.cuda_ipc_engine` runs as with the CUDA engine, on a machine without a GPU.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from ..completion import ThreadDone
from ..errors import PlaneUnavailableError
from ..wire import IpcHandle, ShmHandle
from .cuda_ipc_engine import IpcMapping, IpcQueue

__all__ = ["MemfdIpcEngine"]


class _ThreadQueue:
    """Copies run in issue order on one worker thread: the CPU stand-in for a CUDA stream."""

    def __init__(self, name: str, delay: float = 0.0) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._delay = delay
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Any) -> ThreadDone:
        done = ThreadDone()
        self._jobs.put((list(pairs), done))
        return done

    def synchronize(self) -> None:
        done = ThreadDone()
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

    def view(self, offset: int, nbytes: int, keep: object = None) -> torch.Tensor:
        if self._data is None:
            raise PlaneUnavailableError("cuda_ipc(memfd): the mapping was closed")
        view = self._data[offset : offset + nbytes]
        if keep is None or not nbytes:
            return view
        # a tensor whose storage holds ``keep``: torch.frombuffer keeps the buffer object alive (and
        # the buffer object ``view``, so the mmap lives as long as the tensor, like a CUDA mapping's)
        buf = (ctypes.c_uint8 * nbytes).from_address(view.data_ptr())
        buf.keep = (keep, view)  # type: ignore[attr-defined]
        return torch.frombuffer(buf, dtype=torch.uint8)

    def close(self) -> None:
        self._data = None


class MemfdIpcEngine:
    """The ``cuda_ipc`` plane's protocol on CPU memory: exports are ``memfd`` segments (the
    ``shm`` plane's, shared with it), mappings are ``mmap`` s through ``/proc/<pid>/fd``, copies
    run in order on a worker thread per queue. For tests and debugging on machines without a GPU
    (``Endpoint(engines={"cuda_ipc": MemfdIpcEngine})`` on both sides: CPU buffers then travel over
    ``cuda_ipc`` instead of ``shm``). ``copy_delay`` slows every copy (tests of timeouts)."""

    name = "memfd"

    def __init__(self, copy_delay: float = 0.0) -> None:
        self.copy_delay = copy_delay

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        from .shm_export import memfd_probe

        ok, why = memfd_probe()
        return ok, f"memfd test engine: {why}"

    def handles(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def export(self, tensor: torch.Tensor, segments: list[Any]) -> tuple[str, bytes, int, int, Any]:
        from ..registry import BufferSpec, LocalBuffer
        from .shm_export import export_buffer

        exp = export_buffer(LocalBuffer(BufferSpec.of("ipc", tensor), tensor), segments)
        if exp is None:
            raise PlaneUnavailableError("cuda_ipc(memfd): an empty buffer has nothing to export")
        h = exp.handle
        key = msgspec.msgpack.encode(ShmHandle(h.pid, h.fd, h.inode, exp.segment.size, 0, 0))
        return f"host:{os.uname().nodename}", key, exp.segment.size, h.offset, exp

    def release(self, keep: Any) -> None:
        keep.release()

    def reachable(self, handle: IpcHandle) -> str | None:
        return None if handle.engine == self.name else f"exported by engine {handle.engine!r}, this side runs memfd"

    def open(self, handle: IpcHandle) -> IpcMapping:
        from .shm_export import map_segment

        h = msgspec.msgpack.decode(handle.handle, type=ShmHandle)
        return _MemfdMapping(map_segment(h))

    def mark(self, tensors: Sequence[torch.Tensor]) -> Any:
        return None

    def queue(self, device: str) -> IpcQueue:
        return _ThreadQueue(f"transport-ipc-{device}", self.copy_delay)
