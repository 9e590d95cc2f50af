"""Hostile review (2) of notification credits (protocol 8): rl_sync on top, BlockingEndpoint,
restarts, long runs, the stale-retry stamp. Real sockets (and real processes where a peer must
die or freeze); every wait bounded."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

import transport
from tests._remote import RemoteEndpoint


def _ch(ep: transport.Endpoint, peer: str):
    return ep._connector.channels[peer]


@pytest.mark.timeout(60)
async def test_timed_out_notifies_to_a_peer_holding_its_credits_leave_no_waiter_futures(store_url, uname):
    """A notify that times out waiting for a credit (the peer's application is not reading) cancels
    its wait: its future must leave NoteCredits._waiters. Failed before: each timed-out wait left a
    cancelled future there until a credit came back, so a caller polling a stuck peer with short
    timeouts grew the deque without bound."""
    async with transport.Endpoint(uname("rx"), store=store_url, planes=("tcp",), timeout=10,
                                  max_pending_notifications=1) as rx:
        async with transport.Endpoint(uname("tx"), store=store_url, planes=("tcp",), timeout=10) as tx:
            await tx.notify(rx.name, b"first")  # spends the only credit; rx's application never takes it
            ch = _ch(tx, rx.name)
            timeouts = 0
            for _ in range(500):
                with pytest.raises(transport.TransportTimeoutError):
                    await tx.notify(rx.name, b"more", timeout=0.002)
                timeouts += 1
            waiters = len(ch.credits._waiters)
            assert waiters <= 2, f"{waiters} waiter futures left in NoteCredits._waiters after {timeouts} timed-out notifies"


@pytest.mark.timeout(180)
async def test_window_of_one_20000_notifications_and_posts_no_drift_no_leftovers(store_url, uname):
    """Window 1, 20,000 notifications (notify, post, put-with-notify interleaved) taken one at a
    time by the peer's application: every one arrives, in order; at the end the sender's credits
    are whole again (no drift), nothing is parked, no waiter future is left behind, and the
    receiver's counts match what it took."""
    import torch

    n = 20_000
    async with transport.Endpoint(uname("rx"), store=store_url, planes=("tcp",), timeout=30,
                                  max_pending_notifications=1) as rx:
        rx.register("buf", torch.zeros(64, dtype=torch.uint8))
        async with transport.Endpoint(uname("tx"), store=store_url, planes=("tcp",), timeout=30,
                                      max_pending_notifications=1) as tx:
            got: list[bytes] = []

            async def read() -> None:
                while len(got) < n:
                    got.append((await rx.next_notification(30)).payload)

            reader = asyncio.create_task(read())
            src = torch.ones(64, dtype=torch.uint8)
            t0 = time.monotonic()
            for i in range(n):
                p = i.to_bytes(4, "little")
                k = i % 3
                if k == 0:
                    await tx.post(rx.name, p)
                elif k == 1:
                    await tx.notify(rx.name, p)
                else:
                    await tx.put(rx.name, {"buf": src}, notify=p)
            await asyncio.wait_for(reader, 60)
            took = time.monotonic() - t0
            assert [int.from_bytes(g, "little") for g in got] == list(range(n))
            c = _ch(tx, rx.name).credits
            r = _ch(rx, tx.name).credits
            end = time.monotonic() + 10  # (the last Credit frames: our reader counts them as they come)
            while c._sent - c._returned - c._refunded and time.monotonic() < end:
                await asyncio.sleep(0.02)
            outstanding = c._sent - c._returned - c._refunded
            assert outstanding == 0, (c._sent, c._returned, c._refunded)
            assert c.parked == 0 and c.pump is None
            assert len(c._waiters) <= 1, len(c._waiters)
            assert r._in == n and r._taken == n and r._told == n, (r._in, r._taken, r._told)
            print(f"\n20000 notifications at window 1 in {took:.1f} s")


@pytest.mark.timeout(120)
async def test_peer_restarted_under_its_name_gets_nothing_parked_for_its_old_incarnation(store_url, uname):
    """Posts parked for credits and a notify waiting for one, on the channel to a
    peer (window 1, its application not reading) that is frozen, then killed and restarted under
    its name: the waiting ops fail (lost peer), the parked posts are dropped, and the new
    incarnation gets only what was sent to it, starting with a whole window of its own."""
    name = uname("rx")
    kw = {"store": store_url, "timeout": 20, "planes": ("tcp",), "max_pending_notifications": 1}
    old = RemoteEndpoint(name, **kw)
    new = None
    try:
        async with transport.Endpoint(uname("tx"), store=store_url, planes=("tcp",), timeout=20) as tx:
            for i in range(10):
                await asyncio.wait_for(tx.post(name, b"old-%d" % i), 5)  # 1 sent, 9 parked
            ch = _ch(tx, name)
            assert ch.credits.parked == 9
            waiting = [asyncio.create_task(tx.notify(name, b"old-notify", timeout=30))]
            await asyncio.sleep(0.2)
            old.signal(signal.SIGSTOP)
            old.kill()
            new = RemoteEndpoint(name, **kw)
            done, _ = await asyncio.wait(waiting, timeout=15)
            assert len(done) == len(waiting), "ops waiting for a credit of the dead incarnation still wait"
            for t in done:
                assert isinstance(t.exception(), transport.PeerLostError), repr(t.exception())
            assert ch.credits.parked == 0
            new.start("notifications", 2, 10.0)  # (window 1: it reads while we send)
            await asyncio.wait_for(tx.post(name, b"new-0"), 10)
            await asyncio.wait_for(tx.notify(name, b"new-1"), 10)
            got = await asyncio.to_thread(new.result, 15)
            assert [p for _, p in got] == [b"new-0", b"new-1"], got
            with pytest.raises(Exception, match="TransportTimeoutError"):
                await asyncio.to_thread(new.call, "notifications", 1, 1.0)
            nch = _ch(tx, name)
            assert nch is not ch and nch.credits._sent == 2 and nch.credits._returned >= 1 and nch.credits.parked == 0
    finally:
        old.kill()
        if new is not None:
            new.kill()


@pytest.mark.timeout(120)
def test_blocking_endpoint_threads_post_and_notify_into_a_full_window_then_close(store_url, uname):
    """BlockingEndpoint: threads post (parked: they return at once) and notify (waiting for a
    credit) to a peer whose application reads nothing (window 1); close() from the main thread
    returns within its bound, every notifying thread gets an error promptly (not its 30 s
    timeout), the pump task is gone, and every parked post's record ended (failed, dropped)."""
    from transport.blocking import BlockingEndpoint

    rx = RemoteEndpoint(uname("rx"), store=store_url, timeout=20, planes=("tcp",), max_pending_notifications=1)
    try:
        ep = BlockingEndpoint(uname("tx"), store=store_url, timeout=20, planes=("tcp",))
        errors: list[BaseException | None] = []
        posted = threading.Barrier(5)

        def poster(k: int) -> None:
            for i in range(10):
                ep.post(rx.name, b"p%d-%d" % (k, i), timeout=5)
            posted.wait(10)

        def notifier() -> None:
            try:
                ep.notify(rx.name, b"n", timeout=30)
                errors.append(None)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        posters = [threading.Thread(target=poster, args=(k,)) for k in range(4)]
        for t in posters:
            t.start()
        posted.wait(20)
        notifiers = [threading.Thread(target=notifier) for _ in range(3)]
        for t in notifiers:
            t.start()
        time.sleep(0.3)
        ch = ep.call_in_loop(lambda: _ch(ep.endpoint, rx.name))
        parked = ep.call_in_loop(lambda: ch.credits.parked)
        assert parked == 39, parked
        rec = ep.endpoint.recorder
        t0 = time.monotonic()
        ep.close(timeout=2.0)
        took = time.monotonic() - t0
        for t in notifiers + posters:
            t.join(10)
        assert not any(t.is_alive() for t in notifiers), "a notify waiting for a credit outlived close()"
        assert took < 2.0 + 3.0, f"close took {took:.1f} s"
        assert len(errors) == 3 and all(isinstance(e, transport.TransportError) for e in errors), errors
        assert ch.credits.pump is None and ch.credits.parked == 0
        posts = [r for r in rec.snapshot() if r["kind"] == "post" and r["role"] == "initiator"]
        assert len(posts) == 40, len(posts)
        unended = [r for r in posts if r["state"] in ("posted", "sent")]
        assert not unended, f"{len(unended)} parked posts' records never ended: {unended[:2]}"
    finally:
        rx.kill()


# ---------------------------------------------------------------------------- rl_sync on top, small windows
RL_SPEC = {f"layers.{i}.weight": ("bfloat16", (256, 1024)) for i in range(6)}  # 3 MiB, 6 buckets of 512 KiB
RL_TRAIN = {n: ("float32", sh) for n, (_, sh) in RL_SPEC.items()}


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("mode", "fanout"), [("staged", "chain"), ("swap", "direct")])
async def test_rl_sync_windows_of_one_frozen_generator_across_pushes_holds_up_nobody(store_url, uname, mode, fanout):
    """Trainer and four generators all with max_pending_notifications=1 (every rl_sync message
    waits for the previous one's credit): pushes succeed; one generator frozen (SIGSTOP) across
    three pushes (its Begins, Pulls and Aborts park at the trainer) never holds up the others, each
    push returns by its timeout, and once it is let go (its parked messages of dead pushes flushed
    to it) it holds exactly some version's bytes, and the next push reaches everyone."""
    import rl_sync
    from tests._rl_remote import seeded

    kw = {"store": store_url, "timeout": 20, "heartbeat_timeout": 30.0, "max_pending_notifications": 1}
    gens = []
    try:
        for i in range(4):
            g = RemoteEndpoint(uname(f"gen{i}"), **kw)
            gens.append(g)
            g.call("sub_create", RL_SPEC, {"mode": mode})
        async with transport.Endpoint(uname("trainer"), store=store_url, timeout=20,
                                      max_pending_notifications=1) as ep:
            pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], dtype="auto", bucket_bytes=512 << 10,
                                          fanout=fanout)
            version, normal = 0, []
            for _ in range(3):
                version += 1
                report = await asyncio.wait_for(pub.push(seeded(RL_TRAIN, version), version, timeout=30), 40)
                assert report.ok, report.summary()
                normal.append(max(r.seconds for r in report.results.values()))
            bound = 2 * max(normal[1:]) + 1.0
            timeout = max(3.0, bound + 1.0)
            victim = gens[1]
            victim.signal(signal.SIGSTOP)
            frozen_at = version
            for _ in range(3):
                version += 1
                w = seeded(RL_TRAIN, version)
                t0 = time.monotonic()
                report = await asyncio.wait_for(pub.push(w, version, timeout=timeout), timeout + 10)
                wall = time.monotonic() - t0
                healthy = [report.results[g.name] for g in gens if g is not victim]
                assert all(r.ok for r in healthy), report.summary()
                assert all(r.seconds <= bound for r in healthy), (bound, report.summary())
                assert wall <= timeout + 1.5, (wall, timeout, report.summary())
                assert not report.results[victim.name].ok
            victim.signal(signal.SIGCONT)
            await asyncio.sleep(1.0)
            v, ok = await asyncio.to_thread(victim.call, "sub_check_held", RL_TRAIN, timeout=60)
            assert ok and frozen_at <= v <= version, (v, ok, frozen_at, version)
            version += 1
            report = await asyncio.wait_for(pub.push(seeded(RL_TRAIN, version), version, timeout=30), 40)
            assert report.ok, report.summary()
            for g in gens:
                v, ok = await asyncio.to_thread(g.call, "sub_check_held", RL_TRAIN, timeout=60)
                assert ok and v == version, (g.name, v, ok)
    finally:
        for g in gens:
            g.kill()


# ---------------------------------------------------------------------------- the stale retry's stamp
@pytest.mark.timeout(120)
@pytest.mark.parametrize("notify", [False, True])
async def test_sequential_puts_during_re_registration_churn_are_retried_never_raise_stale(store_url, uname, notify):
    """Puts awaited one at a time (nothing else called on the channel) while the target takes its
    buffer back and registers a fresh one every 5 ms (tcp: the target refuses a stale header): each
    refused put is retried (its stamp did not move), so none raises StaleBufferError; with a
    notification (a window that outlasts the run: the target reads nothing), the same."""
    import torch

    tgt = RemoteEndpoint(uname("tgt"), store=store_url, timeout=20, planes=("tcp",), max_pending_notifications=1_000_000)
    try:
        tgt.call("register", "w", "uint8", (1 << 16,))
        async with transport.Endpoint(uname("src"), store=store_url, planes=("tcp",), timeout=20) as ep:
            src = torch.ones(1 << 16, dtype=torch.uint8)
            await ep.put(tgt.name, {"w": src})
            tgt.start("churn", "w", 200, 0.005, 1 << 16)
            churn = asyncio.ensure_future(asyncio.to_thread(tgt.result, 60))
            stale = ok = gap = 0
            while not churn.done():
                try:
                    await ep.put(tgt.name, {"w": src}, notify=b"n" if notify else None, timeout=10)
                    ok += 1
                except transport.StaleBufferError:
                    stale += 1
                except transport.UnknownBufferError:  # (the target's reader saw the gap between take-back and register)
                    gap += 1
                await asyncio.sleep(0)
            await churn
            ch = _ch(ep, tgt.name)
            c = ch.credits
            refused = sum(1 for r in ep.recorder.snapshot() if r["kind"] == "put" and r["state"] == "failed")
            assert stale == 0, f"{stale} sequential puts raised StaleBufferError ({ok} ok, {refused} refused)"
            if notify:  # every notification that was not refused was delivered, and nothing is left owed
                await asyncio.sleep(0.3)
                assert c.parked == 0 and not c._waiters
            print(f"\n  {ok} puts ok, {gap} in the registration gap, {refused} refused first tries")
    finally:
        tgt.kill()
