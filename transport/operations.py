"""The one-sided operations of an endpoint: ``connect``, ``put``, ``get``, ``route``, ``map``,
``map_route``, ``notify`` and ``post``, each a coroutine on the endpoint's event loop, bounded by its
``timeout`` (or the endpoint's) and cancellable as each docstring says.

:class:`Operations` is the base class of :class:`transport.Endpoint`, which supplies the state it
declares (its name, default ``timeout``, channels, address book, record, secret and state); the
work of an op is in :mod:`transport.transfer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import torch

from .address import AddressBook, encode_address
from .errors import EndpointClosedError, InvalidTensorError, Phase, TransportTimeoutError
from .flight_recorder import OpKind
from .pauses import PauseWatch
from .peer import Peer, Route
from .transfer import Tensors, map_buffer, map_plane, pick_plane, plan, transfer, transfer_now
from .wire import MAX_NOTIFY, Notify

if TYPE_CHECKING:
    from .channel import Channel
    from .connector import Connector
    from .rendezvous import EndpointRecord, Rendezvous

__all__ = ["Operations"]

class Operations:
    """The one-sided operations of :class:`transport.Endpoint` (see the module docstring)."""

    name: str
    incarnation: int
    timeout: float
    loop: asyncio.AbstractEventLoop
    _book: AddressBook
    _connector: Connector
    _rdv: Rendezvous
    _record: EndpointRecord | None
    _secret: bytes | None
    _state: str
    _pause_gate: asyncio.Lock | None = None  # ops after a pause wait for its check in call order (transport.pauses)
    _pause_queue = 0  # ... this many; while any does, every op goes behind them
    _replaced_close: asyncio.Future[None] | None = None

    close: Callable[[], Coroutine[Any, Any, None]]  # (Endpoint's)

    def _check_open(self) -> None:
        if self._state != "open":
            why = self._rdv.pauses.replaced if self._rdv.pauses is not None else None
            raise EndpointClosedError(f"endpoint {self.name!r} is {self._state}" + (
                f": {why}" if why else "; use 'async with Endpoint(...)'"))

    @property
    def pauses(self) -> PauseWatch | None:
        """The endpoint's :class:`~transport.pauses.PauseWatch` (None before it published itself)."""
        return self._rdv.pauses

    def _watch_pauses(self) -> None:
        """:meth:`open`, once the record is published: start the pause watch (:mod:`transport.pauses`)."""
        name, rdv = self.name, self._rdv
        rdv.pauses = PauseWatch(name, self.incarnation, lambda: rdv.incarnation_now(name), self._on_replaced)
        rdv.pauses.start()

    def _on_replaced(self, why: str) -> None:
        """The pause watch's thread: the store names another incarnation of this endpoint. Every
        channel drops the frames it had not begun to send (ops called before the pause, held up by
        it), says why (a ``Bye``; bounded) and breaks (its ops fail :class:`EndpointClosedError`),
        then the endpoint closes on its loop."""
        chans = list(self._connector.all)
        end = time.monotonic() + 1.0
        for ch in chans:
            ch.close(why, max(0.0, end - time.monotonic()), EndpointClosedError(why), unsent=False)

        def close() -> None:
            self._replaced_close = asyncio.ensure_future(self.close())
        with contextlib.suppress(RuntimeError):  # (the loop is gone: so is the endpoint)
            self.loop.call_soon_threadsafe(close)

    async def _after_pause(self, watch: PauseWatch, deadline: float) -> None:
        """Wait until ``watch`` asked the store after a pause (bounded by ``deadline`` and the
        watch's own bound), behind the ops that waited before; :class:`EndpointClosedError` if the
        endpoint was replaced meanwhile."""
        if self._pause_gate is None:
            self._pause_gate = asyncio.Lock()
        self._pause_queue += 1
        try:
            async with asyncio.timeout_at(deadline), self._pause_gate:  # (FIFO)
                why = await watch.settled()
        except TimeoutError:
            raise TransportTimeoutError(f"endpoint {self.name!r} was paused and the op's deadline passed while it "
                                        "asked the store whether it was replaced meanwhile", Phase.CONNECT) from None
        finally:
            self._pause_queue -= 1
        if why is not None:
            raise EndpointClosedError(why)

    def address_record(self) -> bytes:
        """This open endpoint as opaque bytes a peer passes to :meth:`add_peer`. Non-blocking.

        They carry the address it accepts channels on, its incarnation, its host identity and
        its secret: a credential (see :mod:`transport.address`). Raises
        :class:`EndpointClosedError` unless the endpoint is open."""
        self._check_open()
        assert self._record is not None and self._secret is not None
        return encode_address(self._record, self._secret)

    def add_peer(self, record: bytes) -> str:
        """Make the endpoint that ``record`` (its :meth:`address_record`) describes reachable by
        the name returned, with no store in common. Non-blocking; nothing is dialled yet.

        Dialling it then uses the record, not the store, and proves the record's secret. Adding
        a record of a name again replaces the earlier one (a channel already open stays).
        ``ValueError`` for bytes that are not such a record (:func:`transport.address.decode_address`)."""
        self._check_open()
        return self._book.add(record, own_name=self.name)

    def _deadline(self, timeout: float | None) -> float:
        t = self.timeout if timeout is None else timeout
        if not t > 0:  # (NaN too)
            raise ValueError(f"timeout must be > 0, got {t}")
        return time.monotonic() + t

    async def _channel(self, peer: str, deadline: float) -> Channel:
        """The channel that carries ops to ``peer``, dialled if there is none (bounded by ``deadline``),
        once a pause of this process was checked (:mod:`transport.pauses`)."""
        watch = self._rdv.pauses
        if watch is not None and (self._pause_queue or watch.paused()):
            await self._after_pause(watch, deadline)
        return await self._connector.channel(peer, deadline)

    def _open_channel(self, peer: str) -> Channel | None:
        """The open channel to ``peer`` of an open endpoint, without awaiting (the common case of an
        op: it saves the coroutines of :meth:`_channel`); None: call :meth:`_channel` (also while
        a pause of this process is being checked)."""
        if self._state != "open" or self._pause_queue or ((w := self._rdv.pauses) is not None and w.paused()):
            return None
        return self._connector.open_channel(peer)

    async def connect(self, peer: str, timeout: float | None = None) -> Peer:
        """Open (or reuse) the channel to ``peer``; return its :class:`Peer`.

        Waits until ``peer`` appears in the store. Raises
        :class:`PeerNotFoundError` if it does not before the deadline,
        :class:`TransportTimeoutError` (phase connect/handshake) if it does not
        answer, :class:`PlaneUnavailableError` if no allowed plane reaches it.
        Cancelling it abandons the dial and leaves the endpoint usable.
        """
        ch = await self._channel(peer, self._deadline(timeout))
        return ch.peer

    def peer(self, name: str) -> Peer | None:
        """``name``'s :class:`Peer` while this endpoint is open and a channel to ``name`` is, else
        None: the entry of :attr:`~transport.Endpoint.peers` without making the whole dict (which
        also lists the channels of an endpoint that is closing). Never dials, never blocks."""
        if self._state != "open":
            return None
        ch = self._connector.channels.get(name) if isinstance(name, str) else None
        return ch.peer if ch is not None and ch.is_open else None

    async def put(self, peer: str, tensors: Tensors, *, notify: bytes | None = None,
                  timeout: float | None = None) -> None:
        """Write ``tensors`` into ``peer``'s registered buffers of the same names.

        Each value is a tensor of exactly the buffer's dtype and shape, or
        :class:`transport.At` ``(tensor, offset)`` for a sub-range. Returns once
        the target holds the bytes (remote completion). ``notify`` (bytes, at
        most 1 MiB) is delivered to the target's notifications only after all
        bytes have landed; with one, the put first waits (within its deadline,
        in the channel's call order) for a notification credit of ``peer``
        (see ``max_pending_notifications``). Connects first if needed.

        Bad input raises before any byte moves (:class:`UnknownBufferError`,
        :class:`BufferMismatchError`, :class:`InvalidTensorError`). At the
        deadline (``timeout`` or the endpoint's) it raises
        :class:`TransportTimeoutError`; a lost peer gives :class:`PeerLostError`.

        Timeout and cancellation (of the calling task) leave no writer behind:
        the call raises only once nothing of the op writes into the target's
        buffers any more, or what still does is ordered before every later op of
        this endpoint on them. A copy into the peer's memory (``shm``) stops at
        its next chunk and is waited for; one that cannot be stopped
        (``cuda_ipc``) is waited for; bytes already handed to the channel
        (``tcp``, staged) or posted on its NCCL link still land, before anything
        sent after them (a timeout on the NCCL link closes the channel, and the
        next one's link is set up only once the old one's transfers are over). So
        a put that follows returns only once the target holds exactly its bytes.
        The target's buffer may hold a mix of old and new bytes, and the source
        tensors stay referenced, and may still be read, until the bytes are out.
        The endpoint stays usable. The waits are bounded (seconds; staged copies:
        the staging stall bound) and a second cancellation does not cut them
        short; one that runs out is logged (a timeout's message says so).

        CUDA tensors: the op waits for the work queued on this thread's current
        stream of each tensor's device when it starts (at the call, unless it
        first waits for a connection, a link or an earlier op of the channel);
        leave the source unmodified until the call returns.
        """
        deadline = self._deadline(timeout)
        if notify is not None:
            _check_payload(notify)
        ch = self._open_channel(peer) or await self._channel(peer, deadline)
        await transfer(ch, OpKind.PUT, tensors, deadline, lambda plane, op, pairs: plane.put(op, pairs, notify),
                       here=notify is None, note=notify is not None)

    async def get(self, peer: str, tensors: Tensors, *, timeout: float | None = None) -> None:
        """Read ``peer``'s registered buffers into ``tensors`` (same rules as :meth:`put`).

        Returns once every byte is in the local tensors. On timeout or
        cancellation the tensors' contents are unspecified, but nothing of the op
        writes into them once the call has raised, so they can be reused at once:
        a copy still running stops at its next chunk (``shm``, a get reply
        arriving over ``tcp``), one that cannot be stopped (``cuda_ipc``, a staged
        copy) is waited for, and one whose bytes are still trickling in from the
        peer, or an NCCL receive not done 0.25 s (plus its bytes at 1 GB/s) after
        the call gave up, has its
        channel closed (the link aborted; the other pending ops on it fail with
        :class:`PeerLostError`). The waits are bounded as for
        :meth:`put`.
        """
        deadline = self._deadline(timeout)
        ch = self._open_channel(peer) or await self._channel(peer, deadline)
        await transfer(ch, OpKind.GET, tensors, deadline, lambda plane, op, pairs: plane.get(op, pairs),
                             here=True)

    def put_now(self, peer: str, tensors: Tensors) -> bool:
        """:meth:`put` (without a notification) done right now by the calling thread, if it can
        be done without waiting for anything; ``False``, nothing moved, if not: then ``await
        put(...)`` (which is never slower for it).

        It can when the channel to ``peer`` is open and uses ``shm``, every tensor is in CPU
        memory and every buffer is one of the peer's CPU buffers whose shared memory this
        process already mapped (after a first op on it), the copy is under 8 MiB, and no earlier
        op to ``peer`` is still held back. The bytes are then copied into the peer's memory
        before it returns ``True``: the target holds them, as after :meth:`put`, and the flight
        recorder has the op. Any thread, the endpoint's event loop included (it saves the
        coroutine there); it never waits for the loop, the peer or a lock another process
        holds, so it cannot time out and is not cancellable. Ordering: after the ops this
        endpoint started before the call, with the exceptions docs/architecture.md ("Call order
        to a peer") lists for every op (a get still copying on a worker thread, the retry of an
        op the target refused as stale); ops started concurrently from other threads are not
        ordered with it.

        Raises what :meth:`put` raises for bad input (:class:`InvalidTensorError`), and
        :class:`PeerLostError` or :class:`StaleBufferError` when the op failed in a way a retry
        cannot mend (the peer died, or it took the buffer back while the copy ran); a buffer the
        peer replaced before the copy, or one our copy of its registry does not know yet, gives
        ``False`` (``put`` re-reads the registry; a replaced export leaves a failed record in
        the flight recorder, as ``put``'s own retry does)."""
        ch = self._open_channel(peer)
        return ch is not None and transfer_now(ch, OpKind.PUT, tensors)

    def get_now(self, peer: str, tensors: Tensors) -> bool:
        """:meth:`get` done right now by the calling thread, if it can be done without waiting
        for anything; ``False``, nothing moved, if not (then ``await get(...)``). The same rules
        as :meth:`put_now`; ``True``: every byte is in the tensors."""
        ch = self._open_channel(peer)
        return ch is not None and transfer_now(ch, OpKind.GET, tensors)

    async def route(self, peer: str, tensors: Tensors, *, timeout: float | None = None) -> Route:
        """Which plane a put or get of ``tensors`` with ``peer`` takes now, and why; no byte moves.

        ``tensors`` is what :meth:`put` or :meth:`get` would be given, and is checked the same way
        (bad input raises the same errors). Connects first if needed, and waits for an NCCL link
        still being set up (bounded by ``timeout``, or the endpoint's); cancellable like
        :meth:`connect`. The answer holds until the peer's registry, the channel or its link
        changes.
        """
        deadline = self._deadline(timeout)
        ch = await self._channel(peer, deadline)
        pairs = await plan(ch, tensors, deadline)
        plane = await pick_plane(ch, pairs, deadline)
        return Route(plane.name, ch.reason_for(plane))

    async def map(self, peer: str, name: str, *, timeout: float | None = None) -> torch.Tensor:
        """A tensor that *is* ``peer``'s registered buffer ``name``: no copy.

        For a peer on this host: a CPU buffer is mapped over ``shm`` (the channel
        must run it), read-only; a GPU buffer over ``cuda_ipc`` (it must be this
        peer's GPU plane), as a CUDA tensor on the device that holds the
        allocation. Anything else raises :class:`PlaneUnavailableError` saying
        why (:meth:`map_route` tells which plane would map it, without mapping);
        :class:`UnknownBufferError` if the peer has no such buffer. Connects
        first if needed; bounded by ``timeout`` (or the endpoint's), cancellable
        like :meth:`connect` (opening a CUDA mapping runs on a worker thread; a
        cancelled call gives it back).

        The tensor has the buffer's dtype and shape and shows the peer's bytes
        as they are at each read: nothing orders reads with the peer's writes,
        so the application arranges that (rl_sync's ``mode="shared"`` does it
        with a lock per bank, and on a GPU by the publisher waiting for its
        copies before it lets readers in). Writes: an shm mapping is read-only,
        and writing through it kills this process with SIGSEGV rather than
        change what the peer and other readers see; CUDA cannot map peer memory
        read-only, so writes through a ``cuda_ipc`` mapping *do* change the
        peer's buffer, for the peer and every other process mapping it.

        Lifetime: the mapping stays valid while the tensor (or a view of it)
        lives, even after the peer unregisters the buffer; it then shows the
        bytes the buffer last held, not a buffer registered later under the
        same name. An shm mapping also outlives the peer's process. A
        ``cuda_ipc`` mapping keeps the peer's memory retained for this process
        (the peer frees it only after the last view here died), but not past
        the peer's process: CUDA leaves the memory of an exporting process
        that exited undefined, so keep the peer alive while reading. Each call
        reads the peer's registry (one round trip), so it maps the buffer
        registered under ``name`` at the call. One mapping per peer segment or
        allocation is kept, so mapping the same buffer again costs no new
        mapping.
        """
        deadline = self._deadline(timeout)
        return await map_buffer(await self._channel(peer, deadline), name, deadline)

    async def map_route(self, peer: str, name: str, *, timeout: float | None = None) -> Route:
        """Which plane :meth:`map` would map ``peer``'s buffer ``name`` over, and why; maps nothing.
        Raises what :meth:`map` raises when no plane can map it. Connects first if needed and reads
        the peer's registry (one round trip); bounded by ``timeout`` (or the endpoint's)."""
        deadline = self._deadline(timeout)
        return await map_plane(await self._channel(peer, deadline), name, deadline)

    async def notify(self, peer: str, payload: bytes, *, timeout: float | None = None) -> None:
        """Send ``payload`` (bytes, at most 1 MiB) to ``peer``'s notifications; returns once it is queued there.

        Ordered with this endpoint's puts to ``peer``: a notification sent after
        a put arrives after that put's bytes. ``peer`` holds at most its
        ``max_pending_notifications`` of ours that its application has not taken:
        past that, this waits for one to be taken (a notification credit), in
        order with our other ops to ``peer`` (which wait behind it), until the
        deadline (:class:`TransportTimeoutError`, which says so).
        """
        await self._notification(peer, payload, timeout, answer=True)

    async def post(self, peer: str, payload: bytes, *, timeout: float | None = None,
                   reply_expected: bool = False) -> None:
        """Send ``payload`` (bytes, at most 1 MiB) to ``peer``'s notifications without waiting for it to arrive.

        Returns once it is handed to the channel to ``peer`` (dialled first if none is open,
        bounded by ``timeout``, default the endpoint's), in order with this endpoint's ops to
        ``peer`` as :meth:`notify` is: it arrives after the bytes of every put called before
        it. Unlike :meth:`notify`, the peer answers nothing, which saves a round trip per
        message: it is lost with no error here if the channel breaks before the peer read it
        or the peer is closing (the peer logs the drop); a broken channel fails the next op
        to the peer with :class:`PeerLostError` (and a new channel to it has another
        :attr:`Peer.channel_id`). A post never waits for the peer nor for our earlier ops:
        one that cannot go out at once (an earlier op of the channel held back: a staged op
        waiting for the caller's CUDA work, a registry sync; or ``peer`` holding its
        ``max_pending_notifications`` of ours untaken) waits in this process, in order, our
        later ops to ``peer`` behind it, and goes out once its turn and a notification credit
        came (dropped, logged and recorded failed, if the channel closes first; ``close()``
        gives such posts up to 1 s); a frozen peer's posts queue in this process too, so post
        in a loop only what answers come back for; :meth:`notify` waits. For protocols whose
        messages are answered by messages of their own (rl_sync's). Cancelled while it waits
        to dial: not sent. Raises :class:`InvalidTensorError` for a payload that is not bytes or too
        large, :class:`PeerLostError` if the channel is broken, and what dialling raises.

        ``reply_expected``: ``peer`` answers with a post (or notification) of its own, which
        this endpoint's event loop then reads off the channel and delivers itself, one thread
        wake-up less on the answer's way (on ``tcp`` and ``shm`` channels: see
        ``docs/architecture.md``, "answers read on the loop"). Meanwhile the peer's other
        frames on that channel (its ops to us, its registry updates) go to the reader thread
        once the loop meets them: at once while the loop is idle, within about 40 ms if it is
        blocked by synchronous code. So set it where the loop awaits the answer.
        """
        await self._notification(peer, payload, timeout, answer=False, reply_expected=reply_expected)

    def post_nowait(self, peer: str, payload: bytes, *, reply_expected: bool = False) -> bool:
        """:meth:`post` ``payload`` to ``peer`` right now, without a coroutine, if it can be: True
        once it is handed to the channel (the same guarantees as :meth:`post`: behind every frame
        already handed to the channel); False, with nothing sent, if no channel to ``peer`` is
        open yet (or this endpoint is not open), an op to ``peer`` waits for a dial, or an op of
        the channel is still held back (a staged op waiting for its CUDA work, an shm copy still
        running on a worker thread, a post waiting for a notification credit), or ``peer`` holds
        its ``max_pending_notifications`` of ours untaken: then ``await post(...)`` instead, which dials and waits its
        turn. A caller that falls back to such a task for one message keeps its later messages
        to ``peer`` behind it (a ``post_nowait`` made before the task ran would overtake it).
        Never blocks; call it on the endpoint's event loop. Raises :class:`InvalidTensorError`
        for a payload that is not bytes or too large, and :class:`PeerLostError` if the channel
        broke just now. ``reply_expected``: as for :meth:`post`."""
        _check_payload(payload)
        ch = self._open_channel(peer)
        return ch is not None and _post_now(ch, payload, reply_expected)

    async def _notification(self, peer: str, payload: bytes, timeout: float | None, *, answer: bool,
                            reply_expected: bool = False) -> None:
        """:meth:`notify` (``answer``: wait for the peer's Ack) or :meth:`post` (done once handed over)."""
        _check_payload(payload)
        deadline = self._deadline(timeout)
        if not answer and self.post_nowait(peer, payload, reply_expected=reply_expected):  # (no op object)
            return
        ch = await self._channel(peer, deadline)
        if not answer:  # (dialled: out now, as post_nowait, or it waits here, never in the caller)
            if not _post_now(ch, payload, reply_expected):
                ch.ops.called()
                ch.ops.park_post(bytes(payload), reply_expected)
            return
        ch.ops.called()
        op = ch.new_op(OpKind.NOTIFY, [], len(payload))

        async def _send() -> None:
            ch.send(Notify(op.op_id, op.seq, bytes(payload)), op=op)

        await ch.run(op, _send, deadline)


def _check_payload(payload: object) -> None:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidTensorError(f"notification payloads are bytes, got {type(payload).__name__}")
    if len(payload) > MAX_NOTIFY:
        raise InvalidTensorError(f"notification payload of {len(payload)} bytes exceeds {MAX_NOTIFY}")


def _post_now(ch: Channel, payload: bytes, reply_expected: bool) -> bool:
    """Post ``payload`` on ``ch`` right here (counted as called, sent, recorded) if nothing of the
    channel is held back and the peer has a notification credit for it; False, nothing done, else."""
    if not (ch.in_order_now() and ch.credits.available()):
        return False
    ch.ops.called()
    ch.post_here(payload, reply_expected)
    return True
