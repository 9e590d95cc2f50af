"""Hostile tests: puts and gets racing the target's unregister / re-register / restart.

The guarantee under attack (README, "Use" and "Failure behaviour"): a put or get racing the
target's ``unregister`` or re-``register`` of the same name (or its restart as a new incarnation)
either lands before the target takes the buffer back, or fails with a typed transport error; it is
never reported done while its bytes were lost, never writes into a buffer registered later under
the same name or into memory the target has since reused; a get never returns bytes of a later
buffer; notifications keep their order. Real processes (tests/_hostile_remote.py), real sockets,
real shared memory; every wait bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import signal
import time

import pytest
import torch

import transport
from tests._hostile_remote import HostileRemote, wait_gone
from transport.staging import StagingConfig, ThreadCopyEngine

_TYPED = (transport.StaleBufferError, transport.UnknownBufferError, transport.BufferMismatchError)
_TYPED_NAMES = ("StaleBufferError", "UnknownBufferError", "BufferMismatchError")

BIG = 8 << 20  # int64 elements: 64 MiB, a payload that takes tens of ms to receive


async def _until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(0.0002)


# ---------------------------------------------------------------------------- tcp / staged: the reader writes on
_TARGETS = {
    # (target endpoint kwargs, initiator kwargs): the channel's plane is tcp in each
    "tcp": ({"planes": ("tcp",)}, {"planes": ("tcp",)}),
    "tcp-into-shm-segment": ({}, {"planes": ("tcp",)}),  # target allows shm: its buffer lives in a memfd
    "staged": ({"planes": ("tcp",), "staging": StagingConfig(chunk_bytes=1 << 20, buffers=4,
                                                             cpu_engine=ThreadCopyEngine)}, {"planes": ("tcp",)}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setup", list(_TARGETS))
async def test_a_put_served_while_the_target_unregisters_is_not_done_into_reused_or_lost_memory(
        store_url, uname, setup):
    """A 64 MiB put over tcp (or staged on the target) is being received straight into the
    registered tensor by the target's reader thread when the target unregisters the buffer and
    reuses its memory (fills it with -5). The put must then either have landed before the
    unregister returned (it had not: the last element was still 0) or fail typed. Reported done
    with its bytes written into the reused memory, or with them missing from the tensor the
    target took back, is the hole."""
    tkw, ikw = _TARGETS[setup]
    ini = HostileRemote(uname("ini"), store=store_url, timeout=30, **ikw)
    rounds, holes = 3, []
    try:
        async with transport.Endpoint(uname("tgt"), store=store_url, timeout=30, **tkw) as tgt:
            await asyncio.to_thread(ini.call, "connect", tgt.name)
            for r in range(rounds):
                name = f"w{r}"
                w = torch.zeros(BIG, dtype=torch.int64)
                tgt.register(name, w)
                ini.start("put", tgt.name, name, BIG, 7, None, 30)
                await _until(lambda: int(w[0]) == 7, 20, "the first bytes landing")  # noqa: B023
                mid = int(w[-1]) != 7  # still receiving
                tgt.unregister(name)
                if setup != "tcp-into-shm-segment":
                    w.fill_(-5)  # the memory is the target's again: it reuses it
                err = await asyncio.to_thread(ini.result, 30)
                await asyncio.sleep(0.1)
                sevens = int((w == 7).sum())
                if err == "":
                    if setup == "tcp-into-shm-segment":
                        if sevens != BIG:  # reported done, but the tensor taken back lacks its bytes
                            holes.append((r, mid, f"put done; only {sevens}/{BIG} elements of the taken-back "
                                                  "tensor hold its bytes"))
                    elif sevens:
                        holes.append((r, mid, f"put done; {sevens}/{BIG} elements of memory the target reused "
                                              "after unregister() returned were overwritten by it"))
                else:
                    assert err.startswith(_TYPED_NAMES + ("PeerLostError",)), err
    finally:
        ini.kill()
    print(f"\n  {setup}: {len(holes)}/{rounds} rounds hit: {holes}")
    assert not holes, holes


@pytest.mark.timeout(60)
async def test_a_tcp_get_served_while_the_target_unregisters_never_returns_bytes_written_after(store_url, uname):
    """A 64 MiB get over tcp: the target's writer thread sends straight from the registered
    tensor's memory. The target unregisters the buffer after a random 0-40 ms and writes -5 into
    the memory it took back. A get that returns must hold only the buffer's bytes (3), never
    bytes the target wrote after taking the buffer back."""
    ini = HostileRemote(uname("ini"), store=store_url, timeout=30, planes=("tcp",))
    rng = random.Random(1234)
    rounds, holes, outcomes = 8, [], []
    try:
        async with transport.Endpoint(uname("tgt"), store=store_url, timeout=30, planes=("tcp",)) as tgt:
            await asyncio.to_thread(ini.call, "connect", tgt.name)
            for r in range(rounds):
                name = f"w{r}"
                w = torch.full((BIG,), 3, dtype=torch.int64)
                tgt.register(name, w)
                ini.start("get", tgt.name, name, BIG, 30)
                await asyncio.sleep(rng.uniform(0.0, 0.04))
                tgt.unregister(name)
                w.fill_(-5)
                err, got = await asyncio.to_thread(ini.result, 30)
                outcomes.append(err.split(":")[0] or "done")
                if err == "" and -5 in got:
                    holes.append((r, f"get done holding {got[-5]} elements of -5 (memory reused after unregister)"))
                elif err:
                    assert err.startswith(_TYPED_NAMES + ("PeerLostError",)), err
    finally:
        ini.kill()
    print(f"\n  outcomes {outcomes}; holes {holes}")
    assert not holes, holes


# ---------------------------------------------------------------------------- shm one-sided, target killed
@pytest.mark.timeout(40)
@pytest.mark.parametrize("op", ["put", "get"])
@pytest.mark.parametrize("size", ["4KiB", "8MiB", "4KiB-unseen"])
async def test_a_one_sided_op_with_a_killed_and_reaped_target_is_not_reported_done(store_url, uname, size, op):
    """The target is SIGKILLed and reaped (its process no longer exists) before the put is even
    called. An shm put then has nowhere to land: it must fail typed (PeerLostError), not return
    as done. (4 KiB: the one-sided fast path on the event loop; 8 MiB: on a worker thread.)
    "unseen": the channel's reader thread is kept from handling the EOF until the put returned
    (the test holds the channel's lock, which breaking it takes), as a loaded host does by chance
    (the CI once got a 4 KiB put reported done so): the put must find out by itself. A get
    likewise: it must not return bytes read from the memory of a process that no longer exists."""
    n = 512 if size.startswith("4KiB") else 1 << 20
    rounds, holes = 3, []
    async with transport.Endpoint(uname("ini"), store=store_url, planes=("shm",), timeout=5) as ep:
        for r in range(rounds):
            tgt = HostileRemote(uname("tgt"), store=store_url, planes=("shm",))
            try:
                tgt.call("register_int64", "w", n, 0)
                await ep.connect(tgt.name)
                await ep.put(tgt.name, {"w": torch.full((n,), 1, dtype=torch.int64)})  # maps table and segment
                assert tgt.call("summary", "w") == {1: n}
                unseen = ep.peers[tgt.name]._channel._lock if size.endswith("unseen") else contextlib.nullcontext()
                with unseen:
                    os.kill(tgt.pid, signal.SIGKILL)
                    tgt.proc.join(10)
                    wait_gone(tgt.pid)
                    try:
                        if op == "put":
                            await ep.put(tgt.name, {"w": torch.full((n,), 2, dtype=torch.int64)}, timeout=1)
                        else:
                            await ep.get(tgt.name, {"w": torch.zeros(n, dtype=torch.int64)}, timeout=1)
                        holes.append((r, f"{op} done with a process that no longer exists"))
                    except transport.TransportError as exc:
                        assert isinstance(exc, (transport.PeerLostError, transport.PeerNotFoundError) + _TYPED), exc
            finally:
                tgt.kill()
    print(f"\n  {size}: {len(holes)}/{rounds} {op}s with a dead target reported done: {holes}")
    assert not holes, holes


# ---------------------------------------------------------------------------- guards that held
@pytest.mark.timeout(60)
@pytest.mark.parametrize("plane", ["shm", "tcp"])
@pytest.mark.parametrize("size", ["4KiB", "8MiB"])
async def test_gets_racing_re_registration_of_other_sizes_are_never_torn_or_from_a_later_buffer(
        store_url, uname, plane, size):
    """The target re-registers ``w`` 60 times at random moments, alternating two sizes, each fresh
    buffer filled with its generation number; it never writes into a registered buffer. Gets of
    one size must return one generation whole (no mix of two buffers), never a generation newer
    than the target had registered when the get returned, or fail typed."""
    n = 512 if size == "4KiB" else 1 << 20
    sizes = (n, n + 64)
    tgt = HostileRemote(uname("tgt"), store=store_url, planes=(plane,))
    try:
        tgt.call("register_int64", "w", n, 1)
        async with transport.Endpoint(uname("ini"), store=store_url, planes=(plane,), timeout=10) as ep:
            await ep.connect(tgt.name)
            tgt.start("churn_gens", "w", 60, 0.03, sizes, 7)
            done = failed = 0
            deadline = time.monotonic() + 20
            out = torch.empty(n, dtype=torch.int64)
            while time.monotonic() < deadline and not tgt._conn.poll(0):
                out.fill_(-1)
                try:
                    await ep.get(tgt.name, {"w": out}, timeout=5)
                except _TYPED:
                    failed += 1
                    continue
                done += 1
                vals = torch.unique(out).tolist()
                assert len(vals) == 1 and vals[0] >= 1, f"get returned a mix of buffers: {vals}"
            gens = tgt.result(timeout=30)
        assert done > 0, (done, failed)
        print(f"\n  {done} gets whole, {failed} typed failures, {gens} registrations")
    finally:
        tgt.kill()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plane", ["shm", "tcp"])
async def test_puts_with_notifications_racing_re_registration_keep_bytes_and_order(store_url, uname, plane):
    """The initiator (a process) puts value i into element i with notify=str(i), i = 1..N; the
    target (here) unregisters and re-registers ``w`` (fresh zeros, same or larger size) at random
    moments and reads its notifications. Every put reported done must be found in some
    registration (the taken-back ones hold their bytes), every notification's put too, and the
    notifications must come in call order."""
    N = 300
    ini = HostileRemote(uname("ini"), store=store_url, timeout=10, planes=(plane,))
    rng = random.Random(99)
    try:
        async with transport.Endpoint(uname("tgt"), store=store_url, planes=(plane,), timeout=10) as tgt:
            cur = torch.zeros(N + 1, dtype=torch.int64)
            regs = [cur]
            tgt.register("w", cur)
            await asyncio.to_thread(ini.call, "connect", tgt.name)
            ini.start("puts_notify", tgt.name, "w", 1, N + 1, 10)
            notes: list[int] = []

            async def read_notes() -> None:
                while True:
                    note = await tgt.next_notification(timeout=30)
                    notes.append(int(note.payload))

            reader = asyncio.create_task(read_notes())
            try:
                end = time.monotonic() + 20
                while not ini._conn.poll(0) and time.monotonic() < end:
                    await asyncio.sleep(rng.uniform(0, 0.01))
                    tgt.unregister("w")
                    cur = torch.zeros(N + 1 + rng.choice((0, 16)), dtype=torch.int64)
                    regs.append(cur)
                    tgt.register("w", cur)
                results = await asyncio.to_thread(ini.result, 30)
                await _until(lambda: len(notes) >= sum(1 for _, e in results if not e), 10, "notifications")
            finally:
                reader.cancel()
        done = [i for i, e in results if not e]
        bad = [(i, e) for i, e in results if e and e not in _TYPED_NAMES]
        assert not bad, bad
        landed = {i for t in regs for i in range(1, N + 1) if int(t[i]) == i}
        lost = [i for i in done if i not in landed]
        assert not lost, f"puts reported done whose bytes are in no registration: {lost[:10]}"
        assert notes == sorted(notes), f"notifications out of order: {notes[:40]}"
        assert set(notes) <= set(done), set(notes) - set(done)
        print(f"\n  {len(done)} done, {N - len(done)} typed failures, {len(regs)} registrations")
    finally:
        ini.kill()


# ---------------------------------------------------------------------------- shm: a view of an arena
@pytest.mark.timeout(60)
@pytest.mark.parametrize("plane", ["shm", "cuda_ipc"])
async def test_a_late_one_sided_copy_never_lands_in_a_buffer_registered_later_at_the_old_place(store_url, uname, plane):
    """The target registers ``x`` as a view of an arena (rl_sync's layout: arenas, buffers as views).
    The initiator's one-sided put into ``x`` stalls with the slot locked (its copy sleeps 3 s, as a
    frozen or descheduled initiator would); the target's unregister of ``x`` waits the 2 s bound
    and takes it back anyway; it then registers ``y`` at x's old place (filled with -5) and ``x``
    elsewhere in the arena. The late copy must not land in ``y``: that memory was reused under
    another name after the take-back. Reported done with ``y`` overwritten is the hole. ``cuda_ipc``:
    the same through its CPU stand-in engine (one-sided through its exporter's slot table too)."""
    import fcntl

    from tests._remote import RemoteEndpoint
    from transport.planes.cuda_ipc_memfd import MemfdIpcEngine
    from transport.planes.shm_slots import _lock

    n = 1 << 16  # int64: 512 KiB per view
    kw: dict = {"planes": ("shm",)} if plane == "shm" else {"engines": {"cuda_ipc": MemfdIpcEngine}}
    ikw: dict = kw if plane == "shm" else {"engines": {"cuda_ipc": functools.partial(MemfdIpcEngine, copy_delay=3.0)}}
    ini = RemoteEndpoint(uname("ini"), store=store_url, timeout=30, **ikw)
    try:
        async with transport.Endpoint(uname("tgt"), store=store_url, timeout=30, **kw) as tgt:
            arena = tgt.new_buffer("arena", (2 * n,), torch.int64)
            tgt.register("x", arena[:n])
            await asyncio.to_thread(ini.call, "connect", tgt.name)
            if plane == "shm":  # (cuda_ipc's engine sleeps 3 s before each copy: copy_delay)
                ini.call("slow_shm_copies", 3.0)
            ini.start("put_error", tgt.name, {"x": ("int64", (n,), 7)}, 30)
            exp = tgt._registry.get("x").exports[plane]
            fd = tgt.exporter(plane).slot_table.made.fd
            end = time.monotonic() + 20
            while _lock(fd, fcntl.F_WRLCK, exp.handle.slot):  # until its copy holds the slot
                _lock(fd, fcntl.F_UNLCK, exp.handle.slot)
                assert time.monotonic() < end, "the initiator's copy never locked the slot"
                await asyncio.sleep(0.005)
            tgt.unregister("x")  # waits 2 s, then takes it back anyway
            y = arena[:n]
            tgt.register("y", y)
            y.fill_(-5)
            tgt.register("x", arena[n:])
            err = await asyncio.to_thread(ini.result, 30)
            await asyncio.sleep(0.3)
            assert ini.call("op_planes", "put") == [plane]
            clobbered = int((y != -5).sum())
            print(f"\n  put -> {err or 'done'}; y (registered after the take-back) has {clobbered}/{n} elements "
                  f"overwritten; new x holds the put: {bool((arena[n:] != 0).all())}")
            assert clobbered == 0, (f"put {'reported done' if not err else 'failed: ' + err}; {clobbered} elements of "
                                    "'y', registered at x's old place after the take-back, were overwritten by it")
    finally:
        ini.kill()


@pytest.mark.timeout(60)
async def test_a_buffer_registered_over_a_copy_still_frozen_past_the_bound_is_refused(store_url, uname):
    """As above, but the initiator's copy sleeps past both bounds (the take-back's and the new
    registration's): ``register("y")`` at x's old place waits the bound for that copy to let go,
    then fails with BufferMismatchError, registering nothing; once the copy has let go, the same
    registration succeeds and the late copy never reaches ``y``."""
    import fcntl

    from tests._remote import RemoteEndpoint
    from transport.planes.shm_slots import REVOKE_WAIT_S, _lock

    n = 1 << 16
    sleep = 3 * REVOKE_WAIT_S + 1.0  # past the take-back's wait and the registration's
    ini = RemoteEndpoint(uname("ini"), store=store_url, timeout=30, planes=("shm",))
    try:
        async with transport.Endpoint(uname("tgt"), store=store_url, timeout=30, planes=("shm",)) as tgt:
            arena = tgt.new_buffer("arena", (2 * n,), torch.int64)
            tgt.register("x", arena[:n])
            await asyncio.to_thread(ini.call, "connect", tgt.name)
            ini.call("slow_shm_copies", sleep)
            ini.start("put_error", tgt.name, {"x": ("int64", (n,), 7)}, 30)
            exp = tgt._registry.get("x").exports["shm"]
            fd = tgt.exporter("shm").slot_table.made.fd
            end = time.monotonic() + 20
            while _lock(fd, fcntl.F_WRLCK, exp.handle.slot):  # until its copy holds the slot
                _lock(fd, fcntl.F_UNLCK, exp.handle.slot)
                assert time.monotonic() < end, "the initiator's copy never locked the slot"
                await asyncio.sleep(0.005)
            locked_at = time.monotonic()
            tgt.unregister("x")  # waits the bound, then takes it back anyway
            t0 = time.monotonic()
            with pytest.raises(transport.BufferMismatchError, match="still ran"):
                tgt.register("y", arena[:n])
            took = time.monotonic() - t0
            assert REVOKE_WAIT_S - 0.1 <= took < REVOKE_WAIT_S + 1.5, took
            assert "y" not in tgt.buffers
            assert time.monotonic() - locked_at < sleep, "the copy ended before the test could look"
            err = await asyncio.to_thread(ini.result, 30)  # the copy let go: its put failed
            assert err.startswith(("StaleBufferError", "UnknownBufferError")), err
            y = arena[:n]
            tgt.register("y", y)
            y.fill_(-5)
            await asyncio.sleep(0.3)
            assert int((y != -5).sum()) == 0
    finally:
        ini.kill()


@pytest.mark.timeout(60)
async def test_a_notified_shm_put_never_lands_in_a_buffer_registered_later_at_the_old_place(store_url, uname):
    """The same layout without any stall: the initiator (a process) puts into ``x`` (a view of an
    arena) with a notification, in a loop (the header path: copy, then the header names the
    export); the target (here) re-registers ``x`` at the arena's other half and ``y`` at x's old
    place, filled with -5, then only reads. Any change of ``y`` came from a put into ``x`` that
    copied into x's old place after the target had reused it. (Documented in
    docs/architecture.md for this path: "a put racing the re-registration of a view inside a
    still-exported arena can overwrite the old place in that arena".)"""
    n = 1 << 10
    ini = HostileRemote(uname("ini"), store=store_url, timeout=10, planes=("shm",))
    try:
        async with transport.Endpoint(uname("tgt"), store=store_url, planes=("shm",), timeout=10) as tgt:
            arena = tgt.new_buffer("arena", (2 * n,), torch.int64)
            tgt.register("x", arena[:n])
            await asyncio.to_thread(ini.call, "connect", tgt.name)
            hits = 0
            for r in range(20):
                ini.start("put", tgt.name, "x", n, 7 + r, b"n", 10)
                await asyncio.sleep(random.uniform(0, 0.002))
                lo, hi = (arena[:n], arena[n:]) if r % 2 == 0 else (arena[n:], arena[:n])
                tgt.unregister("x")
                for nm in ("y",):
                    if nm in tgt.buffers:
                        tgt.unregister(nm)
                lo.fill_(-5)
                tgt.register("y", lo)
                tgt.register("x", hi)
                err = await asyncio.to_thread(ini.result, 10)
                while True:  # drain its notification, if it was delivered
                    try:
                        await tgt.next_notification(timeout=0.05)
                    except transport.TransportError:
                        break
                    except TimeoutError:
                        break
                if int((lo != -5).sum()):
                    hits += 1
                    print(f"  round {r}: put -> {err or 'done'}; y overwritten ({int((lo != -5).sum())} elements)")
            print(f"\n  {hits}/20 rounds: 'y' overwritten by a put into 'x'")
            assert hits == 0
    finally:
        ini.kill()
