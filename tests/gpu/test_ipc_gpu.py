"""The ``cuda_ipc`` plane on a GPU: two processes on the same device.

The target (a spawned process) registers poisoned CUDA buffers; this process puts fresh random data
into them and gets it back, over the plane the channel chose (``cuda_ipc``: the copies run on this
process's stream, straight into the target's allocation mapped through its IPC handle). Also: a CPU
source into a peer's GPU buffer, a buffer in the middle of a caching-allocator segment (offset
math: its neighbour stays poisoned), a put behind a long kernel on the caller's stream (the copy
waits for it), a re-registered buffer (stale export retried, old export released after
``Unmapped``), and a target whose allocator uses expandable segments (no export: the op is staged,
and said so). The conftest beside this file skips everything without CUDA; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid

import pytest

import transport
from tests._remote import RemoteEndpoint, child_env, make_tensor, poisoned, put_behind_side_stream, same_bytes

MiB = 1 << 20
DEV = "cuda:0"
SHAPES = [(1,), (1023,), (3, 1000), (5 * MiB // 4 + 3,)]
_seeds = itertools.count(12000)


def seed() -> int:
    return next(_seeds)


@pytest.fixture(scope="module")
def target(store_url):
    t = RemoteEndpoint(f"ipc-gpu-tgt-{uuid.uuid4().hex[:6]}", store=store_url)
    try:
        yield t
    finally:
        t.stop()


def with_init(store_url: str, body, **kwargs) -> None:
    """Run ``body(ep)`` on a fresh event loop with an initiator endpoint in this process."""

    async def main() -> None:
        async with transport.Endpoint(f"ipc-gpu-init-{uuid.uuid4().hex[:8]}", store=store_url, timeout=60,
                                      **kwargs) as ep:
            await asyncio.wait_for(body(ep), 240)

    asyncio.run(main())


async def peer_has(ep: transport.Endpoint, peer: str, name: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while name not in (await ep.connect(peer)).buffers:
        assert time.monotonic() < end, f"{peer} never announced {name}"
        await asyncio.sleep(0.02)


def planes_used(ep: transport.Endpoint, names: set[str]) -> set[str]:
    return {r["plane"] for r in ep.recorder.snapshot()
            if r["role"] == "initiator" and r["kind"] in ("put", "get") and set(r["names"]) & names}


async def call(t: RemoteEndpoint, *args):
    return await asyncio.to_thread(t.call, *args)


@pytest.mark.parametrize("local", [DEV, "cpu"], ids=["gpu-src", "cpu-src"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8", "int64"])
def test_put_and_get_over_cuda_ipc(store_url, target, local, dtype):
    async def body(init: transport.Endpoint) -> None:
        names = set()
        for shape in SHAPES:
            name = f"w-{uuid.uuid4().hex[:8]}"
            names.add(name)
            await call(target, "register", name, dtype, shape, DEV)
            await peer_has(init, target.name, name)
            s = seed()
            await init.put(target.name, {name: make_tensor(dtype, shape, s).to(local)})
            assert await call(target, "check", name, s), f"put {local}->{DEV} {dtype}{shape}"
            out = poisoned(dtype, shape).to(local)
            await init.get(target.name, {name: out})
            assert same_bytes(out.cpu(), make_tensor(dtype, shape, s)), f"get {DEV}->{local} {dtype}{shape}"
        peer = await init.connect(target.name)
        assert peer.gpu_plane == "cuda_ipc", peer.gpu_plane_reason
        # the real engine maps only CUDA memory of ours (CudaIpcEngine.handles: tensor.is_cuda): a CPU
        # tensor of ours with the peer's GPU buffer goes staged, the peer staging it in (the CPU stand-in
        # engine accepts CPU tensors, which is why CPU runs could not tell)
        assert planes_used(init, names) == ({"cuda_ipc"} if local == DEV else {"staged"})

    with_init(store_url, body)


def test_buffers_inside_one_allocator_segment(store_url, target):
    """Small tensors share a caching-allocator segment: each export is (segment handle, offset).
    A put into one lands exactly there; its neighbours stay poisoned; the segment is mapped once."""
    async def body(init: transport.Endpoint) -> None:
        names = [f"n{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
        for n in names:
            await call(target, "register", n, "float32", (1000,), DEV)
            await peer_has(init, target.name, n)
        handles = [(await init.connect(target.name))._channel.remote_wire[n].ipc for n in names]
        assert len({h.handle for h in handles}) == 1, "expected one segment for three 4 KB tensors"
        assert len({h.offset for h in handles}) == 3
        s = seed()
        await init.put(target.name, {names[1]: make_tensor("float32", (1000,), s).to(DEV)})
        assert await call(target, "check", names[1], s)
        assert await call(target, "is_poisoned", names[0]) and await call(target, "is_poisoned", names[2])

    with_init(store_url, body)


def test_put_waits_for_the_callers_stream(store_url, target):
    async def body(init: transport.Endpoint) -> None:
        name = f"slow-{uuid.uuid4().hex[:8]}"
        shape = (4 * MiB,)
        await call(target, "register", name, "float32", shape, DEV)
        await peer_has(init, target.name, name)
        s = seed()
        await put_behind_side_stream(init, target.name, name, shape, s, 1_000_000_000, DEV, timeout=120)
        assert await call(target, "check", name, s)

    with_init(store_url, body)


def test_reregistered_buffer_retried_and_old_export_released(store_url, target):
    async def body(init: transport.Endpoint) -> None:
        name = f"re-{uuid.uuid4().hex[:8]}"
        await call(target, "register", name, "float32", (MiB,), DEV)
        await peer_has(init, target.name, name)
        await init.put(target.name, {name: make_tensor("float32", (MiB,), seed()).to(DEV)})
        await call(target, "unregister", name)
        await call(target, "register", name, "float32", (MiB,), DEV)
        s = seed()
        await init.put(target.name, {name: make_tensor("float32", (MiB,), s).to(DEV)})
        assert await call(target, "check", name, s)
        end = time.monotonic() + 10
        while await call(target, "ipc_held"):
            assert time.monotonic() < end, "the old export was never released"
            await asyncio.sleep(0.05)

    with_init(store_url, body)


def test_a_buffer_that_cannot_be_exported_is_staged(store_url):
    """With expandable segments the target's memory (cuMemCreate/cuMemMap) has no legacy cudaIpc
    handle: it logs that, the buffer is announced without an export, and ops on it take the
    staged path (recorded)."""
    # Both names: torch 2.9.1 honours only the deprecated PYTORCH_CUDA_ALLOC_CONF for CUDA's expandable
    # segments (pytorch/pytorch#183387), and a later torch may drop that alias.
    with child_env({var: "expandable_segments:True" for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}):
        t = RemoteEndpoint(f"ipc-gpu-exp-{uuid.uuid4().hex[:6]}", store=store_url)
    try:
        async def body(init: transport.Endpoint) -> None:
            name = f"exp-{uuid.uuid4().hex[:8]}"
            await call(t, "register", name, "float32", (MiB,), DEV)
            await peer_has(init, t.name, name)
            s = seed()
            await init.put(t.name, {name: make_tensor("float32", (MiB,), s).to(DEV)})
            assert await call(t, "check", name, s)
            wb = (await init.connect(t.name))._channel.remote_wire[name]
            assert wb.ipc is None, "memory of an expandable segment has no cudaIpc handle: no export expected"
            assert planes_used(init, {name}) == {"staged"}

        with_init(store_url, body)
    finally:
        t.stop()


def test_the_driver_through_cuda_bindings():
    """The engine's driver layer itself (cuda.bindings.driver): the engine's reason names the bindings and
    the driver API, an error is described by the driver (not ``unknown error``), and a buffer of its own
    allocation exports a 64-byte handle at offset 0 while the caller's current context stays as it was."""
    import torch
    from cuda.bindings import driver as cu

    from transport.cuda import ipc
    from transport.errors import PlaneUnavailableError

    engine, reason = ipc.cuda_ipc_engine()
    assert engine is not None and reason.startswith("CUDA IPC handles through the driver (cuda.bindings "), reason
    with pytest.raises(PlaneUnavailableError, match=r"CUDA error 2 CUDA_ERROR_OUT_OF_MEMORY \((?!unknown error)"):
        ipc.check((cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemAlloc")
    t = ipc.exportable_zeros((4096,), torch.float32, torch.device(DEV))
    assert not t.any()
    before = ipc.check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")  # (after torch's own calls on this thread)
    device, raw, size, offset, _ = engine.export(t[1024:], [])
    assert len(raw) == 64 and raw != bytes(64) and size >= t.numel() * 4 and offset == 4096
    assert int(ipc.check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")) == int(before)
    del t
