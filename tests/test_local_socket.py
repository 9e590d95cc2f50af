"""Channels to same-host peers run on a Unix-domain socket (transport.local_socket), and fall back
to TCP, saying so, where that socket cannot be reached."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest
import torch
from _remote import RemoteEndpoint, make_tensor, same_bytes
from torch.distributed import HashStore

import transport
from transport.address import decode_address, encode_address

pytestmark = pytest.mark.timeout(120)

BIG = (3 << 20) + 5  # float32 elements: a 12 MiB payload, above the receiver's SO_RCVLOWAT threshold


@pytest.mark.parametrize("plane", ["shm", "tcp"])
async def test_a_spawned_same_host_peer_is_reached_over_a_unix_socket_both_ways(store_url, uname, plane):
    target = RemoteEndpoint(uname("tgt"), store=store_url, planes=(plane,), timeout=30)
    try:
        target.call("register", "small", "float32", [1024])
        target.call("register", "big", "float32", [BIG])
        async with transport.Endpoint(uname("init"), store=store_url, planes=(plane,), timeout=30) as ep:
            peer = await ep.connect(target.name)
            assert (peer.plane, peer.socket) == (plane, "unix"), peer
            assert "socket=unix" in repr(peer)
            small, big = make_tensor("float32", (1024,), 1), make_tensor("float32", (BIG,), 2)
            await ep.put(target.name, {"small": small, "big": big}, notify=b"landed")
            assert target.call("check", "small", 1)
            assert target.call("check", "big", 2)
            out = torch.zeros(BIG)
            await ep.get(target.name, {"big": out})
            assert same_bytes(out, big)
            # the target's half of the one channel is the same Unix socket
            assert target.call("peer_planes", ep.name)["socket"] == "unix"
            # and the target's ops to us go over it too
            back = torch.zeros(1024)
            ep.register("back", back)
            target.call("put", ep.name, {"back": ("float32", [1024], 3)}, 30)
            assert same_bytes(back, make_tensor("float32", (1024,), 3))
    finally:
        target.kill()


async def test_with_unix_sockets_off_a_same_host_peer_is_dialled_over_tcp(store_url, uname, monkeypatch):
    target = RemoteEndpoint(uname("tgt"), store=store_url, timeout=30)  # (it listens on a Unix socket)
    try:
        target.call("register", "t", "float32", [256])
        monkeypatch.setenv("TRANSPORT_UNIX_SOCKETS", "0")  # read when the dialer dials
        async with transport.Endpoint(uname("init"), store=store_url, timeout=30) as ep:
            peer = await ep.connect(target.name)
            assert peer.socket == "tcp" and peer.same_host
            await ep.put(target.name, {"t": make_tensor("float32", (256,), 5)})
            assert target.call("check", "t", 5)
            assert target.call("peer_planes", ep.name)["socket"] == "tcp"
    finally:
        target.kill()


async def test_a_unix_socket_that_refuses_falls_back_to_tcp_and_the_log_says_why(caplog):
    async with (
        transport.Endpoint("a", store=HashStore(), timeout=10) as a,
        transport.Endpoint("b", store=HashStore(), timeout=10) as b,
    ):
        rec, secret = decode_address(b.address_record())
        assert rec.unix, "an open endpoint on Linux listens on a Unix socket and publishes its name"
        gone = msgspec.structs.replace(rec, unix="transport-rl/nobody-listens-here")
        a.add_peer(encode_address(gone, secret))
        target = torch.zeros(8)
        b.register("t", target)
        with caplog.at_level(logging.INFO, logger="transport.endpoint"):
            await a.put("b", {"t": torch.ones(8)}, timeout=10)
        assert torch.equal(target, torch.ones(8))
        assert (await a.connect("b")).socket == "tcp"
        assert any("Unix socket refused" in r.getMessage() and "dialling TCP" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("bad", ["x" * 101, "transport-rl/\0hidden"])
async def test_an_address_record_with_an_invalid_unix_name_is_refused(bad):
    async with transport.Endpoint("b", store=HashStore(), timeout=10) as b:
        rec, secret = decode_address(b.address_record())
        with pytest.raises(ValueError, match="Unix socket name"):
            decode_address(encode_address(msgspec.structs.replace(rec, unix=bad), secret))


async def test_a_closed_endpoint_stops_listening_on_its_unix_socket():
    import socket

    from transport.local_socket import unix_address

    b = transport.Endpoint("b", store=HashStore(), timeout=10)
    await b.open()
    rec, _ = decode_address(b.address_record())
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.connect(unix_address(rec.unix))  # listening while open
    probe.close()
    await b.close()
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(ConnectionRefusedError):
        probe.connect(unix_address(rec.unix))
    probe.close()
    await asyncio.sleep(0)


async def test_an_accepted_connection_whose_handler_close_cancelled_before_it_ran_is_closed():
    """close() cancels every task of the endpoint; a connection accepted just before has a handler
    task that may not have run its first step, so its own clean-up never runs (seen in CI as an
    'unclosed socket' ResourceWarning). Here that handler is cancelled at its creation: the accepted
    socket must still be closed, never left to the GC."""
    import gc
    import socket
    import warnings

    from transport.local_socket import unix_address

    b = transport.Endpoint("b", store=HashStore(), timeout=10)
    await b.open()
    spawn, handlers = b._spawn, []

    def spawn_then_cancel(coro):
        task = spawn(coro)
        if coro.__qualname__.endswith("_accept_one"):
            task.cancel()
            handlers.append(task)
        return task

    b._spawn = spawn_then_cancel
    rec, _ = decode_address(b.address_record())
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            probe.connect(unix_address(rec.unix))
            probe.setblocking(False)  # the endpoint's side is closed (bounded: 10 s)
            assert await asyncio.wait_for(asyncio.get_running_loop().sock_recv(probe, 1), 10) == b""
            assert len(handlers) == 1 and handlers[0].cancelled()
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    finally:
        probe.close()
        b._spawn = spawn
        await b.close()


async def test_connections_arriving_while_the_endpoint_closes_are_all_closed():
    """A same-host process dials again and again while close() runs (15 endpoints in turn): every
    connection the endpoint accepted is closed by it, none is left to the GC (with loop.sock_accept,
    a connection taken just before the close cancelled the accepting task was dropped with it:
    ResourceWarning, in 30 of 40 such closes)."""
    import gc
    import socket
    import threading
    import time
    import warnings

    from transport.local_socket import unix_address

    for i in range(15):
        b = transport.Endpoint(f"b{i}", store=HashStore(), timeout=10)
        await b.open()
        rec, _ = decode_address(b.address_record())
        stop, dialed, where = threading.Event(), [], unix_address(rec.unix)

        def dial(address=where, stop=stop, dialed=dialed) -> None:
            end = time.monotonic() + 10
            while not stop.is_set() and time.monotonic() < end:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(address)
                except OSError:
                    s.close()
                    time.sleep(0.0005)
                    continue
                dialed.append(s)
                time.sleep(0.0003)

        dialer = threading.Thread(target=dial, daemon=True)
        dialer.start()
        try:
            await asyncio.sleep(0.02 + (i % 7) * 0.001)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                await b.close()
                stop.set()
                await asyncio.to_thread(dialer.join, 10)
                await asyncio.sleep(0)
                gc.collect()
            leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
            assert not leaked, (i, leaked[:2])
            assert dialed, "no connection was made while the endpoint was open"
        finally:
            stop.set()
            for s in dialed:
                s.close()


async def test_a_peer_that_closes_while_we_send_is_closed_orderly_not_lost(store_url, uname, caplog):
    """A peer says Bye and closes its socket while this side keeps posting: a post that meets the
    closed socket (EPIPE on a Unix socket, at once) must not turn the peer's orderly close into a
    lost channel (a WARNING at every shutdown): the reader still reads the Bye. Five peers in a row,
    each closed in the middle of a stream of posts."""
    async with transport.Endpoint(uname("init"), store=store_url, timeout=30) as ep:
        for _ in range(5):
            target = RemoteEndpoint(uname("tgt"), store=store_url, timeout=30)
            try:
                peer = await ep.connect(target.name)
                assert peer.socket == "unix"
                stop = asyncio.Event()

                async def flood(name: str = target.name, stop: asyncio.Event = stop) -> int:
                    n = 0
                    while not stop.is_set():
                        try:
                            if not ep.post_nowait(name, b"x" * 512):
                                break  # (the channel is gone)
                        except transport.PeerLostError:
                            break
                        n += 1
                        if n % 16 == 0:
                            await asyncio.sleep(0)
                    return n

                with caplog.at_level(logging.INFO, logger="transport.endpoint"):
                    caplog.clear()
                    task = asyncio.ensure_future(flood())
                    await asyncio.sleep(0.05)
                    await asyncio.to_thread(target.stop)  # an orderly close: Bye, then the socket closes
                    for _ in range(200):  # (bounded: 10 s)
                        if target.name not in ep.peers:
                            break
                        await asyncio.sleep(0.05)
                    stop.set()
                    posted = await asyncio.wait_for(task, 10)
                assert posted > 0 and target.name not in ep.peers
                msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
                assert any("closed by" in m and target.name in m for m in msgs), msgs
                assert not any(" lost: " in m and target.name in m for m in msgs), msgs
            finally:
                target.kill()


def _listen_abstract(name: str):
    import socket

    from transport.local_socket import unix_address

    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(unix_address(name))
    lsock.listen(8)
    return lsock


async def test_a_process_squatting_on_a_published_unix_name_is_not_dialled(store_url, uname, caplog):
    """Anyone on the host may listen on an abstract name: a record whose Unix name leads to another
    process than the endpoint it names (checked with SO_PEERCRED) is dialled over TCP instead."""
    target = RemoteEndpoint(uname("tgt"), store=store_url, timeout=30)
    squat = _listen_abstract(f"transport-rl/squat-{uname('x')}")
    try:
        target.call("register", "t", "float32", [64])
        async with transport.Endpoint(uname("init"), store=HashStore(), timeout=30) as ep:
            async with transport.Endpoint(uname("book"), store=store_url, timeout=30) as reader:
                # the target's record as the store has it, its Unix name pointed at the squatter
                rec = await reader._rdv.lookup(target.name, __import__("time").monotonic() + 10)
            assert rec.unix and rec.hostinfo.pid == target.pid
            squatted = msgspec.structs.replace(rec, unix=squat.getsockname()[1:].decode())
            secret = reader._secret  # (the job's secret: the store's)
            ep.add_peer(encode_address(squatted, secret))
            with caplog.at_level(logging.WARNING, logger="transport.endpoint"):
                await ep.put(target.name, {"t": make_tensor("float32", (64,), 9)}, timeout=10)
            assert target.call("check", "t", 9)
            assert (await ep.connect(target.name)).socket == "tcp"
            assert any("is not the endpoint's" in r.getMessage() for r in caplog.records), caplog.records
    finally:
        squat.close()
        target.kill()


async def test_a_proof_made_for_a_unix_socket_fails_at_the_real_endpoints_tcp_listener():
    """The handshake's proofs are bound to the listener they were made for: a relay that listens
    on a Unix name (and passes the peer-process check, being the process the record names) and
    forwards the bytes to the real endpoint's TCP port gets the handshake refused there."""
    import socket
    import threading

    async with (
        transport.Endpoint("a", store=HashStore(), timeout=10) as a,
        transport.Endpoint("b", store=HashStore(), timeout=10) as b,
    ):
        rec, secret = decode_address(b.address_record())
        relay = _listen_abstract("transport-rl/relay-test-" + __import__("secrets").token_hex(4))
        relay_name = relay.getsockname()[1:].decode()

        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        def serve() -> None:
            try:
                conn, _ = relay.accept()
            except OSError:
                return
            with conn, socket.create_connection((rec.host, rec.port)) as up:
                back = threading.Thread(target=pump, args=(conn, up), daemon=True)
                back.start()
                pump(up, conn)
                back.join(10)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        try:  # (both in this process: the record's pid is the relay's, so only the proof can refuse it)
            a.add_peer(encode_address(msgspec.structs.replace(rec, unix=relay_name), secret))
            with pytest.raises(transport.AuthenticationError):
                await a.connect("b", timeout=5)
        finally:
            relay.close()
            await asyncio.to_thread(server.join, 10)
