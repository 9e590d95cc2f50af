"""The staged path through real endpoints, on CPU.

``StagingConfig(cpu_engine=...)`` makes an endpoint stage its CPU tensors exactly as it stages
CUDA tensors (same plane choice, same wire, same reader/writer code, same pipeline); only the
copy engine differs (a worker thread instead of a CUDA stream). So these tests drive the GPU
code path end to end between real processes and sockets; what they cannot show is the CUDA
engine itself (tests/gpu/ does, on a GPU). Fresh random data, destinations poisoned first,
byte equality on the receiving side.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
import uuid

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint, make_tensor, poisoned, put_get_every_shape, same_bytes
from transport.errors import StagingError
from transport.planes import choose_gpu_plane, validate_planes
from transport.staging import StagingConfig, ThreadCopyEngine
from transport.wire import HostInfo

CHUNK = 4096
STAGED = StagingConfig(chunk_bytes=CHUNK, buffers=3, cpu_engine=ThreadCopyEngine)
# sizes around the chunk: one byte, not a multiple, exact multiples, many chunks
SHAPES = [(), (0,), (1,), (1023,), (1024,), (1025,), (3, 1000), (40, 1031)]
_seeds = itertools.count(5000)


def seed() -> int:
    return next(_seeds)


# ---------------------------------------------------------------------------- between processes
# (plane, which side stages: each side decides alone; the wire is the same). Both sides staging
# over tcp is the staged plane of the conformance suite (tests/test_conformance.py).
_SETUPS = [("tcp", "init-stages"), ("tcp", "target-stages"),
           ("shm", "both-stage"), ("shm", "init-stages"), ("shm", "target-stages")]


@pytest.fixture(scope="module", params=_SETUPS, ids=[f"{p}-{s}" for p, s in _SETUPS])
def setup(request):
    return request.param


@pytest.fixture(scope="module")
def plane(setup):
    return setup[0]


@pytest.fixture(scope="module")
def sides(setup):
    return setup[1]


@pytest.fixture(scope="module")
def target(store_url, plane, sides):
    """A target process that stages its buffers (as if they were on a GPU), or not."""
    staging = STAGED if sides != "init-stages" else None
    t = RemoteEndpoint(f"stg-{sides}-{plane}-{uuid.uuid4().hex[:6]}", store=store_url, planes=(plane,),
                       staging=staging)
    try:
        yield t
    finally:
        t.stop()


@pytest.fixture
async def init(store_url, uname, plane, sides):
    """The initiator, staging or not. (Over shm, a plain initiator copies straight into a staging
    target's CPU buffers: only a GPU buffer, which no CPU test can have, forces those ops inline;
    a staging initiator copies through its bounce buffers into the target's segments.)"""
    staging = STAGED if sides != "target-stages" else None
    async with transport.Endpoint(uname("init"), store=store_url, planes=(plane,), timeout=30,
                                  staging=staging) as ep:
        yield ep


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8", "int64", "bool"])
async def test_put_and_get_between_processes(init, target, sides, dtype, uname):
    for shape in SHAPES:
        name = uname("w")
        target.call("register", name, dtype, shape)
        s = seed()
        await init.put(target.name, {name: make_tensor(dtype, shape, s)})
        assert target.call("check", name, s), f"put {dtype}{shape}: the target holds other bytes"
        out = poisoned(dtype, shape)
        await init.get(target.name, {name: out})
        assert same_bytes(out, make_tensor(dtype, shape, s)), f"get {dtype}{shape}: other bytes came back"
    await settle(init)
    st = init.staging.statistics()
    if sides != "target-stages":  # our tensors went through our bounce buffers, over shm too (into the segments)
        assert st.peak_in_use > 0 and st.in_use == 0, st
    else:
        assert st.peak_in_use == 0, st
    end = time.monotonic() + 10  # the target's writer returns a ring once it has sent the last chunk
    while target.call("staging_stats")["in_use"]:
        assert time.monotonic() < end, "the target still holds bounce buffers"
        await asyncio.sleep(0.02)


async def test_sub_ranges_and_several_buffers_in_one_op(init, target, uname):
    a, b = uname("a"), uname("b")
    target.call("register", a, "float32", (5000,))
    target.call("register", b, "int32", (10, 300))
    sa, sb = seed(), seed()
    part = make_tensor("float32", (1500,), sa)
    whole = make_tensor("int32", (10, 300), sb)
    await init.put(target.name, {a: transport.At(part, 1234), b: whole})
    assert target.call("check_range", a, sa, 1234, 1500)
    assert target.call("check", b, sb)
    back = {a: transport.At(poisoned("float32", (1500,)), 1234), b: poisoned("int32", (10, 300))}
    await init.get(target.name, back)
    assert same_bytes(back[a].tensor, part) and same_bytes(back[b], whole)


async def test_the_target_puts_and_gets_back(init, target, uname):
    """The other direction on the same channel: the target is the initiator."""
    name = uname("back")
    dst = poisoned("float16", (777, 9))
    init.register(name, dst)
    s = seed()
    # the target dials us: our loop must keep running meanwhile
    await asyncio.to_thread(target.call, "put", init.name, {name: ("float16", (777, 9), s)}, 30)
    assert same_bytes(dst, make_tensor("float16", (777, 9), s))
    got = await asyncio.to_thread(target.call, "get_check", init.name, {name: ("float16", (777, 9), s)}, 30)
    assert got == {name: True}


async def test_gpu_plane_choice_is_reported(init, target, plane):
    peer = await init.connect(target.name)
    assert peer.plane == plane  # CPU buffers keep their plane
    assert peer.gpu_plane == "staged"
    assert "cuda_ipc: not allowed here" in peer.gpu_plane_reason  # planes=(plane,)
    assert "nccl: not allowed here" in peer.gpu_plane_reason


# ---------------------------------------------------------------------------- failures, in one process
class Counting(ThreadCopyEngine):
    """Counts copies; copy number ``fail_at`` fails on the worker (as a device error would);
    each copy may take ``delay`` seconds (a slow device)."""

    def __init__(self, fail_at: int | None = None, delay: float = 0.0) -> None:
        super().__init__()
        self.fail_at, self.delay, self.calls = fail_at, delay, 0
        self._mu = threading.Lock()

    def _copy(self, dst, src):
        with self._mu:
            self.calls += 1
            n = self.calls
        if self.delay:
            time.sleep(self.delay)
        if n == self.fail_at:
            raise RuntimeError(f"injected device error in copy {n}")
        dst.copy_(src)


def config(engine: ThreadCopyEngine) -> StagingConfig:
    return StagingConfig(chunk_bytes=CHUNK, buffers=3, stall_timeout=5.0, cpu_engine=lambda: engine)


@pytest.fixture(params=["tcp", "shm"])
async def endpoints(request, store_url, uname):
    """make(init_engine, target_engine): two endpoints in this process, staging through those engines."""
    async with endpoint_pairs(store_url, uname, request.param) as make:
        yield lambda ie, te: make(config(ie) if ie is not None else None, config(te) if te is not None else None)


@contextlib.asynccontextmanager
async def endpoint_pairs(store_url: str, uname, plane: str):
    """make(init_staging, target_staging): two endpoints in this process over ``plane``; all closed at the end."""
    opened: list[transport.Endpoint] = []

    async def make(*stagings: StagingConfig | None):
        for staging in stagings:
            ep = transport.Endpoint(uname("f"), store=store_url, planes=(plane,), timeout=10, staging=staging)
            await ep.open()
            opened.append(ep)
        return opened[-2], opened[-1]

    try:
        yield make
    finally:
        for ep in opened:
            await ep.close()


async def settle(*eps: transport.Endpoint, timeout: float = 10.0) -> None:
    """Wait (bounded) until no endpoint holds bounce buffers."""
    end = time.monotonic() + timeout
    while any(ep.staging.statistics().in_use for ep in eps):
        assert time.monotonic() < end, [ep.staging.statistics() for ep in eps]
        await asyncio.sleep(0.02)


async def test_bad_input_raises_before_any_copy(endpoints):
    ie, te = Counting(), Counting()
    a, b = await endpoints(ie, te)
    w = torch.full((3000,), 7.0)
    b.register("w", w)
    for bad, exc in [({"w": torch.zeros(3000, dtype=torch.float64)}, transport.BufferMismatchError),
                     ({"w": torch.zeros(2999)}, transport.BufferMismatchError),
                     ({"w": transport.At(torch.zeros(10), 2995)}, transport.BufferMismatchError),
                     ({"nope": torch.zeros(3)}, transport.UnknownBufferError),
                     ({"w": torch.zeros(6000)[::2]}, transport.InvalidTensorError)]:
        for op in ("put", "get"):
            with pytest.raises(exc):
                await getattr(a, op)(b.name, bad)
    assert ie.calls == te.calls == 0, "a rejected op staged bytes"
    assert torch.equal(w, torch.full((3000,), 7.0))
    src = torch.randn(3000)
    await a.put(b.name, {"w": src})
    assert torch.equal(w, src) and ie.calls > 0 and te.calls > 0


async def test_source_failure_before_the_first_chunk_keeps_the_channel(endpoints):
    """Nothing was sent yet (the header waits for the first chunk): the op fails, the channel lives."""
    a, b = await endpoints(Counting(fail_at=1), None)
    w = torch.zeros(20 * CHUNK, dtype=torch.uint8)
    b.register("w", w)
    peer = await a.connect(b.name)
    with pytest.raises(StagingError, match="injected device error in copy 1") as info:
        await a.put(b.name, {"w": torch.randint(0, 256, w.shape, dtype=torch.uint8)})
    assert "channel was closed" not in str(info.value)
    assert peer.connected and bool((w == 0).all())
    src = torch.randint(0, 256, w.shape, dtype=torch.uint8)
    await a.put(b.name, {"w": src})
    assert torch.equal(w, src) and peer.connected
    await settle(a, b)


async def test_source_failure_mid_put_fails_the_op_and_closes_the_channel(endpoints):
    a, b = await endpoints(Counting(fail_at=4), None)
    w = torch.zeros(20 * CHUNK, dtype=torch.uint8)
    b.register("w", w)
    peer = await a.connect(b.name)
    with pytest.raises(StagingError, match="injected device error in copy 4.*channel was closed"):
        await a.put(b.name, {"w": torch.randint(0, 256, (20 * CHUNK,), dtype=torch.uint8)})
    assert not peer.connected
    await settle(a, b)
    src = torch.randint(0, 256, (20 * CHUNK,), dtype=torch.uint8)
    await a.put(b.name, {"w": src})  # a new channel
    assert torch.equal(w, src)


async def test_destination_failure_mid_put_fails_the_op_and_keeps_the_channel(endpoints):
    a, b = await endpoints(Counting(), Counting(fail_at=3))  # both stage: inline even on an shm channel
    w = torch.zeros(10 * CHUNK + 1, dtype=torch.uint8)
    b.register("w", w)
    peer = await a.connect(b.name)
    with pytest.raises(StagingError, match="injected device error in copy 3"):
        await a.put(b.name, {"w": torch.randint(0, 256, w.shape, dtype=torch.uint8)}, notify=b"not delivered")
    assert peer.connected, "the payload was drained: the channel stays in sync"
    src = torch.randint(0, 256, w.shape, dtype=torch.uint8)
    await a.put(b.name, {"w": src}, notify=b"delivered")
    assert torch.equal(w, src)
    note = await b.next_notification(timeout=5)
    assert note.payload == b"delivered"
    await settle(a, b)


async def test_get_reply_failure_on_the_initiator_keeps_the_channel(endpoints):
    a, b = await endpoints(Counting(fail_at=2), None)
    w = torch.randint(0, 256, (9 * CHUNK,), dtype=torch.uint8)
    b.register("w", w)
    peer = await a.connect(b.name)
    out = torch.zeros_like(w)
    with pytest.raises(StagingError, match="injected device error in copy 2"):
        await a.get(b.name, {"w": out})
    assert peer.connected
    out.fill_(0xA5)
    await a.get(b.name, {"w": out})
    assert torch.equal(out, w)
    await settle(a, b)


async def test_get_reply_failure_on_the_target_before_the_first_chunk_keeps_the_channel(endpoints):
    a, b = await endpoints(Counting(), Counting(fail_at=1))
    w = torch.randint(0, 256, (9 * CHUNK,), dtype=torch.uint8)
    b.register("w", w)
    peer = await a.connect(b.name)
    out = torch.full_like(w, 0xA5)
    with pytest.raises(StagingError, match="injected device error in copy 1"):
        await a.get(b.name, {"w": out})
    assert peer.connected and bool((out == 0xA5).all())
    await a.get(b.name, {"w": out})
    assert torch.equal(out, w)
    await settle(a, b)


async def test_get_reply_failure_on_the_target_fails_the_op(endpoints):
    a, b = await endpoints(Counting(), Counting(fail_at=2))
    w = torch.randint(0, 256, (9 * CHUNK,), dtype=torch.uint8)
    b.register("w", w)
    out = torch.zeros_like(w)
    with pytest.raises(transport.PeerLostError, match="staged payload could not be completed|lost"):
        await a.get(b.name, {"w": out})
    await settle(a, b)
    out.fill_(0xA5)
    await a.get(b.name, {"w": out})  # a new channel; the target's engine works again
    assert torch.equal(out, w)


async def test_cancelled_put_finishes_in_the_background_and_the_channel_stays_usable(endpoints):
    a, b = await endpoints(Counting(delay=0.005), None)
    w = torch.zeros(60 * CHUNK, dtype=torch.uint8)
    b.register("w", w)
    peer = await a.connect(b.name)
    task = asyncio.create_task(a.put(b.name, {"w": torch.randint(0, 256, w.shape, dtype=torch.uint8)}))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await settle(a, b)
    assert peer.connected
    src = torch.randint(0, 256, w.shape, dtype=torch.uint8)
    await a.put(b.name, {"w": src})
    assert torch.equal(w, src)


async def test_timed_out_get_never_writes_after_returning(endpoints):
    await timed_out_get_writes_nothing_after_returning(*await endpoints(Counting(delay=0.01), None))


async def timed_out_get_writes_nothing_after_returning(a: transport.Endpoint, b: transport.Endpoint) -> None:
    """``a`` (staging through a slow engine) gets ``b``'s buffer with a short timeout: nothing lands
    in its tensor after the get raised, the channel stays usable, and the next get works."""
    w = torch.randint(0, 256, (100 * CHUNK,), dtype=torch.uint8)
    b.register("w", w)
    peer = await a.connect(b.name)
    out = torch.full_like(w, 0xA5)
    with pytest.raises(transport.TransportTimeoutError):
        await a.get(b.name, {"w": out}, timeout=0.2)
    snapshot = out.clone()
    await asyncio.sleep(0.5)
    assert torch.equal(out, snapshot), "bytes landed in the caller's tensor after the get returned"
    assert not torch.equal(out, w) and peer.connected
    await settle(a, b)
    out.fill_(0xA5)
    await a.get(b.name, {"w": out})
    assert torch.equal(out, w)


@pytest.mark.parametrize("op", ["put", "get"])
async def test_peer_killed_mid_staged_payload(store_url, uname, op):
    """A socket failure in the middle of a staged payload (the peer process is killed): the op
    fails with PeerLostError within moments, and every bounce buffer comes back."""
    n = 32 << 20  # more than loopback socket buffers hold, so the payload is still moving at the kill
    tgt = RemoteEndpoint(uname("victim"), store=store_url, planes=("tcp",))
    try:
        if op == "put":
            tgt.call("register", "w", "uint8", (n,))
        else:
            tgt.call("register_data", "w", "uint8", (n,), seed())
        engine = Counting(delay=0.01)
        cfg = StagingConfig(chunk_bytes=256 << 10, buffers=3, cpu_engine=lambda: engine)
        async with transport.Endpoint(uname("killer"), store=store_url, planes=("tcp",), timeout=60,
                                      staging=cfg) as ep:
            await ep.connect(tgt.name)
            data = torch.randint(0, 256, (n,), dtype=torch.uint8)
            call = ep.put(tgt.name, {"w": data}) if op == "put" else ep.get(tgt.name, {"w": data})
            task = asyncio.create_task(call)
            while engine.calls < 10:  # the payload is under way
                assert not task.done(), task
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            tgt.kill()
            with pytest.raises(transport.PeerLostError):
                await asyncio.wait_for(task, 20)
            assert time.monotonic() - t0 < 10
            await settle(ep)
    finally:
        tgt.stop()


# ---------------------------------------------------------------------------- choice and checks
def test_gpu_plane_choice_and_reasons():
    here = HostInfo("h1", "boot-1", 1, 10)
    same = HostInfo("h1", "boot-1", 1, 11)
    other = HostInfo("h2", "boot-2", 1, 12)
    plane, why = choose_gpu_plane(here, same)  # no IPC engine given
    assert plane == "staged"
    assert why.startswith("cuda_ipc: no IPC engine") and "nccl: no NCCL link on this channel" in why
    plane, why = choose_gpu_plane(here, other)
    assert plane == "staged" and why.startswith("cuda_ipc: the peer is not on this host")


def test_a_peer_buffer_on_an_unknown_device_is_a_protocol_error():
    from transport.handshake import specs_from_wire
    from transport.wire import WireBuffer

    assert specs_from_wire([WireBuffer("g", "float32", [2], "cuda:3", 8)])["g"].device == "cuda:3"
    for device in ("tpu", "cuda:x", "meta", "", "cpu:0:1"):
        with pytest.raises(transport.ProtocolError, match="unknown device"):
            specs_from_wire([WireBuffer("g", "float32", [2], device, 8)])


def test_planes_argument_names_planes_that_can_be_allowed():
    assert validate_planes(("tcp",)) == ("tcp",)
    with pytest.raises(ValueError, match="unknown planes"):
        validate_planes(("staged",))


async def test_other_devices_are_refused(pair):
    _, b = pair
    with pytest.raises(transport.InvalidTensorError, match="CPU and CUDA"):
        b.register("m", torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="StagingConfig"):
        transport.Endpoint("x", staging={"chunk_bytes": 1})


def test_sender_iterator_submissions():
    """An iterator is sent whole before anything submitted after it; one that fails before its
    first buffer sends nothing and the sender goes on; one that fails later is a sender error."""
    import socket

    from transport.sender import Sender

    a, b = socket.socketpair()
    errors: list[Exception] = []
    sent: list[str] = []
    tx = Sender(a, "test", errors.append)
    tx.start()
    try:
        release = threading.Event()

        def slow():
            yield b"<1"
            release.wait(5)
            yield b"2>"

        def broken_at_once():
            raise StagingError("injected before the first buffer")
            yield b"never"  # pragma: no cover

        assert tx.submit(slow(), lambda: sent.append("slow"))
        assert tx.submit([b"[x]"], lambda: sent.append("x"))  # must not slip into the middle
        assert tx.submit(broken_at_once(), lambda: sent.append("broken"))
        assert tx.submit([b"[y]"], lambda: sent.append("y"))
        time.sleep(0.1)
        release.set()
        assert tx.flush(5)
        b.settimeout(5)
        got = b""
        while len(got) < len(b"<12>[x][y]"):
            got += b.recv(100)
        assert got == b"<12>[x][y]" and sent == ["slow", "x", "y"] and errors == []

        def broken_later():
            yield b"<half"
            raise StagingError("injected after the first buffer")

        assert tx.submit(broken_later())
        end = time.monotonic() + 5
        while not errors:
            assert time.monotonic() < end
            time.sleep(0.01)
        assert isinstance(errors[0], StagingError)
    finally:
        tx.close()
        a.close()
        b.close()


def test_sender_fast_path_carries_the_header_and_direct_max_payload_bytes():
    """The calling thread's one sendmsg carries the frame header and up to DIRECT_MAX payload bytes:
    a payload of exactly DIRECT_MAX leaves no header-sized tail for the writer thread."""
    from transport.sender import _DIRECT_MAX_PARTS, DIRECT_MAX, _head

    head = b"h" * 48
    whole = _head([head, memoryview(bytearray(DIRECT_MAX))])
    assert [len(x) for x in whole] == [48, DIRECT_MAX]
    cut = _head([head, memoryview(bytearray(DIRECT_MAX + 10)), b"tail"])
    assert [len(x) for x in cut] == [48, DIRECT_MAX]
    many = _head([head] + [b"x"] * (2 * _DIRECT_MAX_PARTS))
    assert len(many) == _DIRECT_MAX_PARTS
    assert _head([]) == []


def test_sender_closed_during_a_fast_path_send_keeps_nothing():
    """close() while the calling thread is in its fast-path sendmsg: what the kernel did not take is
    dropped, not queued for a writer that has exited (it would pin the caller's memory)."""
    import gc
    import socket
    import weakref

    import numpy as np

    from transport.sender import Sender

    class ClosesDuringSend(socket.socket):
        sender: Sender | None = None

        def sendmsg(self, *args, **kwargs):  # the real send, then a close() from "another thread"
            n = super().sendmsg(*args, **kwargs)
            assert self.sender is not None
            self.sender.close()
            return n

    a, b = socket.socketpair()
    sock = ClosesDuringSend(fileno=a.detach())
    errors: list[Exception] = []
    sent: list[bool] = []
    tx = Sender(sock, "test", errors.append)
    sock.sender = tx
    tx.start()
    try:
        payload = np.zeros(16 << 20, dtype=np.uint8)  # far more than the socket buffer takes at once
        gone = weakref.ref(payload)  # (a memoryview of it keeps it alive)
        assert tx.submit([b"hdr", memoryview(payload)], lambda: sent.append(True))
        del payload
        gc.collect()
        assert gone() is None, "the sender still holds the unsent rest of a payload after close()"
        tx.join(5)
        assert sent == [] and errors == []
        assert not tx.submit([b"more"])  # closed
    finally:
        tx.close()
        sock.close()
        b.close()
        tx.join(5)


class _BrokenWait:
    """A copy handle whose first wait raises a plain RuntimeError (an engine breaking the
    CopyEngine contract, which says StagingError)."""

    def __init__(self, inner) -> None:
        self.inner, self.broken = inner, True

    def done(self) -> bool:
        return self.inner.done()

    def wait(self, timeout: float) -> None:
        self.inner.wait(timeout)
        if self.broken:
            self.broken = False
            raise RuntimeError("injected engine bug: not a StagingError")


class BrokenWaitOnce(Counting):
    """The first copy's wait raises RuntimeError; everything else works."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def copy(self, dst, src, after=None):
        h = super().copy(dst, src, after)
        if self.armed:
            self.armed = False
            return _BrokenWait(h)
        return h


async def test_lazy_views_are_refused_before_any_copy(endpoints):
    """A lazy negative view's memory does not hold its values (and cannot be viewed as bytes):
    refused with InvalidTensorError before anything is staged or sent."""
    ie, te = Counting(), Counting()
    a, b = await endpoints(ie, te)
    w = torch.zeros(1024)
    b.register("w", w)
    for bad in ({"w": torch._neg_view(torch.randn(1024))},
                {"w": transport.At(torch._neg_view(torch.randn(10)), 3)}):
        for op in ("put", "get"):
            t0 = time.monotonic()
            with pytest.raises(transport.InvalidTensorError, match="lazy"):
                await getattr(a, op)(b.name, bad, timeout=5)
            assert time.monotonic() - t0 < 2
    with pytest.raises(transport.InvalidTensorError, match="lazy"):
        b.register("n", torch._neg_view(torch.randn(4)))
    assert ie.calls == te.calls == 0, "a refused op staged bytes"
    assert not a._channels[b.name].ops.pending
    src = torch.randn(1024)
    await a.put(b.name, {"w": src})
    assert torch.equal(w, src)


async def test_a_non_staging_error_before_the_first_chunk_fails_the_put_at_once(endpoints, caplog):
    """Any error producing a put's first chunk (here an engine raising RuntimeError) fails the op
    at once with StagingError (the error as its cause), not at its deadline; the op leaves the
    table, the writer logs the dropped payload, and the channel stays usable."""
    ie = BrokenWaitOnce()
    a, b = await endpoints(ie, None)
    w = torch.zeros(9 * CHUNK, dtype=torch.uint8)
    b.register("w", w)
    peer = await a.connect(b.name)
    src = torch.randint(0, 256, (9 * CHUNK,), dtype=torch.uint8)
    caplog.set_level("WARNING", logger="transport.sender")
    t0 = time.monotonic()
    with pytest.raises(StagingError, match="injected engine bug") as ei:
        await a.put(b.name, {"w": src}, timeout=10)
    assert time.monotonic() - t0 < 5, "the op waited for its deadline"
    assert isinstance(ei.value.__cause__, RuntimeError) or isinstance(ei.value.__cause__.__cause__, RuntimeError)
    assert not a._channels[b.name].ops.pending, "the failed op stayed in the channel's table"
    end = time.monotonic() + 5  # the writer logs after the op was failed
    while not any("dropped" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < end, "the writer did not log the dropped payload"
        await asyncio.sleep(0.01)
    assert peer.connected and bool((w == 0).all())
    await a.put(b.name, {"w": src}, timeout=10)
    assert torch.equal(w, src)
    await settle(a, b)


async def test_a_non_staging_error_before_the_first_chunk_of_a_get_reply_is_answered(endpoints):
    """The target's writer fails to produce a get reply's first chunk with a non-StagingError:
    the target answers Fail (the initiator does not wait for its deadline), its flight
    recorder says FAILED, and the channel stays usable."""
    a, b = await endpoints(Counting(), BrokenWaitOnce())
    w = torch.randint(0, 256, (9 * CHUNK,), dtype=torch.uint8)
    b.register("w", w)
    peer = await a.connect(b.name)
    out = torch.full_like(w, 0xA5)
    t0 = time.monotonic()
    with pytest.raises(StagingError, match="injected engine bug"):
        await a.get(b.name, {"w": out}, timeout=10)
    assert time.monotonic() - t0 < 5, "the op waited for its deadline"
    assert peer.connected and bool((out == 0xA5).all())
    assert not a._channels[b.name].ops.pending
    await a.get(b.name, {"w": out}, timeout=10)
    assert torch.equal(out, w)
    await settle(a, b)


async def _target_get_states(ep: transport.Endpoint, n: int, timeout: float = 5.0) -> list[str]:
    """The states of the target's get records, once ``n`` of them are final (bounded wait)."""
    end = time.monotonic() + timeout
    while True:
        recs = [r for r in ep.recorder.snapshot() if r["role"] == "target" and r["kind"] == "get"]
        states = [r["state"] for r in recs]
        if len(states) >= n and all(s in ("done", "failed", "rejected") for s in states):
            return states
        assert time.monotonic() < end, states
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("fail_at", [1, 2])
async def test_a_failed_staged_get_reply_is_recorded_failed_on_the_target(endpoints, fail_at):
    """The target's writer settles a staged get reply's record: FAILED when staging failed (before
    the header, or mid-payload), DONE only once the whole payload was sent."""
    a, b = await endpoints(Counting(), Counting(fail_at=fail_at))
    w = torch.randint(0, 256, (9 * CHUNK,), dtype=torch.uint8)
    b.register("w", w)
    out = torch.zeros_like(w)
    with pytest.raises((StagingError, transport.PeerLostError)):
        await a.get(b.name, {"w": out}, timeout=10)
    assert await _target_get_states(b, 1) == ["failed"]
    await settle(a, b)
    await a.get(b.name, {"w": out}, timeout=10)
    assert torch.equal(out, w)
    assert await _target_get_states(b, 2) == ["failed", "done"]


class _GapProbe:
    """The longest the event loop went without running a 10 ms ticker (a blocked loop shows)."""

    def __init__(self) -> None:
        self.gap = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.gap, last = max(self.gap, now - last), now

    def __enter__(self) -> _GapProbe:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def slow_config(engine: ThreadCopyEngine, stall_timeout: float) -> StagingConfig:
    return StagingConfig(chunk_bytes=CHUNK, buffers=3, stall_timeout=stall_timeout, cpu_engine=lambda: engine)


async def test_abandoned_staged_get_waits_for_slow_copies_off_the_loop(store_url, uname):
    """A get abandoned while its copies into the caller's tensor are slow (each longer than the
    old 1 s wait, well within stall_timeout): the timeout is raised only once no copy will write
    any more, and the event loop keeps running meanwhile."""
    engine = Counting(delay=0.8)
    async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=10,
                                  staging=slow_config(engine, 10.0)) as a, \
            transport.Endpoint(uname("b"), store=store_url, planes=("tcp",), timeout=10) as b:
        w = torch.randint(0, 256, (40 * CHUNK,), dtype=torch.uint8)
        b.register("w", w)
        await a.connect(b.name)
        out = torch.full_like(w, 0xA5)
        with _GapProbe() as probe:
            t0 = time.monotonic()
            with pytest.raises(transport.TransportTimeoutError) as ei:
                await a.get(b.name, {"w": out}, timeout=0.3)
            took = time.monotonic() - t0
        assert "pending" not in str(ei.value) and "outlived" not in str(ei.value)
        assert took > 1.2, "the get returned while copies into its tensor were still queued"
        assert took < 10
        assert probe.gap < 0.5, f"the event loop was blocked for {probe.gap:.2f} s"
        snapshot = out.clone()
        await asyncio.sleep(1.0)
        assert torch.equal(out, snapshot), "bytes landed in the caller's tensor after the get returned"
        assert a.staging.parked() == 0
        await settle(a, b)
        engine.delay = 0.0
        out.fill_(0xA5)
        await a.get(b.name, {"w": out}, timeout=30)
        assert torch.equal(out, w)


class HeldCopies(Counting):
    """Copies wait until ``release`` is set (bounded): a stalled device."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def _copy(self, dst, src):
        self.release.wait(20)
        dst.copy_(src)


async def test_abandoned_staged_get_with_a_stuck_copy_says_so(store_url, uname):
    """A get abandoned while a copy into the caller's tensor is stuck past stall_timeout: the
    error says the tensor may still be written, the tensor is held (parked) until the copy
    ends, then let go; the loop is never blocked."""
    engine = HeldCopies()
    try:
        async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=10,
                                      staging=slow_config(engine, 0.5)) as a, \
                transport.Endpoint(uname("b"), store=store_url, planes=("tcp",), timeout=10) as b:
            w = torch.randint(0, 256, (40 * CHUNK,), dtype=torch.uint8)
            b.register("w", w)
            await a.connect(b.name)
            out = torch.full_like(w, 0xA5)
            with _GapProbe() as probe:
                with pytest.raises(transport.TransportTimeoutError, match="outlived its bound") as ei:
                    await a.get(b.name, {"w": out}, timeout=0.2)
            assert "held" in str(ei.value)
            assert probe.gap < 0.5, f"the event loop was blocked for {probe.gap:.2f} s"
            assert a.staging.parked() >= 1
            held = [t for _, ts in a.staging._parked for t in ts]
            assert any(t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for t in held)
            engine.release.set()
            end = time.monotonic() + 10
            while a.staging.parked():
                assert time.monotonic() < end, "parked memory was not let go once the copies ended"
                await asyncio.sleep(0.02)
            await settle(a, b)
            out.fill_(0xA5)
            await a.get(b.name, {"w": out}, timeout=30)
            assert torch.equal(out, w)
    finally:
        engine.release.set()


class Gate:
    """A waitable (like a CUDA event on the caller's stream) that completes when opened."""

    def __init__(self, opened: bool = False, fails: bool = False) -> None:
        self.ev = threading.Event()
        self.fails = fails
        if opened:
            self.ev.set()

    def query(self) -> bool:
        if self.fails and self.ev.is_set():
            raise RuntimeError("injected failure of the caller's work")
        return self.ev.is_set()

    def synchronize(self) -> None:
        if not self.ev.wait(20):
            raise RuntimeError("the gate was never opened")
        if self.fails:
            raise RuntimeError("injected failure of the caller's work")


class GatedMarks(Counting):
    """mark() returns a Gate (the caller's pending work); records what each copy was told to wait for."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: list[Gate] = []
        self.afters: list[object] = []
        self.open_next = False
        self.fail_next = False
        self.stream = None

    def mark(self):
        g = Gate(opened=self.open_next, fails=self.fail_next)
        g.stream = self.stream  # the caller's current stream (like a CUDA StreamMark)
        self.gates.append(g)
        return g

    def copy(self, dst, src, after=None):
        self.afters.append(after)
        return super().copy(dst, src, after)


async def _until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("op", ["put", "get"])
async def test_staged_ops_await_the_callers_work_before_the_channel_sees_them(endpoints, op):
    """The caller's pending work (its mark) is awaited on the event loop before the op reaches the
    channel: meanwhile nothing is staged or sent, the loop and the other direction keep serving,
    a later op of the same caller waits its turn (call order holds), and the copies are then
    issued waiting for nothing."""
    ie = GatedMarks()
    a, b = await endpoints(ie, None)
    w = torch.randint(0, 256, (9 * CHUNK,), dtype=torch.uint8)
    b.register("w", w)
    b.register("v", torch.zeros(16))
    a.register("mine", torch.zeros(16))
    peer = await a.connect(b.name)
    mine = torch.randint(0, 256, (9 * CHUNK,), dtype=torch.uint8)
    local = mine.clone() if op == "put" else torch.full_like(w, 0xA5)
    task = asyncio.create_task(getattr(a, op)(b.name, {"w": local}, timeout=20))
    try:
        await _until(lambda: len(ie.gates) == 1)
        await asyncio.sleep(0.2)
        assert ie.calls == 0, "bytes were staged before the caller's work was done"
        assert not task.done()
        rec = [r for r in a.recorder.snapshot() if r["role"] == "initiator" and r["kind"] == op][-1]
        assert rec["state"] == "posted"
        # the channel is not held by the waiting op: the other direction goes on ...
        await b.put(a.name, {"mine": torch.ones(16)}, timeout=5)
        # ... and a's later ops keep their order: a notify called now reaches b after the op
        note_task = asyncio.create_task(a.notify(b.name, b"after", timeout=20))
        await asyncio.sleep(0.2)
        assert not note_task.done(), "a notify overtook a staged op still waiting for the caller's work"
        assert peer.connected and not task.done()
        ie.gates[0].ev.set()
        await asyncio.wait_for(task, 20)
        await asyncio.wait_for(note_task, 20)
        note = await b.next_notification(timeout=5)
        assert note.payload == b"after"
        if op == "put":
            assert torch.equal(w, mine), "the notification arrived before the put's bytes"
    finally:
        for g in ie.gates:
            g.ev.set()
    if op == "put":
        assert torch.equal(w, mine)
    else:
        assert torch.equal(local, w)
    assert ie.calls > 0 and all(x is None for x in ie.afters), "a copy was told to wait for the caller's stream"
    await settle(a, b)


async def test_marks_of_different_streams_are_awaited_independently(endpoints):
    """A caller's long work on one stream holds up only the ops marked on that stream: an op to
    another peer, marked on another stream whose work is done first, goes ahead."""
    ie = GatedMarks()
    a, b = await endpoints(ie, None)
    _, c = await endpoints(None, None)
    for t in (b, c):
        t.register("w", torch.zeros(4 * CHUNK, dtype=torch.uint8))
        await a.connect(t.name)
    try:
        ie.stream = 1
        slow = asyncio.create_task(a.put(b.name, {"w": torch.ones(4 * CHUNK, dtype=torch.uint8)}, timeout=20))
        await _until(lambda: len(ie.gates) == 1)
        ie.stream = 2
        fast = asyncio.create_task(a.put(c.name, {"w": torch.ones(4 * CHUNK, dtype=torch.uint8)}, timeout=20))
        await _until(lambda: len(ie.gates) == 2)
        await asyncio.sleep(0.1)
        ie.gates[1].ev.set()  # stream 2's work is done; stream 1's is not
        await asyncio.wait_for(fast, 10)
        assert not slow.done()
        ie.gates[0].ev.set()
        await asyncio.wait_for(slow, 10)
    finally:
        for g in ie.gates:
            g.ev.set()
    await settle(a, b, c)


async def test_a_staged_op_times_out_while_the_callers_work_is_pending(endpoints):
    ie = GatedMarks()
    a, b = await endpoints(ie, None)
    w = torch.zeros(9 * CHUNK, dtype=torch.uint8)
    b.register("w", w)
    peer = await a.connect(b.name)
    try:
        with pytest.raises(transport.TransportTimeoutError, match="posted"):
            await a.put(b.name, {"w": torch.ones_like(w)}, timeout=0.3)
        assert ie.calls == 0 and bool((w == 0).all()) and peer.connected
        assert not a._channels[b.name].ops.pending
        ie.gates[0].ev.set()  # the caller's work ends late; later marks of that device queue behind it
        await _until(lambda: all(br.pending == 0 for br in a.staging._bridges.values()))
        ie.fail_next = True
        with pytest.raises(StagingError, match="injected failure of the caller's work"):
            ie.open_next = True
            await a.put(b.name, {"w": torch.ones_like(w)}, timeout=5)
        assert ie.calls == 0 and bool((w == 0).all()) and peer.connected
    finally:
        for g in ie.gates:
            g.ev.set()
    ie.fail_next = False
    await a.put(b.name, {"w": torch.ones_like(w)}, timeout=10)
    assert bool((w == 1).all())


async def test_a_finished_mark_does_not_queue_behind_another_callers_pending_one(endpoints):
    """Marks are awaited in order per device, but one that is already complete is not queued:
    an op whose caller's work is done goes ahead of another op (to another peer) still waiting."""
    ie = GatedMarks()
    a, b = await endpoints(ie, None)
    _, c = await endpoints(None, None)
    wb, wc = torch.zeros(9 * CHUNK, dtype=torch.uint8), torch.zeros(9 * CHUNK, dtype=torch.uint8)
    b.register("w", wb)
    c.register("w", wc)
    await a.connect(b.name)
    await a.connect(c.name)
    waiting = asyncio.create_task(a.put(b.name, {"w": torch.ones_like(wb)}, timeout=20))
    try:
        await _until(lambda: len(ie.gates) == 1)
        ie.open_next = True  # the next caller's work is already done when it calls
        await asyncio.wait_for(a.put(c.name, {"w": torch.full_like(wc, 2)}, timeout=20), 5)
        assert bool((wc == 2).all()) and not waiting.done()
        ie.gates[0].ev.set()
        await asyncio.wait_for(waiting, 20)
        assert bool((wb == 1).all())
    finally:
        for g in ie.gates:
            g.ev.set()
    await settle(a, b, c)


# ------------------------------------------------ our staged tensors, the peer's CPU buffers over shm
# (a GPU tensor of ours meeting a peer's CPU buffer on the same host: StagedShmPlane. On CPU, the
# initiator stages its CPU tensors and keeps the peer's CPU buffers for what they are.)
def shm_config(engine: ThreadCopyEngine) -> StagingConfig:
    return StagingConfig(chunk_bytes=CHUNK, buffers=3, stall_timeout=5.0, cpu_engine=lambda: engine,
                         cpu_engine_peers=False)


@pytest.fixture(scope="module")
def shm_target(store_url):
    t = RemoteEndpoint(f"stg-shm-{uuid.uuid4().hex[:6]}", store=store_url, planes=("shm",))
    try:
        yield t
    finally:
        t.stop()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8", "int64", "bool"])
async def test_staged_tensors_into_a_peers_segments(store_url, shm_target, uname, dtype):
    engine = Counting()
    async with transport.Endpoint(uname("init"), store=store_url, planes=("shm",), timeout=30,
                                  staging=shm_config(engine)) as ep:
        await put_get_every_shape(ep, shm_target, dtype, SHAPES, uname, seed)
        a, b = uname("a"), uname("b")  # sub-ranges and several buffers in one op
        shm_target.call("register", a, dtype, (5000,))
        shm_target.call("register", b, dtype, (10, 300))
        sa, sb = seed(), seed()
        part, whole = make_tensor(dtype, (1500,), sa), make_tensor(dtype, (10, 300), sb)
        await ep.put(shm_target.name, {a: transport.At(part, 1234), b: whole})
        assert shm_target.call("check_range", a, sa, 1234, 1500) and shm_target.call("check", b, sb)
        back = {a: transport.At(poisoned(dtype, (1500,)), 1234), b: poisoned(dtype, (10, 300))}
        await ep.get(shm_target.name, back)
        assert same_bytes(back[a].tensor, part) and same_bytes(back[b], whole)
        await settle(ep)
        st = ep.staging.statistics()
        assert engine.calls > 0 and 0 < st.peak_in_use <= 3, st  # through at most `buffers` bounce buffers
        assert (await ep.connect(shm_target.name)).plane == "shm"
        recs = [r for r in ep.recorder.snapshot() if r["role"] == "initiator" and r["kind"] in ("put", "get")]
        assert {r["plane"] for r in recs} == {"shm"} and {r["state"] for r in recs} == {"done"}


@pytest.fixture
async def shm_pair(store_url, uname):
    """make(engine): an initiator staging through ``engine`` and a plain target, over shm, in this process."""
    async with endpoint_pairs(store_url, uname, "shm") as make:
        yield lambda engine: make(shm_config(engine), None)


@pytest.mark.parametrize("op", ["put", "get"])
async def test_a_failed_copy_into_or_out_of_a_peers_segment_fails_the_op_and_keeps_the_channel(shm_pair, op):
    a, b = await shm_pair(Counting(fail_at=3))
    w = torch.randint(0, 256, (10 * CHUNK + 1,), dtype=torch.uint8)
    b.register("w", w)
    peer = await a.connect(b.name)
    data = torch.randint(0, 256, w.shape, dtype=torch.uint8)
    with pytest.raises(StagingError, match="injected device error in copy 3"):
        if op == "put":
            await a.put(b.name, {"w": data}, notify=b"not delivered")
        else:
            await a.get(b.name, {"w": torch.zeros_like(w)})
    assert peer.connected, "nothing was sent: the channel is intact"
    await settle(a)
    if op == "put":
        await a.put(b.name, {"w": data}, notify=b"delivered")
        assert torch.equal(w, data)
        assert (await b.next_notification(timeout=5)).payload == b"delivered"
    else:
        out = torch.full_like(w, 0xA5)
        await a.get(b.name, {"w": out})
        assert torch.equal(out, w)
    assert peer.connected


async def test_a_timed_out_get_from_a_peers_segment_never_writes_after_returning(shm_pair):
    await timed_out_get_writes_nothing_after_returning(*await shm_pair(Counting(delay=0.01)))


async def test_ops_after_a_staged_shm_put_reach_the_peer_after_it(shm_pair):
    """The staged shm put waits before its header (the caller's device work, then the copies):
    a notification and a put issued right after it, without awaiting it, still arrive after it."""
    a, b = await shm_pair(Counting(delay=0.002))
    w = torch.zeros(40 * CHUNK, dtype=torch.uint8)
    b.register("w", w)
    seen: list[bytes] = []
    b.on_notification(lambda note: seen.append(bytes(w[:4].tolist())) if note.payload == b"after" else None)
    await a.connect(b.name)
    first = torch.full_like(w, 1)
    slow = asyncio.ensure_future(a.put(b.name, {"w": first}))
    await asyncio.sleep(0)  # the put has started (its copies are running on the engine)
    await asyncio.gather(a.notify(b.name, b"after"), slow)
    end = time.monotonic() + 5
    while not seen:
        assert time.monotonic() < end
        await asyncio.sleep(0.01)
    assert seen == [bytes([1, 1, 1, 1])], "the notification overtook the put"
