"""Wire format: msgspec messages in a tagged union, length-prefixed frames.

Every frame on a channel is ``<u32 little-endian length><msgpack message>``.
Bulk bytes of a ``tcp`` put (or of a ``get`` reply) follow their header frame
directly, unframed: both sides know their lengths from the header's items.

Theory of operation, per connection::

    dialer                              acceptor
           <----------------------------  Challenge(protocol, nonce_a)
    Proof(nonce_d, mac_d) ------------->  checks mac_d (nothing else is read before it)
           <----------------------------  Proof(mac_a) + Hello   | Bye (refused) and close
    (checks mac_a)
    Hello  ---------------------------->
    (both check protocol version, names, incarnations)
    Put(tcp) + payload ---------------->  validate, recv_into buffer
           <----------------------------  Ack | Fail
    Put(shm) (bytes already copied) --->  validate
           <----------------------------  Ack | Fail
    Get(tcp) -------------------------->  validate
           <----------------------------  Data + payload | Fail
    Get(shm) (bytes already copied) --->  validate segments
           <----------------------------  Ack | Fail
    Put/Get(cuda_ipc) (copy completed)->  validate exports (as shm)
           <----------------------------  Ack | Fail
    Unmapped(epoch) (after a Registry:
      what left it is unmapped, unused) ->  release the memory held for it
    LinkFrame(Setup) (dialer, after
      Hello: the link's own frames) -->  join the channel's 2-rank link
    LinkFrame(Ready) <----------------> LinkFrame(Ready)  (both ok: the nccl plane is up;
                                           bodies: transport.planes.nccl_frames)
    Put(nccl) (dialer: its ncclSend
      already posted) ----------------->  post ncclRecv into the buffer
           <----------------------------  Ack (from the recv's completion) | Fail
    Put(nccl) <--- (listener: request)    dialer posts ncclRecv, answers
           Go ------------------------->  listener posts its ncclSend
    Notify (spends a credit) ---------->  queue for the application
           <----------------------------  Ack (none for a post)
           <----------------------------  Credit (as the application takes them)
    Registry (whenever it changes) ---->  replace cached copy
    Sync ------------------------------>
           <----------------------------  Registry, Ack
    Ping (when idle) ------------------>  (any frame proves liveness)
    Bye ------------------------------->  orderly close

The connection is symmetric: either side may initiate ops on it. New fields go
last, with defaults, so that older peers can still decode the message.

The first two frames each side reads (``Challenge`` or ``Proof``, or a ``Bye``
refusal) come from a peer that has not proved anything yet: they are read with
:func:`decode_preauth`, at most :data:`MAX_PREAUTH_FRAME` bytes, into a union
that holds only those small messages. The proofs (``transport.auth``) are
HMACs keyed by the job's secret over both nonces and the acceptor's published
address; a ``Hello`` is sent only to a peer whose proof checked.

Every decode failure (malformed msgpack, a type mismatch, nesting deeper than
the interpreter's recursion limit, an allocation that fails) raises
``msgspec.DecodeError`` (``ValidationError`` is a subclass): callers treat
them all as a protocol error.
"""

from __future__ import annotations

import struct
from typing import Any, Union

import msgspec

__all__ = [
    "MAX_FRAME",
    "MAX_LOST",
    "MAX_NOTIFY",
    "MAX_PREAUTH_FRAME",
    "PROTOCOL_VERSION",
    "Ack",
    "Bye",
    "Challenge",
    "Credit",
    "Data",
    "Fail",
    "Get",
    "Go",
    "Hello",
    "HostInfo",
    "IpcHandle",
    "Item",
    "LinkFrame",
    "Lost",
    "Message",
    "Notify",
    "Ping",
    "Proof",
    "Put",
    "Registry",
    "ShmHandle",
    "Sync",
    "Unmapped",
    "WireBuffer",
    "decode",
    "decode_preauth",
    "encode_frame",
    "frame_length",
]

# 2: cuda_ipc exports in WireBuffer, the Unmapped frame, the nccl plane's frames
# 3: the handshake starts with Challenge/Proof (the job's secret), the acceptor sends its Hello first
# 4: ShmHandle's slot-table fields (shm puts without a notification, and gets, need no round trip)
# 5: IpcHandle's slot-table fields (cuda_ipc puts without a notification, and gets, likewise)
# 6: Notify.answer (a posted notification: no Ack, no Fail)
# 7: LinkFrame (a link's set-up frames, opaque to the core) instead of NcclSetup / NcclReady
# 8: notification credits: Hello.notify_window, the Credit frame (transport.credits)
# 9: Hello.lost, the Lost frame (a peer's ended channels: their readers are fenced, transport.fence)
PROTOCOL_VERSION = 9
MAX_LOST = 16  # channel ids a Hello names as lost, at most
MAX_FRAME = 16 * 1024 * 1024  # control frames only; bulk payload is not framed
MAX_PREAUTH_FRAME = 4096  # frames read before the peer proved it belongs to the job
MAX_NOTIFY = 1024 * 1024
HEADER = struct.Struct("<I")


class ShmHandle(msgspec.Struct, array_like=True, frozen=True):
    """How a same-host peer maps a buffer: segment ``/proc/<pid>/fd/<fd>`` (checked by
    inode, ``size`` bytes long); the buffer starts ``offset`` bytes into it. ``export_id``
    is unique per registration, so a re-registered buffer is told apart even when it
    lands in the same segment. ``slot`` (0: none) is the export's word in the owner's slot
    table ``/proc/<pid>/fd/<table_fd>`` (inode ``table_inode``), through which puts and gets
    complete without a round trip (:mod:`transport.planes.shm_slots`)."""

    pid: int
    fd: int
    inode: int
    size: int
    offset: int
    export_id: int
    slot: int = 0
    table_fd: int = -1
    table_inode: int = 0


class IpcHandle(msgspec.Struct, array_like=True, frozen=True):
    """How a same-host peer maps a GPU buffer (the ``cuda_ipc`` plane): ``handle`` is the
    engine's export of the allocation that holds the buffer (``size`` bytes; for CUDA the
    ``cudaIpcMemHandle_t`` of the caching allocator's segment), ``device`` identifies the
    device it lives on (for CUDA the GPU's UUID, so that peers with different
    ``CUDA_VISIBLE_DEVICES`` agree), and the buffer starts ``offset`` bytes into the
    allocation. ``export_id`` is unique per registration, as for ``shm``; ``engine`` names
    the engine that made the handle (``cuda``, or ``memfd`` for the CPU test engine).
    ``slot`` (0: none) is the export's word in the owner's slot table
    ``/proc/<pid>/fd/<table_fd>`` (inode ``table_inode``), as for :class:`ShmHandle`: puts
    without a notification, and gets, then need no round trip."""

    engine: str
    device: str
    handle: bytes
    size: int
    offset: int
    export_id: int
    pid: int = 0
    slot: int = 0
    table_fd: int = -1
    table_inode: int = 0


class WireBuffer(msgspec.Struct, array_like=True, frozen=True):
    name: str
    dtype: str
    shape: list[int]
    device: str
    nbytes: int
    shm: Union[ShmHandle, None] = None
    ipc: Union[IpcHandle, None] = None


class HostInfo(msgspec.Struct, frozen=True):
    """Identity of the host (and pid namespace) a process runs on."""

    hostname: str
    boot_id: str
    pid_ns: int
    pid: int


class Item(msgspec.Struct, array_like=True, frozen=True):
    """One buffer range an op touches: ``count`` elements from element ``offset``.

    ``shape`` is set when the caller addressed the whole buffer; the target
    then checks it exactly.
    """

    name: str
    dtype: str
    offset: int
    count: int
    shape: Union[list[int], None] = None


class Hello(msgspec.Struct, tag="hello"):
    protocol: int
    name: str
    incarnation: int
    host: HostInfo
    planes: list[str]
    epoch: int
    buffers: list[WireBuffer]
    channel_id: str = ""
    # how many of the receiver's notifications the sender of this Hello holds unconsumed at most
    # (its max_pending_notifications): the receiver's credits on the new channel (transport.credits)
    notify_window: int = 0
    # the dialler's latest channels to the acceptor that it closed or lost (their ids): the acceptor
    # breaks those still open on its side and serves nothing of the new channel before their readers
    # stopped (transport.connector: the fence), so no op of a lost channel lands after a later one
    lost: list[str] = msgspec.field(default_factory=list)


class Registry(msgspec.Struct, tag="registry"):
    epoch: int
    buffers: list[WireBuffer]


class Put(msgspec.Struct, tag="put"):
    op_id: int
    seq: int
    plane: str
    items: list[Item]
    notify: Union[bytes, None] = None
    # shm: the export id of each item's buffer as the initiator copied into it; the target
    # checks that each is still the buffer's (0 for an empty item)
    segments: Union[list[int], None] = None


class Get(msgspec.Struct, tag="get"):
    """tcp: the target answers ``Data`` + payload. shm: the initiator already copied out of
    ``segments``; the target only checks they are still the buffers' and answers ``Ack``."""

    op_id: int
    seq: int
    items: list[Item]
    plane: str = "tcp"
    segments: Union[list[int], None] = None


class Data(msgspec.Struct, tag="data"):
    op_id: int


class Notify(msgspec.Struct, tag="notify"):
    op_id: int
    seq: int
    payload: bytes
    # False: posted (``Endpoint.post``): the sender does not wait, so the target answers nothing
    # (no Ack; a notification it cannot queue is dropped and logged, not answered with Fail)
    answer: bool = True


class Credit(msgspec.Struct, tag="credit"):
    """Credits given back: the sender's application has taken ``total`` of the receiver's
    notifications so far on this channel (cumulative: a late or repeated frame changes nothing)."""

    total: int


class Sync(msgspec.Struct, tag="sync"):
    """Ask the peer for its current registry: it answers ``Registry`` then ``Ack``."""

    op_id: int


class Ack(msgspec.Struct, tag="ack"):
    op_id: int


class Fail(msgspec.Struct, tag="fail"):
    op_id: int
    kind: str
    message: str


class Unmapped(msgspec.Struct, tag="unmapped"):
    """Nothing absent from the receiver's registry at ``epoch`` is mapped by the sender any more,
    nor used by a copy of its (``cuda_ipc``). Sent for every registry update by a same-host peer
    that offers ``cuda_ipc``, once its copies into exports that left the registry are over. The
    receiver holds the memory of each unregistered export until every such peer confirmed an
    epoch at least as new, so that its allocator cannot hand that memory to another tensor while
    a peer might still write into it."""

    epoch: int


class LinkFrame(msgspec.Struct, tag="link"):
    """A frame of the channel's link's own protocol (its set-up), opaque to the core: the plane
    that owns the link encodes and decodes ``body`` (:meth:`transport.planes.base.PeerLink.on_frame`;
    the ``nccl`` link's frames: :mod:`transport.planes.nccl_frames`)."""

    body: bytes


class Go(msgspec.Struct, tag="go"):
    """Dialer -> listener: post your half of your op ``op_id`` over the channel's link now (the
    dialer just posted its half; every post of a link follows the dialer's order)."""

    op_id: int


class Lost(msgspec.Struct, tag="lost"):
    """Our channels ``channel_ids`` to the receiver ended, and this one carries our ops from now on:
    the receiver breaks them where still open and serves nothing more of this channel before their
    readers stopped (``transport.fence``)."""

    channel_ids: list[str]


class Challenge(msgspec.Struct, tag="challenge"):
    """Acceptor -> dialer, the first frame of a connection: the acceptor's protocol version and a
    fresh nonce the dialer's proof must cover."""

    protocol: int
    nonce: bytes


class Proof(msgspec.Struct, tag="proof"):
    """A proof of membership in the job (``transport.auth``): the dialer's carries its own fresh
    nonce (the acceptor's proof covers it); the acceptor's leaves ``nonce`` empty."""

    mac: bytes
    nonce: bytes = b""


class _HelloVersion(msgspec.Struct, tag="hello"):
    """Only the version of a ``Hello`` (read before a proof: a peer of another protocol version
    sends its Hello first; nothing else of it is decoded)."""

    protocol: int


class Ping(msgspec.Struct, tag="ping"):
    pass


class Bye(msgspec.Struct, tag="bye"):
    reason: str = ""


Message = Union[Hello, Registry, Put, Get, Data, Notify, Credit, Sync, Ack, Fail, Unmapped, LinkFrame, Go, Ping,
                Bye, Lost, Challenge, Proof]
PreAuth = Union[Challenge, Proof, Bye, _HelloVersion]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_preauth_decoder = msgspec.msgpack.Decoder(PreAuth)


def encode_frame(msg: Message) -> bytes:
    """``msg`` as one length-prefixed frame."""
    body = _encoder.encode(msg)
    if len(body) > MAX_FRAME:
        raise ValueError(f"control frame of {len(body)} bytes exceeds {MAX_FRAME}")
    return HEADER.pack(len(body)) + body


def frame_length(prefix: bytes) -> int:
    """The body length announced by a 4-byte prefix; ``ValueError`` if oversize."""
    (n,) = HEADER.unpack(prefix)
    if n > MAX_FRAME:
        raise ValueError(f"frame length {n} exceeds the limit of {MAX_FRAME} bytes")
    return n


def _decode(decoder: msgspec.msgpack.Decoder[Any], body: bytes | memoryview) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError:
        raise
    except RecursionError:  # msgspec bounds nesting by the interpreter's recursion limit
        raise msgspec.DecodeError("frame nested too deeply") from None
    except Exception as exc:  # MemoryError, OverflowError, anything: still the peer's bytes
        raise msgspec.DecodeError(f"undecodable frame: {type(exc).__name__}: {exc}") from None


def decode(body: bytes | memoryview) -> Message:
    """Decode one frame body; every failure raises ``msgspec.DecodeError`` (or its subclass
    ``ValidationError``), whatever went wrong inside the decoder."""
    return _decode(_decoder, body)  # type: ignore[no-any-return]


def decode_preauth(body: bytes) -> Challenge | Proof | Bye | int:
    """Decode a frame read before the peer proved itself: a ``Challenge``, ``Proof`` or ``Bye``,
    or, for a peer's ``Hello`` (a peer of another protocol version), only its protocol number.
    Raises ``msgspec.DecodeError`` like :func:`decode`."""
    msg = _decode(_preauth_decoder, body)
    return msg.protocol if isinstance(msg, _HelloVersion) else msg  # type: ignore[no-any-return]
