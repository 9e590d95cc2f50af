"""The initiator's ops of one channel: the table of pending ops and each op's life, from posted to settled.

:class:`OpTable` numbers an op and records it (:meth:`OpTable.new_op`), runs it to its deadline in
call order (:meth:`OpTable.run`: an op that had to wait before sending is handed over behind the
one called before it), abandons it when its caller stops waiting (an op whose header went out stays
in the table until its late reply was consumed) and settles its future when it ends. Each
:class:`~transport.channel.Channel` owns one, and the table sees its channel through
:class:`OpChannel`. ``run``, ``settle`` and ``finish_here`` run on the event loop; ``pop``,
``fail_op``, ``settle_from_thread`` and ``record_here`` may be called from any thread (the table is
guarded by the channel's lock).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from .answer_spin import AnswerSpin
from .errors import PeerLostError, Phase, TransportTimeoutError
from .flight_recorder import FlightRecorder, OpKind, OpState, Record
from .hostinfo import local_host, same_host
from .op import Op
from .receiver import RX_POLL_S
from .staging import Staging

if TYPE_CHECKING:
    from .loop_reads import LoopReads
    from .planes.base import DataPlane
    from .wire import HostInfo

__all__ = ["OpChannel", "OpTable", "Place"]

#: an op's place in a channel's call order (:meth:`OpTable.reserve`): the future of the op before it
#: (None: nothing) and its own, done once it went out
Place = tuple["asyncio.Future[None] | None", "asyncio.Future[None]"]

log = logging.getLogger("transport.channel")  # what is logged here is the channel's (as before it moved here)

_LINK_ABANDON_GRACE = 0.25  # s an abandoned op's receive on the link may take to complete before the link is
_LINK_ABANDON_RATE = 1e9  # aborted, plus its bytes at this rate (bytes/s): a healthy slow link is not cut off

_STATE_HINT = {
    "posted": "not yet sent, queued behind earlier traffic or still copying",
    "sent": "sent, no answer from the target",
}


class OpChannel(Protocol):
    """What the op table reads and calls of its channel (:class:`transport.channel.Channel`)."""

    loop: asyncio.AbstractEventLoop
    core: Any  # the endpoint: name, on_timeout()
    id: str
    peer_name: str
    recorder: FlightRecorder
    staging: Staging
    reads: LoopReads | None  # who reads the channel's socket (None: always its reader thread)
    host: HostInfo  # the peer's
    credits: Any  # its notification credits (transport.credits.NoteCredits)
    plane: DataPlane  # its own plane (a parked post's record names it)

    def lose(self, exc: BaseException) -> None: ...


def _expire(fut: asyncio.Future[None]) -> None:
    """An op's deadline passed (event loop): its wait ends with ``TimeoutError``."""
    if not fut.done():
        fut.set_exception(TimeoutError())


class OpTable:
    """The pending ops of one channel (initiator side) and their lifecycle; ``lock`` is the
    channel's lock (``pending`` is read and cleared by the channel's ``lose`` under it)."""

    _op_ids = itertools.count(1)

    def __init__(self, channel: OpChannel, lock: threading.Lock) -> None:
        self.ch = channel
        self.loop = channel.loop
        self.lock = lock
        self._seq = itertools.count(1)
        self.calls = 0  # puts, gets, notifies and posts called on the channel (:meth:`called`)
        self._calls_lock = threading.Lock()
        self.pending: dict[int, Op] = {}
        # the hand-over to the sender of the latest op that had to be ordered behind, or could wait
        # before sending (a staged op awaiting the caller's CUDA work): ops go out in call order
        self._order_tail: asyncio.Future[None] | None = None
        self._holds: list[asyncio.Future[None]] | None = None  # hold_order()s of the op in _in_order's start()
        # whether an op reads its answer itself before it awaits it (answer_spin)
        here = local_host()
        self.spin = AnswerSpin.for_peer(same_host(here, channel.host)[0] and here.pid == channel.host.pid)

    def new_op(self, kind: OpKind, names: list[str], nbytes: int, plane: DataPlane) -> Op:
        """Allocate an op (event loop) that moves its bytes over ``plane``, recorded as posted."""
        op_id = next(OpTable._op_ids)
        seq = next(self._seq)
        rec = self.ch.recorder.record(
            op_id=op_id,
            channel=self.ch.id,
            seq=seq,
            role="initiator",
            initiator=self.ch.core.name,
            peer=self.ch.peer_name,
            kind=kind,
            names=names,
            nbytes=nbytes,
            plane=plane.name,
            state=OpState.POSTED,
        )
        op = Op(self.loop, op_id, seq, kind, rec, plane.inline_payload)
        op.gated = not plane.sends_at_once
        with self.lock:
            self.pending[op_id] = op
        return op

    async def run(self, op: Op, start: Callable[[], Any], deadline: float, place: Place | None = None,
                  ordered: bool = True, keep_on: type[BaseException] | None = None) -> None:
        """Run ``start()`` (which sends the op) and wait for its completion until ``deadline``.

        ``place``: the op's place in the channel's call order, taken before it awaited anything
        (:meth:`reserve`; consumed here); else it goes behind every op started before it.
        ``ordered=False``: a control op that waits behind nothing (a registry sync, which an op
        holding a place may await). ``keep_on``: where ``start()`` raises that, ``place`` is not
        given back (the caller retries the op in it). Raises :class:`TransportTimeoutError` at the deadline,
        :class:`PeerLostError` if the channel breaks, the target's error if it
        rejects. Cancellation stops the wait only: bytes already handed to the
        writer or to a copy thread still go out, and the channel stays usable.
        """
        caught = False  # the op's answer was read by its own coroutine (answer_spin)
        credits = self.ch.credits
        try:
            prev, mine = place if place is not None else (self._order_tail, None)
            if not ordered or (mine is None and not op.gated and (prev is None or prev.done())
                               and not (op.note and not credits.available())):
                # the common case: the op is handed to the sender at once, in call order, and only its
                # future is awaited: a timer fails it at the deadline (cheaper than a timeout scope)
                timer = self.loop.call_at(deadline, _expire, op.future)
                try:
                    await start()
                    reads = self.ch.reads
                    if reads is not None and not op.future.done():  # (its answer: read it right here)
                        caught = self.spin.wait(self.loop, reads, op.future, op.record.nbytes, deadline,
                                                op.record.state == OpState.SENT)  # (its bytes all in the kernel)
                    await op.future
                finally:
                    timer.cancel()
            else:
                if op.note:  # in its turn, it waits for a notification credit first (transport.credits)
                    start = _after_credit(self.ch, op, start)
                async with asyncio.timeout_at(deadline):
                    await self._in_order(prev, start, mine, op.future, keep_on)
                    await op.future
        except TimeoutError:
            was = op.record.state
            if op.via_link:  # its work posted on the link cannot be called back: abort the link (and the channel)
                self.ch.lose(PeerLostError(f"{op.kind.value} #{op.op_id} over the channel's link with "
                                           f"{self.ch.peer_name!r} timed out: the link was aborted and the channel closed"))
            try:
                note = await self._abandon(op)
            finally:  # (even if cancelled again meanwhile: the record always ends)
                self.ch.recorder.update(op.record, OpState.TIMED_OUT)
            exc = TransportTimeoutError(
                f"{op.kind.value} #{op.op_id} (seq {op.seq}) to {self.ch.peer_name!r} did not complete before "
                f"its deadline (it was {was}: {_STATE_HINT.get(was, '')})" + (f"; {note}" if note else "")
                + self._credit_hint(op),
                Phase.NOTIFY if op.kind in (OpKind.NOTIFY, OpKind.POST) else Phase.TRANSFER,
            )
            self.ch.core.on_timeout(self.ch, op, exc)
            raise exc from None
        except asyncio.CancelledError:
            try:
                await self._abandon(op)
            finally:
                self.ch.recorder.update(op.record, OpState.CANCELLED)
            raise
        except Exception as exc:
            try:
                await self._abandon(op)
            finally:
                self.ch.recorder.update(op.record, OpState.FAILED, exc)
            raise
        except BaseException as exc:  # KeyboardInterrupt, GeneratorExit...: no await here
            bound = self._abandon_now(op)
            if bound:
                op.quiet.wait(min(bound, 1.0))
            self._forget(op)
            self.ch.recorder.update(op.record, OpState.FAILED, exc)
            raise
        if caught:  # one pass of the loop, as awaiting the answer would have given: its timers, its other
            await asyncio.sleep(0)  # sockets and what the answers read here woke run before the caller goes on

    def _credit_hint(self, op: Op) -> str:
        """Why an op that timed out before it was sent waited, where notification credits held it
        (it waited for one, or behind posts parked for them): noted in its record too."""
        credits, peer = self.ch.credits, self.ch.peer_name
        if op.on_wire or not (credits.parked or (op.note and not credits.available())):
            return ""
        if not any(event == "awaiting_credit" for event, _ in op.record.history):
            self.ch.recorder.mark(op.record, "awaiting_credit")
        held = ("it waited for a notification credit" if op.note and not credits.parked else
                f"it waited behind {credits.parked} posts parked for notification credits")
        return (f"; {held}: {peer!r} holds {credits.window} notifications of ours its application has not taken "
                f"(its max_pending_notifications)")

    async def _in_order(self, prev: asyncio.Future[None] | None, start: Callable[[], Any],
                        mine: asyncio.Future[None] | None = None,
                        ended: asyncio.Future[Any] | None = None, keep_on: type[BaseException] | None = None) -> None:
        """Hand an op to the sender only after ``prev`` (the op called before it that could wait)
        did, whatever became of it: a notify, put or get called after a staged op that still
        awaits the caller's CUDA work reaches the peer after it, as on every other plane.
        ``mine``: the op's reserved place (:meth:`reserve`), else it takes one now. ``ended``: the
        op's future: if it ends while the op waits (the channel was lost), the op is never sent.
        ``keep_on``: :meth:`run`'s (the place stays taken where ``start()`` raised it)."""
        if mine is None:
            mine = self.loop.create_future()
            self._order_tail = mine
        holds: list[asyncio.Future[None]] = []
        kept = False
        try:
            if prev is not None and not prev.done():
                if ended is None:
                    await asyncio.shield(prev)
                else:
                    await asyncio.wait((prev, ended), return_when=asyncio.FIRST_COMPLETED)
                    if ended.done():  # (failed while it waited: the channel broke)
                        return
            self._holds = holds  # (no other op of the channel starts meanwhile: they are all behind mine)
            try:
                await start()
            except BaseException as exc:
                kept = keep_on is not None and isinstance(exc, keep_on)  # (the caller's retry takes the place)
                raise
        finally:
            if self._holds is holds:  # (cancelled while behind ``prev``, it never set them: they are another op's)
                self._holds = None
            pending = [h for h in holds if not h.done()]
            if kept:
                pass
            elif pending:  # what start() handed to a thread holds the op's place until it ended (cancelled too)
                asyncio.gather(*pending).add_done_callback(lambda _f: self.give_back((prev, mine)))
            else:
                self.give_back((prev, mine))

    def reserve(self) -> Place:
        """Event loop: a place in the channel's call order for an op that has to await something
        (a registry sync, its link) before it is handed over: ops started from now on wait behind
        it. Pass it to :meth:`run`, or :meth:`give_back` it if the op ends before that."""
        place = (self._order_tail, self.loop.create_future())
        self._order_tail = place[1]
        return place

    def give_back(self, place: Place) -> None:
        """Event loop: the op holding ``place`` went out (or never will): the ops behind it may go
        once the op it was behind did (given up while still behind it, it keeps them behind it,
        or they would overtake it)."""
        prev, mine = place
        if prev is not None and not prev.done():
            prev.add_done_callback(lambda _f: self._release(mine))
        else:
            self._release(mine)

    def _release(self, held: asyncio.Future[None]) -> None:
        """Event loop: ``held`` went out (or never will): the ops waiting behind it may go."""
        if not held.done():
            held.set_result(None)
        if self._order_tail is held:
            self._order_tail = None

    def hold_order(self) -> Callable[[], None]:
        """Event loop: ops of the channel started from now on wait, as behind a held-back op
        (:meth:`run`), until the returned function is called (on the event loop; idempotent). For
        a plane whose op hands its work to a thread that sends its header or copies its bytes
        later: an op, post or notify called after it must not reach the peer before it."""
        if self._holds is not None:  # (inside an ordered op's start: the hold keeps the op's own place)
            held: asyncio.Future[None] = self.loop.create_future()
            self._holds.append(held)

            def release() -> None:
                if not held.done():
                    held.set_result(None)

            return release
        place = self.reserve()
        return lambda: self.give_back(place)

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
        past its bound (its tensor is then held until it ends, see :func:`~transport.bounce.stage_in`)."""
        try:
            bound = self._abandon_now(op)
            grace = _LINK_ABANDON_GRACE + op.record.nbytes / _LINK_ABANDON_RATE  # (a big receive on a slow link)
            if bound and op.via_link and not await self._wait_quiet(op, grace):
                # a receive posted on the link cannot be called back: one still pending after the grace (a
                # frozen or slow peer) is stopped by aborting the link, which closes the channel
                self.ch.lose(PeerLostError(
                    f"{op.kind.value} #{op.op_id} was abandoned with its receive on the link still pending after "
                    f"{grace:.2f} s: the link with {self.ch.peer_name!r} was aborted and the channel closed "
                    "so that it cannot land in the caller's tensors later"))
            if bound and not await self._wait_quiet(op, bound):
                note = (f"{op.kind.value} #{op.op_id}: writes into the caller's tensors (or the peer's buffer) were still pending {bound:.1f} s "
                        "after the op was abandoned; they may still land there")
                log.error("channel %s: %s", self.ch.id, note)
                return note
            if op.stuck:
                note = (f"{op.kind.value} #{op.op_id}: a staged copy into the caller's tensor outlived its bound "
                        f"({self.ch.staging.config.stall_timeout:g} s) and may still write into it (the tensor is held "
                        "until it ends)")
                log.error("channel %s: %s", self.ch.id, note)
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
            self.ch.lose(PeerLostError(
                f"{op.kind.value} #{op.op_id} was abandoned while its bytes were still arriving; the channel "
                f"to {self.ch.peer_name!r} was closed so that they cannot land in the caller's tensors"))
        if op.via_link:  # a receive into the caller's tensors stops when it completes or the link is aborted (_abandon)
            return 20.0  # (a link's abort is bounded: NCCL's abort flag ends its waits; then the completions are reported)
        if op.staged:  # the reader may be waiting for a copy, up to stall_timeout
            cfg = self.ch.staging.config
            return cfg.stall_timeout + 0.1 * cfg.buffers + RX_POLL_S + 1.0
        return op.abandon_bound  # a local copy stops at its next chunk; the reader at its next poll

    def _forget(self, op: Op) -> None:
        if not op.on_wire:
            self.pop(op.op_id)

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
        popped = self.pop(op.op_id)
        if lost is not None:
            self.ch.lose(lost)
        if popped is not None:
            self.settle_from_thread(op, exc)

    def pop(self, op_id: int) -> Op | None:
        """Any thread: take op ``op_id`` out of the table (None if it is no longer there)."""
        with self.lock:
            return self.pending.pop(op_id, None)

    def settle(self, op: Op, exc: BaseException | None) -> None:
        """Event loop: finish ``op`` unless its waiter already left (an op with posted work of its
        own, ``op.after``, finishes once that work completed too)."""
        after = op.after
        if after is not None:
            if not after.done():
                after.add_done_callback(lambda f: self.settle(op, exc))
                return
            own = None if after.cancelled() else after.exception()  # (retrieved either way)
            if exc is None:
                exc = own
        if exc is None:
            self.ch.recorder.update(op.record, OpState.DONE)
        else:
            self.ch.recorder.update(op.record, OpState.FAILED, exc)
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
        ch = self.ch
        return ch.recorder.record_done(next(OpTable._op_ids), ch.id, next(self._seq), "initiator", ch.core.name,
                                       ch.peer_name, kind, names, nbytes, plane, t_posted, error)

    def post_here(self, send: Callable[[int, int], None], nbytes: int, plane: str, rec: Record | None = None) -> None:
        """Event loop: ``send(op_id, seq)`` a notification nothing answers, with no op object, and
        record it done (or failed with what ``send`` raised, re-raised) in one step; ``rec``: a
        parked post's record (:meth:`park_post`), whose ids it takes and which it ends."""
        ch = self.ch
        if rec is not None:
            try:
                send(rec.op_id, rec.seq)
            except BaseException as exc:
                ch.recorder.update(rec, OpState.FAILED, exc)
                raise
            ch.recorder.update(rec, OpState.DONE)
            return
        op_id, seq, t0 = next(OpTable._op_ids), next(self._seq), time.time()
        error: BaseException | None = None
        try:
            send(op_id, seq)
        except BaseException as exc:
            error = exc
            raise
        finally:
            ch.recorder.record_done(op_id, ch.id, seq, "initiator", ch.core.name, ch.peer_name, OpKind.POST, [],
                                    nbytes, plane, t0, error)

    def called(self) -> int:
        """Count a put, get, notify or post called on the channel (any thread): a put whose first try the peer
        refused as stale is retried only if no other op was called since its own stamp, since
        the retry would go out after it (:func:`transport.transfer.transfer`)."""
        with self._calls_lock:
            self.calls += 1
            return self.calls

    def park_post(self, payload: bytes, reply_expected: bool) -> None:
        """Event loop: a post that cannot go out right now (an earlier op of the channel is held
        back, no notification credit, or posts are parked already): it takes its place in the
        call order and a record (posted) now, and waits in the channel's credits
        (:meth:`~transport.credits.NoteCredits.park`), not in the caller."""
        ch = self.ch
        rec = ch.recorder.record(op_id=next(OpTable._op_ids), channel=ch.id, seq=next(self._seq), role="initiator",
                                 initiator=ch.core.name, peer=ch.peer_name, kind=OpKind.POST, names=[],
                                 nbytes=len(payload), plane=ch.plane.name, state=OpState.POSTED)
        ch.credits.park(self.reserve(), payload, reply_expected, rec)

    def in_order_now(self) -> bool:
        """Whether an op started now goes out at once (no earlier op of the channel is still held
        back, waiting before it is handed over: see :meth:`run`)."""
        prev = self._order_tail
        return prev is None or prev.done()

    def finish_here(self, op: Op) -> None:
        """Event loop: ``op`` completed on this side alone (a plane that needs no answer: a
        one-sided shm put or get): it leaves the table of pending ops and succeeds."""
        if self.pop(op.op_id) is not None:  # (else the channel was lost meanwhile: lose() failed the op)
            self.settle(op, None)

    def settle_from_thread(self, op: Op, exc: BaseException | None) -> None:
        """Any thread: :meth:`settle` ``op`` on the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.settle, op, exc)
        except RuntimeError:  # loop closed: nobody is waiting any more
            pass


def _after_credit(ch: OpChannel, op: Op, start: Callable[[], Any]) -> Callable[[], Coroutine[Any, Any, None]]:
    """``start``, once ``ch``'s credits allow a notification (at once if they do; the wait is
    noted in the op's record); not at all if the op ended meanwhile (its channel was lost:
    awaiting its future raises that)."""
    async def gated() -> None:
        waited = not ch.credits.available()
        if waited:
            ch.recorder.mark(op.record, "awaiting_credit")
        if await ch.credits.wait(op.future):
            if waited:
                ch.recorder.mark(op.record, "credited")
            await start()
    return gated
