"""Named buffers: the local registry and what peers know of it.

A :class:`BufferSpec` describes one registered tensor (name, dtype, shape,
device, nbytes). The local registry owns the tensors; its *epoch* grows on
every change and travels in each registry update so that a peer's cached copy
can be checked.

Thread safety: the registry is read by channel reader threads (to validate
incoming ops and find destination memory) and changed by the event loop; a
lock guards the dict, and readers take a reference to the entry, which keeps
the tensor alive even if it is unregistered meanwhile.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import BufferMismatchError, InvalidTensorError, UnknownBufferError

__all__ = ["BufferSpec", "Hold", "LocalBuffer", "LocalRegistry", "byte_slice", "dtype_from_name", "dtype_name"]

# Dtypes that may travel, by their wire name. Complex and quantized types are
# left out on purpose: nothing in this field moves them.
_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; raises :class:`InvalidTensorError` if unsupported."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise InvalidTensorError(f"dtype {dtype} cannot be transported") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype for a wire name; raises :class:`KeyError` if unknown."""
    return _DTYPES[name]


@dataclass(frozen=True)
class BufferSpec:
    """What a peer needs to know about a registered buffer."""

    name: str
    dtype: torch.dtype
    shape: torch.Size
    device: str
    nbytes: int
    # derived once (every op checks its tensors against these): the element count, the shape as a
    # list (as an op's wire item carries it) and the dtype's wire name ("" for one that cannot move)
    numel: int = field(init=False, compare=False, repr=False)
    shape_list: list[int] = field(init=False, compare=False, repr=False)
    dtype_name: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", self.shape.numel())
        object.__setattr__(self, "shape_list", list(self.shape))
        object.__setattr__(self, "dtype_name", _NAMES.get(self.dtype, ""))

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> BufferSpec:
        return cls(
            name=name,
            dtype=tensor.dtype,
            shape=tensor.shape,
            device=str(tensor.device),
            nbytes=tensor.numel() * tensor.element_size(),
        )

    def describe(self) -> str:
        return f"{self.name!r} ({self.dtype}, shape {tuple(self.shape)}, {self.nbytes} bytes)"


class Hold:
    """A channel's claim on the registered buffers a peer's op moves bytes into or out of through
    the channel's own stream (a ``tcp`` put's payload received into them, a get's reply sent from
    them, the staged path's copies), from the moment the op's header resolves them to the moment
    its last byte was received or sent (or will never be). :meth:`LocalRegistry.wait_unheld`
    (``unregister``) waits for it; past its bound ``revoke`` is called (the channel breaks, which
    stops its reads and sends). Any thread."""

    __slots__ = ("_registry", "bufs", "released", "revoke")

    def __init__(self, registry: LocalRegistry, revoke: Callable[[str], None]) -> None:
        self._registry = registry
        self.revoke = revoke
        self.bufs: list[LocalBuffer] = []
        self.released = False

    def release(self) -> None:
        """Let go of every buffer held (idempotent)."""
        self._registry.release(self)


@dataclass
class LocalBuffer:
    """One registered tensor and whatever the planes attached to export it."""

    spec: BufferSpec
    tensor: torch.Tensor
    # plane name -> exported handle (e.g. the shared-memory segment)
    exports: dict[str, Any] = field(default_factory=dict)
    # the channels' ops moving bytes into or out of it through their streams (guarded by the registry's lock)
    holds: set[Hold] = field(default_factory=set, repr=False, compare=False)

    def moved(self) -> str | None:
        """Why the tensor no longer matches its registration (None if it still does).

        ``module.to()``/``.half()`` and ``t.data = ...`` re-point a tensor at new
        memory; peers would then write into memory the owner no longer reads."""
        t, s = self.tensor, self.spec
        if t.dtype != s.dtype or t.shape != s.shape or not t.is_contiguous():
            return (f"buffer {s.name!r} was registered as {s.dtype}{tuple(s.shape)} but the tensor is now "
                    f"{t.dtype}{tuple(t.shape)}; re-register it")
        if s.nbytes and t.data_ptr() != self.ptr:
            return f"buffer {s.name!r} was re-pointed at other memory since it was registered; re-register it"
        return None

    ptr: int = 0  # data_ptr() after registration (and export)

    def byte_view(self) -> memoryview:
        """A writable byte view of the whole buffer (CPU only: GPU buffers are staged). Kept
        between calls while the tensor stays at the same memory (every op served into the buffer
        asks for it; :meth:`moved` is checked first)."""
        t = self.tensor
        key = (t.data_ptr(), t.nbytes)
        kept = self._view  # (one read: reader threads of several channels call this at once)
        if kept is not None and kept[0] == key:
            return kept[1]
        view = tensor_bytes(t)
        self._view = (key, view)
        return view

    _view: tuple[tuple[int, int], memoryview] | None = field(default=None, repr=False, compare=False)


# One ctypes array type for every byte view, sliced to size: a type per size would cost ~20 us each
# time a size is new (ctypes keeps them only weakly). Nothing reads or writes past the slice.
_ANY_BYTES = ctypes.c_ubyte * (1 << 46)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat, writable byte ``memoryview`` sharing memory with a contiguous CPU tensor. The view
    keeps that memory alive: it holds an alias of the tensor (``detach()``), so re-pointing the
    tensor afterwards (``set_``, ``.data =``, an unregister that moves it) does not free what the
    view shows. ``ValueError`` for a CUDA or non-contiguous tensor (callers check first:
    :func:`check_tensor`).

    Built on a ``ctypes`` array over the tensor's memory (about 3 us) rather than through
    ``reshape().view(uint8).numpy()`` (about 9 us): it is paid on both sides of every small op.
    """
    n = tensor.nbytes
    if n == 0:
        return memoryview(bytearray(0))
    if not tensor.is_cpu or not tensor.is_contiguous():
        raise ValueError(f"byte views are of contiguous CPU tensors, got {tensor.device} stride {tensor.stride()}")
    arr = _ANY_BYTES.from_address(tensor.data_ptr())
    arr._owner = tensor.detach()  # type: ignore[attr-defined]  # (view -> array -> alias -> the memory)
    return memoryview(arr).cast("B")[:n]


def byte_slice(t: torch.Tensor, off: int, n: int) -> torch.Tensor:
    """Bytes ``[off, off + n)`` of a contiguous tensor, as a ``uint8`` view on its device."""
    return t.detach().reshape(-1).view(torch.uint8)[off : off + n]


def check_tensor(name: str, tensor: object) -> torch.Tensor:
    """Validate a tensor a caller hands in; raise :class:`InvalidTensorError` if unusable."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTensorError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise InvalidTensorError(
            f"{name!r}: tensor is not contiguous (stride {tensor.stride()}); pass .contiguous()"
        )
    if tensor.is_conj() or tensor.is_neg():
        raise InvalidTensorError(
            f"{name!r}: tensor is a lazy {'conjugate' if tensor.is_conj() else 'negative'} view (its memory does "
            "not hold its values); pass .resolve_conj().resolve_neg()"
        )
    if not (tensor.is_cpu or tensor.is_cuda):
        raise InvalidTensorError(
            f"{name!r}: tensor is on {tensor.device}; this build moves CPU and CUDA tensors only"
        )
    dtype_name(tensor.dtype)
    return tensor


class LocalRegistry:
    """Name -> :class:`LocalBuffer`, with an epoch that grows on every change."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)  # a Hold was released
        self._buffers: dict[str, LocalBuffer] = {}
        self.epoch = 0

    def add(self, buf: LocalBuffer) -> None:
        """Add ``buf``; :class:`BufferMismatchError` if its name is taken (callers check first,
        with a friendlier message; this keeps a racing second registration out)."""
        with self._lock:
            if buf.spec.name in self._buffers:
                raise BufferMismatchError(f"buffer {buf.spec.name!r} is already registered")
            self._buffers[buf.spec.name] = buf
            self.epoch += 1

    def remove(self, name: str) -> LocalBuffer:
        with self._lock:
            try:
                buf = self._buffers.pop(name)
            except KeyError:
                raise UnknownBufferError(f"no buffer named {name!r} is registered") from None
            self.epoch += 1
            return buf

    def get(self, name: str, hold: Hold | None = None) -> LocalBuffer | None:
        """The buffer registered as ``name`` (None if none); ``hold``: claimed for it in the same step
        (so an ``unregister`` after this waits for the hold)."""
        with self._lock:
            buf = self._buffers.get(name)
            if buf is not None and hold is not None and not hold.released:
                buf.holds.add(hold)
                hold.bufs.append(buf)
            return buf

    def release(self, hold: Hold) -> None:
        """``hold`` lets go of its buffers (idempotent; any thread)."""
        with self._lock:
            if hold.released:
                return
            hold.released = True
            for buf in hold.bufs:
                buf.holds.discard(hold)
            if hold.bufs:
                self._released.notify_all()

    def wait_unheld(self, buf: LocalBuffer, timeout: float) -> list[Hold]:
        """Wait, at most ``timeout`` s, until no hold is on ``buf`` (removed from the registry
        first, so none is added); returns the holds still on it."""
        end = time.monotonic() + timeout
        with self._lock:
            while buf.holds:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._released.wait(left)
            return list(buf.holds)

    def snapshot(self) -> tuple[int, list[LocalBuffer]]:
        with self._lock:
            return self.epoch, list(self._buffers.values())

    def specs(self) -> dict[str, BufferSpec]:
        with self._lock:
            return {n: b.spec for n, b in self._buffers.items()}

    def clear(self) -> list[LocalBuffer]:
        with self._lock:
            bufs = list(self._buffers.values())
            self._buffers.clear()
            self.epoch += 1
            return bufs
