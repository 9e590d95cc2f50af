"""Which incarnation of a peer's name a channel should reach, when two are alive at once.

A peer's name is taken by its newest incarnation: the one whose record the rendezvous store names.
Two cases need a look there, both bounded:

- a dial whose connect or handshake the dialled incarnation does not answer (frozen, its host
  gone, or gone without closing its socket) looks again every :data:`RECHECK_S` (in the store, or
  in the address book for a peer added from its record); once another incarnation is named, the
  dial gives this one up (:class:`Replaced`) and dials the new one, instead of waiting out the
  op's deadline (:func:`handshake_unless_replaced`);
- a connection from an incarnation we have no open channel with is checked against the store
  (:func:`check_accepted`; a store that does not answer within the caller's bound lets it in): if
  the store names another incarnation, it is a process that was paused past its replacement's
  start, come back, and must not take the name back; it is told why (a ``Bye`` naming its
  replacement: its ops fail :class:`PeerLostError` saying so) and hung up on
  (:meth:`Stale.refuse`). A restarted peer publishes its record before it dials anyone, so the
  store names it by then. A connection waits for the store only :data:`FIRST_LOOKUP_S`: past
  that it is adopted, and every channel of that incarnation is broken the same way once the
  look-up, still running, names another (:meth:`Stale.unseat_when_replaced`), so a store slow to
  answer does not hold up a connection; at most :data:`FIRST_LOOKUPS` look-ups of first
  connections run at once (a burst beyond that is let in unchecked). Peers known only from their
  address records (``Endpoint.add_peer``, no shared store) are not checked: the newer connection
  wins, as a record added later may name it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .errors import PeerLostError
from .handshake import hang_up
from .wire import Bye, Hello, encode_frame

__all__ = ["FIRST_LOOKUPS", "FIRST_LOOKUP_S", "RECHECK_S", "STALE_S", "Replaced", "Stale", "check_accepted", "handshake_unless_replaced",
           "replaced_by"]

log = logging.getLogger("transport.endpoint")

RECHECK_S = 1.0  # a dial's handshake unanswered this long looks for a newer incarnation, and again as long
FIRST_LOOKUP_S = 0.2  # a first connection from a name waits this long for the store (then the look-up goes on)
FIRST_LOOKUPS = 4  # first-connection look-ups running at once, at most (check_accepted)
_SILENCE_LOOKUP_S = 1.0  # the store look-up of a channel heard again after a silence (Stale.after_silence)
STALE_S = 10.0  # an incarnation found replaced is refused at once this long (then the store is asked again)


_T = TypeVar("_T")


class Replaced(Exception):
    """The incarnation being dialled was replaced by a newer one (look the peer up again)."""


class _Owner(Protocol):
    _book: Any  # AddressBook
    _rdv: Any  # Rendezvous
    _state: str  # "open" while it runs

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...


class _Channel(Protocol):
    incarnation: int
    id: str
    peer_name: str
    last_rx: float  # (time.monotonic() of the latest bytes from the peer)

    @property
    def is_open(self) -> bool: ...

    def close(self, reason: str, timeout: float = 1.0, error: BaseException | None = None) -> None: ...


class _Named(Protocol):  # (a Hello, or _Who)
    @property
    def name(self) -> str: ...
    @property
    def incarnation(self) -> int: ...


@dataclass(frozen=True)
class _Who:
    name: str
    incarnation: int


async def replaced_by(ep: _Owner, have: _Channel | None, remote: _Named, deadline: float) -> int | None:
    """The incarnation that replaced ``remote`` (a peer that dialled us), or None: the store names
    another incarnation of its name (whether or not ``have``, our channel to it, is open: ours to the
    stale one may have been lost while it was paused, and its replacement not have dialled us yet). A peer
    from the address book, or a store that cannot be asked, leaves it as before: the newer
    connection wins."""
    if have is not None and have.is_open and have.incarnation == remote.incarnation:
        return None
    if ep._book.lookup(remote.name, set()) is not None:
        return None
    try:
        cur = await ep._rdv.lookup_now(remote.name, deadline)
    except Exception:
        return None
    # (a peer publishes before it dials: a store that names another incarnation names a newer one,
    # also when we hold no open channel to the name, e.g. ours to the stale one was lost meanwhile)
    return cur.incarnation if cur is not None and cur.incarnation != remote.incarnation else None


def _why(remote: _Named, current: int) -> str:
    return (f"refused: incarnation {remote.incarnation:#x} of {remote.name!r} was replaced by incarnation "
            f"{current:#x} (the store names it; this process was paused past its replacement's start?)")


class Stale:
    """The incarnations found replaced (name, incarnation) -> the one that replaced it, for the
    latest 1024: a connection from one within :data:`STALE_S` of that finding is refused at once,
    without asking the store again (also one whose earlier channel of the same incarnation is still
    open: :meth:`Stale.unseat_when_replaced` is closing those); later ones ask again (the record
    that named another may have been withdrawn since). Each is logged once. Event loop.
    ``looking``: first-connection (and after-silence) look-ups running."""

    def __init__(self) -> None:
        self._by: dict[tuple[str, int], tuple[int, float]] = {}
        self.looking = 0
        self._silent: set[Any] = set()  # open channels whose peer was silent for 2 heartbeat intervals
        self.after_looking = 0  # after_silence's look-ups running
        self._unseating: set[Any] = set()  # channels being closed by unseat_when_replaced

    def get(self, remote: _Named) -> int | None:
        found = self._by.get((remote.name, remote.incarnation))
        return found[0] if found is not None and time.monotonic() - found[1] < STALE_S else None

    def count(self, look: asyncio.Task[int | None], after: bool = False) -> None:
        """``look`` is one of the look-ups bounded by :data:`FIRST_LOOKUPS`: counted in ``looking``
        (first connections), or ``after_looking`` (``after``: :meth:`after_silence`'s) while it runs."""
        name = "after_looking" if after else "looking"
        setattr(self, name, getattr(self, name) + 1)
        look.add_done_callback(lambda _: setattr(self, name, getattr(self, name) - 1))

    def after_silence(self, ep: _Owner, channels: set[Any], now: float, interval: float) -> None:
        """Event loop, at every heartbeat (``now``: ``time.monotonic()``): an open channel whose peer
        was silent for 2 heartbeat intervals (frozen, or cut off) and is heard again is checked
        against the store, as a first connection is: a process paused past its replacement's start
        must not keep the name on a channel that never broke. Nothing asked the store while that
        channel stayed open, so our ops went on reaching the paused process once it ran again, and
        never its replacement (found by the chaos soak's ``zombie`` fault). Not while the silence
        lasts: a peer cut off is often cut off with the store, and a look-up then stuck on the
        store's one thread held up every later one (the accept of that peer's next connection).
        At most :data:`FIRST_LOOKUPS` such look-ups run at once (a limit of their own; the rest at
        a later beat), one per peer incarnation."""
        if ep._state != "open":
            return
        asked: set[tuple[str, int]] = set()
        for ch in list(channels):
            if not ch.is_open or ch in self._unseating:
                continue
            if now - ch.last_rx >= 2 * interval:
                self._silent.add(ch)
                continue
            if ch not in self._silent:
                continue
            who = _Who(ch.peer_name, ch.incarnation)
            if (who.name, who.incarnation) not in asked:
                if self.after_looking >= FIRST_LOOKUPS:
                    continue  # (at a later beat)
                asked.add((who.name, who.incarnation))
                look = ep._spawn(replaced_by(ep, None, who, now + _SILENCE_LOOKUP_S))
                self.count(look, after=True)
                self.unseat_when_replaced(ep, who, look, channels)
            self._silent.discard(ch)  # (one look-up answers for every channel of that incarnation)
        self._silent = {c for c in self._silent if c.is_open}

    def add(self, remote: _Named, current: int, why: str) -> None:
        key = (remote.name, remote.incarnation)
        if key not in self._by:
            log.warning("connection from %r %s", remote.name, why)
            if len(self._by) >= 1024:
                del self._by[next(iter(self._by))]
        self._by[key] = (current, time.monotonic())

    def unseat_when_replaced(self, ep: _Owner, remote: _Named, look: asyncio.Task[int | None],
                             channels: Iterable[_Channel]) -> None:
        """Event loop: once ``look`` (:func:`check_accepted`'s, for a channel adopted from ``remote``)
        names another incarnation, every open channel of ``channels`` from that incarnation of the
        name is told why (a ``Bye``, after our copies into the peer's memory ended:
        :meth:`~transport.channel.Channel.close`) and broken; their ops fail :class:`PeerLostError`,
        and the next op to the name dials the incarnation the store names. From then on that
        incarnation's connections are refused at once."""
        async def unseat(ch: _Channel, why: str) -> None:
            try:
                await asyncio.to_thread(ch.close, why, 1.0, PeerLostError(f"channel {ch.id}: {why}"))
            finally:
                self._unseating.discard(ch)

        def done(f: asyncio.Task[int | None]) -> None:
            current = None if f.cancelled() or f.exception() is not None else f.result()
            if current is None:
                return
            why = _why(remote, current)
            self.add(remote, current, why)
            for ch in list(channels):
                if ch.is_open and ch.peer_name == remote.name and ch.incarnation == remote.incarnation \
                        and ch not in self._unseating:
                    self._unseating.add(ch)
                    ep._spawn(unseat(ch, why))

        look.add_done_callback(done)

    async def refuse(self, sock: socket.socket, remote: Hello, current: int) -> None:
        """Tell ``remote``'s (stale) incarnation that ``current`` holds its name, and hang up (noted
        here: logged once per incarnation, so a stale process retrying does not flood the log)."""
        why = _why(remote, current)
        self.add(remote, current, why)
        with contextlib.suppress(OSError):
            await asyncio.get_running_loop().sock_sendall(sock, encode_frame(Bye(why)))
        await hang_up(sock)


async def check_accepted(ep: _Owner, have: _Channel | None, remote: Hello, deadline: float,
                         known: bool, stale: Stale) -> tuple[int | None, asyncio.Task[int | None] | None]:
    """Whether to refuse ``remote``'s connection: ``(current, None)``, ``current`` the incarnation
    that replaced it (``stale``'s, else :func:`replaced_by`, bounded by ``deadline``) or None.
    The look-up is waited for only :data:`FIRST_LOOKUP_S`; past that ``(None, look)``, the look-up
    still running (a task of ``ep``'s): hand it to :meth:`Stale.unseat_when_replaced` once the
    channel is adopted, or cancel it. ``known`` False (no channel to the name ever ended here, none
    is open): at most :data:`FIRST_LOOKUPS` such look-ups run at once (they share the store's one
    thread with our dials): a first connection beyond that is let in unchecked (logged at debug level)."""
    if (current := stale.get(remote)) is not None:
        return current, None
    if not known and stale.looking >= FIRST_LOOKUPS:
        log.debug("connection from %r: %d first-connection look-ups already running; not checked",
                  remote.name, stale.looking)
        return None, None
    look = ep._spawn(replaced_by(ep, have, remote, deadline))
    if not known:
        stale.count(look)
    try:
        # (at most FIRST_LOOKUP_S, a known name's too: a store slow to answer, e.g. its one thread still
        # stuck in a call made while a link was down, held up the adoption of that peer's next
        # connection past its first op's bound: the netns link-cut test's push after the restore)
        done, _ = await asyncio.wait((look,), timeout=FIRST_LOOKUP_S)
    except BaseException:
        look.cancel()
        raise
    return (look.result(), None) if done else (None, look)


async def handshake_unless_replaced(ep: _Owner, hs: Coroutine[Any, Any, _T], peer: str, rec: Any,
                                    skip: set[int], deadline: float) -> _T:
    """``hs``'s result (a dial's handshake with ``peer``'s incarnation ``rec``); but every
    :data:`RECHECK_S` it has not ended, a peer found in the store is looked up again (the look-up
    bounded by ``deadline``, the dial's, and raced with the handshake): once the store names
    another incarnation, ``rec``'s is added to ``skip`` and :class:`Replaced` raised (``hs``
    cancelled). A peer from the address book is looked for there (a record of its replacement
    may have been added meanwhile), not in the store."""
    task = asyncio.ensure_future(hs)
    look: asyncio.Future[Any] | None = None
    try:
        while True:
            waits: set[asyncio.Future[Any]] = {task} if look is None else {task, look}
            done, _ = await asyncio.wait(waits, timeout=RECHECK_S if look is None else None,
                                         return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            cur = None
            if look is None:
                booked = ep._book.lookup(peer, set())
                if booked is None:
                    look = asyncio.ensure_future(ep._rdv.lookup_now(peer, deadline))
                    continue
                cur = booked  # (a record of its replacement may have been added meanwhile: add_peer)
            else:
                cur = None if look.cancelled() or look.exception() is not None else look.result()
                look = None
            if cur is not None and cur.incarnation != rec.incarnation:
                log.info("endpoint %r: incarnation %#x has not answered our handshake and its record names a new one "
                         "(%#x): dialling that", peer, rec.incarnation, cur.incarnation)
                skip.add(rec.incarnation)
                raise Replaced(f"{peer!r} incarnation {rec.incarnation:#x} was replaced by {cur.incarnation:#x}")
    finally:
        for fut in (task, look):
            if fut is not None and not fut.done():
                fut.cancel()
                await asyncio.gather(fut, return_exceptions=True)
