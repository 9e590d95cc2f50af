"""The ``nccl`` plane on GPUs: the channel's own 2-rank communicator between two processes.

NCCL refuses two ranks on one GPU of one host. The put/get and abort tests run in two topologies:
``two-gpus`` (this process on cuda:0, the target on cuda:1; skipped unless
``torch.cuda.device_count() >= 2``) and ``one-gpu-two-nccl-hosts`` (both on cuda:0, the target
started with its own ``NCCL_HOSTID``: NCCL takes the two processes for two hosts, so no duplicate-GPU
refusal, and connects them through its network transport over this host's sockets; the link's whole
data path, set-up, warm-up exchange, posts in the dialer's order, completion and abort, still runs
on a one-GPU machine). Without ``NCCL_HOSTID``, what runs is the refusal itself:
two processes on the same GPU cannot join a link, both sides say why, and GPU ops take the staged
path (logged, in ``peer.gpu_plane_reason``). Fresh random data, destinations poisoned first, byte
equality read back; every wait is bounded. ``cuda_ipc`` is left out of ``planes=`` so that
same-host processes use ``nccl``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
import time
import uuid

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint, child_env, make_tensor, poisoned, put_behind_side_stream, same_bytes

MiB = 1 << 20
PLANES = ("tcp", "nccl")
_seeds = itertools.count(15000)


def seed() -> int:
    return next(_seeds)


def with_init(store_url: str, body) -> None:
    async def main() -> None:
        torch.cuda.set_device(0)
        torch.cuda.init()  # the endpoint offers nccl only if this process already uses CUDA
        async with transport.Endpoint(f"nccl-gpu-init-{uuid.uuid4().hex[:8]}", store=store_url, timeout=60,
                                      planes=PLANES) as ep:
            await asyncio.wait_for(body(ep), 240)

    asyncio.run(main())


async def call(t: RemoteEndpoint, *args):
    return await asyncio.to_thread(t.call, *args)


# Two NCCL "hosts" on one machine (NCCL_HOSTID): NCCL's multi-node NVLink check can fail the init
# there, and its socket transport must use the loopback (not an InfiniBand HCA the machine may expose,
# whose loopback between two "hosts" on one node is not what is tested here). Both processes need it;
# NCCL reads its environment once, at the first communicator, so this process sets it at import.
_ONE_HOST_NCCL = {"NCCL_MNNVL_ENABLE": "0", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
for _k, _v in _ONE_HOST_NCCL.items():
    os.environ.setdefault(_k, _v)


def _spawn_target(store_url: str, device: int, *, nccl_hostid: str | None = None) -> RemoteEndpoint:
    """A target process whose current device (hence its link's) is ``device``; ``nccl_hostid``
    makes NCCL in it take this host for another one."""
    env = {"CUDA_VISIBLE_DEVICES": str(device)}  # its cuda:0 is our cuda:<device>
    if nccl_hostid is not None:
        env["NCCL_HOSTID"] = nccl_hostid
        env.update(_ONE_HOST_NCCL)
    with child_env(env):
        return RemoteEndpoint(f"nccl-gpu-tgt-{uuid.uuid4().hex[:6]}", store=store_url, planes=PLANES, cuda_device=0)


# Where the link's target runs: on cuda:1 (skipped unless there are two GPUs), or on our cuda:0
# as another NCCL "host" (any GPU count).
TOPOLOGIES = [
    pytest.param("two-gpus", marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                      reason="NCCL refuses two ranks on one GPU: needs 2 GPUs")),
    "one-gpu-two-nccl-hosts",
]


def _link_target(store_url: str, topology: str) -> RemoteEndpoint:
    if topology == "two-gpus":
        return _spawn_target(store_url, 1)
    return _spawn_target(store_url, 0, nccl_hostid=f"transport-gpu-test-{uuid.uuid4().hex}")


@pytest.fixture(scope="module", params=TOPOLOGIES)
def link_target(request, store_url):
    """A target the link reaches, shared by the tests that leave it as they found it (each test's
    initiator is a new endpoint: a new channel, with a new communicator)."""
    t = _link_target(store_url, request.param)
    try:
        yield t
    finally:
        t.stop()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8"])
def test_put_and_get_over_the_link(store_url, dtype, link_target):
    t = link_target

    async def body(init: transport.Endpoint) -> None:
        for shape in [(1,), (1023,), (3, 1000), (64 * MiB + 3,)]:
            name = f"w-{uuid.uuid4().hex[:8]}"
            await call(t, "register", name, dtype, shape, "cuda:0")
            peer = await init.connect(t.name)
            end = time.monotonic() + 10
            while name not in (await init.connect(t.name)).buffers:
                assert time.monotonic() < end
                await asyncio.sleep(0.02)
            s = seed()
            await init.put(t.name, {name: make_tensor(dtype, shape, s).to("cuda:0")})
            assert await call(t, "check", name, s)
            out = poisoned(dtype, shape).to("cuda:0")
            await init.get(t.name, {name: out})
            assert same_bytes(out.cpu(), make_tensor(dtype, shape, s))
        assert peer.gpu_plane == "nccl", peer.gpu_plane_reason
        used = {r["plane"] for r in init.recorder.snapshot() if r["role"] == "initiator" and r["kind"] == "put"}
        assert used == {"nccl"}

    with_init(store_url, body)


def test_two_processes_on_one_gpu_cannot_join_and_say_so(store_url):
    """NCCL refuses a second rank on the same GPU: the link goes down on both sides with NCCL's
    reason, and GPU ops take the staged path (the bytes still arrive)."""
    t = _spawn_target(store_url, 0)
    try:
        async def body(init: transport.Endpoint) -> None:
            name = f"w-{uuid.uuid4().hex[:8]}"
            await call(t, "register", name, "float32", (MiB,), "cuda:0")
            await init.connect(t.name)
            ch = init._channels[t.name]
            end = time.monotonic() + 90
            while ch.link is not None and ch.link.state == "pending":
                assert time.monotonic() < end, "the link set-up never ended"
                await asyncio.sleep(0.1)
            s = seed()
            await init.put(t.name, {name: make_tensor("float32", (MiB,), s).to("cuda:0")})
            assert await call(t, "check", name, s)
            peer = await init.connect(t.name)
            if torch.cuda.device_count() < 2:
                assert ch.link is not None and ch.link.state == "down"
                assert peer.gpu_plane == "staged" and "nccl:" in peer.gpu_plane_reason, peer.gpu_plane_reason

        with_init(store_url, body)
    finally:
        t.stop()


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_frozen_peer_aborts_the_channels_communicator_and_a_new_channel_works(store_url, topology):
    """The peer freezes mid-put: the op times out, the channel's communicator is aborted
    (ncclCommAbort) and the channel closed; once the peer runs again the next op builds a new
    channel with a new communicator and moves the bytes."""
    t = _link_target(store_url, topology)
    try:
        async def body(init: transport.Endpoint) -> None:
            await call(t, "register", "w", "uint8", (256 * MiB,), "cuda:0")
            await init.put(t.name, {"w": make_tensor("uint8", (256 * MiB,), seed()).to("cuda:0")})
            old = init._channels[t.name]
            assert old.link is not None and old.link.state == "ready"
            t.signal(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(transport.TransportTimeoutError):
                    await init.put(t.name, {"w": make_tensor("uint8", (256 * MiB,), seed()).to("cuda:0")}, timeout=2)
                assert time.monotonic() - t0 < 30
                assert not old.is_open and old.link.state == "down"
            finally:
                t.signal(signal.SIGCONT)
            s = seed()
            await init.put(t.name, {"w": make_tensor("uint8", (256 * MiB,), s).to("cuda:0")}, timeout=60)
            assert await call(t, "check", "w", s)
            new = init._channels[t.name]
            assert new is not old and new.link is not None and new.link.state == "ready"

        with_init(store_url, body)
    finally:
        t.kill()



def _threads_cpu() -> dict[int, float]:
    """CPU seconds used so far by each Python thread of this process (NCCL's own threads are not
    Python threads: what is measured is this library's and the test's)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for th in threading.enumerate():
        tid = th.native_id
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def test_a_put_waits_for_the_callers_stream_without_blocking_the_loop_or_spinning(store_url, link_target):
    """The caller's side stream runs a long kernel, then writes the source: the put sends those
    bytes (its send waits for an event of that stream, on the GPU), and meanwhile the event loop
    keeps serving other tasks and this process's threads stay almost idle (completion is a
    blocking-sync event a bridge thread sleeps on, no polling loop)."""
    t = link_target

    async def body(init: transport.Endpoint) -> None:
        name, shape = f"w-{uuid.uuid4().hex[:8]}", (4 * MiB,)
        await call(t, "register", name, "float32", shape, "cuda:0")
        end = time.monotonic() + 10
        while name not in (await init.connect(t.name)).buffers:
            assert time.monotonic() < end
            await asyncio.sleep(0.02)
        await init.put(t.name, {name: torch.zeros(shape, device="cuda:0")})  # the link is up
        assert (await init.connect(t.name)).gpu_plane == "nccl"
        s = seed()
        ticks, stop = 0, False

        async def ticker() -> None:
            nonlocal ticks
            while not stop:
                await asyncio.sleep(0.01)
                ticks += 1

        tick_task = asyncio.ensure_future(ticker())
        cpu0, t0 = _threads_cpu(), time.monotonic()
        await put_behind_side_stream(init, t.name, name, shape, s, 2_000_000_000)  # about a second of GPU time
        wall = time.monotonic() - t0
        cpu1 = _threads_cpu()
        stop = True
        await tick_task
        used = sum(v - cpu0.get(tid, 0.0) for tid, v in cpu1.items())
        assert wall > 0.4, f"the kernel took {wall:.2f} s: too short to show anything (raise the sleep)"
        assert await call(t, "check", name, s), "the put sent bytes the side stream had not written yet"
        assert ticks >= 0.5 * wall / 0.01, f"the loop ticked {ticks} times in {wall:.2f} s"
        assert used < 0.3 * wall, f"this process's threads used {used:.2f} s of CPU in {wall:.2f} s"

    with_init(store_url, body)
