"""The public API: registry, bad input, notifications, lifecycle, store options, blocking facade.

Two real endpoints in one process talk over real sockets and shared memory;
the multi-process suites live in test_conformance.py and test_faults.py.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import threading
import time

import pytest
import torch
from torch.distributed import TCPStore

import transport
from tests._remote import backing, open_fds
from transport import errors


def test_public_names_are_exported():
    for name in transport.__all__:
        assert hasattr(transport, name), name
    assert issubclass(transport.TransportTimeoutError, TimeoutError)
    for cls in (transport.UnknownBufferError, transport.BufferMismatchError, transport.PeerNotFoundError,
                transport.PeerLostError, transport.TransportTimeoutError, transport.EndpointClosedError,
                transport.StagingError):
        assert issubclass(cls, transport.TransportError)
        assert getattr(errors, cls.__name__) is cls


async def test_register_and_buffer_specs(pair):
    a, b = pair
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    keep = w
    spec = b.register("w", w)
    assert w is keep and torch.equal(w, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert spec == transport.BufferSpec("w", torch.float32, torch.Size([3, 4]), "cpu", 48)
    assert b.buffers == {"w": spec}
    peer = await a.connect(b.name)
    assert isinstance(peer.buffers["w"].dtype, torch.dtype)
    assert isinstance(peer.buffers["w"].shape, torch.Size)
    assert peer.buffers["w"] == spec
    # same tensor, same name: a no-op; another spec under that name: an error naming both
    b.register("w", w)
    with pytest.raises(transport.BufferMismatchError, match="already registered"):
        b.register("w", torch.zeros(5))
    b.unregister("w")
    with pytest.raises(transport.UnknownBufferError):
        b.unregister("w")
    await asyncio.sleep(0.2)
    assert "w" not in peer.buffers


async def test_new_buffer_is_registered_zeros_and_discard_skips_the_copy_back(pair):
    a, b = pair
    t = b.new_buffer("fresh", (64, 3), torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (64, 3) and not t.any()
    assert b.buffers["fresh"] == transport.BufferSpec("fresh", torch.bfloat16, torch.Size([64, 3]), "cpu", 384)
    if "shm" in b.planes:  # made in its segment: registering moved nothing
        assert "memfd:transport:fresh" in backing(t.data_ptr())[0]
    data = torch.randn(64, 3).to(torch.bfloat16)
    await a.put(b.name, {"fresh": data})
    assert torch.equal(t, data)
    assert b.new_buffer("none", (0, 5), torch.float32).shape == (0, 5)
    with pytest.raises(transport.BufferMismatchError):
        b.new_buffer("fresh", (2,), torch.float32)
    with pytest.raises(transport.InvalidTensorError):
        b.new_buffer("bad", (-1,), torch.float32)
    with pytest.raises(transport.InvalidTensorError, match="CPU or CUDA"):
        b.new_buffer("bad", (2,), torch.float32, device="meta")
    with pytest.raises(transport.InvalidTensorError, match="bad device"):
        b.new_buffer("bad", (2,), torch.float32, device="nowhere:3")
    assert "bad" not in b.buffers
    assert b.new_buffer("here", (3,), device="cpu").device.type == "cpu"
    b.unregister("fresh", discard=True)
    assert t.numel() == 0, "discard leaves the tensor empty"
    with pytest.raises(transport.UnknownBufferError):
        await a.put(b.name, {"fresh": data})


async def test_unregister_without_copy_back_leaves_the_tensor_where_it_is(pair):
    """``copy_back=False``: the buffer leaves the registry (peers' ops on it fail) but its tensor is
    not copied into private memory: same address, same bytes; registered again, peers reach it."""
    a, b = pair
    t = b.new_buffer("kept", (1 << 16,), torch.float32)
    data = torch.randn(1 << 16)
    await a.put(b.name, {"kept": data})
    ptr = t.data_ptr()
    b.unregister("kept", copy_back=False)
    assert "kept" not in b.buffers and t.data_ptr() == ptr and torch.equal(t, data)
    with pytest.raises(transport.UnknownBufferError):
        await a.put(b.name, {"kept": data})
    b.register("kept", t)  # (its segment was let go of: registering exports it again)
    await a.put(b.name, {"kept": data * 2})
    assert torch.equal(t, data * 2)
    b.unregister("kept")  # the default copies it back into private memory
    if "shm" in b.planes:
        assert t.data_ptr() != ptr and "memfd" not in backing(t.data_ptr())[0]
    assert torch.equal(t, data * 2)


async def test_new_buffer_segments_are_closed_without_an_open(store_url, uname):
    """Made before the endpoint opens, a buffer's segment waits for its export at open; unregistered
    or closed before that, the segment is closed (nothing leaks, and a failed registration says why)."""
    ep = transport.Endpoint(uname("x"), store=store_url)
    kept = [ep.new_buffer(f"b{i}", (1000,)) for i in range(3)]
    ep.unregister("b0")
    assert len([s for s in ep._exports.exporter("shm").segments if s.fd >= 0]) == 2
    with pytest.raises(transport.BufferMismatchError):
        ep.new_buffer("b1", (1000,))
    assert len([s for s in ep._exports.exporter("shm").segments if s.fd >= 0]) == 2
    await ep.close()  # never opened
    assert not [s for s in ep._exports.exporter("shm").segments if s.fd >= 0]
    assert all(t.shape == (1000,) and not t.any() for t in kept)  # the tensors stay valid


async def test_unregistering_a_view_before_open_keeps_the_new_buffer_in_its_segment(store_url, uname):
    ep = transport.Endpoint(uname("x"), store=store_url)
    arena = ep.new_buffer("arena", (100,), torch.float32)
    ep.register("head", arena[:10])
    ep.unregister("head")
    where = arena.data_ptr()
    async with ep:
        assert arena.data_ptr() == where, "the arena was copied into a new segment at open"


async def test_route_names_the_plane_an_op_takes_and_why(pair):
    a, b = pair
    b.register("w", torch.zeros(4, 4))
    route = await a.route(b.name, {"w": torch.ones(4, 4)})
    peer = await a.connect(b.name)
    assert isinstance(route, transport.Route) and route == (peer.plane, peer.plane_reason) and route.reason
    assert route.plane == a.planes[0]
    assert peer.same_host is True  # (two endpoints of this process)
    assert peer.maps_memory() is (route.plane == "shm")  # (shm maps the peer's segments; tcp moves bytes)
    assert await a.route(b.name, {"w": transport.At(torch.zeros(2), 3)}) == route  # ranges too
    with pytest.raises(transport.UnknownBufferError):  # checked like put and get
        await a.route(b.name, {"nope": torch.zeros(1)})
    with pytest.raises(transport.BufferMismatchError):
        await a.route(b.name, {"w": torch.zeros(5)})
    with pytest.raises(transport.PeerNotFoundError):
        await a.route("nobody-here", {"w": torch.zeros(4, 4)}, timeout=0.2)
    assert not b._registry.get("w").tensor.any()  # no byte moved


async def test_registered_parameter_keeps_working(pair):
    a, b = pair
    lin = torch.nn.Linear(4, 3)
    b.register("lin.weight", lin.weight)
    new = torch.randn(3, 4)
    await a.put(b.name, {"lin.weight": new})
    assert torch.equal(lin.weight.detach(), new)
    assert lin.weight.requires_grad
    lin(torch.randn(2, 4)).sum().backward()
    assert lin.weight.grad is not None


async def test_registration_after_connect_is_seen_by_the_peer(pair):
    a, b = pair
    await a.connect(b.name)
    t = torch.zeros(8, dtype=torch.int64)
    b.register("late", t)
    await a.put(b.name, {"late": torch.arange(8)})  # the stale cache is refreshed, not an error
    assert torch.equal(t, torch.arange(8))


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ({"nope": torch.zeros(4)}, transport.UnknownBufferError, "no buffer named 'nope'"),
        ({"w": torch.zeros(4, dtype=torch.float64)}, transport.BufferMismatchError, "float32"),
        ({"w": torch.zeros(5)}, transport.BufferMismatchError, "shape"),
        ({"w": torch.zeros(2, 2)}, transport.BufferMismatchError, "shape"),
        ({"w": torch.zeros(8)[::2]}, transport.InvalidTensorError, "contiguous"),
        ({"w": transport.At(torch.zeros(3), 2)}, transport.BufferMismatchError, "out of range"),
        ({"w": transport.At(torch.zeros(1), -1)}, transport.BufferMismatchError, "offset"),
        ({"w": [1.0, 2.0]}, transport.InvalidTensorError, "torch.Tensor"),
        ({}, transport.InvalidTensorError, "no buffers"),
    ],
    ids=["unknown", "dtype", "size", "shape", "noncontig", "range", "negative", "notatensor", "empty"],
)
@pytest.mark.parametrize("op", ["put", "get"])
async def test_bad_input_raises_before_any_byte_moves(pair, bad, exc, match, op):
    a, b = pair
    w = torch.full((4,), 7.0)
    b.register("w", w)
    with pytest.raises(exc, match=match):
        await getattr(a, op)(b.name, bad)
    assert torch.equal(w, torch.full((4,), 7.0)), "a rejected op changed the target"
    # the next valid op on the same endpoint succeeds
    await a.put(b.name, {"w": torch.arange(4.0)})
    assert torch.equal(w, torch.arange(4.0))


async def test_register_rejects_bad_tensors(pair):
    _, b = pair
    with pytest.raises(transport.InvalidTensorError, match="contiguous"):
        b.register("x", torch.zeros(4, 4).t())
    with pytest.raises(transport.InvalidTensorError):
        b.register("x", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(transport.InvalidTensorError):
        b.register("", torch.zeros(2))
    assert b.buffers == {}


async def test_notifications_stream_and_callback(pair):
    a, b = pair
    b.register("w", torch.zeros(3))
    await a.put(b.name, {"w": torch.ones(3)}, notify=b"first")
    await a.notify(b.name, b"second")
    got = []
    async for note in b.notifications():
        got.append(note)
        if len(got) == 2:
            break
    assert [(n.peer, n.payload) for n in got] == [(a.name, b"first"), (a.name, b"second")]
    seen = []
    b.on_notification(seen.append)
    await a.notify(b.name, b"third")
    assert [n.payload for n in seen] == [b"third"]
    b.on_notification(None)
    with pytest.raises(transport.TransportTimeoutError):
        await b.next_notification(timeout=0.1)
    with pytest.raises(transport.InvalidTensorError):
        await a.notify(b.name, "not bytes")  # type: ignore[arg-type]
    with pytest.raises(transport.InvalidTensorError):
        await a.notify(b.name, b"x" * (2 << 20))


async def test_posted_notifications_arrive_in_order_unanswered(pair):
    """``post`` is ``notify`` without the answer: the target's flight recorder has each one done
    and nothing goes back (no Ack), the initiator's has it done once handed to the channel."""
    a, b = pair
    w = torch.zeros(3)
    b.register("w", w)
    await a.post(b.name, b"p0")
    await a.put(b.name, {"w": torch.full((3,), 7.0)}, notify=b"n1")
    for i in range(2, 40):
        await a.post(b.name, b"p%d" % i)
    got = [(await b.next_notification(timeout=10)).payload for _ in range(40)]
    assert got == [b"p0", b"n1"] + [b"p%d" % i for i in range(2, 40)]
    assert torch.equal(w, torch.full((3,), 7.0))
    ini = [r for r in a.recorder.snapshot() if r["kind"] == "post" and r["role"] == "initiator"]
    deadline = time.monotonic() + 10  # (the reader marks a post done just after it delivered it: the last may lag)
    while True:
        tgt = [r for r in b.recorder.snapshot() if r["kind"] == "post" and r["role"] == "target"]
        if all(r["state"] == "done" for r in tgt) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    assert len(ini) == len(tgt) == 39 and all(r["state"] == "done" for r in ini + tgt)
    assert [r["kind"] for r in b.recorder.snapshot() if r["role"] == "target"].count("notify") == 0  # (n1: its put's)
    with pytest.raises(transport.InvalidTensorError):
        await a.post(b.name, "not bytes")  # type: ignore[arg-type]
    with pytest.raises(transport.InvalidTensorError):
        await a.post(b.name, b"x" * (2 << 20))
    with pytest.raises(transport.PeerNotFoundError):
        await a.post("nobody-" + a.name, b"x", timeout=0.5)


async def test_post_nowait_posts_only_over_an_open_channel_and_keeps_the_order(pair):
    """``post_nowait`` sends right away where a channel is open (True), never dials (False, nothing
    sent), keeps the channel's order with ops before it, and is recorded like ``post``."""
    a, b = pair
    w = torch.zeros(5)
    b.register("w", w)
    assert a.post_nowait(b.name, b"never sent") is False  # no channel yet: not dialled, nothing sent
    assert b.name not in a.peers and a.peer(b.name) is None and a.peer(42) is None  # type: ignore[arg-type]
    await a.put(b.name, {"w": torch.full((5,), 3.0)}, notify=b"n0")
    assert a.peer(b.name) is a.peers[b.name] and a.peer(b.name).connected
    sent = [a.post_nowait(b.name, b"q%d" % i) for i in range(1, 30)]
    assert all(sent)
    got = [(await b.next_notification(timeout=10)).payload for _ in range(30)]
    assert got == [b"n0"] + [b"q%d" % i for i in range(1, 30)]
    assert torch.equal(w, torch.full((5,), 3.0))
    ini = [r for r in a.recorder.snapshot() if r["kind"] == "post" and r["role"] == "initiator"]
    assert len(ini) == 29 and all(r["state"] == "done" for r in ini)  # (n0 went with its put)
    with pytest.raises(transport.InvalidTensorError):
        a.post_nowait(b.name, b"x" * (2 << 20))
    with pytest.raises(transport.InvalidTensorError):
        a.post_nowait(b.name, "not bytes")  # type: ignore[arg-type]
    with pytest.raises(transport.TransportTimeoutError):
        await b.next_notification(timeout=0.2)  # (nothing else arrived: the refused ones were not sent)


async def test_notification_routes_by_prefix(pair):
    """A library takes its own messages by prefix (longest wins); the application reads the rest."""
    a, b = pair
    lib, sub = [], []
    b.on_notification(lib.append, prefix=b"lib:")
    b.on_notification(sub.append, prefix=b"lib:sub:")
    for payload in (b"lib:x", b"app", b"lib:sub:y", b"li"):
        await a.notify(b.name, payload)
    assert [n.payload for n in lib] == [b"lib:x"] and [n.payload for n in sub] == [b"lib:sub:y"]
    assert (await b.next_notification(timeout=5)).payload == b"app"
    assert (await b.next_notification(timeout=5)).payload == b"li"
    b.on_notification(None, prefix=b"lib:")
    await a.notify(b.name, b"lib:z")
    assert (await b.next_notification(timeout=5)).payload == b"lib:z" and len(lib) == 1
    with pytest.raises(TypeError):
        b.on_notification(lib.append, prefix="lib:")  # type: ignore[arg-type]


async def test_use_after_close(store_url, uname):
    ep = transport.Endpoint(uname("c"), store=store_url)
    with pytest.raises(transport.EndpointClosedError):
        await ep.put("x", {"w": torch.zeros(1)})
    async with ep:
        pass
    for call in (ep.connect("x"), ep.put("x", {"w": torch.zeros(1)}), ep.get("x", {"w": torch.zeros(1)}),
                 ep.notify("x", b""), ep.post("x", b""), ep.next_notification()):
        with pytest.raises(transport.EndpointClosedError):
            await call
    with pytest.raises(transport.EndpointClosedError):
        ep.register("w", torch.zeros(1))
    await ep.close()  # idempotent


def _torn_down(out: dict[str, bool], key: str, ep: transport.Endpoint, _task: object) -> None:
    out.setdefault(key, ep._listener is None)


@pytest.mark.timeout(120)
async def test_concurrent_and_cancelled_closes_return_only_once_closed(store_url, uname):
    """Two tasks close an endpoint with an open channel at once: each returns only once it is
    closed (its sockets and threads' pipes released, and once the endpoint object is dropped its
    segments), never earlier; a close() that is cancelled stops waiting, and the close still runs
    to its end."""
    async with transport.Endpoint(uname("warm"), store=store_url, timeout=10) as warm:  # (one-time set-up)
        warm.register("x", torch.zeros(4))
    async with transport.Endpoint(uname("b"), store=store_url, timeout=10) as b:
        b.register("x", torch.zeros(1024))
        for cancel in (False, True):
            names = open_fds()
            before = len(names)
            a = transport.Endpoint(uname("a"), store=store_url, timeout=10)
            await a.open()
            a.register("mine", torch.zeros(1024))
            await a.put(b.name, {"x": torch.ones(1024)})
            first = asyncio.ensure_future(a.close())
            second = asyncio.ensure_future(a.close())
            await asyncio.sleep(0)
            if cancel:
                first.cancel()
                second.cancel()
                await asyncio.gather(first, second, return_exceptions=True)
                deadline = time.monotonic() + 10
                while repr(a).split()[2] != "closed" and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
            else:
                done_at = {}
                # (torn down: its listening socket closed, the last step of a close)
                for key, task in (("first", first), ("second", second)):
                    task.add_done_callback(functools.partial(_torn_down, done_at, key, a))
                await asyncio.wait_for(asyncio.gather(first, second), 15)
                assert done_at == {"first": True, "second": True}, done_at
            assert not a.is_open and " closed " in repr(a), repr(a)
            await asyncio.wait_for(a.close(), 5)  # (a later one returns at once)
            del a, first, second  # (its registered tensor and slot table's mappings hold their memfds)
            gc.collect()
            deadline = time.monotonic() + 5
            while len(open_fds()) > before and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            left = open_fds()
            for n in names:
                if n in left:
                    left.remove(n)
            assert len(open_fds()) <= before, (cancel, before, left)


async def test_pending_ops_fail_when_the_peer_closes(store_url, uname):
    async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",)) as a:
        b = transport.Endpoint(uname("b"), store=store_url, planes=("tcp",), max_pending_notifications=1)
        await b.open()
        await a.notify(b.name, b"fills the queue")
        pending = asyncio.ensure_future(a.notify(b.name, b"blocked: b reads no notifications", timeout=30))
        await asyncio.sleep(0.3)
        assert not pending.done()
        await b.close()
        with pytest.raises(transport.PeerLostError):
            await asyncio.wait_for(pending, 10)


async def test_unknown_peer_times_out_as_not_found(store_url, uname):
    async with transport.Endpoint(uname("a"), store=store_url) as a:
        with pytest.raises(transport.PeerNotFoundError, match="no endpoint named"):
            await a.connect("ghost", timeout=0.3)
        with pytest.raises(transport.PeerNotFoundError):
            await a.connect("", timeout=0.3)


async def test_store_from_master_addr_and_store_object(monkeypatch, uname):
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    async with transport.Endpoint(uname("env")) as a:  # torchrun style
        async with transport.Endpoint(uname("obj"), store=store) as b:
            b.register("w", torch.zeros(2))
            await a.put(b.name, {"w": torch.ones(2)})
            assert torch.equal(b._registry.get("w").tensor, torch.ones(2))


def test_bad_arguments():
    with pytest.raises(ValueError, match="planes"):
        transport.Endpoint("x", planes=("carrier-pigeon",))
    with pytest.raises(ValueError):
        transport.Endpoint("")
    with pytest.raises(ValueError):
        transport.Endpoint("a/b")
    with pytest.raises(ValueError, match="takes no engine"):
        transport.Endpoint("x", engines={"shm": object})
    with pytest.raises(ValueError, match="must be a zero-argument factory"):
        transport.Endpoint("x", engines={"nccl": 3})
    with pytest.raises(ValueError, match="engines must map"):
        transport.Endpoint("x", engines=[("nccl", object)])


def test_plane_status_says_what_each_plane_came_to():
    from transport.planes.cuda_ipc_memfd import MemfdIpcEngine

    ep = transport.Endpoint("x", planes=("shm", "cuda_ipc"), engines={"cuda_ipc": MemfdIpcEngine})
    assert ep.plane_status("shm") == (True, "allowed")
    offered, why = ep.plane_status("cuda_ipc")
    assert offered and "memfd" in why
    offered, why = ep.plane_status("tcp")
    assert not offered and "not allowed here" in why
    offered, why = ep.plane_status("nccl")
    assert not offered and "not allowed here" in why
    assert ep.plane_status("staged")[0]
    with pytest.raises(ValueError, match="unknown plane"):
        ep.plane_status("carrier-pigeon")
    with pytest.raises(ValueError, match="is a str"):
        ep.plane_status(["shm"])  # type: ignore[arg-type]


def test_plane_status_reports_a_failing_engine_factory_and_never_starts_cuda():
    def broken():
        raise RuntimeError("no engine today")

    ep = transport.Endpoint("x", engines={"cuda_ipc": broken, "nccl": None})  # (None: the default)
    offered, why = ep.plane_status("cuda_ipc")
    assert not offered and "RuntimeError: no engine today" in why
    default = transport.Endpoint("y")
    offered, why = default.plane_status("cuda_ipc")
    assert offered and "CUDA is not in use" in why and not torch.cuda.is_initialized()


async def test_store_url_must_be_tcp(uname):
    with pytest.raises(transport.TransportError):
        async with transport.Endpoint(uname("x"), store="http://127.0.0.1:1"):
            pass


def test_blocking_facade_keeps_the_endpoints_errors(store_url, uname):
    with transport.BlockingEndpoint(uname("bt"), store=store_url, timeout=10) as ep:
        with pytest.raises(transport.TransportTimeoutError) as info:
            ep.next_notification(timeout=0.2)
        assert info.value.phase is transport.errors.Phase.NOTIFY
        assert "no notification" in str(info.value)
    before = threading.active_count()
    for _ in range(3):
        with pytest.raises(ValueError):
            transport.BlockingEndpoint("a/b")
    assert threading.active_count() == before


def test_blocking_facade(store_url, uname):
    with transport.BlockingEndpoint(uname("bt"), store=store_url, timeout=10) as tgt:
        w = torch.zeros(10)
        tgt.register("w", w)
        with transport.BlockingEndpoint(uname("bi"), store=store_url, timeout=10) as ini:
            src = torch.randn(10)
            ini.put(tgt.name, {"w": src}, notify=b"hi")
            assert torch.equal(w, src)
            assert tgt.next_notification(5).payload == b"hi"
            out = torch.zeros(10)
            ini.get(tgt.name, {"w": out})
            assert torch.equal(out, src)
            with pytest.raises(transport.UnknownBufferError):
                ini.put(tgt.name, {"nope": src})
            # what the async endpoint says of its peers, from a thread
            peer = ini.peer(tgt.name)
            assert peer is not None and peer.name == tgt.name and peer.same_host
            assert set(ini.peers) == {tgt.name} and ini.peer("nobody") is None
            route = ini.route(tgt.name, {"w": src})
            assert route.plane == "shm" and route.reason
            with pytest.raises(transport.UnknownBufferError):
                ini.route(tgt.name, {"nope": src})
            ok, why = ini.plane_status("tcp")
            assert ok and why
            with pytest.raises(ValueError):
                ini.plane_status("carrier-pigeon")
            # on the loop thread (a notification callback) the accessors answer too, without blocking
            assert ini.call_in_loop(lambda: ini.peer(tgt.name)) is not None
            assert set(ini.call_in_loop(lambda: ini.peers)) == {tgt.name}
            for bad in (-1.0, float("nan")):  # the endpoint's ValueError, not a timeout of the wait
                with pytest.raises(ValueError):
                    ini.route(tgt.name, {"w": src}, timeout=bad)
                with pytest.raises(ValueError):
                    ini.put(tgt.name, {"w": src}, timeout=bad)
            # works from several threads at once
            errs: list[BaseException] = []

            def worker(i: int) -> None:
                try:
                    ini.put(tgt.name, {"w": transport.At(torch.full((1,), float(i)), i)})
                except BaseException as e:  # noqa: BLE001
                    errs.append(e)

            ts = [threading.Thread(target=worker, args=(i,)) for i in range(10)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            assert not errs and torch.equal(w, torch.arange(10.0))
    with pytest.raises(transport.EndpointClosedError):
        ini.put(tgt.name, {"w": src})
    # closed: what the async endpoint says once closed
    assert ini.peers == {} and ini.peer(tgt.name) is None and ini.plane_status("tcp")[0]


async def test_close_while_open_is_running_ends_the_open_cleanly(store_url, uname):
    """close() racing open() at every point of open's awaits: open either finished first (and close
    closes normally) or raises EndpointClosedError; close returns within its bound; no task of the
    endpoint dies with an unretrieved exception, and a fresh endpoint of the same name opens after."""
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    outcomes = set()
    try:
        for k in [*range(0, 40, 3), 50, 100, 200, 400, 800]:  # loop turns, then ~ms: past every await of open
            name = uname("racy")
            ep = transport.Endpoint(name, store=store_url, timeout=10)
            opening = asyncio.ensure_future(ep.open())
            for _ in range(k):
                await asyncio.sleep(0 if k < 50 else 0.0001)
            t0 = time.monotonic()
            await ep.close(timeout=5)
            assert time.monotonic() - t0 < 6
            try:
                await asyncio.wait_for(opening, 5)
                outcomes.add("opened")
            except transport.EndpointClosedError as exc:
                if k == 0:  # (closed before open() ran at all)
                    assert "is closed" in str(exc)
                else:
                    assert "closed while it was opening" in str(exc)
                    outcomes.add("cut")
            assert not ep.is_open
            with pytest.raises(transport.EndpointClosedError):
                await ep.put(name, {"x": torch.zeros(1)})
            gc.collect()
            await asyncio.sleep(0.01)
        async with transport.Endpoint(uname("after"), store=store_url, timeout=10) as again:
            assert again.is_open
    finally:
        loop.set_exception_handler(None)
    assert outcomes == {"cut", "opened"}, outcomes  # (the race was really hit, and so was an open that won)
    assert errors == [], errors
