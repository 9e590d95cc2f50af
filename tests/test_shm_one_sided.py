"""``shm`` puts without a notification, and gets, need no round trip (``transport/planes/shm_slots.py``).

The initiator locks the export's word in the target's slot table (shared), checks it still names
the export, copies, checks again and unlocks; the target revokes an export (unregister,
re-register, close) under the exclusive lock, bounded. What must hold, tried here with real
processes: a plain put or get completes with the target frozen (one-sided); a put racing the
target's take-backs either lands before the buffer is taken back or fails with a typed error,
never reported done while its bytes are lost, and a large copy is never torn by a take-back; an
initiator frozen mid-copy holds up a take-back for the bound only, and its put then fails.
Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import signal
import time

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint, landed_elements, make_tensor, same_bytes
from transport.planes.cuda_ipc_memfd import MemfdIpcEngine
from transport.planes.shm_slots import MOVED, REVOKE_WAIT_S, SlotTable, TableView, _lock

_TYPED = (transport.StaleBufferError, transport.UnknownBufferError)


async def test_a_plain_put_and_get_need_nothing_of_a_frozen_target(store_url, uname, tmp_path):
    tgt = RemoteEndpoint(uname("tgt"), store=store_url, planes=("shm",), dump_dir=str(tmp_path))
    try:
        tgt.call("register", "w", "float32", (4096,))
        tgt.call("register", "big", "float32", (1 << 20,))  # 4 MiB: copied on a worker thread
        async with transport.Endpoint(uname("ini"), store=store_url, planes=("shm",), timeout=5) as ep:
            await ep.connect(tgt.name)
            tgt.signal(signal.SIGSTOP)
            try:
                await ep.put(tgt.name, {"w": make_tensor("float32", (4096,), 1)}, timeout=2)
                await ep.put(tgt.name, {"big": make_tensor("float32", (1 << 20,), 2)}, timeout=2)
                out = torch.zeros(4096)
                await ep.get(tgt.name, {"w": out}, timeout=2)
                assert same_bytes(out, make_tensor("float32", (4096,), 1))
                with pytest.raises(transport.TransportTimeoutError):  # a notification needs the target
                    await ep.put(tgt.name, {"w": make_tensor("float32", (4096,), 3)}, notify=b"x", timeout=0.5)
            finally:
                tgt.signal(signal.SIGCONT)
            assert tgt.call("check", "big", 2)
            # the initiator's flight recorder has every op; the target's only the one that messaged it
            recs = [r for r in ep.recorder.snapshot() if r["kind"] in ("put", "get") and r["peer"] == tgt.name]
            assert [(r["kind"], r["plane"], r["state"]) for r in recs[:3]] == [
                ("put", "shm", "done"), ("put", "shm", "done"), ("get", "shm", "done")], recs
            with open(tgt.call("dump", str(tmp_path / "tgt.json"))) as f:  # noqa: ASYNC230 - a small local file
                dump = json.load(f)
            assert [r["kind"] for r in dump["records"] if r["role"] == "target"] == ["put"], dump["records"]
    finally:
        tgt.kill()


# cuda_ipc's one-sided ops use the same slot words (its exporter's own table): its CPU stand-in
# engine runs them here, copies on a worker thread as a CUDA stream would run them
_PLANES = {"shm": {"planes": ("shm",)}, "cuda_ipc": {"engines": {"cuda_ipc": MemfdIpcEngine}}}


@pytest.mark.parametrize("plane", list(_PLANES))
async def test_puts_racing_take_backs_land_before_or_fail_typed(store_url, uname, plane):
    """Small puts (shm: on the event loop), each writing its own index into its own element, while
    the target unregisters and re-registers the buffer every few milliseconds: every put that
    returned must be found in the registration it landed in (taken back whole, or the last one),
    and each failure is a typed one (stale export, or the buffer gone at the retry)."""
    n = 20000 if plane == "shm" else 5000
    kw = _PLANES[plane]
    tgt = RemoteEndpoint(uname("tgt"), store=store_url, **kw)
    try:
        tgt.call("register", "w", "int64", (n,))
        tgt.call("churn", "w", 1, 0.0, 1)  # (zero-filled, not poisoned)
        async with transport.Endpoint(uname("ini"), store=store_url, timeout=10, **kw) as ep:
            await ep.connect(tgt.name)
            tgt.start("churn", "w", 60, 0.005, 1)
            ok, failed = [], 0
            for i in range(1, n):
                try:
                    await ep.put(tgt.name, {"w": transport.At(torch.tensor([i]), i)})
                    ok.append(i)
                except _TYPED:
                    failed += 1
            held = tgt.result(timeout=60)
            held += tgt.call("churn", "w", 1, 0.0, 1)  # and the registration that is live now
        assert len(held) == 61
        landed = landed_elements(held)
        lost = [i for i in ok if i not in landed]
        assert not lost, f"{len(lost)} puts returned but their bytes are in no registration: {lost[:10]}"
        assert len(ok) > n // 2, (len(ok), failed)
        planes = {r["plane"] for r in ep.recorder.snapshot() if r["kind"] == "put" and r["state"] == "done"}
        assert planes == {plane}, planes
        targeted = tgt.call("target_ops")
        assert not targeted, f"one-sided puts sent the target {targeted} headers"
        print(f"\n  {len(ok)} puts landed, {failed} failed typed, across {len(held)} registrations")
    finally:
        tgt.kill()


async def test_a_take_back_waits_for_a_copy_in_flight_so_no_region_is_torn(store_url, uname):
    """Every put of the initiator copies half a region, sleeps 20 ms (its slot locked), then the
    rest, while the target takes the buffer back every 30 ms: each take-back must wait for the copy
    in flight (the slot's exclusive lock), so every region of every registration taken back holds
    one put's bytes whole (or zeros), never half of one and half of another."""
    region, regions = 1 << 16, 8  # float32 elements: 256 KiB regions of a 2 MiB buffer
    tgt = RemoteEndpoint(uname("tgt"), store=store_url, planes=("shm",))
    ini = RemoteEndpoint(uname("ini"), store=store_url, planes=("shm",), timeout=30)
    try:
        tgt.call("register", "w", "float32", (region * regions,))
        tgt.call("churn", "w", 1, 0.0, region)  # (zero-filled, not poisoned)
        ini.call("connect", tgt.name)
        ini.call("split_shm_copies", 0.02)
        tgt.start("churn", "w", 30, 0.03, region)
        ini.start("put_regions", tgt.name, "w", region, regions, 150, 30)
        held = tgt.result(timeout=120)
        ok, typed, other = ini.result(timeout=120)
        assert not other, other
        torn = [(r, k, lo, hi) for r, reg in enumerate(held) for k, (lo, hi) in enumerate(reg) if lo != hi]
        assert not torn, f"regions torn by a take-back (registration, region, min, max): {torn[:5]}"
        assert ok > 0 and any(lo for reg in held for lo, _ in reg), (ok, typed)
        print(f"\n  {ok} split puts landed, {typed} failed typed, {len(held)} take-backs, no region torn")
    finally:
        ini.kill()
        tgt.kill()


async def test_an_initiator_frozen_mid_copy_holds_a_take_back_for_the_bound_only(store_url, uname, caplog):
    """The initiator sleeps inside its copy (the slot locked): the target's unregister waits
    REVOKE_WAIT_S, takes the buffer back anyway (logged), and the put then fails with a typed
    error; the bytes it copied late never reach the tensor the target took back."""
    ini = RemoteEndpoint(uname("ini"), store=store_url, planes=("shm",), timeout=30)
    try:
        async with transport.Endpoint(uname("tgt"), store=store_url, planes=("shm",), timeout=30) as tgt:
            w = tgt.new_buffer("w", (1 << 18,), torch.float32)  # 1 MiB, zeros
            await asyncio.to_thread(ini.call, "connect", tgt.name)  # (our loop serves the handshake)
            ini.call("slow_shm_copies", REVOKE_WAIT_S + 1.0)
            ini.start("put_error", tgt.name, {"w": ("float32", (1 << 18,), 7)}, 30)
            exp = tgt._registry.get("w").exports["shm"]
            end = time.monotonic() + 20
            while _lock(exp.table.fd, fcntl.F_WRLCK, exp.handle.slot):  # until its copy sleeps with the slot locked
                _lock(exp.table.fd, fcntl.F_UNLCK, exp.handle.slot)
                assert time.monotonic() < end, "the initiator's copy never locked the slot"
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="transport.planes.shm_slots"):
                tgt.unregister("w")
            took = time.monotonic() - t0
            assert REVOKE_WAIT_S - 0.1 <= took < REVOKE_WAIT_S + 1.0, took
            assert "taken back anyway" in caplog.text
            err = await asyncio.to_thread(ini.result, 30)
            assert err.startswith(("StaleBufferError", "UnknownBufferError")), err
            await asyncio.sleep(0.5)
            assert bool((w == 0).all()), "a late copy reached the tensor the target had taken back"
    finally:
        ini.kill()


@pytest.mark.skipif(not SlotTable.usable(), reason="this kernel has no OFD locks on a memfd")
def test_an_ops_slots_are_locked_all_or_nothing_a_run_at_a_time():
    """An op's slots are locked shared a run of consecutive slots per call: one slot the owner
    holds exclusively (it is revoking) fails the whole op's enter and leaves none of its other
    slots locked; holds nest per slot (two ops of this process), and a slot is unlocked only by
    its last holder; a word that no longer names the export (revoked, or re-pointed) fails the
    enter and drops every hold it took. The owner's exclusive lock is the probe: the table and
    the view are two open file descriptions, as in two processes."""
    table = SlotTable()
    view = TableView(os.getpid(), table.fd, table.inode)
    try:
        ids = {slot: 1000 + slot for slot in range(1, 9)}
        assert [table.alloc(ids[slot]) for slot in range(1, 9)] == list(range(1, 9))

        def owner_can_take(slot: int) -> bool:
            if _lock(table.fd, fcntl.F_WRLCK, slot):
                _lock(table.fd, fcntl.F_UNLCK, slot)
                return True
            return False

        op = [(slot, ids[slot]) for slot in (1, 2, 3, 5, 6, 8)]  # runs 1-3, 5-6, 8
        names = [f"w{slot}" for slot, _ in op]
        assert _lock(table.fd, fcntl.F_WRLCK, 5)  # the owner is revoking slot 5
        with pytest.raises(transport.StaleBufferError, match="taking the buffer back"):
            view.enter(op, names)
        _lock(table.fd, fcntl.F_UNLCK, 5)
        assert all(owner_can_take(slot) for slot in range(1, 9)), "a failed enter left a slot locked"
        view.enter([(3, ids[3]), (2, ids[2]), (3, ids[3])], ["w3", "w2", "w3"])  # another op: unsorted, a repeat
        assert _lock(table.fd, fcntl.F_WRLCK, 5)
        with pytest.raises(transport.StaleBufferError, match="taking the buffer back"):
            view.enter(op, names)  # (fails while that op holds 2 and 3: their locks are that op's, kept)
        _lock(table.fd, fcntl.F_UNLCK, 5)
        assert [owner_can_take(slot) for slot in range(1, 9)] == [True, False, False, True, True, True, True, True]
        view.leave([3, 2, 3])
        assert all(owner_can_take(slot) for slot in range(1, 9)), "an op's leave did not give back its holds"
        view.enter(op, names)
        assert not any(owner_can_take(slot) for slot, _ in op) and owner_can_take(4) and owner_can_take(7)
        view.enter([(2, ids[2]), (3, ids[3]), (4, ids[4])], ["w2", "w3", "w4"])  # a second op, overlapping
        view.check(op)
        view.leave([slot for slot, _ in op])
        assert [owner_can_take(slot) for slot in range(1, 9)] == [True, False, False, False, True, True, True, True]
        view.leave([2, 3, 4])
        assert all(owner_can_take(slot) for slot in range(1, 9))
        table.mark_moved(6, ids[6], "w6")
        with pytest.raises(transport.BufferMismatchError, match="re-register"):
            view.enter(op, names)
        assert all(owner_can_take(slot) for slot in range(1, 9)), "a failed check left a slot locked"
        assert _WORD_OF(table, 6) == ids[6] | MOVED
        table.revoke(2, "w2")
        with pytest.raises(transport.StaleBufferError, match="revoked"):
            view.enter([(1, ids[1]), (2, ids[2])], ["w1", "w2"])
        assert all(owner_can_take(slot) for slot in range(1, 9))
    finally:
        view.close()
        table.close()


def _WORD_OF(table: SlotTable, slot: int) -> int:  # noqa: N802 (the word, as peers read it)
    import struct

    return struct.unpack_from("<Q", table._mm, slot * 8)[0]


async def test_kept_views_follow_the_peers_registry(store_url, uname, monkeypatch):
    """The initiator keeps views of a peer's segment typed and shaped like its whole-buffer ops
    (ShmPlane._remote; the puts here carry a notify, since the ops run_here takes copy by
    address). A name re-registered at the same place with another dtype and shape gets a view of
    its own; past the cap a segment's views start afresh; ranges keep none; a segment
    the peer stops exporting has its views dropped with its mapping."""
    from transport.planes import shm as shm_plane

    monkeypatch.setattr(shm_plane, "_SHAPED_MAX", 3)
    async with transport.Endpoint(uname("a"), store=store_url, planes=("shm",), timeout=10) as a:
        async with transport.Endpoint(uname("b"), store=store_url, planes=("shm",), timeout=10) as b:
            arena = torch.zeros(4096)
            b.register("arena", arena)
            b.register("w", arena[0:100])
            await a.put(b.name, {"w": torch.full((100,), 1.0)}, notify=b"n")
            plane = a._channels[b.name].plane
            inode = b._registry.get("w").exports["shm"].handle.inode
            assert len(plane._shaped[inode][1]) == 1
            b.unregister("w")  # the same place, another dtype and shape
            b.register("w", arena[0:100].view(torch.int32).view(10, 10))
            await a.put(b.name, {"w": torch.arange(100, dtype=torch.int32).view(10, 10)}, notify=b"n")
            assert torch.equal(arena[0:100].view(torch.int32), torch.arange(100, dtype=torch.int32))
            for k in range(1, 8):  # names at new places of the arena: past the cap, it starts afresh
                b.register(f"v{k}", arena[k * 100 : k * 100 + 50])
                await a.put(b.name, {f"v{k}": torch.full((50,), float(k))}, notify=b"n")
                assert torch.equal(arena[k * 100 : k * 100 + 50], torch.full((50,), float(k)))
                assert 1 <= len(plane._shaped[inode][1]) <= 3
            for k in range(1, 8):  # and every kept view still lands where its name is now
                await a.put(b.name, {f"v{k}": torch.full((50,), -float(k))}, notify=b"n")
                assert torch.equal(arena[k * 100 : k * 100 + 50], torch.full((50,), -float(k)))
            n = len(plane._shaped[inode][1])
            await a.put(b.name, {"arena": transport.At(torch.full((50,), 9.0), 200)}, notify=b"n")  # (a range: no view)
            assert len(plane._shaped[inode][1]) == n and torch.equal(arena[200:250], torch.full((50,), 9.0))
            for name in ["arena", "w"] + [f"v{k}" for k in range(1, 8)]:
                b.unregister(name)
            other = b.new_buffer("other", (10,), torch.float32)
            await a.put(b.name, {"other": torch.ones(10)}, notify=b"n")  # (its registry update reached a first)
            assert torch.equal(other, torch.ones(10))
            assert inode not in plane._shaped and inode not in plane._maps


async def test_a_one_sided_put_to_a_peer_that_exited_says_so_while_the_channel_is_still_open(store_url, uname):
    """The peer's process exits while a forked child keeps the channel's socket (no EOF yet): the put's
    copy lands in memory nobody owns, and the slot table's check says so ("... exited ... went
    nowhere"). It read "channel to 'x' is closed" (an open channel), the cause dropped (found by a review)."""
    from tests._remote import RemoteEndpoint

    tgt = RemoteEndpoint(uname("tgt"), store=store_url, planes=("shm",), commands="tests._lifecycle_remote")
    try:
        tgt.call("register", "w", "float32", (1024,))
        async with transport.Endpoint(uname("ini"), store=store_url, planes=("shm",), timeout=5,
                                      heartbeat_interval=1.0, heartbeat_timeout=30.0) as ep:
            for _ in range(2):  # (maps the segment and the slot table: the next put is one-sided, on the loop)
                await ep.put(tgt.name, {"w": torch.ones(1024)}, timeout=5)
            tgt.start("fork_and_exit", 20.0)
            await asyncio.to_thread(tgt.proc.join, 10)
            assert not tgt.proc.is_alive()
            ch = ep._connector.channels[tgt.name]
            assert ch.is_open  # (the child holds the socket)
            with pytest.raises(transport.PeerLostError) as got:
                await ep.put(tgt.name, {"w": torch.ones(1024)}, timeout=5)
            assert "exited" in str(got.value), f"channel open={ch.is_open}, error: {got.value}"
    finally:
        tgt.kill()
