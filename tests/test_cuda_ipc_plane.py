"""The ``cuda_ipc`` plane's protocol through real endpoints and processes, on CPU.

``Endpoint(engines={"cuda_ipc": MemfdIpcEngine})`` (both sides) exports CPU buffers through ``memfd`` segments
the way the CUDA engine exports GPU allocations, so every op on them takes the ``cuda_ipc`` plane:
the same plane choice, export ids, stale-export retry, mapping cache, retention of unregistered
exports until the peer sends ``Unmapped``, copies on an ordered queue awaited through a completion
bridge, header after the copy. Only the engine differs from a GPU run (tests/gpu/test_ipc_gpu.py
runs the CUDA engine). Fresh random data, destinations poisoned first, byte equality read back on
the other side; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import threading
import time
import uuid

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint, make_tensor, poisoned
from tests._remote import op_records as _ops
from tests._remote import until as _until
from transport.errors import PlaneUnavailableError, StaleBufferError, TransportTimeoutError
from transport.planes import choose_gpu_plane, validate_planes
from transport.planes.cuda_ipc_engine import MappingCache
from transport.planes.cuda_ipc_holds import PeerSlots
from transport.planes.cuda_ipc_memfd import MemfdIpcEngine
from transport.planes.cuda_ipc_retention import Retention
from transport.planes.shm_slots import new_slot_table
from transport.wire import HostInfo, IpcHandle

_seeds = itertools.count(7000)


def seed() -> int:
    return next(_seeds)


@pytest.fixture(scope="module")
def target(store_url):
    t = RemoteEndpoint(f"ipc-tgt-{uuid.uuid4().hex[:6]}", store=store_url, engines={"cuda_ipc": MemfdIpcEngine})
    try:
        yield t
    finally:
        t.stop()


@pytest.fixture
async def init(store_url, uname):
    async with transport.Endpoint(uname("ipc-init"), store=store_url, timeout=30, engines={"cuda_ipc": MemfdIpcEngine}) as ep:
        yield ep


@contextlib.asynccontextmanager
async def slow_copies(store_url: str, uname, copy_delay: float):
    """A target process and an initiator here, over cuda_ipc, whose copies each take ``copy_delay`` s."""
    t = RemoteEndpoint(uname("ipc-tgt"), store=store_url, engines={"cuda_ipc": MemfdIpcEngine})
    try:
        slow = functools.partial(MemfdIpcEngine, copy_delay=copy_delay)
        async with transport.Endpoint(uname("ipc-init"), store=store_url, timeout=30, engines={"cuda_ipc": slow}) as ep:
            yield t, ep
    finally:
        t.stop()


async def test_stale_export_is_retried_and_old_export_released(init, target, uname, monkeypatch):
    """The peer re-registers a buffer while our copy of its registry still names the old export:
    the put copies into the old (held) memory, the peer answers stale, the endpoint refreshes the
    registry and retries once, into the new export; the old export's memory is released once we
    confirmed the registry update (Unmapped)."""
    name = uname("w")
    target.call("register", name, "float32", (512,))
    await init.put(target.name, {name: make_tensor("float32", (512,), seed())})
    ch = init._channels[target.name]
    real = ch.take_registry
    monkeypatch.setattr(ch, "take_registry", lambda msg: (time.sleep(1.0), real(msg)))  # our reader lags
    target.call("unregister", name)
    target.call("register", name, "float32", (512,))
    assert target.call("ipc_held"), "the old export is held while we may still copy into it"
    s = seed()
    await init.put(target.name, {name: make_tensor("float32", (512,), s)})
    assert target.call("check", name, s)
    stale = [r for r in _ops(init, "put") if r["state"] == "failed" and "re-registered" in (r["error"] or "")]
    assert stale, "the first attempt should have met the stale export"
    await _until(lambda: not target.call("ipc_held"), what="the old export released")


async def test_unregister_during_a_copy_holds_the_memory_until_it_is_done(store_url, uname):
    """Retention: while our copy into an export runs, the peer unregisters it; the peer holds
    that memory until the copy is over and we confirmed the registry update, then releases it.
    The op itself fails cleanly: its export was taken back while its copy wrote, so it is not
    retried (its bytes may have reached memory the peer reused), as on shm."""
    # the copy takes 6 s: the unregister waits up to REVOKE_WAIT_S (2 s) for it to leave the export's
    # slot, and the checks below must still see it running on a slow, loaded machine (3 s did not)
    slow = functools.partial(MemfdIpcEngine, copy_delay=6.0)
    t = RemoteEndpoint(uname("ipc-tgt"), store=store_url, engines={"cuda_ipc": MemfdIpcEngine})
    try:
        async with transport.Endpoint(uname("ipc-init"), store=store_url, timeout=30, engines={"cuda_ipc": slow}) as ep:
            name = uname("w")
            t.call("register", name, "float32", (1000,))
            await ep.connect(t.name)
            task = asyncio.ensure_future(ep.put(t.name, {name: make_tensor("float32", (1000,), seed())}))
            await _until(lambda: (ch := ep._channels.get(t.name)) is not None and ch.planes._ipc is not None
                         and bool(ch.planes._ipc._busy), what="our copy is running")
            t.call("unregister", name)
            assert len(t.call("ipc_held")) == 1  # we have not confirmed: our copy runs
            await asyncio.sleep(0.3)
            assert len(t.call("ipc_held")) == 1, "released while our copy was still running"
            with pytest.raises(StaleBufferError, match="not retried"):
                await asyncio.wait_for(task, 10)
            await _until(lambda: not t.call("ipc_held"), what="the export released after Unmapped")
    finally:
        t.stop()


async def test_a_killed_initiator_releases_what_it_held(store_url, uname):
    """The initiator dies mid-copy into an export the target has just unregistered: the target held
    the memory while the copy ran, and releases it once that process is gone (pidfd)."""
    t = RemoteEndpoint(uname("ipc-tgt"), store=store_url, engines={"cuda_ipc": MemfdIpcEngine})
    slow = functools.partial(MemfdIpcEngine, copy_delay=6.0)
    i = RemoteEndpoint(uname("ipc-init"), store=store_url, engines={"cuda_ipc": slow})
    try:
        name = uname("w")
        t.call("register", name, "uint8", (4096,))
        i.call("put", t.name, {name: ("uint8", (4096,), seed())}, 60)  # connected and mapped (6 s)
        i.start("put", t.name, {name: ("uint8", (4096,), seed())}, 60)  # its copy starts at once, takes 6 s
        await asyncio.sleep(1.0)
        t.call("unregister", name)
        await asyncio.sleep(0.5)
        assert len(t.call("ipc_held")) == 1, "released while the initiator's copy was running"
        i.kill()
        await _until(lambda: not t.call("ipc_held"), what="the export released once the peer process exited")
    finally:
        i.kill()
        t.stop()


async def test_a_channel_lost_while_its_process_lives_holds_what_existed_then(store_url, uname):
    """Our channel breaks (no Bye) while our copy into the target runs: the target cannot know the
    copy is over, so it holds that export as long as this process lives; exports it makes later
    are not held on our account."""
    async with slow_copies(store_url, uname, 2.0) as (t, ep):
        name = uname("w")
        t.call("register", name, "uint8", (4096,))
        task = asyncio.ensure_future(ep.put(t.name, {name: make_tensor("uint8", (4096,), seed())}))
        await _until(lambda: (ch := ep._channels.get(t.name)) is not None and ch.planes._ipc is not None
                     and bool(ch.planes._ipc._busy), what="our copy is running")
        ep._channels[t.name].lose(transport.PeerLostError("test: the channel breaks"))
        with pytest.raises(transport.PeerLostError):
            await asyncio.wait_for(task, 10)
        t.call("unregister", name)
        await asyncio.sleep(2.5)  # our copy is over by now, but the target cannot know it
        assert len(t.call("ipc_held")) == 1
        later = uname("later")
        t.call("register", later, "uint8", (64,))
        await ep.put(t.name, {later: make_tensor("uint8", (64,), seed())})  # a new channel
        t.call("unregister", later)
        await _until(lambda: len(t.call("ipc_held")) == 1, what="the later export released")


async def test_get_abandoned_mid_copy_writes_nothing_after_it_raised(store_url, uname):
    async with slow_copies(store_url, uname, 0.4) as (t, ep):
        name = uname("w")
        s = seed()
        t.call("register_data", name, "uint8", (1 << 16,), s)
        await ep.get(t.name, {name: poisoned("uint8", (1 << 16,))})  # connected, mapped
        out = poisoned("uint8", (1 << 16,))
        with pytest.raises(TransportTimeoutError) as info:  # (the copy takes 0.4 s)
            await ep.get(t.name, {name: out}, timeout=0.1)
        assert _ops(ep, "get")[-1]["plane"] == "cuda_ipc"
        assert "may still land" not in str(info.value)
        after = out.clone()
        await asyncio.sleep(0.6)
        assert torch.equal(out, after)  # the copy was over when get raised


async def test_planes_without_cuda_ipc_use_shm(store_url, uname):
    t = RemoteEndpoint(uname("ipc-tgt"), store=store_url, engines={"cuda_ipc": MemfdIpcEngine})
    try:
        async with transport.Endpoint(uname("ipc-init"), store=store_url, timeout=30, planes=("shm", "tcp"),
                                      engines={"cuda_ipc": MemfdIpcEngine}) as ep:
            name = uname("w")
            t.call("register", name, "float32", (64,))
            s = seed()
            await ep.put(t.name, {name: make_tensor("float32", (64,), s)})
            assert t.call("check", name, s)
            peer = await ep.connect(t.name)
            assert peer.gpu_plane == "staged" and "not allowed here" in peer.gpu_plane_reason
            assert peer.maps_memory() and not peer.maps_memory(gpu=True)
            assert {r["plane"] for r in _ops(ep, "put")} == {"shm"}
    finally:
        t.stop()


async def test_peer_says_its_gpu_buffers_are_mapped_over_cuda_ipc(init, target):
    peer = await init.connect(target.name)
    assert peer.gpu_plane == "cuda_ipc" and peer.maps_memory(gpu=True) and peer.maps_memory()


async def test_a_peer_without_the_engine_gets_no_exports(store_url, uname):
    """A target without cuda_ipc exports nothing; our CPU ops then take the CPU plane."""
    t = RemoteEndpoint(uname("ipc-tgt"), store=store_url, planes=("shm", "tcp"))
    try:
        async with transport.Endpoint(uname("ipc-init"), store=store_url, timeout=30, engines={"cuda_ipc": MemfdIpcEngine}) as ep:
            name = uname("w")
            t.call("register", name, "float32", (64,))
            s = seed()
            await ep.put(t.name, {name: make_tensor("float32", (64,), s)})
            assert t.call("check", name, s)
            assert {r["plane"] for r in _ops(ep, "put")} == {"shm"}
    finally:
        t.stop()


# ---------------------------------------------------------------------------- the parts alone
def test_validate_planes_accepts_gpu_planes_and_needs_a_cpu_plane():
    assert validate_planes(None) == ("shm", "tcp", "cuda_ipc", "nccl")
    assert validate_planes(["tcp", "cuda_ipc"]) == ("tcp", "cuda_ipc")
    with pytest.raises(ValueError, match="no CPU plane"):
        validate_planes(["cuda_ipc", "nccl"])
    with pytest.raises(ValueError, match="unknown planes"):
        validate_planes(["tcp", "staged"])


def test_choose_gpu_plane_reasons():
    here = HostInfo("h", "boot", 1, 10)
    neighbour = HostInfo("h", "boot", 1, 11)
    far = HostInfo("g", "other-boot", 1, 11)
    ok = (True, "engine ready")
    assert choose_gpu_plane(here, neighbour, ipc_engine=ok)[0] == "cuda_ipc"
    for remote, mine, theirs, engine, why in [
        (far, ("tcp", "cuda_ipc"), ("tcp", "cuda_ipc"), ok, "not on this host"),
        (here, ("tcp", "cuda_ipc"), ("tcp", "cuda_ipc"), ok, "in this process"),
        (neighbour, ("tcp",), ("tcp", "cuda_ipc"), ok, "not allowed here"),
        (neighbour, ("tcp", "cuda_ipc"), ("tcp",), ok, "not allowed by the peer"),
        (neighbour, ("tcp", "cuda_ipc"), ("tcp", "cuda_ipc"), (False, "no CUDA"), "no CUDA"),
    ]:
        plane, reason = choose_gpu_plane(here, remote, mine, theirs, engine)
        assert plane == "staged" and why in reason, reason


def test_retention_releases_once_every_holder_confirmed_the_epoch():
    released = []
    r = Retention(released.append)
    r.retire(1, "a", 3)  # no holder: released at once
    assert released == ["a"]
    r.watch("ch1", 4, None)
    r.watch("hs", 4, None)  # a handshake in progress: its peer may map what our Hello (epoch 4) named
    r.retire(2, "b", 5)
    r.acked("ch1", 5)
    assert released == ["a"] and r.held == {2: 5}
    r.forget("hs")  # the handshake failed
    assert released == ["a", "b"]
    r.retire(3, "c", 6)
    r.acked("ch1", 5)  # an older epoch confirms nothing new
    assert r.held == {3: 6}
    r.closed("ch1", 3)  # closed, and its process is not on this host: nothing in flight here
    assert released == ["a", "b", "c"] and r.holders == {}


def test_retention_waits_for_a_closed_peers_process_for_what_existed_then():
    import subprocess
    import sys

    released = []
    r = Retention(released.append)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        r.watch("ch", 1, child.pid)
        r.retire(7, "x", 2)
        r.closed("ch", 7)  # its channel closed (no Bye), its process lives: it may still copy into 7
        r.retire(8, "y", 3)  # made after it closed: not its concern
        time.sleep(0.3)
        assert released == ["y"]
        r.closed("ch", 9)  # (a second close changes nothing)
        child.kill()
        child.wait(10)
        end = time.monotonic() + 10
        while len(released) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        assert released == ["y", "x"] and r.holders == {}
    finally:
        child.kill()


def test_retention_at_shutdown_holds_for_live_peer_processes():
    import subprocess
    import sys

    from transport.planes.cuda_ipc_retention import NEVER

    released = []
    r = Retention(released.append)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        r.watch("live", 5, child.pid)
        r.watch("far", 5, None)  # not on this host: nothing of ours mapped there
        r.retire(1, "registered", NEVER)  # still registered when the endpoint closed
        r.shutdown(1)
        r.watch("late", 1, child.pid)  # no new holders after shutdown
        time.sleep(0.3)
        assert released == [] and set(r.holders) == {"live"}
        child.kill()
        child.wait(10)
        end = time.monotonic() + 10
        while not released and time.monotonic() < end:
            time.sleep(0.05)
        assert released == ["registered"]
    finally:
        child.kill()


class _CountingEngine(MemfdIpcEngine):
    def __init__(self) -> None:
        super().__init__()
        self.opened: list[bytes] = []
        self.closed: list[bytes] = []

    def open(self, handle):
        self.opened.append(handle.handle)
        key = handle.handle
        closed = self.closed

        class M:
            def view(self, offset, nbytes):
                return torch.zeros(nbytes, dtype=torch.uint8)

            def close(self):
                closed.append(key)

        return M()


def test_mapping_cache_maps_once_and_unmaps_when_unused():
    engine = _CountingEngine()
    cache = MappingCache(engine)
    h1 = IpcHandle("memfd", "d", b"alloc-1", 100, 0, 1)
    h2 = IpcHandle("memfd", "d", b"alloc-1", 100, 50, 2)  # another buffer of the same allocation
    cache.acquire(h1)
    cache.acquire(h2)
    cache.acquire(h1)
    assert engine.opened == [b"alloc-1"] and len(cache) == 1
    cache.release(h1)
    cache.release(h1)
    cache.retire(h1)
    assert engine.closed == []  # h2 is still live and in use
    cache.retire(h2)
    assert engine.closed == []  # ... in use
    cache.release(h2)
    assert engine.closed == [b"alloc-1"] and len(cache) == 0
    cache.acquire(h1)  # mapped again when needed again
    assert engine.opened == [b"alloc-1", b"alloc-1"]


def test_mapping_cache_open_failure_counts_nothing():
    class Failing(MemfdIpcEngine):
        def open(self, handle):
            raise PlaneUnavailableError("cannot map")

    cache = MappingCache(Failing())
    with pytest.raises(PlaneUnavailableError):
        cache.acquire(IpcHandle("memfd", "d", b"x", 10, 0, 1))
    assert len(cache) == 0


class _SlowUnmap(_CountingEngine):
    """Records opens and unmaps (``events``); an unmap takes 0.3 s (``unmapping`` is set as it
    starts); ``first_open`` runs before the first open."""

    def __init__(self, first_open=None) -> None:
        super().__init__()
        self.events: list[str] = []
        self.unmapping = threading.Event()
        self._first_open = first_open

    def open(self, handle):
        self.events.append("open")
        if self._first_open is not None and self.events.count("open") == 1:
            self._first_open()
        m = super().open(handle)
        real = m.close

        def close():
            self.events.append("close-start")
            self.unmapping.set()
            time.sleep(0.3)
            real()
            self.events.append("close-end")

        m.close = close
        return m


def test_mapping_cache_never_reopens_an_allocation_while_it_is_being_unmapped():
    """The driver may refuse to open a handle whose unmapping is still under way (and a refusal
    would send that allocation staged for good): an acquire that comes in meanwhile waits for it."""
    engine = _SlowUnmap()
    cache = MappingCache(engine)
    h = IpcHandle("memfd", "d", b"alloc-1", 100, 0, 1)
    cache.acquire(h)
    cache.retire(h)
    closer = threading.Thread(target=cache.release, args=(h,))  # the last user: unmaps (slowly)
    closer.start()
    assert engine.unmapping.wait(5)
    cache.acquire(h)  # meanwhile: waits for the unmap, then maps anew
    closer.join(5)
    assert engine.events == ["open", "close-start", "close-end", "open"], engine.events
    assert len(cache) == 1 and cache.refusal(h) is None
    cache.release(h)
    cache.close()
    assert engine.events[-2:] == ["close-start", "close-end"] and len(cache) == 0


def test_mapping_cache_an_opener_that_waited_on_the_gate_does_not_reopen_during_an_unmap():
    """A thread that was waiting to open an allocation while another opened it, and gets its turn
    only once that mapping is already being unmapped, waits for the unmap too."""
    second_waits = threading.Event()

    def first_open() -> None:  # the second opener is queued on the gate before the first one maps
        assert second_waits.wait(5)
        time.sleep(0.05)

    engine = _SlowUnmap(first_open)

    class Gate:  # the allocation's opening lock; its second user is descheduled right after getting it
        def __init__(self) -> None:
            self._lock, self._users = threading.Lock(), 0

        def __enter__(self) -> None:
            self._users += 1
            n = self._users
            if n == 2:
                second_waits.set()
            self._lock.acquire()
            if n == 2:
                engine.unmapping.wait(5)

        def __exit__(self, *exc) -> None:
            self._lock.release()

    cache = MappingCache(engine)
    h = IpcHandle("memfd", "d", b"alloc-1", 100, 0, 1)
    cache._opening[h.handle] = Gate()
    first = threading.Thread(target=cache.acquire, args=(h,))
    first.start()
    time.sleep(0.02)
    second = threading.Thread(target=cache.acquire, args=(h,))
    second.start()
    first.join(5)
    cache.retire(h)
    closer = threading.Thread(target=cache.release, args=(h,))  # the first user leaves: unmapped
    closer.start()
    second.join(5)
    closer.join(5)
    assert engine.events == ["open", "close-start", "close-end", "open"], engine.events
    assert len(cache) == 1 and cache.refusal(h) is None


def test_mapping_cache_a_non_blocking_acquire_counts_only_what_is_mapped():
    engine = _CountingEngine()
    cache = MappingCache(engine)
    h = IpcHandle("memfd", "d", b"alloc-1", 100, 0, 1)
    assert cache.acquire(h, block=False) is None and engine.opened == [] and len(cache) == 0
    cache.acquire(h)
    assert cache.acquire(h, block=False) is not None and engine.opened == [b"alloc-1"]
    cache.release(h)
    cache.release(h)
    cache.retire(h)
    assert engine.closed == [b"alloc-1"]


def test_mapping_cache_an_opener_woken_on_a_gate_that_has_served_does_not_open_again():
    """A waiter on an allocation's opening gate that wakes only after that opening's mapping came
    and went (and a new opener started) must not open the allocation a second time."""
    opened: list[str] = []
    release_first, release_third, second_go = threading.Event(), threading.Event(), threading.Event()
    holds = {"first": release_first, "third": release_third}

    class Held(_CountingEngine):
        def open(self, handle):
            hold = holds.get(threading.current_thread().name)
            if hold is not None:
                assert hold.wait(5)
            opened.append(threading.current_thread().name)
            return super().open(handle)

    class SlowGate:  # "second" is descheduled for a while after it gets the gate
        def __init__(self) -> None:
            self._lock = threading.Lock()

        def __enter__(self) -> None:
            self._lock.acquire()
            if threading.current_thread().name == "second":
                assert second_go.wait(5)

        def __exit__(self, *exc) -> None:
            self._lock.release()

    cache = MappingCache(Held())
    h = IpcHandle("memfd", "d", b"alloc-1", 100, 0, 1)
    cache._opening[h.handle] = SlowGate()
    got: dict[str, object] = {}
    threads = {n: threading.Thread(target=lambda n=n: got.__setitem__(n, cache.acquire(h)), name=n)
               for n in ("first", "second", "third")}
    threads["first"].start()
    time.sleep(0.05)
    threads["second"].start()  # waits on the gate
    time.sleep(0.05)
    release_first.set()
    threads["first"].join(5)
    cache.release(h)
    cache.retire(h)  # the first mapping is unmapped
    threads["third"].start()  # opens anew, behind its own gate
    time.sleep(0.05)
    second_go.set()  # the second waiter wakes on the old gate
    time.sleep(0.05)
    release_third.set()
    threads["second"].join(5)
    threads["third"].join(5)
    assert opened == ["first", "third"], opened
    assert got["second"] is got["third"] and len(cache) == 1


def test_mapping_cache_an_unmap_that_lasts_too_long_refuses_only_while_it_lasts(monkeypatch):
    import transport.planes.cuda_ipc_engine as ipc

    monkeypatch.setattr(ipc, "_UNMAP_WAIT_S", 0.05)
    engine = _SlowUnmap()  # an unmap takes 0.3 s
    cache = MappingCache(engine)
    h = IpcHandle("memfd", "d", b"alloc-1", 100, 0, 1)
    cache.acquire(h)
    cache.retire(h)
    closer = threading.Thread(target=cache.release, args=(h,))
    closer.start()
    assert engine.unmapping.wait(5)
    with pytest.raises(PlaneUnavailableError, match="still being unmapped"):
        cache.acquire(h)
    assert "still being unmapped" in (cache.refusal(h) or "")  # the op's retry goes staged
    closer.join(5)
    assert cache.refusal(h) is None  # the unmap ended: mappable again
    cache.acquire(h)
    assert engine.events == ["open", "close-start", "close-end", "open"], engine.events


def test_a_slot_table_that_cannot_be_opened_keeps_the_header_path(caplog):
    """cuda_ipc works without the peer's slot table (unlike shm): where /proc/<pid>/fd/<n> cannot be
    opened (another user, a process that is not dumpable), the op takes its header and
    acknowledgement instead of failing, and the table is not tried again at every op (logged once)."""
    slots = PeerSlots("cuda_ipc", "peer")
    gone = IpcHandle("memfd", "d", b"x", 10, 0, 1, pid=os.getpid(), slot=3, table_fd=2**30, table_inode=12345)
    with caplog.at_level(logging.WARNING, logger="transport.planes.cuda_ipc"):
        assert slots.guard(["w"], [gone]) is None
        assert slots.guard(["w"], [gone]) is None
    assert caplog.text.count("cannot be opened") == 1, caplog.text
    # a table that opens: the words are locked and checked, and a revoked one is refused typed
    table = new_slot_table("cuda_ipc")
    assert table is not None
    try:
        slot = table.alloc(7)
        live = IpcHandle("memfd", "d", b"x", 10, 0, 7, pid=os.getpid(), slot=slot, table_fd=table.fd,
                         table_inode=table.inode)
        guard = slots.guard(["w"], [live])
        assert guard is not None
        guard.over()
        assert guard.stale is None
        guard = slots.guard(["w"], [live])
        table.revoke(slot, "w", wait=False)  # taken back while "the copy ran" (it did not wait: no bound here)
        guard.over()
        assert isinstance(guard.stale, transport.StaleBufferError)
        with pytest.raises(transport.StaleBufferError):
            slots.guard(["w"], [live])
        assert not guard.view.owner_exited()  # (this process: alive)
    finally:
        slots.close()
        table.close()


async def test_a_re_pointed_tensor_is_refused_over_cuda_ipc_not_corrupted(init, target, uname):
    """The owner re-points a registered tensor (``.data =``, as ``module.to()`` does): cuda_ipc's
    puts and gets are one-sided, so no header reaches the owner to check; its heartbeat tick
    marks the export's slot, and the peer's later puts and gets fail with BufferMismatchError
    (saying to re-register) instead of landing in, or reading, the old memory."""
    name = uname("w")
    target.call("register", name, "float32", (8, 8))
    await init.put(target.name, {name: make_tensor("float32", (8, 8), seed())})
    assert [r["plane"] for r in _ops(init, "put")][-1] == "cuda_ipc"
    target.call("repoint", name)
    deadline = time.monotonic() + 5.0  # (the tick runs every heartbeat interval: 1 s)
    while True:
        try:
            await init.put(target.name, {name: make_tensor("float32", (8, 8), seed())})
        except transport.BufferMismatchError as exc:
            assert "re-register" in str(exc), exc
            break
        assert time.monotonic() < deadline, "the re-pointed tensor was never noticed"
        await asyncio.sleep(0.05)
    assert target.call("is_poisoned", name), "a put landed in the tensor's new memory"
    with pytest.raises(transport.BufferMismatchError, match="re-register"):
        await init.get(target.name, {name: torch.empty(8, 8)})
    assert _ops(init, "get")[-1]["plane"] == "cuda_ipc"
    target.call("re_register", name)  # registered again: ops work again, on the new memory
    s = seed()
    await init.put(target.name, {name: make_tensor("float32", (8, 8), s)})
    assert target.call("check", name, s)
    assert _ops(init, "put")[-1]["plane"] == "cuda_ipc"
