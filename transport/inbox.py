"""An endpoint's notifications: the queue the application reads, the callbacks that take them
instead, and the back-pressure on the channels that deliver them.

Channel reader threads hand each notification to :meth:`Inbox.deliver`, which blocks while
``max_pending`` of them are waiting for the application (the channel reads nothing meanwhile, so
the peer's later ops wait behind it: back-pressure, not loss). The notification then moves to the
event loop, where a callback registered for the longest matching payload prefix takes it, else the
catch-all callback, else the queue that :meth:`Inbox.next` and :meth:`Inbox.iterate` read.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from .errors import EndpointClosedError, Phase, TransportTimeoutError
from .peer import Notification

__all__ = ["Inbox"]

log = logging.getLogger("transport.endpoint")

_ROOM_POLL_S = 0.2  # how often a delivery blocked on a full queue checks whether to give up


class _Delivering(Protocol):
    """What :meth:`Inbox.deliver` uses of the channel it delivers for."""

    @property
    def is_open(self) -> bool: ...
    last_rx: float


class Inbox:
    """The notifications of one endpoint; ``is_open()`` says whether the endpoint still takes
    them. Routes may be set at once; deliveries start once :meth:`attach` gave it the endpoint's
    event loop (at ``open()``)."""

    def __init__(self, max_pending: int, is_open: Callable[[], bool]) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_open = is_open
        self._queue: asyncio.Queue[Notification] = asyncio.Queue()
        self._room = threading.Semaphore(max_pending)
        self._catch_all: Callable[[Notification], Any] | None = None
        self._routes: dict[bytes, Callable[[Notification], Any]] = {}  # payload prefix -> callback
        self._closed = asyncio.Event()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver on ``loop`` from now on (the endpoint's, at ``open()``)."""
        self._loop = loop

    def close(self) -> None:
        """The endpoint closes: every :meth:`next` waiting, and any later, raises
        :class:`EndpointClosedError` (event loop)."""
        self._closed.set()

    # ---------------------------------------------------------------- reader threads
    def deliver(self, note: Notification, ch: _Delivering) -> bool:
        """Hand ``note`` to the event loop (a channel's reader thread); blocks while the queue is
        full. False if the endpoint or the channel closed while waiting (the op is then not
        acknowledged)."""
        while not self._room.acquire(timeout=_ROOM_POLL_S):
            if not self._is_open() or not ch.is_open:
                return False
            ch.last_rx = time.monotonic()  # we are the ones not reading: the peer is not silent
        try:
            if self._loop is None:
                raise RuntimeError("not attached to an event loop")
            self._loop.call_soon_threadsafe(self._enqueue, note)
        except RuntimeError:  # the loop is closed
            self._room.release()
            return False
        return True

    # ---------------------------------------------------------------- event loop
    def _enqueue(self, note: Notification) -> None:
        callback = self._route(note.payload)
        if callback is not None:
            self._room.release()
            try:
                callback(note)
            except Exception:  # a user callback must not kill the channel
                log.exception("notification callback failed")
            return
        self._queue.put_nowait(note)

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

    async def next(self, timeout: float) -> Notification:
        """The next queued notification; :class:`TransportTimeoutError` after ``timeout`` s,
        :class:`EndpointClosedError` once the endpoint closes (a waiter is woken at once)."""
        if self._queue.empty():
            if self._closed.is_set():
                raise EndpointClosedError("the endpoint closed: no notification will arrive")
            get = asyncio.ensure_future(self._queue.get())
            closed = asyncio.ensure_future(self._closed.wait())
            try:
                await asyncio.wait({get, closed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:  # (cancelled): a notification taken meanwhile goes back to the front, never lost
                if get.done() and not get.cancelled():
                    self._queue._queue.appendleft(get.result())  # type: ignore[attr-defined]
                raise
            finally:
                closed.cancel()
                if not get.done():
                    get.cancel()
            if not get.done() or get.cancelled():
                if self._closed.is_set():
                    raise EndpointClosedError("the endpoint closed while waiting for a notification")
                raise TransportTimeoutError("no notification arrived before the deadline", Phase.NOTIFY)
            note = get.result()
        else:
            note = self._queue.get_nowait()
        self._room.release()
        return note

    async def iterate(self) -> AsyncGenerator[Notification, None]:
        """Queued notifications as they arrive, until ``is_open()`` turns false (checked at least
        every 0.5 s)."""
        while self._is_open():
            get = asyncio.ensure_future(self._queue.get())
            try:
                while not get.done():
                    await asyncio.wait([get], timeout=0.5)
                    if not self._is_open() and not get.done():
                        get.cancel()
                        return
            except asyncio.CancelledError:
                get.cancel()
                raise
            self._room.release()
            yield get.result()
