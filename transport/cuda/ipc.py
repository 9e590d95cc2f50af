"""The CUDA engine of the ``cuda_ipc`` plane (:mod:`transport.planes.cuda_ipc_engine`, :mod:`transport.planes.cuda_ipc`).

The only code of the plane that needs a GPU, kept small:

- export: ``cuMemGetAddressRange`` finds the allocation (torch's caching allocator hands out blocks
  inside larger ``cudaMalloc`` segments) and ``cuIpcGetMemHandle`` exports it; the buffer is then
  ``(handle, offset)``. A tensor in memory that cannot be exported this way (expandable segments,
  ``cudaMallocAsync`` pools) raises :class:`~transport.errors.PlaneUnavailableError`: the endpoint
  logs it and peers reach that buffer through the staged path.
- open: ``cuIpcOpenMemHandle`` (once per allocation and process: :class:`~transport.planes.cuda_ipc_engine.MappingCache`),
  on the local device whose UUID is the exporter's (processes with different
  ``CUDA_VISIBLE_DEVICES`` agree); the mapping is wrapped as a ``uint8`` tensor through
  ``__cuda_array_interface__`` (no copy, no ownership).
- copies: one dedicated stream per channel and device; a copy first waits (``wait_event``, on the
  GPU) for an event recorded on the caller's current stream at the call, and is followed by a
  blocking-sync event that a :class:`~transport.completion.CompletionBridge` thread sleeps on.

The driver is reached through cuda-python's ``cuda.bindings.driver`` (imported on first use, so this
module imports without it; it loads ``libcuda.so.1``, which torch has loaded already in a process
that uses CUDA); the calls run in the device's primary context (torch's), made current for the
call and restored after, so the caller's current device never changes. cuda-bindings releases the
GIL around each driver call (from 12.9.1 / 13.0.0, hence pyproject's floor), as ctypes did, so a
blocking call (``cuMemFree``, ``cuStreamSynchronize``) blocks only its own thread.
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

_CUDA_ERROR_OUT_OF_MEMORY = 2
_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE

# the driver entry points the engine calls (their cuda.bindings signatures: docs/cuda.md)
_FUNCTIONS = ("cuDriverGetVersion", "cuGetErrorName", "cuGetErrorString", "cuMemGetAddressRange", "cuIpcGetMemHandle",
              "cuIpcOpenMemHandle", "cuIpcCloseMemHandle", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuDeviceGet",
              "cuDevicePrimaryCtxRetain", "cuMemAlloc", "cuMemFree", "cuMemsetD8", "cuStreamSynchronize")


def _bindings() -> Any:
    """``cuda.bindings.driver``, imported on first use: without cuda-python this module still imports (and
    the plane says why it is off)."""
    try:
        from cuda.bindings import driver
    except Exception as exc:  # noqa: BLE001 - ImportError, or whatever a broken install raises
        raise PlaneUnavailableError(
            f"cuda_ipc: cuda-python's driver bindings (cuda.bindings.driver) cannot be imported: "
            f"{type(exc).__name__}: {exc}") from exc
    return driver


def check(result: Any, what: str) -> Any:
    """Check what a ``cuda.bindings.driver`` call returned, ``(CUresult, value, ...)``: on CUDA_SUCCESS the
    value (None when there is none, a tuple when there are several); otherwise
    :class:`~transport.errors.PlaneUnavailableError` naming the call, the error's code and name, and the
    driver's description of it (``unknown error`` where the driver cannot be asked)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    code = int(err)
    if code != 0:
        raise PlaneUnavailableError(f"cuda_ipc: {what} failed: {_describe(code)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _describe(code: int) -> str:
    """``CUDA error 2 CUDA_ERROR_OUT_OF_MEMORY (out of memory)``."""
    cu = _bindings()
    try:
        err = cu.CUresult(code)
    except ValueError:  # a code newer than these bindings
        return f"CUDA error {code} (unknown error)"
    name, text = err.name, "unknown error"
    for fn, is_name in ((cu.cuGetErrorName, True), (cu.cuGetErrorString, False)):
        try:
            rc, raw = fn(err)
        except Exception:  # noqa: BLE001 - no driver library: the enum's name is all there is
            continue
        if int(rc) == 0 and raw:
            value = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            if is_name:
                name = value
            else:
                text = value
    return f"CUDA error {code} {name} ({text})"


def _address(obj: Any) -> int:
    """The address a cuda.bindings handle (CUcontext, CUdeviceptr, ...) stands for, as an int."""
    return int(obj)


# A CUipcMemHandle's 64 bytes are read and written through its address (getPtr()): cuda.bindings up to 12.9
# and 13.3 also expose them as ``.reserved``, 13.4 no longer does; getPtr() is in every version. This copies
# bytes of a struct these bindings allocated; no driver call goes through ctypes.
def _handle_bytes(handle: Any) -> bytes:
    return ctypes.string_at(handle.getPtr(), _HANDLE_BYTES)


def _handle_from_bytes(cu: Any, raw: bytes) -> Any:
    if len(raw) != _HANDLE_BYTES:
        raise PlaneUnavailableError(f"cuda_ipc: malformed IPC handle ({len(raw)} bytes)")
    h = cu.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), raw, _HANDLE_BYTES)
    return h


class _Driver:
    """The driver through ``cuda.bindings.driver``: the module, once the driver library is known to load."""

    def __init__(self) -> None:
        cu = _bindings()
        for name in _FUNCTIONS:
            if not hasattr(cu, name):
                raise PlaneUnavailableError(f"cuda_ipc: cuda.bindings.driver has no {name}")
        try:
            # loads libcuda.so.1 (cuda.bindings does so on the first call) without initialising CUDA:
            # cuDriverGetVersion is one of the calls that need no cuInit
            result = cu.cuDriverGetVersion()
        except Exception as exc:  # noqa: BLE001 - cuda.pathfinder's DynamicLibNotFoundError, or RuntimeError
            raise PlaneUnavailableError(
                f"cuda_ipc: the NVIDIA driver library was not found (cuda.bindings: {type(exc).__name__}: {exc})"
            ) from exc
        self.cu = cu
        self.version = int(check(result, "cuDriverGetVersion"))

    def describe(self) -> str:
        """``CUDA IPC handles through the driver (cuda.bindings 13.4.4, driver API 13.0)``."""
        try:
            from cuda.bindings import __version__ as bindings
        except ImportError:
            bindings = "?"
        major, minor = self.version // 1000, self.version % 1000 // 10
        return f"CUDA IPC handles through the driver (cuda.bindings {bindings}, driver API {major}.{minor})"


@functools.cache
def _driver() -> _Driver:
    return _Driver()


_contexts: dict[int, Any] = {}  # device index -> its primary context (a CUcontext)
_ctx_lock = threading.Lock()


@contextlib.contextmanager
def _in_device(index: int) -> Iterator[_Driver]:
    """Make device ``index``'s primary context (torch's) current for driver calls; restore after."""
    drv = _driver()
    cu = drv.cu
    with _ctx_lock:
        ctx = _contexts.get(index)
        if ctx is None:
            torch.cuda.init()
            dev = check(cu.cuDeviceGet(index), f"cuDeviceGet({index})")
            ctx = _contexts[index] = check(cu.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({index})")
    prev = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    switched = _address(prev) != _address(ctx)
    if switched:
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    try:
        yield drv
    finally:
        if switched:
            cu.cuCtxSetCurrent(prev)


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
                    drv.cu.cuMemFree(drv.cu.CUdeviceptr(ptr))  # (cuMemFree waits for the device's work on it)
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
    with _in_device(index) as drv:
        cu = drv.cu
        result = cu.cuMemAlloc(nbytes)
        if int(result[0]) == _CUDA_ERROR_OUT_OF_MEMORY:  # torch's cache may hold what is missing: hand it back, once
            torch.cuda.empty_cache()
            result = cu.cuMemAlloc(nbytes)
        ptr = _address(check(result, f"cuMemAlloc of {nbytes} bytes on cuda:{index}"))
        owner = _Allocation(index, ptr, nbytes)
        # cuMemsetD8 on device memory may return before it is done, and torch's streams do not wait for
        # the legacy stream it runs on: wait here, so no later copy on another stream races the zeroing
        check(cu.cuMemsetD8(cu.CUdeviceptr(ptr), 0, nbytes), "cuMemsetD8")
        check(cu.cuStreamSynchronize(cu.CUstream(0)), "cuStreamSynchronize")
    raw = torch.as_tensor(owner, device=torch.device("cuda", index))
    if raw.data_ptr() != ptr:
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
                check(drv.cu.cuIpcCloseMemHandle(drv.cu.CUdeviceptr(ptr)), "cuIpcCloseMemHandle")


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
        with _in_device(index) as drv:
            cu = drv.cu
            base_ptr, size = check(cu.cuMemGetAddressRange(cu.CUdeviceptr(ptr)), "cuMemGetAddressRange")
            base = _address(base_ptr)
            try:
                handle = check(cu.cuIpcGetMemHandle(cu.CUdeviceptr(base)), "cuIpcGetMemHandle")
            except PlaneUnavailableError as exc:
                raise PlaneUnavailableError(
                    f"{exc} (memory from expandable segments or cudaMallocAsync pools cannot be exported with "
                    "cudaIpc handles: register memory from Endpoint.new_buffer(..., device=...), or unset "
                    "expandable_segments in PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF)"
                ) from exc
        return _uuid(index), _handle_bytes(handle), int(size), ptr - base, None

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
        with _in_device(index) as drv:
            cu = drv.cu
            h = _handle_from_bytes(cu, handle.handle)
            flags = int(cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            ptr = _address(check(cu.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle"))
        return _CudaMapping(index, ptr, handle.size)

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
        if _engine is None:
            if not torch.cuda.is_available():
                return None, "CUDA is not available in this process"
            try:
                _driver()
            except PlaneUnavailableError as exc:
                return None, str(exc)
            _engine = CudaIpcEngine()
        return _engine, _driver().describe()
