"""One channel per connected peer: op sequencing, acks, deadlines, abort, heartbeats.

A channel owns one connection to one incarnation of a peer (a Unix-domain
socket to a peer on this host, else TCP: :mod:`transport.local_socket`) and two
threads: a *reader* that parses frames (and receives bulk bytes straight into
registered tensors; :class:`~transport.dispatch.Dispatcher`) and the writer of
its :class:`~transport.sender.Sender`, which sends frames in order (small ones
go straight from the calling thread).
Threads keep blocking socket I/O, and the GIL-free ``recv_into``/``sendall``
of large payloads, off the event loop; they report to the loop with
``call_soon_threadsafe``.

Theory of operation (channel states)::

    state     event                          next      effect
    OPEN      op posted                      OPEN      frames queued in order
    OPEN      Bye received / close()         CLOSED    pending ops fail (PeerLost / EndpointClosed)
    OPEN      EOF, socket error              BROKEN    pending ops fail with PeerLostError
    OPEN      a send meets the peer's close  OPEN      the reader ends it (its Bye: CLOSED), else BROKEN in 0.5 s
    OPEN      no traffic for hb timeout      BROKEN    pending ops fail with PeerLostError
    OPEN      malformed frame                BROKEN    ProtocolError logged, pending ops fail
    CLOSED/BROKEN  anything                  same      ignored; the endpoint dials anew

Ops (see :mod:`transport.planes.base` for one op's lifecycle) are numbered
with a per-channel sequence number; the target handles headers strictly in
stream order, so both sides agree on the order of every op. An op's future is
settled by the reader thread when the target answers. A caller that stops
waiting (timeout, cancellation) leaves the op in the table marked
*abandoned*: its late reply is still consumed (a late ``get`` payload is
drained into scratch, not written into the caller's tensor), so the stream
never desynchronises. The table and each op's run, abandon and settling are
the channel's :class:`~transport.op_table.OpTable`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .credits import NoteCredits, carries_note
from .dispatch import Dispatcher
from .errors import (
    EndpointClosedError,
    PeerLostError,
    StagingError,
    TransportTimeoutError,
)
from .flight_recorder import OpKind, OpState, Record
from .handshake import specs_from_wire
from .hostinfo import local_host, same_host
from .local_socket import family_name
from .loop_reads import LoopReads
from .loop_reads import enabled as loop_reads_enabled
from .op import Op
from .op_table import OpTable, Place
from .peer import Notification, Peer
from .planes import PeerLink, PlaneChoice, needs_unmap_acks
from .receiver import Receiver
from .registry import BufferSpec
from .sender import Sender, chain
from .serving import Serving
from .staging import Staging
from .wire import (
    Bye,
    Hello,
    HostInfo,
    Item,
    Message,
    Notify,
    Ping,
    Registry,
    Sync,
    Unmapped,
    WireBuffer,
    encode_frame,
)

if TYPE_CHECKING:
    from .planes.base import DataPlane, Exporter

__all__ = ["Channel", "ChannelState", "Notification", "Op"]

log = logging.getLogger(__name__)



_HUNG_UP_GRACE = 0.5  # s the reader has to find the Bye of a peer that closed while we sent, before it is lost


class ChannelState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"
    BROKEN = "broken"


class CoreProtocol(Protocol):
    """What a channel needs from its endpoint (implemented by ``Endpoint``)."""

    name: str
    incarnation: int
    loop: asyncio.AbstractEventLoop

    staging: Staging
    planes: tuple[str, ...]  # the planes this endpoint allows
    @property
    def notify_window(self) -> int: ...  # the notification credits we grant each peer (transport.credits)

    def exporter(self, plane: str) -> Exporter | None: ...  # a plane's exporter (None: not allowed, exports nothing)

    def unmapped(self, ch: Channel, epoch: int) -> None: ...  # reader thread
    def deliver(self, note: Notification, ch: Channel, here: bool = False,  # reader thread or loop
                ack: Callable[[], None] | None = None) -> bool: ...
    def wire_registry(self) -> tuple[int, list[WireBuffer]]: ...  # any thread
    def channel_closed(self, ch: Channel, exc: BaseException) -> None: ...  # event loop
    def on_timeout(self, ch: Channel, op: Op, exc: TransportTimeoutError) -> None: ...  # event loop


class Channel:
    """A connection to one incarnation of one peer. Created by the endpoint."""

    def __init__(
        self,
        core: CoreProtocol,
        sock: socket.socket,
        remote: Hello,
        channel_id: str,
        plane_cls: type[DataPlane],
        plane_reason: str,
        *,
        registry: Any,
        recorder: Any,
    ) -> None:
        self.core = core
        self.loop: asyncio.AbstractEventLoop = core.loop
        self.id = channel_id
        self.peer_name = remote.name
        self.incarnation = remote.incarnation
        self.host: HostInfo = remote.host
        self.remote_planes: tuple[str, ...] = tuple(remote.planes)
        # a same-host peer that may map our exports confirms registry updates (planes.needs_unmap_acks)
        here = local_host()
        self.unmap_acks = needs_unmap_acks(core.planes, self.remote_planes,
                                         same_host(here, remote.host)[0] and here.pid != remote.host.pid)
        self.holder: str | None = None  # its key in the endpoint's Retention, if it is a holder
        self.remote_epoch = remote.epoch
        self.remote_wire: dict[str, WireBuffer] = {b.name: b for b in remote.buffers}
        self.peer_specs: dict[str, BufferSpec] = specs_from_wire(remote.buffers)
        self.registry = registry
        self.recorder = recorder
        self.state = ChannelState.OPEN
        self.error: BaseException | None = None
        self.orderly = False  # closed by a Bye, not by a failure
        self.plane: DataPlane = plane_cls(self)
        self._bye = False  # say_bye ran
        self._hung_up: PeerLostError | None = None  # the peer closed its end while we sent (_peer_hung_up)
        self.plane_reason = plane_reason
        self.staging = core.staging
        self.link: PeerLink | None = None  # the channel's NCCL link, if both endpoints offer nccl (set by the endpoint)
        self.planes = PlaneChoice(self)  # the GPU planes and the choice of a plane per op
        self._sock = sock
        self.socket_kind = family_name(sock)  # "unix" (a same-host peer: transport.local_socket) or "tcp"
        self._lock = threading.Lock()
        self.ops = OpTable(self, self._lock)  # the initiator's pending ops and their lifecycle
        self.credits = NoteCredits(self, remote.notify_window, core.notify_window)  # notifications, both ways
        self._tx = Sender(sock, self.peer_name, self._send_failed)
        self._rx = Receiver(sock, lambda: self.is_open)  # (reader thread only)
        self._target = Serving(self, self._rx, self._lock)  # the target's half: the peer's ops, served by the reader
        # the loop reads its ops' answers and the posts it expects itself (loop_reads), where the plane allows
        loop_reads = loop_reads_enabled() and self.plane.answers_on_loop
        self.reads: LoopReads | None = (LoopReads(self, sock, self._rx, self.ops, self._target.serve_notify_here)
                                        if loop_reads else None)
        self._frames = Dispatcher(self, self._rx, self._target, self.ops, self.reads)  # the reader thread's frames
        self._reader = threading.Thread(target=self._frames.read_loop, name=f"transport-rx-{self.peer_name}",
                                        daemon=True)
        self.fence: list[threading.Thread] = []  # readers of the peer's old channels to wait for (transport.fence)
        self.fence_lost: Callable[[list[str]], list[threading.Thread]] = lambda ids: []  # (set by the connector)
        self.peer = Peer(self)

    def start(self) -> None:
        self._reader.start()
        self._tx.start()

    @property
    def is_open(self) -> bool:
        return self.state is ChannelState.OPEN

    @property
    def reader(self) -> threading.Thread:
        """The channel's reader thread (it serves the peer's ops)."""
        return self._reader

    # ---------------------------------------------------------------- initiator side
    def new_op(self, kind: OpKind, names: list[str], nbytes: int, plane: DataPlane | None = None, *,
               answered: bool = True) -> Op:
        """Allocate an op (event loop) that moves its bytes over ``plane`` (default: the channel's);
        ``answered`` False: no answer is expected (a posted notification, an op its plane may finish
        on this side alone), so the loop does not ask for the socket's reads (:mod:`transport.loop_reads`).
        Raises :class:`PeerLostError` if the channel is down."""
        plane = plane or self.plane
        if not self.is_open:
            raise PeerLostError(f"channel to {self.peer_name!r} is {self.state.value}: {self.error}")
        op = self.ops.new_op(kind, names, nbytes, plane)
        if self.reads is not None and answered:
            self.reads.want_replies()
        return op

    # ---------------------------------------------------------------- plane choice (planes.choice)
    def plane_for(self, pairs: Sequence[tuple[Item, torch.Tensor]]) -> DataPlane:
        """The plane for one op (event loop): :meth:`~transport.planes.choice.PlaneChoice.plane_for`."""
        return self.planes.plane_for(pairs)

    def reason_for(self, plane: DataPlane) -> str:
        """Why an op that :meth:`plane_for` gave ``plane`` takes it (event loop)."""
        return self.planes.reason_for(plane)

    def map_plane(self, name: str) -> tuple[DataPlane, str]:
        """The plane that aliases the peer's buffer ``name`` here, and why
        (:meth:`~transport.planes.choice.PlaneChoice.map_plane`)."""
        return self.planes.map_plane(name)

    def gpu_plane_choice(self) -> tuple[str, str]:
        """This peer's plane for GPU buffers and why (:func:`~transport.planes.choose_gpu_plane`)."""
        return self.planes.gpu_plane_choice()

    def link_changed(self) -> None:
        """Event loop: the NCCL link was set up or went down: choose the GPU plane again (logged)."""
        self.planes.link_changed()

    @property
    def gpu_plane(self) -> str | None:
        """The plane for GPU buffers (None until the first op on one decided it)."""
        return self.planes.gpu_plane

    @property
    def gpu_plane_reason(self) -> str | None:
        return self.planes.gpu_plane_reason

    @property
    def last_refusal(self) -> str:
        """Why the latest op that could not use the GPU plane was staged ("" if it could)."""
        return self.planes.last_refusal

    def send(self, msg: Message, payload: Sequence[memoryview] | Iterator[memoryview] = (), *,
             op: Op | None = None, direct: bool = True,
             early: Callable[[StagingError], None] | None = None,
             on_sent: Callable[[], None] | None = None, on_dropped: Callable[[], None] | None = None) -> None:
        """Send ``msg`` (and raw ``payload`` behind it) after everything sent before. Never blocks.

        Small frames go out from the calling thread; the rest through the writer thread. A
        ``payload`` that is an iterator (the staged path) is drained by the writer thread, which
        sends nothing else until it is exhausted; if it fails before its first buffer, nothing
        is sent and ``early`` gets the error (from the writer thread). ``on_sent`` (not with ``op``)
        / ``on_dropped``: once it was sent whole / never will be (also if this raises): Sender.submit."""
        if not self.is_open:
            if on_dropped is not None:
                on_dropped()
            raise PeerLostError(f"channel to {self.peer_name!r} is {self.state.value}: {self.error}")
        if op is not None:
            op.on_wire = True
            rec = op.record
            on_sent = lambda: self.recorder.update(rec, OpState.SENT)  # noqa: E731
        if carries_note(msg):  # (spends a credit; one that is never sent gives it back)
            self.credits.sent()
            on_dropped = self.credits.unsent_then(on_dropped)
        head = encode_frame(msg)
        frames: list[bytes | memoryview] | Iterator[bytes | memoryview]
        # (concrete types first: an ABC isinstance check costs more than the rest of a small send)
        frames = [head, *payload] if isinstance(payload, (list, tuple)) else chain(head, iter(payload), early)
        if not self._tx.submit(frames, on_sent, direct=direct, on_dropped=on_dropped):
            raise PeerLostError(f"channel to {self.peer_name!r} is {self.state.value}: {self.error}")

    def send_quietly(self, msg: Message) -> None:
        """:meth:`send`, for answers that do not matter once the channel is gone (any thread)."""
        try:
            self.send(msg)
        except PeerLostError:
            pass

    def _send_failed(self, exc: Exception) -> None:
        if isinstance(exc, (BrokenPipeError, ConnectionResetError)) and self._peer_hung_up(exc):
            return
        if isinstance(exc, StagingError):
            lost = PeerLostError(f"channel to {self.peer_name!r} closed: a staged payload could not be completed "
                                 f"and the peer had seen part of it ({exc})")
        else:
            lost = PeerLostError(f"sending to {self.peer_name!r} failed: {exc}")
        lost.__cause__ = exc
        self.lose(lost)

    def _peer_hung_up(self, exc: OSError) -> bool:
        """The peer closed its end while we sent (any thread). The reader reads what the peer sent
        before it closed, usually a Bye (an orderly close, not a loss), and ends the channel;
        meanwhile sends fail here again and are taken the same way (the reader's own answers too,
        so it gets to that Bye; a posted notification is then lost, as ``post`` allows; an op
        waiting for an answer fails when the channel ends). Failing that, :data:`_HUNG_UP_GRACE` s
        from the first failure the channel is lost with ``exc``. False (lose it at once) if the
        event loop is gone."""
        if self._hung_up is not None:
            return True
        lost = PeerLostError(f"sending to {self.peer_name!r} failed: the peer closed its end ({exc})")
        lost.__cause__ = exc
        self._hung_up = lost
        try:
            self.loop.call_soon_threadsafe(self.loop.call_later, _HUNG_UP_GRACE, self.lose, lost)
        except RuntimeError:
            return False
        return True

    @property
    def last_tx(self) -> float:
        return self._tx.last_tx

    @property
    def last_rx(self) -> float:
        """The last time the peer's bytes arrived (or the reader was held up by this side)."""
        return self._rx.last_rx

    @last_rx.setter
    def last_rx(self, when: float) -> None:  # (reader thread)
        self._rx.last_rx = when

    def run(self, op: Op, start: Callable[[], Any], deadline: float, place: Place | None = None,
            ordered: bool = True, keep_on: type[BaseException] | None = None) -> Coroutine[Any, Any, None]:
        """Run ``start()`` (which sends the op) and wait for its completion until ``deadline``:
        await it (it is :meth:`~transport.op_table.OpTable.run`: :class:`TransportTimeoutError` at
        the deadline, :class:`PeerLostError` if the channel breaks, the target's error if it
        rejects; cancellation stops the wait only; ``place``, ``ordered``, ``keep_on`` as there)."""
        return self.ops.run(op, start, deadline, place, ordered, keep_on)

    def reserve(self) -> Place:
        """Event loop: a place in the call order for an op that awaits before it is handed over
        (:meth:`~transport.op_table.OpTable.reserve`); to :meth:`run`, else :meth:`give_back`."""
        return self.ops.reserve()

    def give_back(self, place: Place) -> None:
        """Event loop: a place :meth:`reserve` gave, not used (:meth:`~transport.op_table.OpTable.give_back`)."""
        self.ops.give_back(place)

    async def sync_registry(self, deadline: float) -> None:
        """Fetch the peer's current registry (one round trip); bounded by ``deadline``."""
        op = self.new_op(OpKind.SYNC, [], 0)

        async def _send() -> None:
            self.send(Sync(op.op_id), op=op)

        await self.run(op, _send, deadline, ordered=False)  # (an op holding a place may await it)

    # ---------------------------------------------------------------- the op table (op_table.OpTable)
    def fail_op(self, op: Op, exc: BaseException, lost: BaseException | None = None) -> None:
        """Any thread: fail ``op`` with ``exc``; with ``lost``, break the channel first
        (:meth:`~transport.op_table.OpTable.fail_op`)."""
        self.ops.fail_op(op, exc, lost)

    def record_here(self, kind: OpKind, names: list[str], nbytes: int, plane: str, t_posted: float,
                    error: BaseException | None = None) -> Record:
        """The flight recorder's record of an op a plane did right here, with no op object
        (:meth:`~transport.op_table.OpTable.record_here`). Any thread."""
        return self.ops.record_here(kind, names, nbytes, plane, t_posted, error)

    def in_order_now(self) -> bool:
        """Whether an op started now goes out at once (no earlier op of the channel is still held
        back, waiting before it is handed over: see :meth:`run`)."""
        return self.ops.in_order_now()

    def hold_order(self) -> Callable[[], None]:
        """Event loop: later ops of the channel wait until the returned function is called (on
        the event loop): :meth:`~transport.op_table.OpTable.hold_order`."""
        return self.ops.hold_order()

    def post_here(self, payload: bytes, reply_expected: bool = False, rec: Record | None = None) -> None:
        """Event loop: send ``payload`` as a notification nothing answers, right now (nothing of
        the channel is held back: :meth:`in_order_now`), recorded in the flight recorder as done
        (or failed) in one step (:meth:`~transport.op_table.OpTable.post_here`). Raises
        :class:`PeerLostError` if the channel is down. ``reply_expected``: the loop asks for the reads.
        ``rec``: a parked post's record (:meth:`~transport.op_table.OpTable.park_post`)."""
        self.ops.post_here(lambda op_id, seq: self.send(Notify(op_id, seq, bytes(payload), False)), len(payload),
                           self.plane.name, rec)
        if self.reads is not None and reply_expected:
            self.reads.want_replies()

    def finish_here(self, op: Op) -> None:
        """Event loop: ``op`` completed on this side alone (a one-sided shm put or get): it leaves
        the table of pending ops and succeeds."""
        self.ops.finish_here(op)

    # ---------------------------------------------------------------- heartbeats
    def tick(self, now: float, interval: float, timeout: float) -> None:
        """Event loop, every ``interval``: send a ping if idle, declare the peer lost if silent."""
        if not self.is_open:
            return
        if now - self.last_rx > timeout:
            self.lose(PeerLostError(f"no traffic from {self.peer_name!r} for {now - self.last_rx:.1f} s (heartbeats missed)"))
            return
        if now - self.last_tx >= interval:
            self.send(Ping())

    # ---------------------------------------------------------------- teardown
    def lose(self, exc: BaseException) -> None:
        """Break the channel (any thread): fail pending ops with ``exc``, close the socket."""
        with self._lock:
            if self.state is not ChannelState.OPEN:
                return
            self.state = ChannelState.CLOSED if isinstance(exc, EndpointClosedError) else ChannelState.BROKEN
            self.error = exc
            pending = list(self.ops.pending.values())
            self.ops.pending.clear()
            replies = list(self._target.replies.values())
            self._target.replies.clear()
        if self.link is not None:  # NCCL ops cannot be cancelled: abort the communicator (a worker thread)
            self.link.abort(exc)
        for rec in replies:  # staged get replies the writer will not finish (one it is sending fails anyway)
            self.recorder.update(rec, OpState.FAILED, f"the channel closed before the reply was sent: {exc}")
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._tx.close()
        if self.reads is not None:
            self.reads.wake()
        for op in pending:
            self.ops.settle_from_thread(op, exc)
        try:
            self.loop.call_soon_threadsafe(self._closed, exc)
        except RuntimeError:
            pass

    def _closed(self, exc: BaseException) -> None:
        self.credits.close()
        if self.reads is not None:
            self.reads.close()
        self.plane.close()
        self.planes.close()
        self.core.channel_closed(self, exc)

    def say_bye(self, reason: str) -> None:
        """First step of an orderly close: queue a Bye behind everything already queued (any
        thread but the loop's: it may wait, at most 1 s, for our planes' copies into the peer's mapped memory to be over
        (:meth:`PlaneChoice.quiesce`), since a Bye tells the peer that nothing of ours writes into
        its memory any more; if they are not, no Bye is sent and the peer holds its unregistered
        exports until this process exits). Once called, no new such copy starts on this channel.
        Idempotent."""
        if not self.is_open or self._bye:
            return
        self._bye = True
        if not self.planes.quiesce(1.0):
            log.warning("channel %s: copies into %r's mapped memory still running at close; closing without a Bye",
                        self.id, self.peer_name)
            return
        self._tx.submit([encode_frame(Bye(reason))])

    def close(self, reason: str, timeout: float = 1.0, error: BaseException | None = None,
              unsent: bool = True) -> None:
        """Orderly close (any thread but the reader): let the Bye go out (bounded by
        ``timeout``), then break with ``error`` (default :class:`EndpointClosedError`).
        ``unsent`` False: frames queued and not started yet are dropped, not sent before the Bye."""
        if not unsent:
            self._tx.drop_queued()
        self.say_bye(reason)
        if self.is_open:
            self._tx.flush(timeout)
        self.lose(error or EndpointClosedError(f"endpoint {self.core.name!r} closed the channel: {reason}"))

    def join(self, timeout: float) -> None:
        """Wait (bounded) for both threads to finish, then close the socket."""
        end = time.monotonic() + timeout
        self._tx.join(timeout)
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(max(0.0, end - time.monotonic()))
        if self.reads is not None and not self._reader.is_alive():
            self.reads.release()
        try:
            self._sock.close()
        except OSError:
            pass

    # ---------------------------------------------------------------- the peer's registry (reader thread)
    def take_registry(self, msg: Registry) -> None:
        """Reader thread: the peer announced its registry (ignored if an update already overtook it)."""
        specs = specs_from_wire(msg.buffers)
        if msg.epoch < self.remote_epoch:  # overtaken by a newer one (a Sync reply races flushes)
            return
        wire = {b.name: b for b in msg.buffers}
        old = self.remote_wire
        self.remote_wire, self.peer_specs, self.remote_epoch = wire, specs, msg.epoch
        self.plane.registry_changed()
        if self.unmap_acks:  # confirm the epoch once nothing of ours uses the exports that left it
            if not self.planes.retire(old, wire, msg.epoch):  # nothing of ours ever mapped them
                self.send(Unmapped(msg.epoch))
