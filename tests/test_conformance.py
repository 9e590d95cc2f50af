"""One conformance suite, run against every CPU plane, between real processes.

Every check reads the bytes on the receiving side, on fresh random data, with
the destination poisoned first.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint, make_tensor, poisoned, same_bytes

PLANES = ["shm", "tcp"]
DTYPES = ["float32", "bfloat16", "float16", "int64", "uint8", "bool"]
SHAPES = [(), (0,), (3, 0, 2), (7,), (33, 65)]
_seeds = itertools.count(1000)


@pytest.fixture(scope="module", params=PLANES)
def plane(request):
    return request.param


@pytest.fixture(scope="module")
def targets(store_url, plane):
    """Two target processes using ``plane``, alive for the whole module."""
    import uuid

    tag = uuid.uuid4().hex[:6]
    procs = [RemoteEndpoint(f"tgt{i}-{plane}-{tag}", store=store_url, planes=(plane,)) for i in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def seed() -> int:
    return next(_seeds)


@pytest.fixture
async def ep(store_url, uname, plane):
    async with transport.Endpoint(uname("init"), store=store_url, planes=(plane,), timeout=30) as e:
        yield e


async def test_plane_is_the_forced_one(ep, targets, plane):
    peer = await ep.connect(targets[0].name, timeout=30)
    assert peer.plane == plane
    assert plane in peer.plane_reason


@pytest.mark.parametrize("dtype", DTYPES)
async def test_put_every_dtype_and_shape(ep, targets, dtype, uname):
    tgt = targets[0]
    for shape in SHAPES:
        name = uname(f"{dtype}")
        tgt.call("register", name, dtype, shape)
        s = seed()
        src = make_tensor(dtype, shape, s)
        await ep.put(tgt.name, {name: src})
        if src.numel():
            assert tgt.call("check", name, s), f"{dtype}{shape}: target holds other bytes"
        else:
            assert tgt.call("check", name, s)


@pytest.mark.parametrize("dtype", DTYPES)
async def test_get_every_dtype_and_shape(ep, targets, dtype, uname):
    tgt = targets[1]
    for shape in SHAPES:
        name = uname(f"g{dtype}")
        s = seed()
        tgt.call("register_data", name, dtype, shape, s)
        out = poisoned(dtype, shape)
        await ep.get(tgt.name, {name: out})
        assert same_bytes(out, make_tensor(dtype, shape, s)), f"{dtype}{shape}"


async def test_many_buffers_in_one_put(ep, targets, uname):
    tgt = targets[0]
    names = {uname("sd"): ("bfloat16", (17, 3 + i), seed()) for i in range(40)}
    for n, (dt, sh, _) in names.items():
        tgt.call("register", n, dt, sh)
    await ep.put(tgt.name, {n: make_tensor(dt, sh, s) for n, (dt, sh, s) in names.items()})
    for n, (_, _, s) in names.items():
        assert tgt.call("check", n, s)


async def test_sub_range_put_and_get(ep, targets, uname):
    tgt = targets[0]
    name = uname("rng")
    tgt.call("register", name, "float32", (10, 10))
    s = seed()
    chunk = make_tensor("float32", (25,), s)
    await ep.put(tgt.name, {name: transport.At(chunk, offset=40)})
    assert tgt.call("check_range", name, s, 40, 25)
    back = poisoned("float32", (25,))
    await ep.get(tgt.name, {name: transport.At(back, offset=40)})
    assert same_bytes(back, chunk)
    # the rest of the buffer was not touched
    head = poisoned("float32", (40,))
    await ep.get(tgt.name, {name: transport.At(head, offset=0)})
    assert bool((head.view(torch.uint8) == 0xA5).all())


async def test_one_initiator_many_targets_concurrently(ep, targets, uname):
    jobs = []
    for tgt in targets:
        name = uname("fan")
        tgt.call("register", name, "float32", (256, 1024))
        s = seed()
        jobs.append((tgt, name, s))
    await asyncio.gather(*[ep.put(t.name, {n: make_tensor("float32", (256, 1024), s)}) for t, n, s in jobs])
    for t, n, s in jobs:
        assert t.call("check", n, s)


async def test_several_initiators_into_one_target(store_url, targets, uname, plane):
    tgt = targets[0]
    inits = [RemoteEndpoint(uname("ini"), store=store_url, planes=(plane,)) for _ in range(2)]
    try:
        jobs = []
        for ini in inits:
            name = uname("multi")
            tgt.call("register", name, "int64", (1000, 100))
            s = seed()
            ini.start("put", tgt.name, {name: ("int64", (1000, 100), s)}, 60)
            jobs.append((ini, name, s))
        for ini, _, _ in jobs:
            ini.result(90)
        for _, name, s in jobs:
            assert tgt.call("check", name, s)
    finally:
        for ini in inits:
            ini.stop()


async def test_both_directions_on_one_channel(ep, targets, uname):
    tgt = targets[1]
    mine = uname("mine")
    theirs = uname("theirs")
    local = poisoned("float16", (64, 64))
    ep.register(mine, local)
    tgt.call("register", theirs, "float16", (64, 64))
    await ep.connect(tgt.name)
    s1, s2 = seed(), seed()
    # target puts into us over the channel we dialled while we put into it
    tgt.start("put", ep.name, {mine: ("float16", (64, 64), s1)}, 30)
    await ep.put(tgt.name, {theirs: make_tensor("float16", (64, 64), s2)})
    await asyncio.to_thread(tgt.result, 60)
    assert same_bytes(local, make_tensor("float16", (64, 64), s1))
    assert tgt.call("check", theirs, s2)
    # and it reads back what we hold
    res = tgt.call("get_check", ep.name, {mine: ("float16", (64, 64), s1)}, 30)
    assert res == {mine: True}
    ep.unregister(mine)


async def test_put_notification_arrives_after_bytes(ep, targets, uname):
    tgt = targets[0]
    name = uname("note")
    tgt.call("register", name, "float32", (1024,))
    s = seed()
    await ep.put(tgt.name, {name: make_tensor("float32", (1024,), s)}, notify=b"v1")
    await ep.notify(tgt.name, b"plain")
    notes = tgt.call("notifications", 2, 10)
    assert notes == [(ep.name, b"v1"), (ep.name, b"plain")]
    assert tgt.call("check", name, s)


@pytest.mark.slow
async def test_one_gib(ep, targets, uname):
    tgt = targets[0]
    name = uname("big")
    n = (1 << 30) // 4
    tgt.call("register", name, "float32", (n,), timeout=120)
    s = seed()
    src = make_tensor("float32", (n,), s)
    await ep.put(tgt.name, {name: src}, timeout=120)
    assert tgt.call("check", name, s, timeout=120)
    out = poisoned("float32", (n,))
    await ep.get(tgt.name, {name: out}, timeout=120)
    assert same_bytes(out, src)
    tgt.call("unregister", name)
