"""The target's half of a channel: the peer's ops, served by the channel's reader thread.

Each incoming ``Put``, ``Get`` and ``Notify`` header is checked against the local registry
(:func:`transport.ranges.resolve_item`), recorded in the flight recorder as the op's target record,
and served: a ``tcp`` or staged put's payload is received straight into the registered tensor (or
drained into scratch if the header was rejected, so the stream never desynchronises), an ``shm``
put or get was done by the initiator already and is only confirmed, a get's bytes are sent back
(staged ones through the pinned bounce buffers, by the writer thread), an ``nccl`` op is posted on
the channel's link. Every op is answered with ``Ack``, ``Fail`` or ``Data``, in stream order, but a
posted notification (``Notify.answer`` False: ``Endpoint.post``), which is answered with nothing (one
that cannot be queued is dropped and logged). The application's code takes no part in any of it.

:meth:`Serving.receive` also receives a get reply's payload on the initiator's side (it stops
writing into the caller's tensors once the caller abandoned the op).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .errors import (
    BufferMismatchError,
    EndpointClosedError,
    PeerLostError,
    ProtocolError,
    StagingError,
    StaleBufferError,
    TransportError,
    error_kind,
)
from .flight_recorder import OpKind, OpState, Record
from .peer import Notification
from .planes import STAGED, SendingChannel, WireSemantics, wire_semantics
from .ranges import item_bytes, resolve_item
from .registry import Hold, byte_slice
from .staging import Staging
from .wire import MAX_NOTIFY, Ack, Data, Fail, Get, Go, Item, Notify, Put

if TYPE_CHECKING:
    from .op import Op
    from .receiver import Receiver

__all__ = ["ServedChannel", "Serving"]

log = logging.getLogger("transport.channel")

_RX_CHUNK = 4 << 20  # a get's payload is received in chunks so that an abandoned get stops writing


class ServedChannel(SendingChannel, Protocol):
    """What the target's half uses of its channel (:class:`transport.channel.Channel`) besides
    :class:`~transport.planes.SendingChannel` (its ``core``: ``deliver()``, ``name``)."""

    id: str
    loop: asyncio.AbstractEventLoop
    plane: Any  # the channel's CPU plane (its name)
    registry: Any  # the endpoint's LocalRegistry
    staging: Staging
    error: BaseException | None

    def lose(self, exc: BaseException) -> None: ...


class Serving:
    """The target's half of one channel (reader thread, except where a method says otherwise):
    ``rx`` is the channel's socket's receiving half, ``lock`` the channel's lock (the table of
    staged replies is read by ``lose`` under it)."""

    def __init__(self, channel: ServedChannel, rx: Receiver, lock: threading.Lock) -> None:
        self.ch = channel
        self.rx = rx
        self.lock = lock
        self.current: Record | None = None  # the target record the reader is working on
        self.replies: dict[int, Record] = {}  # target records of staged get replies queued for the writer

    def _hold(self) -> Hold:
        """A claim on the buffers an op served through the stream moves bytes into or out of: an
        ``unregister`` of one of them waits for it (bounded); past the bound the channel breaks,
        which stops its reads and sends, and fails the peer's op (never reported done)."""
        return Hold(self.ch.registry, self._revoked)

    def _revoked(self, why: str) -> None:
        self.ch.lose(PeerLostError(f"channel to {self.ch.peer_name!r} broken: {why}"))

    def _target_record(self, msg: Put | Get | Notify, kind: OpKind, items: list[Item], plane: str) -> Record:
        nbytes = 0
        for it in items:
            nbytes += item_bytes(it)
        self.current = self.ch.recorder.record(
            op_id=msg.op_id,
            channel=self.ch.id,
            seq=msg.seq,
            role="target",
            initiator=self.ch.peer_name,
            peer=self.ch.peer_name,
            kind=kind,
            names=[it.name for it in items],
            nbytes=nbytes,
            plane=plane,
            state=OpState.RECEIVED,
        )
        return self.current

    def _resolve(self, items: list[Item], segments: list[int] | None = None,
                 plane: str = "", hold: Hold | None = None) -> list[tuple[Any, int, int]]:
        """Target side: ``(buffer, byte_offset, nbytes)`` per item, or raise.

        ``segments`` (ops of a plane that copies directly: ``shm``, ``cuda_ipc``) are the export
        ids of ``plane`` the initiator copied into or out of; a buffer that is no longer that
        export raises :class:`StaleBufferError`. ``hold``: each buffer found is claimed for it
        as it is looked up (the caller releases it, raised or not).
        """
        if segments is not None and len(segments) != len(items):
            raise ProtocolError(f"op names {len(items)} items but {len(segments)} segments")
        out = []
        for i, it in enumerate(items):
            buf = self.ch.registry.get(it.name, hold)
            # (a range past the buffer is a typed BufferMismatchError, not a protocol error: an honest peer
            # sends one when its copy of our registry is stale, e.g. right after a re-registration with a
            # smaller shape; the payload of a tcp put is drained and the channel lives on)
            off, n = resolve_item(buf, it)
            why = buf.moved()
            if why is not None:
                raise BufferMismatchError(why)
            if segments is not None and n:
                exp = buf.exports.get(plane)
                if exp is None or exp.handle.export_id != segments[i]:
                    raise StaleBufferError(
                        f"buffer {it.name!r} was re-registered: the op used export {segments[i]}, the buffer is now "
                        f"{'export ' + str(exp.handle.export_id) if exp is not None else 'not exported'}"
                    )
            out.append((buf, off, n))
        return out

    def _check_plane(self, plane: str) -> WireSemantics:
        """An op's plane must be one whose bytes travel in the stream (any channel can carry
        those), one that copies exports directly and is not bound to the channel's CPU plane
        (``cuda_ipc``: checked per buffer against its export), the NCCL link's, or this channel's
        own CPU plane (``shm``; :func:`transport.planes.wire_semantics`). Returns how to serve it
        (``inline``: the payload follows the header; ``via_link``: the NCCL link moves it)."""
        wire = wire_semantics(plane)
        if wire is None or (wire.own_plane and plane != self.ch.plane.name):
            raise ProtocolError(f"op over plane {plane!r}, which this channel does not use")
        return wire

    def _ranges(self, msg: Put | Get, what: str, *, copied: bool,
                hold: Hold | None = None) -> tuple[list[tuple[Any, int, int]], TransportError | None]:
        """The op's ranges (:meth:`_resolve`), or the error to answer it with; a malformed header
        raises :class:`ProtocolError`. ``copied``: the initiator copied into or out of the exports
        the op names (``segments``)."""
        if copied and msg.segments is None:
            raise ProtocolError(f"{msg.plane} {what} without segments")
        try:
            return self._resolve(msg.items, msg.segments if copied else None, msg.plane, hold), None
        except ProtocolError:
            raise
        except TransportError as exc:
            return [], exc

    def serve_put(self, msg: Put) -> None:
        rec = self._target_record(msg, OpKind.PUT, msg.items, msg.plane)
        if msg.notify is not None and len(msg.notify) > MAX_NOTIFY:
            raise ProtocolError(f"notification of {len(msg.notify)} bytes exceeds {MAX_NOTIFY}")
        wire = self._check_plane(msg.plane)
        inline = wire.inline
        if wire.via_link:
            self._serve_via_link(msg, rec)
            return
        if inline:  # the payload follows: received into the buffers, held against unregister until it landed
            hold = self._hold()
            try:
                ranges, error = self._ranges(msg, "put", copied=False, hold=hold)
                if error is not None:
                    self.rx.drain(sum(item_bytes(it) for it in msg.items))
                else:
                    dests = [self._dest(buf, off, n) for buf, off, n in ranges]
                    if any(not isinstance(d, memoryview) for d in dests):
                        rec.plane = STAGED
                    error = self.receive(dests, None)
            finally:
                hold.release()
        else:
            ranges, error = self._ranges(msg, "put", copied=True)
        if error is not None:
            self._reject(rec, msg.op_id, error)
            return
        if msg.notify is None:
            self._answer(rec, msg.op_id)
        elif not self.ch.core.deliver(Notification(self.ch.peer_name, msg.notify, msg.op_id), self.ch,
                                      ack=lambda: self._answer(rec, msg.op_id)):
            self._reject(rec, msg.op_id, EndpointClosedError(f"{self.ch.core.name!r} is closing; notification not delivered"))

    def _serve_via_link(self, msg: Put | Get, rec: Record) -> None:
        """Reader thread: the peer's op over the channel's link (a plane whose bytes the link
        moves); the link posts our half and answers from its completion
        (:meth:`transport.planes.base.PeerLink.serve`)."""
        link = self.ch.link
        if link is None:
            raise ProtocolError(f"{msg.plane} op #{msg.op_id} on a channel without a link")
        link.ready_for_peer_op(msg.op_id)
        error: TransportError | None = None
        ranges = None
        try:
            ranges = self._resolve(msg.items)
        except ProtocolError:
            raise
        except TransportError as exc:
            error = exc
        deliver = None
        note = msg.notify if isinstance(msg, Put) else None
        if note is not None:
            if len(note) > MAX_NOTIFY:
                raise ProtocolError(f"notification of {len(note)} bytes exceeds {MAX_NOTIFY}")

            def deliver(ack: Callable[[], None]) -> TransportError | None:  # (the link's answering thread)
                try:
                    if self.ch.core.deliver(Notification(self.ch.peer_name, note, msg.op_id), self.ch, ack=ack):
                        return None
                except ProtocolError as exc:  # past its credits
                    self.ch.lose(exc)
                    return exc
                return EndpointClosedError(f"{self.ch.core.name!r} is closing; notification not delivered")

        self.current = None  # the link's completion settles the record
        link.serve(msg, ranges, error, rec, deliver)

    def take_go(self, msg: Go) -> None:
        link = self.ch.link
        if link is None:
            raise ProtocolError("Go on a channel without a link")
        link.take_go(msg.op_id)

    def _done(self, rec: Record) -> None:
        self.ch.recorder.update(rec, OpState.DONE)
        self.current = None

    def _answer(self, rec: Record, op_id: int) -> None:
        """The op is done: record it and acknowledge it (for a notification, once handed to the
        loop and before the endpoint's close can send its ``Bye``: ``Inbox.deliver``)."""
        self._done(rec)
        self.ch.send(Ack(op_id))

    def _reject(self, rec: Record, op_id: int, error: TransportError, *, answer: bool = True) -> None:
        """Record the op rejected and answer ``Fail``; ``answer`` False (a posted notification, whose
        sender waits for nothing): log it instead."""
        self.ch.recorder.update(rec, OpState.REJECTED, error)
        self.current = None
        if answer:
            self.ch.send(Fail(op_id, error_kind(error), str(error)))
        else:
            log.warning("endpoint %s: an op posted by %s was dropped: %s", self.ch.core.name, self.ch.peer_name, error)

    def serve_get(self, msg: Get) -> None:
        rec = self._target_record(msg, OpKind.GET, msg.items, msg.plane)
        wire = self._check_plane(msg.plane)
        copied = not wire.inline
        if wire.via_link:
            self._serve_via_link(msg, rec)
            return
        hold = None if copied else self._hold()  # (released once the reply was sent, or never will be)
        ranges, error = self._ranges(msg, "get", copied=copied, hold=hold)
        if error is not None:
            if hold is not None:
                hold.release()
            self._reject(rec, msg.op_id, error)
            return
        if hold is None:  # the initiator already copied; the segments were still the buffers'
            self._done(rec)
            self.ch.send(Ack(msg.op_id))
            return
        if any(self.ch.staging.stages(buf.spec.device) for buf, _, n in ranges if n):
            rec.plane = STAGED
            parts = [byte_slice(buf.tensor, off, n) for buf, off, n in ranges if n]
            op_id = msg.op_id

            def early(exc: StagingError) -> None:  # nothing was sent: answer with the error instead
                if self.ch.is_open:
                    self.ch.send(Fail(op_id, error_kind(exc), str(exc)))

            # the writer copies each staged part out chunk by chunk (a later failure breaks the
            # channel) and settles the record: the reader is long gone by then
            with self.lock:
                if self.ch.is_open:  # (else lose() has run: the send below raises)
                    self.replies[id(rec)] = rec
            self.ch.send(Data(msg.op_id), self._staged_reply(rec, parts, hold), early=early, on_dropped=hold.release)
            self.current = None  # only now: until here a failure settles the record (Dispatcher._fail_serving)
            return
        try:
            views = [buf.byte_view()[off : off + n] for buf, off, n in ranges if n]
        except BaseException:
            hold.release()
            raise
        # the views keep the buffers alive until sent; the hold keeps unregister from returning before that
        self.ch.send(Data(msg.op_id), views, on_sent=hold.release, on_dropped=hold.release)
        self._done(rec)  # queued for the writer; the initiator's record says when it arrived

    def _staged_reply(self, rec: Record, parts: list[torch.Tensor], hold: Hold) -> Iterator[memoryview]:
        """Writer thread: a staged get reply's payload. Its record says DONE once the last byte
        was sent, FAILED if staging failed (before or after the header went out) or the channel
        closed before the payload was out. ``hold`` is released once it ended either way."""
        ok = False
        try:
            yield from self.ch.staging.payload(parts)
            ok = True  # asked for more after the last chunk: that one was sent
        except Exception as exc:
            self.ch.recorder.update(rec, OpState.FAILED, exc)
            raise
        finally:
            hold.release()
            with self.lock:
                self.replies.pop(id(rec), None)
            if ok:
                self.ch.recorder.update(rec, OpState.DONE)
            else:  # closed early (a no-op if it failed above)
                self.ch.recorder.update(rec, OpState.FAILED, f"the channel closed before the reply was sent: {self.ch.error}")

    def _dest(self, buf: Any, off: int, n: int) -> memoryview | torch.Tensor:
        """Target side: where bytes ``[off, off + n)`` of a registered buffer are written: a
        memoryview of CPU memory, or a byte view of the tensor when its device is staged."""
        if self.ch.staging.stages(buf.spec.device):  # (the spec's string: cheaper than tensor.device)
            return byte_slice(buf.tensor, off, n)
        return buf.byte_view()[off : off + n]

    def receive(self, dests: Sequence[memoryview | torch.Tensor], op: Op | None) -> StagingError | None:
        """Reader thread: receive a payload into ``dests`` in order (memoryviews straight, tensors
        through the staged path). Every byte is consumed whatever happens, so the stream stays in
        sync. For a get reply (``op``), writing stops once the caller abandoned the op: the rest is
        drained (``op.quiet`` is set once nothing more will be written, except by a staged copy
        that outlived its bound: then ``op.stuck`` is set first, and the tensor is held until the
        copy ends). After a staging error the rest is drained too; the error is returned."""
        if op is None:  # a put into CPU memory (the common case): straight into the registered tensors
            views = [d for d in dests if type(d) is memoryview]
            if len(views) == len(dests):
                total = left = sum(len(v) for v in views)
                for v in views:
                    left -= len(v)
                    if len(v):
                        self.rx.recv_into(v, left, total)
                return None
        sizes = [len(d) if isinstance(d, memoryview) else d.numel() * d.element_size() for d in dests]
        total = left = sum(sizes)
        error: StagingError | None = None
        writing = True
        if op is not None:
            with op.lock:
                writing = op.busy = not op.abandoned

        def stopped() -> bool:
            return op is not None and op.abandoned

        def stop_writing() -> None:
            nonlocal writing
            writing = False
            if op is not None:
                op.quiet.set()

        try:
            for dest, n in zip(dests, sizes, strict=True):
                left -= n
                if not n:
                    continue
                if not writing:
                    self.rx.drain(n, left, total)
                elif isinstance(dest, memoryview):
                    got = 0
                    while got < n:
                        if writing and stopped():  # the caller gave up: drain the rest
                            stop_writing()
                        k = n - got if op is None else min(n - got, _RX_CHUNK)
                        more = left + n - got - k
                        if writing:
                            self.rx.recv_into(dest[got : got + k], more, total)
                        else:
                            self.rx.drain(k, more, total)
                        got += k
                else:
                    def fill(view: memoryview, more: int, rest: int = left) -> None:
                        self.rx.recv_into(view, more + rest, total)

                    def stuck() -> None:  # (before quiet is set)
                        if op is not None:
                            op.stuck = True

                    try:
                        if not self.ch.staging.receive(dest, fill, stop=stopped, on_stop=stop_writing,
                                                    on_stuck=stuck):
                            stop_writing()
                    except StagingError as exc:
                        error = exc
                        stop_writing()
        finally:
            if op is not None:
                op.quiet.set()
        return error

    def serve_notify_here(self, msg: Notify, answer: Callable[[Callable[[], None]], None]) -> bool:
        """:meth:`serve_notify` on the event loop, which read ``msg`` (``LoopReads``, under its
        lock): delivered without the reader thread, recorded, and answered if asked: the answer is
        handed to ``answer``, which sends it before the loop runs anything else (``LoopReads``, once
        it let go of that lock: a send that fails breaks the channel, which takes it; an answer left
        to the loop's next turn waited for whatever ran in this one). False, nothing done, where
        it must be the thread's: too large or past the peer's credits (protocol errors), or the
        endpoint closing. Never raises."""
        op_id = msg.op_id
        if len(msg.payload) > MAX_NOTIFY or not self.ch.core.deliver(
                Notification(self.ch.peer_name, msg.payload, op_id), self.ch, here=True,
                ack=(lambda: answer(lambda: self._ack_here(op_id))) if msg.answer else None):
            return False
        self._done(self._target_record(msg, OpKind.NOTIFY if msg.answer else OpKind.POST, [], "control"))
        return True

    def _ack_here(self, op_id: int) -> None:
        if self.ch.is_open:  # (closed meanwhile: the initiator's op fails with the channel)
            try:
                self.ch.send(Ack(op_id))
            except TransportError:  # (broken just now: the same)
                pass

    def serve_notify(self, msg: Notify) -> None:
        rec = self._target_record(msg, OpKind.NOTIFY if msg.answer else OpKind.POST, [], "control")
        if len(msg.payload) > MAX_NOTIFY:
            raise ProtocolError(f"notification of {len(msg.payload)} bytes exceeds {MAX_NOTIFY}")
        if not self.ch.core.deliver(Notification(self.ch.peer_name, msg.payload, msg.op_id), self.ch,
                                    ack=(lambda: self._answer(rec, msg.op_id)) if msg.answer else None):
            self._reject(rec, msg.op_id, EndpointClosedError(f"{self.ch.core.name!r} is closing; notification not "
                                                             "delivered"), answer=msg.answer)
            return
        if not msg.answer:
            self._done(rec)
