"""One channel per connected peer: op sequencing, acks, deadlines, abort, heartbeats.

A channel owns one TCP connection to one incarnation of a peer and two
threads: a *reader* that parses frames (and receives bulk bytes straight into
registered tensors) and the writer of its :class:`~transport.sender.Sender`,
which sends frames in order (small ones go straight from the calling thread).
Threads keep blocking socket I/O, and the GIL-free ``recv_into``/``sendall``
of large payloads, off the event loop; they report to the loop with
``call_soon_threadsafe``.

Theory of operation (channel states)::

    state     event                          next      effect
    OPEN      op posted                      OPEN      frames queued in order
    OPEN      Bye received / close()         CLOSED    pending ops fail (PeerLost / EndpointClosed)
    OPEN      EOF, socket error              BROKEN    pending ops fail with PeerLostError
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
never desynchronises.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import torch

from .errors import (
    ERROR_KINDS,
    EndpointClosedError,
    PeerLostError,
    Phase,
    ProtocolError,
    RemoteError,
    StagingError,
    TransportTimeoutError,
)
from .flight_recorder import OpKind, OpState, Record
from .handshake import specs_from_wire
from .hostinfo import local_host, same_host
from .op import Op
from .peer import Notification, Peer
from .planes import PlaneChoice
from .receiver import RX_POLL_S, Receiver
from .registry import BufferSpec
from .sender import Sender
from .serving import Serving
from .staging import Staging
from .wire import (
    Ack,
    Bye,
    Data,
    Fail,
    Get,
    Go,
    Hello,
    HostInfo,
    Item,
    Message,
    NcclReady,
    NcclSetup,
    Notify,
    Ping,
    Put,
    Registry,
    Sync,
    Unmapped,
    WireBuffer,
    decode,
    encode_frame,
)

if TYPE_CHECKING:
    from .ipc import IpcEngine
    from .link import Link
    from .planes.base import DataPlane

__all__ = ["Channel", "ChannelState", "Notification", "Op"]

log = logging.getLogger(__name__)

_P2P_ABANDON_GRACE = 0.25  # s an abandoned op's NCCL receive may take to complete before the link is aborted,
_P2P_ABANDON_RATE = 1e9  # ... plus its bytes at this rate (bytes/s): a healthy slow link is not cut off
_RX_CHUNK = 4 << 20  # a get's payload is received in chunks so that an abandoned get stops writing
_MAX_ITEM_BYTES = 1 << 44  # 16 TiB: anything larger in a header is hostile


_STATE_HINT = {
    "posted": "not yet sent, queued behind earlier traffic or still copying",
    "sent": "sent, no answer from the target",
}


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
    def ipc_engine(self) -> IpcEngine | None: ...  # the cuda_ipc plane's engine (None: no cuda_ipc here)
    @property
    def ipc_reason(self) -> str: ...  # why there is (or is not) an engine

    def ipc_unmapped(self, ch: Channel, epoch: int) -> None: ...  # reader thread
    def deliver(self, note: Notification, ch: Channel) -> bool: ...  # reader thread; blocks while the queue is full
    def wire_registry(self) -> tuple[int, list[WireBuffer]]: ...  # any thread
    def channel_closed(self, ch: Channel, exc: BaseException) -> None: ...  # event loop
    def on_timeout(self, ch: Channel, op: Op, exc: TransportTimeoutError) -> None: ...  # event loop


def _chain(head: bytes, payload: Iterator[memoryview],
           early: Callable[[StagingError], None] | None = None) -> Iterator[bytes | memoryview]:
    """A header frame and a lazily produced payload, as one iterator submission (closing it
    closes ``payload``). The payload's first buffer is produced *before* the header goes out:
    if that fails (``early`` is told), nothing was sent and the channel stays in sync. Any
    error there is reported, as a :class:`StagingError` (the original as its cause): one that
    reached the writer unreported would leave the op waiting for its deadline."""
    try:
        first = next(payload, None)
    except Exception as exc:
        if isinstance(exc, StagingError):
            if early is not None:
                early(exc)
            raise
        err = StagingError(f"cannot produce the payload: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        if early is not None:
            early(err)
        raise err from exc
    yield head
    if first is not None:
        yield first
        yield from payload


def _expire(fut: asyncio.Future[None]) -> None:
    """An op's deadline passed (event loop): its wait ends with ``TimeoutError``."""
    if not fut.done():
        fut.set_exception(TimeoutError())


class Channel:
    """A connection to one incarnation of one peer. Created by the endpoint."""

    _op_ids = itertools.count(1)

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
        # same-host peers that both offer cuda_ipc confirm each registry update (Unmapped): the
        # owner of an unregistered export holds its memory until they did (transport.retention.Retention)
        here = local_host()
        self.ipc_acks = ("cuda_ipc" in self.remote_planes and "cuda_ipc" in core.planes
                         and same_host(here, remote.host)[0] and here.pid != remote.host.pid)
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
        self.plane_reason = plane_reason
        self.staging = core.staging
        self.link: Link | None = None  # the channel's NCCL link, if both endpoints offer nccl (set by the endpoint)
        self.planes = PlaneChoice(self)  # the GPU planes and the choice of a plane per op
        self._sock = sock
        self._seq = itertools.count(1)
        self._pending: dict[int, Op] = {}
        # the hand-over to the sender of the latest op that had to be ordered behind, or could wait
        # before sending (a staged op awaiting the caller's CUDA work): ops go out in call order
        self._order_tail: asyncio.Future[None] | None = None
        self._lock = threading.Lock()
        self._tx = Sender(sock, self.peer_name, self._send_failed)
        self._rx = Receiver(sock, lambda: self.is_open)  # (reader thread only)
        self._target = Serving(self, self._rx, self._lock)  # the target's half: the peer's ops, served by the reader
        self._reader = threading.Thread(target=self._read_loop, name=f"transport-rx-{self.peer_name}", daemon=True)
        self.peer = Peer(self)

    def start(self) -> None:
        self._reader.start()
        self._tx.start()

    @property
    def is_open(self) -> bool:
        return self.state is ChannelState.OPEN

    # ---------------------------------------------------------------- initiator side
    def new_op(self, kind: OpKind, names: list[str], nbytes: int, plane: DataPlane | None = None) -> Op:
        """Allocate an op (event loop) that moves its bytes over ``plane`` (default: the channel's).
        Raises :class:`PeerLostError` if the channel is down."""
        plane = plane or self.plane
        if not self.is_open:
            raise PeerLostError(f"channel to {self.peer_name!r} is {self.state.value}: {self.error}")
        op_id = next(Channel._op_ids)
        seq = next(self._seq)
        rec = self.recorder.record(
            op_id=op_id,
            channel=self.id,
            seq=seq,
            role="initiator",
            initiator=self.core.name,
            peer=self.peer_name,
            kind=kind,
            names=names,
            nbytes=nbytes,
            plane=plane.name,
            state=OpState.POSTED,
        )
        op = Op(self.loop, op_id, seq, kind, rec, plane.inline_payload)
        op.gated = not plane.sends_at_once
        with self._lock:
            self._pending[op_id] = op
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
             early: Callable[[StagingError], None] | None = None) -> None:
        """Send ``msg`` (and raw ``payload`` behind it) after everything sent before. Never blocks.

        Small frames go out from the calling thread; the rest through the writer thread. A
        ``payload`` that is an iterator (the staged path) is drained by the writer thread, which
        sends nothing else until it is exhausted; if it fails before its first buffer, nothing
        is sent and ``early`` gets the error (from the writer thread).
        """
        if not self.is_open:
            raise PeerLostError(f"channel to {self.peer_name!r} is {self.state.value}: {self.error}")
        on_sent = None
        if op is not None:
            op.on_wire = True
            rec = op.record
            on_sent = lambda: self.recorder.update(rec, OpState.SENT)  # noqa: E731
        head = encode_frame(msg)
        frames: list[bytes | memoryview] | Iterator[bytes | memoryview]
        # (concrete types first: an ABC isinstance check costs more than the rest of a small send)
        frames = [head, *payload] if isinstance(payload, (list, tuple)) else _chain(head, iter(payload), early)
        if not self._tx.submit(frames, on_sent, direct=direct):
            raise PeerLostError(f"channel to {self.peer_name!r} is {self.state.value}: {self.error}")

    def send_quietly(self, msg: Message) -> None:
        """:meth:`send`, for answers that do not matter once the channel is gone (any thread)."""
        try:
            self.send(msg)
        except PeerLostError:
            pass

    def _send_failed(self, exc: Exception) -> None:
        if isinstance(exc, StagingError):
            lost = PeerLostError(f"channel to {self.peer_name!r} closed: a staged payload could not be completed "
                                 f"and the peer had seen part of it ({exc})")
        else:
            lost = PeerLostError(f"sending to {self.peer_name!r} failed: {exc}")
        lost.__cause__ = exc
        self.lose(lost)

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

    async def run(self, op: Op, start: Callable[[], Any], deadline: float) -> None:
        """Run ``start()`` (which sends the op) and wait for its completion until ``deadline``.

        Raises :class:`TransportTimeoutError` at the deadline,
        :class:`PeerLostError` if the channel breaks, the target's error if it
        rejects. Cancellation stops the wait only: bytes already handed to the
        writer or to a copy thread still go out, and the channel stays usable.
        """
        try:
            prev = self._order_tail
            if not op.gated and (prev is None or prev.done()):
                # the common case: the op is handed to the sender at once, in call order, and only its
                # future is awaited: a timer fails it at the deadline (cheaper than a timeout scope)
                timer = self.loop.call_at(deadline, _expire, op.future)
                try:
                    await start()
                    await op.future
                finally:
                    timer.cancel()
            else:
                async with asyncio.timeout_at(deadline):
                    await self._in_order(prev, start)
                    await op.future
        except TimeoutError:
            was = op.record.state
            if op.p2p:  # its NCCL operations cannot be called back: abort the link (and the channel)
                self.lose(PeerLostError(f"{op.kind.value} #{op.op_id} over the NCCL link with {self.peer_name!r} "
                                        "timed out: the channel's communicator was aborted and the channel closed"))
            try:
                note = await self._abandon(op)
            finally:  # (even if cancelled again meanwhile: the record always ends)
                self.recorder.update(op.record, OpState.TIMED_OUT)
            exc = TransportTimeoutError(
                f"{op.kind.value} #{op.op_id} (seq {op.seq}) to {self.peer_name!r} did not complete before "
                f"its deadline (it was {was}: {_STATE_HINT.get(was, '')})" + (f"; {note}" if note else ""),
                Phase.NOTIFY if op.kind is OpKind.NOTIFY else Phase.TRANSFER,
            )
            self.core.on_timeout(self, op, exc)
            raise exc from None
        except asyncio.CancelledError:
            try:
                await self._abandon(op)
            finally:
                self.recorder.update(op.record, OpState.CANCELLED)
            raise
        except Exception as exc:
            try:
                await self._abandon(op)
            finally:
                self.recorder.update(op.record, OpState.FAILED, exc)
            raise
        except BaseException as exc:  # KeyboardInterrupt, GeneratorExit...: no await here
            bound = self._abandon_now(op)
            if bound:
                op.quiet.wait(min(bound, 1.0))
            self._forget(op)
            self.recorder.update(op.record, OpState.FAILED, exc)
            raise

    async def _in_order(self, prev: asyncio.Future[None] | None, start: Callable[[], Any]) -> None:
        """Hand an op to the sender only after ``prev`` (the op called before it that could wait)
        did, whatever became of it: a notify, put or get called after a staged op that still
        awaits the caller's CUDA work reaches the peer after it, as on every other plane."""
        mine: asyncio.Future[None] = self.loop.create_future()
        self._order_tail = mine
        try:
            if prev is not None and not prev.done():
                await asyncio.shield(prev)
            await start()
        finally:
            mine.set_result(None)
            if self._order_tail is mine:
                self._order_tail = None

    async def sync_registry(self, deadline: float) -> None:
        """Fetch the peer's current registry (one round trip); bounded by ``deadline``."""
        op = self.new_op(OpKind.SYNC, [], 0)

        async def _send() -> None:
            self.send(Sync(op.op_id), op=op)

        await self.run(op, _send, deadline)

    async def _abandon(self, op: Op) -> str | None:
        """The caller stopped waiting (event loop). An op whose header went out stays in the table
        until its reply arrives (a get's payload must still be consumed); one that never reached
        the wire is forgotten now. No byte is written into the caller's tensors (or, by a copy of ours, the peer's buffer) after this
        returns: a writer that is busy stops at its next chunk (a local copy, or bytes arriving
        fast); bytes that trickle in are cut off by closing the channel.

        A staged get's copies into the caller's tensor cannot be called back: they are waited
        for until the op is quiet, up to the staging stall bound (``stall_timeout`` plus the
        time to give up on the copies behind a stuck one and on the socket), off the event
        loop (this coroutine awaits a worker thread; cancelling it again does not cut that
        wait short, the cancellation is re-raised after it). Returns None once nothing more
        will be written, else a sentence saying what may still be (also logged): a copy stuck
        past its bound (its tensor is then held until it ends, see :func:`~transport.staging.stage_in`)."""
        try:
            bound = self._abandon_now(op)
            grace = _P2P_ABANDON_GRACE + op.record.nbytes / _P2P_ABANDON_RATE  # (a big receive on a slow link)
            if bound and op.p2p and not await self._wait_quiet(op, grace):
                # an NCCL receive cannot be called back: one still pending after the grace (a frozen or
                # slow peer) is stopped by aborting the link, which closes the channel
                self.lose(PeerLostError(
                    f"{op.kind.value} #{op.op_id} was abandoned with its NCCL receive still pending after "
                    f"{grace:.2f} s: the link with {self.peer_name!r} was aborted and the channel closed "
                    "so that it cannot land in the caller's tensors later"))
            if bound and not await self._wait_quiet(op, bound):
                note = (f"{op.kind.value} #{op.op_id}: writes into the caller's tensors (or the peer's buffer) were still pending {bound:.1f} s "
                        "after the op was abandoned; they may still land there")
                log.error("channel %s: %s", self.id, note)
                return note
            if op.stuck:
                note = (f"{op.kind.value} #{op.op_id}: a staged copy into the caller's tensor outlived its bound "
                        f"({self.staging.config.stall_timeout:g} s) and may still write into it (the tensor is held "
                        "until it ends)")
                log.error("channel %s: %s", self.id, note)
                return note
            return None
        finally:
            self._forget(op)

    def _abandon_now(self, op: Op) -> float:
        """The non-blocking part of :meth:`_abandon` (event loop); returns how long to wait for
        ``op.quiet`` (0: nothing is being written)."""
        with op.lock:
            op.abandoned = True
            busy = op.busy
        if not op.future.done():  # nobody will retrieve what the op ends with
            op.future.cancel()
        if not busy or op.quiet.wait(0.05):
            return 0.0
        if op.inline:  # bytes trickling in from the socket: cut them off
            self.lose(PeerLostError(
                f"{op.kind.value} #{op.op_id} was abandoned while its bytes were still arriving; the channel "
                f"to {self.peer_name!r} was closed so that they cannot land in the caller's tensors"))
        if op.p2p:  # a receive into the caller's tensors stops when it completes or the link is aborted (_abandon)
            return 20.0  # (ncclCommAbort is bounded: NCCL's abort flag ends its waits; then the completions are reported)
        if op.staged:  # the reader may be waiting for a copy, up to stall_timeout
            cfg = self.staging.config
            return cfg.stall_timeout + 0.1 * cfg.buffers + RX_POLL_S + 1.0
        return op.abandon_bound  # a local copy stops at its next chunk; the reader at its next poll

    def _forget(self, op: Op) -> None:
        if not op.on_wire:
            self._pop(op.op_id)

    @staticmethod
    async def _wait_quiet(op: Op, bound: float) -> bool:
        """Wait (bounded, off the event loop) until ``op`` writes no more; True if it is quiet."""
        try:
            fut = asyncio.ensure_future(asyncio.to_thread(op.quiet.wait, bound))
        except RuntimeError:  # no executor (the loop is shutting down): a short wait here
            return op.quiet.wait(min(bound, 1.0))
        cancelled = False
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                if fut.cancelled():
                    break
                cancelled = True  # the wait protects the caller's memory: finish it first
            except Exception:
                break
        if cancelled:
            raise asyncio.CancelledError
        return op.quiet.is_set()

    def fail_op(self, op: Op, exc: BaseException, lost: BaseException | None = None) -> None:
        """Any thread: fail ``op`` with ``exc``; with ``lost``, break the channel first (its other
        pending ops fail with ``lost``), so the caller that sees ``exc`` finds the channel closed."""
        popped = self._pop(op.op_id)
        if lost is not None:
            self.lose(lost)
        if popped is not None:
            self._settle_from_thread(op, exc)

    def _pop(self, op_id: int) -> Op | None:
        with self._lock:
            return self._pending.pop(op_id, None)

    def _settle(self, op: Op, exc: BaseException | None) -> None:
        """Event loop: finish ``op`` unless its waiter already left (an op with posted work of its
        own, ``op.after``, finishes once that work completed too)."""
        after = op.after
        if after is not None:
            if not after.done():
                after.add_done_callback(lambda f: self._settle(op, exc))
                return
            own = None if after.cancelled() else after.exception()  # (retrieved either way)
            if exc is None:
                exc = own
        if exc is None:
            self.recorder.update(op.record, OpState.DONE)
        else:
            self.recorder.update(op.record, OpState.FAILED, exc)
        op.keep = None
        if op.future.done():
            return
        if exc is None:
            op.future.set_result(None)
        else:
            op.future.set_exception(exc)

    def record_here(self, kind: OpKind, names: list[str], nbytes: int, plane: str, t_posted: float,
                    error: BaseException | None = None) -> Record:
        """The flight recorder's record of an op a plane did right here, with no op object
        (:meth:`~transport.planes.base.DataPlane.run_here`), from ``t_posted`` to now: done, or
        failed with ``error``. Any thread (one step under the recorder's lock)."""
        return self.recorder.record_done(
            op_id=next(Channel._op_ids), channel=self.id, seq=next(self._seq), role="initiator",
            initiator=self.core.name, peer=self.peer_name, kind=kind, names=names, nbytes=nbytes, plane=plane,
            t_posted=t_posted, error=error)

    def in_order_now(self) -> bool:
        """Whether an op started now goes out at once (no earlier op of the channel is still held
        back, waiting before it is handed over: see :meth:`run`)."""
        prev = self._order_tail
        return prev is None or prev.done()

    def finish_here(self, op: Op) -> None:
        """Event loop: ``op`` completed on this side alone (a plane that needs no answer: a
        one-sided shm put or get): it leaves the table of pending ops and succeeds."""
        if self._pop(op.op_id) is not None:  # (else the channel was lost meanwhile: lose() failed the op)
            self._settle(op, None)

    def _settle_from_thread(self, op: Op, exc: BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self._settle, op, exc)
        except RuntimeError:  # loop closed: nobody is waiting any more
            pass

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
            pending = list(self._pending.values())
            self._pending.clear()
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
        for op in pending:
            self._settle_from_thread(op, exc)
        try:
            self.loop.call_soon_threadsafe(self._closed, exc)
        except RuntimeError:
            pass

    def _closed(self, exc: BaseException) -> None:
        self.plane.close()
        self.planes.close()
        self.core.channel_closed(self, exc)

    def say_bye(self, reason: str) -> None:
        """First step of an orderly close: queue a Bye behind everything already queued (any
        thread but the loop's: it may wait, at most 1 s, for our cuda_ipc copies to be over, since
        a Bye tells the peer that nothing of ours writes into its memory any more; if they are not,
        no Bye is sent and the peer holds its unregistered exports until this process exits).
        Once called, no new cuda_ipc copy starts on this channel. Idempotent."""
        if not self.is_open or self._bye:
            return
        self._bye = True
        if not self.planes.quiesce(1.0):
            log.warning("channel %s: cuda_ipc copies to %r still running at close; closing without a Bye",
                        self.id, self.peer_name)
            return
        self._tx.submit([encode_frame(Bye(reason))])

    def close(self, reason: str, timeout: float = 1.0) -> None:
        """Orderly close (any thread but the reader): let the Bye go out (bounded by
        ``timeout``), then break with :class:`EndpointClosedError`."""
        self.say_bye(reason)
        if self.is_open:
            self._tx.flush(timeout)
        self.lose(EndpointClosedError(f"endpoint {self.core.name!r} closed the channel: {reason}"))

    def join(self, timeout: float) -> None:
        """Wait (bounded) for both threads to finish, then close the socket."""
        end = time.monotonic() + timeout
        self._tx.join(timeout)
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(max(0.0, end - time.monotonic()))
        try:
            self._sock.close()
        except OSError:
            pass

    # ---------------------------------------------------------------- reader thread
    def _read_loop(self) -> None:
        try:
            rx = self._rx
            rx.start()
            while self.state is ChannelState.OPEN:
                self._dispatch(decode(rx.read_frame()))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, ProtocolError) as exc:
            self._fail_serving(exc)
            if self.is_open:
                log.error("protocol error on channel %s from %r: %s; closing the channel", self.id, self.peer_name, exc)
            self.lose(exc if isinstance(exc, ProtocolError) else ProtocolError(str(exc)))
        except (EOFError, OSError) as exc:
            self._fail_serving(exc)
            self.lose(PeerLostError(f"connection to {self.peer_name!r} lost: {exc}"))
        except PeerLostError as exc:  # an answer could not be sent: the channel is already lost
            self._fail_serving(exc)
            self.lose(exc)
        except BaseException as exc:  # a bug: never leave the peer hanging
            self._fail_serving(exc)
            log.exception("channel %s reader crashed", self.id)
            self.lose(PeerLostError(f"channel reader crashed: {exc!r}"))

    def _fail_serving(self, exc: BaseException) -> None:
        rec, self._target.current = self._target.current, None
        if rec is not None:
            self.recorder.update(rec, OpState.FAILED, exc)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Put):
            self._target.serve_put(msg)
        elif isinstance(msg, Get):
            self._target.serve_get(msg)
        elif isinstance(msg, Ack):
            op = self._pop(msg.op_id)
            if op is not None:
                self._settle_from_thread(op, None)
        elif isinstance(msg, Fail):
            if self.link is not None:
                self.link.not_posted(msg.op_id)  # a listener's nccl op the dialer rejected before its Go
            op = self._pop(msg.op_id)
            if op is not None:
                cls = ERROR_KINDS.get(msg.kind, RemoteError)
                self._settle_from_thread(op, cls(f"{self.peer_name!r} rejected the op: {msg.message}"))
        elif isinstance(msg, Data):
            self._take_data(msg)
        elif isinstance(msg, Notify):
            self._target.serve_notify(msg)
        elif isinstance(msg, Registry):
            self._take_registry(msg)
        elif isinstance(msg, Sync):
            epoch, bufs = self.core.wire_registry()
            self.send(Registry(epoch, bufs))
            self.send(Ack(msg.op_id))
        elif isinstance(msg, Unmapped):
            self.core.ipc_unmapped(self, msg.epoch)
        elif isinstance(msg, Go):
            self._target.take_go(msg)
        elif isinstance(msg, NcclSetup):
            if self.link is None:
                self.send(NcclReady(False, "", "this endpoint does not offer the nccl plane to this peer"))
            else:
                self.link.on_setup(msg)
        elif isinstance(msg, NcclReady):
            if self.link is not None:
                self.link.on_ready(msg)
        elif isinstance(msg, Ping):
            pass
        elif isinstance(msg, Bye):
            self.orderly = True
            self.lose(PeerLostError(f"{self.peer_name!r} closed the channel: {msg.reason or 'bye'}"))
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} frame after the handshake")

    def _take_data(self, msg: Data) -> None:
        with self._lock:
            op = self._pending.get(msg.op_id)
        if op is None or op.dests is None:
            raise ProtocolError(f"data for unknown get #{msg.op_id}")
        error = self._target.receive(op.dests, op)
        self._pop(msg.op_id)
        self._settle_from_thread(op, error)

    def _take_registry(self, msg: Registry) -> None:
        specs = specs_from_wire(msg.buffers)
        if msg.epoch < self.remote_epoch:  # overtaken by a newer one (a Sync reply races flushes)
            return
        wire = {b.name: b for b in msg.buffers}
        old = self.remote_wire
        self.remote_wire, self.peer_specs, self.remote_epoch = wire, specs, msg.epoch
        self.plane.registry_changed()
        if self.ipc_acks:  # confirm the epoch once nothing of ours uses the exports that left it
            gone = [wb.ipc for name, wb in old.items()
                    if wb.ipc is not None and ((nb := wire.get(name)) is None or nb.ipc != wb.ipc)]
            if not self.planes.retire(gone, msg.epoch):  # nothing of ours ever mapped them
                self.send(Unmapped(msg.epoch))
