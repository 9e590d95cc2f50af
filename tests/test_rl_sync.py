"""rl_sync between real processes: plans, contents, consistency under readers, failures, fan-out."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing as mp
import re
import signal
import threading
import time
import types

import pytest
import torch

import rl_sync
import rl_sync.pub_buffers
import transport
from rl_sync.fanout import assign_sources
from rl_sync.plan import build_manifest, check_sources, make_buckets, plan_hash
from tests._remote import RemoteEndpoint, backing, same_bytes
from tests._rl_remote import blocking_generator, seeded, stamped
from tests._rl_remote import generators as rl_generators
from transport.planes.cuda_ipc_memfd import MemfdIpcEngine

# the subscriber's layout: several dtypes, a 0-d and an empty tensor, one tensor larger than a bucket
GEN = {
    "embed.weight": ("bfloat16", (300, 64)),
    "layers.0.weight": ("bfloat16", (128, 64)),
    "layers.0.bias": ("bfloat16", (128,)),
    "scale": ("float32", ()),
    "empty": ("float32", (0, 4)),
    "steps": ("int64", (3,)),
}
# what the trainer holds: float32 where the generator has bfloat16
TRAIN = {n: ("float32" if dt == "bfloat16" else dt, sh) for n, (dt, sh) in GEN.items()}
BUCKET = 16 << 10  # several buckets per push, and embed.weight (37.5 KiB) is split across three


generators = functools.partial(rl_generators, spec=GEN)


def trainer(store_url, uname, **kw):
    return transport.Endpoint(uname("trainer"), store=store_url, timeout=20, **kw)


def cast_pub(ep, gens, **kw):
    return rl_sync.WeightPublisher(ep, [g.name for g in gens], dtype="auto", bucket_bytes=BUCKET, **kw)


# ---------------------------------------------------------------------------- plan (no processes)
def test_buckets_cover_every_byte_once_and_respect_the_size():
    state = {n: torch.zeros(sh, dtype=getattr(torch, dt)) for n, (dt, sh) in GEN.items()}
    man = build_manifest(state, arena_bytes=40 << 10)
    assert len(man.arenas) >= 2, "a 40 KiB arena limit must give several arenas"
    buckets = make_buckets(man, BUCKET)
    seen: dict[str, list[tuple[int, int]]] = {}
    for b in buckets:
        assert 0 < b.nbytes <= BUCKET
        for p in b.pieces:
            assert b.offset <= p.entry.offset + p.start and p.entry.offset + p.stop <= b.offset + b.nbytes
            seen.setdefault(p.entry.name, []).append((p.start, p.stop))
    for e in man.entries:
        ranges = sorted(seen.get(e.name, []))
        covered = 0
        for start, stop in ranges:
            assert start == covered, f"{e.name}: gap or overlap at {start}"
            covered = stop
        assert covered == e.nbytes
        if e.nbytes <= BUCKET:
            assert len(ranges) <= 1, f"{e.name} fits in a bucket and must not be split"
    assert len(seen["embed.weight"]) == 3
    assert plan_hash(man, buckets) != plan_hash(man, make_buckets(man, BUCKET // 2))


def test_the_staged_commit_writes_in_the_manifests_order_and_keeps_no_view_after_close():
    """The staged commit copies the bank in batches; live tensors that share memory (views of one
    tensor, here under two dtypes) are still written in the manifest's order, the last entry
    winning as with one ``copy_`` per entry; the views it keeps per bank go at close()."""
    from rl_sync.modes.staged import StagedMode
    from rl_sync.plan import dtype_from_name

    base = torch.zeros(4)
    live = {"a": base, "b": base.view(torch.int32), "c": base[:], "d": torch.zeros(3),
            "e": torch.zeros(2, dtype=torch.int64), "f": torch.zeros(3)}
    man = build_manifest(live, 1 << 20)
    arena = torch.zeros(man.arenas[0], dtype=torch.uint8)
    values = {"a": 1.0, "b": 2, "c": 3.0, "d": 4.0, "e": 5, "f": 6.0}
    for e in man.entries:
        arena[e.offset:e.offset + e.nbytes].view(dtype_from_name(e.dtype)).fill_(values[e.name])
    mode = StagedMode(types.SimpleNamespace(manifest=man, _live=live, _banks=[[arena]]))  # type: ignore[arg-type]
    for _ in range(2):  # (the second commit uses the kept views)
        base.zero_()
        mode._apply(0)
        assert base.tolist() == [3.0] * 4, "c comes last in the manifest: its bytes must win"
        assert live["d"].tolist() == [4.0] * 3 and live["e"].tolist() == [5, 5] and live["f"].tolist() == [6.0] * 3
    assert [e.name for e in man.entries] == list(live)
    mode.close()
    assert not mode._kept
    mode._apply(0)  # (a commit racing close() keeps nothing either)
    assert not mode._kept and base.tolist() == [3.0] * 4


def test_check_sources_lists_every_difference():
    gen = {n: torch.zeros(sh, dtype=getattr(torch, dt)) for n, (dt, sh) in GEN.items()}
    man = build_manifest(gen, 1 << 20)
    train = {n: torch.zeros(sh, dtype=getattr(torch, dt)) for n, (dt, sh) in TRAIN.items()}
    del train["layers.0.bias"]
    train["extra"] = torch.zeros(2)
    train["layers.0.weight"] = torch.zeros(64, 128)
    with pytest.raises(rl_sync.PlanMismatchError) as ei:
        check_sources(train, man, dtype=None, name_map=None, subscriber="g")
    diffs = "\n".join(ei.value.differences)
    assert len(ei.value.differences) == 5, diffs  # layers.0.weight differs in shape and dtype
    for needle in ("'layers.0.bias'", "'extra'", "shape (128, 64)", "'embed.weight': dtype bfloat16"):
        assert needle in diffs
    mapped = check_sources({"model." + n: t for n, t in gen.items()}, man, dtype=None,
                           name_map=lambda n: n.removeprefix("model."), subscriber="g")
    assert set(mapped) == set(GEN)
    # a dtype casts floating-point tensors only; "auto" follows each subscriber entry
    train = {n: torch.zeros(sh, dtype=getattr(torch, dt)) for n, (dt, sh) in TRAIN.items()}
    with pytest.raises(rl_sync.PlanMismatchError) as ei:
        check_sources(train, man, dtype=torch.bfloat16, name_map=None, subscriber="g")
    assert [d.split(":")[0] for d in ei.value.differences] == ["'empty'", "'scale'"]
    assert "the trainer sends float32 cast to bfloat16" in ei.value.differences[1]
    assert set(check_sources(train, man, dtype="auto", name_map=None, subscriber="g")) == set(GEN)


def test_source_memo_keeps_the_check_while_what_it_read_stays(monkeypatch):
    """SourceMemo answers from its memo while names, shapes, dtypes, dtype= and the name map stay,
    and checks again (raising what check_sources raises) once one of them changes."""
    import rl_sync.plan as plan

    gen = {n: torch.zeros(sh, dtype=getattr(torch, dt)) for n, (dt, sh) in GEN.items()}
    man = build_manifest(gen, 1 << 20)
    calls = []
    real = plan.check_sources
    monkeypatch.setattr(plan, "check_sources", lambda *a, **k: calls.append(1) or real(*a, **k))
    memo = plan.SourceMemo()
    train = {"model." + n: t for n, t in gen.items()}
    names = {"model." + n: n for n in gen}

    def sources(tensors, name_map=names, dtype=None):
        return memo.sources("d", tensors, man, dtype=dtype, name_map=name_map, subscriber="g")

    first = sources(train)
    assert len(calls) == 1 and first == {n: train["model." + n] for n in gen}
    again = dict(train, **{"model.steps": torch.ones(3, dtype=torch.int64)})  # new tensors, same shapes
    assert sources(again) == {n: again["model." + n] for n in gen} and len(calls) == 1
    assert sources(again, dict(names)) and len(calls) == 2  # another mapping object: checked again
    assert sources(again) and sources(again) and len(calls) == 3
    names["model.extra"] = "extra"  # the kept mapping edited in place: checked again
    assert sources(again) and len(calls) == 4
    with pytest.raises(rl_sync.PlanMismatchError):  # a shape changed
        sources(dict(again, **{"model.steps": torch.ones(4, dtype=torch.int64)}))
    with pytest.raises(rl_sync.PlanMismatchError):  # a dtype changed
        sources(dict(again, **{"model.steps": torch.ones(3, dtype=torch.int32)}))
    assert sources(again, dtype="auto") and len(calls) == 7  # another dtype=
    memo.forget(set())
    assert sources(again, dtype="auto") and len(calls) == 8


def test_repointing_modes_refuse_views_and_keep_tied_weights():
    from rl_sync.weights import shared_memory

    fused = torch.zeros(6, 4)
    tied = torch.nn.Parameter(torch.zeros(3, 4))
    views = {"qkv.q": fused[:2], "qkv.k": fused[2:4], "qkv.v": fused[4:], "embed": tied, "head": tied,
             "empty.a": torch.zeros(0), "empty.b": torch.zeros(0, 2)}
    assert shared_memory(views) == [["qkv.k", "qkv.q", "qkv.v"]]  # one object under two names is no alias
    assert shared_memory({"half": fused[:3]}) == [["half"]]  # a view of a tensor not given: its base stays behind
    assert shared_memory({"all": fused, "part": fused[1:]}) == [["all", "part"]]
    assert shared_memory({"embed": tied, "head": tied, "other": torch.zeros(2)}) == []
    for mode in ("swap", "direct", "shared"):
        with pytest.raises(ValueError, match=r"qkv.k, qkv.q, qkv.v share memory"):
            rl_sync.WeightSubscriber(transport.Endpoint("never-opened", store="tcp://127.0.0.1:1"), views, mode=mode)


def test_hostile_manifests_and_messages_are_refused_not_raised():
    import msgspec

    from rl_sync import messages as m
    from rl_sync.plan import decode_manifest

    nested = b"\x81\xa1a" * 100_000 + b"\xc0"  # 100k levels of {"a": {...}}: RecursionError in the decoder
    with pytest.raises(rl_sync.PlanMismatchError, match="does not decode"):
        decode_manifest(nested)
    with pytest.raises(msgspec.DecodeError):
        m.decode(m.TO_SUBSCRIBER + b"\x92\xa4pull" + b"\x91" * 100_000 + b"\xc0")
    with pytest.raises(msgspec.DecodeError):
        m.decode(m.TO_PUBLISHER + nested)


def test_rwlock_calls_on_idle_when_the_last_holder_leaves():
    from rl_sync.rwlock import RWLock

    lock, calls = RWLock(), []
    lock.on_idle = lambda: calls.append(lock.readers)
    assert lock.acquire_read(0) and lock.acquire_read(0)
    lock.release_read()
    assert calls == []
    lock.release_read()
    assert calls == [0]
    assert lock.acquire_write(0)
    lock.release_write()  # a writer leaving counts too (a close waiting behind a commit)
    assert calls == [0, 0]


def test_assign_sources_builds_a_tree_per_host():
    subs = ["a", "b", "c", "d", "e"]
    same = {"a": True, "b": True}
    hosts = {"c": "h2", "d": "h2", "e": "h3"}
    src = assign_sources(subs, same, hosts)
    assert src == {"a": None, "b": None, "c": None, "d": "c", "e": None}
    assert assign_sources(subs, same, hosts, "chain") == {"a": None, "b": "a", "c": "b", "d": "c", "e": "d"}
    with pytest.raises(ValueError):
        assign_sources(subs, same, hosts, "ring")


# ---------------------------------------------------------------------------- pushes
@pytest.mark.parametrize("plane", ["shm", "tcp"])
async def test_push_casts_and_delivers_exact_bytes(store_url, uname, plane):
    with generators(store_url, uname, 2, planes=(plane,)) as gens:
        async with trainer(store_url, uname, planes=(plane,)) as ep:
            pub = cast_pub(ep, gens)
            for version, seed in ((1, 10), (2, 20)):
                report = await pub.push(seeded(TRAIN, seed), version)
                assert report.ok, report.summary()
                for g in gens:
                    assert g.call("sub_version") == version
                    assert all(g.call("sub_check", TRAIN, seed).values())
            nbytes = sum(torch.zeros(sh, dtype=getattr(torch, dt)).nbytes for dt, sh in GEN.values())
            assert set(report.results) == {g.name for g in gens}
            for r in report.results.values():
                assert r.ok and r.error is None and r.bytes >= nbytes and r.seconds > 0
            assert report.bytes == sum(r.bytes for r in report.results.values()) and report.gbps > 0
            assert report.packed_bytes < report.bytes, "buckets are packed once, not once per subscriber"
            assert pub.version == 2


async def test_stale_version_and_plan_mismatch_raise_before_any_byte_moves(store_url, uname):
    with generators(store_url, uname, 1) as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens)
            with pytest.raises(rl_sync.PlanMismatchError) as ei:
                bad = seeded(TRAIN, 1)
                del bad["steps"]
                bad["layers.0.bias"] = torch.zeros(5)
                await pub.push(bad, 1)
            assert len(ei.value.differences) == 2 and gens[0].name in str(ei.value)
            assert gens[0].call("sub_version") == 0
            assert (await pub.push(seeded(TRAIN, 1), 3)).ok
            for v in (3, 2, 0):
                with pytest.raises(rl_sync.StaleVersionError):
                    await pub.push(seeded(TRAIN, 2), v)
            assert gens[0].call("sub_version") == 3 and all(gens[0].call("sub_check", TRAIN, 1).values())
            # a second publisher that starts lower is refused by the subscriber itself
            other = rl_sync.WeightPublisher(ep, [gens[0].name], dtype="auto", bucket_bytes=BUCKET)
            pub.close()
            report = await other.push(seeded(TRAIN, 2), 2)
            assert isinstance(report.results[gens[0].name].error, rl_sync.StaleVersionError)
            assert all(gens[0].call("sub_check", TRAIN, 1).values())
            # an endpoint that runs no WeightSubscriber (yet): its entry fails once the planning bound passed
            async with transport.Endpoint(uname("plain"), store=store_url) as plain:
                t0 = time.monotonic()
                report = await rl_sync.WeightPublisher(ep, [plain.name]).push(seeded(TRAIN, 1), 9, timeout=1.0)
                assert 0.9 <= time.monotonic() - t0 < 5
                err = report.results[plain.name].error
                assert isinstance(err, rl_sync.SubscriberNotReadyError) and "runs no WeightSubscriber" in str(err)


async def test_a_push_takes_the_trainers_tensors_as_they_are_at_that_push(store_url, uname):
    """The publisher keeps its check of the trainer's tensors while their names, shapes and dtypes
    stay: values changed in place, an object replaced, and a tensor reshaped or recast in place
    (``.data``) are each seen by the next push (pushed, or refused before any byte moves)."""
    with generators(store_url, uname, 1) as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens)
            data = seeded(TRAIN, 1)
            assert (await pub.push(data, 1)).ok
            for n, t in seeded(TRAIN, 2).items():  # the same objects, new values
                data[n].copy_(t)
            assert (await pub.push(data, 2)).ok and all(gens[0].call("sub_check", TRAIN, 2).values())
            for n, t in seeded(TRAIN, 3).items():
                data[n].copy_(t)
            old = data["layers.0.weight"]
            data["layers.0.weight"] = old.clone()  # a new object under that name, with seed 3's values
            old.zero_()  # the one it replaced: a push that still read it would leave zeros there
            assert (await pub.push(data, 3)).ok and all(gens[0].call("sub_check", TRAIN, 3).values())
            bias = data["layers.0.bias"].data
            data["layers.0.bias"].data = torch.zeros(5)  # the same object, another shape
            with pytest.raises(rl_sync.PlanMismatchError) as ei:
                await pub.push(data, 4)
            assert any("'layers.0.bias': shape (128,)" in d for d in ei.value.differences), ei.value.differences
            data["layers.0.bias"].data = bias
            steps = data["steps"].data
            data["steps"].data = steps.float()  # the same object, another dtype (not castable to int64)
            with pytest.raises(rl_sync.PlanMismatchError) as ei:
                await pub.push(data, 4)
            assert any("'steps': dtype int64" in d for d in ei.value.differences), ei.value.differences
            data["steps"].data = steps
            assert gens[0].call("sub_version") == 3 and all(gens[0].call("sub_check", TRAIN, 3).values())
            assert (await pub.push(data, 4)).ok and all(gens[0].call("sub_check", TRAIN, 3).values())


async def test_a_changed_name_map_and_a_parameter_given_new_memory_are_seen_by_the_next_push(store_url, uname):
    """A dict name map edited in place or replaced by another, and (``live=True``, the trainer's
    tensors pulled where they lie) a Parameter whose memory was replaced (``.data =``, as
    ``module.to()`` does): the next push maps and reads them as they are then."""
    spec = {"x": ("float32", (4,)), "y": ("float32", (4,))}
    with generators(store_url, uname, 1, spec=spec) as gens:
        async with trainer(store_url, uname) as ep:
            names = {"a": "x", "b": "y"}
            pub = rl_sync.WeightPublisher(ep, [gens[0].name], name_map=names)
            want = seeded(spec, 1)
            assert (await pub.push({"a": want["x"], "b": want["y"]}, 1)).ok
            assert all(gens[0].call("sub_check", spec, 1).values())
            names["a"], names["b"] = "y", "x"  # edited in place
            want = seeded(spec, 2)
            assert (await pub.push({"a": want["y"], "b": want["x"]}, 2)).ok
            assert all(gens[0].call("sub_check", spec, 2).values())
            pub.name_map = {"a": "x", "b": "y"}  # another map
            want = seeded(spec, 3)
            assert (await pub.push({"a": want["x"], "b": want["y"]}, 3)).ok
            assert all(gens[0].call("sub_check", spec, 3).values())
            pub.close()
            want = seeded(spec, 4)
            model = torch.nn.ParameterDict({n: torch.nn.Parameter(t.clone()) for n, t in want.items()})
            live = rl_sync.WeightPublisher(ep, [gens[0].name], live=True)
            report = await live.push(model, 4)
            assert report.ok and report.packed_bytes == 0, "live=True: pulled from the trainer's tensors"
            assert all(gens[0].call("sub_check", spec, 4).values())
            for n, t in seeded(spec, 5).items():
                model[n].data = t.clone()  # the same Parameter objects, new memory
            assert (await live.push(model, 5)).ok
            assert all(gens[0].call("sub_check", spec, 5).values())


async def test_name_map_translates_names_and_progress_shows_a_bar(store_url, uname, capfd):
    with generators(store_url, uname, 1) as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens, name_map={f"module.{n}": n for n in GEN})
            data = seeded(TRAIN, 5)
            report = await pub.push({f"module.{n}": t for n, t in data.items()}, 1, progress=True)
            assert report.ok, report.summary()
            assert all(gens[0].call("sub_check", TRAIN, 5).values())
            err = capfd.readouterr().err
            assert "push v1" in err and "100%" in err, err
            await pub.push({f"module.{n}": t for n, t in data.items()}, 2)
            assert "push v2" not in capfd.readouterr().err, "no bar unless asked for"


@pytest.mark.parametrize("mode", ["staged", "swap", "direct", "shared"])
async def test_readers_never_see_two_versions(store_url, uname, mode):
    """A reader loop inside hold() checks that every element of every tensor carries one version stamp."""
    spec = {"a": ("float32", (64, 64)), "b": ("float32", (4096,)), "c": ("float32", (3, 5))}
    with generators(store_url, uname, 2, spec=spec, mode=mode) as gens:
        async with trainer(store_url, uname) as ep:
            pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], bucket_bytes=4096)
            for g in gens:
                g.call("sub_reader_start")
            pushes = 200
            for v in range(1, pushes + 1):
                report = await pub.push(stamped(spec, v), v)
                assert report.ok, report.summary()
            for g in gens:
                checks, bad, versions = g.call("sub_reader_stop")
                assert not bad, f"a reader saw a mix of versions: {bad}"
                assert checks > 50 and len(versions) > 10, (checks, versions)
                assert g.call("sub_check_stamp") == [pushes, True] or g.call("sub_check_stamp") == (pushes, True)


async def test_commit_waits_for_readers_and_times_out_without_applying(store_url, uname):
    with generators(store_url, uname, 1, commit_timeout=1.0) as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens)
            assert (await pub.push(seeded(TRAIN, 1), 1)).ok
            weights = seeded(TRAIN, 2)  # (made before the clock starts: making them takes a while)
            t0 = time.monotonic()  # (before the hold starts: it ends 0.6 s after its start, later than t0 + 0.6)
            gens[0].call("sub_hold", 0.6)
            assert (await pub.push(weights, 2)).ok
            assert time.monotonic() - t0 >= 0.6, "the commit must wait for the reader to leave hold()"
            gens[0].call("sub_hold", None)
            report = await pub.push(seeded(TRAIN, 3), 3)
            err = report.results[gens[0].name].error
            assert isinstance(err, rl_sync.CommitTimeoutError) and err.phase == "commit" == rl_sync.SyncPhase.COMMIT
            assert isinstance(err, transport.TransportTimeoutError)  # (what code written before it catches)
            # the publisher's Abort is best-effort and may reach the subscriber after the reader left (then the
            # commit that was told may still apply: README, "Atomic versions"); this case is the Abort first
            for _ in range(100):
                if not gens[0].call("sub_pushing"):
                    break
                await asyncio.sleep(0.05)
            assert not gens[0].call("sub_pushing"), "the Abort did not reach the subscriber within 5 s"
            gens[0].call("sub_release", timeout=30)
            assert gens[0].call("sub_version", timeout=30) == 2
            assert all(gens[0].call("sub_check", TRAIN, 2).values())


async def test_a_push_given_up_while_its_commit_waits_is_never_applied(store_url, uname):
    """The publisher's deadline passes while a reader holds the weights: the late commit must not apply."""
    with generators(store_url, uname, 1) as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens)
            assert (await pub.push(seeded(TRAIN, 1), 1)).ok
            gens[0].call("sub_hold", None)
            report = await pub.push(seeded(TRAIN, 2), 2, timeout=1.0)
            err = report.results[gens[0].name].error
            assert isinstance(err, rl_sync.CommitTimeoutError) and err.phase == "commit" == rl_sync.SyncPhase.COMMIT
            assert isinstance(err, transport.TransportTimeoutError)  # (what code written before it catches)
            # the publisher's Abort is best-effort and may reach the subscriber after the reader left (then the
            # commit that was told may still apply: README, "Atomic versions"); this case is the Abort first
            for _ in range(100):
                if not gens[0].call("sub_pushing"):
                    break
                await asyncio.sleep(0.05)
            assert not gens[0].call("sub_pushing"), "the Abort did not reach the subscriber within 5 s"
            gens[0].call("sub_release", timeout=30)
            await asyncio.sleep(0.5)  # the reader has left; an aborted commit must still not apply
            assert gens[0].call("sub_version") == 1
            assert all(gens[0].call("sub_check", TRAIN, 1).values())
            assert (await pub.push(seeded(TRAIN, 3), 3)).ok
            assert all(gens[0].call("sub_check", TRAIN, 3).values())


async def test_swap_mode_repoints_in_place_and_keeps_the_old_version_on_failure(store_url, uname):
    with generators(store_url, uname, 3, mode="swap") as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens, fanout="chain")  # relays read the bank their source fills
            for v in (1, 2, 3):
                report = await pub.push(seeded(TRAIN, v), v)
                assert report.ok, report.summary()
                for g in gens:
                    assert all(g.call("sub_check", TRAIN, v).values())
            gens[2].signal(signal.SIGSTOP)
            report = await pub.push(seeded(TRAIN, 4), 4, timeout=2.0)
            gens[2].signal(signal.SIGCONT)
            assert not report.results[gens[2].name].ok
            await asyncio.sleep(0.3)
            assert gens[2].call("sub_version") == 3 and all(gens[2].call("sub_check", TRAIN, 3).values())
            assert (await pub.push(seeded(TRAIN, 5), 5)).ok
            for g in gens:
                assert all(g.call("sub_check", TRAIN, 5).values())


async def test_swap_mode_keeps_module_parameters_usable(store_url, uname):
    """In one process: a module's own Parameter objects are re-pointed; forward and backward still work."""
    torch.manual_seed(0)
    src, dst = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    weight = dst.weight
    async with trainer(store_url, uname) as ep, transport.Endpoint(uname("gen"), store=store_url) as gep:
        sub = rl_sync.WeightSubscriber(gep, dst, mode="swap")
        pub = rl_sync.WeightPublisher(ep, [gep.name])
        for v in (1, 2):
            with torch.no_grad():
                src.weight.add_(1.0)
            assert (await pub.push(src, v)).ok
            async with sub.hold() as held:
                assert held == v and dst.weight is weight and torch.equal(dst.weight, src.weight)
                assert torch.equal(dst.bias, src.bias)
        dst(torch.ones(2, 8)).sum().backward()
        assert dst.weight.grad is not None and dst.weight.grad.shape == (4, 8)
        with pytest.raises(ValueError, match="CPU or CUDA tensors"):
            rl_sync.WeightSubscriber(gep, {"m": torch.empty(3, device="meta")}, mode="swap")
        with pytest.raises(ValueError, match=r"several devices \(cpu: \['a'\]; meta: \['m'\]\)"):
            rl_sync.WeightSubscriber(gep, {"a": torch.empty(3), "m": torch.empty(3, device="meta")})
        with pytest.raises(ValueError, match="mode must be one of"):
            rl_sync.WeightSubscriber(gep, dst, mode="inplace")


async def test_direct_mode_writes_the_live_weights_and_a_failed_push_tears_them(store_url, uname):
    """Direct mode: one copy of the weights. A push cancelled after its first bytes landed leaves
    the weights torn: hold() waits (here: times out) until the next push commits."""
    spec = {"w": ("float32", (8 << 20,)), "b": ("float32", (7,))}  # 32 MiB in 1 MiB buckets: a push takes a while
    with generators(store_url, uname, 1, spec=spec, mode="direct", commit_timeout=5.0) as gens:
        g = gens[0]
        async with trainer(store_url, uname) as ep:
            pub = rl_sync.WeightPublisher(ep, [g.name], bucket_bytes=1 << 20)
            assert (await pub.push(seeded(spec, 1), 1)).ok
            assert all(g.call("sub_check", spec, 1).values()) and not g.call("sub_torn")
            torn_at = None
            for v in range(2, 8):  # cancel each push as soon as bytes landed; a push that wins the race commits
                push = asyncio.ensure_future(pub.push(seeded(spec, v), v))
                while not push.done() and not g.call("sub_torn"):
                    await asyncio.sleep(0.002)
                push.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await push
                await asyncio.sleep(0.2)
                if g.call("sub_torn"):
                    torn_at = v
                    break
                assert g.call("sub_version") == v and all(g.call("sub_check", spec, v).values())
            assert torn_at is not None, "no push was ever caught between its first byte and its commit"
            assert g.call("sub_version") == torn_at - 1, "a cancelled push must not commit"
            assert g.call("sub_try_hold", 0.5) == "timeout", "hold() must not hand out torn weights"
            report = await pub.push(seeded(spec, 10), 10)
            assert report.ok, report.summary()
            assert not g.call("sub_torn")
            assert g.call("sub_try_hold", 2.0) == 10
            assert all(g.call("sub_check", spec, 10).values())


async def test_direct_mode_makes_its_arenas_at_the_first_push_one_at_a_time(store_url, uname):
    """Direct mode holds the weights once: no arena exists before the first push, which makes them
    one at a time as the weights move in (several arenas here), and a chain of direct subscribers
    relays from arenas registered at that push."""
    with generators(store_url, uname, 2, mode="direct", arena_bytes=16 << 10) as gens:
        assert not [n for n in gens[0].call("peer_specs_local") if n.startswith("rl_sync/arena/")]
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens, fanout="chain")
            for version in (1, 2):
                report = await pub.push(seeded(TRAIN, version * 10), version)
                assert report.ok, report.summary()
                for g in gens:
                    assert all(g.call("sub_check", TRAIN, version * 10).values())
            arenas = sorted(n for n in gens[0].call("peer_specs_local") if n.startswith("rl_sync/arena/"))
            assert len(arenas) >= 3 and all(n.startswith("rl_sync/arena/0/") for n in arenas), arenas
            assert {r.source for r in report.results.values()} == {ep.name, gens[0].name}


async def test_direct_mode_gives_up_a_push_that_stops_and_lets_readers_back(store_url, uname):
    """A publisher that vanishes mid-push (no Abort, no Commit) must not lock the readers out forever."""
    spec = {"w": torch.zeros(4096)}
    async with trainer(store_url, uname) as ep, transport.Endpoint(uname("gen"), store=store_url) as gep:
        sub = rl_sync.WeightSubscriber(gep, spec, mode="direct", commit_timeout=0.5)
        src = torch.full((sub.nbytes,), 7, dtype=torch.uint8)
        ep.register("src", src)
        buckets, digest = sub.plan(1 << 20)
        await ep.notify(gep.name, rl_sync.messages.encode(rl_sync.messages.Begin(1, 1, digest, 1 << 20)))
        deadline = time.monotonic() + 5
        while sub._push is None or not sub._push.locked:  # Begin took the writer lock
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        with pytest.raises(transport.TransportTimeoutError):
            async with sub.hold(timeout=0.1):
                pass
        await ep.notify(gep.name, rl_sync.messages.encode(rl_sync.messages.Pull(1, 0, ep.name, "src", 0)))
        while not sub.torn:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        # ... and then nothing: after commit_timeout without progress the subscriber gives the push up
        while sub._push is not None:
            assert time.monotonic() < deadline, "the stalled direct push was never given up"
            await asyncio.sleep(0.05)
        assert sub.version == 0 and sub.torn
        with pytest.raises(transport.TransportTimeoutError, match="torn"):
            async with sub.hold(timeout=0.2):
                pass
        assert bytes(spec["w"].view(torch.uint8)[:8].tolist()) == b"\x07" * 8, "the pull wrote the live tensor"
        pub = rl_sync.WeightPublisher(ep, [gep.name])
        want = torch.arange(4096, dtype=torch.float32)
        report = await pub.push({"w": want}, 2)
        assert report.ok, report.summary()
        async with sub.hold(timeout=2.0) as v:
            assert v == 2 and torch.equal(spec["w"], want) and not sub.torn


async def test_direct_mode_abort_or_close_while_begin_waits_never_keeps_the_lock(store_url, uname):
    """A Begin waiting for readers is aborted: it must not take the lock afterwards. close() while
    the first push moves the weights into the arena must give the lock back."""
    msgs = rl_sync.messages
    async with trainer(store_url, uname) as ep, transport.Endpoint(uname("gen"), store=store_url) as gep:
        sub = rl_sync.WeightSubscriber(gep, {"w": torch.zeros(4096)}, mode="direct", commit_timeout=5.0)
        _, digest = sub.plan(1 << 20)
        reader_in, reader_out = asyncio.Event(), asyncio.Event()

        async def reader() -> None:
            async with sub.hold():
                reader_in.set()
                await reader_out.wait()

        task = asyncio.ensure_future(reader())
        await asyncio.wait_for(reader_in.wait(), 5)
        await ep.notify(gep.name, msgs.encode(msgs.Begin(1, 1, digest, 1 << 20)))
        deadline = time.monotonic() + 5
        while not sub._starting:  # the Begin waits for the reader
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await ep.notify(gep.name, msgs.encode(msgs.Abort(1, "the publisher gave up")))
        reader_out.set()
        await asyncio.wait_for(task, 5)
        await asyncio.sleep(0.2)
        async with sub.hold(timeout=1.0) as v:  # the aborted Begin let go of the lock at once
            assert v == 0 and sub._push is None

        real_adopt = sub._strategy._adopt_arena  # (rl_sync.modes.direct.DirectMode)

        def slow_adopt(*args) -> None:  # the first push's one-time move of the weights (a copy batch), made slow
            time.sleep(0.5)
            real_adopt(*args)

        sub._strategy._adopt_arena = slow_adopt
        await ep.notify(gep.name, msgs.encode(msgs.Begin(2, 1, digest, 1 << 20)))
        deadline = time.monotonic() + 5
        while not sub._lock._writer:  # the lock is taken: the weights are moving
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        sub.close()
        async with sub.hold(timeout=2.0):  # close() gave the lock back, once the copies it could not stop ended
            pass


@pytest.mark.parametrize("mode", ["staged", "swap", "direct", "shared"])
async def test_a_begin_whose_plan_hash_differs_is_refused_and_nothing_moves(store_url, uname, mode):
    """README: "both sides check a hash of the plan at every push". A publisher (here a raw
    endpoint) whose Begin carries another plan's hash is answered with a "plan" refusal; the
    Pull and Commit it sends after that change nothing: the version stays, the weights stay
    byte for byte. A real push then goes through."""
    msgs = rl_sync.messages
    w0 = torch.arange(4096, dtype=torch.float32)
    spec = {"w": w0.clone()}
    async with trainer(store_url, uname) as ep, transport.Endpoint(uname("gen"), store=store_url) as gep:
        sub = rl_sync.WeightSubscriber(gep, spec, mode=mode, commit_timeout=2.0)
        _, digest = sub.plan(1 << 20)
        ep.register("src", torch.full((sub.nbytes,), 7, dtype=torch.uint8))
        wrong = ("0" if digest[0] != "0" else "1") + digest[1:]
        await ep.notify(gep.name, msgs.encode(msgs.Begin(1, 1, wrong, 1 << 20)))
        reply = msgs.decode((await ep.next_notification(timeout=5)).payload)
        assert isinstance(reply, msgs.Reply) and reply.stage == "begin" and reply.error_kind == "plan", reply
        assert "plan hash" in (reply.error or "")
        await ep.notify(gep.name, msgs.encode(msgs.Pull(1, 0, ep.name, "src", 0)))
        await ep.notify(gep.name, msgs.encode(msgs.Commit(1, 1)))
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError, transport.TransportTimeoutError):
            while True:  # whatever it answers (or not) within half a second
                msgs.decode((await ep.next_notification(timeout=0.5)).payload)
        async with sub.hold(timeout=2.0) as v:
            assert v == 0 and same_bytes(spec["w"], w0) and not sub.torn
        pub = rl_sync.WeightPublisher(ep, [gep.name])
        want = torch.full((4096,), 3.0)
        report = await pub.push({"w": want}, 2)
        assert report.ok, report.summary()
        async with sub.hold(timeout=2.0) as v:
            assert v == 2 and torch.equal(spec["w"], want)
        sub.close()


async def test_a_begin_during_a_staged_commits_copy_leaves_that_commit_answered_as_committed(store_url, uname):
    """Publisher 1's push is committing (the staged copy into the live weights runs, held for
    0.5 s) when publisher 2's Begin comes. The copy is uncancellable and commits: publisher 1 is
    answered "committed" and never "dropped" (before, it was told "dropped" first and failed that
    entry although the subscriber then held its version)."""
    msgs = rl_sync.messages
    spec = {"w": torch.zeros(4096)}
    async with trainer(store_url, uname) as ep, trainer(store_url, uname) as ep2, \
            transport.Endpoint(uname("gen"), store=store_url) as gep:
        sub = rl_sync.WeightSubscriber(gep, spec, mode="staged", commit_timeout=5.0)
        buckets, digest = sub.plan(1 << 20)
        assert len(buckets) == 1
        ep.register("src", torch.full((sub.nbytes,), 7, dtype=torch.uint8))
        real_apply, copying = sub._strategy._apply, threading.Event()

        def slow_apply(bank: int) -> None:  # (the copier thread)
            copying.set()
            time.sleep(0.5)
            real_apply(bank)

        sub._strategy._apply = slow_apply

        async def answer(on: transport.Endpoint) -> rl_sync.messages.Reply:
            return msgs.decode((await on.next_notification(timeout=5)).payload)

        await ep.notify(gep.name, msgs.encode(msgs.Begin(1, 1, digest, 1 << 20)))
        assert (await answer(ep)).stage == "begin"
        await ep.notify(gep.name, msgs.encode(msgs.Pull(1, 0, ep.name, "src", 0)))
        pulled = await answer(ep)
        assert pulled.stage == "pull" and pulled.error is None, pulled
        await ep.notify(gep.name, msgs.encode(msgs.Commit(1, 1)))
        assert await asyncio.to_thread(copying.wait, 5)
        await ep2.notify(gep.name, msgs.encode(msgs.Begin(1, 2, digest, 1 << 20)))  # publisher 2, mid-copy
        first = await answer(ep)
        assert first.stage == "commit" and first.error is None, first
        assert sub.version == 1 and bool((spec["w"].view(torch.uint8) == 7).all())
        assert (await answer(ep2)).stage == "begin"  # (publisher 2's push goes on)
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError, transport.TransportTimeoutError):
            late = msgs.decode((await ep.next_notification(timeout=0.5)).payload)
            raise AssertionError(f"publisher 1 was answered again: {late}")
        sub.close()


@contextlib.asynccontextmanager
async def _one_subscriber(store_url, uname, mode: str, commit_timeout: float):
    """Two trainer endpoints and a generator's endpoint whose subscriber (``mode``) holds one tensor
    of 4096 floats, 0..4095; the first trainer registers "src" for the Pulls the test sends by hand.
    Yields (ep, ep2, gep, sub, digest, w0, spec): ``w0`` the initial weights, ``spec`` the live ones."""
    w0 = torch.arange(4096, dtype=torch.float32)
    spec = {"w": w0.clone()}
    async with trainer(store_url, uname) as ep, trainer(store_url, uname) as ep2, \
            transport.Endpoint(uname("gen"), store=store_url) as gep:
        sub = rl_sync.WeightSubscriber(gep, spec, mode=mode, commit_timeout=commit_timeout)
        _, digest = sub.plan(1 << 20)
        ep.register("src", torch.full((sub.nbytes,), 7, dtype=torch.uint8))
        yield ep, ep2, gep, sub, digest, w0, spec


async def test_a_swap_commit_superseded_while_it_waits_for_readers_moves_nothing(store_url, uname):
    """swap's first commit waits for the GPU work readers queued (here a stand-in wait of 0.5 s:
    this machine has no GPU). A Begin of another publisher's push supersedes it meanwhile: its
    publisher is told "dropped", and the commit, once the wait ends, re-points nothing (before, it
    re-pointed the weights and set the version of the push its publisher had been told was dropped)."""
    msgs = rl_sync.messages
    async with _one_subscriber(store_url, uname, "swap", 5.0) as (ep, ep2, gep, sub, digest, w0, spec):
        waiting = asyncio.Event()

        async def reads_queued(timeout: float, abandoned=None) -> bool:  # (ReaderMarks.wait, GPU work pending)
            waiting.set()
            await asyncio.sleep(0.5)
            return True

        async def answer(on: transport.Endpoint) -> rl_sync.messages.Reply:
            return msgs.decode((await on.next_notification(timeout=5)).payload)

        await ep.notify(gep.name, msgs.encode(msgs.Begin(1, 1, digest, 1 << 20)))
        assert (await answer(ep)).stage == "begin"
        await ep.notify(gep.name, msgs.encode(msgs.Pull(1, 0, ep.name, "src", 0)))
        assert (await answer(ep)).error is None
        sub._readers.wait = reads_queued
        await ep.notify(gep.name, msgs.encode(msgs.Commit(1, 1)))
        await asyncio.wait_for(waiting.wait(), 5)
        await ep2.notify(gep.name, msgs.encode(msgs.Begin(1, 2, digest, 1 << 20)))
        dropped = await answer(ep)
        assert dropped.stage == "dropped", dropped
        await asyncio.sleep(1.0)  # the commit's wait is over
        assert sub.version == 0 and same_bytes(spec["w"], w0)
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError, transport.TransportTimeoutError):
            late = msgs.decode((await ep.next_notification(timeout=0.3)).payload)
            assert late.stage != "commit" or late.error is not None, f"the dropped push committed: {late}"
        sub.close()


async def test_a_swap_begin_superseded_while_it_waits_for_readers_leaves_the_newer_push_current(store_url, uname):
    """swap's Begin waits for the GPU work readers queued (a stand-in wait: no GPU here), 0.6 s for the
    first Begin, 0.1 s for a second publisher's Begin that supersedes it meanwhile. The second push is
    begun and stays the current one: its pulls are served and its bank's stamp stays the one it was
    given (before, the first Begin, once its wait ended, re-stamped the bank, made itself current
    again, answered its publisher "begin" after "dropped", and the second push's pulls were refused)."""
    msgs = rl_sync.messages
    async with trainer(store_url, uname) as ep_a, trainer(store_url, uname) as ep_b, \
            transport.Endpoint(uname("gen"), store=store_url) as gep:
        sub = rl_sync.WeightSubscriber(gep, {"w": torch.zeros(4096)}, mode="swap", commit_timeout=10.0)
        _, digest = sub.plan(1 << 20)
        ep_b.register("src", torch.full((sub.nbytes,), 7, dtype=torch.uint8))
        waits: list[float] = [0.6, 0.1]

        async def reads_queued(timeout: float, abandoned=None) -> bool:  # (ReaderMarks.wait, GPU work pending)
            await asyncio.sleep(waits.pop(0) if waits else 0.0)
            return True

        async def answer(on: transport.Endpoint, timeout: float = 5) -> rl_sync.messages.Reply:
            return msgs.decode((await on.next_notification(timeout=timeout)).payload)

        sub._readers.wait = reads_queued
        await ep_a.notify(gep.name, msgs.encode(msgs.Begin(1, 1, digest, 1 << 20)))
        await asyncio.sleep(0.1)
        await ep_b.notify(gep.name, msgs.encode(msgs.Begin(7, 1, digest, 1 << 20)))
        assert (await answer(ep_a)).stage == "dropped"
        begun = await answer(ep_b)
        assert begun.stage == "begin" and begun.error is None, begun
        await asyncio.sleep(1.0)  # the first Begin's wait is over
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError, transport.TransportTimeoutError):
            late = await answer(ep_a, 0.3)
            raise AssertionError(f"the dropped push was answered again: {late}")
        assert int(sub._stamps.tensor[begun.bank]) == begun.stamp, "the bank was re-stamped by the dropped push"
        await ep_b.notify(gep.name, msgs.encode(msgs.Pull(7, 0, ep_b.name, "src", 0)))
        pulled = await answer(ep_b)
        assert pulled.stage == "pull" and pulled.error is None, pulled
        sub.close()


class _ReadsRunning:
    """Stands in for the CUDA event a reader recorded as it left hold() on a GPU (this machine has
    none): not done until ``finish()``; counts the polls of it."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.polls = 0

    def query(self) -> bool:
        self.polls += 1
        return self.finished.is_set()


@pytest.mark.parametrize("how", ["superseded", "closed"])
async def test_a_staged_commit_dropped_while_it_waits_for_readers_gpu_work_stops_waiting(store_url, uname, how):
    """A staged commit, holding the writer lock, waits for the GPU work readers queued in hold()
    (a reader's kernel still running: the stand-in event above). A Begin of another publisher's
    push supersedes it meanwhile, or the subscriber is closed: the wait ends at once (before, it
    went on to commit_timeout, 10 s here, keeping new readers out of hold() all that time, and a
    closed subscriber's worker thread polling as long). New readers get in, the publisher is told
    the push was aborted (not that readers held the weights), nothing is copied, and the reads'
    event is no longer polled."""
    msgs = rl_sync.messages
    async with _one_subscriber(store_url, uname, "staged", 10.0) as (ep, ep2, gep, sub, digest, w0, spec):
        reads = _ReadsRunning()

        async def answer(on: transport.Endpoint, timeout: float = 5) -> rl_sync.messages.Reply:
            return msgs.decode((await on.next_notification(timeout=timeout)).payload)

        try:
            await ep.notify(gep.name, msgs.encode(msgs.Begin(1, 1, digest, 1 << 20)))
            assert (await answer(ep)).stage == "begin"
            await ep.notify(gep.name, msgs.encode(msgs.Pull(1, 0, ep.name, "src", 0)))
            assert (await answer(ep)).error is None
            sub._readers._events[(0, 0)] = reads  # a reader left hold() with its kernel still running
            await ep.notify(gep.name, msgs.encode(msgs.Commit(1, 1)))
            deadline = time.monotonic() + 5
            while reads.polls == 0:  # the commit holds the writer lock and waits for that kernel
                assert time.monotonic() < deadline, "the commit never waited for the readers' GPU work"
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            if how == "closed":
                sub.close()
            else:
                await ep2.notify(gep.name, msgs.encode(msgs.Begin(1, 2, digest, 1 << 20)))
                assert (await answer(ep)).stage == "dropped"
                reply = await answer(ep)  # the commit's own answer, once its wait ended
                assert reply.stage == "commit" and "aborted" in (reply.error or ""), reply
                async with sub.hold(timeout=3.0):  # new readers are not kept out behind that commit
                    assert same_bytes(spec["w"], w0) and sub.version == 0
            await asyncio.sleep(0.3)
            polls = reads.polls
            await asyncio.sleep(0.3)
            assert reads.polls == polls, "the dropped commit's wait still polls the readers' GPU work"
            assert time.monotonic() - t0 < 5.0, "the wait went on past the drop"
            assert same_bytes(spec["w"], w0) and sub.version == 0
        finally:
            reads.finished.set()
            sub.close()


async def test_direct_mode_waits_longer_for_the_first_pull(store_url, uname):
    """The publisher sends pulls only once every subscriber has begun (others may wait for their
    readers), so before the first Pull a direct push gets twice commit_timeout."""
    msgs = rl_sync.messages
    async with trainer(store_url, uname) as ep, transport.Endpoint(uname("gen"), store=store_url) as gep:
        sub = rl_sync.WeightSubscriber(gep, {"w": torch.zeros(4096)}, mode="direct", commit_timeout=0.6)
        _, digest = sub.plan(1 << 20)
        await ep.notify(gep.name, msgs.encode(msgs.Begin(1, 1, digest, 1 << 20)))
        deadline = time.monotonic() + 5
        while sub._push is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        t0 = time.monotonic()  # (at most a poll after the Begin: the wait is measured from here)
        while sub._push is not None:
            assert time.monotonic() < deadline, "never given up"
            await asyncio.sleep(0.02)
        took = time.monotonic() - t0  # twice commit_timeout (1.2 s) after the Begin, less this loop's lateness
        assert took >= 0.9, f"given up {took:.2f} s after the Begin: not twice commit_timeout (0.6 s)"
        async with sub.hold(timeout=1.0):
            assert not sub.torn


# ---------------------------------------------------------------------------- failures
@pytest.mark.parametrize("mode", ["staged", "shared"])
async def test_cancelled_push_is_never_committed(store_url, uname, mode):
    with generators(store_url, uname, 3, mode=mode) as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens)
            assert (await pub.push(seeded(TRAIN, 1), 1)).ok
            for g in gens[1:]:  # their pulls (shared: their Begin) stall, so the push is stuck mid-way for them
                g.signal(signal.SIGSTOP)
            push = asyncio.ensure_future(pub.push(seeded(TRAIN, 2), 2))
            end = time.monotonic() + 30  # the healthy one commits while the others are frozen
            while await asyncio.to_thread(gens[0].call, "sub_version") != 2:
                assert time.monotonic() < end, "the healthy subscriber did not commit while the others were frozen"
                await asyncio.sleep(0.05)
            assert not push.done()
            push.cancel()
            with pytest.raises(asyncio.CancelledError):
                await push
            for g in gens[1:]:
                g.signal(signal.SIGCONT)
            await asyncio.sleep(0.5)
            # the healthy one did not wait for the frozen ones: it committed before the cancellation
            assert gens[0].call("sub_version") == 2
            assert all(gens[0].call("sub_check", TRAIN, 2).values())
            for g in gens[1:]:
                assert g.call("sub_version") == 1
                assert all(g.call("sub_check", TRAIN, 1).values()), "the previous version must stay intact"
            report = await pub.push(seeded(TRAIN, 3), 3)
            assert report.ok, report.summary()
            for g in gens:
                assert all(g.call("sub_check", TRAIN, 3).values())


async def test_dead_subscriber_fails_only_its_entry_and_a_restart_gets_everything(store_url, uname):
    with generators(store_url, uname, 2) as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens, connect_timeout=2.0)
            assert (await pub.push(seeded(TRAIN, 1), 1)).ok
            # killed in the middle of a push (frozen first so the push is certainly mid-way)
            gens[1].signal(signal.SIGSTOP)
            push = asyncio.ensure_future(pub.push(seeded(TRAIN, 2), 2, timeout=60))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            gens[1].kill()
            report = await asyncio.wait_for(push, 30)
            assert time.monotonic() - t0 < 5.0, "a dead subscriber must be given up on within seconds"
            assert report.results[gens[0].name].ok
            assert isinstance(report.results[gens[1].name].error, transport.PeerLostError)
            assert not report.ok
            assert all(gens[0].call("sub_check", TRAIN, 2).values())
            # dead before the push: fails its entry after a short probe (it was lost last time), the other commits
            weights = seeded(TRAIN, 3)  # (made before the clock starts: making them takes a while)
            t0 = time.monotonic()
            report = await pub.push(weights, 3, timeout=3)
            assert time.monotonic() - t0 < 1.5 and report.results[gens[0].name].ok
            assert isinstance(report.results[gens[1].name].error, (transport.PeerNotFoundError,
                                                                   transport.TransportTimeoutError))
            # restarted under the same name: the next push gives it the full weights
            reborn = RemoteEndpoint(gens[1].name, store=store_url, timeout=20)
            try:
                reborn.call("sub_create", GEN, {})
                report = await pub.push(seeded(TRAIN, 4), 4)
                assert report.ok, report.summary()
                assert all(reborn.call("sub_check", TRAIN, 4).values())
                assert reborn.call("sub_version") == 4
            finally:
                reborn.kill()


async def test_frozen_subscriber_times_out_and_spares_the_rest(store_url, uname):
    with generators(store_url, uname, 2) as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens)
            assert (await pub.push(seeded(TRAIN, 1), 1)).ok
            gens[1].signal(signal.SIGSTOP)
            weights = seeded(TRAIN, 2)  # (made before the clock starts: making them takes a while)
            t0 = time.monotonic()
            report = await pub.push(weights, 2, timeout=4.0)  # roomy: the healthy one must finish
            took = time.monotonic() - t0
            gens[1].signal(signal.SIGCONT)
            assert 3.5 < took < 9, took
            assert report.results[gens[0].name].ok
            assert isinstance(report.results[gens[1].name].error, transport.TransportTimeoutError)
            await asyncio.sleep(0.3)
            assert gens[1].call("sub_version") == 1
            assert all(gens[1].call("sub_check", TRAIN, 1).values())


async def test_late_joiner_and_leaver(store_url, uname):
    with generators(store_url, uname, 2) as gens:
        async with trainer(store_url, uname) as ep:
            pub = rl_sync.WeightPublisher(ep, [gens[0].name], dtype="auto", bucket_bytes=BUCKET)
            assert (await pub.push(seeded(TRAIN, 1), 1)).ok
            pub.add_subscriber(gens[1].name)
            report = await pub.push(seeded(TRAIN, 2), 2)
            assert report.ok and set(report.results) == {g.name for g in gens}
            assert all(gens[1].call("sub_check", TRAIN, 2).values())
            pub.remove_subscriber(gens[0].name)
            report = await pub.push(seeded(TRAIN, 3), 3)
            assert set(report.results) == {gens[1].name}
            assert gens[0].call("sub_version") == 2


# ---------------------------------------------------------------------------- fan-out
async def test_relay_chain_delivers_and_survives_a_dead_relay(store_url, uname):
    with generators(store_url, uname, 3) as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens, fanout="chain")
            report = await pub.push(seeded(TRAIN, 1), 1)
            assert report.ok, report.summary()
            names = sorted(g.name for g in gens)
            assert [report.results[n].source for n in names] == [ep.name, names[0], names[1]]
            for g in gens:
                assert all(g.call("sub_check", TRAIN, 1).values())
            # the middle of the chain dies mid-push: the last one gets its buckets from the publisher
            middle = next(g for g in gens if g.name == names[1])
            middle.signal(signal.SIGSTOP)
            push = asyncio.ensure_future(pub.push(seeded(TRAIN, 2), 2, timeout=60))
            await asyncio.sleep(0.5)
            middle.kill()
            report = await asyncio.wait_for(push, 30)
            assert report.results[names[0]].ok and report.results[names[2]].ok, report.summary()
            assert isinstance(report.results[names[1]].error, transport.PeerLostError)
            for g in gens:
                if g is not middle:
                    assert all(g.call("sub_check", TRAIN, 2).values())


def test_blocking_subscriber(store_url, uname):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    name = uname("bgen")
    proc = ctx.Process(target=blocking_generator, args=(name, store_url, TRAIN, 7, out), daemon=True)
    proc.start()
    try:
        assert out.get(timeout=60) == ("ready", 0)

        async def push() -> rl_sync.PushReport:
            async with trainer(store_url, uname) as ep:
                report = await rl_sync.WeightPublisher(ep, [name], bucket_bytes=BUCKET).push(seeded(TRAIN, 7), 1)
                await ep.notify(name, b"stop")
                return report

        report = asyncio.run(push())
        assert report.ok, report.summary()
        assert out.get(timeout=30) == ("done", 1, 1, True)
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


# ---------------------------------------------------------------------------- shared mode
def _bank_of(backing, perms="r--s"):
    """The publisher bank every live tensor of one subscriber lies in (asserting it is one bank,
    mapped read-only: over shm; cuda_ipc maps it read-write, ``perms="rw-s"``)."""
    files = {f for f, _ in backing.values()}
    have = {p for _, p in backing.values()}
    assert len(files) == 1 and "rl_sync/pub/" in next(iter(files)), backing
    assert have == {perms}, f"a shared subscriber's weights must be a {perms} mapping of the bank: {backing}"
    return next(iter(files)).split("/bank")[1].split("/")[0]


async def test_shared_mode_subscribers_read_one_packed_copy(store_url, uname):
    """Three local subscribers in shared mode: their weights are the publisher's bank, mapped
    read-only; they register no arenas; every byte is the trainer's cast; banks alternate."""
    with generators(store_url, uname, 3, mode="shared") as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens)
            for g in gens:
                assert g.call("sub_buffers") == ["rl_sync/manifest"], "shared mode registers no arenas"
            banks = []
            for v in (1, 2, 3):
                report = await pub.push(seeded(TRAIN, v), v)
                assert report.ok, report.summary()
                assert report.packed_bytes == sum(report.results[gens[0].name].bytes for _ in (0,)), \
                    "the trainer packs each byte once, whatever the number of subscribers"
                held = set()
                for g in gens:
                    assert all(g.call("sub_check", TRAIN, v).values())
                    held.add(_bank_of(g.call("sub_backing")))
                assert len(held) == 1, f"all subscribers read one bank: {held}"
                banks.append(held.pop())
            assert banks[0] != banks[1] and banks[1] != banks[2], f"a push writes the bank nobody reads: {banks}"
            pub.close()


async def test_shared_mode_next_to_copying_modes_in_one_layout(store_url, uname):
    """Subscribers of one layout in shared, staged and swap mode: one pack into the bank, the
    copying ones pull from it."""
    gens = [RemoteEndpoint(uname(f"gen{i}"), store=store_url, timeout=20) for i in range(3)]
    try:
        for g, mode in zip(gens, ("shared", "staged", "swap"), strict=True):
            g.call("sub_create", GEN, {"mode": mode})
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens)
            for v in (1, 2):
                report = await pub.push(seeded(TRAIN, v), v)
                assert report.ok, report.summary()
                assert report.packed_bytes == report.results[gens[0].name].bytes
                for g in gens:
                    assert all(g.call("sub_check", TRAIN, v).values())
            _bank_of(gens[0].call("sub_backing"))
    finally:
        for g in gens:
            g.kill()


async def test_shared_mode_stuck_subscriber_keeps_its_bank_and_others_go_on(store_url, uname, caplog):
    """One subscriber keeps readers in hold() past its commit timeout: its weights stay on their
    version (the bank is never rewritten under it), the others take every push (a bank is added
    while all are held, and dropped once it is let go), and it catches up afterwards."""
    with generators(store_url, uname, 3, mode="shared", commit_timeout=0.5) as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens)
            assert (await pub.push(seeded(TRAIN, 1), 1)).ok
            stuck, rest = gens[0], gens[1:]
            stuck_bank = _bank_of(stuck.call("sub_backing"))
            stuck.call("sub_hold", None)  # (until sub_release: however slow the pushes below are)
            for v in (2, 3, 4, 5):
                report = await pub.push(seeded(TRAIN, v), v, timeout=3.0)
                assert all(report.results[g.name].ok for g in rest), report.summary()
                assert isinstance(report.results[stuck.name].error, transport.TransportTimeoutError)
                for g in rest:
                    assert all(g.call("sub_check", TRAIN, v).values())
                    assert _bank_of(g.call("sub_backing")) != stuck_bank
            assert re.search(r"bank \d+ added", caplog.text), caplog.text
            stuck.call("sub_release", timeout=30)
            assert stuck.call("sub_version", timeout=30) == 1
            assert all(stuck.call("sub_check", TRAIN, 1).values()), "the stuck subscriber's bank was rewritten"
            for v in (6, 7, 8):
                report = await pub.push(seeded(TRAIN, v), v)
                assert report.ok, report.summary()
                for g in gens:
                    assert all(g.call("sub_check", TRAIN, v).values())
            assert len(pub._bank_sets[next(iter(pub._bank_sets))]) == 2, "the extra bank is dropped once let go"


async def test_shared_mode_dead_subscriber_lets_go_of_its_bank(store_url, uname):
    """A killed shared subscriber fails its own entry only; its lock dies with it (no bank added),
    and a restarted one maps the current bank at the next push. Writing into the weights kills
    only the writer: the others' weights are untouched."""
    with generators(store_url, uname, 2, mode="shared") as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens, connect_timeout=2.0)
            assert (await pub.push(seeded(TRAIN, 1), 1)).ok
            with pytest.raises(Exception):  # noqa: B017 - the child dies of SIGSEGV: no reply comes
                gens[1].call("sub_write", "embed.weight", timeout=10)
            gens[1].proc.join(10)
            assert gens[1].proc.exitcode == -signal.SIGSEGV
            assert all(gens[0].call("sub_check", TRAIN, 1).values())
            for v in (2, 3, 4):
                report = await pub.push(seeded(TRAIN, v), v, timeout=5)
                assert report.results[gens[0].name].ok, report.summary()
                assert not report.results[gens[1].name].ok
                assert all(gens[0].call("sub_check", TRAIN, v).values())
            assert len(pub._bank_sets[next(iter(pub._bank_sets))]) == 2, "a dead subscriber pins no bank"
            reborn = RemoteEndpoint(gens[1].name, store=store_url, timeout=20)
            try:
                reborn.call("sub_create", GEN, {"mode": "shared"})
                report = await pub.push(seeded(TRAIN, 5), 5)
                assert report.ok, report.summary()
                assert all(reborn.call("sub_check", TRAIN, 5).values())
            finally:
                reborn.kill()


async def test_shared_mode_over_cuda_ipc_maps_the_bank_and_a_stuck_or_dead_subscriber_holds_up_only_itself(
        store_url, uname, caplog):
    """Shared mode through the cuda_ipc plane (its CPU stand-in engine on every side: the banks'
    exports are memfd segments, as a GPU bank's are CUDA IPC handles), the path GPU banks take.
    Each subscriber maps the bank over cuda_ipc and the report says so; a stuck one keeps its bank
    (one is added) and catches up later; a killed one pins nothing. CUDA maps peer memory
    read-write: a write through one subscriber's weights reaches the bank, so every subscriber
    reading that bank sees it, until the next push re-points them into a freshly written bank."""
    with generators(store_url, uname, 3, mode="shared", commit_timeout=0.5, ipc_engine=MemfdIpcEngine) as gens:
        async with trainer(store_url, uname, engines={"cuda_ipc": MemfdIpcEngine}) as ep:
            pub = cast_pub(ep, gens, connect_timeout=2.0)
            report = await pub.push(seeded(TRAIN, 1), 1)
            assert report.ok, report.summary()
            for g in gens:
                r = report.results[g.name]
                assert r.plane == "shared" and "mapped over cuda_ipc" in r.plane_reason, r
                assert g.call("sub_buffers") == ["rl_sync/manifest"]
                assert all(g.call("sub_check", TRAIN, 1).values())
            bank = {_bank_of(g.call("sub_backing"), perms="rw-s") for g in gens}
            assert len(bank) == 1, bank
            # the mapping is writable: one subscriber's write shows in the others' weights (same bank)
            assert gens[2].call("sub_write", "embed.weight") == "written"
            assert not gens[0].call("sub_check", TRAIN, 1)["embed.weight"], "the write did not reach the bank"
            stuck, rest = gens[0], gens[1:]
            stuck_bank = _bank_of(stuck.call("sub_backing"), perms="rw-s")
            stuck.call("sub_hold", None)  # (until sub_release: however slow the pushes below are)
            for v in (2, 3, 4):
                report = await pub.push(seeded(TRAIN, v), v, timeout=3.0)
                assert all(report.results[g.name].ok for g in rest), report.summary()
                assert isinstance(report.results[stuck.name].error, transport.TransportTimeoutError)
                for g in rest:
                    assert all(g.call("sub_check", TRAIN, v).values()), "the next push heals the written bank"
                    assert _bank_of(g.call("sub_backing"), perms="rw-s") != stuck_bank
            assert re.search(r"bank \d+ added", caplog.text), caplog.text
            stuck.call("sub_release", timeout=30)
            assert stuck.call("sub_version", timeout=30) == 1, "the stuck subscriber's bank was rewritten"
            gens[2].kill()
            for v in (5, 6, 7):
                report = await pub.push(seeded(TRAIN, v), v, timeout=5)
                assert all(report.results[g.name].ok for g in gens[:2]), report.summary()
                assert not report.results[gens[2].name].ok
                for g in gens[:2]:
                    assert all(g.call("sub_check", TRAIN, v).values())
            assert len(pub._bank_sets[next(iter(pub._bank_sets))]) == 2, "the extra bank is dropped once let go"


async def test_shared_mode_needs_the_publisher_on_its_host(store_url, uname):
    """Over tcp (shm not allowed) a shared subscriber cannot map the banks: its entry fails with a
    reason that says so; a staged subscriber in the same push is served."""
    gens = [RemoteEndpoint(uname(f"gen{i}"), store=store_url, timeout=20, planes=("tcp",)) for i in range(2)]
    try:
        gens[0].call("sub_create", GEN, {"mode": "shared"})
        gens[1].call("sub_create", GEN, {})
        async with trainer(store_url, uname, planes=("tcp",)) as ep:
            pub = cast_pub(ep, gens)
            report = await pub.push(seeded(TRAIN, 1), 1)
            err = report.results[gens[0].name].error
            assert isinstance(err, rl_sync.RlSyncError) and "its channel runs tcp, not shm" in str(err), err
            assert report.results[gens[1].name].ok
            assert gens[0].call("sub_version") == 0
            with pytest.raises(transport.PlaneUnavailableError, match="shm"):
                await ep.map(gens[1].name, "rl_sync/manifest")
    finally:
        for g in gens:
            g.kill()


async def test_shared_mode_close_keeps_the_weights_and_lets_go_of_the_bank(store_url, uname):
    """Closing a shared subscriber copies its weights out of the bank: it keeps its version, its
    weights become writable, and the publisher may rewrite that bank (no bank is added)."""
    with generators(store_url, uname, 2, mode="shared") as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens)
            assert (await pub.push(seeded(TRAIN, 1), 1)).ok
            gens[1].call("sub_close")
            pub.remove_subscriber(gens[1].name)
            for v in (2, 3, 4):
                assert (await pub.push(seeded(TRAIN, v), v)).ok
            assert len(pub._bank_sets[next(iter(pub._bank_sets))]) == 2
            assert all(gens[1].call("sub_check", TRAIN, 1).values())
            assert all(p == "rw-p" for _, p in gens[1].call("sub_backing").values())
            assert gens[1].call("sub_write", "embed.weight") == "written"
            assert all(gens[0].call("sub_check", TRAIN, 4).values())


async def test_shared_mode_close_waits_for_readers_before_letting_go_of_the_bank(store_url, uname):
    """Closed while a reader holds views of the weights: the bank stays locked (the publisher adds
    one meanwhile) until the reader leaves, so its views never change inside hold()."""
    with generators(store_url, uname, 2, mode="shared") as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens)
            assert (await pub.push(seeded(TRAIN, 1), 1)).ok
            gens[1].call("sub_hold_views", 3.0)
            gens[1].call("sub_close")
            assert gens[1].call("sub_try_hold", 1.0) == 1, "a hold after close must not wait for the leave"
            pub.remove_subscriber(gens[1].name)
            for v in (2, 3, 4):
                assert (await pub.push(seeded(TRAIN, v), v)).ok
            assert gens[1].call("sub_hold_views_result", timeout=30), "a reader's views changed inside hold()"
            assert all(gens[1].call("sub_check", TRAIN, 1).values())
            assert all(p == "rw-p" for _, p in gens[1].call("sub_backing").values())
            for v in (5, 6):
                assert (await pub.push(seeded(TRAIN, v), v)).ok
            assert len(pub._bank_sets[next(iter(pub._bank_sets))]) == 2, "the bank is let go once the reader left"


async def test_shared_mode_a_forked_child_does_not_pin_a_bank(store_url, uname):
    """A subscriber forks a child (no exec) that outlives several pushes: the child must not keep
    the subscriber's old bank locked, so no bank is added."""
    with generators(store_url, uname, 1, mode="shared") as gens:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens)
            assert (await pub.push(seeded(TRAIN, 1), 1)).ok
            gens[0].call("sub_fork_child", 8.0)
            for v in (2, 3, 4, 5):
                assert (await pub.push(seeded(TRAIN, v), v)).ok
                assert all(gens[0].call("sub_check", TRAIN, v).values())
            assert len(pub._bank_sets[next(iter(pub._bank_sets))]) == 2, "the forked child pinned a bank"


async def test_shared_mode_two_publishers_on_one_endpoint_keep_their_banks_apart(store_url, uname):
    """Two publishers of one layout on one endpoint, each with its own shared subscriber: neither
    ever reads the other's weights."""
    with generators(store_url, uname, 2, mode="shared") as gens:
        async with trainer(store_url, uname) as ep:
            pa = rl_sync.WeightPublisher(ep, [gens[0].name], dtype="auto", bucket_bytes=BUCKET)
            pb = rl_sync.WeightPublisher(ep, [gens[1].name], dtype="auto", bucket_bytes=BUCKET)
            for v in (1, 2, 3):
                assert (await pa.push(seeded(TRAIN, 10 + v), v)).ok
                assert (await pb.push(seeded(TRAIN, 20 + v), v)).ok
                assert all(gens[0].call("sub_check", TRAIN, 10 + v).values())
                assert all(gens[1].call("sub_check", TRAIN, 20 + v).values())
            pa.close()
            pb.close()
            assert not [n for n in ep.buffers if n.startswith("rl_sync/pub/")], "close unregisters every bank"


async def test_shared_mode_commit_sent_behind_its_begin_is_served_once_the_begin_is(store_url, uname):
    """A shared subscriber is told to commit as soon as the bank is sealed, without waiting for its
    Begin's answer (one round trip per push). One whose Begins are served late (its loop busy) gets
    the Commit first and serves it after the Begin: every push commits, with exactly its bytes, and
    the other subscriber is not held up by it."""
    with generators(store_url, uname, 2, mode="shared") as gens:
        gens[0].call("sub_slow_begin", 0.3)
        async with trainer(store_url, uname) as ep:
            events: list[rl_sync.PushEvent] = []
            pub = cast_pub(ep, gens, observer=events.append)
            for v in (1, 2, 3):
                events.clear()
                report = await pub.push(seeded(TRAIN, v), v)
                assert report.ok, report.summary()
                for g in gens:
                    assert all(g.call("sub_check", TRAIN, v).values())
                slow = [e.kind for e in events if e.subscriber == gens[0].name]
                assert slow.index("commit_sent") < slow.index("begun") < slow.index("committed"), slow
                late, fast = (report.results[g.name].seconds for g in gens)
                assert late >= 0.3 and fast < late, (fast, late)
            pub.close()


async def test_shared_mode_push_is_one_message_each_way(store_url, uname):
    """mode="shared": the bank is packed and sealed first, then each subscriber gets one message (its
    Begin with its Commit inside) and answers once (the Commit's answer says it began): the
    trainer's flight recorder holds one post to each subscriber per push and one from it, and
    every push commits exactly its bytes."""
    def posts(ep: transport.Endpoint, g: RemoteEndpoint) -> tuple[int, int]:
        # (every post not failed: the reader thread marks a served post done just after it delivered it, so the
        # answer that ended the previous push can still read "received" when the push returns)
        recs = [r for r in ep.recorder.snapshot()
                if r["kind"] == "post" and r["state"] in ("posted", "sent", "received", "done")]
        return (sum(r["role"] == "initiator" and r["peer"] == g.name for r in recs),
                sum(r["role"] == "target" and r["initiator"] == g.name for r in recs))

    with generators(store_url, uname, 2, mode="shared") as gens:
        async with trainer(store_url, uname) as ep:
            events: list[rl_sync.PushEvent] = []
            pub = cast_pub(ep, gens, observer=events.append)
            assert (await pub.push(seeded(TRAIN, 1), 1)).ok  # (plans made, a bank)
            before = [posts(ep, g) for g in gens]
            for v in (2, 3, 4):
                events.clear()
                report = await pub.push(seeded(TRAIN, v), v)
                assert report.ok, report.summary()
                for g in gens:
                    assert all(g.call("sub_check", TRAIN, v).values())
                    kinds = [e.kind for e in events if e.subscriber == g.name]
                    assert kinds == ["begin_sent", "commit_sent", "begun", "committed"], kinds
            after = [posts(ep, g) for g in gens]
            assert [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)] == [(3, 3), (3, 3)]
            pub.close()


async def test_shared_mode_commit_behind_a_refused_begin_commits_nothing(store_url, uname):
    """The Commit that follows a Begin the subscriber refuses (here: a version older than the one it
    holds from another publisher) is refused too: the push fails for it with the Begin's reason and
    its weights stay those of the version it holds."""
    with generators(store_url, uname, 1, mode="shared") as gens:
        gens[0].call("sub_slow_begin", 0.2)
        async with trainer(store_url, uname) as ep:
            ahead = cast_pub(ep, gens)
            assert (await ahead.push(seeded(TRAIN, 50), 50)).ok
            behind = cast_pub(ep, gens)
            report = await behind.push(seeded(TRAIN, 7), 7)
            r = report.results[gens[0].name]
            assert not r.ok and r.stage in ("begin", "commit"), report.summary()
            assert "not newer than the committed 50" in str(r.error), r.error
            assert gens[0].call("sub_version") == 50
            assert all(gens[0].call("sub_check", TRAIN, 50).values())
            ahead.close()
            behind.close()


async def test_shared_mode_subscriber_maps_a_restarted_publishers_banks(store_url, uname):
    """Shared subscribers keep the banks they mapped, per publisher incarnation: a publisher that
    restarts under its name (new endpoint, new banks) is mapped afresh at its first commit, and its
    weights are what the subscribers then hold."""
    with generators(store_url, uname, 2, mode="shared") as gens:
        name = uname("trainer")
        for life, versions in enumerate(((1, 2, 3), (4, 5))):
            async with transport.Endpoint(name, store=store_url, timeout=20) as ep:
                pub = cast_pub(ep, gens)
                for v in versions:
                    report = await pub.push(seeded(TRAIN, 100 * life + v), v)
                    assert report.ok, report.summary()
                    for g in gens:
                        assert all(g.call("sub_check", TRAIN, 100 * life + v).values()), (life, v)
                pub.close()


async def test_shared_mode_a_bank_set_made_again_never_reuses_bank_names(store_url, uname):
    """A shared subscriber removed for a push and added back: the publisher drops the layout's
    banks and makes new ones. Their names are new (a subscriber keeps the banks it mapped by their
    names), so the subscriber re-points into the new bank and holds exactly each version's bytes.
    (Found by review: with names reused, it adopted the dropped bank's stale bytes while reporting
    the new version committed.)"""
    with generators(store_url, uname, 1, mode="shared") as sh, generators(store_url, uname, 1) as st:
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, sh + st)
            for v in (1, 2):
                assert (r := await pub.push(seeded(TRAIN, v), v)).ok, r.summary()
            first = {n for n in ep.buffers if "/bank" in n}
            pub.remove_subscriber(sh[0].name)
            assert (r := await pub.push(seeded(TRAIN, 3), 3)).ok, r.summary()  # the banks go
            pub.add_subscriber(sh[0].name)
            for v in (4, 5, 6):
                assert (r := await pub.push(seeded(TRAIN, v), v)).ok, r.summary()
                assert sh[0].call("sub_version") == v
                assert all(sh[0].call("sub_check", TRAIN, v).values()), f"version {v}: other bytes"
            assert not first & {n for n in ep.buffers if "/bank" in n}, "bank names were reused"
            pub.close()


def _banks_mapped(g) -> set[str]:
    """The publisher banks generator ``g``'s process maps (from /proc/<pid>/maps)."""
    with open(f"/proc/{g.proc.pid}/maps") as f:
        return {line.split("rl_sync/pub/")[1].split("/")[0] + "/" + line.split("/bank")[1].split("/")[0]
                for line in f if "rl_sync/pub/" in line and "/bank" in line}


async def test_shared_mode_banks_the_publisher_let_go_are_unmapped_at_the_next_commit(store_url, uname):
    """A subscriber keeps the banks it mapped while the publisher registers them; those the
    publisher let go (here: it closed) are unmapped at the subscriber's next commit, so their
    memory is freed: afterwards it maps only the bank its weights point into."""
    with generators(store_url, uname, 2, mode="shared") as gens:
        async with trainer(store_url, uname) as ep:
            old = cast_pub(ep, gens)
            for v in (1, 2, 3):
                assert (r := await old.push(seeded(TRAIN, v), v)).ok, r.summary()
            assert all(len(_banks_mapped(g)) == 2 for g in gens), [_banks_mapped(g) for g in gens]
            old.close()
            new = cast_pub(ep, gens)
            assert (r := await new.push(seeded(TRAIN, 4), 4)).ok, r.summary()
            for g in gens:
                assert all(g.call("sub_check", TRAIN, 4).values())
                mapped = _banks_mapped(g)
                assert len(mapped) == 1 and not next(iter(mapped)).startswith(old._prefix.split("/")[2]), mapped
            new.close()


async def test_shared_banks_that_cannot_be_made_fail_only_the_shared_subscribers(store_url, uname, monkeypatch):
    """Making the banks fails (here: no room for the lock directory): the shared subscriber's
    entry fails with the reason, the copying subscriber of the same layout is served."""
    gens = [RemoteEndpoint(uname(f"gen{i}"), store=store_url, timeout=20) for i in range(2)]
    try:
        gens[0].call("sub_create", GEN, {"mode": "shared"})
        gens[1].call("sub_create", GEN, {})
        def no_room(owner):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(rl_sync.pub_buffers, "make_lock_dir", no_room)
        async with trainer(store_url, uname) as ep:
            pub = cast_pub(ep, gens)
            report = await pub.push(seeded(TRAIN, 1), 1)
            err = report.results[gens[0].name].error
            assert isinstance(err, rl_sync.RlSyncError) and "shared banks" in str(err), err
            assert report.results[gens[1].name].ok
            assert all(gens[1].call("sub_check", TRAIN, 1).values())
    finally:
        for g in gens:
            g.kill()


def test_shared_mode_blocking_subscriber_leaves_the_bank_when_its_last_reader_does(store_url, uname):
    """A blocking subscriber closed, with its endpoint, while a thread is in hold(): when that
    reader leaves, the weights move to private memory and the bank is let go."""
    import threading

    async def main() -> None:
        async with trainer(store_url, uname) as ep:
            other = RemoteEndpoint(uname("gen"), store=store_url, timeout=20)
            try:
                other.call("sub_create", GEN, {"mode": "shared"})
                bep = transport.BlockingEndpoint(uname("bgen"), store=store_url, timeout=20)
                model = {n: torch.zeros(sh, dtype=getattr(torch, dt)) for n, (dt, sh) in GEN.items()}
                sub = rl_sync.BlockingWeightSubscriber(bep, model, mode="shared")
                pub = cast_pub(ep, [other, bep])
                assert (await pub.push(seeded(TRAIN, 1), 1)).ok
                inside, leave = threading.Event(), threading.Event()

                def reader() -> None:
                    with sub.hold():
                        inside.set()
                        leave.wait(30)

                t = threading.Thread(target=reader)
                t.start()
                assert await asyncio.to_thread(inside.wait, 10)
                await asyncio.to_thread(sub.close)
                await asyncio.to_thread(bep.close)
                pub.remove_subscriber(bep.name)
                for v in (2, 3):
                    assert (await pub.push(seeded(TRAIN, v), v)).ok
                assert backing(model["embed.weight"].data_ptr())[1] == "r--s", "still in the bank while read"
                leave.set()
                await asyncio.to_thread(t.join, 10)
                assert backing(model["embed.weight"].data_ptr())[1] == "rw-p"
                want = seeded(TRAIN, 1)
                assert all(same_bytes(model[n], want[n].to(model[n].dtype)) for n in GEN)
                for v in (4, 5):
                    assert (await pub.push(seeded(TRAIN, v), v)).ok
                assert len(pub._bank_sets[next(iter(pub._bank_sets))]) == 2, "the bank was let go"
            finally:
                other.kill()

    asyncio.run(main())


def test_lock_folders_of_dead_publishers_are_removed():
    """A publisher killed before its close leaves its lock folder; the next one made removes it
    (and never touches a live process's)."""
    import os
    import subprocess
    import sys
    import tempfile

    from rl_sync.banks import make_lock_dir, remove_lock_dir

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    stale = tempfile.mkdtemp(prefix=f"rl_sync-{dead}-gone-")
    open(os.path.join(stale, "abc-0.lock"), "w").close()
    mine = make_lock_dir("me")
    try:
        assert not os.path.exists(stale), "the dead publisher's folder is left"
        assert os.path.isdir(mine) and f"rl_sync-{os.getpid()}-me-" in mine
        other = make_lock_dir("me2")
        assert os.path.isdir(other) and os.path.isdir(mine), "a live publisher's folder was removed"
        remove_lock_dir(other)
        assert not os.path.exists(other)
    finally:
        remove_lock_dir(mine)


async def test_reader_marks_are_forgotten_only_once_done():
    """ReaderMarks' bookkeeping (rl_sync/device.py), with stand-in events (CUDA events on a GPU): a
    wait that times out keeps what is not done, a second wait running at the same time still waits
    for it (a superseding push never skips readers' GPU work), and only done events are dropped."""
    import threading

    from rl_sync.device import ReaderMarks

    class Ev:
        def __init__(self) -> None:
            self.done = threading.Event()

        def query(self) -> bool:
            return self.done.is_set()

    marks = ReaderMarks(torch.device("cpu"))
    assert await marks.wait(0.01)  # CPU: nothing recorded, nothing to wait for
    slow, quick = Ev(), Ev()
    quick.done.set()
    marks._events.update({(0, 1): slow, (0, 2): quick})
    assert not await marks.wait(0.05)  # slow is not done
    assert marks.pending() == [slow]  # quick is forgotten, slow kept
    first = asyncio.ensure_future(marks.wait(5.0))
    second = asyncio.ensure_future(marks.wait(5.0))
    await asyncio.sleep(0.1)
    assert not first.done() and not second.done()  # both wait for slow
    slow.done.set()
    assert await first and await second
    assert marks.pending() == []
