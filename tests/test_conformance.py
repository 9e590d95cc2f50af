"""One conformance suite, run against every plane, between real processes.

The same cases, with the same exceptions, for each plane: ``shm`` and ``tcp``; the staged path
(its CPU copy engine, ``ThreadCopyEngine``, over a tcp channel); ``cuda_ipc`` (its CPU engine,
``MemfdIpcEngine``); ``nccl`` (its CPU engine, ``SocketLinkEngine``). On a machine with CUDA the
same cases run the real engines on CUDA tensors (``staged-cuda``, ``cuda_ipc-cuda``; ``nccl-cuda``
needs two GPUs); here they are skipped, with the reason. Each plane is a small factory
(:class:`Plane`): the Endpoint arguments of the targets and of the initiator, the device of the
tensors, and the few behaviours a plane documents differently (``one_sided``,
``timeout_closes_channel``), so no case is copied per plane.

Every op must take the plane under test: each test's initiator is checked, at its teardown, to
have run every op that moved bytes over that plane (its flight recorder), and the tests that move
bytes say which plane :meth:`Endpoint.route` picked; a silent fallback fails. Every check reads
the bytes on the receiving side, on fresh random data, with the destination poisoned first; every
wait is bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import signal
import time
import uuid
from typing import Any

import pytest
import torch

import transport
from tests._race_remote import describe
from tests._remote import RemoteEndpoint, make_tensor, op_records, poisoned, same_bytes
from transport.planes import SocketLinkEngine
from transport.planes.cuda_ipc_memfd import MemfdIpcEngine
from transport.staging import StagingConfig, ThreadCopyEngine

MiB = 1 << 20
DTYPES = ["float32", "bfloat16", "float16", "int64", "uint8", "bool"]
# (40, 1031) float32 is 2.5 staged chunks (STAGED below): several chunks, the last one partial
SHAPES = [(), (0,), (3, 0, 2), (7,), (33, 65), (40, 1031)]
STAGED = StagingConfig(chunk_bytes=64 * 1024, buffers=3, cpu_engine=ThreadCopyEngine)
_seeds = itertools.count(1000)
_CUDA = torch.cuda.is_available()
_NO_CUDA = "no CUDA device on this machine: the real engines run on a GPU machine (the CPU stand-ins run here)"


@dataclasses.dataclass(frozen=True)
class Plane:
    """How to build the endpoints of one plane, and what that plane documents differently."""

    name: str  # the plane every op must take (the initiator's flight recorder, Endpoint.route)
    target: dict[str, Any]  # Endpoint arguments of the target processes
    init: dict[str, Any]  # and of the initiator
    device: str = "cpu"  # where the initiator's tensors live
    target_device: str | None = None  # and the targets' (None: the same)
    # plain puts and gets need nothing of the target process (shm: one-sided copies into its
    # segments); they complete while it is frozen
    one_sided: bool = False
    # a timed-out op closes the channel (nccl: the link is aborted); the next op dials a new one
    timeout_closes_channel: bool = False
    race_bytes: int = 32 * MiB  # the size of an op of the cancellation race
    race_rounds: int = 30
    kill_bytes: int = 256 * MiB  # a put that is still running when the target is killed
    gib: bool = False  # run the 1 GiB case (slow): where the engine is a real one, not a CPU stand-in

    @property
    def remote(self) -> str:
        return self.target_device or self.device


def shm() -> Plane:
    return Plane("shm", {"planes": ("shm",)}, {"planes": ("shm",)}, one_sided=True, race_bytes=256 * MiB,
                 race_rounds=40, kill_bytes=768 * MiB, gib=True)


def tcp() -> Plane:
    # (kill_bytes: loopback tcp moves 256 MiB in ~50 ms on a quiet VM, faster than the test's 1 ms polls see it "sent")
    return Plane("tcp", {"planes": ("tcp",)}, {"planes": ("tcp",)}, gib=True, kill_bytes=768 * MiB)


def staged() -> Plane:
    """The staged path with the CPU copy engine: both sides stage their CPU tensors as CUDA ones."""
    kw = {"planes": ("tcp",), "staging": STAGED}
    return Plane("staged", kw, kw)


def cuda_ipc() -> Plane:
    kw = {"engines": {"cuda_ipc": MemfdIpcEngine}}  # (all planes allowed: CPU buffers take cuda_ipc over shm)
    # (kill_bytes: as shm's; a one-sided put's copy that ends before the killed process is gone
    # succeeds, rightly, and 256 MiB was copied before a loaded 2-core VM had the victim exit)
    return Plane("cuda_ipc", kw, kw, one_sided=True, race_bytes=64 * MiB, kill_bytes=768 * MiB)


def nccl() -> Plane:
    kw = {"planes": ("tcp", "nccl"), "engines": {"nccl": SocketLinkEngine}}
    return Plane("nccl", kw, kw, timeout_closes_channel=True)


def staged_cuda() -> Plane:
    return dataclasses.replace(staged(), target={"planes": ("tcp",)}, init={"planes": ("tcp",)}, device="cuda:0",
                               gib=True)


def cuda_ipc_cuda() -> Plane:
    return dataclasses.replace(cuda_ipc(), target={}, init={}, device="cuda:0", gib=True)


def nccl_cuda() -> Plane:
    """Two GPUs (NCCL refuses two ranks on one): the targets on cuda:1, the initiator on cuda:0."""
    return dataclasses.replace(nccl(), target={"planes": ("tcp", "nccl"), "cuda_device": 1},
                               init={"planes": ("tcp", "nccl")}, device="cuda:0", target_device="cuda:1",
                               gib=True)


FACTORIES = {"shm": shm, "tcp": tcp, "staged": staged, "cuda_ipc": cuda_ipc, "nccl": nccl,
             "staged-cuda": staged_cuda, "cuda_ipc-cuda": cuda_ipc_cuda, "nccl-cuda": nccl_cuda}
PARAMS = ["shm", "tcp", "staged", "cuda_ipc", "nccl",
          pytest.param("staged-cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _CUDA, reason=_NO_CUDA)]),
          pytest.param("cuda_ipc-cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _CUDA, reason=_NO_CUDA)]),
          pytest.param("nccl-cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
              not _CUDA or torch.cuda.device_count() < 2, reason="nccl needs two CUDA devices: " + _NO_CUDA)])]


@pytest.fixture(scope="module", params=PARAMS)
def plane(request) -> Plane:
    return FACTORIES[request.param]()


@pytest.fixture(scope="module")
def targets(store_url, plane):
    """Two target processes of ``plane``, alive for the whole module."""
    tag = uuid.uuid4().hex[:6]
    procs = [RemoteEndpoint(f"tgt{i}-{plane.name}-{plane.device[:4]}-{tag}", store=store_url, **plane.target)
             for i in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def seed() -> int:
    return next(_seeds)


def took(ep: transport.Endpoint, *kinds: str) -> set[str]:
    """The planes the initiator's ops of ``kinds`` that moved bytes ran over (its flight recorder)."""
    return {r["plane"] for k in kinds or ("put", "get") for r in op_records(ep, k) if r["nbytes"]}


@pytest.fixture
async def ep(store_url, uname, plane):
    if plane.device.startswith("cuda"):
        torch.cuda.set_device(plane.device)  # (before the endpoint: it offers nccl only then)
    async with transport.Endpoint(uname("init"), store=store_url, timeout=30, **plane.init) as e:
        yield e
        assert took(e) <= {plane.name}, f"ops fell back from {plane.name} to another plane: {took(e)}"
        if took(e) and "staging" in plane.init:
            assert e.staging.statistics().peak_in_use > 0, "the initiator's ops were not staged"


def mk(plane: Plane, dtype: str, shape: tuple[int, ...], s: int) -> torch.Tensor:
    return make_tensor(dtype, shape, s).to(plane.device)


def pz(plane: Plane, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return poisoned(dtype, shape).to(plane.device)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return same_bytes(a.cpu(), b.cpu())


async def call(tgt: RemoteEndpoint, *args: Any, timeout: float = 60.0) -> Any:
    """A command to a target process, off the event loop (the initiator keeps serving meanwhile)."""
    return await asyncio.to_thread(tgt.call, *args, timeout=timeout)


def reg(tgt: RemoteEndpoint, plane: Plane, name: str, dtype: str, shape: tuple[int, ...]) -> None:
    tgt.call("register", name, dtype, shape, plane.remote)


# ---------------------------------------------------------------------------- the plane
async def test_every_op_takes_the_plane_under_test(ep, targets, plane, uname):
    name = uname("route")
    reg(targets[0], plane, name, "float32", (100,))
    src = mk(plane, "float32", (100,), seed())
    route = await ep.route(targets[0].name, {name: src})
    assert route.plane == plane.name, route
    peer = await ep.connect(targets[0].name)
    assert plane.name in (peer.plane, peer.gpu_plane), (peer.plane_reason, peer.gpu_plane_reason)
    await ep.put(targets[0].name, {name: src})
    await ep.get(targets[0].name, {name: pz(plane, "float32", (100,))})
    assert took(ep, "put") == took(ep, "get") == {plane.name}


# ---------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("dtype", DTYPES)
async def test_put_every_dtype_and_shape(ep, targets, plane, dtype, uname):
    tgt = targets[0]
    for shape in SHAPES:
        name = uname(f"{dtype}")
        reg(tgt, plane, name, dtype, shape)
        s = seed()
        await ep.put(tgt.name, {name: mk(plane, dtype, shape, s)})
        assert tgt.call("check", name, s), f"{dtype}{shape}: target holds other bytes"
    assert took(ep, "put") == {plane.name}


@pytest.mark.parametrize("dtype", DTYPES)
async def test_get_every_dtype_and_shape(ep, targets, plane, dtype, uname):
    tgt = targets[1]
    for shape in SHAPES:
        name = uname(f"g{dtype}")
        s = seed()
        tgt.call("register_data", name, dtype, shape, s, plane.remote)
        out = pz(plane, dtype, shape)
        await ep.get(tgt.name, {name: out})
        assert same(out, make_tensor(dtype, shape, s)), f"{dtype}{shape}"
    assert took(ep, "get") == {plane.name}


async def test_many_buffers_in_one_put(ep, targets, plane, uname):
    tgt = targets[0]
    names = {uname("sd"): ("bfloat16", (17, 3 + i), seed()) for i in range(40)}
    for n, (dt, sh, _) in names.items():
        reg(tgt, plane, n, dt, sh)
    await ep.put(tgt.name, {n: mk(plane, dt, sh, s) for n, (dt, sh, s) in names.items()})
    for n, (_, _, s) in names.items():
        assert tgt.call("check", n, s)
    assert took(ep, "put") == {plane.name}


async def test_sub_range_put_and_get(ep, targets, plane, uname):
    tgt = targets[0]
    name, other = uname("rng"), uname("whole")
    reg(tgt, plane, name, "float32", (10, 10))
    reg(tgt, plane, other, "int32", (100,))
    s, s2 = seed(), seed()
    chunk = mk(plane, "float32", (25,), s)
    # a range and a whole buffer in one op
    await ep.put(tgt.name, {name: transport.At(chunk, offset=40), other: mk(plane, "int32", (100,), s2)})
    assert tgt.call("check_range", name, s, 40, 25) and tgt.call("check", other, s2)
    back = pz(plane, "float32", (25,))
    await ep.get(tgt.name, {name: transport.At(back, offset=40)})
    assert same(back, chunk)
    # the rest of the buffer was not touched; the last element is in range
    head, tail = pz(plane, "float32", (40,)), pz(plane, "float32", (35,))
    await ep.get(tgt.name, {name: transport.At(head, offset=0)})
    await ep.get(tgt.name, {name: transport.At(tail, offset=65)})
    assert bool((head.cpu().view(torch.uint8) == 0xA5).all()) and bool((tail.cpu().view(torch.uint8) == 0xA5).all())
    assert took(ep) == {plane.name}


async def test_one_initiator_many_targets_concurrently(ep, targets, plane, uname):
    jobs = []
    for tgt in targets:
        name = uname("fan")
        reg(tgt, plane, name, "float32", (256, 1024))
        jobs.append((tgt, name, seed()))
    await asyncio.gather(*[ep.put(t.name, {n: mk(plane, "float32", (256, 1024), s)}) for t, n, s in jobs])
    for t, n, s in jobs:
        assert t.call("check", n, s)
    assert took(ep, "put") == {plane.name}


async def test_several_initiators_into_one_target(ep, store_url, targets, plane, uname):
    """Another process's initiator and this one put into one target at once."""
    if plane.device != "cpu":
        pytest.skip("the other initiator process makes CPU tensors")
    tgt = targets[0]
    ini = await asyncio.to_thread(RemoteEndpoint, uname("ini"), store=store_url, **plane.init)
    try:
        theirs, mine = uname("multi"), uname("multi")
        for n in (theirs, mine):
            reg(tgt, plane, n, "int64", (1000, 100))
        s1, s2 = seed(), seed()
        ini.start("put", tgt.name, {theirs: ("int64", (1000, 100), s1)}, 60)
        await ep.put(tgt.name, {mine: mk(plane, "int64", (1000, 100), s2)})
        await asyncio.to_thread(ini.result, 90)
        assert tgt.call("check", theirs, s1) and tgt.call("check", mine, s2)
        assert ini.call("op_planes", "put") == [plane.name]
        assert took(ep, "put") == {plane.name}
    finally:
        ini.stop()


async def test_both_directions_on_one_channel(ep, targets, plane, uname):
    tgt = targets[1]
    mine, theirs = uname("mine"), uname("theirs")
    local = pz(plane, "float16", (64, 64))
    ep.register(mine, local)
    reg(tgt, plane, theirs, "float16", (64, 64))
    await ep.connect(tgt.name)
    s1, s2 = seed(), seed()
    # the target puts into us over the channel we dialled while we put into it
    tgt.start("put", ep.name, {mine: ("float16", (64, 64), s1)}, 30, plane.remote)
    await ep.put(tgt.name, {theirs: mk(plane, "float16", (64, 64), s2)})
    await asyncio.to_thread(tgt.result, 60)
    assert same(local, make_tensor("float16", (64, 64), s1))
    assert tgt.call("check", theirs, s2)
    # and it reads back what we hold
    res = await call(tgt, "get_check", ep.name, {mine: ("float16", (64, 64), s1)}, 30, plane.remote)
    assert res == {mine: True}
    assert await call(tgt, "op_planes", "put") == await call(tgt, "op_planes", "get") == [plane.name]
    assert took(ep, "put") == {plane.name}
    ep.unregister(mine)


async def test_put_notification_arrives_after_bytes(ep, targets, plane, uname):
    tgt = targets[0]
    name, other = uname("note"), uname("note2")
    reg(tgt, plane, name, "float32", (1024,))
    reg(tgt, plane, other, "uint8", (MiB,))
    s, s2 = seed(), seed()
    await ep.put(tgt.name, {name: mk(plane, "float32", (1024,), s)}, notify=b"v1")
    await ep.notify(tgt.name, b"plain")
    await ep.put(tgt.name, {other: mk(plane, "uint8", (MiB,), s2), name: mk(plane, "float32", (1024,), s)},
                 notify=b"v2")
    # a posted notification (nothing answers it) keeps the order too: after the put called before it,
    # before the put called after it, whose bytes it does not wait for
    s3 = seed()
    await ep.put(tgt.name, {other: mk(plane, "uint8", (MiB,), s3)})
    await ep.post(tgt.name, b"posted")
    await ep.put(tgt.name, {name: mk(plane, "float32", (1024,), s)}, notify=b"v3")
    # (the target reads its notifications, then its buffers: every put's bytes were in before "v3")
    notes = tgt.call("notifications", 5, 10)
    assert notes == [(ep.name, b"v1"), (ep.name, b"plain"), (ep.name, b"v2"), (ep.name, b"posted"), (ep.name, b"v3")]
    assert tgt.call("check", name, s) and tgt.call("check", other, s3)
    posted = [r for r in op_records(ep, "post") if r["nbytes"] == len(b"posted")]
    assert posted and posted[-1]["state"] == "done", posted
    assert took(ep, "put") == {plane.name}


@pytest.mark.slow
async def test_one_gib(ep, targets, plane, uname):
    if not plane.gib:
        pytest.skip(f"{plane.name} runs a CPU stand-in engine here: 1 GiB proves nothing the race's sizes do not")
    tgt = targets[0]
    name = uname("big")
    n = (1 << 30) // 4
    reg(tgt, plane, name, "float32", (n,))
    s = seed()
    src = mk(plane, "float32", (n,), s)
    await ep.put(tgt.name, {name: src}, timeout=120)
    assert tgt.call("check", name, s, timeout=120)
    out = pz(plane, "float32", (n,))
    await ep.get(tgt.name, {name: out}, timeout=120)
    assert same(out, src)
    tgt.call("unregister", name)
    assert took(ep) == {plane.name}


# ---------------------------------------------------------------------------- bad input
async def test_bad_input_raises_typed_before_any_byte_moves(ep, targets, plane, uname):
    """Unknown name, wrong dtype, wrong shape, an At out of range, a non-contiguous tensor: the
    typed error, for puts, gets and route alike; no op starts, the target's buffer and the
    caller's tensor keep their bytes, and the channel works on."""
    tgt = targets[0]
    name = uname("bad")
    reg(tgt, plane, name, "float32", (3000,))
    await ep.connect(tgt.name)
    dev = plane.device
    cases = [({uname("nope"): torch.zeros(3000, device=dev)}, transport.UnknownBufferError),
             ({name: torch.zeros(3000, dtype=torch.float64, device=dev)}, transport.BufferMismatchError),
             ({name: torch.zeros(2999, device=dev)}, transport.BufferMismatchError),
             ({name: torch.zeros(30, 100, device=dev)}, transport.BufferMismatchError),
             ({name: transport.At(torch.zeros(10, device=dev), 2995)}, transport.BufferMismatchError),
             ({name: transport.At(torch.zeros(10, device=dev), -1)}, transport.BufferMismatchError),
             ({name: torch.zeros(6000, device=dev)[::2]}, transport.InvalidTensorError)]
    for bad, exc in cases:
        for op in ("put", "get", "route"):
            before = [v.tensor if isinstance(v, transport.At) else v for v in bad.values()][0].clone()
            with pytest.raises(exc):
                await getattr(ep, op)(tgt.name, bad)
            after = [v.tensor if isinstance(v, transport.At) else v for v in bad.values()][0]
            assert torch.equal(before, after), f"{op} {exc.__name__}: the caller's tensor changed"
    assert not op_records(ep, "put") and not op_records(ep, "get"), "a rejected op was started"
    assert tgt.call("is_poisoned", name), "a rejected op wrote into the target's buffer"
    s = seed()
    await ep.put(tgt.name, {name: mk(plane, "float32", (3000,), s)})
    assert tgt.call("check", name, s)
    assert took(ep, "put") == {plane.name}


# ---------------------------------------------------------------------------- cancellation
MARK = 0x5A


class _Catch(logging.Handler):
    """The asyncio logger's messages (a task destroyed while pending is a leak)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def delays(duration: float) -> list[float]:
    """Where to cancel: before the op is sent (tiny timeouts), then points spread over an
    uncancelled op's duration (mid-copy)."""
    return [0.0005, 0.001, 0.002] + [duration * f for f in (0.05, 0.15, 0.3, 0.5, 0.7, 0.9)]


STOP_BOUND_S = 10.0  # README: a stopped op's waits "are bounded (seconds; staged: the staging stall bound)"


async def stopped(op: Any, mode: str, delay: float) -> bool:
    """Run ``op(timeout)``, stopped after ``delay`` (cancelled by ``wait_for``) or by its own
    ``timeout=``; True if it raised, False if it completed first. One that raised did so within
    :data:`STOP_BOUND_S` of being stopped (its copies stopped or finished, its bytes drained)."""
    t0 = time.monotonic()
    try:
        if mode == "wait_for":
            await asyncio.wait_for(op(None), delay)
        else:
            await op(delay)
    except (TimeoutError, transport.TransportTimeoutError):
        late = time.monotonic() - t0 - delay
        assert late < STOP_BOUND_S, f"the op raised {late:.1f} s after it was stopped ({mode}, {delay * 1e3:.2f} ms)"
        return True
    return False


async def timed(op: Any) -> float:
    t0 = time.monotonic()
    await op()
    return time.monotonic() - t0


async def test_a_cancelled_put_leaves_no_writer_behind(ep, targets, plane, uname, request):
    """Put's guarantee (its docstring), at every point of the op: once a put was cancelled or
    timed out, nothing of it writes into the target any more; a put right after, into the same
    buffer, returns only once the target holds exactly its bytes; the endpoint stays usable.
    No task is left pending. (The target holds one byte value per buffer: cheap to check at
    hundreds of MiB.)"""
    tgt, n, buf = targets[0], plane.race_bytes, uname("race")
    catch = _Catch()
    logging.getLogger("asyncio").addHandler(catch)
    request.addfinalizer(lambda: logging.getLogger("asyncio").removeHandler(catch))
    await call(tgt, "register_fill", buf, n, 0, plane.remote)
    # round k puts first[k % 2] (stopped), then second[k % 2]: the target starts each round holding
    # the previous round's second value, never the first op's
    first = [torch.full((n,), v, dtype=torch.uint8, device=plane.device) for v in (1, 3)]
    second = [torch.full((n,), v, dtype=torch.uint8, device=plane.device) for v in (2, 4)]
    warm = min([await timed(lambda: ep.put(tgt.name, {buf: second[1]}, timeout=60)) for _ in range(2)])
    points = delays(warm)
    raised, mid, wrong = 0, 0, []
    rounds = 0
    for k in range(3 * plane.race_rounds):  # (more rounds while too few ops were stopped: a quick VM finishes some)
        if k >= plane.race_rounds and raised >= plane.race_rounds // 2:
            break
        rounds += 1
        mode, delay = ("timeout" if k % 3 == 2 else "wait_for"), points[k % len(points)]
        a, b = first[k % 2], second[k % 2]
        hit = await stopped(lambda timeout, a=a: ep.put(tgt.name, {buf: a}, timeout=timeout), mode, delay)
        raised += hit
        if hit and k % 4 == 3:  # how much of the first put had landed (probing delays the second put)
            mid += 0 < await call(tgt, "count", buf, int(a[0])) < n
        await ep.put(tgt.name, {buf: b}, timeout=60)  # at once, into the same buffer
        if (bad := await call(tgt, "holds", buf, int(b[0]))) is not None:
            wrong.append(f"round {k} ({mode} after {delay * 1e3:.2f} ms, raised={hit}): {bad}")
    print(f"[conformance] {plane.name} cancelled puts: {raised}/{rounds} raised, {mid} probed mid-copy")
    gc.collect()
    await asyncio.sleep(0.1)
    assert not [m for m in catch.messages if "destroyed but it is pending" in m], catch.messages
    assert not wrong, "once the next put returned, the target held other bytes:\n" + "\n".join(wrong)
    assert raised >= plane.race_rounds // 2, "too few puts were stopped before they completed: this tests nothing"
    assert took(ep, "put") == {plane.name}
    await call(tgt, "unregister", buf)


async def test_a_cancelled_get_writes_nothing_after_it_raised(ep, targets, plane, uname):
    """Get's guarantee, at every point of the op: once a get was cancelled or timed out, nothing
    of it writes into the caller's tensor (which the caller reuses at once); the next get into it
    returns exactly its bytes; the endpoint stays usable."""
    tgt, n = targets[1], plane.race_bytes
    src_a, src_b, va, vb = uname("ga"), uname("gb"), 7, 9
    await call(tgt, "register_fill", src_a, n, va, plane.remote)
    await call(tgt, "register_fill", src_b, n, vb, plane.remote)
    out = torch.zeros(n, dtype=torch.uint8, device=plane.device)
    warm = await timed(lambda: ep.get(tgt.name, {src_a: out}, timeout=60))
    warm = min(warm, await timed(lambda: ep.get(tgt.name, {src_b: out}, timeout=60)))
    points = delays(warm)
    raised, mid, wrong = 0, 0, []
    rounds = 0
    for k in range(3 * plane.race_rounds):  # (more rounds while too few ops were stopped: a quick VM finishes some)
        if k >= plane.race_rounds and raised >= plane.race_rounds // 2:
            break
        rounds += 1
        mode, delay = ("timeout" if k % 3 == 2 else "wait_for"), points[k % len(points)]
        # out holds vb (the previous round's second get): the first get's bytes are va
        hit = await stopped(lambda timeout: ep.get(tgt.name, {src_a: out}, timeout=timeout), mode, delay)
        raised += hit
        mid += hit and int(out[0]) == va and int(out[-1]) != va  # (the copies run from the start)
        out.fill_(MARK)  # the caller reuses its tensor at once
        if (bad := describe(out.cpu(), MARK)) is not None:
            wrong.append(f"round {k} ({mode} after {delay * 1e3:.2f} ms): written after it raised: {bad}")
        await ep.get(tgt.name, {src_b: out}, timeout=60)
        if (bad := describe(out.cpu(), vb)) is not None:
            wrong.append(f"round {k} ({mode} after {delay * 1e3:.2f} ms): the next get returned other bytes: {bad}")
    print(f"[conformance] {plane.name} cancelled gets: {raised}/{rounds} raised, {mid} mid-copy")
    assert not wrong, "\n".join(wrong)
    assert raised >= plane.race_rounds // 2, "too few gets were stopped before they completed: this tests nothing"
    assert took(ep, "get") == {plane.name}
    for b in (src_a, src_b):
        await call(tgt, "unregister", b)


# ---------------------------------------------------------------------------- registry changes
async def test_registry_changes_fail_typed_or_land_in_the_new_buffer(ep, targets, plane, uname):
    """The target re-registers a buffer (our copy of its registry is stale): the next put lands in
    the new buffer, not the old one, and a get reads the new one; re-registered with another
    shape, the old shape is refused (BufferMismatchError) and the new one works; unregistered,
    puts and gets fail with UnknownBufferError. Never done while the bytes went nowhere."""
    tgt = targets[0]
    name = uname("rereg")
    reg(tgt, plane, name, "float32", (4096,))
    s1 = seed()
    await ep.put(tgt.name, {name: mk(plane, "float32", (4096,), s1)})  # our cache now names the first buffer
    tgt.call("reregister", name, "float32", (4096,), plane.remote)
    s2 = seed()
    await ep.put(tgt.name, {name: mk(plane, "float32", (4096,), s2)})  # at once: our cache is stale
    assert tgt.call("check", name, s2), "the put reported done but the new buffer does not hold its bytes"
    assert tgt.call("check", name + "#old", s1), "the put wrote into the unregistered buffer"
    out = pz(plane, "float32", (4096,))
    await ep.get(tgt.name, {name: out})
    assert same(out, make_tensor("float32", (4096,), s2))
    # the same name, another shape
    tgt.call("reregister", name, "float32", (64, 32), plane.remote)
    with pytest.raises(transport.BufferMismatchError):
        await ep.put(tgt.name, {name: mk(plane, "float32", (4096,), seed())})
    with pytest.raises(transport.BufferMismatchError):
        await ep.get(tgt.name, {name: pz(plane, "float32", (4096,))})
    assert tgt.call("is_poisoned", name)
    s3 = seed()
    await ep.put(tgt.name, {name: mk(plane, "float32", (64, 32), s3)})
    assert tgt.call("check", name, s3)
    # gone
    tgt.call("unregister", name)
    with pytest.raises(transport.UnknownBufferError):
        await ep.put(tgt.name, {name: mk(plane, "float32", (64, 32), seed())})
    out = pz(plane, "float32", (64, 32))
    with pytest.raises(transport.UnknownBufferError):
        await ep.get(tgt.name, {name: out})
    assert same(out, poisoned("float32", (64, 32)))
    # the channel lives on
    other = uname("after")
    reg(tgt, plane, other, "int64", (50,))
    s4 = seed()
    await ep.put(tgt.name, {other: mk(plane, "int64", (50,), s4)})
    assert tgt.call("check", other, s4)
    assert took(ep) == {plane.name}


# ---------------------------------------------------------------------------- frozen, killed, restarted
async def test_a_frozen_target_times_out_at_the_deadline_then_works_again(ep, targets, plane, uname):
    """SIGSTOP the target: an op that needs it (a put with a notification, a get where the plane
    is not one-sided) raises TransportTimeoutError (also a TimeoutError) at its deadline; a
    one-sided plane's plain put and get complete meanwhile. Once the target runs again, the next
    op works: on the same channel, or (nccl: the timeout aborted the link) on a new one."""
    tgt = targets[1]
    name = uname("frz")
    reg(tgt, plane, name, "float32", (1024,))
    s = seed()
    await ep.put(tgt.name, {name: mk(plane, "float32", (1024,), s)})
    old = ep._channels[tgt.name]
    tgt.signal(signal.SIGSTOP)
    try:
        if plane.one_sided:
            s = seed()
            await ep.put(tgt.name, {name: mk(plane, "float32", (1024,), s)}, timeout=2)
            out = pz(plane, "float32", (1024,))
            await ep.get(tgt.name, {name: out}, timeout=2)
            assert same(out, make_tensor("float32", (1024,), s))
        ops = [lambda: ep.put(tgt.name, {name: mk(plane, "float32", (1024,), seed())}, notify=b"n", timeout=1.5)]
        if not plane.one_sided:
            ops.append(lambda: ep.get(tgt.name, {name: pz(plane, "float32", (1024,))}, timeout=1.5))
        for op in ops:
            t0 = time.monotonic()
            with pytest.raises(transport.TransportTimeoutError) as info:
                await op()
            elapsed = time.monotonic() - t0
            assert isinstance(info.value, TimeoutError)
            assert 1.4 <= elapsed < 4.0, f"raised after {elapsed:.2f} s, the deadline was 1.5 s"
    finally:
        tgt.signal(signal.SIGCONT)
    s = seed()
    await ep.put(tgt.name, {name: mk(plane, "float32", (1024,), s)}, timeout=20)
    assert tgt.call("check", name, s)
    out = pz(plane, "float32", (1024,))
    await ep.get(tgt.name, {name: out}, timeout=20)
    assert same(out, make_tensor("float32", (1024,), s))
    assert (ep._channels[tgt.name] is not old) == plane.timeout_closes_channel
    assert took(ep) == {plane.name}


async def test_a_killed_target_fails_ops_fast_and_restarted_is_reached_again(store_url, ep, targets, plane, uname):
    """SIGKILL the target mid-put: the put fails with PeerLostError within seconds (the
    connection's loss, not the op's deadline); another target's channel is untouched. The target
    restarted under the same name (a new incarnation) is reached again and ops work."""
    name = uname("phoenix")
    n = plane.kill_bytes // 4
    victim = RemoteEndpoint(name, store=store_url, **plane.target)
    second = None
    try:
        await call(victim, "register", "w", "float32", (n,), plane.remote, timeout=120)
        first = await ep.connect(name)
        src = mk(plane, "float32", (n,), seed())
        put = asyncio.ensure_future(ep.put(name, {"w": src}, timeout=120))
        # kill as soon as the put is under way (a fast plane moves kill_bytes in a few tens of ms): once it
        # is on the wire, or, one-sided (it sends nothing, so it is never "sent"), after a few ms
        limit = time.monotonic() + (0.005 if plane.one_sided else 0.05)
        while time.monotonic() < limit and (plane.one_sided or
                                            not any(r["state"] == "sent" for r in op_records(ep, "put")[-1:])):
            await asyncio.sleep(0.001)
        assert not put.done(), "the put was over before the kill: make kill_bytes larger"
        t0 = time.monotonic()
        victim.kill()
        with pytest.raises(transport.PeerLostError):
            await asyncio.wait_for(put, 30)
        assert time.monotonic() - t0 < 5.0, "the loss must be noticed within seconds, not at the op's deadline"
        other = uname("other")
        reg(targets[0], plane, other, "float32", (1000,))
        s = seed()
        await ep.put(targets[0].name, {other: mk(plane, "float32", (1000,), s)}, timeout=30)
        assert targets[0].call("check", other, s)
        # restarted under the same name
        second = await asyncio.to_thread(RemoteEndpoint, name, store=store_url, **plane.target)
        reg(second, plane, "w", "float32", (1000,))
        s = seed()
        deadline = time.monotonic() + 30
        while True:  # the first op after the restart may race the loss of the old channel
            try:
                await ep.put(name, {"w": mk(plane, "float32", (1000,), s)}, timeout=30)
                break
            except transport.PeerLostError:
                assert time.monotonic() < deadline, "the restarted target was never reached"
        assert second.call("check", "w", s)
        out = pz(plane, "float32", (1000,))
        await ep.get(name, {"w": out}, timeout=30)
        assert same(out, make_tensor("float32", (1000,), s))
        peer = await ep.connect(name)
        assert peer.incarnation == second.incarnation != first.incarnation
        assert {r["plane"] for r in op_records(ep, "put")[-1:] + op_records(ep, "get")[-1:]} == {plane.name}
    finally:
        victim.kill()
        if second is not None:
            second.stop()
