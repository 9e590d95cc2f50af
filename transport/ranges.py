"""Which bytes of which buffer an op touches, checked on both sides.

The initiator checks a call against its cached copy of the peer's registry
before any byte moves (:func:`plan_items`); the target checks every incoming
item again against its own registry (:func:`resolve_item`), because the cache
may be stale and because a peer may be hostile.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .errors import BufferMismatchError, InvalidTensorError, ProtocolError, UnknownBufferError
from .registry import BufferSpec, LocalBuffer, check_tensor, dtype_from_name, dtype_name
from .wire import Item, WireBuffer

__all__ = ["At", "item_bytes", "item_fits", "plan_items", "resolve_item"]

_MAX_ITEM_BYTES = 1 << 44  # 16 TiB: anything larger in a header is hostile


@dataclass(frozen=True)
class At:
    """Address a sub-range of a registered buffer: ``tensor.numel()`` elements
    starting at element ``offset`` of the buffer (flattened, row-major).

    ``ep.put(peer, {"w": At(chunk, offset=4096)})`` writes ``chunk`` into
    elements ``[4096, 4096 + chunk.numel())`` of ``w``; with ``get`` it reads
    that range into ``chunk``. Without ``At``, the tensor must match the
    buffer's dtype and shape exactly: a smaller tensor is an error, never a
    silent partial transfer.
    """

    tensor: torch.Tensor
    offset: int


def plan_items(
    specs: Mapping[str, BufferSpec], tensors: Mapping[str, torch.Tensor | At], *, peer: str, into: bool = False
) -> list[tuple[Item, torch.Tensor]]:
    """Check a put/get call against the peer's registry; return the wire items.

    ``into``: the op writes into the tensors (a get): one that requires grad is refused (autograd
    forbids writing into a leaf that requires grad, and a get into a tensor a graph saved would
    change what backward reads: get into ``tensor.detach()``, the same memory, instead).
    Raises :class:`UnknownBufferError`, :class:`BufferMismatchError` or
    :class:`InvalidTensorError` naming expected vs got. Nothing is sent.
    """
    if not isinstance(tensors, Mapping):
        raise InvalidTensorError(f"expected a mapping of buffer name -> tensor, got {type(tensors).__name__}")
    if not tensors:
        raise InvalidTensorError("the op names no buffers")
    out: list[tuple[Item, torch.Tensor]] = []
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise InvalidTensorError(f"buffer names are strings, got {name!r}")
        spec = specs.get(name)
        if spec is None:
            raise UnknownBufferError(f"peer {peer!r} has no buffer named {name!r}")
        if isinstance(value, At):
            t = check_tensor(name, value.tensor)
            off = value.offset
            if isinstance(off, bool) or not isinstance(off, int) or off < 0:
                raise BufferMismatchError(f"{name!r}: offset must be an int >= 0, got {off!r}")
            shape = None
        else:
            t = check_tensor(name, value)
            off = 0
            shape = list(t.shape)
        if into and t.requires_grad:
            raise InvalidTensorError(f"{name!r}: a get writes into the tensor, which requires grad; get into "
                                     "tensor.detach() (the same memory) instead")
        if t.dtype != spec.dtype:
            raise BufferMismatchError(f"buffer {name!r} on {peer!r} holds {spec.dtype}, the tensor is {t.dtype}")
        # (the spec's derived fields, not the tensor's shape and dtype again: each torch attribute
        # costs a fraction of a microsecond, and a state dict's put checks hundreds of tensors)
        if shape is not None and shape != spec.shape_list:
            raise BufferMismatchError(
                f"buffer {name!r} on {peer!r} has shape {tuple(spec.shape)}, the tensor has {tuple(t.shape)}"
                " (use transport.At(tensor, offset) to address a sub-range)"
            )
        n = t.numel()
        if off + n > spec.numel:
            raise BufferMismatchError(
                f"buffer {name!r} on {peer!r} holds {spec.numel} elements; elements "
                f"[{off}, {off + n}) are out of range"
            )
        out.append((Item(name, spec.dtype_name or dtype_name(t.dtype), off, n, shape), t))
    return out


def item_fits(it: Item, wb: WireBuffer) -> bool:
    """Whether ``it``, planned against our copy of the peer's registry, fits the buffer the peer
    announces now as ``wb``: the same dtype, the same shape where it named the whole buffer, and
    its range inside. A plane that finds the export to copy into at copy time checks this: the
    reader thread may have taken a newer registry since the op was planned (the buffer
    re-registered smaller, or with another dtype, under the same name, at the same place), and the
    slot's word names the new export, so only this keeps the copy inside the new buffer."""
    if wb.dtype != it.dtype or (it.shape is not None and it.shape != wb.shape):
        return False
    try:
        size = dtype_from_name(it.dtype).itemsize
    except KeyError:
        return False
    return (it.offset + it.count) * size <= wb.nbytes


def item_bytes(it: Item) -> int:
    """The bytes an item of a peer's op covers; :class:`ProtocolError` for an unknown dtype or a nonsensical range."""
    try:
        size = dtype_from_name(it.dtype).itemsize
    except KeyError:
        raise ProtocolError(f"op names unknown dtype {it.dtype!r}") from None
    if it.offset < 0 or it.count < 0 or it.count * size > _MAX_ITEM_BYTES:
        raise ProtocolError(f"op addresses a nonsensical range: offset {it.offset}, count {it.count}")
    return it.count * size


def resolve_item(buf: LocalBuffer | None, item: Item) -> tuple[int, int]:
    """Target side: ``(byte_offset, nbytes)`` of ``item`` inside ``buf``.

    Raises :class:`UnknownBufferError` / :class:`BufferMismatchError` when the
    item does not fit the registered buffer.
    """
    if buf is None:
        raise UnknownBufferError(f"no buffer named {item.name!r} is registered")
    spec = buf.spec
    if item.dtype != dtype_name(spec.dtype):
        raise BufferMismatchError(f"buffer {spec.name!r} holds {dtype_name(spec.dtype)}, the op carries {item.dtype}")
    if item.offset < 0 or item.count < 0 or item.offset + item.count > spec.numel:
        raise BufferMismatchError(
            f"buffer {spec.name!r} holds {spec.numel} elements; the op addresses "
            f"[{item.offset}, {item.offset + item.count})"
        )
    if item.shape is not None and list(spec.shape) != list(item.shape):
        raise BufferMismatchError(
            f"buffer {spec.name!r} has shape {tuple(spec.shape)}, the op carries {tuple(item.shape)}"
        )
    size = spec.dtype.itemsize
    return item.offset * size, item.count * size
