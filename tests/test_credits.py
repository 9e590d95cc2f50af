"""Notification credits (transport.credits): each peer holds at most its ``max_pending_notifications``
of our notifications untaken; past that our notify waits (and times out saying why), our posts wait
here in order without holding up the caller, a refused notification gives its credit back, and a
peer that ignores its credits loses the channel. The receiver's reader never blocks on them: the
answers to its own ops arrive whatever the peer sends (the flood case: tests/test_core_hostile2.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch

import transport
from tests import _wire_peer as peer
from transport import wire


async def _payloads(ep: transport.Endpoint, n: int) -> list[bytes]:
    return [(await ep.next_notification(timeout=10)).payload for _ in range(n)]


async def test_a_peer_holds_exactly_its_window_and_the_next_notify_waits_for_a_taken_one(store_url, uname):
    """Window 4, nothing taken: four notifies complete, the fifth waits and times out saying it
    waited for a credit, never sent (the target received four); once the target took one, the
    next notify goes out at once; every notification arrives once, in order."""
    async with transport.Endpoint(uname("tgt"), store=store_url, planes=("tcp",), max_pending_notifications=4) as tgt:
        async with transport.Endpoint(uname("ini"), store=store_url, planes=("tcp",), timeout=10) as ini:
            for i in range(4):
                await asyncio.wait_for(ini.notify(tgt.name, b"n%d" % i), 5)
            assert ini.peers[tgt.name].notify_credits == (0, 4, 0)
            t0 = time.monotonic()
            with pytest.raises(transport.TransportTimeoutError, match="waited for a notification credit"):
                await ini.notify(tgt.name, b"never", timeout=0.5)
            assert 0.4 < time.monotonic() - t0 < 3.0
            late = asyncio.ensure_future(ini.notify(tgt.name, b"n4", timeout=10))
            await asyncio.sleep(0.3)
            assert not late.done(), "a fifth notification went out while the target held four untaken"
            assert await _payloads(tgt, 1) == [b"n0"]
            await asyncio.wait_for(late, 5)  # (the taken one's credit came back)
            assert await _payloads(tgt, 4) == [b"n1", b"n2", b"n3", b"n4"]
            received = [r for r in tgt.recorder.snapshot() if r["role"] == "target" and r["kind"] == "notify"]
            assert len(received) == 5, "the timed-out notify reached the target"
            with pytest.raises(transport.TransportTimeoutError):
                await tgt.next_notification(timeout=0.3)


async def test_posts_past_the_window_return_at_once_and_go_out_in_order_before_later_ops(store_url, uname):
    """Window 2, nothing taken: 50 posts each return at once (waiting here for credits); a put
    called after them waits behind them, and a notify too; as the target takes them, all 50
    arrive in order, then the notify, and the put's bytes landed."""
    async with transport.Endpoint(uname("tgt"), store=store_url, planes=("tcp",), max_pending_notifications=2) as tgt:
        tgt.register("w", torch.zeros(4))
        async with transport.Endpoint(uname("ini"), store=store_url, planes=("tcp",), timeout=20) as ini:
            await ini.connect(tgt.name)
            t0 = time.monotonic()
            for i in range(50):
                await asyncio.wait_for(ini.post(tgt.name, b"p%02d" % i), 1.0)
            assert time.monotonic() - t0 < 2.0
            assert not ini.post_nowait(tgt.name, b"x"), "post_nowait overtook posts waiting for credits"
            assert ini.peers[tgt.name].notify_credits == (0, 2, 48)
            put = asyncio.ensure_future(ini.put(tgt.name, {"w": torch.full((4,), 7.0)}))
            note = asyncio.ensure_future(ini.notify(tgt.name, b"after"))
            await asyncio.sleep(0.3)
            assert not put.done() and not note.done(), "an op overtook posts waiting for credits"
            got = await _payloads(tgt, 51)
            assert got == [b"p%02d" % i for i in range(50)] + [b"after"]
            await asyncio.wait_for(asyncio.gather(put, note), 10)
            assert bool((tgt._registry.get("w").tensor == 7.0).all())


async def test_close_gives_posts_waiting_for_credits_a_second_to_go_out(store_url, uname, caplog):
    """Window 2: 10 posts wait for credits when the poster closes while the target takes them
    (one per 20 ms): all 10 arrive. 10 more while nobody takes any: close returns within about
    its second, and the ones left are dropped with a warning."""
    async with transport.Endpoint(uname("tgt"), store=store_url, planes=("tcp",), max_pending_notifications=2) as tgt:
        ini = transport.Endpoint(uname("ini"), store=store_url, planes=("tcp",), timeout=10)
        await ini.open()
        for i in range(10):
            await ini.post(tgt.name, b"p%d" % i)

        async def take() -> list[bytes]:
            got = []
            for _ in range(10):
                got.append((await tgt.next_notification(timeout=10)).payload)
                await asyncio.sleep(0.02)
            return got

        taker = asyncio.ensure_future(take())
        await asyncio.wait_for(ini.close(), 10)
        assert await asyncio.wait_for(taker, 10) == [b"p%d" % i for i in range(10)]

        ini = transport.Endpoint(uname("ini2"), store=store_url, planes=("tcp",), timeout=10)
        await ini.open()
        for i in range(10):
            await ini.post(tgt.name, b"q%d" % i)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="transport.channel"):
            await asyncio.wait_for(ini.close(), 10)
        assert time.monotonic() - t0 < 3.0
        assert any("posts still waiting for notification credits: dropped" in r.getMessage() for r in caplog.records)
        assert await _payloads(tgt, 2) == [b"q0", b"q1"]


async def test_a_callback_gives_each_credit_back_as_it_runs(store_url, uname):
    """Notifications taken by a callback never fill the window: 40 notifies (window 2) all
    complete, one after another."""
    async with transport.Endpoint(uname("tgt"), store=store_url, planes=("tcp",), max_pending_notifications=2) as tgt:
        seen: list[bytes] = []
        tgt.on_notification(lambda note: seen.append(note.payload))
        async with transport.Endpoint(uname("ini"), store=store_url, planes=("tcp",), timeout=10) as ini:
            for i in range(40):
                await asyncio.wait_for(ini.notify(tgt.name, b"c%d" % i), 5)
        assert seen == [b"c%d" % i for i in range(40)]


async def test_refused_notifications_give_their_credits_back(store_url, uname):
    """Window 2: 6 puts with a notification into a buffer the target dropped are refused (the
    target queues nothing): each gives its credit back, so a notify afterwards still goes out."""
    async with transport.Endpoint(uname("tgt"), store=store_url, planes=("tcp",), max_pending_notifications=2) as tgt:
        tgt.register("w", torch.zeros(4))
        tgt.register("v", torch.zeros(4))
        async with transport.Endpoint(uname("ini"), store=store_url, planes=("tcp",), timeout=10) as ini:
            await ini.connect(tgt.name)
            tgt.unregister("w")
            refused = 0
            for _ in range(6):
                try:  # (the first is refused there; later ones may be refused here from the refreshed registry)
                    await ini.put(tgt.name, {"w": torch.ones(4)}, notify=b"lost", timeout=5)
                except transport.TransportError:
                    refused += 1
            assert refused == 6
            await asyncio.wait_for(ini.put(tgt.name, {"v": torch.ones(4)}, notify=b"v1"), 5)
            await asyncio.wait_for(ini.notify(tgt.name, b"n"), 5)
            assert await _payloads(tgt, 2) == [b"v1", b"n"]


async def test_a_notify_cancelled_while_it_waits_for_a_credit_is_never_sent(store_url, uname):
    """Window 1 held: a notify waiting for a credit is cancelled; after the target took the one
    it held, the next notify goes out, and the cancelled payload never arrives."""
    async with transport.Endpoint(uname("tgt"), store=store_url, planes=("tcp",), max_pending_notifications=1) as tgt:
        async with transport.Endpoint(uname("ini"), store=store_url, planes=("tcp",), timeout=10) as ini:
            await ini.notify(tgt.name, b"first")
            waiting = asyncio.ensure_future(ini.notify(tgt.name, b"cancelled"))
            await asyncio.sleep(0.2)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert await _payloads(tgt, 1) == [b"first"]
            await asyncio.wait_for(ini.notify(tgt.name, b"second"), 5)
            assert await _payloads(tgt, 1) == [b"second"]
            with pytest.raises(transport.TransportTimeoutError):
                await tgt.next_notification(timeout=0.3)


async def test_a_peer_that_ignores_its_credits_loses_the_channel(store_url, uname, caplog):
    """A hand-made peer granted 4 sends 200 posts without waiting: the endpoint queues at most
    twice its grant plus the slack, then closes the channel with a protocol error; it stays usable."""
    caplog.set_level(logging.ERROR, logger="transport.channel")
    async with transport.Endpoint(uname("tgt"), store=store_url, planes=("tcp",), max_pending_notifications=4) as tgt:
        s = await asyncio.to_thread(peer.handshaken, tgt.address, tgt._secret)
        try:
            frames = b"".join(wire.encode_frame(wire.Notify(i + 1, i + 1, b"flood", False)) for i in range(200))
            await asyncio.to_thread(s.sendall, frames)
            assert await asyncio.to_thread(peer.closed_by_peer, s, 10.0)
        finally:
            s.close()
        queued = 0
        while True:
            try:
                await tgt.next_notification(timeout=0.3)
            except transport.TransportTimeoutError:
                break
            queued += 1
        assert queued == 2 * 4 + 64, queued
        assert any("notifications its credits did not cover" in r.getMessage() for r in caplog.records)
        async with transport.Endpoint(uname("ini"), store=store_url, planes=("tcp",), timeout=10) as ini:
            await asyncio.wait_for(ini.notify(tgt.name, b"ok"), 5)
            assert await _payloads(tgt, 1) == [b"ok"]


def test_a_hello_granting_no_credit_is_refused(store_url, uname):
    """A peer whose Hello grants no notification credit is refused at the handshake."""
    with transport.BlockingEndpoint(uname("tgt"), store=store_url, planes=("tcp",)) as tgt:
        bad = peer.hello()
        bad.notify_window = 0
        s = peer.handshaken(tgt.address, tgt._ep._secret, bad)
        try:
            assert peer.closed_by_peer(s, 10.0)
        finally:
            s.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_max_pending_notifications_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_pending_notifications"):
        transport.Endpoint("x", store="tcp://127.0.0.1:1", max_pending_notifications=bad)



@pytest.mark.parametrize("n", [1024, 8 << 20], ids=["4KiB", "32MiB"])
async def test_a_stale_put_is_not_retried_behind_a_notify_called_after_it(store_url, uname, n):
    """shm: the target re-registered ``w`` after we cached its registry. A put with a
    notification into ``w`` and a notify called right after it (not awaited in between): the
    notify never arrives before the put's notification and bytes. The put's first try is refused
    as stale (at once for 4 KiB; 32 MiB, after its copy on a worker thread, the notify waiting
    behind it): retried, it keeps its place in the call order, or, where the notify was called
    before the refusal, it raises StaleBufferError (its retry would go out after the notify).
    Called alone, a stale put is still retried and lands in the new buffer."""
    async with transport.Endpoint(uname("tgt"), store=store_url, planes=("shm",)) as tgt:
        tgt.register("w", torch.zeros(n))
        seen: list[tuple[bytes, float]] = []
        tgt.on_notification(lambda note: seen.append((note.payload, float(tgt._registry.get("w").tensor[0]))))
        async with transport.Endpoint(uname("ini"), store=store_url, planes=("shm",), timeout=10) as ini:
            await ini.put(tgt.name, {"w": torch.ones(n)})  # (our copy of its registry names the first export)
            raised = 0
            for value in (7.0, 8.0, 9.0):
                tgt.unregister("w")
                tgt.register("w", torch.zeros(n))
                seen.clear()
                put = asyncio.ensure_future(ini.put(tgt.name, {"w": torch.full((n,), value)}, notify=b"put"))
                note = asyncio.ensure_future(ini.notify(tgt.name, b"after"))
                results = await asyncio.wait_for(asyncio.gather(put, note, return_exceptions=True), 10)
                assert results[1] is None, results
                await asyncio.sleep(0.1)
                if isinstance(results[0], transport.StaleBufferError):
                    raised += 1
                    assert seen == [(b"after", 0.0)], seen
                else:
                    assert results[0] is None, results
                    assert seen == [(b"put", value), (b"after", value)], seen
            print(f"[credits] stale puts of {n * 4} B: {raised}/3 raised, {3 - raised}/3 retried in place")
            tgt.unregister("w")
            tgt.register("w", torch.zeros(n))
            await asyncio.wait_for(ini.put(tgt.name, {"w": torch.full((n,), 5.0)}, notify=b"alone"), 10)
            await asyncio.sleep(0.1)
            assert seen[-1] == (b"alone", 5.0)
