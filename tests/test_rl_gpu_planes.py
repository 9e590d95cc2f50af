"""rl_sync over the GPU planes' protocols, on CPU: ``cuda_ipc`` and ``nccl`` with their CPU stand-in engines.

``Endpoint(engines={"cuda_ipc": MemfdIpcEngine})`` runs the ``cuda_ipc`` plane's whole protocol (exports in the
registry, the peer's allocation mapped once, copies on an ordered queue awaited through a completion
bridge, header after the copy) on memfd-backed CPU memory; ``Endpoint(engines={"nccl": SocketLinkEngine})``
runs the ``nccl`` plane's (a 2-rank link per channel, the dialer's post order, ``Go`` frames, abort)
over a second socket, with ``shm`` left out as between hosts. Trainer and generators are real
processes; only the engine differs from a GPU run (tests/gpu/test_rl_sync_gpu.py runs CUDA's).

What must hold on those planes as on the CPU ones: every mode and fan-out delivers exact bytes, the
push report names the plane each subscriber's bytes took (checked against the subscriber's own
flight recorder) and why; a subscriber frozen or killed mid-transfer holds up only itself and keeps
its last version; a push cancelled mid-transfer is never committed; the next push reaches everyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rl_sync
import transport
from tests._rl_remote import seeded
from tests.test_rl_faults import (
    BUCKET,
    SPEC,
    TIMEOUT,
    TRAIN,
    _check_all,
    _Gens,
    _Trap,
    next_push_reaches_everyone,
    warm_up,
)
from transport.planes import SocketLinkEngine
from transport.planes.cuda_ipc_memfd import MemfdIpcEngine

REPO = Path(__file__).resolve().parents[1]
ENGINES = {
    "cuda_ipc": {"engines": {"cuda_ipc": MemfdIpcEngine}},
    "nccl": {"engines": {"nccl": SocketLinkEngine}, "planes": ("tcp", "nccl")},  # no shm: as between two hosts
}
CASES = [(e, m, f) for e in ENGINES for m in ("staged", "swap", "direct", "shared") for f in ("direct", "chain")
         if not (e == "nccl" and m == "shared")]  # (shared maps the publisher's banks: one host only)


def _pub(ep, gens, **kw):
    return rl_sync.WeightPublisher(ep, [g.name for g in gens], dtype="auto", bucket_bytes=BUCKET, **kw)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("engine", "mode", "fanout"), CASES, ids=[f"{e}-{m}-{f}" for e, m, f in CASES])
async def test_every_mode_and_fanout_delivers_and_reports_its_plane(store_url, uname, engine, mode, fanout):
    gens = _Gens(store_url, uname, mode, **ENGINES[engine])
    try:
        async with transport.Endpoint(uname("trainer"), store=store_url, timeout=20, **ENGINES[engine]) as ep:
            events: list[rl_sync.PushEvent] = []
            pub = _pub(ep, gens.gens, fanout=fanout, observer=events.append)
            for version in (1, 2):
                report = await pub.push(seeded(TRAIN, version), version, timeout=30)
                assert report.ok, report.summary()
                _check_all(gens.gens, {version})
            want = "shared" if mode == "shared" else engine
            for g in gens.gens:
                r = report.results[g.name]
                assert r.plane == want and r.plane_reason, (g.name, r)
                if mode == "shared":  # (the path of a GPU bank: mapped over cuda_ipc, not shm)
                    assert f"mapped over {engine}" in r.plane_reason, r
                else:
                    assert g.call("op_planes", "get") == [engine], "the report and the flight recorder disagree"
            assert report.planes == {want: len(gens.gens)} and f"over {want} x3" in report.summary()
            if fanout == "chain" and mode != "shared":
                # each pulls from the one before it; a relay that answered its Begin after the main pass began, or
                # left a pull unanswered past the relay bound (a loaded machine), has its dependent pull from the
                # publisher instead, as documented: only then
                relays = [gens.gens[0].name, gens.gens[1].name]
                late = [e.detail for e in events if e.version == 2 and e.kind == "resourced"]
                for why in late:
                    m = (re.fullmatch(r"its relay (\S+) has not begun", why)
                         or re.fullmatch(r"its pulls of buckets \[[\d, ]+\] from its relay (\S+) went unanswered for "
                                         r"[\d.]+ s", why))
                    assert m is not None and m.group(1) in relays, late
                    relays[relays.index(m.group(1))] = ep.name
                assert sorted(r.source for r in report.results.values()) == sorted([ep.name, *relays]), (
                    report.results, late)
    finally:
        gens.close()


FAULTS = [(e, m) for e in ENGINES for m in ("staged", "swap", "direct")]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("engine", "mode"), FAULTS, ids=[f"{e}-{m}" for e, m in FAULTS])
async def test_a_frozen_or_killed_subscriber_holds_up_only_itself(store_url, uname, engine, mode):
    """SIGSTOP, then SIGKILL, of the middle subscriber of three once it holds two buckets (chain
    fan-out: it relays to the third, who then pulls from the publisher)."""
    gens = _Gens(store_url, uname, mode, **ENGINES[engine])
    trap = _Trap()
    lines = []
    try:
        async with transport.Endpoint(uname("trainer"), store=store_url, timeout=20, **ENGINES[engine]) as ep:
            pub = _pub(ep, gens.gens, fanout="chain", observer=trap)
            version, bound = await warm_up(pub)
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                g = gens.gens[1]
                trap.arm(g.name, g.pid, "transfer", sig)
                version += 1
                weights = seeded(TRAIN, version)  # (made before the clock starts: making them takes a while)
                t0 = time.monotonic()
                report = await pub.push(weights, version, timeout=TIMEOUT)
                wall = time.monotonic() - t0
                assert trap.fired_at is not None, report.summary()
                healthy = [report.results[h.name] for h in gens.gens if h is not g]
                res = report.results[g.name]
                lines.append(f"  {sig.name} mid-transfer: healthy committed in "
                             f"{', '.join(f'{r.seconds:.2f}' for r in healthy)} s (bound {bound:.2f}), push {wall:.2f} s, "
                             f"planes {report.planes}")
                assert all(r.ok and r.seconds <= bound and r.plane == engine for r in healthy), (
                    f"{lines[-1]}\n{report.summary()}\n{trap.trace()}")
                assert not res.ok and res.stage == "transfer", f"{res}\n{trap.trace()}"
                _check_all([h for h in gens.gens if h is not g], {version})
                if sig == signal.SIGSTOP:
                    assert isinstance(res.error, transport.TransportTimeoutError), res
                    g.signal(signal.SIGCONT)
                    await asyncio.sleep(0.3)
                    if mode == "direct":
                        assert g.call("sub_torn") and g.call("sub_version") == version - 1
                    else:
                        _check_all([g], {version - 1})
                else:
                    assert isinstance(res.error, transport.PeerLostError), res
                    gens.restart(1)
                version = await next_push_reaches_everyone(pub, gens.gens, version)
    finally:
        gens.close()
    print(f"\n[{engine}, {mode}]\n" + "\n".join(lines))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("engine", "mode"), [(e, m) for e in ENGINES for m in ("staged", "direct")])
async def test_a_push_cancelled_mid_transfer_is_never_committed(store_url, uname, engine, mode):
    gens = _Gens(store_url, uname, mode, **ENGINES[engine])
    try:
        async with transport.Endpoint(uname("trainer"), store=store_url, timeout=20, **ENGINES[engine]) as ep:
            task: asyncio.Task | None = None

            def cancel_mid_transfer(ev: rl_sync.PushEvent) -> None:
                if ev.version == 2 and ev.kind == "pulled" and ev.have >= 2 and task is not None:
                    task.cancel()

            pub = _pub(ep, gens.gens, observer=cancel_mid_transfer)
            assert (await pub.push(seeded(TRAIN, 1), 1, timeout=30)).ok
            task = asyncio.ensure_future(pub.push(seeded(TRAIN, 2), 2, timeout=30))
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 30)
            await asyncio.sleep(0.5)
            if mode == "direct":  # written in place: torn until the next commit, never version 2
                assert [g.call("sub_version") for g in gens.gens] == [1, 1, 1]
            else:
                assert _check_all(gens.gens, {1}) == [1, 1, 1]
            report = await pub.push(seeded(TRAIN, 3), 3, timeout=30)
            assert report.ok and report.planes == {engine: 3}, report.summary()
            _check_all(gens.gens, {3})
    finally:
        gens.close()


LIVE = [(e, m, f) for e in ENGINES for m, f in (("staged", "direct"), ("swap", "direct"), ("direct", "chain"))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("engine", "mode", "fanout"), LIVE, ids=[f"{e}-{m}-{f}" for e, m, f in LIVE])
async def test_a_push_served_live_from_the_trainers_tensors(store_url, uname, engine, mode, fanout):
    """No cast needed (bfloat16 on both sides) and ``live=True``: nothing is packed, the subscribers
    pulling from the publisher read the trainer's own tensors (one copy: into the arena, which in
    direct mode is the live weights), the others relay as usual; a frozen subscriber holds up only
    itself; the trainer's tensors keep their values (a push only reads them)."""
    gens = _Gens(store_url, uname, mode, **ENGINES[engine])
    trap = _Trap()
    try:
        async with transport.Endpoint(uname("trainer"), store=store_url, timeout=20, **ENGINES[engine]) as ep:
            pub = _pub(ep, gens.gens, fanout=fanout, live=True, observer=trap)
            for version in (1, 2):
                weights = seeded(SPEC, version)
                report = await pub.push(weights, version, timeout=30)
                assert report.ok, report.summary()
                assert report.packed_bytes == 0 and report.planes == {engine: 3}, report.summary()
                _check_all(gens.gens, {version})
                assert all(torch.equal(t, seeded(SPEC, version)[n]) for n, t in weights.items())
            live = [n for n in ep.buffers if "/live/" in n]
            assert len(live) == len(SPEC) and not [n for n in ep.buffers if "/slot" in n]
            g = gens.gens[1]
            trap.arm(g.name, g.pid, "transfer", signal.SIGSTOP)
            report = await pub.push(seeded(SPEC, 3), 3, timeout=TIMEOUT)
            g.signal(signal.SIGCONT)
            assert trap.fired_at is not None
            assert all(report.results[h.name].ok for h in gens.gens if h is not g), report.summary()
            await asyncio.sleep(0.3)
            report = await pub.push(seeded(SPEC, 4), 4, timeout=30)
            assert report.ok, report.summary()
            _check_all(gens.gens, {4})
            pub.close()
            assert not [n for n in ep.buffers if "/live/" in n]
    finally:
        gens.close()


def _other_host_unavailable() -> str | None:
    """Why a process cannot be started as another "host" here (new pid and mount namespaces), or None."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    try:
        res = subprocess.run(["unshare", "--pid", "--mount", "--fork", "--mount-proc", "--kill-child", "true"],
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    return None if res.returncode == 0 else f"unshare --pid --mount needs root: {res.stderr.strip()}"


@pytest.mark.timeout(200)
@pytest.mark.skipif(_other_host_unavailable() is not None, reason=str(_other_host_unavailable()))
@pytest.mark.parametrize("mode", ["staged", "direct"])
async def test_on_another_host_one_pulls_over_nccl_and_its_neighbour_relays_over_cuda_ipc(store_url, uname, mode):
    """Point 6's topology on CPU: two generators in one process on another "host" (new pid and
    mount namespaces: transport sees another host) with fanout="auto": one of them pulls from the
    trainer over nccl, the other relays from it over cuda_ipc (its neighbour on that host); both
    hold the exact bytes, and the report says so."""
    names = [uname("hostb-gen0"), uname("hostb-gen1")]  # (sorted: the first is the host's leader)
    proc = subprocess.Popen(["unshare", "--pid", "--mount", "--fork", "--mount-proc", "--kill-child",  # noqa: ASYNC220 - starts it only
                             sys.executable, "tests/_pidns_host.py", store_url, mode, *names],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)

    async def line() -> str:
        got = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert got, f"the other host's process ended (rc {proc.poll()})"
        return got.strip()

    try:
        assert await line() == "ready"
        kw = {"engines": {"cuda_ipc": MemfdIpcEngine, "nccl": SocketLinkEngine}, "planes": ("tcp", "cuda_ipc", "nccl")}
        async with transport.Endpoint(uname("trainer"), store=store_url, timeout=20, **kw) as ep:
            pub = rl_sync.WeightPublisher(ep, names, dtype="auto", bucket_bytes=BUCKET)
            for version in (1, 2):
                report = await pub.push(seeded(TRAIN, version), version, timeout=30)
                assert report.ok, report.summary()
                proc.stdin.write(f"check {json.dumps(TRAIN)}\n")
                proc.stdin.flush()
                assert json.loads(await line()) == [[version, True], [version, True]]
            lead, other = report.results[names[0]], report.results[names[1]]
            assert (lead.source, lead.plane) == (ep.name, "nccl"), lead
            assert (other.source, other.plane) == (names[0], "cuda_ipc"), other
            assert not (await ep.connect(names[0])).same_host
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.write("quit\n")
            proc.stdin.flush()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        for f in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                f.close()
