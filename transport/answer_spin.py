"""Waiting for a small op's answer by reading the socket on the event loop for a moment before sleeping.

The answer to a small op (an ``Ack``, a get's ``Data`` of a few KiB) arrives a few tens of
microseconds after its header went out. Sleeping in the selector until it comes costs the event
loop's wake-up and one pass of the loop (the selector, the reader's callback, the task's next
step): on a 2-core VM about as long as the round trip itself. So once an op's header went out, its
coroutine reads the channel's socket itself (:meth:`transport.loop_reads.LoopReads.spin`, a
non-blocking ``recv`` per turn) until the answer was handled or the budget passed, and only then
awaits. Measured with ``bench/bench_transport.py --only raw,tcp``: a 4 KiB tcp put's p50 went from
1.9x the raw socket's send+ack to 1.2x.

It spins only where that delays nothing else:

* ops of at most :data:`SPIN_MAX_BYTES`, and larger ones (up to :data:`SENT_SPIN_MAX_BYTES`)
  only if every byte of theirs was already handed to the kernel when the op was started (a tcp
  put's payload taken by the sender's fast path, an shm op's header sent after its copy): what
  is left is the peer draining its receive queue and answering, often within the budget. Over
  loopback TCP, back-to-back 1 MiB puts against a raw socket's send+ack, this spin on and off
  in random order per repetition in one process pair (four runs): 0.98-1.22x the raw socket
  with it, 0.92-1.09x without; at 4 MiB no clear change (the fast path seldom takes it all).
  ``bench/tcp_fanout.py --switch sent_spin`` (three runs): one peer 1.08-1.27x faster with it
  from 128 KiB to 4 MiB (once 0.79x at 128 KiB), a put to 4 peers at once 0.95-1.08x (not
  slower). A larger op that still has bytes queued never spins (its answer is a send buffer's
  drain away).
  Large ops keep their own record of misses (below), so a peer slow to drain megabytes does
  not stop small ops from spinning;
* only while the event loop has nothing else ready to run (asyncio's own loops: their queue of
  ready callbacks is empty) and creates tasks the usual way (no task factory: with Python 3.12's
  eager tasks the first op of a ``gather`` would run, and spin, before the others are even
  created); other loops (uvloop) expose no such queue and never spin. So the ops of a ``gather``
  all go out before any of them spins;
* only while the loop owns the channel's reads (:mod:`transport.loop_reads`), and never towards
  an endpoint of this same process (it may need this very loop, or the GIL this spin holds, to
  answer);
* never past the op's own deadline; it stops as soon as an answer it read woke another task;
* an op whose answer the spin caught then yields to the loop once (``asyncio.sleep(0)``) before
  it returns, as an op that awaited its answer would have: the loop runs its timers, its other
  sockets and what the answers read meanwhile woke (other ops' callers, notification
  callbacks, in the order their frames came) before the caller goes on. So a loop of small ops
  never holds the event loop for more than one op and its budget at a time;
* a channel whose answers missed the budget ``n`` times in a row lets the next ``2**n`` ops (at
  most 64) go by without spinning, until an answer is caught again (small and large ops
  counted apart): a frozen, slow or far peer costs one budget now and then.

Errors, cancellation and deadlines are those of the op (its future is awaited after the spin as
before). ``TRANSPORT_SPIN_US`` in the environment sets the budget in microseconds (default
100; ``0`` turns spinning off); it is read when a channel is set up, and a value that is not a
number from 0 to 10000 is logged as an error and the default used.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sized
from typing import Any, Protocol

__all__ = ["DEFAULT_SPIN_US", "SENT_SPIN_MAX_BYTES", "SPIN_MAX_BYTES", "AnswerSpin", "budget_from_env", "env_budget", "env_setting"]

log = logging.getLogger("transport.channel")

SPIN_MAX_BYTES = 64 << 10  # the largest op that spins for its answer whatever was sent of it
SENT_SPIN_MAX_BYTES = 4 << 20  # the largest op that spins once all its bytes are in the kernel
DEFAULT_SPIN_US = 100.0
_MAX_MISSES = 6  # a channel that keeps missing lets 2**6 = 64 ops go by between spins


def budget_from_env() -> float:
    """The spin budget in seconds: ``TRANSPORT_SPIN_US`` (microseconds; default 100, ``0``: off)."""
    raw = os.environ.get("TRANSPORT_SPIN_US", str(DEFAULT_SPIN_US)).strip()
    try:
        us = float(raw)
    except ValueError:
        raise ValueError(f"TRANSPORT_SPIN_US must be a number of microseconds, not {raw!r}") from None
    if not 0 <= us <= 10_000:
        raise ValueError(f"TRANSPORT_SPIN_US must be between 0 and 10000 (microseconds), not {raw!r}")
    return us * 1e-6


_env_seen: tuple[str | None, float, str | None] | None = None  # (the variable's value, its budget, its error)


def env_setting() -> tuple[float, str | None]:
    """The budget channels use (seconds) and, if ``TRANSPORT_SPIN_US`` is bad, why (then the
    budget is the default, 100 us): :func:`budget_from_env` parsed once per value of the variable."""
    global _env_seen
    raw = os.environ.get("TRANSPORT_SPIN_US")
    seen = _env_seen
    if seen is not None and seen[0] == raw:
        return seen[1], seen[2]
    error: str | None = None
    try:
        budget = budget_from_env()
    except ValueError as exc:
        error = str(exc)
        log.error("%s; spinning for answers with the default budget, %.0f us", exc, DEFAULT_SPIN_US)
        budget = DEFAULT_SPIN_US * 1e-6
    _env_seen = (raw, budget, error)
    return budget, error


def env_budget() -> float:
    """:func:`budget_from_env`, except that a bad value is logged (once per value) as an error
    and the default (100 us) used: a channel is never refused for it."""
    return env_setting()[0]


class _Reads(Protocol):
    def spin(self, fut: asyncio.Future[Any], budget: float, ready: Sized) -> bool | None: ...


class AnswerSpin:
    """One channel's policy: whether an op's coroutine reads the socket for its answer before it
    awaits it (see the module docstring). ``budget``: seconds (None: ``TRANSPORT_SPIN_US``'s;
    0: never). Event loop only."""

    __slots__ = ("_misses", "_skip", "budget", "caught", "missed", "skipped")

    def __init__(self, budget: float | None = None) -> None:
        self.budget = env_budget() if budget is None else budget

        self.caught = 0  # spins that saw their answer (doctor, tests)
        self.missed = 0  # spins that ran out of budget
        self.skipped = 0  # ops that did not spin because of earlier misses
        # per class of op (0: at most SPIN_MAX_BYTES, 1: larger, all sent): misses in a row (at most
        # _MAX_MISSES), and ops left to let by without spinning
        self._misses = [0, 0]
        self._skip = [0, 0]

    @classmethod
    def for_peer(cls, same_process: bool) -> AnswerSpin:
        """The policy of a channel to a peer: never spins towards an endpoint of this same process
        (it may need this very loop, or the GIL the spin holds, to answer); else the environment's."""
        return cls(0.0 if same_process else None)

    def wait(self, loop: asyncio.AbstractEventLoop, reads: _Reads, fut: asyncio.Future[Any], nbytes: int,
             deadline: float, sent: bool = False) -> bool:
        """Event loop, right after an op was started: read ``reads``' socket until ``fut`` is done,
        the budget passed or ``deadline`` (``time.monotonic()``) came, if the policy allows (``sent``:
        every byte of the op is already in the kernel; an op larger than :data:`SPIN_MAX_BYTES`
        spins only then). True if ``fut`` is done by then (the caller then yields to the loop once
        before it returns: see the module docstring). Never raises what the op raises (the future
        carries it); returns at once when it does not spin."""
        if self.budget <= 0 or fut.done():
            return False
        if nbytes <= SPIN_MAX_BYTES:
            cls = 0
        elif sent and nbytes <= SENT_SPIN_MAX_BYTES:
            cls = 1
        else:
            return False
        ready = getattr(loop, "_ready", None)  # (asyncio's BaseEventLoop: the callbacks to run next)
        if ready is None or ready or loop.get_task_factory() is not None:
            return False
        if self._skip[cls]:
            self._skip[cls] -= 1
            self.skipped += 1
            return False
        budget = min(self.budget, deadline - time.monotonic())
        if budget <= 0:
            return False
        got = reads.spin(fut, budget, ready)
        if got is None:  # (stopped for something else: the loop has work, or the reads went to the thread)
            return fut.done()
        if got:
            self.caught += 1
            self._misses[cls] = 0
            return True
        self.missed += 1
        misses = self._misses[cls] = min(self._misses[cls] + 1, _MAX_MISSES)
        self._skip[cls] = 1 << misses
        return False
