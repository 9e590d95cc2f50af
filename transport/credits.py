"""Flow control of one channel's notifications: credits, both ways.

Each endpoint grants every peer a window of notifications (its ``max_pending_notifications``,
sent in its ``Hello``): how many of that peer's notifications (``notify``, ``post``, a put's
``notify``) it may hold that its application has not taken yet. A sender spends one credit per
notification it sends and waits while it has none; the receiver gives credits back in ``Credit``
frames as its application takes notifications (or a callback ran), and a notification the
receiver refused (it answered the op ``Fail``) gives its credit back on the sender's side. So the
receiver never blocks on a full queue: its channel's reader goes on reading, and the answers to
its own ops to that peer arrive whatever the peer sends.

Sender's side (:meth:`NoteCredits.available`, :meth:`NoteCredits.wait`, :meth:`NoteCredits.park`):
an awaited op that carries a notification waits for a credit in the channel's call order (its
deadline bounds that wait; :meth:`transport.op_table.OpTable.run`); a ``post`` never waits: one
that finds no credit is parked here, holding its place in the call order, and sent, in order, as
credits come back. Receiver's side (:meth:`NoteCredits.delivered`, :meth:`NoteCredits.taken`): a
peer that sends more than it was granted (more than twice, with slack for the notifications a
sender's ops had in flight when its credits ran out) breaks the channel with a ProtocolError.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from .errors import ProtocolError, TransportError
from .flight_recorder import OpState
from .wire import Credit, Message, Notify, Put

__all__ = ["NoteCredits", "carries_note"]

log = logging.getLogger("transport.channel")

_SLACK = 64  # notifications past twice the grant a peer may have in flight before it is a protocol error


def carries_note(msg: Message) -> bool:
    """Whether ``msg`` carries a notification (spends a credit)."""
    return type(msg) is Notify or (type(msg) is Put and msg.notify is not None)


class _CreditChannel(Protocol):
    loop: asyncio.AbstractEventLoop
    peer_name: str
    recorder: Any  # the endpoint's flight recorder: a parked post's record

    @property
    def is_open(self) -> bool: ...

    def send(self, msg: Message) -> None: ...
    def post_here(self, payload: bytes, reply_expected: bool = False, rec: Any = None) -> None: ...
    def give_back(self, place: Any) -> None: ...


class NoteCredits:
    """The notification credits of one channel ``ch``: ``window`` granted by the peer (what we
    may send), ``grant`` granted to it (what it may send us). Counters are cumulative over the
    channel's life and guarded by a lock (reader thread, writer thread and event loop touch them);
    waiting and parking are the event loop's."""

    def __init__(self, ch: _CreditChannel, window: int, grant: int) -> None:
        self.ch, self.window, self.grant = ch, window, grant
        self._lock = threading.Lock()
        # our sends: notifications handed to the channel, credits the peer gave back, refused ones
        self._sent = self._returned = self._refunded = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._parked: collections.deque[tuple[Any, bytes, bool, Any]] = collections.deque()  # (place, payload, reply, rec)
        self._pump: asyncio.Task[None] | None = None
        # the peer's sends: notifications delivered here, taken by the application, credits given back
        self._in = self._taken = self._told = 0
        self._every = max(1, grant // 4)  # credits given back in one Credit frame
        self._closed = False

    # ---------------------------------------------------------------- our side: sending
    def available(self) -> bool:
        """Whether a notification may be sent now (any thread)."""
        return self._sent - self._returned - self._refunded < self.window

    def free(self) -> int:
        """How many notifications may be sent now (any thread; a snapshot)."""
        return max(0, self.window - (self._sent - self._returned - self._refunded))

    @property
    def parked(self) -> int:
        """Posts waiting here for a credit (event loop)."""
        return len(self._parked)

    @property
    def pump(self) -> asyncio.Task[None] | None:
        """The task sending the parked posts, while there are any (event loop)."""
        return self._pump

    def sent(self, n: int = 1) -> None:
        """``n`` notifications were handed to the channel (``n`` = -1: one of them was dropped
        unsent). Any thread."""
        with self._lock:
            self._sent += n
        if n < 0:
            self._wake_soon()

    def unsent_then(self, then: Callable[[], None] | None) -> Callable[[], None]:
        """An ``on_dropped`` for a send that spent a credit: gives it back, then calls ``then``."""
        def dropped() -> None:
            self.sent(-1)
            if then is not None:
                then()
        return dropped

    def returned(self, total: int) -> None:
        """The peer's ``Credit(total)``: it has given back ``total`` credits so far (reader thread
        or event loop)."""
        with self._lock:  # (never more than were sent: a peer cannot widen its own window)
            total = min(total, self._sent - self._refunded)
            if total <= self._returned:
                return
            self._returned = total
        self._wake_soon()

    def refund(self) -> None:
        """An op of ours that carried a notification was refused by the peer (``Fail``): it queued
        nothing, so the credit comes back here (reader thread or event loop)."""
        with self._lock:
            self._refunded += 1
        self._wake_soon()

    def _wake_soon(self) -> None:
        if not self._waiters:  # (a waiter registers before it checks again: no wake-up is lost)
            return
        try:
            self.ch.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _wake(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    async def wait(self, ended: asyncio.Future[Any] | None = None) -> bool:
        """Wait (event loop) until a notification may be sent: True, at once if it may now; False
        if the channel closed or ``ended`` (the op's future) is done first. Cancellation-safe (it
        takes nothing: the caller's send spends the credit)."""
        while not self.available():
            if self._closed or not self.ch.is_open or (ended is not None and ended.done()):
                return False
            fut = self.ch.loop.create_future()
            self._waiters.append(fut)
            try:
                if self.available():  # (a credit came back between the check and registering)
                    break
                await (fut if ended is None else asyncio.wait((fut, ended), return_when=asyncio.FIRST_COMPLETED))
            finally:
                if not fut.done():
                    fut.cancel()
                if self._waiters and self._waiters[-1] is fut:  # (a wait that left: no dead entry stays behind)
                    self._waiters.pop()
                elif fut.cancelled():
                    try:
                        self._waiters.remove(fut)
                    except ValueError:  # (already taken by _wake)
                        pass
        return True

    def park(self, place: Any, payload: bytes, reply_expected: bool, rec: Any) -> None:
        """A post that cannot go out now (event loop: :meth:`~transport.op_table.OpTable.park_post`):
        it holds ``place`` (the channel's call order: ops started after it go out after it) and is
        sent, in order, once its turn came and a credit came back (``rec``, its record, then
        done); dropped if the channel closes first, as a post in flight to a peer that dies (``rec``
        failed, and logged)."""
        self._parked.append((place, payload, reply_expected, rec))
        if self._pump is None:
            self._pump = self.ch.loop.create_task(self._send_parked(), name=f"transport-credits-{self.ch.peer_name}")

    async def _send_parked(self) -> None:
        try:
            while self._parked:
                place, payload, reply, rec = self._parked[0]
                prev = place[0]
                if prev is not None and not prev.done():
                    await asyncio.wait((prev,))
                waited = not self.available()
                if waited:
                    self.ch.recorder.mark(rec, "awaiting_credit")
                if not await self.wait():
                    break
                if waited:
                    self.ch.recorder.mark(rec, "credited")
                self._parked.popleft()
                try:
                    self.ch.post_here(payload, reply, rec)
                except TransportError:  # the channel broke: what is parked goes with it
                    self.ch.give_back(place)
                    break
                self.ch.give_back(place)
        finally:
            self._pump = None
            self._drop_parked()

    def _drop_parked(self) -> None:
        if self._parked and (self._closed or not self.ch.is_open):
            log.warning("channel to %r closed with %d posts still waiting for notification credits: dropped",
                        self.ch.peer_name, len(self._parked))
        while self._parked and (self._closed or not self.ch.is_open):
            place, _, _, rec = self._parked.popleft()
            self.ch.recorder.update(rec, OpState.FAILED, "dropped: the channel closed before it was sent (it waited "
                                                         "for its turn or a notification credit)")
            self.ch.give_back(place)

    def close(self) -> None:
        """The channel closed (event loop): waiters return False, parked posts are dropped."""
        self._closed = True
        self._wake()
        if self._pump is None:
            self._drop_parked()

    # ---------------------------------------------------------------- the peer's side: receiving
    def delivered(self) -> bool:
        """One of the peer's notifications is queued here (reader thread or event loop); False if
        the peer sent far more than it was granted (the reader thread raises ProtocolError then)."""
        with self._lock:
            self._in += 1
            if self._in - self._told <= 2 * self.grant + _SLACK:
                return True
            self._in -= 1
        return False

    def overflow(self) -> ProtocolError:
        return ProtocolError(f"{self.ch.peer_name!r} sent more than {2 * self.grant + _SLACK} notifications its "
                             f"credits did not cover (it was granted {self.grant})")

    def taken(self) -> None:
        """The application took one of the peer's notifications (or a callback ran for it): its
        credit goes back to the peer, batched (event loop)."""
        with self._lock:
            self._taken += 1
            if self._taken - self._told < self._every:
                return
            self._told = self._taken
            total = self._told
        if self.ch.is_open:
            try:
                self.ch.send(Credit(total))
            except TransportError:  # (closed just now: the credits die with the channel)
                pass
