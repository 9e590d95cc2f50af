"""Posting rl_sync's messages in order: at once where the transport can, else behind in a task.

Shared by the publisher (:mod:`rl_sync.push_track`) and the subscriber (:mod:`rl_sync.subscriber`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import transport

__all__ = ["REPLY_EXPECTED", "InOrder", "post_in_order"]

log = logging.getLogger("rl_sync.subscriber")

REPLY_EXPECTED = True  # (see InOrder)


class _Posting(Protocol):
    def post_nowait(self, peer: str, payload: bytes, *, reply_expected: bool = False) -> bool: ...


class InOrder:
    """Messages to each peer in the order they are given: :meth:`now` posts one right away
    (``Endpoint.post_nowait``) while no earlier message to that peer still waits in a task
    registered with :meth:`behind`; otherwise (or where the transport cannot post at once) the
    caller posts it in a task of its own and registers it, and later ones wait behind it.

    Every message of rl_sync is answered by one of the peer's (a Reply, or the publisher's next
    push), so each is posted with ``reply_expected`` (:meth:`transport.Endpoint.post`): the event
    loop reads the answer off the channel itself, one thread wake-up less per hop. Tasks that
    post one pass :data:`REPLY_EXPECTED` on."""

    def __init__(self, endpoint: _Posting) -> None:
        self._ep = endpoint
        self._waiting: dict[str, int] = {}  # peer -> its messages still being posted by a task

    def now(self, peer: str, payload: bytes) -> bool:
        """Post ``payload`` to ``peer`` at once if that keeps the order; False: nothing sent, post it
        in a task and pass that to :meth:`behind`. Raises what ``post_nowait`` raises."""
        return not self._waiting.get(peer) and self._ep.post_nowait(peer, payload, reply_expected=REPLY_EXPECTED)

    def behind(self, peer: str, task: asyncio.Task[Any]) -> None:
        """``task`` posts a message to ``peer``: later ones wait until it is done (a done callback,
        so a task cancelled before it began counts as done too)."""
        self._waiting[peer] = self._waiting.get(peer, 0) + 1

        def done(_: asyncio.Task[Any]) -> None:
            self._waiting[peer] -= 1

        task.add_done_callback(done)


def post_in_order(order: InOrder, ep: transport.Endpoint, peer: str, payload: bytes,
                  spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[Any]]) -> None:
    """Post ``payload`` (a message nothing answers: a subscriber's reply) to ``peer`` behind every
    earlier one: at once where it can, else in a task made by ``spawn``. A failure is logged."""
    try:
        if order.now(peer, payload):
            return
    except transport.TransportError as exc:
        log.warning("subscriber %s: reply to %s failed: %s", ep.name, peer, exc)
        return

    async def send() -> None:
        try:
            await ep.post(peer, payload, reply_expected=REPLY_EXPECTED)
        except transport.TransportError as exc:
            log.warning("subscriber %s: reply to %s failed: %s", ep.name, peer, exc)

    order.behind(peer, spawn(send()))
