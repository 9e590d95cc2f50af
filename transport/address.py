"""Connecting to a peer from its address record, with no store shared between the two.

An open :class:`~transport.Endpoint` describes itself as opaque bytes
(:meth:`Endpoint.address_record <transport.Endpoint.address_record>`): its name, the
address it accepts channels on, its incarnation, its host identity (which decides whether
``shm`` can reach it) and the secret a dialer must prove it holds
(:mod:`transport.auth`). A peer that is handed those bytes by any control plane of the
application calls :meth:`Endpoint.add_peer <transport.Endpoint.add_peer>` and can then
``connect``/``put``/``get`` by that name, whether or not the two endpoints share a store.

The record is a credential: whoever holds it can join this endpoint's channels (it
carries the secret that the handshake proves). Exchange it only with peers allowed to
read and write the endpoint's registered buffers, as you would the job's secret.

An endpoint needs a store of its own for the rest (its own record and, unless one is
given, its secret): ``store=torch.distributed.HashStore()`` is an in-process one that no
other process sees, so an endpoint made with it is reachable only through its record.

Dialling a peer added this way uses that record and the secret in it; if the peer's
incarnation refuses the connection (it exited), the dial fails with
:class:`~transport.PeerNotFoundError` at once: a new incarnation needs a new record.
"""

from __future__ import annotations

import msgspec

from .errors import PeerNotFoundError
from .rendezvous import EndpointRecord, record_problem

__all__ = ["ADDRESS_VERSION", "AddressBook", "AddressRecord", "decode_address", "encode_address"]

ADDRESS_VERSION = 1
_MAX_RECORD = 64 * 1024


class AddressRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What :func:`encode_address` puts in the bytes (``kind`` tells them from other JSON)."""

    kind: str
    version: int
    endpoint: EndpointRecord
    secret: bytes


_KIND = "transport-rl/address"
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AddressRecord)


def encode_address(record: EndpointRecord, secret: bytes) -> bytes:
    """The opaque bytes that describe the endpoint published as ``record`` with ``secret``."""
    return _encoder.encode(AddressRecord(_KIND, ADDRESS_VERSION, record, bytes(secret)))


def decode_address(data: bytes) -> tuple[EndpointRecord, bytes]:
    """``(record, secret)`` from :func:`encode_address`'s bytes; ``ValueError`` for anything else.

    Decoding never executes code or looks anything up: it is a typed JSON decode, then checks."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"an address record is bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > _MAX_RECORD:
        raise ValueError(f"an address record is at most {_MAX_RECORD} bytes, got {len(data)}")
    try:
        rec = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise ValueError(f"not an endpoint address record: {exc}") from None
    if rec.kind != _KIND:
        raise ValueError(f"not an endpoint address record (kind {rec.kind!r})")
    if rec.version != ADDRESS_VERSION:
        raise ValueError(f"unsupported address record version {rec.version} (this build reads {ADDRESS_VERSION})")
    ep = rec.endpoint
    if (why := record_problem(ep)) is not None:
        raise ValueError(f"the address record holds {why}")
    if not rec.secret:
        raise ValueError("the address record holds an empty secret")
    return ep, rec.secret


class AddressBook:
    """The peers an endpoint was handed records of: name -> (record, secret).

    Consulted before the store when dialling (:meth:`lookup`) and for the secret to prove
    (:meth:`secret_for`). Not thread-safe: the endpoint uses it on its loop."""

    def __init__(self) -> None:
        self._peers: dict[str, tuple[EndpointRecord, bytes]] = {}

    def add(self, data: bytes, *, own_name: str) -> str:
        """Add (or replace) the peer ``data`` describes; return its name."""
        rec, secret = decode_address(data)
        if rec.name == own_name:
            raise ValueError(f"the address record describes this endpoint itself ({own_name!r})")
        self._peers[rec.name] = (rec, secret)
        return rec.name

    def lookup(self, name: str, skip_incarnations: set[int]) -> EndpointRecord | None:
        """The record added for ``name`` (None: none was, look in the store); raises
        :class:`PeerNotFoundError` when its incarnation already refused a connection."""
        got = self._peers.get(name)
        if got is None:
            return None
        rec = got[0]
        if rec.incarnation in skip_incarnations:
            raise PeerNotFoundError(
                f"endpoint {name!r} at {rec.host}:{rec.port} (incarnation {rec.incarnation:#x}, from its address "
                "record) refused the connection: it is gone; add a new record of it to reach its next incarnation"
            )
        return rec

    def secret_for(self, name: str) -> bytes | None:
        """The secret to prove when dialling ``name`` (None: the endpoint's own)."""
        got = self._peers.get(name)
        return None if got is None else got[1]
