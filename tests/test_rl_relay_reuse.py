"""A relay whose arena no longer holds the push its dependents pull (fan-out relays: ``fanout="chain"``
on one host, ``"auto"`` over tcp as between hosts).

A dependent reads its relay's staging arena one-sidedly, by name. Once the relay committed it is free
to take another publisher's push into the same bank, to make a new WeightSubscriber on its endpoint
(zero-filled arenas under the same names), or to be killed and restarted under its name; a dependent
that answers its Begin late, or whose relay pull is still in flight, would then read the relay's new
bytes (the old code committed them as the pushed version and reported ok).

What must hold: a subscriber's entry is ok only if it holds exactly the pushed version's bytes; a
healthy dependent whose relay can no longer serve the push gets the bytes from the publisher and
commits within the push's timeout; the relay keeps what it took since; the next push reaches both.
Real processes (tests/_remote.py), real sockets and shared memory; every wait bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest

import rl_sync
import transport
from tests._remote import RemoteEndpoint, wait_stopped
from tests._rl_remote import seeded

SPEC = {f"w{i}": ("float32", (256, 1024)) for i in range(4)}  # 4 MiB: 4 buckets of 1 MiB
BUCKET = 1 << 20
TIMEOUT = 30.0  # the push's timeout (a restart of the relay's process takes seconds on a loaded machine)


def _kw(store_url: str, fanout: str) -> dict:
    planes = {"planes": ("tcp",)} if fanout == "auto" else {}  # tcp: relayed as between hosts
    return {"store": store_url, "timeout": 20, "heartbeat_timeout": 10.0, **planes}


def _spawn(name: str, kw: dict) -> RemoteEndpoint:
    g = RemoteEndpoint(name, **kw)
    try:
        g.call("sub_create", SPEC, {"mode": "staged"})
    except BaseException:
        g.kill()
        raise
    return g


def _held(g: RemoteEndpoint) -> tuple[int, bool]:
    """The version ``g`` holds and whether its weights are exactly that version's bytes (one hold())."""
    v, exact = g.call("sub_check_held", SPEC, timeout=60)
    return v, exact


def _holds_exactly_v2(report: rl_sync.PushReport, dep: RemoteEndpoint) -> None:
    """The dependent's entry is ok and it holds exactly version 2's bytes."""
    v, exact = _held(dep)
    assert exact, f"{dep.name} reports version {v} but does not hold exactly its bytes: {report.summary()}"
    assert report.results[dep.name].ok and v == 2, report.summary()


async def _next_push_reaches_both(pub: rl_sync.WeightPublisher, gens: list[RemoteEndpoint], version: int) -> None:
    report = await asyncio.wait_for(pub.push(seeded(SPEC, version), version, timeout=TIMEOUT), TIMEOUT + 10)
    assert report.ok, report.summary()
    for g in gens:
        assert _held(g) == (version, True), g.name


@contextlib.asynccontextmanager
async def _relay_setup(store_url: str, uname, fanout: str) -> AsyncIterator[tuple[dict, list[str], list, Any, Any]]:
    """Two generators (names[0]: the relay under chain, the leader under auto), spawned, and two trainer
    endpoints (two publishers); the generators are killed at the end, whatever happened."""
    kw = _kw(store_url, fanout)
    names = sorted(uname(f"gen{i}") for i in range(2))
    gens = [_spawn(n, kw) for n in names]
    ep_kw = {k: v for k, v in kw.items() if k != "heartbeat_timeout"}
    try:
        async with transport.Endpoint(uname("trainer"), **ep_kw) as ep, \
                transport.Endpoint(uname("trainer-b"), **ep_kw) as ep_b:
            yield kw, names, gens, ep, ep_b
    finally:
        for g in gens:
            g.kill()


async def _finish(pubs: list[rl_sync.WeightPublisher], gens: list[RemoteEndpoint]) -> None:
    """The next push of the first publisher reaches both generators; then every publisher is closed."""
    await _next_push_reaches_both(pubs[0], gens, 4)
    for p in pubs:
        p.close()


CASES = [(v, f) for f in ("chain", "auto") for v in ("recreate", "second_pub", "restart")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("variant", "fanout"), CASES, ids=[f"{v}-{f}" for v, f in CASES])
async def test_a_late_dependent_never_commits_what_its_reused_relay_holds_now(store_url, uname, variant, fanout):
    """The dependent frozen (SIGSTOP) before its Begin arrives; its relay commits version 2, then makes a
    new subscriber, takes version 3 from another publisher, or is killed and restarted; the dependent let
    go answers its Begin late. It must commit exactly version 2 (from the publisher), reported ok."""
    async with _relay_setup(store_url, uname, fanout) as (kw, names, gens, ep, ep_b):
        relay_committed = asyncio.Event()

        def observer(ev: rl_sync.PushEvent) -> None:
            if ev.subscriber == names[0] and ev.kind == "committed" and ev.version == 2:
                relay_committed.set()

        pub = rl_sync.WeightPublisher(ep, names, fanout=fanout, bucket_bytes=BUCKET, observer=observer)
        report = await asyncio.wait_for(pub.push(seeded(SPEC, 1), 1, timeout=TIMEOUT), TIMEOUT + 10)
        assert report.ok, report.summary()
        pub_b = rl_sync.WeightPublisher(ep_b, [names[0]], bucket_bytes=BUCKET)

        gens[1].signal(signal.SIGSTOP)  # the dependent answers its Begin late
        push = asyncio.ensure_future(pub.push(seeded(SPEC, 2), 2, timeout=TIMEOUT))
        try:
            await asyncio.wait_for(relay_committed.wait(), 20)
            if variant == "recreate":  # same endpoint, same model: new arenas under the same names
                await asyncio.to_thread(gens[0].call, "sub_close")
                await asyncio.to_thread(gens[0].call, "sub_create", SPEC, {"mode": "staged"})
            elif variant == "second_pub":  # another publisher's push into the same bank
                rb = await asyncio.wait_for(pub_b.push(seeded(SPEC, 3), 3, timeout=TIMEOUT), TIMEOUT + 10)
                assert rb.ok, rb.summary()
            else:  # killed, restarted under its name
                gens[0].kill()
                gens[0] = await asyncio.to_thread(_spawn, names[0], kw)
        finally:
            gens[1].signal(signal.SIGCONT)
        report = await asyncio.wait_for(push, TIMEOUT + 10)
        _holds_exactly_v2(report, gens[1])
        relay_v, relay_exact = _held(gens[0])
        assert relay_exact and relay_v == {"recreate": 0, "second_pub": 3, "restart": 0}[variant], relay_v
        await _finish([pub, pub_b], gens)


@pytest.mark.timeout(240)
async def test_a_relay_pull_in_flight_while_the_relay_takes_another_push_is_refused(store_url, uname):
    """fanout='chain' over shared memory: the dependent is frozen as its Pull of the last bucket from its
    relay is sent (so the publisher saw the relay hold it when it sent the Pull). The relay commits, then
    takes version 3 from another publisher into the same bank; the dependent let go reads the relay's
    arena after that. A check before the read cannot see it: the dependent must refuse those bytes
    (the relay's stamp, read after them, changed) and commit exactly version 2 from the publisher. The
    relay's own copies are slowed (0.5 s each, from the first push on: the publisher's bounds for the
    second take the first's pulls as their yardstick) so that the publisher's relay bound (4x the
    median pull) does not give the frozen pull up first (then the bytes it read would be ignored anyway)."""
    last = len(SPEC) - 1
    async with _relay_setup(store_url, uname, "chain") as (_, names, gens, ep, ep_b):
        relay_committed = asyncio.Event()
        trap = {"armed": False, "fired": False}

        def observer(ev: rl_sync.PushEvent) -> None:
            if ev.version != 2:
                return
            if ev.subscriber == names[0] and ev.kind == "committed":
                relay_committed.set()
            if (trap["armed"] and ev.subscriber == names[1] and ev.kind == "pull_sent" and ev.bucket == last
                    and ev.source == names[0]):
                os.kill(gens[1].proc.pid, signal.SIGSTOP)  # (before the Pull is sent: it reads after the reuse)
                trap["armed"], trap["fired"] = False, True

        pub = rl_sync.WeightPublisher(ep, names, fanout="chain", bucket_bytes=BUCKET, observer=observer)
        gens[0].call("slow_shm_copies", 0.5, True)  # (from the first push: the yardstick of the second's bounds)
        report = await asyncio.wait_for(pub.push(seeded(SPEC, 1), 1, timeout=TIMEOUT), TIMEOUT + 10)
        assert report.ok, report.summary()
        pub_b = rl_sync.WeightPublisher(ep_b, [names[0]], bucket_bytes=len(SPEC) * BUCKET)  # one bucket
        trap["armed"] = True
        push = asyncio.ensure_future(pub.push(seeded(SPEC, 2), 2, timeout=TIMEOUT))
        try:
            await asyncio.wait_for(relay_committed.wait(), 20)
            assert trap["fired"], "the dependent's relay pull of the last bucket was never sent"
            await asyncio.to_thread(wait_stopped, gens[1].proc.pid)
            rb = await asyncio.wait_for(pub_b.push(seeded(SPEC, 3), 3, timeout=TIMEOUT), TIMEOUT + 10)
            assert rb.ok, rb.summary()
        finally:
            os.kill(gens[1].proc.pid, signal.SIGCONT)
        report = await asyncio.wait_for(push, TIMEOUT + 10)
        _holds_exactly_v2(report, gens[1])
        assert _held(gens[0]) == (3, True)
        await _finish([pub, pub_b], gens)
