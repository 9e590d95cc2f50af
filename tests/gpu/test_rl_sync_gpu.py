"""rl_sync GPU to GPU on one device: trainer (this process) and generators (spawned processes).

The trainer's weights are float32 on ``cuda:0``, the generators' bfloat16 on ``cuda:0``: the publisher
packs (and casts) into send slots on the GPU, on its own stream, after the work queued on the
caller's stream at ``push()``; each generator pulls into arenas on the GPU over ``cuda_ipc`` (its
arenas are allocations of their own, exportable even when its allocator runs expandable segments),
and commits (staged: a device-to-device copy; swap and direct: re-pointing) only once the GPU work
its readers queued inside ``hold()`` is done; in shared mode its weights point into a bank on the
trainer's GPU, mapped over cuda_ipc. What is checked: exact bytes in every mode and fan-out, the plane the report names (and the generator's flight recorder agrees), a long kernel
queued inside ``hold()`` on a side stream that reads the weights while the next push commits, and
a push right behind a long kernel on the trainer's stream. The conftest skips all of it without
CUDA; every wait is bounded. Runs its own event loops (the GPU machine has no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest
import torch

import rl_sync
import transport
from tests._remote import RemoteEndpoint, child_env
from tests._rl_remote import seeded

DEV = "cuda:0"
SPEC = {**{f"layers.{i}.weight": ("bfloat16", (1024, 1024)) for i in range(6)},
        "layers.0.bias": ("bfloat16", (1024,)), "scale": ("float32", ()), "steps": ("int64", (3,))}
TRAIN = {n: ("float32" if dt == "bfloat16" else dt, sh) for n, (dt, sh) in SPEC.items()}
BUCKET = 4 << 20
SLEEP_CYCLES = 1_000_000_000  # torch.cuda._sleep: about half a second on an H200


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _train(seed: int) -> dict[str, torch.Tensor]:
    return {n: t.to(DEV) for n, t in seeded(TRAIN, seed).items()}


@contextlib.contextmanager
def _gens(store_url: str, n: int, mode: str, env: dict[str, str] | None = None):
    gens = []
    with child_env(env):
        for i in range(n):
            g = RemoteEndpoint(_name(f"gpu-gen{i}"), store=store_url, timeout=60)
            gens.append(g)
            g.call("sub_create", SPEC, {"mode": mode}, DEV)
    try:
        yield gens
    finally:
        for g in gens:
            g.kill()


def _run(body) -> None:
    async def main() -> None:
        await asyncio.wait_for(body(), 240)

    asyncio.run(main())


async def _call(g: RemoteEndpoint, *args):
    return await asyncio.to_thread(g.call, *args)


def _check(g: RemoteEndpoint, version: int) -> None:
    v, exact = g.call("sub_check_held", TRAIN)
    assert (v, exact) == (version, True), f"{g.name}: holds version {v}, exact={exact}, expected {version}"


@pytest.mark.parametrize("fanout", ["direct", "chain"])
@pytest.mark.parametrize("mode", ["staged", "swap", "direct"])
def test_every_mode_pulls_gpu_to_gpu_over_cuda_ipc(store_url, mode, fanout):
    with _gens(store_url, 2, mode) as gens:
        async def body() -> None:
            async with transport.Endpoint(_name("gpu-trainer"), store=store_url, timeout=60) as ep:
                pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], dtype="auto", bucket_bytes=BUCKET,
                                              fanout=fanout)
                for version in (1, 2):
                    report = await pub.push(_train(version), version, timeout=60)
                    assert report.ok, report.summary()
                    for g in gens:
                        await asyncio.to_thread(_check, g, version)
                print(report.summary())
                for g in gens:
                    r = report.results[g.name]
                    assert r.plane == "cuda_ipc", (r.plane, r.plane_reason)
                    assert await _call(g, "op_planes", "get") == ["cuda_ipc"]
                slots = [b.spec for b in ep._registry.snapshot()[1] if "/slot" in b.spec.name]
                assert slots and all(sp.device.startswith("cuda") for sp in slots), slots  # packed on the GPU

        _run(body)


# every dtype that travels (transport.registry), one tensor each, the same dtype on both sides
EVERY_DTYPE = {f"t.{n}": (n, (33, 7)) for n in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64") if hasattr(torch, n)}


@pytest.mark.parametrize("mode", ["staged", "swap", "shared"])
def test_every_dtype_is_packed_and_committed_on_the_gpu(store_url, mode):
    """Every dtype that travels, uncast: packed on the trainer's GPU (``_foreach_copy_`` per dtype
    pair, into send slots or the shared bank) and, staged, copied into the live weights by the
    commit's ``_foreach_copy_`` on the generator's GPU: exact bytes after each of two pushes."""
    gens = [RemoteEndpoint(_name("gpu-gen-dt"), store=store_url, timeout=60)]
    try:
        gens[0].call("sub_create", EVERY_DTYPE, {"mode": mode}, DEV)

        async def body() -> None:
            async with transport.Endpoint(_name("gpu-trainer"), store=store_url, timeout=60) as ep:
                pub = rl_sync.WeightPublisher(ep, [gens[0].name], bucket_bytes=BUCKET)
                for version in (1, 2):
                    train = {n: t.to(DEV) for n, t in seeded(EVERY_DTYPE, version).items()}
                    report = await pub.push(train, version, timeout=60)
                    assert report.ok, report.summary()
                    v, exact = await _call(gens[0], "sub_check_held", EVERY_DTYPE)
                    assert (v, exact) == (version, True), f"holds version {v}, exact={exact}"

        _run(body)
    finally:
        gens[0].kill()


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_a_generator_with_expandable_segments_still_pulls_over_cuda_ipc(store_url, mode):
    """Its live weights come from expandable segments (not exportable), its arenas from
    Endpoint.new_buffer(device=) (a cuMemAlloc of their own): the pulls still take cuda_ipc."""
    # (both names: torch 2.9.1 honours only the deprecated PYTORCH_CUDA_ALLOC_CONF for it, pytorch/pytorch#183387)
    env = {var: "expandable_segments:True" for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    with _gens(store_url, 1, mode, env=env) as gens:
        async def body() -> None:
            async with transport.Endpoint(_name("gpu-trainer"), store=store_url, timeout=60) as ep:
                pub = rl_sync.WeightPublisher(ep, [gens[0].name], dtype="auto", bucket_bytes=BUCKET)
                for version in (1, 2):
                    report = await pub.push(_train(version), version, timeout=60)
                    assert report.ok, report.summary()
                    await asyncio.to_thread(_check, gens[0], version)
                assert report.results[gens[0].name].plane == "cuda_ipc", report.results

        _run(body)


@pytest.mark.parametrize("mode", ["staged", "swap", "direct"])
def test_a_long_kernel_queued_in_hold_finishes_before_the_commit_changes_the_weights(store_url, mode):
    """A reader queues half a second of GPU sleep and then copies of the weights on a side stream
    inside hold(streams=[side]), and leaves the block at once; the next push commits meanwhile. The
    copies must hold exactly the version held (the commit waited for them), and copies queued after
    the commit exactly the new one."""
    with _gens(store_url, 1, mode) as gens:
        g = gens[0]

        async def body() -> None:
            async with transport.Endpoint(_name("gpu-trainer"), store=store_url, timeout=60) as ep:
                pub = rl_sync.WeightPublisher(ep, [g.name], dtype="auto", bucket_bytes=BUCKET)
                assert (await pub.push(_train(1), 1, timeout=60)).ok
                assert await _call(g, "sub_gpu_read", SLEEP_CYCLES) == 1
                report = await pub.push(_train(2), 2, timeout=60)
                assert report.ok, report.summary()
                assert await _call(g, "sub_gpu_read_result", TRAIN) == (1, True)
                assert await _call(g, "sub_gpu_read", 0) == 2
                assert await _call(g, "sub_gpu_read_result", TRAIN) == (2, True)

        _run(body)


def test_a_push_waits_for_the_work_queued_on_the_trainers_stream(store_url):
    """The trainer's "optimizer step" (a fill behind half a second of GPU sleep on its current
    stream) is still queued when push() is called: the pack reads the weights after it."""
    with _gens(store_url, 2, "staged") as gens:
        async def body() -> None:
            async with transport.Endpoint(_name("gpu-trainer"), store=store_url, timeout=60) as ep:
                pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], dtype="auto", bucket_bytes=BUCKET)
                weights = {n: torch.zeros(sh, dtype=getattr(torch, dt), device=DEV) for n, (dt, sh) in TRAIN.items()}
                # a first push makes the send slots (their allocation waits for the whole device): only a later
                # push can show whether the pack itself waits for the work queued on the trainer's stream
                assert (await pub.push(weights, 1, timeout=60)).ok
                torch.cuda.synchronize()
                torch.cuda._sleep(SLEEP_CYCLES)
                for t in weights.values():
                    t.fill_(3)
                report = await pub.push(weights, 3, timeout=60)
                assert report.ok, report.summary()
                for g in gens:
                    assert await _call(g, "sub_check_stamp") == (3, True)

        _run(body)


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_a_colocated_push_served_live_copies_once_from_the_trainers_tensors(store_url, mode):
    """Trainer and generator on one GPU, bfloat16 on both sides (no cast): nothing is packed, the
    generator copies straight out of the trainer's tensors over cuda_ipc (direct mode: into its
    live weights); the second push reuses the first one's registrations."""
    same = dict(SPEC)
    with _gens(store_url, 1, mode) as gens:
        async def body() -> None:
            async with transport.Endpoint(_name("gpu-trainer"), store=store_url, timeout=60) as ep:
                pub = rl_sync.WeightPublisher(ep, [gens[0].name], bucket_bytes=BUCKET)
                weights = {n: t.to(DEV) for n, t in seeded(same, 1).items()}
                report = await pub.push(weights, 1, timeout=60)
                assert report.ok and report.packed_bytes == 0, report.summary()
                assert report.results[gens[0].name].plane == "cuda_ipc", report.results
                v, exact = await _call(gens[0], "sub_check_held", same)
                assert (v, exact) == (1, True)
                epoch = ep._registry.snapshot()[0]
                for n, t in weights.items():  # the next "optimizer step", in place
                    t.copy_(seeded(same, 2)[n].to(DEV))
                report = await pub.push(weights, 2, timeout=60)
                assert report.ok and report.packed_bytes == 0, report.summary()
                assert ep._registry.snapshot()[0] == epoch, "the live tensors were registered again"
                assert await _call(gens[0], "sub_check_held", same) == (2, True)

        _run(body)


def test_shared_mode_points_generators_into_the_trainers_gpu_bank(store_url):
    """mode='shared' on a GPU: the publisher packs into banks on the trainer's GPU and each generator's
    weights point into one of them, mapped over cuda_ipc (no copy to the generators). A generator's
    kernel queued inside hold() (half a second of sleep, then copies, on a side stream) still reads
    its old bank while the next two pushes commit: the bank it reads is let go only once that kernel
    is done, so the second push adds a bank instead of rewriting it, and the copies hold exactly the
    version that was held."""
    with _gens(store_url, 2, "shared") as gens:
        async def body() -> None:
            async with transport.Endpoint(_name("gpu-trainer"), store=store_url, timeout=60) as ep:
                pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], dtype="auto", bucket_bytes=BUCKET)
                report = await pub.push(_train(1), 1, timeout=60)
                assert report.ok, report.summary()
                for g in gens:
                    r = report.results[g.name]
                    assert r.plane == "shared" and "mapped over cuda_ipc" in r.plane_reason, r
                    await asyncio.to_thread(_check, g, 1)
                banks = [b.spec for b in ep._registry.snapshot()[1] if "/bank" in b.spec.name]
                assert banks and all(sp.device.startswith("cuda") for sp in banks), banks
                assert report.packed_bytes == report.results[gens[0].name].bytes, "one pack for every generator"
                assert await _call(gens[0], "sub_gpu_read", SLEEP_CYCLES) == 1
                for v in (2, 3):
                    report = await pub.push(_train(v), v, timeout=60)
                    assert report.ok, report.summary()
                assert await _call(gens[0], "sub_gpu_read_result", TRAIN) == (1, True)
                for g in gens:
                    await asyncio.to_thread(_check, g, 3)
                print(report.summary())

        _run(body)
