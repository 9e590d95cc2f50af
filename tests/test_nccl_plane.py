"""The ``nccl`` plane's protocol through real endpoints and processes, on CPU.

``Endpoint(engines={"nccl": SocketLinkEngine})`` (both sides) gives each channel a link whose
"communicator" is a second TCP connection with NCCL's semantics where they matter here: posted
operations run in posting order, one at a time per side, and a send completes only once the peer's
receive took the bytes, so two sides that post in different orders deadlock (reported there as a
link error instead of a hang). Everything else is the plane's real code: set-up frames, the
dialer's order (``Go``), target serving from the link's completion, rejections that keep both
sides in step, abort on timeout and loss, a restarted peer. Only the engine differs from a GPU
run (tests/gpu/test_nccl_plane_gpu.py). Fresh random data, destinations poisoned
first, byte equality read back; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import signal
import threading
import time
import uuid

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint, make_tensor, poisoned, same_bytes
from tests._remote import op_records as _ops
from tests._remote import until as _until
from transport.errors import PeerLostError, TransportTimeoutError, UnknownBufferError
from transport.planes import SocketLinkEngine

PLANES = ("tcp", "nccl")
_seeds = itertools.count(8000)


def seed() -> int:
    return next(_seeds)


class RefusingLinkEngine(SocketLinkEngine):
    """Cannot join any link (as NCCL refusing two ranks on one GPU)."""

    def connect(self, unique_id, rank, timeout):
        raise RuntimeError("ncclInvalidUsage: Duplicate GPU detected")


@pytest.fixture(scope="module")
def target(store_url):
    t = RemoteEndpoint(f"nccl-tgt-{uuid.uuid4().hex[:6]}", store=store_url, planes=PLANES,
                       engines={"nccl": SocketLinkEngine})
    try:
        yield t
    finally:
        t.stop()


@pytest.fixture
async def init(store_url, uname):
    async with transport.Endpoint(uname("nccl-init"), store=store_url, timeout=30, planes=PLANES,
                                  engines={"nccl": SocketLinkEngine}) as ep:
        yield ep


async def test_both_sides_initiating_at_once_stay_in_order(init, target, uname):
    """The deadlock a per-side order would cause: both sides put to each other at the same time,
    many times. Every post follows the dialer's order, so nothing stalls or desynchronises."""
    ours, theirs = uname("ours"), uname("theirs")
    n = 64 * 1024
    init.register(ours, poisoned("uint8", (n,)))
    target.call("register", theirs, "uint8", (n,))
    for _ in range(8):
        s_in, s_out = seed(), seed()
        target.start("put", init.name, {ours: ("uint8", (n,), s_in)}, 30)
        await asyncio.gather(*[init.put(target.name, {theirs: make_tensor("uint8", (n,), s_out)})
                               for _ in range(3)])
        assert await asyncio.to_thread(target.result, 30) is None
        assert target.call("check", theirs, s_out)
        assert same_bytes(init._registry.get(ours).tensor, make_tensor("uint8", (n,), s_in))


async def test_a_rejected_op_keeps_the_link_in_step(init, target, uname, monkeypatch):
    """Our copy of the peer's registry lags: we post a send for a buffer it has just unregistered.
    The peer posts a receive into scratch memory (our send must be matched) and fails the op; the
    next ops on the link are fine."""
    gone, kept = uname("gone"), uname("kept")
    target.call("register", gone, "float32", (2048,))
    target.call("register", kept, "float32", (2048,))
    await init.put(target.name, {kept: make_tensor("float32", (2048,), seed())})
    ch = init._channels[target.name]
    real = ch.take_registry
    monkeypatch.setattr(ch, "take_registry", lambda msg: (time.sleep(1.0), real(msg)))
    target.call("unregister", gone)
    with pytest.raises(UnknownBufferError):  # two items, one of them gone: both posted into scratch
        await init.put(target.name, {kept: make_tensor("float32", (2048,), seed()),
                                     gone: make_tensor("float32", (2048,), seed())})
    with pytest.raises(UnknownBufferError):
        await init.get(target.name, {gone: torch.zeros(2048)})
    s = seed()
    await init.put(target.name, {kept: make_tensor("float32", (2048,), s)})
    assert target.call("check", kept, s)
    assert ch.is_open and ch.link is not None and ch.link.state == "ready"


async def test_the_dialer_rejects_a_listener_op_without_posting(init, target, uname):
    """The listener's view of our registry lags: it asks to put into a buffer we just unregistered.
    We (the dialer) answer Fail without a Go: the listener never posted, its op fails at once with
    UnknownBufferError (not at its deadline), and the link stays in step."""
    await init.connect(target.name)  # we are the dialer
    gone, kept = uname("gone"), uname("kept")
    init.register(gone, poisoned("float32", (10,)))
    init.register(kept, poisoned("float32", (10,)))
    await _until(lambda: target.call("peer_has", init.name, gone), what="the target knows our buffers")
    target.call("lag", init.name, "take_registry", 2.0)  # its reader sleeps before our next update
    init.unregister(gone)
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="UnknownBufferError"):
        await asyncio.to_thread(target.call, "put", init.name, {gone: ("float32", (10,), seed())}, 20)
    assert time.monotonic() - t0 < 8
    s = seed()
    await asyncio.to_thread(target.call, "put", init.name, {kept: ("float32", (10,), s)}, 20)
    assert same_bytes(init._registry.get(kept).tensor, make_tensor("float32", (10,), s))


async def test_a_listener_get_given_up_before_its_go_writes_nothing(store_url, uname):
    """We are the listener; the dialer is slow to answer our get's request. We give up (cancel):
    the Go comes later and the receive must still be posted (the link must follow the dialer), but
    into scratch memory, never into our tensor; the next get works."""
    t = RemoteEndpoint(uname("nccl-dialer"), store=store_url, planes=PLANES, engines={"nccl": SocketLinkEngine})
    try:
        async with transport.Endpoint(uname("nccl-listener"), store=store_url, timeout=30, planes=PLANES,
                                      engines={"nccl": SocketLinkEngine}) as ep:
            s = seed()
            t.call("register_data", "w", "uint8", (4096,), s)
            await asyncio.to_thread(t.call, "connect", ep.name)  # it dials: we are the listener
            await _until(lambda: t.name in ep._channels and ep._channels[t.name].link is not None
                         and ep._channels[t.name].link.state == "ready", what="the link is up")
            t.call("lag", ep.name, "_target._serve_via_link", 1.0)
            out = poisoned("uint8", (4096,))
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(ep.get(t.name, {"w": out}), 0.3)
            await asyncio.sleep(1.5)  # the Go came and the receive ran meanwhile
            assert bool((out == 0xA5).all()), "the abandoned get wrote into the caller's tensor"
            back = poisoned("uint8", (4096,))
            await ep.get(t.name, {"w": back}, timeout=20)
            assert same_bytes(back, make_tensor("uint8", (4096,), s))
            assert ep._channels[t.name].link.state == "ready"
    finally:
        t.stop()


async def test_a_peer_killed_mid_transfer_fails_the_op_at_once_and_restarted_gets_a_new_link(store_url, uname):
    """A peer killed mid-transfer: the op fails with PeerLostError at once (the connection's loss,
    not the op's timeout), the channel's link is aborted;
    the peer restarted under the same name (a new incarnation) is reached over a new channel with
    a new link, and the bytes move over it."""
    name = uname("nccl-restart")
    slow = functools.partial(SocketLinkEngine, delay=2.0)
    t = RemoteEndpoint(name, store=store_url, planes=PLANES, engines={"nccl": slow})
    t2 = None
    try:
        async with transport.Endpoint(uname("nccl-init"), store=store_url, timeout=30, planes=PLANES,
                                      engines={"nccl": SocketLinkEngine}) as ep:
            t.call("register", "w", "uint8", (1 << 16,))
            first = await ep.connect(name)
            old = ep._channels[name]
            await _until(lambda: old.link is not None and old.link.state == "ready", 10, "the first link up")
            conn = old.link.conn
            put = asyncio.ensure_future(ep.put(name, {"w": make_tensor("uint8", (1 << 16,), seed())}, timeout=30))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            t.kill()
            with pytest.raises(PeerLostError):
                await asyncio.wait_for(put, 15)
            assert time.monotonic() - t0 < 10
            await _until(lambda: conn.aborted, 10,
                         "the old link's communicator aborted")
            t2 = RemoteEndpoint(name, store=store_url, planes=PLANES, engines={"nccl": SocketLinkEngine})
            t2.call("register", "w", "uint8", (1 << 16,))
            s = seed()
            await ep.put(name, {"w": make_tensor("uint8", (1 << 16,), s)}, timeout=30)
            assert t2.call("check", "w", s)
            peer = await ep.connect(name)
            new = ep._channels[name]
            assert peer.incarnation != first.incarnation and new is not old
            assert new.link is not None and new.link.state == "ready" and new.link.conn is not conn
            assert {r["plane"] for r in _ops(ep, "put")[-1:]} == {"nccl"}
    finally:
        t.kill()
        if t2 is not None:
            t2.stop()


async def test_a_frozen_peer_times_out_aborts_the_link_and_a_new_channel_works(store_url, uname):
    """A frozen peer: the op times out, the channel's link is aborted and the channel closed
    (other ops on it fail with PeerLostError), another peer's channel is untouched, and once the
    peer runs again the next op gets a new channel with a new link."""
    a = RemoteEndpoint(uname("nccl-frozen"), store=store_url, planes=PLANES, engines={"nccl": SocketLinkEngine})
    b = RemoteEndpoint(uname("nccl-other"), store=store_url, planes=PLANES, engines={"nccl": SocketLinkEngine})
    try:
        async with transport.Endpoint(uname("nccl-init"), store=store_url, timeout=30, planes=PLANES,
                                      engines={"nccl": SocketLinkEngine}, heartbeat_timeout=60) as ep:
            for r in (a, b):
                r.call("register", "w", "uint8", (1 << 20,))
                await ep.put(r.name, {"w": make_tensor("uint8", (1 << 20,), seed())})
            old = ep._channels[a.name]
            conn = old.link.conn  # the channel's "communicator"
            a.signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                slow = asyncio.ensure_future(ep.put(a.name, {"w": make_tensor("uint8", (1 << 20,), seed())},
                                                    timeout=5))
                await asyncio.sleep(0.2)
                with pytest.raises(TransportTimeoutError):
                    await ep.put(a.name, {"w": make_tensor("uint8", (1 << 20,), seed())}, timeout=1)
                assert time.monotonic() - t0 < 15
                with pytest.raises(PeerLostError):
                    await asyncio.wait_for(slow, 10)
                assert not old.is_open and old.link is not None and old.link.state == "down"
                await _until(lambda: conn.aborted, 10,
                             "the old link's communicator aborted")
                s = seed()
                await ep.put(b.name, {"w": make_tensor("uint8", (1 << 20,), s)}, timeout=10)
                assert b.call("check", "w", s)
            finally:
                a.signal(signal.SIGCONT)
            s = seed()
            await ep.put(a.name, {"w": make_tensor("uint8", (1 << 20,), s)}, timeout=20)
            assert a.call("check", "w", s)
            new = ep._channels[a.name]
            assert new is not old and new.link is not None and new.link.state == "ready"
            assert {r["plane"] for r in _ops(ep, "put")[-1:]} == {"nccl"}
    finally:
        a.kill()
        b.stop()


async def test_a_get_cancelled_while_its_peer_is_frozen_aborts_the_link_at_once(store_url, uname):
    """Cancelling (not timing out) a get whose receive waits on a frozen peer: the call raises within
    the 0.25 s grace plus the abort, not at the endpoint's timeout or the heartbeat's; the link is
    aborted and the channel closed, nothing lands in the tensor afterwards, and once the peer runs
    again a new channel serves it (rl_sync relies on this when a relay freezes)."""
    t = RemoteEndpoint(uname("nccl-frozen"), store=store_url, planes=PLANES, engines={"nccl": SocketLinkEngine})
    try:
        async with transport.Endpoint(uname("nccl-init"), store=store_url, timeout=30, planes=PLANES,
                                      engines={"nccl": SocketLinkEngine}, heartbeat_timeout=60) as ep:
            s = seed()
            t.call("register_data", "w", "uint8", (1 << 20,), s)
            await ep.get(t.name, {"w": poisoned("uint8", (1 << 20,))})  # the channel and its link are up
            old = ep._channels[t.name]
            t.signal(signal.SIGSTOP)
            try:
                out = poisoned("uint8", (1 << 20,))
                task = asyncio.ensure_future(ep.get(t.name, {"w": out}))
                await asyncio.sleep(0.3)
                t0 = time.monotonic()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(task, 10)
                took = time.monotonic() - t0
                assert took < 3.0, f"the cancelled get took {took:.2f} s"
                assert not old.is_open and old.link is not None and old.link.state == "down"
                assert _ops(ep, "get")[-1]["state"] in ("cancelled", "failed")  # (the abort fails it first)
                after = out.clone()
            finally:
                t.signal(signal.SIGCONT)
            await asyncio.sleep(0.5)
            assert torch.equal(out, after)  # nothing landed after the call raised
            back = poisoned("uint8", (1 << 20,))
            await ep.get(t.name, {"w": back}, timeout=20)
            assert same_bytes(back, make_tensor("uint8", (1 << 20,), s))
            assert ep._channels[t.name] is not old
    finally:
        t.kill()


async def test_a_link_that_cannot_be_set_up_is_reported_and_ops_take_another_plane(store_url, uname):
    t = RemoteEndpoint(uname("nccl-tgt"), store=store_url, planes=PLANES, engines={"nccl": RefusingLinkEngine})
    try:
        async with transport.Endpoint(uname("nccl-init"), store=store_url, timeout=30, planes=PLANES,
                                      engines={"nccl": SocketLinkEngine}) as ep:
            t.call("register", "w", "float32", (100,))
            s = seed()
            await ep.put(t.name, {"w": make_tensor("float32", (100,), s)})
            assert t.call("check", "w", s)
            peer = await ep.connect(t.name)
            ch = ep._channels[t.name]
            await _until(lambda: ch.link is not None and ch.link.state == "down", what="the link is down")
            assert peer.gpu_plane == "staged" and "Duplicate GPU" in peer.gpu_plane_reason, peer.gpu_plane_reason
            s = seed()
            await ep.put(t.name, {"w": make_tensor("float32", (100,), s)})
            assert t.call("check", "w", s)
            assert {r["plane"] for r in _ops(ep, "put")} <= {"tcp", "nccl"}
            assert _ops(ep, "put")[-1]["plane"] == "tcp"
    finally:
        t.stop()


async def test_a_cpu_op_racing_the_link_going_down_takes_the_channel_plane(store_url, uname):
    """The link can go down (reader thread) between plane_for's first look at it and its choice of
    GPU plane. An op on CPU buffers that a CPU link engine would have carried then takes the
    channel's plane, not the staged path meant for GPU bytes (seen once in CI as a flaky
    test_a_link_that_cannot_be_set_up_is_reported_and_ops_take_another_plane). Deterministic here:
    the choice itself marks the link down first, as the reader thread would just before it."""
    t = RemoteEndpoint(uname("nccl-tgt"), store=store_url, planes=PLANES, engines={"nccl": SocketLinkEngine})
    try:
        async with transport.Endpoint(uname("nccl-init"), store=store_url, timeout=30, planes=PLANES,
                                      engines={"nccl": SocketLinkEngine}) as ep:
            t.call("register", "w", "float32", (100,))
            peer = await ep.connect(t.name)
            ch = ep._channels[t.name]
            await _until(lambda: ch.link is not None and ch.link.state == "ready", what="the link is up")
            link = ch.link
            choose = ch.planes.gpu_plane_choice

            def racing_choice():
                with link._state_lock:
                    link.state, link.reason = "down", "taken down while the op picked its plane"
                return choose()

            ch.planes.gpu_plane_choice = racing_choice
            ch.link_changed()  # the next op chooses its GPU plane again
            s = seed()
            await ep.put(t.name, {"w": make_tensor("float32", (100,), s)})
            assert t.call("check", "w", s)
            assert _ops(ep, "put")[-1]["plane"] == "tcp", _ops(ep, "put")[-1]
            assert peer.gpu_plane == "staged" and "taken down" in peer.gpu_plane_reason
    finally:
        t.stop()


@pytest.mark.parametrize("at", ["before the op", "as the op picks its plane"])
async def test_an_op_meeting_a_link_just_gone_down_is_staged_and_the_channel_lives(store_url, uname, at):
    """The link is marked down on the reader thread; the event loop learns of it (link_changed)
    only later. An op for the link (here: CPU tensors staged like GPU ones, ``cpu_engine``) in
    between goes through the staged path, instead of posting on the dead link, which failed the
    op and closed the whole channel."""
    from transport.staging import StagingConfig, ThreadCopyEngine

    t = RemoteEndpoint(uname("nccl-tgt"), store=store_url, planes=PLANES, engines={"nccl": SocketLinkEngine})
    try:
        async with transport.Endpoint(uname("nccl-init"), store=store_url, timeout=30, planes=PLANES,
                                      engines={"nccl": SocketLinkEngine},
                                      staging=StagingConfig(cpu_engine=ThreadCopyEngine)) as ep:
            t.call("register", "w", "float32", (100,))
            await ep.connect(t.name)
            ch = ep._channels[t.name]
            # settled: the loop has run link_changed() for the link coming up
            await _until(lambda: ch.link is not None and ch.link._settled.done(), what="the link is up")
            link = ch.link
            s = seed()
            await ep.put(t.name, {"w": make_tensor("float32", (100,), s)})
            assert t.call("check", "w", s) and _ops(ep, "put")[-1]["plane"] == "nccl"

            def going_down(why: str) -> None:  # what _maybe_settle or abort does, before link_changed runs
                with link._state_lock:
                    link.state, link.reason = "down", why

            if at == "before the op":
                going_down("gone down just now")
                assert ch.gpu_plane == "nccl"  # the loop has not heard of it yet
            else:  # the op was given the link, which went down right after (transfer.pick_plane picks again)
                refusal = ch.planes._nccl_refusal

                def refused_then_down(pairs):
                    why = refusal(pairs)
                    if link.state != "down":
                        going_down("went down as the op picked its plane")
                    return why

                ch.planes._nccl_refusal = refused_then_down
            s = seed()
            await ep.put(t.name, {"w": make_tensor("float32", (100,), s)})
            assert t.call("check", "w", s)
            assert _ops(ep, "put")[-1]["plane"] == "staged", _ops(ep, "put")[-1]
            assert ch.is_open
    finally:
        t.stop()


async def test_no_link_without_nccl_on_both_sides(store_url, uname):
    t = RemoteEndpoint(uname("nccl-tgt"), store=store_url, planes=("tcp",))
    try:
        async with transport.Endpoint(uname("nccl-init"), store=store_url, timeout=30, planes=PLANES,
                                      engines={"nccl": SocketLinkEngine}) as ep:
            peer = await ep.connect(t.name)
            assert ep._channels[t.name].link is None
            assert "nccl: the peer does not offer it" in peer.gpu_plane_reason
    finally:
        t.stop()


async def test_an_endpoint_created_before_cuda_was_in_use_offers_nccl_once_it_is(store_url, uname, monkeypatch):
    """An endpoint whose process did not use CUDA yet when it was created offers no nccl on its first
    channels; once CUDA is in use, the next channel it sets up offers nccl and gets a link. (On CPU:
    CUDA "comes into use" by patching the check, and the engine found then is the socket engine.)"""
    import transport.planes.nccl_offer as E

    state = {"device": None}
    monkeypatch.setattr(E, "current_cuda_device", lambda: state["device"])
    monkeypatch.setattr(E, "link_engine_probe",
                        lambda factory, device=None: (SocketLinkEngine(), f"socket engine on device {device}"))
    early = RemoteEndpoint(uname("nccl-early"), store=store_url, planes=PLANES, engines={"nccl": SocketLinkEngine})
    late = RemoteEndpoint(uname("nccl-late"), store=store_url, planes=PLANES, engines={"nccl": SocketLinkEngine})
    dialer = RemoteEndpoint(uname("nccl-dialer"), store=store_url, planes=PLANES, engines={"nccl": SocketLinkEngine})
    try:
        async with transport.Endpoint(uname("nccl-init"), store=store_url, timeout=30, planes=PLANES) as ep:
            offered, why = ep.plane_status("nccl")
            assert not offered and "CUDA was not in use" in why
            first = await ep.connect(early.name)
            assert ep._channels[early.name].link is None and "nccl: the peer" not in first.gpu_plane_reason
            state["device"] = 0  # the application starts using CUDA
            peer = await ep.connect(late.name)
            ch = ep._channels[late.name]
            offered, why = ep.plane_status("nccl")
            assert offered and "device 0" in why
            assert ch.link is not None
            await _until(lambda: ch.link.state == "ready", 10, "the link is up")
            late.call("register", "w", "uint8", (4096,))
            await _until(lambda: "w" in peer.buffers, 10, "the peer's registry names w")
            s = seed()
            await ep.put(late.name, {"w": make_tensor("uint8", (4096,), s)})
            assert late.call("check", "w", s)
            assert _ops(ep, "put")[-1]["plane"] == "nccl" and peer.gpu_plane == "nccl"
            assert ep._channels[early.name].link is None  # a channel set up before keeps going without one
            # the other direction: a peer dials us now, and puts into our buffer over its link
            ours = poisoned("uint8", (4096,))
            ep.register("ours", ours)
            s = seed()
            await asyncio.to_thread(dialer.call, "put", ep.name, {"ours": ("uint8", (4096,), s)}, 30)
            assert same_bytes(ours, make_tensor("uint8", (4096,), s))
            assert ep._channels[dialer.name].link is not None
            assert _ops(ep, "put", role="target")[-1]["plane"] == "nccl"
    finally:
        early.stop()
        late.stop()
        dialer.stop()


def test_the_poster_runs_each_ops_job_in_order_on_its_own_thread():
    """What NcclConn posts with (transport.completion.Poster): jobs run in submission order on the poster's
    thread, never the caller's; a job's Posted completes once the job ran and the waitable it
    returned completed; a job that raises fails its own Posted only."""
    from transport.completion import Poster, ThreadDone

    poster = Poster()
    gate = threading.Event()
    ran: list[tuple[int, int]] = []
    later = ThreadDone()

    def job(i: int, result=None, fail: bool = False):
        def run():
            if i == 0:
                assert gate.wait(10)
            ran.append((i, threading.get_ident()))
            if fail:
                raise ValueError(f"job {i}")
            return result
        return run

    try:
        posted = [poster.submit(job(0)), poster.submit(job(1, fail=True)), poster.submit(job(2, later)),
                  poster.submit(job(3))]
        assert not any(p.query() for p in posted)  # nothing ran: job 0 waits on the gate
        gate.set()
        posted[3].synchronize()
        assert [i for i, _ in ran] == [0, 1, 2, 3]
        assert {tid for _, tid in ran} != {threading.get_ident()} and len({tid for _, tid in ran}) == 1
        assert posted[0].query() and posted[3].query()
        with pytest.raises(RuntimeError, match="job 1"):
            posted[1].query()
        with pytest.raises(RuntimeError, match="job 1"):
            posted[1].synchronize()
        assert not posted[2].query()  # it ran, but the work it queued is not done yet
        later.finished.set()
        assert posted[2].query()
        posted[2].synchronize()
    finally:
        poster.close()


async def test_a_notified_put_whose_link_aborts_after_its_completion_is_failed_not_left_received(store_url,
                                                                                                    uname):
    """On the target, a put with ``notify=`` completes on the link's bridge thread, is checked
    (the link still up), and is then handed to the link's answering thread; an abort in between
    (the peer lost, a timeout elsewhere on the link) drops that hand-over. The op then ends FAILED
    in the target's flight recorder, never left RECEIVED, the notification is not delivered, and
    the initiator's put fails (nothing reported done). Deterministic: the hand-over aborts first."""
    async with transport.Endpoint(uname("nccl-tgt"), store=store_url, timeout=30, planes=PLANES,
                                  engines={"nccl": SocketLinkEngine}) as tgt, \
            transport.Endpoint(uname("nccl-init"), store=store_url, timeout=10, planes=PLANES,
                               engines={"nccl": SocketLinkEngine}) as ep:
        tgt.register("w", torch.zeros(64))
        await ep.connect(tgt.name)
        ch = ep._channels[tgt.name]
        await _until(lambda: ch.link is not None and ch.link.state == "ready", what="the initiator's link is up")
        await ep.put(tgt.name, {"w": torch.ones(64)}, notify=b"first")
        assert (await tgt.next_notification(timeout=10)).payload == b"first"
        assert _ops(ep, "put")[-1]["plane"] == "nccl"
        tch = tgt._channels[ep.name]
        link = tch.link
        answer = link.answer

        def aborted_first(job):  # the channel lost (which aborts its link) just before the hand-over
            tch.lose(PeerLostError("lost by the test between the completion's check and the hand-over"))
            return answer(job)

        link.answer = aborted_first
        with pytest.raises(PeerLostError):
            await ep.put(tgt.name, {"w": torch.full((64,), 2.0)}, notify=b"second")
        await _until(lambda: _ops(tgt, "put", role="target")[-1]["state"] != "received",
                     what="the target's record leaves RECEIVED")
        recs = _ops(tgt, "put", role="target")
        assert recs[-1]["state"] == "failed" and "before the op's notification was delivered" in recs[-1]["error"], \
            recs[-1]
        with pytest.raises((asyncio.TimeoutError, TimeoutError, transport.TransportTimeoutError)):
            await tgt.next_notification(timeout=0.3)
