"""Whether this process was paused, and whether its endpoint's name was taken meanwhile.

A process stopped for a while (SIGSTOP, a debugger, a frozen container or VM) past the start of
its replacement (a new process published under the same name) runs again with its channels
open. Its peers cannot tell it from the live process until one of them asks the store
(:mod:`transport.incarnations`: a channel heard again after a silence); meanwhile it would serve
the ops and notifications queued in its sockets (a push meant for the name, reported done by a
process nobody reads from) and send its own (a stale trainer's weights). So an endpoint with a
store runs a :class:`PauseWatch`: a thread that wakes every :data:`TICK_S`. A wake
:data:`PAUSE_S` late means the process did not run (or got no CPU) that long; the thread then asks
the store, bounded by :data:`CHECK_S`, whether the record of the endpoint's name is still its own
incarnation. Until it has the answer, :meth:`PauseWatch.paused` is true, and

- a channel's reader thread serves no frame (:meth:`PauseWatch.settle`, in
  :class:`transport.dispatch.Dispatcher`), and the event loop delivers no notification it reads
  (it leaves it to the thread);
- no op of the endpoint starts (:meth:`PauseWatch.settled`, in
  :class:`transport.operations.Operations`: they wait, in call order).

The store names this incarnation (or no one, or does not answer in time: a store cut off is no
proof of a replacement): all goes on. It names another: the endpoint was replaced.
``on_replaced`` (the watch thread) tells every peer why (a ``Bye``) and closes the endpoint; the
waiting ops raise :class:`~transport.errors.EndpointClosedError` saying so. A short pause costs a
store look-up, nothing else; a pause shorter than :data:`PAUSE_S` goes unnoticed (a replacement
needs longer than that to start and publish).

Not covered: a peer's one-sided copy into this process's shared memory (``shm``, ``cuda_ipc``
puts without a notification) needs nothing of this process, so it lands while the process is
stopped, replaced or not, until the peer's heartbeat timeout or this process's ``Bye``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable

__all__ = ["CHECK_S", "PAUSE_S", "TICK_S", "PauseWatch"]

log = logging.getLogger("transport.endpoint")

# the watch's clock: CLOCK_BOOTTIME counts a suspend of the host too (CLOCK_MONOTONIC does not)
_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)
_clock_gettime = time.clock_gettime
TICK_S = 0.1  # how often the watch thread wakes
PAUSE_S = 1.0  # a wake this late means the process was paused (or starved): ask the store
CHECK_S = 2.0  # the store's answer is waited for this long (no answer: not replaced)
_CLOSE_S = 2.0  # settle() waits this much longer, while a replaced endpoint's channels are told why
_BOUND_S = PAUSE_S + CHECK_S + _CLOSE_S  # how long settle() and settled() wait for the watch


class _Bound:
    """A waiter's :data:`_BOUND_S`, counted afresh whenever the waiter itself was paused (the watch
    then asks the store again, so the waiter waits for that answer too)."""

    def __init__(self) -> None:
        self._prev = _clock_gettime(_CLOCK)
        self._end = self._prev + _BOUND_S

    def left(self) -> float:
        now = _clock_gettime(_CLOCK)
        if now - self._prev > PAUSE_S:
            self._end = now + _BOUND_S
        self._prev = now
        return self._end - now


class PauseWatch:
    """The watch of one endpoint (see the module docstring). ``current()`` asks the store for the
    incarnation it names for the endpoint's name: a future of it (None: none named), or None (no
    store); ``on_replaced(why)`` runs on the watch thread once it names another than
    ``incarnation``, before the threads and ops waiting in :meth:`settle` / :meth:`settled` are
    let go."""

    def __init__(self, name: str, incarnation: int,
                 current: Callable[[], concurrent.futures.Future[int | None] | None],
                 on_replaced: Callable[[str], None]) -> None:
        self.name = name
        self.incarnation = incarnation
        self.last = _clock_gettime(_CLOCK)  # the watch's latest wake after which nothing was left to check
        self.replaced: str | None = None  # why this endpoint was found replaced (then it stays so)
        self.checks = 0  # store look-ups made after a pause
        self._current = current
        self._on_replaced = on_replaced
        self._cond = threading.Condition(threading.Lock())
        self._loop_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"transport-pause-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the watch (bounded: a look-up under way is left to the daemon thread); waiters go on,
        and :meth:`paused` is false from now on (unless the endpoint was found replaced)."""
        self._stop.set()
        self._release()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2 * TICK_S)  # (it ends at once, or at its look-up's next slice)

    def paused(self) -> bool:
        """Whether the watch has not run for :data:`PAUSE_S` or is asking the store after a pause,
        or the endpoint was found replaced (any thread; a clock read: cheap enough for every op)."""
        return _clock_gettime(_CLOCK) - self.last > PAUSE_S or self.replaced is not None

    def _unchecked(self) -> bool:
        """Under ``_cond``: a pause is not checked yet (and the endpoint not found replaced)."""
        return self.replaced is None and _clock_gettime(_CLOCK) - self.last > PAUSE_S and not self._stop.is_set()

    def settle(self) -> str | None:
        """Any thread but the watch's: wait while :meth:`paused` (bounded: :data:`PAUSE_S` +
        :data:`CHECK_S` + a little, counted afresh after a pause of its own; past that, logged, it
        goes on). Returns why the endpoint was replaced, or None."""
        bound = _Bound()
        with self._cond:
            while self._unchecked():
                left = bound.left()
                if left <= 0:
                    log.warning("endpoint %r: the pause watch did not answer in %.1f s; going on", self.name, _BOUND_S)
                    break
                self._cond.wait(min(left, TICK_S))
            return self.replaced

    async def settled(self) -> str | None:
        """:meth:`settle` for a coroutine (its event loop is not blocked; bounded the same way;
        cancellable)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if self._unchecked():
                self._loop_waiters.append((loop, fut))
            else:
                fut.set_result(None)
        bound = _Bound()
        while not fut.done() and (left := bound.left()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(fut), min(left, TICK_S))
        return self.replaced

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            while True:
                since = _clock_gettime(_CLOCK)
                late = since - self.last
                if late > PAUSE_S:
                    since = self._check(late)  # (when the answer was last known to hold: no pause since)
                if self._release(since):
                    break  # (else the process was paused again, right here: check again)

    def _check(self, late: float) -> float:
        """The watch woke ``late`` s after its previous wake: ask the store who holds the name.
        Returns the clock reading as of which the answer held (no pause since it came)."""
        try:
            current, at = self._ask()
        except Exception as exc:  # (the store failed: no proof of a replacement)
            log.debug("endpoint %r: store look-up after a pause failed: %s", self.name, exc)
            current, at = None, _clock_gettime(_CLOCK)
        if current is None or current == self.incarnation:
            log.info("endpoint %r: this process did not run for %.1f s; the store still names it (incarnation "
                     "%#x)%s", self.name, late, self.incarnation, "" if current else " or did not answer")
            return at
        why = (f"endpoint {self.name!r} (incarnation {self.incarnation:#x}) was replaced by incarnation "
               f"{current:#x} while this process did not run ({late:.1f} s): the store names it")
        log.error("%s; closing this endpoint, its peers told why", why)
        try:
            self._on_replaced(why)
        except Exception:
            log.exception("endpoint %r: closing the replaced endpoint failed", self.name)
        finally:  # (only now: a waiter that saw it sooner, at its next slice, broke its channel before the
            with self._cond:  # Bye went out, and the peer's op failed without the reason; paused() stays
                self.replaced = why  # true until _release, so none was let go meanwhile)
        return at

    def _ask(self) -> tuple[int | None, float]:
        """The incarnation the store names (None: none, no answer within :data:`CHECK_S`, or the
        watch stopped), waited for in slices of :data:`TICK_S`: if this process is paused again
        meanwhile, the answer may predate a replacement, so it asks again."""
        while not self._stop.is_set():
            self.checks += 1
            fut = self._current()
            if fut is None:
                return None, _clock_gettime(_CLOCK)
            last = _clock_gettime(_CLOCK)
            end = last + CHECK_S
            while True:
                try:
                    got = fut.result(TICK_S)
                except concurrent.futures.TimeoutError:
                    now = _clock_gettime(_CLOCK)
                    if now - last > PAUSE_S:
                        break  # (paused meanwhile: ask again)
                    if now >= end or self._stop.is_set():
                        fut.cancel()
                        return None, now
                    last = now
                    continue
                except Exception as exc:  # (the store failed: no proof of a replacement)
                    log.debug("endpoint %r: store look-up after a pause failed: %s", self.name, exc)
                    got = None
                now = _clock_gettime(_CLOCK)
                if now - last > PAUSE_S:
                    break  # (the answer may have come before a pause that just ended: ask again)
                return got, now
        return None, _clock_gettime(_CLOCK)

    def _release(self, since: float | None = None) -> bool:
        """A wake with nothing left to check as of ``since``: let every waiter go. False, nothing
        done, if the process was paused again after ``since`` (over :data:`PAUSE_S` ago)."""
        with self._cond:
            now = _clock_gettime(_CLOCK)
            if since is not None and now - since > PAUSE_S and not self._stop.is_set():
                return False
            self.last = math.inf if self._stop.is_set() else now  # (stopped: nothing watches any more)
            self._cond.notify_all()
            waiters, self._loop_waiters = self._loop_waiters, []
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # (its loop closed meanwhile)
                loop.call_soon_threadsafe(_resolve, fut)
        return True


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
