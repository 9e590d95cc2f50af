"""rl_sync against a second hostile pass: many concurrent readers across a commit, commits racing a newer
Begin, a trainer killed mid-push in shared mode, pushes cancelled at each step, hostile messages.

Real processes (spawn), real sockets, real shared memory; every wait bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

import rl_sync
import transport
from tests._remote import RemoteEndpoint
from tests._rl_remote import stamped
from tests.test_rl_sync import trainer

SPEC = {"a": ("float32", (64, 64)), "b": ("float32", (4096,)), "c": ("float32", (3, 5))}
# 16 MiB in 8 MiB buckets: the pulls' shm copies run on the loop's default executor (THREAD_COPY_BYTES)
BIG = {"a": ("float32", (2048, 2048)), "b": ("float32", (1024,))}
CMDS = "tests._rl_hostile2_remote"


@contextlib.contextmanager
def gens_of(store_url, uname, modes, spec=SPEC, **sub_kwargs):
    gens = []
    try:
        for i, mode in enumerate(modes):
            g = RemoteEndpoint(uname(f"gen{i}"), store=store_url, timeout=20, commands=CMDS)
            gens.append(g)
            g.call("sub_create", spec, {"mode": mode, **sub_kwargs})
        yield gens
    finally:
        for g in gens:
            g.kill()




# ---------------------------------------------------------------------------- many readers
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "big"), [("staged", False), ("swap", False), ("direct", False), ("shared", False),
                                           ("direct", True)], ids=["staged", "swap", "direct", "shared", "direct-big"])
async def test_a_crowd_of_reader_tasks_across_commits_neither_hangs_nor_mixes(store_url, uname, mode, big):
    """40 tasks on the generator's loop go in and out of ``hold()`` (an async server with many requests
    in flight) while pushes commit. Readers that arrive while a commit waits queue behind it; that
    queue must not take the threads the commit's own copy (and the pulls' shm copies) need: every
    push commits within its timeout, no reader sees two versions, and the readers go on. (direct-big:
    readers queue behind the whole push, whose 8 MiB pulls copy on the loop's default executor.)"""
    spec = BIG if big else SPEC
    with gens_of(store_url, uname, [mode], spec=spec) as gens:
        async with trainer(store_url, uname) as ep:
            pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], bucket_bytes=(8 << 20) if big else 4096)
            assert (await pub.push(stamped(spec, 1), 1)).ok
            gens[0].call("h2_crowd_start", 40, 0.002)
            try:
                for v in range(2, 7):
                    t0 = time.monotonic()
                    report = await pub.push(stamped(spec, v), v, timeout=8)
                    assert report.ok, f"push {v} after {time.monotonic() - t0:.1f} s: {report.summary()}"
            finally:
                checks, bad, versions, errors = gens[0].call("h2_crowd_stop", timeout=60)
            assert not bad, f"a reader saw a mix of versions: {bad}"
            assert not errors, errors
            assert checks > 100 and versions[-1] == 6, (checks, versions)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["staged", "shared"])
async def test_reader_threads_and_tasks_together_across_commits(store_url, uname, mode):
    """Plain threads in ``hold_blocking()`` and tasks in ``hold()`` at once, across commits: a commit
    waits for both kinds, both kinds queue behind it and are woken when it ends (a thread's release
    wakes a task, a task's release a thread), nobody sees two versions."""
    with gens_of(store_url, uname, [mode]) as gens:
        async with trainer(store_url, uname) as ep:
            pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], bucket_bytes=4096)
            assert (await pub.push(stamped(SPEC, 1), 1)).ok
            gens[0].call("h2_thread_readers_start", 4, 0.003)
            gens[0].call("h2_crowd_start", 12, 0.002)
            try:
                for v in range(2, 8):
                    report = await pub.push(stamped(SPEC, v), v, timeout=8)
                    assert report.ok, report.summary()
            finally:
                checks, bad, versions, errors = gens[0].call("h2_crowd_stop", timeout=60)
                tchecks, tbad, terrors = gens[0].call("h2_thread_readers_stop", timeout=60)
            assert not bad and not tbad, (bad, tbad)
            assert not errors and not terrors, (errors, terrors)
            assert checks > 50 and tchecks > 20 and versions[-1] == 7, (checks, tchecks, versions)


async def test_rwlock_async_waits_hold_nothing_when_cancelled_or_timed_out_and_wake_across_threads():
    """The lock's async side waits on the loop (no worker thread): a cancelled or timed-out wait holds
    nothing, a waiting writer keeps new readers out (thread and task), and a release on another
    thread wakes a task."""
    import threading

    from rl_sync.rwlock import RWLock

    lock = RWLock()
    assert lock.acquire_read(0)
    writer = asyncio.ensure_future(lock.acquire_write_async(5))
    await asyncio.sleep(0.05)
    assert not writer.done() and not lock.try_acquire_read() and not lock.acquire_read(0.05)
    reader = asyncio.ensure_future(lock.acquire_read_async(5))  # queues behind the writer
    await asyncio.sleep(0.05)
    assert not reader.done()
    threading.Timer(0.1, lock.release_read).start()  # the reader leaves on another thread
    assert await asyncio.wait_for(writer, 5) is True
    assert not reader.done()
    lock.release_write()
    assert await asyncio.wait_for(reader, 5) is True
    # a writer that times out, and one cancelled, hold nothing and let readers back in
    assert await lock.acquire_write_async(0.1) is False
    cancelled = asyncio.ensure_future(lock.acquire_write_async(5))
    await asyncio.sleep(0.05)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert lock.try_acquire_read() and lock.readers == 2
    lock.release_read()
    lock.release_read()
    assert lock.try_acquire_write()
    late = asyncio.ensure_future(lock.acquire_read_async(5))
    await asyncio.sleep(0.05)
    late.cancel()
    with pytest.raises(asyncio.CancelledError):
        await late
    lock.release_write()
    assert lock.readers == 0 and lock.try_acquire_write()
    lock.release_write()
    assert not lock._waiters


# ---------------------------------------------------------------------------- a commit racing a newer Begin
@pytest.mark.timeout(120)
async def test_a_staged_commit_waiting_for_readers_gpu_work_never_copies_a_newer_push_s_bytes(store_url, uname):
    """Staged mode on a GPU waits, holding the writer lock, for the GPU work readers queued inside
    hold() before it copies staging into the weights (stood in for here: every ReaderMarks.wait takes
    1 s). The push of version 2 is cancelled once its Commit is out (an Abort follows), and version 3
    begins at once: its pulls write the staging arena during that wait, and it is cancelled after a
    few buckets. The commit of version 2 must then not copy the staging arena (it holds version 3's
    bytes): whatever version the subscriber reports, it holds exactly that version's bytes."""
    with gens_of(store_url, uname, ["staged"]) as gens:
        async with trainer(store_url, uname) as ep:
            tasks: dict[int, asyncio.Task] = {}

            def observer(ev: rl_sync.PushEvent) -> None:
                task = tasks.get(ev.version)
                if task is None or task.done():
                    return
                if (ev.version == 2 and ev.kind == "commit_sent") or (ev.version == 3 and ev.kind == "pulled"
                                                                       and ev.have >= 3):
                    task.cancel()

            pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], bucket_bytes=4096, observer=observer)
            assert (await pub.push(stamped(SPEC, 1), 1)).ok
            gens[0].call("h2_slow_reader_marks", 1.0)
            for v in (2, 3):
                tasks[v] = asyncio.ensure_future(pub.push(stamped(SPEC, v), v, timeout=10))
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(tasks[v], 15)
            await asyncio.sleep(1.5)  # the commit of version 2 is over, whatever it did
            v, same = gens[0].call("sub_check_stamp", timeout=30)
            assert same, f"the subscriber reports version {v} but its weights hold other bytes"
            report = await pub.push(stamped(SPEC, 4), 4, timeout=10)
            assert report.ok, report.summary()
            assert tuple(gens[0].call("sub_check_stamp", timeout=30)) == (4, True)


# ---------------------------------------------------------------------------- shared: the trainer killed mid-push
def _shared_trainer_proc(name: str, store_url: str, names: list[str], ready) -> None:
    """Pushes version 1 to ``names`` (shared mode), then version 2, stopping its loop (so the process can be
    killed there) right after the first subscriber's Begin+Commit went out, before the second's."""
    import logging
    import sys

    logging.basicConfig(level=logging.WARNING)

    async def main() -> None:
        async with transport.Endpoint(name, store=store_url, timeout=20) as ep:
            def stop_there(ev: rl_sync.PushEvent) -> None:
                if ev.version == 2 and ev.kind == "begin_sent" and ev.subscriber == names[1]:
                    ready.set()
                    time.sleep(60)  # killed here: names[0] is told to commit version 2, names[1] is not

            pub = rl_sync.WeightPublisher(ep, names, bucket_bytes=4096, observer=stop_there)
            report = await pub.push(stamped(SPEC, 1), 1, timeout=20)
            if not report.ok:
                raise SystemExit(f"push 1 failed: {report.summary()}")
            await pub.push(stamped(SPEC, 2), 2, timeout=20)

    asyncio.run(main())
    sys.exit(0)


@pytest.mark.timeout(120)
async def test_shared_mode_trainer_killed_mid_push_then_restarted_under_its_name(store_url, uname):
    """Shared subscribers point into the trainer's banks. The trainer is killed mid-push (one
    subscriber told to commit and mapping the new bank, the other not told): each keeps a whole
    version (its weights stay readable: the banks' memory outlives the process while mapped), and
    the trainer restarted under its name (a new incarnation, new banks, the old lock folder removed)
    pushes the next version to both, bit-exact, and again (its banks alternate, none added)."""
    import multiprocessing as mp

    with gens_of(store_url, uname, ["shared", "shared"], commit_timeout=2.0) as gens:
        names = [g.name for g in gens]
        tname = uname("trainer")
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        proc = ctx.Process(target=_shared_trainer_proc, args=(tname, store_url, names, ready), daemon=True)
        proc.start()
        try:
            assert await asyncio.to_thread(ready.wait, 60), "the trainer never got mid-push"
            await asyncio.sleep(0.2)  # (the first subscriber is mapping the bank of the frozen trainer)
            proc.kill()
            await asyncio.to_thread(proc.join, 10)
        finally:
            with contextlib.suppress(Exception):
                proc.kill()
        await asyncio.sleep(0.5)
        held = [tuple(g.call("sub_check_stamp", timeout=30)) for g in gens]
        assert all(same for _, same in held) and {v for v, _ in held} <= {1, 2}, held
        assert held[1][0] == 1, held
        async with transport.Endpoint(tname, store=store_url, timeout=20) as ep:
            pub = rl_sync.WeightPublisher(ep, names, bucket_bytes=4096)
            for v in (3, 4, 5):
                report = await pub.push(stamped(SPEC, v), v, timeout=10)
                assert report.ok, report.summary()
                for g in gens:
                    assert tuple(g.call("sub_check_stamp", timeout=30)) == (v, True)
            assert len(next(iter(pub._bank_sets.values()))) == 2, "a dead trainer's bank pinned a new one"
            pub.close()


# ---------------------------------------------------------------------------- cancelled at each step
STEPS = ("begin_sent", "begun", "pull_sent", "pulled", "commit_sent", "committed")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["staged", "swap", "direct", "shared"])
async def test_a_push_cancelled_at_each_step_then_the_next_at_once(store_url, uname, mode):
    """A push is cancelled from its observer at the first event of each kind (at each of its steps: Begin
    out, begun, a pull out, a bucket landed, Commit out, a commit answered), and the next push starts at
    once. The cancelled push raises CancelledError; every subscriber then holds one whole version, the
    cancelled one only if the publisher counts it pushed (``pub.version``) (direct: or torn on the
    previous one); the next version reaches everyone, bit-exact."""
    with gens_of(store_url, uname, [mode, mode]) as gens:
        async with trainer(store_url, uname) as ep:
            arm: dict[str, object] = {}

            def observer(ev: rl_sync.PushEvent) -> None:
                task = arm.get("task")
                if task is not None and ev.kind == arm["kind"] and not task.done():
                    task.cancel()
                    arm.pop("task")

            pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], bucket_bytes=4096, observer=observer)
            v = 1
            assert (await pub.push(stamped(SPEC, v), v)).ok
            seen = []
            for kind in STEPS:
                v += 1
                arm["kind"] = kind
                task = arm["task"] = asyncio.ensure_future(pub.push(stamped(SPEC, v), v, timeout=10))
                try:
                    report = await asyncio.wait_for(asyncio.shield(task), 20)
                    seen.append((kind, "not cancelled", report.ok))  # (no such event in this mode)
                except asyncio.CancelledError:
                    seen.append((kind, "cancelled", pub.version))
                arm.pop("task", None)
                for g in gens:
                    got = tuple(g.call("h2_check_now", 5.0, timeout=30))
                    if got[0] == "torn":
                        assert mode == "direct" and got[1] == v - 1, (kind, got)
                        continue
                    held, same = got
                    assert same, f"{kind}: {g.name} reports version {held} but holds other bytes"
                    assert held in (v - 1, v), (kind, got)
                    assert held <= pub.version, f"{kind}: {g.name} holds version {held}, pub.version {pub.version}"
                v += 1
                report = await pub.push(stamped(SPEC, v), v, timeout=10)
                assert report.ok, f"after a cancel at {kind}: {report.summary()}"
                for g in gens:
                    assert tuple(g.call("h2_check_now", 5.0, timeout=30)) == (v, True), kind
            print(f"\n[{mode}] {seen}")


# ---------------------------------------------------------------------------- a model changed under the subscriber
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["staged", "swap", "direct", "shared"])
@pytest.mark.parametrize("dtype", [None, "float64"], ids=["new-memory", "new-dtype"])
async def test_a_tensor_given_new_memory_after_the_subscriber_was_made_is_never_silently_left_behind(
        store_url, uname, mode, dtype):
    """The application gives a model tensor new memory in place (``t.data = ...``: what ``model.to()``,
    ``.half()`` or ``.cuda()`` do to each parameter), of the same dtype or another. A push must then
    either deliver that version into the tensor the model holds, bit-exact, or fail that subscriber's
    entry; never report it committed while the model keeps other bytes (or reads bank bytes as another
    dtype)."""
    with gens_of(store_url, uname, [mode]) as gens:
        async with trainer(store_url, uname) as ep:
            pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], bucket_bytes=4096)
            assert (await pub.push(stamped(SPEC, 1), 1)).ok
            gens[0].call("h2_set_data", "a", dtype)
            report = await pub.push(stamped(SPEC, 2), 2, timeout=10)
            v, same, layout = gens[0].call("h2_stamp_of", timeout=30)
            if report.ok:
                assert v == 2 and same, f"committed version {v}, but the model holds other bytes: {layout}"
            else:
                err = report.results[gens[0].name].error
                assert "'a'" in str(err), err
                assert v == 1


# ---------------------------------------------------------------------------- hostile messages
def test_a_commit_naming_a_fifo_as_its_bank_lock_is_refused_without_blocking(tmp_path):
    """A shared-mode Commit names its bank's lock file by path (``Commit.lock``), and the subscriber opens
    it on its event loop. A peer that names a FIFO (or any file that is not a regular one) must get a
    refusal at once: a plain open() of a FIFO blocks until a writer comes, freezing the generator's loop
    (pushes, heartbeats) for good."""
    import os
    import threading

    from rl_sync.banks import BankLease

    fifo = str(tmp_path / "lock")
    os.mkfifo(fifo)
    got: list[object] = []

    def lease() -> None:
        try:
            got.append(BankLease(fifo, 1, 1))
        except Exception as exc:
            got.append(exc)

    t = threading.Thread(target=lease, daemon=True)
    t.start()
    t.join(2.0)
    blocked = t.is_alive()
    if blocked:  # let it go: a writer opens the FIFO
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(5.0)
    assert not blocked, "BankLease blocked opening a FIFO named by a peer"
    assert got and isinstance(got[0], Exception), got


def test_a_subscriber_keeps_a_few_plans_not_one_per_bucket_size_asked_for():
    """Every Begin names its publisher's bucket size and the subscriber caches the plan for it: a
    peer that names a new size at every Begin must not grow that cache without bound."""
    sub = object.__new__(rl_sync.WeightSubscriber)
    sub.manifest = rl_sync.plan.build_manifest({"w": torch.zeros(1024)}, 1 << 20, "host")
    sub._plans = {}
    for size in range(64, 64 * 50, 64):
        buckets, digest = sub.plan(size)
        assert sum(b.nbytes for b in buckets) == 4096 and digest
    assert len(sub._plans) <= 4
    assert sub.plan(64 * 49) is sub.plan(64 * 49)  # (the newest stay cached)
