"""The fence between a peer's old channels and a new one: nothing an old channel's reader still
serves lands after an op of the new channel.

A channel's reader thread serves the peer's ops from its socket in stream order, but the bytes of
an op the initiator gave up on (a timeout) may still sit in that socket when the initiator loses
the channel (its heartbeat bound, an abandoned get) and dials again: the old reader would serve
them after the new channel's ops, and overwrite what a later put wrote. So:

- each endpoint remembers, per peer, the ids of its latest channels to that peer that closed or
  broke on its side (:meth:`Fences.closed`), and a dialler names them in its ``Hello``
  (``Hello.lost``, at most :data:`~transport.wire.MAX_LOST`);
- adopting a new channel, an endpoint breaks the channels the peer named that are still open on
  its side, and the new channel's reader serves nothing before the reader threads of every channel
  to that peer that closed, broke or was just broken here have stopped (:func:`wait`, bounded by
  :data:`FENCE_S`; past it the new channel is lost with :class:`PeerLostError`, and the next dial
  fences again).

- where our ops move to a channel no Hello of ours introduced (two channels serve between the
  same pair, both sides having dialled at once, and the one that carries our ops ends on our
  side; or one we accepted becomes our route), they go behind a ``Lost`` frame naming our ended
  channels: the peer's reader of the other channel, reading it, breaks the ended one where still
  open there and reads no further frame before its reader stopped (the same bound; past it that
  channel is lost too).

The ids are kept for the :data:`MAX_PEERS` peers touched most recently (a server that sees many
short-lived peers does not keep them all for good), and never forgotten for a peer touched within
:data:`KEEP_S` or with a reader of its ended channels still serving.

A reader stops at its next frame boundary once its channel is no longer open (what it is
receiving then lands first, and a reader just past that check serves the one frame it is on:
the wait covers both); breaking the channel shuts its socket down, so the bytes left in it are
never served.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .errors import PeerLostError
from .wire import MAX_LOST, Lost

__all__ = ["FENCE_S", "KEEP_S", "MAX_PEERS", "Fences", "wait"]

log = logging.getLogger("transport.endpoint")

FENCE_S = 10.0  # how long a new channel's reader waits for the old readers to stop
MAX_PEERS = 4096  # peers whose ended (or named lost) channel ids are kept; the least recently touched go first
KEEP_S = 60.0  # ... but never one touched this recently, or with a reader of its ended channels still serving


class _PerPeer:
    """peer -> a deque of ids (``maxlen``), for the :data:`MAX_PEERS` peers touched last (see the module
    docstring). :meth:`get` from any thread without the lock: a peer being touched never leaves the
    dict meanwhile (``move_to_end``), so a reader never misses ids that are kept."""

    def __init__(self, maxlen: int) -> None:
        self._ids: collections.OrderedDict[str, collections.deque[str]] = collections.OrderedDict()
        self._touched: dict[str, float] = {}
        self._maxlen = maxlen
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, peer: str) -> collections.deque[str] | None:
        return self._ids.get(peer)

    def touch(self, peer: str, busy: set[str]) -> collections.deque[str]:
        """``peer``'s deque (created if absent), now the most recently touched; past MAX_PEERS peers the
        least recently touched is forgotten, unless it was touched within KEEP_S or is in ``busy``."""
        now = time.monotonic()
        with self._lock:
            q = self._ids.get(peer)
            if q is None:
                q = self._ids[peer] = collections.deque(maxlen=self._maxlen)
            else:
                self._ids.move_to_end(peer)
            self._touched[peer] = now
            while len(self._ids) > MAX_PEERS:
                oldest = next(iter(self._ids))
                if now - self._touched[oldest] < KEEP_S or oldest in busy:
                    break  # (kept: the dict holds more for a while)
                self._ids.popitem(last=False)
                del self._touched[oldest]
            return q


class Fences:
    """One endpoint's record of the channels its peers' new channels are fenced from (event loop;
    :meth:`fence_for` also from a reader thread, for a Lost frame: atomic steps under the GIL)."""

    def __init__(self) -> None:
        # (both per peer, for MAX_PEERS peers: a job that sees many short-lived peers does not keep them all)
        self._lost = _PerPeer(MAX_LOST)  # peer -> ids of our channels to it that ended
        self._ended: set[Any] = set()  # channels that ended whose reader may still be serving a frame
        # peer -> ids its Hellos named as lost: one of those we had not adopted yet is never adopted
        # (its handshake was still finishing here, e.g. held up by a store look-up, when the new one came)
        self._named = _PerPeer(4 * MAX_LOST)

    def closed(self, ch: Any) -> None:
        """``ch`` closed or broke on our side."""
        self._ended = {c for c in self._ended if c.reader.is_alive()}
        if ch.reader.is_alive():
            self._ended.add(ch)
        self._lost.touch(ch.peer_name, self._busy()).append(ch.id)

    def _busy(self) -> set[str]:
        """The peers a reader of whose ended channels still serves (their ids are never forgotten)."""
        return {c.peer_name for c in list(self._ended) if c.reader.is_alive()}

    def lost_ids(self, peer: str, channels: Iterable[Any] = ()) -> list[str]:
        """The ids a Hello to ``peer`` names as lost: our latest ended channels to it, and those of
        ``channels`` (ours) already broken whose end the loop has not run yet (lost by a thread)."""
        ids = list(self._lost.get(peer) or ()) + [c.id for c in list(channels) if c.peer_name == peer and not c.is_open]
        return list(dict.fromkeys(ids))[-MAX_LOST:]  # (once each: ids a peer reuses, e.g. given none, repeat)

    def fence_for(self, peer: str, incarnation: int, lost: Iterable[str], channels: Iterable[Any],
                  sweep: bool = True) -> list[threading.Thread]:
        """The reader threads a new channel to ``peer`` (of ``incarnation``) must wait for: those of
        the channels to ``peer`` that ended here, and of the open ones of that incarnation the peer
        says it lost (``lost``: its Hello's), which are broken now; ``sweep`` (adopting a channel, on
        the loop): also those still open to another incarnation of ``peer``, broken now. Event loop,
        or (a Lost frame, without ``sweep``) the reader thread of the channel it came on."""
        named = set(lost)
        if named:
            seen = self._named.touch(peer, self._busy())
            seen.extend(i for i in named if i not in seen)
        readers = []
        for c in list(channels):
            if c.peer_name != peer:
                continue
            if c.is_open and c.incarnation == incarnation and c.id in named:
                c.lose(PeerLostError(f"{peer!r} lost channel {c.id} and dialled again"))
            elif sweep and c.is_open and c.incarnation != incarnation:  # every channel of a replaced incarnation, not
                c.lose(PeerLostError(f"{peer!r} restarted (new incarnation {incarnation:#x})"))  # only the routed one
            if not c.is_open and c.reader.is_alive():
                readers.append(c.reader)
        # (a copy first: a Lost frame's reader thread calls this while the loop may add to the set)
        readers += [c.reader for c in list(self._ended) if c.peer_name == peer and c.reader.is_alive()]
        return list(dict.fromkeys(readers))

    def arm(self, ch: Any, peer: str, incarnation: int, lost: Iterable[str], channels: set[Any]) -> None:
        """A new channel ``ch`` to ``peer``: the readers it waits for before its first frame, and
        those a Lost frame on it names (:meth:`fence_for`; ``channels``: every other one of ours)."""
        ch.fence = self.fence_for(peer, incarnation, lost, channels)
        # (a Lost read on a channel broken meanwhile, e.g. by a new incarnation's: nothing to wait for, nothing to break)
        ch.fence_lost = lambda ids: (self.fence_for(peer, incarnation, ids, list(channels), sweep=False)
                                     if ch.is_open else [])

    def introduce(self, ch: Any, peer: str, channels: Iterable[Any]) -> None:
        """Our ops to ``peer`` move to ``ch``, which no Hello of ours introduced (one we accepted, or
        the other of two): a Lost frame ahead of them names our channels to ``peer`` that ended."""
        lost = self.lost_ids(peer, channels)
        if lost:
            ch.send_quietly(Lost(lost))

    def refuse_late(self, peer: str, channel_id: str) -> bool:
        """Whether an accepted channel must not be adopted: ``peer`` already named it lost (in the Hello
        of a later channel) while its acceptance was still finishing here (logged)."""
        if channel_id not in (self._named.get(peer) or ()):
            return False
        log.warning("channel %s from %r: not adopted, the peer already named it lost (in the Hello of a later "
                    "channel); connection closed", channel_id, peer)
        return True

    def known(self, peer: str) -> bool:
        """Whether a channel to ``peer`` ever ended here (then a connection from an incarnation we
        have no open channel to is checked against the store: the one we talked to may have been
        replaced meanwhile, and may come back)."""
        return bool(self._lost.get(peer))


def wait(readers: list[threading.Thread], is_open: Callable[[], bool], peer: str,
         waiting: Callable[[], None] | None = None) -> None:
    """Reader thread of a channel, before its next frame: wait until ``readers`` stopped (bounded
    by :data:`FENCE_S`, and only while ``is_open()``); ``waiting()`` is called every 0.1 s meanwhile
    (the reader counts the wait as traffic: the silence is its own, not the peer's, so the
    heartbeat does not break the channel for it). Raises :class:`PeerLostError` if one still runs
    past the bound (the channel is then lost: the next dial fences again)."""
    end = time.monotonic() + FENCE_S
    for t in readers:
        while t.is_alive() and is_open() and t is not threading.current_thread():  # (a Lost naming its own channel)
            left = end - time.monotonic()
            if left <= 0:
                raise PeerLostError(f"a reader of an earlier channel to {peer!r} still served it {FENCE_S:.0f} s "
                                    f"after the new channel came up (ops of the two could land out of order)")
            if waiting is not None:
                waiting()
            t.join(min(left, 0.1))
