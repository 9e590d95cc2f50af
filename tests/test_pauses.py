"""A process paused (SIGSTOP) and replaced meanwhile serves nothing and sends nothing once it runs
again (transport.pauses); one paused but not replaced goes on as before.

Real processes (tests._remote), real sockets, a real TCPStore; every wait bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint, wait_stopped
from transport.pauses import _BOUND_S, PAUSE_S

pytestmark = pytest.mark.timeout(120)

_SERVE = ("import time; from torch.distributed import TCPStore; "
          "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
          "print(s.port, flush=True); time.sleep(600)")


@pytest.fixture
def store_proc():
    """A TCPStore served by a process of its own (the test stops it): (the process, its URL)."""
    p = subprocess.Popen([sys.executable, "-c", _SERVE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline())
        yield p, f"tcp://127.0.0.1:{port}"
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait(10)
        p.stdout.close()


def _full(value: int) -> torch.Tensor:
    return torch.full((16,), value, dtype=torch.uint8)


@contextlib.asynccontextmanager
async def _a_with_y(uname, url: str, timeout: float) -> AsyncIterator[tuple[transport.Endpoint, torch.Tensor]]:
    """A (tcp only: a put's bytes wait in the target's socket), with a zeroed buffer ``y``."""
    async with transport.Endpoint(uname("a"), store=url, timeout=timeout, planes=("tcp",)) as a:
        y = torch.zeros(16, dtype=torch.uint8)
        a.register("y", y)
        yield a, y


async def _talking(a: transport.Endpoint, name: str, url: str) -> tuple[RemoteEndpoint, list]:
    """B1 under ``name`` (store ``url``), with a buffer ``x`` A put 1s into: B1, and the ops it served."""
    b1 = RemoteEndpoint(name, store=url, timeout=30, commands="tests._lifecycle_remote")
    try:
        b1.call("register", "x", "uint8", [16])
        await a.put(name, {"x": _full(1)}, timeout=10)
        return b1, b1.call("served")
    except BaseException:
        b1.kill()
        raise


async def _pause(b1: RemoteEndpoint) -> None:
    b1.signal(signal.SIGSTOP)
    await asyncio.to_thread(wait_stopped, b1.pid, 10)


async def test_a_paused_process_replaced_meanwhile_serves_and_sends_nothing_once_it_runs_again(store_url, uname):
    """B1 is paused with a put and a notification of A's queued in its socket (tcp: the bytes wait
    there too) and a put of its own queued for its application (a command), and replaced by B2
    (published) meanwhile. Run again, B1 asks the store before it serves or sends anything, finds
    B2, tells A why and closes: A's put and notification fail saying B1 was replaced, B1 served
    neither (its buffer, its flight recorder), its own put fails and A's buffer holds nothing of it;
    A's next put reaches B2. (B1 served both once it ran, before A's check after the silence: A's put
    was reported done into a process nobody reads from, and B1's stale bytes landed in A's buffer.)"""
    name = uname("b")
    async with _a_with_y(uname, store_url, 30) as (a, y):
        b1, served = await _talking(a, name, store_url)
        b2 = None
        try:
            await _pause(b1)
            try:
                ops = [asyncio.ensure_future(a.put(name, {"x": _full(7)}, timeout=30)),
                       asyncio.ensure_future(a.notify(name, b"for the live process", timeout=30))]
                own = asyncio.ensure_future(asyncio.to_thread(b1.call, "put_error", a.name, "y", 16, 5, 20.0))
                b2 = await asyncio.to_thread(RemoteEndpoint, name, store=store_url, timeout=30,
                                             commands="tests._lifecycle_remote")
                b2.call("register", "x", "uint8", [16])
                await asyncio.sleep(PAUSE_S + 0.5)
            finally:
                b1.signal(signal.SIGCONT)
            for result in await asyncio.wait_for(asyncio.gather(*ops, return_exceptions=True), 30):
                assert isinstance(result, transport.PeerLostError) and "replaced" in str(result), repr(result)
            err = await asyncio.wait_for(own, 30)
            assert err is not None and "EndpointClosedError" in err and "replaced" in err, err
            assert torch.equal(y, torch.zeros(16, dtype=torch.uint8)), f"B1's stale put landed in A's buffer: {y}"
            assert b1.call("all_equal", "x", 0, 16, 1), "B1 served A's put once it ran again"
            assert b1.call("served") == served, "B1 served an op once it ran again"
            end = time.monotonic() + 10
            while (state := b1.call("pause_state"))["open"] and time.monotonic() < end:
                await asyncio.sleep(0.05)
            assert not state["open"] and state["checks"] >= 1, state
            await a.put(name, {"x": _full(9)}, timeout=10)
            assert a.peer(name).incarnation == b2.incarnation
            assert b2.call("all_equal", "x", 0, 16, 9)
        finally:
            b1.kill()
            if b2 is not None:
                b2.kill()


async def test_a_paused_process_not_replaced_asks_the_store_and_goes_on(store_url, uname):
    """B1 is paused past PAUSE_S with a put of A's queued in its socket and one of its own queued;
    nobody replaced it. Run again, it asks the store once, which names it, and both puts land; its
    endpoint stays open."""
    name = uname("b")
    async with _a_with_y(uname, store_url, 30) as (a, y):
        b1, _ = await _talking(a, name, store_url)
        try:
            checks = b1.call("pause_state")["checks"]
            await _pause(b1)
            try:
                put = asyncio.ensure_future(a.put(name, {"x": _full(7)}, timeout=30))
                own = asyncio.ensure_future(asyncio.to_thread(b1.call, "put_error", a.name, "y", 16, 5, 20.0))
                await asyncio.sleep(PAUSE_S + 0.5)
            finally:
                b1.signal(signal.SIGCONT)
            await asyncio.wait_for(put, 30)
            assert await asyncio.wait_for(own, 30) is None
            assert b1.call("all_equal", "x", 0, 16, 7) and torch.equal(y, _full(5))
            state = b1.call("pause_state")
            assert state["open"] and state["checks"] >= checks + 1, state
        finally:
            b1.kill()


async def test_a_pause_while_the_watch_waits_for_the_store_is_checked_again(store_proc, uname):
    """B1 is paused; run again, its watch asks the store, which is slow (stopped). While that look-up
    is out, B1 is paused again; A queues a put for B1, B2 replaces B1, then B1 runs again. The
    answer to the first look-up (or its time-out, 'no answer') predates B2: the watch asks again, finds
    B2, and B1 serves nothing. (The watch let go on the stale answer and B1 served A's put, 3 runs
    in 3; found by a review.)"""
    store, url = store_proc
    name = uname("b")
    async with transport.Endpoint(uname("a"), store=url, timeout=30, planes=("tcp",)) as a:
        b1, served = await _talking(a, name, url)
        b2 = None
        try:
            checks = b1.call("pause_state")["checks"]
            await _pause(b1)
            await asyncio.sleep(PAUSE_S + 0.5)
            os.kill(store.pid, signal.SIGSTOP)
            await asyncio.to_thread(wait_stopped, store.pid, 10)
            b1.signal(signal.SIGCONT)
            end = time.monotonic() + 5  # (B1's watch noticed the pause: its look-up waits for the store)
            while (st := await asyncio.to_thread(b1.call, "pause_state"))["checks"] == checks:
                assert time.monotonic() < end, st
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            await _pause(b1)  # paused again, its look-up out
            os.kill(store.pid, signal.SIGCONT)
            put = asyncio.ensure_future(a.put(name, {"x": _full(7)}, timeout=30))
            b2 = await asyncio.to_thread(RemoteEndpoint, name, store=url, timeout=30,
                                         commands="tests._lifecycle_remote")
            await asyncio.sleep(PAUSE_S + 1.0)
            b1.signal(signal.SIGCONT)
            res = (await asyncio.gather(asyncio.wait_for(put, 30), return_exceptions=True))[0]
            assert isinstance(res, transport.PeerLostError) and "replaced" in str(res), repr(res)
            assert b1.call("served") == served, "B1 served A's put after its second pause"
        finally:
            b1.kill()
            if b2 is not None:
                b2.kill()


async def test_a_frame_the_event_loop_reads_after_a_pause_waits_for_the_check_too(store_url, uname):
    """B1's notify waits for a credit of A's (A holds B1's first, untaken: a window of 1) when B1
    is paused; B1's event loop reads its socket (an op of its waits for its answer). A's application
    takes the first (a Credit goes to B1's socket), B2 replaces B1, B1 runs again. The loop leaves
    the Credit to the reader thread, which waits for the store's answer: the waiting notify never
    goes out, it fails, and A delivers nothing more from B1. (The loop read the Credit at once and
    A delivered B1's stale notification, 4 runs in 5; found by a review.)"""
    name = uname("b")
    async with transport.Endpoint(uname("a"), store=store_url, timeout=30, planes=("tcp",),
                                  max_pending_notifications=1) as a:
        b1 = RemoteEndpoint(name, store=store_url, timeout=30, commands="tests._lifecycle_remote")
        b2 = None
        try:
            await asyncio.to_thread(b1.call, "notify", a.name, b"one")
            b1.start("notify_after", a.name, b"two", 0.0, 30.0)  # waits for a credit
            await asyncio.sleep(0.5)
            await _pause(b1)
            try:
                assert (await a.next_notification(5)).payload == b"one"
                b2 = await asyncio.to_thread(RemoteEndpoint, name, store=store_url, timeout=30,
                                             commands="tests._lifecycle_remote")
                await asyncio.sleep(PAUSE_S + 0.5)
            finally:
                b1.signal(signal.SIGCONT)
            with pytest.raises(transport.TransportTimeoutError):
                stale = await a.next_notification(3)
                pytest.fail(f"A delivered B1's stale notification: {stale}")
            err = await asyncio.to_thread(b1.result, 30)
            assert isinstance(err, str) and "EndpointClosedError" in err and "replaced" in err, err
        finally:
            b1.kill()
            if b2 is not None:
                b2.kill()


async def test_waiters_count_their_bound_afresh_after_a_second_pause(store_proc, uname):
    """B1 is paused with a put of A's in its socket and a put of its own queued; it runs again while
    the store is slow (stopped): its reader waits in settle() with A's put, its own put in settled().
    Paused again, longer than the waiters' bound (on a clock that runs while the process is
    stopped), and replaced meanwhile, it runs again: the watch asks again and the waiters wait for
    that answer too; B1 serves nothing and sends nothing. (The waiters' bound had run out: B1 served
    A's put and its own stale put landed in A's buffer, 2 runs in 2; found by a second review.)"""
    store, url = store_proc
    name = uname("b")
    bound = _BOUND_S
    async with _a_with_y(uname, url, 60) as (a, y):
        b1, served = await _talking(a, name, url)
        b2 = None
        try:
            await _pause(b1)
            put = asyncio.ensure_future(a.put(name, {"x": _full(7)}, timeout=60))
            own = asyncio.ensure_future(asyncio.to_thread(b1.call, "put_error", a.name, "y", 16, 5, 60.0))
            await asyncio.sleep(PAUSE_S + 0.5)
            os.kill(store.pid, signal.SIGSTOP)
            await asyncio.to_thread(wait_stopped, store.pid, 10)
            b1.signal(signal.SIGCONT)
            t0 = time.monotonic()
            await asyncio.sleep(0.5)  # (its watch asks the slow store; the reader and the op wait)
            await _pause(b1)  # paused again, the look-up out
            os.kill(store.pid, signal.SIGCONT)
            b2 = await asyncio.to_thread(RemoteEndpoint, name, store=url, timeout=60,
                                         commands="tests._lifecycle_remote")
            await asyncio.sleep(max(PAUSE_S + 0.5, t0 + bound + 1.0 - time.monotonic()))
            b1.signal(signal.SIGCONT)
            res = (await asyncio.gather(asyncio.wait_for(put, 30), return_exceptions=True))[0]
            err = await asyncio.wait_for(own, 30)
            assert torch.equal(y, torch.zeros(16, dtype=torch.uint8)), f"B1's stale put landed in A's buffer: {y}"
            assert b1.call("served") == served, "B1 served A's put after its second pause"
            assert isinstance(res, transport.PeerLostError) and "replaced" in str(res), repr(res)
            assert err is not None and "replaced" in err, err
        finally:
            b1.kill()
            if b2 is not None:
                b2.kill()


async def test_a_pause_right_after_the_store_answered_is_checked(store_url, uname):
    """B1 is paused with a put of A's in its socket. Run again, its watch asks the store, which
    names B1; right then B1 is paused again (by its watch thread itself, at its INFO record: a real
    SIGSTOP after the last clock read of the look-up) and replaced meanwhile. Run again, the watch
    asks again and B1 serves nothing. (It let the waiters go on the answer that predated B2, and B1
    served A's put, 3 runs in 3; found by a second review.)"""
    name = uname("b")
    async with transport.Endpoint(uname("a"), store=store_url, timeout=60, planes=("tcp",)) as a:
        b1, served = await _talking(a, name, store_url)
        b2 = None
        try:
            b1.call("stop_self_on_answer")
            await _pause(b1)
            put = asyncio.ensure_future(a.put(name, {"x": _full(7)}, timeout=60))
            await asyncio.sleep(PAUSE_S + 0.5)
            b1.signal(signal.SIGCONT)
            await asyncio.to_thread(wait_stopped, b1.pid, 10)  # (it stopped itself, right after the answer)
            b2 = await asyncio.to_thread(RemoteEndpoint, name, store=store_url, timeout=60,
                                         commands="tests._lifecycle_remote")
            await asyncio.sleep(PAUSE_S + 0.5)
            b1.signal(signal.SIGCONT)
            res = (await asyncio.gather(asyncio.wait_for(put, 30), return_exceptions=True))[0]
            assert b1.call("served") == served, "B1 served A's put after a pause the watch never checked"
            assert isinstance(res, transport.PeerLostError) and "replaced" in str(res), repr(res)
        finally:
            b1.kill()
            if b2 is not None:
                b2.kill()
