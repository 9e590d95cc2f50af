"""CompletionBridge: blocking waits (CUDA events on a GPU) awaited from asyncio.

Here the waitables are gates that a test (or a timer thread) opens: they block in
``synchronize`` with the GIL released, like a blocking-sync CUDA event. ``tests/gpu`` runs the
same bridge on real CUDA events.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests._loop_probe import probe_wait
from transport.completion import CompletionBridge, CompletionError
from transport.errors import EndpointClosedError


class Gate:
    """Completes when opened; ``synchronize`` sleeps (GIL released) until then."""

    def __init__(self, fail: str | None = None) -> None:
        self._ev = threading.Event()
        self._fail = fail
        self.synced = threading.Event()  # synchronize() returned

    def open(self) -> None:
        self._ev.set()

    def query(self) -> bool:
        if self._ev.is_set() and self._fail:
            raise RuntimeError(self._fail)
        return self._ev.is_set()

    def synchronize(self) -> None:
        self._ev.wait(30)
        self.synced.set()
        if self._fail:
            raise RuntimeError(self._fail)


def open_later(gate: Gate, seconds: float) -> None:
    threading.Timer(seconds, gate.open).start()


@pytest.fixture
async def bridge():
    b = CompletionBridge(asyncio.get_running_loop(), name="test-bridge")
    yield b
    b.close(2.0)


async def test_loop_keeps_serving_and_no_core_spins_during_a_long_wait(bridge):
    gate = Gate()
    open_later(gate, 0.6)
    cpu, wall, ticks = await probe_wait(bridge.wait(gate), timeout=10)
    assert wall >= 0.55
    assert ticks >= 20, f"the loop served only {ticks} ticks of 10 ms in {wall:.2f} s"
    # a spinning waiter would use ~one core for the whole wait
    assert cpu < 0.5 * wall, f"{cpu:.2f} s of CPU during a {wall:.2f} s wait"


async def test_already_complete_needs_no_thread(bridge):
    gate = Gate()
    gate.open()
    fut = bridge.wait(gate)
    assert fut.done() and fut.exception() is None
    assert not gate.synced.is_set()


async def test_waits_complete_in_submission_order(bridge):
    gates = [Gate() for _ in range(5)]
    order: list[int] = []
    futs = [bridge.wait(g) for g in gates]
    for i, f in enumerate(futs):
        f.add_done_callback(lambda _f, i=i: order.append(i))
    # open them in reverse: a later one must still not be reported before an earlier one
    for g in reversed(gates):
        g.open()
    async with asyncio.timeout(10):
        await asyncio.gather(*futs)
    assert order == [0, 1, 2, 3, 4]


async def test_failed_work_fails_that_wait_only(bridge):
    bad, good = Gate(fail="illegal memory access"), Gate()
    f_bad, f_good = bridge.wait(bad), bridge.wait(good)
    bad.open()
    good.open()
    async with asyncio.timeout(10):
        with pytest.raises(CompletionError, match="illegal memory access"):
            await f_bad
        await f_good
    late = Gate()
    late.open()
    assert bridge.wait(late).done()  # the bridge goes on


async def test_cancelled_waiter_leaves_the_bridge_usable(bridge):
    slow = Gate()
    task = asyncio.create_task(asyncio.wait_for(bridge.wait(slow), 0.1))
    with pytest.raises(TimeoutError):
        await task
    nxt = Gate()
    f = bridge.wait(nxt)
    nxt.open()
    await asyncio.sleep(0.05)
    assert not f.done(), "a later wait was reported before the earlier, still running one"
    slow.open()  # the thread waited for it even though nobody awaits it any more
    async with asyncio.timeout(10):
        await f
    assert slow.synced.is_set()


async def test_close_fails_pending_waits_and_is_bounded(bridge):
    stuck, queued = Gate(), Gate()
    f1, f2 = bridge.wait(stuck), bridge.wait(queued)
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    bridge.close(timeout=0.2)  # the thread is blocked in stuck.synchronize(): close must not hang
    assert time.monotonic() - t0 < 1.0
    async with asyncio.timeout(5):
        for f in (f1, f2):
            with pytest.raises(EndpointClosedError):
                await f
    g = Gate()
    g.open()
    with pytest.raises(EndpointClosedError):
        await bridge.wait(g)
    stuck.open()  # let the daemon thread finish
