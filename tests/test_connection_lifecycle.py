"""An endpoint's connections at the edges of its life: a connect in flight when ``close()`` runs, an
accept that fails for want of descriptors, a record withdrawn while a new incarnation publishes.

Real processes (tests._remote), real sockets, a real TCPStore; every wait bounded.
"""

from __future__ import annotations

import asyncio
import math
import signal
import threading
import time
from typing import Any

import pytest
import torch
from torch.distributed import HashStore, Store, TCPStore

import transport
from tests._remote import RemoteEndpoint
from transport.errors import EndpointClosedError

pytestmark = pytest.mark.timeout(120)


def _transport_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("transport-") and t.name != "transport-store"}


async def test_ops_connecting_when_close_runs_fail_endpoint_closed_and_no_channel_is_adopted(store_url, uname):
    """A's put dials B, whose process is stopped: the handshake waits for it. A closes meanwhile: the put, a
    second op queued behind that dial and one looking up a peer that never appears all fail with
    EndpointClosedError at once (not at their deadlines, not as timeouts or store errors); once B runs
    again, the dial's handshake can finish, but nothing is adopted: A holds no channel and no channel
    thread, B keeps no channel to A, and the put's bytes never landed."""
    b = RemoteEndpoint(uname("b"), store=store_url, timeout=30, commands="tests._lifecycle_remote")
    try:
        b.call("register", "x", "uint8", [1024])
        before = _transport_threads()
        a = transport.Endpoint(uname("a"), store=store_url, timeout=30)
        await a.open()
        b.signal(signal.SIGSTOP)
        put = asyncio.ensure_future(a.put(b.name, {"x": torch.full((1024,), 7, dtype=torch.uint8)}, timeout=20))
        queued = asyncio.ensure_future(a.notify(b.name, b"behind the dial", timeout=20))
        missing = asyncio.ensure_future(a.connect(uname("nobody"), timeout=20))
        await asyncio.sleep(0.5)
        assert not put.done() and not queued.done() and not missing.done()
        t0 = time.monotonic()
        await asyncio.wait_for(a.close(), 10)
        done, _ = await asyncio.wait({put, queued, missing}, timeout=5)
        took = time.monotonic() - t0
        b.signal(signal.SIGCONT)
        assert done == {put, queued, missing}, f"ops still pending {took:.1f} s after close()"
        for op in (put, queued, missing):
            assert isinstance(op.exception(), EndpointClosedError), repr(op.exception())
        await asyncio.sleep(1.0)  # (B answers the handshake it was sent now: A must not adopt it)
        assert not a._connector.all and not a._connector.channels
        assert _transport_threads() <= before, _transport_threads() - before
        end = time.monotonic() + 10
        while b.call("peer_names") and time.monotonic() < end:  # B sees the connection hang up
            await asyncio.sleep(0.1)
        assert b.call("peer_names") == []
        assert b.call("is_poisoned", "x"), "the put's bytes landed although it failed"
    finally:
        b.stop()


async def test_an_accept_failing_for_want_of_descriptors_does_not_stop_the_endpoint_accepting(store_url, uname):
    """B runs out of file descriptors (every one taken, a dial to it pending): its accept fails with EMFILE.
    Once it has descriptors again, the pending dial and later ones are accepted: the endpoint never stops
    accepting for good (it did: its accept loop ended at the first such error, and every later dial waited
    out its deadline in the handshake)."""
    b = RemoteEndpoint(uname("b"), store=store_url, timeout=30, commands="tests._lifecycle_remote")
    try:
        b.call("register", "x", "uint8", [64])
        async with transport.Endpoint(uname("a"), store=store_url, timeout=30) as a:
            assert b.call("exhaust_fds", 512) > 0
            pending = asyncio.ensure_future(a.connect(b.name, timeout=30))
            done, _ = await asyncio.wait({pending}, timeout=1.5)  # its accept fails: no descriptor for it
            assert not done, "connected although the target had no free descriptor"
            b.call("release_fds")
            await asyncio.wait_for(pending, 10)
            await a.put(b.name, {"x": torch.full((64,), 3, dtype=torch.uint8)}, timeout=10)
            assert b.call("all_equal", "x", 0, 64, 3)
        async with transport.Endpoint(uname("c"), store=store_url, timeout=30) as c:  # a new peer, later
            await c.connect(b.name, timeout=10)
    finally:
        b.stop()


class _SlowStore(Store):  # type: ignore[misc]
    """A real HashStore reached as over a slow link: each call takes ``delay`` s before it acts (as a store on
    another host answers). ``then`` (key, value, at): sets that value ``at`` s after the first call that
    names the key once armed (a new incarnation publishing while the old one closes)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.inner, self.delay = HashStore(), delay
        self.armed: tuple[str, bytes, float] | None = None
        self.timers: list[threading.Timer] = []

    def _slow(self, key: str) -> None:
        if self.armed is not None and self.armed[0] == key:
            k, v, at = self.armed
            self.armed = None
            timer = threading.Timer(at, self.inner.set, (k, v))
            timer.start()
            self.timers.append(timer)
        time.sleep(self.delay)

    def set(self, key: str, value: Any) -> None:
        self._slow(key)
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._slow(key)
        return self.inner.get(key)  # type: ignore[no-any-return]

    def check(self, keys: list[str]) -> bool:
        self._slow(keys[0])
        return self.inner.check(keys)  # type: ignore[no-any-return]

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._slow(key)
        return self.inner.compare_set(key, expected, desired)  # type: ignore[no-any-return]

    def delete_key(self, key: str) -> bool:
        self._slow(key)
        return self.inner.delete_key(key)  # type: ignore[no-any-return]

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)  # type: ignore[no-any-return]

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def set_timeout(self, timeout: Any) -> None:
        self.inner.set_timeout(timeout)


async def test_close_never_withdraws_the_record_a_new_incarnation_published_meanwhile(uname):
    """The old incarnation of ``b`` closes while its replacement publishes: over a store whose calls take
    0.2 s, the new record lands 0.5 s into the old one's withdrawal (it looked its own record up, then
    deleted the key: the new record went with it, and the replacement was open but unreachable by name).
    The new incarnation stays reachable, by a peer that dials it afterwards."""
    store = _SlowStore(0.2)
    name = uname("b")
    key = f"transport/v1/endpoint/{name}"
    new = transport.Endpoint(name, store=store, timeout=30)
    await new.open()
    old = None
    try:
        new_record = store.inner.get(key)
        old = transport.Endpoint(name, store=store, timeout=30)
        await old.open()  # (published last: the store names the old one, as before the restart)
        store.armed = (key, new_record, 0.5)
        await asyncio.wait_for(old.close(), 15)
        for timer in store.timers:
            timer.join(5)
        assert store.inner.check([key]) and store.inner.get(key) == new_record, "the new incarnation's record is gone"
        async with transport.Endpoint(uname("a"), store=store, timeout=30) as a:
            peer = await a.connect(name, timeout=10)
            assert peer.incarnation == new.incarnation
    finally:
        if old is not None:
            await old.close()
        await new.close()


async def test_a_withdrawn_record_reads_as_none_and_the_name_can_be_published_again(store_url, uname):
    name = uname("b")
    async with transport.Endpoint(name, store=store_url, timeout=10):
        pass
    async with transport.Endpoint(uname("a"), store=store_url, timeout=10) as a:
        with pytest.raises(transport.PeerNotFoundError):
            await a.connect(name, timeout=0.5)
        async with transport.Endpoint(name, store=store_url, timeout=10) as again:
            assert (await a.connect(name, timeout=10)).incarnation == again.incarnation


@pytest.mark.parametrize("bad", [math.nan, -1.0])
async def test_next_notification_refuses_a_nan_or_negative_timeout(store_url, uname, bad):
    async with transport.Endpoint(uname("a"), store=store_url, timeout=10) as a:
        with pytest.raises(ValueError):
            await asyncio.wait_for(a.next_notification(timeout=bad), 5)
        with pytest.raises(transport.TransportTimeoutError):  # (0: only what is queued already)
            await asyncio.wait_for(a.next_notification(timeout=0), 5)


async def _adopted(a: transport.Endpoint, name: str, incarnation: int) -> None:
    """Wait (10 s at most) until ``a``'s channel to ``name`` is to ``incarnation``: an shm put is
    one-sided, so the dialler's put may return before ``a``, after its side of the handshake (a store
    look-up included), adopted the channel."""
    end = time.monotonic() + 10
    while ((p := a.peer(name)) is None or p.incarnation != incarnation) and time.monotonic() < end:
        await asyncio.sleep(0.05)
    p = a.peer(name)
    assert p is not None and p.incarnation == incarnation, (p, hex(incarnation))


async def test_a_paused_incarnation_that_comes_back_does_not_take_the_name_from_its_replacement(store_url, uname,
                                                                                               monkeypatch):
    """B1 is paused (SIGSTOP: a long GC, swapping) and replaced: B2 opens under the same name and talks to A.
    When B1 runs again and dials A, A refuses it (the store names B2, with which A has a channel); it
    took the name back: A dropped B2's channel as "restarted" and put into the stale B1, reported done."""
    from transport import incarnations

    # (A waits for the store's answer: past FIRST_LOOKUP_S, 0.2 s, it adopts B1 and breaks the channel
    # only once the answer comes, which under CI load let B1's put land first; the bound is tested
    # in tests/test_rendezvous_faults.py)
    monkeypatch.setattr(incarnations, "FIRST_LOOKUP_S", 10.0)
    name = uname("b")
    async with transport.Endpoint(uname("a"), store=store_url, timeout=20) as a:
        a.register("y", torch.zeros(16, dtype=torch.uint8))
        spec = {"y": ("uint8", [16], 1)}
        b1 = RemoteEndpoint(name, store=store_url, timeout=20, commands="tests._lifecycle_remote")
        b2 = None
        try:
            b1.call("register", "x", "uint8", [16])
            b1.call("pause_watch_off")  # (B1's own check after the pause, transport.pauses, off: A's alone)
            await asyncio.to_thread(b1.call, "put", a.name, spec, 10)  # (A's loop must run meanwhile)
            b1.signal(signal.SIGSTOP)
            b2 = await asyncio.to_thread(RemoteEndpoint, name, store=store_url, timeout=20)
            b2.call("register", "x", "uint8", [16])
            await asyncio.to_thread(b2.call, "put", a.name, spec, 10)
            await _adopted(a, name, b2.incarnation)
            b1.signal(signal.SIGCONT)
            end = time.monotonic() + 15  # (B1 finds its channel to A closed: A dropped it for B2)
            while a.name in await asyncio.to_thread(b1.call, "peer_names") and time.monotonic() < end:
                await asyncio.sleep(0.1)
            # a notified put (a message: a one-sided shm put of B1's needs none, and A does not stop those)
            err = await asyncio.to_thread(b1.call, "put_error", a.name, "y", 16, 3, 5.0, b"stale", timeout=30)
            assert err is not None and "PeerLostError" in err and "replaced" in err, err  # (told why)
            assert a.peer(name).incarnation == b2.incarnation, "the stale incarnation took the name back"
            await a.put(name, {"x": torch.full((16,), 9, dtype=torch.uint8)}, timeout=10)
            assert b2.call("all_equal", "x", 0, 16, 9)
            assert b1.call("is_poisoned", "x")
        finally:
            b1.kill()
            if b2 is not None:
                b2.kill()


async def test_a_dial_to_a_frozen_incarnation_moves_to_its_replacement_once_published(store_url, uname):
    """A dials B1, which is frozen: its handshake is not answered. B2 is published under the same name a
    moment later: the dial gives B1 up within about a second and connects to B2 (it waited out the op's
    whole deadline, then failed)."""
    name = uname("b")
    b1 = RemoteEndpoint(name, store=store_url, timeout=20)
    b2 = None
    try:
        b1.signal(signal.SIGSTOP)
        async with transport.Endpoint(uname("a"), store=store_url, timeout=30) as a:
            t0 = time.monotonic()
            dial = asyncio.ensure_future(a.connect(name, timeout=30))
            await asyncio.sleep(0.3)
            b2 = await asyncio.to_thread(RemoteEndpoint, name, store=store_url, timeout=20)
            published = time.monotonic() - t0
            peer = await asyncio.wait_for(dial, 25)
            took = time.monotonic() - t0
            assert peer.incarnation == b2.incarnation
            assert took < published + 5, (published, took)
    finally:
        b1.kill()
        if b2 is not None:
            b2.kill()


async def test_a_peer_known_from_its_address_record_that_restarts_is_reached_again(uname):
    """No store in common (each endpoint on a store of its own, peers added from address records): B1 is
    paused (its host silent) and B restarts as B2, which dials A with A's record. A takes B2 as B's restart
    (no store names who holds the name: the newer connection wins, as before)."""
    own = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(3)]
    urls = [f"tcp://127.0.0.1:{st.port}" for st in own]
    name = uname("b")
    async with transport.Endpoint(uname("a"), store=urls[0], timeout=20) as a:
        a.register("y", torch.zeros(16, dtype=torch.uint8))
        b1 = RemoteEndpoint(name, store=urls[1], timeout=20, commands="tests._lifecycle_remote")
        b2 = None
        try:
            a.add_peer(b1.call("address_record"))
            b1.call("add_peer", a.address_record())
            assert await asyncio.to_thread(b1.call, "put_error", a.name, "y", 16, 1, 10.0) is None
            b1.signal(signal.SIGSTOP)
            b2 = await asyncio.to_thread(RemoteEndpoint, name, store=urls[2], timeout=20,
                                         commands="tests._lifecycle_remote")
            b2.call("add_peer", a.address_record())
            assert await asyncio.to_thread(b2.call, "put_error", a.name, "y", 16, 2, 10.0) is None
            await _adopted(a, name, b2.incarnation)
        finally:
            b1.kill()
            if b2 is not None:
                b2.kill()


class _NoCompareSet(Store):  # type: ignore[misc]
    """A custom store (a dict) that, like many, does not implement compare_set."""

    def __init__(self) -> None:
        super().__init__()
        self.d: dict[str, bytes] = {}

    def set(self, key: str, value: Any) -> None:
        self.d[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key: str) -> bytes:
        return self.d[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.d for k in keys)

    def delete_key(self, key: str) -> bool:
        return self.d.pop(key, None) is not None

    def add(self, key: str, value: int) -> int:
        n = int(self.d.get(key, b"0")) + value
        self.d[key] = str(n).encode()
        return n

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        pass

    def set_timeout(self, timeout: Any) -> None:
        pass


async def test_a_store_without_compare_set_still_gets_a_secret_and_has_the_record_withdrawn(uname, monkeypatch):
    monkeypatch.delenv("TRANSPORT_SECRET", raising=False)
    store = _NoCompareSet()
    with pytest.raises(RuntimeError):
        store.compare_set("k", "", "v")  # (what such a store raises: not NotImplementedError)
    name = uname("b")
    ep = transport.Endpoint(name, store=store, timeout=10)
    await ep.open()
    assert f"transport/v1/endpoint/{name}" in store.d
    await ep.close()
    assert f"transport/v1/endpoint/{name}" not in store.d
