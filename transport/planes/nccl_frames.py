"""The ``nccl`` link's set-up frames, carried in the core's opaque :class:`transport.wire.LinkFrame`.

Dialer -> listener, right after the handshake: :class:`Setup` (join the channel's 2-rank link with
this unique id; the dialer is rank 0). Each side, once its join ended: :class:`Ready` (ok, the
device its link serves, or why not); the link is used only if both said ok. The core hands every
``LinkFrame`` to the channel's link (:meth:`transport.planes.base.PeerLink.on_frame`), or, on a
channel without one, to :func:`link_refusal`.
"""

from __future__ import annotations

from typing import Union

import msgspec

from ..errors import ProtocolError
from ..wire import LinkFrame

__all__ = ["Ready", "Setup", "decode", "encode", "link_refusal"]


class Setup(msgspec.Struct, tag="setup"):
    """Dialer -> listener: join the link with ``unique_id`` (NCCL's 128-byte id) as rank 1."""

    unique_id: bytes


class Ready(msgspec.Struct, tag="ready"):
    """Each side, once its join ended: ``ok``, the device its link serves (``cuda:N``), or why not."""

    ok: bool
    device: str = ""
    reason: str = ""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Union[Setup, Ready])


def encode(msg: Setup | Ready) -> LinkFrame:
    """``msg`` as the frame the channel sends."""
    return LinkFrame(_encoder.encode(msg))


def decode(body: bytes) -> Setup | Ready:
    """A link frame's body; :class:`ProtocolError` for anything else (the peer's bytes)."""
    try:
        return _decoder.decode(body)
    except Exception as exc:  # (DecodeError, RecursionError, MemoryError, anything: still the peer's bytes)
        raise ProtocolError(f"malformed link frame: {type(exc).__name__}: {exc}") from None


def link_refusal(body: bytes) -> LinkFrame | None:
    """What a channel without a link answers to the peer's link frame ``body`` (reader thread): a
    :class:`Setup` is refused with ``Ready(False)`` (this endpoint offers no link to the peer), a
    :class:`Ready` needs no answer. :class:`ProtocolError` for a malformed body."""
    if isinstance(decode(body), Setup):
        return encode(Ready(False, "", "this endpoint does not offer the nccl plane to this peer"))
    return None
