"""Waiting for a small op's answer by reading the socket on the event loop for a moment before sleeping.

The answer to a small op (an ``Ack``, a get's ``Data`` of a few KiB) arrives a few tens of
microseconds after its header went out. Sleeping in the selector until it comes costs the event
loop's wake-up and one pass of the loop (the selector, the reader's callback, the task's next
step): on a 2-core VM about as long as the round trip itself. So once an op's header went out, its
coroutine reads the channel's socket itself (:meth:`transport.loop_reads.LoopReads.spin`, a
non-blocking ``recv`` per turn) until the answer was handled or :data:`SPIN_S` passed, and only then
awaits. Measured with ``bench/bench_transport.py --only raw,tcp``: a 4 KiB tcp put's p50 went from
1.9x the raw socket's send+ack to 1.2x.

It only ever spins while spinning delays nothing:

* ops of at most :data:`SPIN_MAX_BYTES` (larger ones take longer than the budget anyway);
* only while the event loop has nothing else ready to run (asyncio's own loops: their queue of
  ready callbacks is empty; other loops, e.g. uvloop, expose no such queue: they never spin), so
  the ops of a ``gather`` all go out before any of them spins, and other tasks are never kept
  waiting for more than one budget;
* only while the loop owns the channel's reads (:mod:`transport.loop_reads`);
* a channel whose answers missed the budget ``n`` times in a row spins again only after the next
  ``2**n`` ops (at most 64) that did not, until an answer is caught again: a frozen, slow or
  far peer costs almost nothing.

Cancellation and deadlines are unchanged: the spin is bounded by the budget, and the op's future
is awaited afterwards as before. ``TRANSPORT_SPIN_US`` in the environment sets the budget in
microseconds (default 100); ``0`` turns spinning off.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sized
from typing import Any, Protocol

__all__ = ["SPIN_MAX_BYTES", "SPIN_S", "AnswerSpin", "budget_from_env"]

SPIN_MAX_BYTES = 64 << 10  # the largest op that spins for its answer
_MAX_SKIP = 64  # a channel that keeps missing spins on one op in this many


def budget_from_env() -> float:
    """The spin budget in seconds: ``TRANSPORT_SPIN_US`` (microseconds; default 100, ``0``: off)."""
    raw = os.environ.get("TRANSPORT_SPIN_US", "100").strip()
    try:
        us = float(raw)
    except ValueError:
        raise ValueError(f"TRANSPORT_SPIN_US must be a number of microseconds, not {raw!r}") from None
    if not 0 <= us <= 10_000:
        raise ValueError(f"TRANSPORT_SPIN_US must be between 0 and 10000 (microseconds), not {raw!r}")
    return us * 1e-6


SPIN_S = budget_from_env()  # read once, at import


class _Reads(Protocol):
    def spin(self, fut: asyncio.Future[Any], budget: float, ready: Sized) -> bool | None: ...


class AnswerSpin:
    """One channel's policy: whether an op's coroutine reads the socket for its answer before it
    awaits it (see the module docstring). Event loop only."""

    __slots__ = ("_misses", "_skip", "budget", "caught", "missed", "skipped")

    def __init__(self, budget: float | None = None) -> None:
        self.budget = SPIN_S if budget is None else budget  # seconds; 0: off
        self.caught = 0  # spins that saw their answer (doctor, tests)
        self.missed = 0  # spins that ran out of budget
        self.skipped = 0  # ops that did not spin because of earlier misses
        self._misses = 0  # misses in a row
        self._skip = 0  # ops left to let by without spinning

    def wait(self, loop: asyncio.AbstractEventLoop, reads: _Reads, fut: asyncio.Future[Any], nbytes: int) -> None:
        """Event loop, right after an op's header went out: read ``reads``' socket until ``fut``
        is done or the budget passed, if the policy allows. Never raises what the op raises (the
        future carries it); returns at once when it does not spin."""
        if self.budget <= 0 or nbytes > SPIN_MAX_BYTES or fut.done():
            return
        ready = getattr(loop, "_ready", None)  # (asyncio's BaseEventLoop: the callbacks to run next)
        if ready is None or ready:
            return
        if self._skip:
            self._skip -= 1
            self.skipped += 1
            return
        got = reads.spin(fut, self.budget, ready)
        if got is None:  # (stopped for something else: the loop has work, or the reads went to the thread)
            return
        if got:
            self.caught += 1
            self._misses = 0
        else:
            self.missed += 1
            self._misses += 1
            self._skip = min(1 << self._misses, _MAX_SKIP)
