"""CUDA tensors through the staged path (transport/staging.py + transport/cuda/staging.py) on a GPU.

The CUDA copy engine alone (chunks through pinned bounce buffers on its own stream, ordered after
the caller's stream), then put/get between two spawned processes: GPU->GPU, GPU->CPU, CPU->GPU
over tcp, and over an shm channel a CUDA destination (inline on the socket) and a CUDA source
copied straight into the peer's CPU segment. Fresh random data, destinations poisoned first, byte
equality read back on the receiving side. The conftest beside this file skips everything when
CUDA is not available; every wait here is bounded.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint, make_tensor, poisoned, put_behind_side_stream, same_bytes
from transport.bounce import stage_in, stage_out
from transport.staging import Staging, StagingConfig

MiB = 1 << 20
DEV = "cuda:0"
SHAPES = [(1,), (1023,), (3, 1000), (5 * MiB // 4 + 3,)]  # the last spans several 1 MiB chunks, not a multiple
_seeds = itertools.count(9000)


def seed() -> int:
    return next(_seeds)


# ---------------------------------------------------------------------------- the engine alone
@pytest.mark.parametrize("size", [1, 4095, 4 * MiB, 9 * MiB + 7])
def test_cuda_engine_stages_out_and_in(size):
    staging = Staging(StagingConfig(chunk_bytes=MiB, buffers=3))
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=DEV)
    engine = staging.engine(src.device)
    ring = staging.ring(engine, size)
    got = bytearray()
    try:
        for view in stage_out(src, ring, 30.0, engine.mark()):
            got += bytes(view)
        assert all(ring.buffer(i).is_pinned() for i in range(ring.count))
    finally:
        ring.release()
    assert bytes(src.cpu().numpy()) == bytes(got)

    dst = torch.full((size,), 0xA5, dtype=torch.uint8, device=DEV)
    data = memoryview(got)
    pos = 0

    def fill(view: memoryview, more: int) -> None:
        nonlocal pos
        view[:] = data[pos : pos + len(view)]
        pos += len(view)

    ring = staging.ring(engine, size)
    try:
        assert stage_in(dst, ring, 30.0, fill, after=engine.mark()) is True
    finally:
        ring.release()
    assert torch.equal(dst, src)
    assert staging.statistics().in_use == 0 and staging.statistics().peak_in_use <= 3


def test_staged_copies_wait_for_the_callers_stream():
    """Bytes written on a side stream right before the call are the ones staged out."""
    staging = Staging(StagingConfig(chunk_bytes=MiB, buffers=2))
    side = torch.cuda.Stream()
    src = torch.zeros(8 * MiB, dtype=torch.uint8, device=DEV)
    want = torch.randint(0, 256, src.shape, dtype=torch.uint8, device=DEV)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the stream busy, then overwrite src
        src.copy_(want)
        mark = staging.engine(src.device).mark()  # recorded on the current (side) stream
    ring = staging.ring(staging.engine(src.device), src.numel())
    try:
        got = b"".join(bytes(v) for v in stage_out(src, ring, 30.0, mark))
    finally:
        ring.release()
    assert got == bytes(want.cpu().numpy())


# ---------------------------------------------------------------------------- between processes
@pytest.fixture(scope="module", params=["tcp", "shm"])
def plane(request):
    return request.param


@pytest.fixture(scope="module")
def target(store_url, plane):
    t = RemoteEndpoint(f"gpu-tgt-{plane}-{uuid.uuid4().hex[:6]}", store=store_url, planes=(plane,),
                       staging=StagingConfig(chunk_bytes=MiB, buffers=4))
    try:
        yield t
    finally:
        t.stop()


def with_init(store_url: str, plane: str, body) -> None:
    """Run ``body(ep)`` on a fresh event loop with an initiator endpoint in this process (no
    pytest-asyncio needed: the GPU machine may not have it)."""

    async def main() -> None:
        async with transport.Endpoint(f"gpu-init-{uuid.uuid4().hex[:8]}", store=store_url, planes=(plane,),
                                      timeout=60, staging=StagingConfig(chunk_bytes=MiB, buffers=4)) as ep:
            await asyncio.wait_for(body(ep), 240)

    asyncio.run(main())


@pytest.mark.parametrize("local, remote", [(DEV, DEV), (DEV, "cpu"), ("cpu", DEV)],
                         ids=["gpu-to-gpu", "gpu-to-cpu", "cpu-to-gpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8", "int64"])
def test_put_and_get(store_url, target, plane, local, remote, dtype):
    async def body(init: transport.Endpoint) -> None:
        for shape in SHAPES:
            name = f"w-{uuid.uuid4().hex[:8]}"
            await asyncio.to_thread(target.call, "register", name, dtype, shape, remote)
            peer = await init.connect(target.name)
            await peer_has(init, target.name, name)
            assert peer.buffers[name].device == ("cuda:0" if remote == DEV else "cpu")
            s = seed()
            await init.put(target.name, {name: make_tensor(dtype, shape, s).to(local)})
            assert await asyncio.to_thread(target.call, "check", name, s), f"put {local}->{remote} {dtype}{shape}"
            out = poisoned(dtype, shape).to(local)
            await init.get(target.name, {name: out})
            assert same_bytes(out.cpu(), make_tensor(dtype, shape, s)), f"get {remote}->{local} {dtype}{shape}"
        peer = await init.connect(target.name)
        assert peer.gpu_plane == "staged" and "cuda_ipc: not allowed here" in peer.gpu_plane_reason

    with_init(store_url, plane, body)


async def peer_has(ep: transport.Endpoint, peer: str, name: str, timeout: float = 10.0) -> None:
    """Wait (bounded) until ``ep``'s copy of ``peer``'s registry names ``name``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while name not in (await ep.connect(peer)).buffers:
        assert loop.time() < end, f"{peer} never announced {name}"
        await asyncio.sleep(0.02)


def test_the_peer_puts_into_and_gets_from_our_gpu_buffer(store_url, target, plane):
    async def body(init: transport.Endpoint) -> None:
        name = f"ours-{uuid.uuid4().hex[:8]}"
        dst = poisoned("float16", (3 * MiB // 2 + 5,)).to(DEV)
        spec = init.register(name, dst)
        assert spec.device == "cuda:0"
        s = seed()
        shape = tuple(dst.shape)
        await asyncio.to_thread(target.call, "put", init.name, {name: ("float16", shape, s)}, 60, DEV)
        assert same_bytes(dst.cpu(), make_tensor("float16", shape, s))
        got = await asyncio.to_thread(target.call, "get_check", init.name, {name: ("float16", shape, s)}, 60)
        assert got == {name: True}

    with_init(store_url, plane, body)


def test_bad_input_with_gpu_tensors_raises_before_any_byte_moves(store_url, target, plane):
    async def body(init: transport.Endpoint) -> None:
        name = f"v-{uuid.uuid4().hex[:8]}"
        await asyncio.to_thread(target.call, "register", name, "float32", (1000,), DEV)
        for bad, exc in [(torch.zeros(1000, dtype=torch.float16, device=DEV), transport.BufferMismatchError),
                         (torch.zeros(999, device=DEV), transport.BufferMismatchError),
                         (torch.zeros(2000, device=DEV)[::2], transport.InvalidTensorError)]:
            with pytest.raises(exc):
                await init.put(target.name, {name: bad})
        assert await asyncio.to_thread(target.call, "is_poisoned", name)

    with_init(store_url, plane, body)


def test_a_callers_long_kernel_delays_only_its_own_op(store_url, target, plane):
    """A put issued behind a long kernel on the caller's stream waits for it on the event loop
    before reaching the channel (and sends the bytes that stream leaves), while another op on the
    same channel completes meanwhile: no channel thread and no shared copy stream waits on the
    application's stream."""

    async def body(init: transport.Endpoint) -> None:
        slow_name, fast_name = f"slow-{uuid.uuid4().hex[:8]}", f"fast-{uuid.uuid4().hex[:8]}"
        shape = (MiB,)
        for name in (slow_name, fast_name):
            await asyncio.to_thread(target.call, "register", name, "float32", shape, DEV)
            await peer_has(init, target.name, name)
        s_slow, s_fast = seed(), seed()
        want = make_tensor("float32", shape, s_slow).to(DEV)
        src = torch.zeros(shape, device=DEV)
        side = torch.cuda.Stream()
        torch.cuda.synchronize()

        async def slow_put() -> None:
            # (the current stream is per thread, not per task: only this task marks while it is set)
            with torch.cuda.stream(side):
                torch.cuda._sleep(3_000_000_000)  # a second or more of GPU time, then src is written
                src.copy_(want)
                await init.put(target.name, {slow_name: src}, timeout=120)

        slow = asyncio.ensure_future(slow_put())
        await asyncio.sleep(0.05)
        await asyncio.wait_for(init.put(target.name, {fast_name: make_tensor("float32", shape, s_fast)}), 30)
        assert not slow.done(), "the kernel ended before the other op; the check proves nothing (raise the sleep)"
        await asyncio.wait_for(slow, 120)
        assert await asyncio.to_thread(target.call, "check", slow_name, s_slow)
        assert await asyncio.to_thread(target.call, "check", fast_name, s_fast)

    with_init(store_url, plane, body)


def test_side_stream_work_is_ordered_before_the_copy_of_a_gpu_tensor_with_a_cpu_buffer(store_url, target, plane):
    """Our CUDA tensor with the peer's CPU buffer (over shm: copied straight between the device
    and the peer's segment; over tcp: staged). Put: the bytes a side stream writes right before
    the call, behind a long kernel, are the ones that land. Get: the fetched bytes land after a
    write the side stream still has queued on the destination, so they are what the caller sees."""

    async def body(init: transport.Endpoint) -> None:
        name = f"cpu-buf-{uuid.uuid4().hex[:8]}"
        shape = (MiB + 3,)
        await asyncio.to_thread(target.call, "register", name, "float32", shape, "cpu")
        await peer_has(init, target.name, name)
        s = seed()
        await put_behind_side_stream(init, target.name, name, shape, s, 500_000_000, DEV)
        assert await asyncio.to_thread(target.call, "check", name, s), f"{plane}: the put sent stale bytes"

        dst = torch.zeros(shape, device=DEV)
        side = torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(500_000_000)
            dst.fill_(7.0)  # queued before the get: the get's bytes must land after it
            await init.get(target.name, {name: dst}, timeout=60)
            side.synchronize()
        assert same_bytes(dst.cpu(), make_tensor("float32", shape, s)), f"{plane}: the get's bytes were overwritten"

    with_init(store_url, plane, body)
