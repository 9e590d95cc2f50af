"""Rendezvous and incarnations: a paused incarnation, an unanswered connect, a store record that
cannot be dialled, an address-book peer replaced mid-dial. Each case failed before its fix (found by
a hostile review of transport/rendezvous.py, incarnations.py and the dial loop).

Real processes (tests._remote), real sockets, a real TCPStore; every wait bounded.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint
from transport.rendezvous import parse_store_url

pytestmark = pytest.mark.timeout(60)


async def _dialled(dial: asyncio.Future, t0: float, what: str) -> transport.Peer:
    """The peer ``dial`` (a connect begun at ``t0``) reached; a failure says when, and ``what``."""
    try:
        return await asyncio.wait_for(dial, 15)
    except transport.TransportError as exc:
        pytest.fail(f"{time.monotonic() - t0:.1f} s after the dial began ({what}): {type(exc).__name__}: {exc}")


async def test_a_paused_incarnation_whose_channel_was_lost_does_not_take_the_name_back(store_url, uname):
    """B1 talks to A, then is paused (SIGSTOP) long enough for A's heartbeat to declare the channel lost;
    B restarts as B2 (published: the store names B2), which has not talked to A yet. B1 runs again and
    dials A. A has no open channel to the name, so replaced_by() does not look at the store and A adopts
    the stale B1: A's next put to the name lands in B1, not in B2, whom the store names."""
    name = uname("b")
    async with transport.Endpoint(uname("a"), store=store_url, timeout=20, heartbeat_interval=0.2,
                                  heartbeat_timeout=1.0) as a:
        a.register("y", torch.zeros(16, dtype=torch.uint8))
        b1 = RemoteEndpoint(name, store=store_url, timeout=20, commands="tests._lifecycle_remote")
        b2 = None
        try:
            b1.call("register", "x", "uint8", [16])
            assert await asyncio.to_thread(b1.call, "put_error", a.name, "y", 16, 1, 10.0, b"one") is None
            b1.signal(signal.SIGSTOP)
            end = time.monotonic() + 10  # (A's heartbeat loses the channel to the frozen B1)
            while a.peer(name) is not None and time.monotonic() < end:
                await asyncio.sleep(0.05)
            assert a.peer(name) is None
            b2 = await asyncio.to_thread(RemoteEndpoint, name, store=store_url, timeout=20,
                                         commands="tests._lifecycle_remote")
            b2.call("register", "x", "uint8", [16])
            b1.signal(signal.SIGCONT)
            # B1 (stale) dials A again: a notified put, a message A has to serve
            err = await asyncio.to_thread(b1.call, "put_error", a.name, "y", 16, 3, 5.0, b"stale", timeout=30)
            await a.put(name, {"x": torch.full((16,), 9, dtype=torch.uint8)}, timeout=10)
            got_b2 = b2.call("all_equal", "x", 0, 16, 9)
            got_b1 = b1.call("all_equal", "x", 0, 16, 9)
            peer = a.peer(name)
            assert peer is not None and peer.incarnation == b2.incarnation, (
                f"A routes {name!r} to incarnation {peer and hex(peer.incarnation)} (B1 {b1.incarnation:#x}, "
                f"B2 {b2.incarnation:#x}, the one the store names); B1's put: {err!r}")
            assert got_b2 and not got_b1, ("A's put went to the stale incarnation", got_b1, got_b2)
        finally:
            b1.kill()
            if b2 is not None:
                b2.kill()


async def test_a_dial_whose_connect_is_unanswered_moves_to_the_replacement_once_published(store_url, uname):
    """The store names incarnation B1 of ``b`` whose host is gone: its SYNs go unanswered (emulated here by
    a listener whose accept queue is full, so the kernel drops them). B restarts as B2 and publishes 0.3 s
    into A's dial. A dial whose *handshake* goes unanswered looks the record up again every second
    (incarnations.handshake_unless_replaced); one whose *connect* goes unanswered does not: it waits for
    the connect until the op's deadline and fails TransportTimeoutError, with B2 up and named all along."""
    import socket

    from transport.hostinfo import local_host
    from transport.rendezvous import _PREFIX, EndpointRecord, _rec_encoder

    name = uname("b")
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead.listen(0)
    fillers = []
    for _ in range(4):  # fill the accept queue: later SYNs are dropped (a gone host answers none)
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(dead.getsockname())
        fillers.append(s)
    await asyncio.sleep(0.2)
    probe = socket.socket()
    probe.settimeout(0.5)
    with pytest.raises(TimeoutError):
        probe.connect(dead.getsockname())  # (the premise: a connect there goes unanswered)
    probe.close()
    host, port = dead.getsockname()
    b1 = EndpointRecord(name, host, port, 0x1234, local_host(), "")
    store = TCPStoreClient(store_url)
    store.set(_PREFIX + name, _rec_encoder.encode(b1))
    try:
        async with transport.Endpoint(uname("a"), store=store_url, timeout=20) as a:
            t0 = time.monotonic()
            dial = asyncio.ensure_future(a.connect(name, timeout=8))
            await asyncio.sleep(0.3)
            async with transport.Endpoint(name, store=store_url, timeout=20) as b2:
                published = time.monotonic() - t0
                peer = await _dialled(dial, t0, f"B2 published at {published:.1f} s")
                took = time.monotonic() - t0
                assert peer.incarnation == b2.incarnation
                assert took < published + 3, (published, took)
    finally:
        for s in fillers:
            s.close()
        dead.close()


def TCPStoreClient(url: str):  # noqa: N802
    from torch.distributed import TCPStore

    from transport.rendezvous import parse_store_url

    host, port = parse_store_url(url)
    return TCPStore(host, port, is_master=False, wait_for_workers=False)


@pytest.mark.parametrize("host,port", [("127.0.0.1", 70000), ("127.0.0.1", -1), ("x" * 300, 1234)])
async def test_a_store_record_with_an_impossible_address_fails_the_op_typed(store_url, uname, host, port):
    """A record in the store (anyone who can write the store, README "Threat model": denial of service only)
    whose address cannot be dialled: the op fails with a TransportError (PeerNotFoundError or a timeout),
    as for a malformed record, not with the OverflowError / UnicodeError that socket.connect raises for it
    (the store's records are not checked as address records are: transport.address.decode_address)."""
    from transport.hostinfo import local_host
    from transport.rendezvous import _PREFIX, EndpointRecord, _rec_encoder

    name = uname("b")
    store = TCPStoreClient(store_url)
    store.set(_PREFIX + name, _rec_encoder.encode(EndpointRecord(name, host, port, 0x77, local_host(), "")))
    async with transport.Endpoint(uname("a"), store=store_url, timeout=20) as a:
        try:
            await asyncio.wait_for(a.connect(name, timeout=1.0), 10)
        except transport.TransportError:
            pass
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"connect raised {type(exc).__name__}: {exc} (not a TransportError)")
        else:
            pytest.fail("connected to an impossible address")
        assert a.is_open


async def test_a_dial_to_a_frozen_peer_moves_to_the_record_added_for_its_replacement(uname):
    """No store in common: A knows B from its address record. A dials B1, which is frozen (SIGSTOP): its
    handshake is not answered. B restarts as B2 and the application hands A B2's record (add_peer, which
    "replaces the earlier one"). The dial keeps waiting on B1 until the op's deadline: for a peer in the
    address book, incarnations.handshake_unless_replaced never looks again, though the book now names B2."""
    from torch.distributed import TCPStore

    own = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(3)]
    urls = [f"tcp://127.0.0.1:{st.port}" for st in own]
    name = uname("b")
    b1 = RemoteEndpoint(name, store=urls[1], timeout=20, commands="tests._lifecycle_remote")
    b2 = None
    try:
        async with transport.Endpoint(uname("a"), store=urls[0], timeout=20) as a:
            a.add_peer(await asyncio.to_thread(_record_of, b1))
            b1.signal(signal.SIGSTOP)
            t0 = time.monotonic()
            dial = asyncio.ensure_future(a.connect(name, timeout=8))
            await asyncio.sleep(0.3)
            b2 = await asyncio.to_thread(RemoteEndpoint, name, store=urls[2], timeout=20,
                                         commands="tests._lifecycle_remote")
            a.add_peer(await asyncio.to_thread(_record_of, b2))
            added = time.monotonic() - t0
            peer = await _dialled(dial, t0, f"B2's record added at {added:.1f} s")
            assert peer.incarnation == b2.incarnation
            assert time.monotonic() - t0 < added + 3
    finally:
        b1.kill()
        if b2 is not None:
            b2.kill()


def _record_of(remote: RemoteEndpoint) -> bytes:
    return remote.call("address_record")


class _StallableProxy:
    """A TCP proxy in front of the store that can stop forwarding (a store host that stopped
    answering for a while: overloaded, or a network partition to it)."""

    delay = 0.0  # (s each way: _SlowProxy)

    def __init__(self, store_url: str) -> None:
        self.host, self.port = parse_store_url(store_url)
        self.stalled = False
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                while self.stalled:
                    await asyncio.sleep(0.01)
                if self.delay:
                    await asyncio.sleep(self.delay)
                w.write(data)
                await w.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(self.host, self.port)
        for coro in (self._pipe(cr, sw), self._pipe(sr, cw)):
            t = asyncio.ensure_future(coro)
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()


async def test_a_first_connection_is_not_held_up_by_a_store_that_stopped_answering(store_url, uname):
    """Y and X are up and published; then Y's store stops answering (its host overloaded or cut
    off). X, which has never talked to Y, connects and puts (timeout 3 s): Y has nothing to take
    back from a name none of its channels ever reached, so it does not ask the store (it did for a
    while, and adopted the channel only once the look-up gave up, 10 s later: X's put timed out)."""
    proxy = _StallableProxy(store_url)
    purl = await proxy.start()
    try:
        async with transport.Endpoint(uname("y"), store=purl, timeout=20, planes=("tcp",)) as y:
            w = torch.zeros(16)
            y.register("w", w)
            async with transport.Endpoint(uname("x"), store=store_url, timeout=20, planes=("tcp",)) as x:
                proxy.stalled = True  # (X found Y in its own, healthy, connection to the store)
                try:
                    t0 = time.monotonic()
                    try:
                        await x.put(y.name, {"w": torch.ones(16)}, timeout=3)
                    except transport.TransportError as exc:
                        pytest.fail(f"X's first put to Y failed after {time.monotonic() - t0:.1f} s, Y's store "
                                    f"stalled: {type(exc).__name__}: {exc}")
                    assert torch.equal(w, torch.ones(16))
                finally:
                    proxy.stalled = False
    finally:
        await proxy.stop()


async def _stale_and_replacement(store_url: str, name: str) -> tuple[RemoteEndpoint, RemoteEndpoint]:
    """B1 up (published) and paused; B2 published under the same name meanwhile; B1 running again. Neither
    has talked to anyone. B1's own check after the pause is off (as when the store does not answer it:
    transport.pauses; tests/test_pauses.py): the peers' checks alone keep the name from it."""
    from tests._remote import wait_stopped

    b1 = RemoteEndpoint(name, store=store_url, timeout=20, commands="tests._lifecycle_remote")
    b1.call("register", "x", "uint8", [16])
    b1.call("pause_watch_off")
    b1.signal(signal.SIGSTOP)
    wait_stopped(b1.pid, 10)
    try:
        b2 = await asyncio.to_thread(RemoteEndpoint, name, store=store_url, timeout=20,
                                     commands="tests._lifecycle_remote")
    except BaseException:
        b1.kill()
        raise
    b2.call("register", "x", "uint8", [16])
    b1.signal(signal.SIGCONT)
    return b1, b2


def _wait_for_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's endpoints wait for the store's answer on every accepted connection (not
    only FIRST_LOOKUP_S): a test of the refusal itself, not of the bound on a slow store (the next
    test's subject). Under CI load the look-up took over 0.2 s: the stale put was adopted, landed
    and returned before the answer came (then the channel was broken, as designed)."""
    from transport import incarnations

    monkeypatch.setattr(incarnations, "FIRST_LOOKUP_S", 10.0)


async def _refused_and_replaced(a: transport.Endpoint, name: str, b1: RemoteEndpoint, b2: RemoteEndpoint,
                                value: int) -> None:
    """B1's notified put to A (a message A has to serve) fails, saying B1 was replaced; A's put to the
    name reaches B2 alone."""
    err = await asyncio.to_thread(b1.call, "put_error", a.name, "y", 16, value, 5.0, b"stale", timeout=30)
    assert err is not None and "PeerLostError" in err and "replaced" in err, err
    await a.put(name, {"x": torch.full((16,), 9, dtype=torch.uint8)}, timeout=10)
    assert a.peer(name).incarnation == b2.incarnation
    assert b2.call("all_equal", "x", 0, 16, 9) and not b1.call("all_equal", "x", 0, 16, 9)


async def test_a_paused_incarnation_that_never_talked_to_us_does_not_take_the_name(store_url, uname, monkeypatch):
    """B1 is paused before it ever talked to A, and replaced by B2 (published). B1 runs again and
    dials A: its first connection to A. A refuses it (the store names B2) and tells it why; A's
    put to the name reaches B2. (A first connection from a name was never checked against the
    store: A adopted B1, and its put went to the stale process, reported done.)"""
    _wait_for_the_store(monkeypatch)
    name = uname("b")
    async with transport.Endpoint(uname("a"), store=store_url, timeout=20) as a:
        a.register("y", torch.zeros(16, dtype=torch.uint8))
        b1, b2 = await _stale_and_replacement(store_url, name)
        try:
            await _refused_and_replaced(a, name, b1, b2, 3)
        finally:
            b1.kill()
            b2.kill()


async def test_a_stale_first_connection_adopted_while_the_store_was_slow_is_broken_once_it_answers(store_url, uname):
    """As above, but A's store answers only after 0.5 s when B1 connects: A adopts B1 after
    FIRST_LOOKUP_S (0.2 s; a first connection is not held up longer), and breaks that channel,
    telling B1 why, once the look-up names B2; A's next put reaches B2. (Before the look-up went on
    after adoption, A kept routing the name to B1.)"""
    from transport.incarnations import FIRST_LOOKUP_S

    proxy = _StallableProxy(store_url)
    purl = await proxy.start()
    name = uname("b")
    try:
        async with transport.Endpoint(uname("a"), store=purl, timeout=20) as a:
            a.register("y", torch.zeros(16, dtype=torch.uint8))
            b1, b2 = await _stale_and_replacement(store_url, name)
            try:
                proxy.stalled = True
                try:
                    put = asyncio.ensure_future(asyncio.to_thread(b1.call, "put_error", a.name, "y", 16, 3, 5.0,
                                                                  timeout=30))
                    end = time.monotonic() + 10  # (A adopts B1 once FIRST_LOOKUP_S passed)
                    while a.peer(name) is None and time.monotonic() < end:
                        await asyncio.sleep(0.01)
                    assert a.peer(name) is not None and a.peer(name).incarnation == b1.incarnation
                    await asyncio.sleep(max(0.0, 0.5 - FIRST_LOOKUP_S))
                finally:
                    proxy.stalled = False
                t0 = time.monotonic()
                while a.peer(name) is not None and time.monotonic() < t0 + 5:
                    await asyncio.sleep(0.01)
                assert a.peer(name) is None, "A still routes the name to the stale incarnation"
                await asyncio.wait_for(put, 30)  # (it may have landed: it came before the store answered)
                await _refused_and_replaced(a, name, b1, b2, 4)
            finally:
                b1.kill()
                b2.kill()
    finally:
        await proxy.stop()


async def test_every_channel_of_a_stale_incarnation_is_closed_once_the_late_look_up_names_its_replacement(
        store_url, uname):
    """Stale B1 (the store names B2) connects to A while A's store is slow: A adopts B1's channel C1
    after FIRST_LOOKUP_S, the look-up still running. A second channel of B1's, C1' (both serve, as
    when both sides dialled at once), comes while C1 is open and is not checked (A trusts an open
    channel's incarnation). When the look-up names B2, both are closed, and A's put reaches B2. (Only
    C1 was: the route moved to C1', and A's puts went on landing in B1; found by a review.)"""
    proxy = _StallableProxy(store_url)
    purl = await proxy.start()
    name = uname("b")
    b2 = None
    try:
        async with transport.Endpoint(uname("a"), store=purl, timeout=20, planes=("tcp",)) as a, \
                transport.Endpoint(name, store=store_url, timeout=20, planes=("tcp",)) as b1:
            a.register("y", torch.zeros(16, dtype=torch.uint8))
            xb1 = b1.new_buffer("x", (16,))
            b2 = await asyncio.to_thread(RemoteEndpoint, name, store=store_url, timeout=20, planes=("tcp",),
                                         commands="tests._lifecycle_remote")
            b2.call("register", "x", "uint8", [16])
            await b1._rdv.lookup(a.name, time.monotonic() + 5)  # (A's record is in the store before it stalls)
            proxy.stalled = True
            try:
                await b1.connect(a.name, timeout=5)  # C1
                end = time.monotonic() + 5
                while a.peer(name) is None and time.monotonic() < end:
                    await asyncio.sleep(0.01)
                assert a.peer(name) is not None and a.peer(name).incarnation == b1.incarnation
                await b1._connector._dial(a.name, time.monotonic() + 5)  # C1' (the connector's own dial)
                end = time.monotonic() + 5
                while sum(c.peer_name == name and c.is_open for c in a._connector.all) < 2:
                    assert time.monotonic() < end, "A did not adopt B1's second channel"
                    await asyncio.sleep(0.01)
            finally:
                proxy.stalled = False  # (A's look-up for C1 answers now, within its 1 s bound: it names B2)
            end = time.monotonic() + 5
            while any(c.peer_name == name and c.is_open for c in a._connector.all) and time.monotonic() < end:
                await asyncio.sleep(0.02)
            still = [c.id for c in a._connector.all if c.peer_name == name and c.is_open]
            assert not still, f"channels of the stale incarnation still open: {still}"
            await a.put(name, {"x": torch.full((16,), 9, dtype=torch.uint8)}, timeout=10)
            assert a.peer(name).incarnation == b2.incarnation
            assert not bool((xb1 == 9).all()) and b2.call("all_equal", "x", 0, 16, 9)
    finally:
        if b2 is not None:
            b2.kill()
        await proxy.stop()


class _SlowProxy(_StallableProxy):
    """The store behind a link with ``delay`` s each way (a store host across a slow network)."""

    delay = 0.02


async def test_a_burst_of_first_connections_runs_a_bounded_number_of_store_look_ups(store_url, uname):
    """24 peers connect to A at once (a server at job start), A's store 20 ms away. At most
    FIRST_LOOKUPS of their look-ups run at once (and as many after-silence ones) (they share A's one store thread with A's own dials:
    40 of them held A's next dial 0.85 s and timed out past 1 s, dropping A's shared store client;
    found by a review); every peer is adopted, and A's store client is never dropped."""
    from transport.incarnations import FIRST_LOOKUPS

    proxy = _SlowProxy(store_url)
    purl = await proxy.start()
    n = 24
    kw = {"timeout": 20, "planes": ("tcp",)}
    try:
        async with transport.Endpoint(uname("a"), store=purl, **kw) as a, \
                transport.Endpoint(uname("d"), store=store_url, **kw) as d:
            running = {"now": 0, "most": 0, "calls": 0}
            real = a._rdv.lookup_now

            async def counted(*args, **kwargs):
                running["now"] += 1
                running["calls"] += 1
                running["most"] = max(running["most"], running["now"])
                try:
                    return await real(*args, **kwargs)
                finally:
                    running["now"] -= 1

            a._rdv.lookup_now = counted
            peers = [transport.Endpoint(uname("p"), store=store_url, **kw) for _ in range(n)]
            try:
                await asyncio.gather(*(p.open() for p in peers))
                await peers[0]._rdv.lookup(a.name, time.monotonic() + 5)
                await asyncio.gather(*(p.connect(a.name, timeout=10) for p in peers))
                end = time.monotonic() + 10
                while len(a.peers) < n and time.monotonic() < end:
                    await asyncio.sleep(0.005)
                assert len(a.peers) == n
                await a.connect(d.name, timeout=10)
            finally:
                await asyncio.gather(*(p.close() for p in peers), return_exceptions=True)
            # (first connections' look-ups, and those of channels heard again after a silence: a limit each)
            assert 0 < running["most"] <= 2 * FIRST_LOOKUPS, running
            assert not a._rdv._client.broken, "a look-up timed out: A's shared store client was dropped"
    finally:
        await proxy.stop()


async def test_an_incarnation_refused_while_another_was_named_is_let_in_once_that_record_is_withdrawn(
        store_url, uname, monkeypatch):
    """A is alive; another endpoint of its name (incarnation 0x77) publishes, then withdraws (its open
    failed). A's connection to E while 0x77 was named is refused, and again at once within STALE_S
    (0.5 s here); after that E asks the store again, which names no one now, and lets A in. (E
    refused A for good, blaming 0x77, which no longer existed; found by a review.)"""
    from torch.distributed import TCPStore

    from transport import incarnations
    from transport.hostinfo import local_host
    from transport.rendezvous import _PREFIX, EndpointRecord, _rec_encoder

    monkeypatch.setattr(incarnations, "STALE_S", 0.5)
    _wait_for_the_store(monkeypatch)
    name = uname("a")
    store = TCPStore(*parse_store_url(store_url), is_master=False, wait_for_workers=False)
    async with transport.Endpoint(uname("e"), store=store_url, timeout=10) as e:
        y = torch.zeros(16, dtype=torch.uint8)
        e.register("y", y)
        a = RemoteEndpoint(name, store=store_url, timeout=10)
        try:
            other = _rec_encoder.encode(EndpointRecord(name, "127.0.0.1", 9, 0x77, local_host(), ""))
            store.set(_PREFIX + name, other)  # the other incarnation publishes
            # (notified: a message E must serve. A one-sided shm put can land before the refusal, through
            # the exports E's Hello announced before its look-up: A runs here, it was never paused, so its
            # own check, transport.pauses, does not stop it; 1 run in 6 under load)
            err = await asyncio.to_thread(a.call, "put_error", e.name, {"y": ("uint8", [16], 1)}, 3.0, b"n")
            assert "refused" in err, err
            store.compare_set(_PREFIX + name, other, b"")  # ... and withdraws (Rendezvous.withdraw)
            await asyncio.sleep(0.6)
            err = await asyncio.to_thread(a.call, "put_error", e.name, {"y": ("uint8", [16], 2)}, 5.0)
            assert err == "", f"the store names no other incarnation of {name!r} now, yet A is refused: {err}"
            from tests._remote import make_tensor

            assert torch.equal(y, make_tensor("uint8", (16,), 2))
        finally:
            a.kill()


async def test_a_paused_incarnation_whose_channel_survived_the_pause_loses_the_name_to_its_replacement(
        store_url, uname):
    """B1 talks to A; B1 is paused (SIGSTOP) for less than A's heartbeat timeout, long enough for B2 to
    start under the same name (published; B2 does not dial A). B1 runs again: its channel to A never
    broke. A hears B1 again after a silence of over 2 heartbeat intervals, asks the store, which names
    B2: A closes B1's channel, telling it why, and A's next put reaches B2. (A went on putting into B1:
    nothing asked the store while the channel stayed open; found by the chaos soak's zombie fault.)
    B1's own check after the pause is off (transport.pauses; as when the store does not answer it):
    A's check alone."""
    from tests._remote import wait_stopped

    name = uname("b")
    async with transport.Endpoint(uname("a"), store=store_url, timeout=20, heartbeat_interval=0.2,
                                  heartbeat_timeout=30.0) as a:
        b1 = RemoteEndpoint(name, store=store_url, timeout=20, commands="tests._lifecycle_remote")
        b2 = None
        try:
            b1.call("register", "x", "uint8", [16])
            b1.call("pause_watch_off")
            await a.put(name, {"x": torch.full((16,), 1, dtype=torch.uint8)}, timeout=10)
            b1.signal(signal.SIGSTOP)
            wait_stopped(b1.pid, 10)
            try:
                b2 = await asyncio.to_thread(RemoteEndpoint, name, store=store_url, timeout=20,
                                             commands="tests._lifecycle_remote")
                b2.call("register", "x", "uint8", [16])
                await asyncio.sleep(0.5)  # (at least 2 heartbeat intervals of silence, whatever B2's start took)
            finally:
                b1.signal(signal.SIGCONT)
            end = time.monotonic() + 10
            while a.peer(name) is not None and a.peer(name).incarnation == b1.incarnation:
                assert time.monotonic() < end, "A still routes the name to the paused incarnation"
                await asyncio.sleep(0.05)
            await a.put(name, {"x": torch.full((16,), 9, dtype=torch.uint8)}, timeout=10)
            assert a.peer(name).incarnation == b2.incarnation
            assert b2.call("all_equal", "x", 0, 16, 9) and not b1.call("all_equal", "x", 0, 16, 9)
            names = await asyncio.to_thread(b1.call, "peer_names")
            assert a.name not in names, f"B1's channel to A is still open: {names}"
        finally:
            b1.kill()
            if b2 is not None:
                b2.kill()


async def test_a_peer_heard_again_is_checked_whatever_the_silent_channels_ahead_of_it():
    """Stale.after_silence's scheduling (the store and channels stand-ins; the real path is the test
    above): 4 peers silent for good (dead, or cut off) and a paused one heard again, whose store
    record names a replacement. The silent ones are not looked up at all (a look-up stuck on a store
    cut off with them held up every later store call of the process), so they cannot take the
    look-up slots from the one heard again (they did, at every beat, in a version that checked them
    while silent: found by a review); and the first-connection limit is left alone."""
    from types import SimpleNamespace

    from transport import incarnations

    class Ch(SimpleNamespace):
        __hash__ = object.__hash__

        def close(self, reason, timeout=1.0, error=None):
            self.is_open = False
            self.reason = reason

    asked: list[str] = []

    async def lookup_now(name, deadline):  # (a slow store: a look-up lasts 3 beats of this test)
        asked.append(name)
        await asyncio.sleep(0.25)
        return SimpleNamespace(incarnation=2 if name == "zombie" else 1)

    tasks: set[asyncio.Task] = set()

    def spawn(coro):
        t = asyncio.ensure_future(coro)
        tasks.add(t)
        return t

    ep = SimpleNamespace(_state="open", _book=SimpleNamespace(lookup=lambda name, skip: None),
                         _rdv=SimpleNamespace(lookup_now=lookup_now), _spawn=spawn)
    t0 = time.monotonic()
    silent = [Ch(peer_name=f"dead{i}", incarnation=1, id=f"d{i}", is_open=True, last_rx=t0 - 5.0) for i in range(4)]
    zombie = Ch(peer_name="zombie", incarnation=1, id="z", is_open=True, last_rx=t0)
    channels = [*silent, zombie]  # (a list: the zombie last in the order they are walked)
    stale = incarnations.Stale()
    for beat in range(8):  # a beat a second; the zombie is silent from the 2nd to the 5th (paused), then heard
        if beat == 5:
            zombie.last_rx = t0 + beat
        stale.after_silence(ep, channels, t0 + beat, 1.0)  # type: ignore[arg-type]
        await asyncio.sleep(0.1)
    await asyncio.gather(*tasks)
    await asyncio.sleep(0.1)  # (the unseat's thread)
    assert asked == ["zombie"] and not zombie.is_open, (asked, zombie.is_open)
    assert "replaced" in zombie.reason and stale.looking == 0 and getattr(stale, "after_looking", 0) == 0
