"""An endpoint's notification queue (transport.inbox): waiting for a notification never loses one.

What must hold, for :meth:`Endpoint.next_notification` and :meth:`Endpoint.notifications`:
- a wait that is cancelled or times out takes nothing: every notification is read exactly once,
  in the order it was sent, by whichever wait comes next, however the waits end;
- a waiter cancelled after its notification was queued for it (woken, not yet run) passes it on
  to the next waiter instead of stranding it;
- many concurrent waiters each get a different notification; closing the endpoint wakes them all;
- waits that time out leave nothing behind (no growing list of dead waiters).
"""

from __future__ import annotations

import asyncio
import random

import pytest

import transport
from tests._remote import RemoteEndpoint
from transport.inbox import Inbox
from transport.peer import Notification


def _note(i: int) -> Notification:
    return Notification("peer", f"n{i}".encode())


class _Credits:
    """A channel's side of its queued notifications (what the inbox uses of
    transport.credits.NoteCredits): counts the credits given back, one per notification taken."""

    def __init__(self) -> None:
        self.given_back = 0

    def delivered(self) -> bool:
        return True

    def overflow(self) -> Exception:
        return AssertionError("never past its credits here")

    def taken(self) -> None:
        self.given_back += 1


@pytest.mark.timeout(60)
async def test_a_waiter_cancelled_after_its_wake_up_passes_the_notification_on():
    inbox = Inbox(16, lambda: True)
    inbox.attach(asyncio.get_running_loop())
    first = asyncio.ensure_future(inbox.next(10))
    second = asyncio.ensure_future(inbox.next(10))
    await asyncio.sleep(0)  # (both parked, first in line)
    assert len(inbox._waiters) == 2
    credits = _Credits()
    inbox._enqueue(_note(1), credits)  # wakes the first waiter ...
    first.cancel()  # ... which is cancelled before it runs
    got = await asyncio.wait_for(second, 5)
    assert got.payload == b"n1"
    with pytest.raises(asyncio.CancelledError):
        await first
    assert not inbox._waiters and not inbox._notes
    assert credits.given_back == 1  # (once, by the wait that took it)


@pytest.mark.timeout(60)
async def test_concurrent_waiters_each_get_one_and_close_wakes_the_rest():
    inbox = Inbox(64, lambda: True)
    inbox.attach(asyncio.get_running_loop())
    waiters = [asyncio.ensure_future(inbox.next(10)) for _ in range(8)]
    await asyncio.sleep(0)
    credits = _Credits()
    for i in range(5):
        inbox._enqueue(_note(i), credits)
    await asyncio.sleep(0.05)
    done = [w for w in waiters if w.done()]
    assert sorted(w.result().payload for w in done) == [f"n{i}".encode() for i in range(5)]
    assert [w.result().payload for w in waiters[:5]] == [f"n{i}".encode() for i in range(5)]  # (in the order they came)
    assert credits.given_back == 5
    inbox.close()
    for w in waiters[5:]:
        with pytest.raises(transport.EndpointClosedError):
            await asyncio.wait_for(w, 5)
    with pytest.raises(transport.EndpointClosedError):
        await inbox.next(1)


@pytest.mark.timeout(60)
async def test_waits_that_time_out_leave_nothing_behind():
    inbox = Inbox(4, lambda: True)
    inbox.attach(asyncio.get_running_loop())
    for _ in range(50):
        with pytest.raises(transport.TransportTimeoutError):
            await inbox.next(0.001)
    tasks = [asyncio.ensure_future(inbox.next(5)) for _ in range(20)]
    await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert not inbox._waiters
    credits = _Credits()
    inbox._enqueue(_note(7), credits)
    assert credits.given_back == 0
    assert (await inbox.next(1)).payload == b"n7"
    assert credits.given_back == 1


@pytest.mark.timeout(180)
async def test_waits_cut_short_lose_nothing_from_a_real_peer(store_url, uname):
    """A peer process notifies 300 times while we read with waits that time out, are cancelled
    (at random points) or complete: each notification is read once, in order."""
    b = RemoteEndpoint(uname("b"), store=store_url, timeout=10)
    try:
        async with transport.Endpoint(uname("a"), store=store_url, timeout=10) as ep:
            await ep.connect(b.name)
            count = 300
            sender = asyncio.ensure_future(asyncio.to_thread(
                lambda: [b.call("notify", ep.name, f"m{i}".encode(), timeout=10) for i in range(count)]))
            rng = random.Random(5)
            got: list[bytes] = []
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 120
            while len(got) < count and loop.time() < deadline:
                how = rng.random()
                if how < 0.3:
                    try:
                        got.append((await ep.next_notification(timeout=rng.choice((0.0001, 0.001, 0.01)))).payload)
                    except transport.TransportTimeoutError:
                        pass
                elif how < 0.6:
                    task = asyncio.ensure_future(ep.next_notification(timeout=5))
                    for _ in range(rng.randrange(4)):
                        await asyncio.sleep(0)
                    if rng.random() < 0.5:
                        await asyncio.sleep(rng.choice((0.0001, 0.001)))
                    task.cancel()
                    try:
                        got.append((await task).payload)  # (it completed before the cancel reached it)
                    except asyncio.CancelledError:
                        pass
                else:
                    got.append((await ep.next_notification(timeout=10)).payload)
            await asyncio.wait_for(sender, 60)
            assert got == [f"m{i}".encode() for i in range(count)]
            with pytest.raises(transport.TransportTimeoutError):
                await ep.next_notification(timeout=0.05)
            assert not ep._inbox._waiters
    finally:
        b.kill()
