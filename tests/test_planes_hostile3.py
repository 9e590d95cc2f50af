"""Hostile review of the planes (third round): shm, the cuda_ipc CPU stand-in, staged into shm.

Each case tries to break one documented guarantee (README "Failure behaviour", docs/architecture.md):
a one-sided copy lands before the target takes the buffer back or fails typed; nothing is written
after an op raised; ranges stay inside the range. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import transport
from transport.planes.shm import ShmPlane

_TYPED = (transport.StaleBufferError, transport.UnknownBufferError, transport.PeerLostError)


def _pausing_copy(monkeypatch, half: threading.Event, go: threading.Event, min_numel: int) -> None:
    """Every shm copy into a peer of at least ``min_numel`` elements writes half, sets ``half``,
    waits (bounded) for ``go``, then writes the rest: a copy thread descheduled in the middle of a
    chunk (what a 64 MiB memcpy on a loaded 2-core host is)."""
    real = ShmPlane._copy_one

    def copy(self, op, t, remote, into_peer):
        if not into_peer or t.numel() < min_numel:
            return real(self, op, t, remote, into_peer)
        k = t.numel() // 2
        flat, dst = t.reshape(-1), remote.view(t.dtype).reshape(-1)
        dst[:k].copy_(flat[:k])
        half.set()
        go.wait(10)
        dst[k:].copy_(flat[k:])
        return True

    monkeypatch.setattr(ShmPlane, "_copy_one", copy)


# ---------------------------------------------------------------------------- shm: the channel lost mid-copy

def _take_back_and_reuse(tgt, arena, n):
    """The target takes ``x`` back (timed: it waits for a copy holding its slot, up to 2 s) and
    registers ``y`` at x's old place in ``arena``, filled with -5; returns (seconds, y)."""
    t0 = time.monotonic()
    tgt.unregister("x")
    took = time.monotonic() - t0
    y = arena[:n]
    tgt.register("y", y)
    y.fill_(-5)
    return took, y

@pytest.mark.timeout(60)
async def test_a_channel_lost_mid_copy_keeps_the_slot_locked_until_the_copy_stopped(store_url, uname, monkeypatch):
    """The initiator's channel breaks (a socket reset) while its one-sided put is in the middle of a
    chunk. Its plane closes on the event loop meanwhile; the copy thread still writes the rest of
    that chunk. The target, seeing the channel go, takes ``x`` (a view of an arena) back and
    registers ``y`` at its old place. The take-back must wait for the copy still writing (the slot's
    lock): closing the slot table's descriptor must not drop the lock under a copy in flight, or
    the rest of the chunk lands in ``y``, registered after the take-back."""
    n = 1 << 20  # int64: 8 MiB, a worker thread's copy
    half, go = threading.Event(), threading.Event()
    async with transport.Endpoint(uname("tgt"), store=store_url, planes=("shm",), timeout=10) as tgt, \
            transport.Endpoint(uname("ini"), store=store_url, planes=("shm",), timeout=10) as ini:
        arena = tgt.new_buffer("arena", (2 * n,), torch.int64)
        tgt.register("x", arena[:n])
        await ini.connect(tgt.name)
        await ini.get(tgt.name, {"x": torch.empty(n, dtype=torch.int64)})  # segment and table mapped
        _pausing_copy(monkeypatch, half, go, n)
        put = asyncio.ensure_future(ini.put(tgt.name, {"x": torch.full((n,), 7, dtype=torch.int64)}))
        assert await asyncio.to_thread(half.wait, 10), "the copy never started"
        ini._channels[tgt.name].lose(transport.PeerLostError("test: the socket was reset"))
        await asyncio.sleep(0.1)  # the initiator's channel closes its planes on the loop
        threading.Timer(0.3, go.set).start()  # the copy thread runs again 0.3 s from now
        took, y = _take_back_and_reuse(tgt, arena, n)  # must wait for the copy (its slot lock), up to the 2 s bound
        with pytest.raises(_TYPED):
            await asyncio.wait_for(put, 10)
        go.set()
        clobbered = int((y != -5).sum())
        print(f"\n  unregister took {took:.3f} s; y has {clobbered}/{n} elements overwritten by the late copy")
        assert took < 1.5, f"the take-back waited {took:.3f} s: the slot stayed locked after the copy stopped"
        assert clobbered == 0, (f"unregister returned after {took:.3f} s without waiting for the copy in flight; "
                                f"{clobbered} elements of 'y' (registered after the take-back) were overwritten")


def test_a_closed_table_view_releases_each_lock_as_its_op_leaves():
    """Unit: a peer's slot table closed (its channel lost) while an op holds a slot: the op's
    ``leave`` must release the lock then, not whenever the view object happens to be collected
    (the view's mmap holds a duplicate of the descriptor, so closing the fd alone drops no lock):
    a view kept alive by anything (a traceback in an exception the caller kept) kept the peer's
    slot locked, every take-back of it waited the 2 s bound and memory over it stayed refused."""
    import fcntl
    import os

    from transport.planes.shm_slots import SlotTable, TableView, _lock

    table = SlotTable()
    try:
        slot = table.alloc(42)
        view = TableView(os.getpid(), table.fd, table.inode)
        view.enter1(slot, 42, "x")
        view.enter([(slot, 42)], ["x"])  # two ops of this process on the slot
        view.close()  # the channel closed meanwhile
        assert not _lock(table.fd, fcntl.F_WRLCK, slot), "closing the view dropped the lock under a copy in flight"
        with pytest.raises(transport.PeerLostError):
            view.enter1(slot, 42, "x")  # no new op on a closed view
        view.leave1(slot)
        assert not _lock(table.fd, fcntl.F_WRLCK, slot), "the second op still copies"
        view.leave([slot])
        kept = view  # (an exception's traceback keeps the view alive)
        assert _lock(table.fd, fcntl.F_WRLCK, slot), "the lock outlived the last op on a closed view"
        _lock(table.fd, fcntl.F_UNLCK, slot)
        assert kept.fd < 0 and not kept.owner_exited()
    finally:
        table.close()


# ---------------------------------------------------------------------------- ranges past 2**31 and 2**32 bytes
def _plane_kwargs(name: str) -> dict:
    from tests import test_conformance as conf

    return conf.FACTORIES[name]().init


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plane", ["shm", "staged", "nccl"])  # (cuda_ipc needs a peer process: not here)
async def test_ranges_across_2_31_and_2_32_bytes_land_exactly(store_url, uname, plane):
    """A 4 GiB + 64 KiB uint8 buffer (sparse: only the pages written are ever touched), and
    ranges that straddle byte 2**31, byte 2**32 and the buffer's end, and zero-length ones there:
    each put lands exactly in its range (the bytes around it, poisoned, untouched), each get reads
    exactly its range (the destination around it untouched), on every plane. A 32-bit offset or
    length anywhere on the path (a view, a memmove, a wire field, a bounce buffer) would land
    elsewhere or fail."""
    kw = _plane_kwargs(plane)
    size = (1 << 32) + (1 << 20)
    k = 12288  # 3 pages
    spots = [(1 << 31) - 4096, (1 << 32) - 4096, (1 << 32) + (1 << 16) + 5, size - k]
    async with transport.Endpoint(uname("tgt"), store=store_url, timeout=20, **kw) as tgt, \
            transport.Endpoint(uname("ini"), store=store_url, timeout=20, **kw) as ini:
        if plane == "shm":
            w = tgt.new_buffer("w", (size,), torch.uint8)  # a memfd segment: zero pages on first touch
        else:
            w = torch.empty(size, dtype=torch.uint8)  # (untouched pages cost nothing)
            tgt.register("w", w)
        for off in spots:  # poison around each range
            w[max(0, off - 4096) : off + k + 4096].fill_(0xA5)
        route = await ini.route(tgt.name, {"w": transport.At(torch.zeros(k, dtype=torch.uint8), spots[0])})
        assert route.plane == plane, route
        for i, off in enumerate(spots):
            src = torch.randint(0, 256, (k,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
            await ini.put(tgt.name, {"w": transport.At(src, off)})
            await ini.put(tgt.name, {"w": transport.At(torch.zeros(0, dtype=torch.uint8), off + k)})  # zero-length
            assert torch.equal(w[off : off + k], src), f"put at byte {off}: the range does not hold its bytes"
            lo, hi = w[max(0, off - 4096) : off], w[off + k : off + k + 4096]
            assert bool((lo == 0xA5).all()) and bool((hi == 0xA5).all()), f"put at byte {off} wrote outside its range"
            out = torch.full((k + 2 * 4096,), 0x5A, dtype=torch.uint8)
            await ini.get(tgt.name, {"w": transport.At(out[4096 : 4096 + k], off)})
            assert torch.equal(out[4096 : 4096 + k], src), f"get at byte {off} read other bytes"
            assert bool((out[:4096] == 0x5A).all()) and bool((out[4096 + k :] == 0x5A).all()), \
                f"get at byte {off} wrote outside the destination view"
        with pytest.raises(transport.BufferMismatchError):  # one element past the end
            await ini.put(tgt.name, {"w": transport.At(torch.zeros(k, dtype=torch.uint8), size - k + 1)})
        assert bool((w[size - k - 4096 : size - k] == 0xA5).all())


# ---------------------------------------------------------------------------- staged into shm: the slot locks
@pytest.mark.timeout(60)
async def test_a_staged_put_into_an_arena_view_never_lands_in_a_buffer_registered_later_at_the_old_place(
        store_url, uname, monkeypatch):
    """A staged put (our tensors staged through bounce buffers, here with the CPU copy engine) into
    the peer's ``x``, a view of an arena in shm, is halfway through its copy when the target takes
    ``x`` back and registers ``y`` at its old place. docs/architecture.md: the staged shm path is
    a header op, and "where the exports have slots, those copies run under the slot locks as a
    one-sided op's do, so a put never lands in a view of an arena registered later at the old
    place". The take-back must wait for the copy (or the copy must fail before writing more):
    the rest of the copy must not land in ``y``."""
    from transport.planes.shm import StagedShmPlane
    from transport.staging import StagingConfig, ThreadCopyEngine

    n = 1 << 20  # int64: 8 MiB
    half, go = threading.Event(), threading.Event()
    real = StagedShmPlane._copy_one

    def copy(self, op, t, remote, into_peer):
        if not into_peer or t.numel() < n:
            return real(self, op, t, remote, into_peer)
        flat, k = t.reshape(-1), t.numel() // 2
        kb = k * t.element_size()
        if not real(self, op, flat[:k], remote[:kb], True):
            return False
        half.set()
        go.wait(10)
        return real(self, op, flat[k:], remote[kb:], True)

    staging = StagingConfig(chunk_bytes=1 << 20, buffers=3, cpu_engine=ThreadCopyEngine, cpu_engine_peers=False)
    async with transport.Endpoint(uname("tgt"), store=store_url, planes=("shm",), timeout=10) as tgt, \
            transport.Endpoint(uname("ini"), store=store_url, planes=("shm",), timeout=10, staging=staging) as ini:
        arena = tgt.new_buffer("arena", (2 * n,), torch.int64)
        tgt.register("x", arena[:n])
        await ini.put(tgt.name, {"x": torch.full((n,), 1, dtype=torch.int64)})  # mapped; staged
        assert {r["plane"] for r in ini.recorder.snapshot() if r["kind"] == "put"} == {"shm"}
        assert ini.staging.statistics().peak_in_use > 0, "the put was not staged"
        monkeypatch.setattr(StagedShmPlane, "_copy_one", copy)
        put = asyncio.ensure_future(ini.put(tgt.name, {"x": torch.full((n,), 7, dtype=torch.int64)}))
        assert await asyncio.to_thread(half.wait, 10), "the copy never started"
        threading.Timer(0.3, go.set).start()
        took, y = _take_back_and_reuse(tgt, arena, n)
        try:
            await asyncio.wait_for(put, 10)
            outcome = "done"
        except transport.TransportError as exc:
            outcome = f"{type(exc).__name__}"
        go.set()
        clobbered = int((y != -5).sum())
        print(f"\n  put -> {outcome}; unregister took {took:.3f} s; y has {clobbered}/{n} elements overwritten")
        assert clobbered == 0, (f"the take-back did not wait for the staged copy in flight ({took:.3f} s): {clobbered} "
                                f"elements of 'y', registered at x's old place after it, were overwritten (put: {outcome})")
        assert outcome != "done" or bool((y == 7).all())


# ---------------------------------------------------------------------------- cuda_ipc: a put with a notification
@pytest.mark.timeout(60)
async def test_a_notified_cuda_ipc_put_never_lands_in_a_buffer_registered_later_at_the_old_place(store_url, uname):
    """cuda_ipc (its CPU stand-in engine, its copies delayed 1 s as a busy stream would run them):
    the initiator (a process) puts into ``x``, a view of the target's arena, with a notification
    (the header path). While its copy is queued, the target takes ``x`` back and registers ``y`` at
    its old place (filled with -5). The late copy must not land in ``y``: the take-back waits for
    it (the export's slot lock, as for a one-sided op), or the copy is dropped."""
    import functools

    from tests._hostile_remote import HostileRemote
    from transport.planes.cuda_ipc_memfd import MemfdIpcEngine

    n = 1 << 16  # int64: 512 KiB
    ini = HostileRemote(uname("ini"), store=store_url, timeout=20,
                        engines={"cuda_ipc": functools.partial(MemfdIpcEngine, copy_delay=1.0)})
    try:
        async with transport.Endpoint(uname("tgt"), store=store_url, timeout=20,
                                      engines={"cuda_ipc": MemfdIpcEngine}) as tgt:
            arena = tgt.new_buffer("arena", (2 * n,), torch.int64)
            tgt.register("x", arena[:n])
            await asyncio.to_thread(ini.call, "connect", tgt.name)
            ini.start("put", tgt.name, "x", n, 7, b"note", 20)
            await asyncio.sleep(0.5)  # its copy is queued (it runs 1 s after it was issued)
            took, y = _take_back_and_reuse(tgt, arena, n)
            err = await asyncio.to_thread(ini.result, 30)
            await asyncio.sleep(0.3)
            assert ini.call("op_planes", "put") == ["cuda_ipc"]
            clobbered = int((y != -5).sum())
            print(f"\n  put -> {err or 'done'}; unregister took {took:.3f} s; y has {clobbered}/{n} elements overwritten")
            assert clobbered == 0, (f"put {'reported done' if not err else 'failed: ' + err}; {clobbered} elements of "
                                    "'y', registered at x's old place after the take-back, were overwritten by it")
    finally:
        ini.kill()
