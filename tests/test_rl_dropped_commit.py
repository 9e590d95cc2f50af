"""A commit (direct mode: a Begin) whose push was dropped while it waited for readers to leave hold().

The readers-writer lock prefers writers, so a commit waiting for the writer side keeps every new
``hold()`` out. Once its push is dropped (the publisher's Abort after its deadline, a newer Begin
superseding it) it can never apply: it must leave the lock's queue at once, so new readers get in,
and it must hold no lease on a shared bank, so one reader stuck in ``hold()`` pins one bank only.
Before, it waited out its whole ``commit_timeout`` (30 s by default) with new readers locked out,
and in shared mode the publisher added a whole-model bank at every push.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import glob
import os
import time

import pytest
import torch

import rl_sync
import transport
from tests._rl_remote import generators as rl_generators
from tests._rl_remote import seeded

# the subscriber's layout (bfloat16 where the trainer has float32: the publisher casts)
GEN = {"a.weight": ("bfloat16", (256, 64)), "a.bias": ("bfloat16", (256,)), "scale": ("float32", ())}
TRAIN = {n: ("float32" if dt == "bfloat16" else dt, sh) for n, (dt, sh) in GEN.items()}
MODES = ["staged", "swap", "direct", "shared"]


generators = functools.partial(rl_generators, spec=GEN)


def trainer(store_url, uname):
    return transport.Endpoint(uname("trainer"), store=store_url, timeout=20)


def publisher(ep, gens):
    return rl_sync.WeightPublisher(ep, [g.name for g in gens], dtype="auto")


def new_hold_within(gen, seconds: float):
    """What a new hold() on ``gen`` gets within ``seconds`` (tried in 0.5 s slices): the version, or "timeout"."""
    deadline = time.monotonic() + seconds
    got = gen.call("sub_try_hold", 0.5)
    while got == "timeout" and time.monotonic() < deadline:
        got = gen.call("sub_try_hold", 0.5)
    return got


@pytest.mark.parametrize("mode", MODES)
async def test_an_aborted_commit_stops_waiting_and_lets_new_readers_in(store_url, uname, mode):
    """A reader stays in hold(); push 2 (deadline 1 s) cannot commit and its publisher aborts it.
    A new hold() then gets in within seconds (before: it waited behind the aborted commit, or
    direct mode's Begin, for the whole commit_timeout of 30 s). The aborted push never applies,
    and the next push commits once the reader left."""
    with generators(store_url, uname, 1, mode=mode, commit_timeout=30.0) as gens:
        g = gens[0]
        async with trainer(store_url, uname) as ep:
            pub = publisher(ep, gens)
            assert (await pub.push(seeded(TRAIN, 1), 1, timeout=20)).ok
            g.call("sub_hold", None)  # (until sub_release)
            report = await pub.push(seeded(TRAIN, 2), 2, timeout=1.0)
            assert isinstance(report.results[g.name].error, transport.TransportTimeoutError), report.summary()
            t0 = time.monotonic()
            assert new_hold_within(g, 8.0) == 1, "a new hold() still waits behind the aborted push's commit"
            assert time.monotonic() - t0 < 10.0
            g.call("sub_release", timeout=30)
            await asyncio.sleep(0.5)  # the reader has left: the aborted push must still not apply
            assert g.call("sub_version") == 1 and not g.call("sub_torn")
            assert all(g.call("sub_check", TRAIN, 1).values())
            report = await pub.push(seeded(TRAIN, 3), 3, timeout=20)
            assert report.ok, report.summary()
            assert all(g.call("sub_check", TRAIN, 3).values())
            pub.close()


@pytest.mark.parametrize("mode", ["staged", "swap", "direct"])
async def test_a_superseded_commit_stops_waiting_and_lets_new_readers_in(store_url, uname, mode):
    """Publisher 1's commit (direct mode: its Begin) waits for a reader; publisher 2's Begin
    supersedes it (publisher 1 is told "dropped" and sends nothing more: raw messages, no Abort).
    The superseded commit leaves the lock's queue at once: staged and swap let a new hold() in
    (publisher 2 has not committed); direct's waiting writer is then publisher 2's Begin alone,
    and once that is aborted readers get in. Nothing of publisher 1's push applies."""
    msgs = rl_sync.messages
    w0 = torch.arange(4096, dtype=torch.float32)
    spec = {"w": w0.clone()}
    async with trainer(store_url, uname) as ep, trainer(store_url, uname) as ep2, \
            transport.Endpoint(uname("gen"), store=store_url, timeout=20) as gep:
        sub = rl_sync.WeightSubscriber(gep, spec, mode=mode, commit_timeout=20.0)
        _, digest = sub.plan(1 << 20)
        ep.register("src", torch.full((sub.nbytes,), 7, dtype=torch.uint8))
        reader_in, reader_out = asyncio.Event(), asyncio.Event()

        async def reader() -> None:
            async with sub.hold():
                reader_in.set()
                await reader_out.wait()

        async def answer(on: transport.Endpoint) -> rl_sync.messages.Reply:
            return msgs.decode((await on.next_notification(timeout=5)).payload)

        async def writers_waiting(n: int) -> None:
            deadline = time.monotonic() + 5
            while sub._lock._writers_waiting != n:
                assert time.monotonic() < deadline, (sub._lock._writers_waiting, n)
                await asyncio.sleep(0.01)

        task = asyncio.ensure_future(reader())
        try:
            await asyncio.wait_for(reader_in.wait(), 5)
            await ep.notify(gep.name, msgs.encode(msgs.Begin(1, 1, digest, 1 << 20)))
            if mode != "direct":  # (direct: the Begin itself waits for the reader)
                assert (await answer(ep)).stage == "begin"
                await ep.notify(gep.name, msgs.encode(msgs.Pull(1, 0, ep.name, "src", 0)))
                assert (await answer(ep)).error is None
                await ep.notify(gep.name, msgs.encode(msgs.Commit(1, 1)))
            await writers_waiting(1)
            await ep2.notify(gep.name, msgs.encode(msgs.Begin(1, 2, digest, 1 << 20)))
            dropped = await answer(ep)
            assert dropped.stage == "dropped", dropped
            if mode == "direct":
                await writers_waiting(1)  # publisher 2's Begin only
                await ep2.notify(gep.name, msgs.encode(msgs.Abort(1, "publisher 2 gave up")))
            else:
                assert (await answer(ep2)).stage == "begin"
            t0 = time.monotonic()
            async with sub.hold(timeout=3.0) as v:
                assert v == 0 and time.monotonic() - t0 < 3.0
            assert sub._lock._writers_waiting == 0
        finally:
            reader_out.set()
            await asyncio.wait_for(task, 5)
        await asyncio.sleep(0.3)  # (the reader left: a commit still waiting would now apply)
        async with sub.hold(timeout=3.0) as v:
            assert v == 0 and torch.equal(spec["w"], w0) and not sub.torn
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError, transport.TransportTimeoutError):
            late = msgs.decode((await ep.next_notification(timeout=0.3)).payload)
            assert late.stage != "commit" or late.error is not None, f"the dropped push committed: {late}"
        sub.close()


async def test_shared_mode_a_reader_stuck_in_hold_pins_one_bank_and_the_publisher_reuses_the_others(store_url,
                                                                                                    uname):
    """Two shared subscribers; one keeps a reader in hold() (commit_timeout 60 s: its commits wait
    until their push is aborted or superseded). The other takes every push, and the publisher's
    banks stay within the documented bound (the distinct versions the subscribers hold, plus one:
    3), with one lock file per bank (before: a bank and a lock file more at every push, each
    pinned by a waiting commit's lease). The stuck subscriber keeps its version and its bank's
    bytes, and catches up once its reader leaves."""
    with generators(store_url, uname, 2, mode="shared", commit_timeout=60.0) as gens:
        stuck, other = gens
        async with trainer(store_url, uname) as ep:
            pub = publisher(ep, gens)
            assert (await pub.push(seeded(TRAIN, 1), 1, timeout=20)).ok
            stuck.call("sub_hold", None)  # (until sub_release)
            banks = []
            for v in range(2, 8):
                report = await pub.push(seeded(TRAIN, v), v, timeout=2.0)
                assert report.results[other.name].ok, report.summary()
                assert isinstance(report.results[stuck.name].error, transport.TransportTimeoutError), report.summary()
                (bank_set,) = pub._bank_sets.values()
                banks.append(len(bank_set))
                assert len(glob.glob(os.path.join(pub._lock_dir, "*.lock"))) == len(bank_set)
                assert all(other.call("sub_check", TRAIN, v).values())
            assert max(banks) <= 3, f"the publisher's banks after each push: {banks}"
            assert new_hold_within(stuck, 5.0) == 1
            stuck.call("sub_release", timeout=30)
            await asyncio.sleep(0.5)
            assert stuck.call("sub_version") == 1
            assert all(stuck.call("sub_check", TRAIN, 1).values()), "the stuck subscriber's bank was rewritten"
            for v in (8, 9):
                report = await pub.push(seeded(TRAIN, v), v, timeout=20)
                assert report.ok, report.summary()
                for g in gens:
                    assert all(g.call("sub_check", TRAIN, v).values())
            pub.close()
