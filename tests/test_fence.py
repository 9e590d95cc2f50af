"""The fence between a peer's old channels and a new one (transport/fence.py): nothing an old
channel's reader still serves lands after an op of the new channel.

Found by a review: a put that timed out with its bytes still in the target's socket, then the
channel lost (the target frozen past the heartbeat bound), then a later put over a new channel:
the later put returned, and the target's old reader then served the first put's bytes over it."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint
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
