"""An endpoint's notifications: the queue the application reads and the callbacks that take them
instead.

Channel reader threads (or the event loop, where it reads a channel itself) hand each
notification to :meth:`Inbox.deliver`, which never blocks: each peer holds at most ``window`` of
its notifications here unconsumed, by the channel's credits (:mod:`transport.credits`: the peer
waits for credits, not our reader). The notification moves to the event loop, where a callback
registered for the longest matching payload prefix takes it, else the catch-all callback, else the
queue that :meth:`Inbox.next` and :meth:`Inbox.iterate` read; either way its credit goes back to
its channel then.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from .errors import EndpointClosedError, Phase, TransportTimeoutError
from .peer import Notification

__all__ = ["Inbox"]

log = logging.getLogger("transport.endpoint")


class _Credits(Protocol):
    """What :meth:`Inbox.deliver` uses of the channel's credits (:class:`transport.credits.NoteCredits`)."""

    def delivered(self) -> bool: ...
    def overflow(self) -> Exception: ...
    def taken(self) -> None: ...


class Inbox:
    """The notifications of one endpoint; ``is_open()`` says whether the endpoint still takes
    them. Routes may be set at once; deliveries start once :meth:`attach` gave it the endpoint's
    event loop (at ``open()``).

    The queue is a deque read only on the event loop; each waiter of :meth:`next` or
    :meth:`iterate` parks one future, woken in the order they came. A waiter takes a notification
    only when it runs again (never while it may still be cancelled), so a cancelled or timed-out
    wait loses nothing; one that leaves without taking passes its wake-up on."""

    def __init__(self, window: int, is_open: Callable[[], bool]) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < 2**63:
            raise ValueError(f"max_pending_notifications must be an int from 1 to 2**63 - 1, got {window!r}")
        self.window = window  # each peer's notifications held here unconsumed, at most (its credits)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_open = is_open
        self._notes: collections.deque[tuple[Notification, _Credits]] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._catch_all: Callable[[Notification], Any] | None = None
        self._routes: dict[bytes, Callable[[Notification], Any]] = {}  # payload prefix -> callback
        self._closed = False
        self._order = threading.Lock()  # a reader thread's hand-over and answer; close() waits for it

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver on ``loop`` from now on (the endpoint's, at ``open()``)."""
        self._loop = loop

    def close(self) -> None:
        """The endpoint closes: every :meth:`next` waiting, and any later, raises
        :class:`EndpointClosedError` (event loop). Once it returned, every notification that a
        reader thread handed over has had its answer sent (it waits for one mid-way, which takes
        microseconds: the answer is a send that never blocks), so the channels' ``Bye`` frames,
        sent after this, follow those answers."""
        with self._order:
            self._closed = True
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    # ---------------------------------------------------------------- reader threads
    def deliver(self, note: Notification, credits: _Credits, ack: Callable[[], None] | None = None) -> bool:
        """Hand ``note``, which spent one of ``credits`` (its channel's), to the event loop (a
        channel's reader thread), then call ``ack`` (the sender's answer, for a notification it
        waits on: a send that never blocks); never blocks otherwise. False, nothing done, if the
        endpoint is closing (the op is then refused); raises ProtocolError if the peer sent more
        than its credits allow. Queued before answered: whatever the answer lets the sender do
        next (a notification over another channel, or, in this process, read what its callback
        did) comes after ``note``. Both under the lock :meth:`close` takes: an application that
        closes its endpoint as soon as it took ``note`` cannot get its ``Bye`` to the sender
        ahead of the answer. An exception of ``ack`` propagates (the channel is lost)."""
        with self._order:
            if self._closed or self._loop is None:
                return False
            if not credits.delivered():
                raise credits.overflow()
            try:
                self._loop.call_soon_threadsafe(self._enqueue, note, credits)
            except RuntimeError:  # the loop is closed
                return False
            if ack is not None:
                ack()
        return True

    # ---------------------------------------------------------------- event loop
    def deliver_here(self, note: Notification, credits: _Credits, ack: Callable[[], None] | None = None) -> bool:
        """:meth:`deliver` from the event loop itself (it read the notification: a channel's
        ``LoopReads``): queued on the loop behind what the reader threads delivered before, without
        a thread's wake-up, and ``ack`` called at once (the notification queued first; the caller
        sends the answer before the loop runs anything else, as the thread's answer goes out
        whatever the loop does). False, nothing done, if the endpoint is closing or the peer
        sent more than its credits allow (the caller leaves the notification to the reader
        thread)."""
        if self._closed or self._loop is None or not credits.delivered():
            return False
        self._loop.call_soon(self._enqueue, note, credits)
        if ack is not None:
            ack()
        return True

    def _enqueue(self, note: Notification, credits: _Credits) -> None:
        callback = self._route(note.payload)
        if callback is not None:
            try:
                callback(note)
            except Exception:  # a user callback must not kill the channel
                log.exception("notification callback failed")
            finally:
                credits.taken()
            return
        self._notes.append((note, credits))
        self._wake_one()

    def _wake_one(self) -> None:
        """Wake the longest-waiting waiter still waiting (event loop)."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _take(self) -> Notification:
        note, credits = self._notes.popleft()
        credits.taken()
        return note

    def _route(self, payload: bytes) -> Callable[[Notification], Any] | None:
        if self._routes:
            best = b""
            for prefix in self._routes:
                if len(prefix) > len(best) and payload.startswith(prefix):
                    best = prefix
            if best:
                return self._routes[best]
        return self._catch_all

    def on_notification(self, callback: Callable[[Notification], Any] | None, prefix: bytes) -> None:
        """Route notifications whose payload starts with ``prefix`` (all: ``b""``) to
        ``callback``; None removes the route (see :meth:`transport.Endpoint.on_notification`)."""
        if not isinstance(prefix, bytes):
            raise TypeError(f"prefix must be bytes, got {type(prefix).__name__}")
        if not prefix:
            self._catch_all = callback
        elif callback is None:
            self._routes.pop(prefix, None)
        else:
            self._routes[prefix] = callback

    async def _wait(self, timeout: float) -> None:
        """Park until a notification is queued, the inbox closes or ``timeout`` s passed (event
        loop); the caller takes what is queued as soon as this returns. Cancelled (its wake-up
        may already have come), it passes the wake-up on if notifications are still queued."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        timer = loop.call_later(max(timeout, 0.0), _expire, fut)
        try:
            await fut
        except BaseException:
            if not fut.done():
                fut.cancel()
            if self._notes:  # (never strand a notification behind a waiter that left)
                self._wake_one()
            raise
        finally:
            timer.cancel()
            if self._waiters and self._waiters[-1] is fut:  # (timed out: leave no dead entry behind)
                self._waiters.pop()
            elif fut in self._waiters:
                self._waiters.remove(fut)

    async def next(self, timeout: float) -> Notification:
        """The next queued notification; :class:`TransportTimeoutError` after ``timeout`` s,
        :class:`EndpointClosedError` once the endpoint closes (a waiter is woken at once).
        Cancelled or timed out, it takes nothing: every notification stays queued for the next.
        ``ValueError`` for a negative or NaN ``timeout`` (0: only what is queued already)."""
        if not timeout >= 0:  # (NaN too: its timer would never fire)
            raise ValueError(f"timeout must be >= 0, got {timeout}")
        deadline = time.monotonic() + timeout
        while not self._notes:
            if self._closed:
                raise EndpointClosedError("the endpoint closed: no notification will arrive")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportTimeoutError("no notification arrived before the deadline", Phase.NOTIFY)
            await self._wait(left)
        return self._take()

    async def iterate(self) -> AsyncGenerator[Notification, None]:
        """Queued notifications as they arrive, until ``is_open()`` turns false (checked at least
        every 0.5 s) or the inbox closes."""
        while self._is_open() and not self._closed:
            if not self._notes:
                await self._wait(0.5)
                continue
            yield self._take()


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
