"""Which incarnation of a peer's name a channel should reach, when two are alive at once.

A peer's name is taken by its newest incarnation: the one whose record the rendezvous store (or
the endpoint's address book) names. Two cases need a look there, both bounded:

- a dial whose handshake the dialled incarnation does not answer (frozen, or gone without closing
  its socket) looks again every :data:`RECHECK_S`; once the store names another incarnation, the
  dial gives this one up (:class:`Replaced`) and dials the new one, instead of waiting out the
  op's deadline (:func:`handshake_unless_replaced`);
- a connection from an incarnation other than the one we have an open channel with is taken as
  the peer's restart only if the store does not name the one we have: a process that was paused
  past its replacement's start, come back, must not take the name back (:func:`replaced_by`). A
  restarted peer publishes its record before it dials anyone, so the store names it by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from .wire import Hello

__all__ = ["RECHECK_S", "Replaced", "handshake_unless_replaced", "replaced_by"]

log = logging.getLogger("transport.endpoint")

RECHECK_S = 1.0  # a dial's handshake unanswered this long looks for a newer incarnation, and again as long


class Replaced(Exception):
    """The incarnation being dialled was replaced by a newer one (look the peer up again)."""


class _Owner(Protocol):
    _book: Any  # AddressBook
    _rdv: Any  # Rendezvous


class _Channel(Protocol):
    incarnation: int

    @property
    def is_open(self) -> bool: ...


async def _named(ep: _Owner, name: str, deadline: float) -> Any:
    """The record that names ``name`` now: the address book's, else the store's (None: none)."""
    return ep._book.lookup(name, set()) or await ep._rdv.lookup_now(name, deadline)


async def replaced_by(ep: _Owner, have: _Channel | None, remote: Hello, deadline: float) -> int | None:
    """The incarnation that replaced ``remote`` (a peer that dialled us), or None: ``have`` (our
    channel to its name) is open to another incarnation, and that one is named (store or address
    book). A store that cannot be asked leaves it as before: the newer connection wins."""
    if have is None or not have.is_open or have.incarnation == remote.incarnation:
        return None
    try:
        cur = await _named(ep, remote.name, deadline)
    except Exception:
        return None
    return have.incarnation if cur is not None and cur.incarnation == have.incarnation else None


async def handshake_unless_replaced(ep: _Owner, hs: Coroutine[Any, Any, Hello], peer: str, rec: Any,
                                    skip: set[int]) -> Hello:
    """``hs``'s result (a dial's handshake with ``peer``'s incarnation ``rec``); but every
    :data:`RECHECK_S` it has not ended, a peer found in the store is looked up again: once the
    store names another incarnation, ``rec``'s is added to ``skip`` and :class:`Replaced` raised
    (``hs`` cancelled). A peer from the address book is not looked for (its record is given)."""
    task = asyncio.ensure_future(hs)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=RECHECK_S)
            if done:
                return task.result()
            if ep._book.lookup(peer, set()) is not None:
                continue
            cur = None
            with contextlib.suppress(Exception):  # (the store slow or gone: the handshake's own deadline holds)
                cur = await ep._rdv.lookup_now(peer, time.monotonic() + RECHECK_S)
            if cur is not None and cur.incarnation != rec.incarnation:
                log.info("endpoint %r: incarnation %#x has not answered our handshake in %.0f s and the store names "
                         "a new one (%#x): dialling that", peer, rec.incarnation, RECHECK_S, cur.incarnation)
                skip.add(rec.incarnation)
                raise Replaced(f"{peer!r} incarnation {rec.incarnation:#x} was replaced by {cur.incarnation:#x}")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
