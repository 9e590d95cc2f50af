"""Remote memory as values: who a peer is, which bytes of which of its buffers, as bytes.

What a library built on :class:`~transport.Endpoint` needs to address a peer's memory by
byte range and to hand such addresses around over a control plane of its own (the
``torch.distributed._transport`` backend in :mod:`transport.torch_backend` uses only these
and the rest of :mod:`transport`'s public names):

- :func:`peer_address`: what an :meth:`Endpoint.address_record <transport.Endpoint.address_record>`
  says about its endpoint (name, incarnation, address), without the secret it carries;
- :class:`RemoteBuffer`: bytes ``[offset, offset + length)`` of a buffer a peer registered,
  with :meth:`~RemoteBuffer.to_bytes` / :meth:`~RemoteBuffer.from_bytes`; made by the owner
  with :func:`describe_buffer` and sent to whoever will ``put``/``get`` it;
- :func:`byte_view`: a tensor's bytes as a flat ``uint8`` tensor that shares its storage;
- :meth:`RemoteBuffer.items`: the ``{name: At(...)}`` mapping that :meth:`Endpoint.put` and
  :meth:`Endpoint.get` take, for local bytes and a remote byte range.

Everything here is non-blocking and pure: nothing is looked up, dialled or waited for, so
nothing here has a timeout or can be cancelled; the ``put``/``get`` it feeds has both. A
:class:`RemoteBuffer` names memory, it grants nothing: the peer must also have been added
(its address record, :meth:`Endpoint.add_peer <transport.Endpoint.add_peer>`, or a shared
store), and the peer checks every op against its own registry again.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import msgspec
import torch

from .address import decode_address
from .endpoint import Endpoint
from .ranges import At
from .registry import dtype_from_name, dtype_name

__all__ = ["PeerAddress", "RemoteBuffer", "byte_view", "describe_buffer", "peer_address"]

_KIND = "transport-rl/remote-buffer"
_VERSION = 1
_MAX_DESCRIPTOR = 4096


@dataclass(frozen=True)
class PeerAddress:
    """What an endpoint's address record says about it, less its secret.

    ``name`` is what :meth:`Endpoint.add_peer <transport.Endpoint.add_peer>` returns for the
    record; ``incarnation`` tells this run of the endpoint from a later one of the same name
    (a :class:`RemoteBuffer` carries it, so its holder can tell a restarted peer from the old one:
    compare it with the connected peer's :attr:`~transport.Peer.incarnation`; put and get do not
    check it); ``host``/``port`` is where it accepts channels."""

    name: str
    incarnation: int
    host: str
    port: int


def peer_address(record: bytes) -> PeerAddress:
    """The :class:`PeerAddress` of an :meth:`Endpoint.address_record <transport.Endpoint.address_record>`.

    Non-blocking (a typed JSON decode and checks; nothing is dialled). ``TypeError`` for
    anything but bytes, ``ValueError`` for bytes that are not such a record."""
    rec, _ = decode_address(record)
    return PeerAddress(rec.name, rec.incarnation, rec.host, rec.port)


class _Wire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: str
    version: int
    endpoint: str
    incarnation: int
    buffer: str
    dtype: str
    offset: int
    length: int


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(_Wire)


@dataclass(frozen=True)
class RemoteBuffer:
    """Bytes ``[offset, offset + length)`` of the buffer ``buffer`` that endpoint ``endpoint``
    (incarnation ``incarnation``) registered; the buffer holds ``dtype`` elements.

    Made by the buffer's owner with :func:`describe_buffer`; travels as :meth:`to_bytes`
    (a small JSON document, no secret in it) and comes back with :meth:`from_bytes`, which
    validates it and builds nothing else. A byte range must cover whole elements: ``offset``
    and ``length`` are multiples of the dtype's size (always true for ``uint8`` buffers)."""

    endpoint: str
    incarnation: int
    buffer: str
    dtype: torch.dtype
    offset: int
    length: int

    def __post_init__(self) -> None:
        for field in ("endpoint", "buffer"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise ValueError(f"RemoteBuffer.{field} must be a non-empty string, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"RemoteBuffer.dtype must be a torch.dtype, got {self.dtype!r}")
        for field in ("incarnation", "offset", "length"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RemoteBuffer.{field} must be an int >= 0, got {value!r}")
        size = self.dtype.itemsize
        if self.offset % size or self.length % size:
            raise ValueError(f"a byte range of a {self.dtype} buffer covers whole {size}-byte elements; got offset "
                             f"{self.offset}, length {self.length}")

    def slice(self, offset: int, length: int | None = None) -> RemoteBuffer:
        """Bytes ``[offset, offset + length)`` of this range (default: to its end), as a new
        descriptor. ``ValueError`` if that does not lie inside this range."""
        offset = operator.index(offset)
        length = self.length - offset if length is None else operator.index(length)
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"bytes [{offset}, {offset + length}) are outside this {self.length}-byte range")
        return RemoteBuffer(self.endpoint, self.incarnation, self.buffer, self.dtype, self.offset + offset, length)

    def items(self, local: torch.Tensor) -> dict[str, At]:
        """What :meth:`Endpoint.put` / :meth:`Endpoint.get` take to move ``local`` to or from the
        start of this range: ``{buffer: At(local as dtype, element offset)}``.

        ``local`` is a contiguous tensor of any dtype whose bytes fit in the range (for
        instance a :func:`byte_view`); its bytes are reinterpreted as ``dtype`` (no copy), so
        its size must be a whole number of elements. A put writes ``local``'s bytes, a get
        reads into them. ``ValueError``/``TypeError`` for a tensor that does not fit."""
        if not isinstance(local, torch.Tensor):
            raise TypeError(f"local must be a torch.Tensor, got {type(local).__name__}")
        raw = byte_view(local)
        if raw.numel() > self.length:
            raise ValueError(f"{raw.numel()} local bytes do not fit in this {self.length}-byte range")
        size = self.dtype.itemsize
        if raw.numel() % size:
            raise ValueError(f"{raw.numel()} bytes are not a whole number of {self.dtype} elements")
        if raw.data_ptr() % size:
            raise ValueError(f"local bytes are not aligned to {size} bytes, as a {self.dtype} view needs")
        return {self.buffer: At(raw.view(self.dtype), offset=self.offset // size)}

    def to_bytes(self) -> bytes:
        """This descriptor as bytes for :meth:`from_bytes` (JSON; names memory, grants nothing)."""
        return _encoder.encode(_Wire(_KIND, _VERSION, self.endpoint, self.incarnation, self.buffer,
                                     dtype_name(self.dtype), self.offset, self.length))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> RemoteBuffer:
        """The descriptor :meth:`to_bytes` made. ``TypeError`` for anything but bytes,
        ``ValueError`` for bytes that are not such a descriptor (a typed decode, then checks;
        nothing is executed or looked up)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"a remote-buffer descriptor is bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) > _MAX_DESCRIPTOR:
            raise ValueError(f"a remote-buffer descriptor is at most {_MAX_DESCRIPTOR} bytes, got {len(data)}")
        try:
            w = _decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise ValueError(f"not a remote-buffer descriptor: {exc}") from None
        if w.kind != _KIND:
            raise ValueError(f"not a remote-buffer descriptor (kind {w.kind!r})")
        if w.version != _VERSION:
            raise ValueError(f"unsupported remote-buffer descriptor version {w.version} (this build reads {_VERSION})")
        try:
            dtype = dtype_from_name(w.dtype)
        except KeyError:
            raise ValueError(f"the remote-buffer descriptor names unknown dtype {w.dtype!r}") from None
        return cls(w.endpoint, w.incarnation, w.buffer, dtype, w.offset, w.length)


def describe_buffer(endpoint: Endpoint, name: str, *, offset: int = 0, length: int | None = None) -> RemoteBuffer:
    """The :class:`RemoteBuffer` of bytes ``[offset, offset + length)`` (default: all) of the
    buffer ``endpoint`` registered as ``name``. Non-blocking.

    :class:`~transport.UnknownBufferError` if no such buffer is registered, ``ValueError`` for
    a range outside it or not on element boundaries. The descriptor names the buffer: an op
    through it reaches the buffer the endpoint has under ``name`` at that op. Once the buffer is
    unregistered, ops fail (:class:`~transport.UnknownBufferError`); a buffer registered again
    under the same name is reached too (if its dtype and size still fit the range), and so is a
    restarted endpoint of the same name: compare :attr:`RemoteBuffer.incarnation` with the
    connected :attr:`~transport.Peer.incarnation` to refuse those."""
    from .errors import UnknownBufferError

    spec = endpoint.buffers.get(name)
    if spec is None:
        raise UnknownBufferError(f"endpoint {endpoint.name!r} has no buffer named {name!r}")
    whole = RemoteBuffer(endpoint.name, endpoint.incarnation, name, spec.dtype, 0, spec.nbytes)
    return whole.slice(offset, length)


def byte_view(tensor: torch.Tensor, offset: int = 0, length: int | None = None) -> torch.Tensor:
    """Bytes ``[offset, offset + length)`` (default: to the end) of a contiguous ``tensor``, as a
    flat ``uint8`` tensor sharing its storage: writes through either are seen by both.
    Non-blocking, no copy. ``ValueError`` for a non-contiguous tensor or a range outside it.

    Registering a tensor may move its storage (the ``shm`` plane; see the README's Planes
    section): take byte views of a registered tensor after registering it, not before."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    offset = operator.index(offset)
    length = flat.numel() - offset if length is None else operator.index(length)
    if offset < 0 or length < 0 or offset + length > flat.numel():
        raise ValueError(f"bytes [{offset}, {offset + length}) are outside the tensor's {flat.numel()} bytes")
    return flat[offset : offset + length]
