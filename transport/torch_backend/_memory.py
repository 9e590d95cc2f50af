"""Registered memory of a :class:`~transport.torch_backend.TransportRL`: handles, byte-range
views and the wire descriptor peers address it by."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch.distributed._transport._serialization import _WireDescriptor
from torch.distributed._transport._work import _validate_timeout

__all__ = ["TransportRLMemory", "TransportRLMemoryView", "TransportRLMutableMemoryView", "TransportRLRemoteBuffer"]

BACKEND = "transport_rl"


@dataclass(frozen=True)
class TransportRLRemoteBuffer(_WireDescriptor):
    """A peer's registered memory: which endpoint (name and incarnation), which of its buffers,
    how many bytes. ``serialize()`` gives torch's JSON v1 envelope (backend ``"transport_rl"``);
    ``deserialize()`` validates it and builds nothing else. It names memory, it does not grant a
    connection: the peer must also have been connected to with its ``bind()`` bytes."""

    _backend = BACKEND
    _fields = {"endpoint": str, "incarnation": int, "buffer": str, "length": int}

    endpoint: str
    incarnation: int
    buffer: str
    length: int


@dataclass(eq=False)
class Registration:
    """One registration, shared by every handle of it (``register_memory`` of the same tensor
    again). ``flat`` is the caller's memory as a flat uint8 tensor, registered with the endpoint
    as ``name`` (byte offsets are element offsets of it); ``base_name``, with ``shm``, is the
    caller's tensor itself, registered first so that its storage moves into shared memory in
    place and ``flat`` shares that segment."""

    tensor: torch.Tensor
    flat: torch.Tensor
    name: str
    base_name: str | None
    address: int
    length: int
    active: bool = True

    def ensure_active(self) -> None:
        if not self.active:
            raise RuntimeError("memory has been unregistered")

    def replaced(self) -> bool:
        """Whether the caller resized the tensor or replaced its storage since registration."""
        t = self.tensor
        return t.data_ptr() != self.address or t.numel() * t.element_size() != self.length


class TransportRLMemoryView:
    """``length`` bytes from byte ``offset`` of a registration (read-only use: a write's source)."""

    def __init__(self, memory: TransportRLMemory, offset: int, length: int) -> None:
        self._memory = memory
        self._offset = offset
        self._length = length
        self._slice: torch.Tensor | None = None

    def size(self) -> int:
        return self._length

    def _bytes(self) -> torch.Tensor:
        """The viewed bytes, as a slice of the registration's flat uint8 tensor (made once: a
        registration's flat tensor never changes)."""
        if self._slice is None:
            self._slice = self._memory._registration.flat[self._offset : self._offset + self._length]
        return self._slice


class TransportRLMutableMemoryView(TransportRLMemoryView):
    """A view a read may write into."""

    writable: Literal[True] = True


class _Describes(Protocol):
    """What a memory handle needs of its transport (:class:`~transport.torch_backend.TransportRL`)."""

    def _descriptor(self, registration: Registration) -> TransportRLRemoteBuffer: ...


class TransportRLMemory:
    """A handle of a registration made by :meth:`TransportRL.register_memory`."""

    def __init__(self, transport: _Describes, registration: Registration, reused: bool) -> None:
        self._transport = transport
        self._registration = registration
        self._reused = reused

    def reused_registration(self) -> bool:
        """Whether this handle shares a registration made by an earlier ``register_memory``."""
        return self._reused

    def _range(self, offset: int | None, length: int | None) -> tuple[int, int]:
        reg = self._registration
        reg.ensure_active()
        offset = 0 if offset is None else operator.index(offset)
        if offset < 0 or offset > reg.length:
            raise ValueError(f"offset {offset} is outside the registered memory ({reg.length} bytes)")
        length = reg.length - offset if length is None else operator.index(length)
        if length < 0 or length > reg.length - offset:
            raise ValueError(f"view of {length} bytes from {offset} exceeds the registered memory ({reg.length} bytes)")
        return offset, length

    def to_view(self, offset: int | None = None, length: int | None = None) -> TransportRLMemoryView:
        """Bytes ``[offset, offset + length)`` (default: to the end). Non-blocking."""
        return TransportRLMemoryView(self, *self._range(offset, length))

    def to_mutable_view(self, offset: int | None = None, length: int | None = None) -> TransportRLMutableMemoryView:
        """As :meth:`to_view`, for a read's destination. Non-blocking."""
        return TransportRLMutableMemoryView(self, *self._range(offset, length))

    def to_remote_buffer(self, *, timeout: float | None = None) -> TransportRLRemoteBuffer:
        """The descriptor a peer writes to and reads from. Non-blocking (``timeout`` is only
        validated); ``RuntimeError`` once unregistered or the transport is closed."""
        _validate_timeout(timeout)
        self._registration.ensure_active()
        return self._transport._descriptor(self._registration)
