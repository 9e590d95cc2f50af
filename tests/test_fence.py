"""The fence between a peer's old channels and a new one (transport/fence.py): nothing an old
channel's reader still serves lands after an op of the new channel.

Found by a review: a put that timed out with its bytes still in the target's socket, then the
channel lost (the target frozen past the heartbeat bound), then a later put over a new channel:
the later put returned, and the target's old reader then served the first put's bytes over it."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint
from transport import connector as connector_mod
from transport.staging import StagingConfig, ThreadCopyEngine


@pytest.mark.parametrize("plane", ["tcp", "staged"])
async def test_a_timed_out_put_still_buffered_in_a_lost_channel_does_not_land_after_a_later_put(
        store_url, uname, plane):
    """README, "Cancellation and timeouts leave no writer behind": once a put raised (timeout),
    what of it still writes into the target's buffer is ordered before every later op; a put that
    follows returns only once the target holds exactly its bytes. Here the first put's bytes sit in
    the target's socket when the channel is lost; the next put dials a new channel and returns;
    the target's old reader (slowed down by 1.5 s per header) must not serve the first put after it."""
    n = 16 * 1024  # float32: 64 KiB, fits in the socket's buffers while the target is stopped
    # its pings keep the new channel alive at the initiator; its own bound (1 s) is shorter than the
    # fence's wait (the old reader's lag): the wait counts as traffic, or the new channel would be lost
    tkw: dict = {"planes": ("tcp",), "heartbeat_interval": 0.2, "heartbeat_timeout": 1.0}
    ikw: dict = {"planes": ("tcp",)}
    if plane == "staged":
        tkw["stage_cpu"] = True
        ikw["staging"] = StagingConfig(chunk_bytes=16 * 1024, buffers=2, cpu_engine=ThreadCopyEngine)
    t = RemoteEndpoint(uname("tgt"), store=store_url, **tkw)
    try:
        t.call("register", "w", "float32", (n,))
        async with transport.Endpoint(uname("ini"), store=store_url, timeout=10, heartbeat_interval=0.2,
                                      heartbeat_timeout=1.0, **ikw) as a:
            peer = await a.connect(t.name)
            first = peer.channel_id
            await a.put(t.name, {"w": torch.zeros(n)})
            t.call("lag", a.name, "_target.serve_put", 1.5)  # the old reader is slow to serve a header
            t.signal(signal.SIGSTOP)
            try:
                # its bytes are in the socket (PeerLostError: the heartbeat bound came first)
                with pytest.raises((transport.TransportTimeoutError, transport.PeerLostError)):
                    await a.put(t.name, {"w": torch.ones(n)}, timeout=0.3)
                end = time.monotonic() + 5
                while peer.connected:  # the frozen target misses its heartbeats: the channel is lost
                    assert time.monotonic() < end, "the channel was not lost"
                    await asyncio.sleep(0.05)
            finally:
                t.signal(signal.SIGCONT)
            await a.put(t.name, {"w": torch.full((n,), 2.0)}, timeout=15)  # over a new channel
            assert a.peer(t.name) is not None and a.peer(t.name).channel_id != first
            assert t.call("all_equal", "w", 0, n, 2.0), "the put that follows had not landed when it returned"
            await asyncio.sleep(2.5)  # (the old reader's lag is over)
            assert t.call("all_equal", "w", 0, n, 2.0), "the timed-out put's bytes landed after a later put"
    finally:
        t.stop()


async def test_an_old_reader_past_the_fence_bound_fails_the_new_channel_and_a_later_dial_gets_through(
        store_url, uname):
    """The old channel's reader still serves past the bound (here 1 s; its lag 3 s): the new channel
    is lost with PeerLostError, the target logging why (never a silent reorder, never a hang); once the old
    reader stopped, the next put dials again and lands, and nothing of the old channel lands after it."""
    n = 16 * 1024
    t = RemoteEndpoint(uname("tgt"), store=store_url, planes=("tcp",), heartbeat_interval=0.2)
    try:
        t.call("register", "w", "float32", (n,))
        t.call("fence_s", 1.0)
        async with transport.Endpoint(uname("ini"), store=store_url, timeout=10, heartbeat_interval=0.2,
                                      heartbeat_timeout=1.0, planes=("tcp",)) as a:
            peer = await a.connect(t.name)
            await a.put(t.name, {"w": torch.zeros(n)})
            t.call("lag", a.name, "_target.serve_put", 3.0)
            t.signal(signal.SIGSTOP)
            try:
                with pytest.raises((transport.TransportTimeoutError, transport.PeerLostError)):
                    await a.put(t.name, {"w": torch.ones(n)}, timeout=0.3)
                end = time.monotonic() + 5
                while peer.connected:
                    assert time.monotonic() < end, "the channel was not lost"
                    await asyncio.sleep(0.05)
            finally:
                t.signal(signal.SIGCONT)
            t0 = time.monotonic()
            with pytest.raises(transport.PeerLostError):  # (the target logs why: "... earlier channel ...")
                await a.put(t.name, {"w": torch.full((n,), 2.0)}, timeout=15)
            assert time.monotonic() - t0 < 5
            await asyncio.sleep(3.5)  # (the old reader served its put and stopped)
            await a.put(t.name, {"w": torch.full((n,), 3.0)}, timeout=15)
            assert t.call("all_equal", "w", 0, n, 3.0)
            await asyncio.sleep(1.0)
            assert t.call("all_equal", "w", 0, n, 3.0), "an old channel's put landed after a later put"
    finally:
        t.stop()


async def test_ops_moved_to_the_peers_other_channel_wait_for_the_ended_ones_reader(store_url, uname):
    """Two channels serve between the same pair (both sides dialled at once; here the second is
    dialled by hand). Ours (X) ends on our side with a timed-out put's bytes still in the target's
    socket, the target's reader of X lagging; our next put goes over the other channel (Y), behind a
    Lost frame naming X: the target breaks X and serves nothing more of Y before X's reader stopped,
    so the timed-out put never lands after the later one."""
    n = 16 * 1024
    t = RemoteEndpoint(uname("tgt"), store=store_url, planes=("tcp",))
    try:
        t.call("register", "w", "float32", (n,))
        async with transport.Endpoint(uname("ini"), store=store_url, timeout=10, planes=("tcp",)) as a:
            x_peer = await a.connect(t.name)
            await a.put(t.name, {"w": torch.zeros(n)})
            await a._connector._dial(t.name, time.monotonic() + 10)  # a second channel, as from a dial race
            x = next(ch for ch in a._all if ch.peer_name == t.name and ch.id == x_peer.channel_id)
            y = next(ch for ch in a._all if ch.peer_name == t.name and ch.id != x.id)
            assert a.peer(t.name).channel_id == x.id  # (our ops stay on X while it is open)
            t.call("lag", a.name, "_target.serve_put", 1.5)  # the target's reader of X is slow to serve
            with pytest.raises(transport.TransportTimeoutError):
                await a.put(t.name, {"w": torch.ones(n)}, timeout=0.3)  # its bytes are in X's socket
            x.lose(transport.PeerLostError("test: X lost on our side"))
            end = time.monotonic() + 5
            while a.peer(t.name) is None or a.peer(t.name).channel_id != y.id:
                assert time.monotonic() < end, "our ops did not move to Y"
                await asyncio.sleep(0.01)
            await a.put(t.name, {"w": torch.full((n,), 2.0)}, timeout=10)  # over Y
            assert t.call("all_equal", "w", 0, n, 2.0), "the put over Y had not landed when it returned"
            await asyncio.sleep(2.0)  # (X's reader's lag is over)
            assert t.call("all_equal", "w", 0, n, 2.0), "the timed-out put's bytes landed after a later put"
    finally:
        t.stop()


async def test_an_old_channel_adopted_by_the_acceptor_after_the_new_one_does_not_serve_after_it(
        store_url, uname, monkeypatch):
    """The dialler adopts a channel as soon as its half of the handshake is over and may send ops
    on it at once; the acceptor adopts it only after its own awaits (check_accepted's store look-up,
    the wait while it is still opening). Here the acceptor's adoption of the first channel C1 is
    held up (a slow store look-up, simulated: 3 s); the dialler's put on C1 times out, it loses C1
    (heartbeat bound) and dials C2 naming C1 in Hello.lost. The acceptor adopts C2 first: C1 is
    not among its channels yet, so nothing is broken or fenced, and C2 serves the second put; then
    the acceptor adopts C1, whose reader serves the first put over it."""
    n = 16 * 1024
    real = connector_mod.check_accepted
    calls = {"n": 0}
    target_name = uname("tgt")

    async def slow_first(ep, have, remote, deadline, **kw):
        if ep.name == target_name:
            calls["n"] += 1
            if calls["n"] == 1:
                await asyncio.sleep(3.0)  # (the first accepted channel's store look-up is slow)
        return await real(ep, have, remote, deadline, **kw)

    monkeypatch.setattr(connector_mod, "check_accepted", slow_first)
    w = torch.zeros(n)
    async with transport.Endpoint(target_name, store=store_url, planes=("tcp",), timeout=10,
                                  heartbeat_interval=0.2) as t:
        t.register("w", w)
        async with transport.Endpoint(uname("ini"), store=store_url, planes=("tcp",), timeout=10,
                                      heartbeat_interval=0.2, heartbeat_timeout=1.0) as a:
            peer = await a.connect(t.name)  # C1: adopted here; the target's adoption is held up
            first = peer.channel_id
            with pytest.raises((transport.TransportTimeoutError, transport.PeerLostError)):
                await a.put(t.name, {"w": torch.ones(n)}, timeout=0.3)
            end = time.monotonic() + 5
            while peer.connected:  # no pings from the target on C1: lost by the heartbeat bound
                assert time.monotonic() < end, "the channel was not lost"
                await asyncio.sleep(0.05)
            await a.put(t.name, {"w": torch.full((n,), 2.0)}, timeout=10)  # C2, naming C1 as lost
            assert a.peer(t.name) is not None and a.peer(t.name).channel_id != first
            assert bool((w == 2.0).all()), "the later put had not landed when it returned"
            await asyncio.sleep(3.0)  # (the target's adoption of C1 goes through meanwhile)
            assert bool((w == 2.0).all()), (
                f"the timed-out put over the old channel landed after a later put over the new one "
                f"(w[0] = {w[0].item()})")


async def test_a_replaced_incarnations_unrouted_channel_does_not_serve_after_the_new_incarnations(
        store_url, uname):
    """Both sides dialled at once (their first ops to each other): two channels serve, and each
    side's ops go over a different one: X1's over C_x, ours over C_y. X1 puts into our buffer over
    C_x while our reader of C_x is slow (2 s before a handler); the put times out; X1 then freezes
    and is replaced (X2: the same name's new incarnation, which dials us and puts). Adopting X2's
    channel we break our routed channel to X1 (C_y: adopt's ``old.lose``) and fence on its reader,
    but C_x, open to the replaced incarnation and not routed here, is neither broken nor fenced
    (fence_for breaks only channels of the new incarnation): its reader serves X1's put after X2's
    put returned."""
    n = 16 * 1024
    w = torch.zeros(n)
    served: list[str] = []
    lag = {"on": None}
    async with transport.Endpoint(uname("y"), store=store_url, planes=("tcp",), timeout=10,
                                  heartbeat_interval=0.2) as y:
        y.register("w", w)

        def watch(ch):
            serve = ch._target.serve_put

            def wrapped(msg):
                served.append(ch.id)
                if lag["on"] == ch.id:
                    time.sleep(2.0)
                serve(msg)
            ch._target.serve_put = wrapped

        # the crossing set up deterministically (simultaneous dials often give it, not always): X1 dials
        # first and routes its own C_x; our adoption of C_x is held up 1 s (setup only), so our own dial
        # C_y, made meanwhile, is our route; X1 accepts C_y while C_x is open and keeps C_x
        xname = uname("x")
        real = connector_mod.check_accepted
        hold = {"first": True}

        async def late_first(ep, have, remote, deadline, **kw):
            if ep is y and remote.name == xname and hold.pop("first", False):
                await asyncio.sleep(1.0)
            return await real(ep, have, remote, deadline, **kw)

        connector_mod.check_accepted = late_first
        try:
            x1 = RemoteEndpoint(xname, store=store_url, planes=("tcp",), heartbeat_interval=0.2)
            x1.start("connect", y.name)
            await asyncio.sleep(0.3)
            await y.connect(xname)
            await asyncio.to_thread(x1.result, 20)
            await asyncio.sleep(1.0)
        finally:
            connector_mod.check_accepted = real
        for ch in list(y._connector.all):
            if ch.peer_name == xname:
                watch(ch)
        await asyncio.to_thread(x1.call, "put", y.name, {"w": ("float32", (n,), 1)}, 10)
        assert served and served[-1] != y._connector.channels[xname].id, "no crossing"
        try:
            c_x = served[-1]  # the channel X1's ops go over (not our route)
            lag["on"] = c_x
            err = await asyncio.to_thread(x1.call, "put_error", y.name, {"w": ("float32", (n,), 2)}, 0.3)
            assert err.startswith(("TransportTimeoutError", "PeerLostError")), err
            x1.signal(signal.SIGSTOP)  # frozen, then replaced
            async with transport.Endpoint(xname, store=store_url, planes=("tcp",), timeout=10,
                                          heartbeat_interval=0.2) as x2:
                await x2.put(y.name, {"w": torch.full((n,), 2.0)}, timeout=10)
                assert bool((w == 2.0).all()), "the later put had not landed when it returned"
                await asyncio.sleep(2.5)  # (the slow reader of C_x is done)
                assert bool((w == 2.0).all()), (
                    "the replaced incarnation's timed-out put landed after the new incarnation's put")
        finally:
            x1.signal(signal.SIGCONT)
            x1.stop()


async def test_a_channel_accepted_after_our_route_ended_does_not_let_our_later_put_overtake_a_stale_one(
        store_url, uname, monkeypatch):
    """Both sides dialled at once: X's own dial A carries X's ops; Y's dial C is adopted by Y at once
    but X's acceptance of C is still finishing (its check_accepted look-up, held here until A ended).
    X's put over A times out with its bytes in Y's socket (Y's reader of A is slow: 1.5 s before it
    serves a put header); then A ends on X's side only (what X's heartbeat bound does: ``lose``).
    No other channel is open at X then, so ``Connector.closed`` sends no ``Lost``; X then adopts C,
    which becomes its route with nothing sent ahead of X's ops (C is the acceptor's channel here: no
    Hello of X names A, and Y's Hello of C, sent while A was open at Y, does not either). X's next put
    goes over C and returns; Y's reader of A, still open at Y, then serves the timed-out put over it.
    README: "once a put raised (timeout), what of it still writes into the target's buffer is ordered
    before every later op"."""
    from transport.errors import PeerLostError

    n = 16 * 1024
    w = torch.zeros(n)
    xname, yname = uname("x"), uname("y")
    release = asyncio.Event()
    real = connector_mod.check_accepted

    async def held(ep, have, remote, deadline, **kw):
        if ep.name == xname and remote.name == yname:
            await asyncio.wait_for(release.wait(), 10)  # (X's acceptance of C: a slow look-up)
        return await real(ep, have, remote, deadline, **kw)

    monkeypatch.setattr(connector_mod, "check_accepted", held)
    kw: dict = {"store": store_url, "planes": ("tcp",), "timeout": 10, "heartbeat_interval": 0.2}
    async with transport.Endpoint(yname, **kw) as y, transport.Endpoint(xname, **kw) as x:
        y.register("w", w)
        y_dial = asyncio.ensure_future(y.connect(xname))  # C (X's acceptance held)
        await asyncio.sleep(0.3)
        await asyncio.wait_for(x.connect(yname), 5)  # A: X's route
        await asyncio.wait_for(y_dial, 5)
        a_id = x._connector.channels[yname].id
        a_at_y = next(ch for ch in y._connector.all if ch.id == a_id)
        serve = a_at_y._target.serve_put

        def slow(msg):
            time.sleep(1.5)
            serve(msg)

        a_at_y._target.serve_put = slow
        with pytest.raises((transport.TransportTimeoutError, transport.PeerLostError)):
            await x.put(yname, {"w": torch.ones(n)}, timeout=0.3)  # its bytes sit in Y's socket of A
        x._connector.channels[yname].lose(PeerLostError("no traffic (as the heartbeat bound does)"))
        await asyncio.sleep(0.1)
        release.set()  # X's acceptance of C goes through: C becomes X's route
        end = time.monotonic() + 5
        while x.peer(yname) is None:
            assert time.monotonic() < end, "C was not adopted"
            await asyncio.sleep(0.01)
        assert x.peer(yname).channel_id != a_id
        await x.put(yname, {"w": torch.full((n,), 2.0)}, timeout=5)
        assert bool((w == 2.0).all()), "the later put had not landed when it returned"
        await asyncio.sleep(2.5)  # (Y's slow reader of A is done)
        assert bool((w == 2.0).all()), (
            f"X's timed-out put over A landed after X's later put over C (w[0] = {w[0].item()})")


class _Ch(SimpleNamespace):  # (a channel as the fence's bookkeeping sees it: hashable, like Channel)
    __hash__ = object.__hash__


def _stopped_thread() -> threading.Thread:
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    return t


def test_the_ids_kept_per_peer_are_bounded_by_the_peers_touched_most_recently(monkeypatch):
    """A server that sees many short-lived peers (each channel ends once) keeps ended-channel ids for
    MAX_PEERS peers, not for every peer it ever saw (past KEEP_S; 0 here); the most recent ones, and
    one touched again, are kept (Hello.lost, refuse_late and known() read them)."""
    from transport import fence

    monkeypatch.setattr(fence, "KEEP_S", 0.0)
    done = _stopped_thread()
    f = fence.Fences()
    f.closed(_Ch(peer_name="keeper", id="keeper-1", reader=done))
    n = fence.MAX_PEERS + 500
    for i in range(n):
        f.closed(_Ch(peer_name=f"p{i}", id=f"c{i}", reader=done))
        f.fence_for(f"p{i}", 1, [f"old{i}"], [])
        if i % 1000 == 0:
            f.closed(_Ch(peer_name="keeper", id=f"keeper-{i + 2}", reader=done))
    assert len(f._lost) <= fence.MAX_PEERS and len(f._named) <= fence.MAX_PEERS
    assert not f.known("p0") and f.known(f"p{n - 1}") and f.known("keeper")
    assert f.lost_ids(f"p{n - 1}") == [f"c{n - 1}"]
    assert f.refuse_late(f"p{n - 1}", f"old{n - 1}") and not f.refuse_late("p0", "old0")


def test_recent_peers_and_peers_whose_old_reader_still_serves_are_never_forgotten(monkeypatch):
    """Our channel C to p ended while its reader still serves a frame; then MAX_PEERS other peers'
    channels end. p's ids are kept (our next Hello to p must name C, so p breaks its side of C and
    fences its new channel from C's reader there): they were evicted with the rest. With KEEP_S at
    its default, none of a burst of MAX_PEERS + 10 peers is forgotten either."""
    from transport import fence

    release = threading.Event()
    serving = threading.Thread(target=release.wait, args=(30,), daemon=True)
    serving.start()
    done = _stopped_thread()
    try:
        f = fence.Fences()
        f.closed(_Ch(peer_name="p", id="C", reader=serving))
        for i in range(fence.MAX_PEERS + 10):
            f.closed(_Ch(peer_name=f"q{i}", id=f"c{i}", reader=done))
        assert f.lost_ids("p") == ["C"] and f.known("q0")  # (all within KEEP_S)
        monkeypatch.setattr(fence, "KEEP_S", 0.0)
        for i in range(fence.MAX_PEERS + 10):
            f.closed(_Ch(peer_name=f"r{i}", id=f"d{i}", reader=done))
        assert serving.is_alive()
        assert f.lost_ids("p") == ["C"], f"lost_ids('p') = {f.lost_ids('p')} while C's reader still serves"
    finally:
        release.set()
        serving.join(5)


def test_refuse_late_never_misses_a_named_id_while_a_lost_frame_touches_the_peer():
    """refuse_late (event loop, no lock) while a reader thread handles Lost frames from the same peer
    (fence_for touches its ids): the id the peer named lost is always found (a pop-and-reinsert
    left the peer out of the dict for a moment: 534582 misses in 3.4M checks)."""
    import logging

    from transport.fence import Fences

    f = Fences()
    f.fence_for("p", 1, ["old"], [])
    stop = threading.Event()

    def lost_frames() -> None:
        while not stop.is_set():
            f.fence_for("p", 1, ["n1"], [], sweep=False)

    log = logging.getLogger("transport.endpoint")
    level = log.level
    log.setLevel(logging.CRITICAL)  # (each refusal is logged)
    t = threading.Thread(target=lost_frames, daemon=True)
    t.start()
    misses = checks = 0
    try:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            checks += 1
            misses += not f.refuse_late("p", "old")
    finally:
        stop.set()
        t.join(5)
        log.setLevel(level)
    assert checks > 1000 and misses == 0, f"refuse_late missed the named id {misses} times in {checks} checks"
