"""The CUDA engine of the ``cuda_ipc`` plane (:mod:`transport.ipc`, :mod:`transport.planes.cuda_ipc`).

The only code of the plane that needs a GPU, kept small:

- export: ``cuMemGetAddressRange`` finds the allocation (torch's caching allocator hands out blocks
  inside larger ``cudaMalloc`` segments) and ``cuIpcGetMemHandle`` exports it; the buffer is then
  ``(handle, offset)``. A tensor in memory that cannot be exported this way (expandable segments,
  ``cudaMallocAsync`` pools) raises :class:`~transport.errors.PlaneUnavailableError`: the endpoint
  logs it and peers reach that buffer through the staged path.
- open: ``cuIpcOpenMemHandle`` (once per allocation and process: :class:`~transport.ipc.MappingCache`),
  on the local device whose UUID is the exporter's (processes with different
  ``CUDA_VISIBLE_DEVICES`` agree); the mapping is wrapped as a ``uint8`` tensor through
  ``__cuda_array_interface__`` (no copy, no ownership).
- copies: one dedicated stream per channel and device; a copy first waits (``wait_event``, on the
  GPU) for an event recorded on the caller's current stream at the call, and is followed by a
  blocking-sync event that a :class:`~transport.completion.CompletionBridge` thread sleeps on.

The driver is reached with ctypes through ``libcuda.so.1`` (already loaded by torch in a process
that uses CUDA); the calls run in the device's primary context (torch's), made current for the
call and restored after, so the caller's current device never changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..errors import PlaneUnavailableError
from ..wire import IpcHandle
from .marks import caller_marks

__all__ = ["CudaIpcEngine", "allocator_warning", "cuda_ipc_engine", "exportable_zeros"]

_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1
_CUDA_ERROR_OUT_OF_MEMORY = 2
_HANDLE_BYTES = 64


class _CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _HANDLE_BYTES)]


class _Driver:
    """The few driver entry points the engine uses."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise PlaneUnavailableError(f"cuda_ipc: the CUDA driver library libcuda.so.1 cannot be loaded: {exc}") from exc
        u64, p = ctypes.c_uint64, ctypes.POINTER
        self._get_error = self._fn("cuGetErrorString", [ctypes.c_int, p(ctypes.c_char_p)])
        self.range = self._fn("cuMemGetAddressRange_v2", [p(u64), p(ctypes.c_size_t), u64])
        self.get_handle = self._fn("cuIpcGetMemHandle", [p(_CUipcMemHandle), u64])
        self.open_handle = self._fn("cuIpcOpenMemHandle_v2", [p(u64), _CUipcMemHandle, ctypes.c_uint],
                                    "cuIpcOpenMemHandle")
        self.close_handle = self._fn("cuIpcCloseMemHandle", [u64])
        self.ctx_get = self._fn("cuCtxGetCurrent", [p(ctypes.c_void_p)])
        self.ctx_set = self._fn("cuCtxSetCurrent", [ctypes.c_void_p])
        self.device_get = self._fn("cuDeviceGet", [p(ctypes.c_int), ctypes.c_int])
        self.primary_retain = self._fn("cuDevicePrimaryCtxRetain", [p(ctypes.c_void_p), ctypes.c_int])
        self.mem_alloc = self._fn("cuMemAlloc_v2", [p(u64), ctypes.c_size_t], "cuMemAlloc")
        self.mem_free = self._fn("cuMemFree_v2", [u64], "cuMemFree")
        self.memset = self._fn("cuMemsetD8_v2", [u64, ctypes.c_ubyte, ctypes.c_size_t], "cuMemsetD8")
        self.stream_sync = self._fn("cuStreamSynchronize", [ctypes.c_void_p])

    def _fn(self, name: str, argtypes: list[Any], fallback: str | None = None) -> Any:
        for n in (name, fallback):
            if n is None:
                continue
            try:
                f = getattr(self.lib, n)
            except AttributeError:
                continue
            f.argtypes = argtypes
            f.restype = ctypes.c_int
            return f
        raise PlaneUnavailableError(f"cuda_ipc: libcuda.so.1 has no {name}")

    def check(self, rc: int, what: str) -> None:
        if rc == 0:
            return
        text = ctypes.c_char_p()
        msg = "unknown error"
        if self._get_error(rc, ctypes.byref(text)) == 0 and text.value:
            msg = text.value.decode(errors="replace")
        raise PlaneUnavailableError(f"cuda_ipc: {what} failed: CUDA error {rc} ({msg})")


@functools.cache
def _driver() -> _Driver:
    return _Driver()


_contexts: dict[int, int] = {}
_ctx_lock = threading.Lock()


@contextlib.contextmanager
def _in_device(index: int) -> Iterator[_Driver]:
    """Make device ``index``'s primary context (torch's) current for driver calls; restore after."""
    drv = _driver()
    with _ctx_lock:
        ctx = _contexts.get(index)
        if ctx is None:
            torch.cuda.init()
            dev = ctypes.c_int()
            drv.check(drv.device_get(ctypes.byref(dev), index), f"cuDeviceGet({index})")
            c = ctypes.c_void_p()
            drv.check(drv.primary_retain(ctypes.byref(c), dev.value), f"cuDevicePrimaryCtxRetain({index})")
            ctx = _contexts[index] = c.value or 0
    prev = ctypes.c_void_p()
    drv.check(drv.ctx_get(ctypes.byref(prev)), "cuCtxGetCurrent")
    switched = (prev.value or 0) != ctx
    if switched:
        drv.check(drv.ctx_set(ctx), "cuCtxSetCurrent")
    try:
        yield drv
    finally:
        if switched:
            drv.ctx_set(prev.value)


@functools.cache
def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _index_of(uuid: str) -> int | None:
    for i in range(torch.cuda.device_count()):
        if _uuid(i) == uuid:
            return i
    return None


class _Cai:
    """A device pointer as ``__cuda_array_interface__`` (v2: no stream synchronisation)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.keep: object = None  # what must live as long as tensors made from this
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class _Allocation(_Cai):
    """One ``cuMemAlloc`` allocation, owned; freed when the last tensor made from it dies (torch
    keeps this object alive from the ``__cuda_array_interface__`` it reads)."""

    def __init__(self, index: int, ptr: int, nbytes: int) -> None:
        super().__init__(ptr, nbytes)
        self.index = index
        self.ptr = ptr

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            try:
                with _in_device(self.index) as drv:
                    drv.mem_free(ptr)  # (cuMemFree waits for the device's work on it)
            except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone; the process frees it
                pass


def allocator_warning() -> str | None:
    """Why memory from torch's caching allocator cannot be exported with CUDA IPC handles in this
    process (expandable segments, ``cudaMallocAsync``), or None. Reads ``PYTORCH_ALLOC_CONF`` (the
    current name) and ``PYTORCH_CUDA_ALLOC_CONF`` (the older one) as torch does."""
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        conf = os.environ.get(var, "").replace(" ", "").lower()
        if "expandable_segments:true" in conf:
            return (f"{var} enables expandable segments: tensors from torch's allocator cannot be exported with "
                    "CUDA IPC handles, so peers reach them through the staged path (buffers from "
                    "Endpoint.new_buffer(..., device=...) are exported all the same)")
        if "backend:cudamallocasync" in conf:
            return (f"{var} selects cudaMallocAsync: its pool memory cannot be exported with CUDA IPC handles "
                    "(buffers from Endpoint.new_buffer(..., device=...) can)")
    return None


def exportable_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor in a ``cuMemAlloc`` allocation of its own, which ``cuIpcGetMemHandle``
    exports whatever torch's allocator is set to (expandable segments, ``cudaMallocAsync``, a
    cuMem-based pool). Blocks until the memset is done (it also waits for the work queued on the
    device's legacy default stream: call it at set-up, not per op). Out of memory: torch's cache is
    emptied and the allocation tried once more; then :class:`PlaneUnavailableError`. Runs on the
    calling thread; the allocation is freed (``cuMemFree``, which waits for the device) on the
    thread that drops its last view."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    ptr = ctypes.c_uint64()
    with _in_device(index) as drv:
        rc = drv.mem_alloc(ctypes.byref(ptr), nbytes)
        if rc == _CUDA_ERROR_OUT_OF_MEMORY:  # torch's cache may hold what is missing: hand it back, once
            torch.cuda.empty_cache()
            rc = drv.mem_alloc(ctypes.byref(ptr), nbytes)
        drv.check(rc, f"cuMemAlloc of {nbytes} bytes on cuda:{index}")
        owner = _Allocation(index, ptr.value, nbytes)
        # cuMemsetD8 on device memory may return before it is done, and torch's streams do not wait for
        # the legacy stream it runs on: wait here, so no later copy on another stream races the zeroing
        drv.check(drv.memset(ptr.value, 0, nbytes), "cuMemsetD8")
        drv.check(drv.stream_sync(None), "cuStreamSynchronize")
    raw = torch.as_tensor(owner, device=torch.device("cuda", index))
    if raw.data_ptr() != ptr.value:
        raise PlaneUnavailableError(f"cuda_ipc: wrapping a new allocation made a copy (0x{raw.data_ptr():x})")
    return raw.view(dtype).view(shape)


class _CudaMapping:
    def __init__(self, index: int, ptr: int, size: int) -> None:
        self.index = index
        self.ptr = ptr
        self.size = size

    def view(self, offset: int, nbytes: int, keep: object = None) -> torch.Tensor:
        if not self.ptr:
            raise PlaneUnavailableError("cuda_ipc: the mapping was closed")
        if offset < 0 or offset + nbytes > self.size:
            raise PlaneUnavailableError(f"cuda_ipc: bytes [{offset}, {offset + nbytes}) lie outside the peer's "
                                        f"allocation of {self.size} bytes")
        cai = _Cai(self.ptr + offset, nbytes)
        cai.keep = keep  # (torch keeps the interface's object alive while the tensor's storage lives)
        view = torch.as_tensor(cai, device=torch.device("cuda", self.index))
        if view.data_ptr() != self.ptr + offset or view.device.index != self.index:  # a copy would lose the put
            raise PlaneUnavailableError(f"cuda_ipc: wrapping the peer's memory made a copy (at 0x{view.data_ptr():x} "
                                        f"on {view.device}, not 0x{self.ptr + offset:x} on cuda:{self.index})")
        return view

    def close(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            with _in_device(self.index) as drv:
                drv.check(drv.close_handle(ptr), "cuIpcCloseMemHandle")


class _CudaQueue:
    def __init__(self, index: int) -> None:
        self.index = index
        self.stream = torch.cuda.Stream(device=index)

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Any) -> torch.cuda.Event:
        with torch.cuda.device(self.index), torch.cuda.stream(self.stream):
            for event in after or ():
                self.stream.wait_event(event)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # a bridge thread sleeps on it: no spinning
            done.record(self.stream)
        return done

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        pass


class CudaIpcEngine:
    """CUDA IPC through the driver API; see the module docstring. One per process (:func:`cuda_ipc_engine`)."""

    name = "cuda"

    def handles(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def export(self, tensor: torch.Tensor, segments: list[Any]) -> tuple[str, bytes, int, int, Any]:
        index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        ptr = tensor.data_ptr()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        handle = _CUipcMemHandle()
        with _in_device(index) as drv:
            drv.check(drv.range(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
            try:
                drv.check(drv.get_handle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
            except PlaneUnavailableError as exc:
                raise PlaneUnavailableError(
                    f"{exc} (memory from expandable segments or cudaMallocAsync pools cannot be exported with "
                    "cudaIpc handles: register memory from Endpoint.new_buffer(..., device=...), or unset "
                    "expandable_segments in PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF)"
                ) from exc
        raw = ctypes.string_at(ctypes.addressof(handle), _HANDLE_BYTES)
        return _uuid(index), raw, size.value, ptr - base.value, None

    def release(self, keep: Any) -> None:
        pass

    def reachable(self, handle: IpcHandle) -> str | None:
        if handle.engine != self.name:
            return f"exported by engine {handle.engine!r}, this side runs {self.name!r}"
        if len(handle.handle) != _HANDLE_BYTES:
            return f"malformed IPC handle ({len(handle.handle)} bytes)"
        if _index_of(handle.device) is None:
            return f"the peer's GPU {handle.device} is not visible in this process (CUDA_VISIBLE_DEVICES)"
        return None

    def open(self, handle: IpcHandle) -> _CudaMapping:
        index = _index_of(handle.device)
        if index is None:
            raise PlaneUnavailableError(f"cuda_ipc: the peer's GPU {handle.device} is not visible in this process")
        h = _CUipcMemHandle.from_buffer_copy(handle.handle)
        ptr = ctypes.c_uint64()
        with _in_device(index) as drv:
            drv.check(drv.open_handle(ctypes.byref(ptr), h, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        return _CudaMapping(index, ptr.value, handle.size)

    def mark(self, tensors: Sequence[torch.Tensor]) -> list[torch.cuda.Event]:
        return caller_marks(tensors)

    def queue(self, device: str) -> _CudaQueue:
        index = _index_of(device)
        if index is None:
            raise PlaneUnavailableError(f"cuda_ipc: GPU {device} is not visible in this process")
        return _CudaQueue(index)


_engine: CudaIpcEngine | None = None
_engine_lock = threading.Lock()


def cuda_ipc_engine() -> tuple[CudaIpcEngine | None, str]:
    """The process's CUDA IPC engine and why, or None and why not (no GPU, no driver library)."""
    global _engine
    with _engine_lock:
        if _engine is not None:
            return _engine, "CUDA IPC handles through the driver (libcuda.so.1)"
        if not torch.cuda.is_available():
            return None, "CUDA is not available in this process"
        try:
            _driver()
        except PlaneUnavailableError as exc:
            return None, str(exc)
        _engine = CudaIpcEngine()
        return _engine, "CUDA IPC handles through the driver (libcuda.so.1)"
