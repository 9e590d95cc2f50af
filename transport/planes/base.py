"""The interface every data plane implements.

Lifecycle of one op, initiator side (the target's application code takes no
part in any of it):

1. The endpoint checks the call against its cached copy of the peer's
   registry (:func:`transport.ranges.plan_items`) and asks the channel for an
   :class:`~transport.op.Op` (op id, per-channel sequence number, future,
   flight-recorder record).
2. It asks the channel for the op's plane (:meth:`~transport.channel.Channel.plane_for`:
   the channel's CPU plane, or the staged plane when GPU memory is involved on
   either side) and calls its :meth:`DataPlane.put` or :meth:`DataPlane.get` with
   the op and the ``(item, tensor)`` pairs. The plane moves the bytes and sends whatever
   header the target needs, through ``channel.send``, in the channel's order.
   A plane whose bytes travel in the control stream (``tcp``) sends them right
   behind the header; a plane that writes the peer's memory directly (``shm``)
   copies first and then sends the header as the "done" message.
3. The channel's reader thread completes the op's future when the target's
   ``Ack``/``Fail``/``Data`` arrives. ``put`` therefore returns only once the
   target holds the bytes (and an ``shm`` get only once the target confirmed
   that the memory read is still the buffer's).

Target side, the channel's reader thread validates each incoming header
against the local registry (:func:`transport.ranges.resolve_item`); for
planes with ``inline_payload`` it receives the bytes straight into the
registered tensor (or drains them into scratch if the header was rejected, so
the stream never desynchronises).

A subclass must set :attr:`name` and :attr:`inline_payload` and implement
:meth:`put`, :meth:`get`, :meth:`probe` and :meth:`reaches`; it may override
:meth:`close` to drop cached mappings and :meth:`registry_changed` to drop stale ones.

Cancellation and timeouts. Cancelling the awaiting task never interrupts a copy
already handed to a thread, a device or the socket (the tensors stay referenced
until it finishes), and every plane keeps one rule about what is left: once
``put``/``get`` has raised, nothing of that op writes into the peer's buffers or
the caller's tensors any more, or every later op on those buffers is ordered
after what still does (a put that follows returns only once the target holds
exactly its bytes). Each plane keeps it its own way:

- a plane whose thread or device writes memory directly (a copy into the peer's
  memory or the caller's tensors: ``shm``, ``cuda_ipc``, the staged receive of a
  get reply, the ``nccl`` receive of a get) sets ``op.busy`` under ``op.lock``
  when that writing starts, unless ``op.abandoned`` was set first, may set
  ``op.abandon_bound``, and sets ``op.quiet`` once nothing more will be written;
  the channel's abandon then waits for ``op.quiet`` (off the event loop, shielded
  from a second cancellation, bounded) before the call raises;
- a plane whose put bytes travel in the channel's stream (``tcp``, ``staged``)
  lets them go on: the target serves the channel's ops in stream order, so a
  later op on the channel lands after them;
- ``nccl``: a put's send that was posted completes, and later ops of the channel
  are posted behind it on the link; one that timed out aborted the link and closed
  the channel, and no new link with that peer joins, on either side, before that
  abort is over (:mod:`transport.planes.nccl_link`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol

import torch

from ..errors import PeerLostError, PlaneUnavailableError, StagingError, TransportError
from ..flight_recorder import FlightRecorder, OpKind, Record
from ..op import Op
from ..registry import BufferSpec, LocalBuffer
from ..staging import Staging
from ..wire import Get, HostInfo, Item, Message, Put, WireBuffer

__all__ = ["ChannelPort", "DataPlane", "Exporter", "PeerLink", "SendingChannel", "closed_error"]


class PeerLink(Protocol):
    """A channel's link: a second connection to the peer that a plane moves bytes over (the
    ``nccl`` plane's 2-rank communicator, :class:`transport.planes.nccl_link.Link`, made by
    :meth:`transport.planes.PlaneOffers.link_for`). The core sees only this: it hands the link the set-up
    frames and the peer's ops over it, waits for it to be set up, and aborts it with the channel.
    Thread-safe."""

    state: str  # "pending" (being set up), "ready", or "down"
    reason: str  # why it is in that state (reports, the plane choice's reason)
    engine: Any  # what moves its bytes on this side (``.device``, ``.handles(tensor)``)
    peer_device: str  # the device the peer's side serves ("" until set up)

    def start(self) -> None:
        """Dialer, event loop: begin the set-up (non-blocking)."""

    async def wait(self, deadline: float) -> bool:
        """Wait (bounded) until the link is set up or failed; True if it is usable."""

    def abort(self, why: BaseException | str) -> None:
        """Any thread, idempotent: the link is done; what is in flight on it stops (non-blocking)."""

    def on_frame(self, body: bytes) -> None:
        """Reader thread: one of the peer's frames of the link's own protocol (its set-up; a
        :class:`~transport.wire.LinkFrame`'s body). :class:`ProtocolError` for one out of place."""

    def not_posted(self, op_id: int) -> bool:
        """Reader thread, on a Fail: drop our op ``op_id`` if it was never posted (True if so)."""

    def ready_for_peer_op(self, op_id: int) -> None:
        """Reader thread, before serving the peer's op over the link: raises ProtocolError unless
        the link is (now) ready."""

    def take_go(self, op_id: int) -> None:
        """Reader thread: the dialer's go-ahead for our op ``op_id``."""

    def serve(self, msg: Put | Get, ranges: list[tuple[Any, int, int]] | None, error: TransportError | None,
              rec: Any, deliver: Callable[[Callable[[], None]], TransportError | None] | None) -> None:
        """Reader thread: post our half of the peer's op and answer it from the completion; for a put
        with a notification, ``deliver(ack)`` hands it to the application (None, or the error to
        answer), calling ``ack`` (which must send the ``Ack``) once it is queued, under the lock the
        endpoint's close takes before its ``Bye``."""


class SendingChannel(Protocol):
    """What every half of a channel uses of it (:class:`transport.channel.Channel` is one): the
    reader (:class:`transport.dispatch.ReadChannel`), the target's half
    (:class:`transport.serving.ServedChannel`) and its planes (:class:`ChannelPort`) each add
    what only they use. ``is_open`` and ``send`` may be used from any thread."""

    core: Any  # the endpoint (a plane's exporter: ``core.exporter(name)``; the target's ``deliver()``)
    peer_name: str
    recorder: FlightRecorder
    link: PeerLink | None  # the channel's link (nccl's), or None

    @property
    def is_open(self) -> bool: ...

    def send(self, msg: Message, payload: Sequence[memoryview] | Iterator[memoryview] = (), *,
             op: Op | None = None, direct: bool = True,
             early: Callable[[StagingError], None] | None = None,
             on_sent: Callable[[], None] | None = None, on_dropped: Callable[[], None] | None = None) -> None:
        """Send ``msg`` (and ``payload`` behind it) in the channel's order; never blocks."""


class ChannelPort(SendingChannel, Protocol):
    """What a plane may use of the channel that owns it: :class:`SendingChannel` and the below.
    Attributes are read on the event loop unless a plane's docs say otherwise; ``send``,
    ``send_quietly``, ``lose`` and ``fail_op`` may be called from any thread."""

    loop: asyncio.AbstractEventLoop
    #: the peer's registry as last announced: specs, and the wire records (exports: shm, cuda_ipc)
    peer_specs: dict[str, BufferSpec]
    remote_wire: dict[str, WireBuffer]
    error: BaseException | None  # why the channel broke (None while open)
    staging: Staging  # the endpoint's bounce buffers (the staged path)

    def send_quietly(self, msg: Message) -> None:
        """:meth:`send`, ignoring a channel that is gone."""

    def lose(self, exc: BaseException) -> None:
        """Break the channel: every pending op fails with ``exc``."""

    def fail_op(self, op: Op, exc: BaseException, lost: BaseException | None = None) -> None:
        """End ``op`` with ``exc`` (and break the channel with ``lost`` if given)."""

    def record_here(self, kind: OpKind, names: list[str], nbytes: int, plane: str, t_posted: float,
                    error: BaseException | None = None) -> Record:
        """Record in the flight recorder an op done right here (:meth:`DataPlane.run_here`) that
        began at ``t_posted`` (``time.time()``): done, or failed with ``error``."""

    def finish_here(self, op: Op) -> None:
        """``op`` completed on this side alone (a one-sided copy): it succeeds."""

    def hold_order(self) -> Callable[[], None]:
        """Ops of the channel started from now on wait until the returned function is called
        (on the event loop): for an op whose work goes on in a thread that sends its header or
        lands its bytes later (an op, post or notify called after it must not overtake it)."""


def _retrieved(job: asyncio.Future[Any]) -> None:
    if not job.cancelled():
        job.exception()


class DataPlane(abc.ABC):
    """One way of moving bytes to and from one peer, owned by a channel."""

    name: ClassVar[str]
    inline_payload: ClassVar[bool]
    #: False for a plane whose ``put``/``get`` may wait before handing the op to the channel (the
    #: staged path awaits the caller's CUDA work): the channel then keeps later ops behind it
    sends_at_once: ClassVar[bool] = True
    #: True for a channel plane (a CPU plane) whose answers, and the peer's posts, the event loop
    #: may read itself while it waits for them (:mod:`transport.loop_reads`): the peer's registry
    #: updates then reach the reader thread once the loop hands the reads back (at once when it
    #: meets one; within the stall bound if the loop is busy), so only where every op is checked
    #: against the live export whatever our copy of the registry says (tcp: the target checks its
    #: registry as it serves each op; shm: the slot's word, or the header's export ids)
    answers_on_loop: ClassVar[bool] = False
    #: True for a plane that may finish a put without a notification, or a get, on this side
    #: alone (no message: ``shm``'s and ``cuda_ipc``'s slot words): the loop then expects no answer
    one_sided: ClassVar[bool] = False

    def __init__(self, channel: ChannelPort) -> None:
        self.channel = channel

    @classmethod
    @abc.abstractmethod
    def probe(cls) -> tuple[bool, str]:
        """Whether this machine can use the plane at all, and why (cheap, no peers)."""

    @classmethod
    @abc.abstractmethod
    def reaches(cls, local: HostInfo, remote: HostInfo) -> tuple[bool, str]:
        """Whether the plane can reach a peer on ``remote`` from ``local``, and why."""

    @abc.abstractmethod
    async def put(self, op: Op, pairs: list[tuple[Item, torch.Tensor]], notify: bytes | None) -> None:
        """Move the bytes of ``pairs`` into the peer's buffers and send the header."""

    @abc.abstractmethod
    async def get(self, op: Op, pairs: list[tuple[Item, torch.Tensor]]) -> None:
        """Start reading the peer's buffers into the tensors of ``pairs``."""

    def run_here(self, kind: OpKind, pairs: list[tuple[Item, torch.Tensor]]) -> bool:
        """Do a whole put (without a notification) or get right here, synchronously on the event
        loop, or on any thread for :meth:`Endpoint.put_now <transport.Endpoint.put_now>`, if this
        plane can (a one-sided op whose copy is short, each item checked against the buffer the
        peer announces now: :func:`~transport.ranges.item_fits`); False (nothing done, nothing
        recorded) otherwise, and the op takes :meth:`put`/:meth:`get`. It records the op in the
        flight recorder itself (a failure too) and raises what the op would
        (:class:`~transport.errors.StaleBufferError` for a buffer the peer replaced: the
        endpoint refreshes its registry and retries once)."""
        return False

    async def threaded(self, work: Callable[[], Any], hold: bool = True) -> Any:
        """Run ``work`` (an op's copy, which may send its header) on a worker thread; its result,
        or what it raised. ``hold``: the channel's later ops are held back until it ended (a
        put's header sent, or its bytes landed: :meth:`ChannelPort.hold_order`). ``work`` always
        runs, even if the caller stops waiting first (it sees the op abandoned and stops at its
        next chunk boundary), so the hold always ends."""
        loop = asyncio.get_running_loop()
        release = self.channel.hold_order() if hold else None

        def held() -> Any:
            try:
                return work()
            finally:
                if release is not None:
                    with contextlib.suppress(RuntimeError):  # (the loop closed: nothing waits any more)
                        loop.call_soon_threadsafe(release)

        try:
            job = loop.run_in_executor(None, held)
        except BaseException:
            if release is not None:
                release()
            raise
        job.add_done_callback(_retrieved)  # (its error is the caller's, or nobody's once it stopped waiting)
        return await asyncio.shield(job)  # (a cancelled caller must not cancel the job still queued)

    def staged_twin(self) -> DataPlane | None:
        """For a plane whose peer buffers lie in memory this process maps (shm): a plane of the
        same channel that moves a GPU tensor of ours into or out of them through the staging
        bounce buffers (made once per channel by the channel); None when there is none."""
        return None

    @classmethod
    def features(cls) -> dict[str, tuple[bool, str]]:
        """Optional capabilities of the plane on this machine, each ``(available, why)``, for
        ``python -m transport doctor`` (cheap, no peers)."""
        return {}

    #: True for a plane that can alias a peer's buffer in this process (:meth:`map`)
    maps_peer_memory: ClassVar[bool] = False
    #: True for a plane whose ops are posted on the channel's NCCL link: an op for it while the link
    #: is being set up waits for the link (:func:`transport.transfer.pick_plane`)
    via_link: ClassVar[bool] = False
    #: True for a plane whose op may find, only once it runs, that this process cannot open the
    #: peer's memory (:class:`~transport.errors.PlaneUnavailableError`): the op is then retried once
    #: on the staged path (:func:`transport.transfer.transfer`; logged by the plane)
    staged_on_unavailable: ClassVar[bool] = False

    async def map(self, name: str) -> torch.Tensor:
        """The peer's registered buffer ``name`` as a tensor of its dtype and shape that aliases
        its memory (:meth:`transport.Endpoint.map`). Raises
        :class:`~transport.errors.StaleBufferError` if the peer no longer exports it, and
        :class:`~transport.errors.PlaneUnavailableError` if this plane cannot map it."""
        raise PlaneUnavailableError(f"the {self.name} plane cannot map a peer's buffer")

    def registry_changed(self) -> None:  # noqa: B027 - optional hook
        """The peer's registry changed: drop what is cached for buffers that are gone."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """The channel is gone: drop every cached resource."""


class Exporter:
    """A plane's target half at registration: what it makes of each registered buffer so peers can
    reach it (its handle travels in the registry the endpoint sends them, in the
    :class:`~transport.wire.WireBuffer` field :attr:`wire_field`), and what it must undo when
    the buffer goes. The endpoint's :class:`~transport.exports.Exports` holds one per allowed
    plane that has one (:func:`transport.planes.make_exporters`) and names none of them.

    Every method runs on the thread that registers (the event loop's, or the caller's before the
    endpoint opens) unless it says otherwise; none waits except where it says so. The defaults
    do nothing, for a plane without the feature.
    """

    #: the plane whose exports these are (the key in ``LocalBuffer.exports``)
    plane: ClassVar[str]
    #: the :class:`~transport.wire.WireBuffer` field this plane's handle travels in
    wire_field: ClassVar[str]

    def export(self, buf: LocalBuffer) -> None:
        """Make ``buf`` reachable over this plane (may move its bytes, and set
        ``buf.exports[plane]``); a buffer it cannot or need not export is left alone."""

    def handle(self, buf: LocalBuffer) -> Any:
        """What peers are told of ``buf`` over this plane (None: not exported). Any thread."""
        exp = buf.exports.get(self.plane)
        return None if exp is None else exp.handle

    def unexport(self, buf: LocalBuffer, *, detach: bool, closing: bool, epoch: int) -> None:
        """Stop exporting ``buf`` (it left the registry at ``epoch``). ``detach``: it was
        unregistered, and must not stay in memory peers may still write (false: unregistered with
        ``copy_back=False``, or not unregistered); ``closing``: the endpoint closes (do not wait for
        peers)."""

    def new_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor | None:
        """A zero-filled tensor for :meth:`Endpoint.new_buffer` in memory this plane can export
        without a copy, or None (the endpoint then asks the next exporter, or allocates it)."""
        return None

    def new_buffer_failed(self, tensor: torch.Tensor) -> None:
        """Registering what :meth:`new_buffer` made failed: let go of its memory."""

    def forget_unexported(self, tensor: torch.Tensor | None, live: list[torch.Tensor]) -> None:
        """Let go of memory made by :meth:`new_buffer` that no export holds: the memory ``tensor``
        lies in (unless one of ``live`` lies there too), or all of it (``tensor`` None)."""

    def tick(self, bufs: list[LocalBuffer]) -> None:
        """Every heartbeat interval (event loop), with the registered buffers."""

    def status(self) -> tuple[bool, str]:
        """Whether this plane can be used here, and why (e.g. its engine could not be made). May
        make that engine. Any thread."""
        return True, "allowed"

    # peers that may map exports (see transport.planes.cuda_ipc_retention): a channel, or a handshake in progress
    def watch(self, holder: str, epoch: int, pid: int | None) -> None:
        """``holder`` (process ``pid`` if on this host) may map exports of registries up to ``epoch``."""

    def forget(self, holder: str) -> None:
        """``holder`` (a handshake that failed before the peer saw our registry) maps nothing."""

    def acked(self, holder: str, epoch: int) -> None:
        """``holder`` confirmed that it uses nothing absent from our registry at ``epoch`` (reader thread)."""

    def closed(self, holder: str, orderly: bool) -> None:
        """``holder``'s channel (or handshake) closed; ``orderly``: the peer promised it was done."""

    def close(self) -> None:
        """The endpoint closes: every export was undone; release what is left (live peers may
        keep some memory until they exit)."""


def closed_error(channel: ChannelPort, what: str = "is closed") -> PeerLostError:
    """The error of an op that finds ``channel`` closed (``what`` happened to it), saying why it
    closed where it did (its :attr:`~ChannelPort.error`: e.g. the reason of the peer's ``Bye``)."""
    why = channel.error
    return PeerLostError(f"channel to {channel.peer_name!r} {what}" + (f": {why}" if why is not None else ""))
