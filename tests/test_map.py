"""``Endpoint.map``: a same-host peer's registered buffer aliased here, no copy (shm: read-only; cuda_ipc: read-write)."""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint, backing, make_tensor, same_bytes, until
from transport.planes.cuda_ipc_memfd import MemfdIpcEngine


@pytest.fixture
def peer(store_url, uname):
    p = RemoteEndpoint(uname("peer"), store=store_url, timeout=20)
    try:
        yield p
    finally:
        p.kill()


async def test_map_aliases_the_peers_buffer_read_only(store_url, uname, peer):
    peer.call("register_data", "w", "bfloat16", [33, 7], 1)
    peer.call("register_data", "empty", "float32", [0, 4], 2)
    peer.call("register_data", "scalar", "int64", [], 3)
    async with transport.Endpoint(uname("me"), store=store_url, timeout=20) as ep:
        view = await ep.map(peer.name, "w")
        assert view.dtype == torch.bfloat16 and view.shape == (33, 7)
        assert same_bytes(view, make_tensor("bfloat16", (33, 7), 1))
        assert backing(view.data_ptr())[1] == "r--s", "the mapping must be read-only"
        # it is the peer's memory: a put into the buffer shows through at once
        await ep.put(peer.name, {"w": make_tensor("bfloat16", (33, 7), 9)})
        assert same_bytes(view, make_tensor("bfloat16", (33, 7), 9))
        assert (await ep.map(peer.name, "w")).data_ptr() == view.data_ptr(), "one mapping per segment"
        assert (await ep.map(peer.name, "empty")).shape == (0, 4)
        scalar = await ep.map(peer.name, "scalar")
        assert scalar.shape == () and same_bytes(scalar, make_tensor("int64", (), 3))
        # re-registered under the same name: a new map shows the new buffer, the old view the old bytes
        peer.call("unregister", "w")
        peer.call("register_data", "w", "float32", [5], 4)
        new = await ep.map(peer.name, "w")
        assert new.dtype == torch.float32 and same_bytes(new, make_tensor("float32", (5,), 4))
        assert same_bytes(view, make_tensor("bfloat16", (33, 7), 9))
        with pytest.raises(transport.UnknownBufferError):
            await ep.map(peer.name, "nope")
        # the view outlives the peer
        peer.kill()
        assert same_bytes(view, make_tensor("bfloat16", (33, 7), 9))


async def test_map_refuses_a_peer_reached_over_tcp(store_url, uname):
    p = RemoteEndpoint(uname("peer"), store=store_url, timeout=20, planes=("tcp",))
    try:
        p.call("register_data", "w", "float32", [8], 1)
        async with transport.Endpoint(uname("me"), store=store_url, timeout=20, planes=("tcp",)) as ep:
            with pytest.raises(transport.PlaneUnavailableError, match="tcp plane; mapping needs shm"):
                await ep.map(p.name, "w")
            await ep.get(p.name, {"w": torch.empty(8)})  # the endpoint is still usable
    finally:
        p.kill()


def test_blocking_facade_maps(store_url, uname, peer):
    peer.call("register_data", "w", "float32", [64], 5)
    with transport.BlockingEndpoint(uname("me"), store=store_url, timeout=20) as ep:
        assert same_bytes(ep.map(peer.name, "w"), make_tensor("float32", (64,), 5))


async def test_map_over_cuda_ipc_aliases_writably_and_holds_the_export(store_url, uname):
    """With the cuda_ipc plane's CPU stand-in engine on both sides (exports are memfd segments,
    as a GPU's are CUDA IPC handles), ``map`` goes over cuda_ipc: the tensor aliases the peer's
    buffer, and writes through it reach the peer (CUDA maps peer memory read-write). While the
    view lives the peer's memory stays retained for us, even unregistered; once the last view
    dies we confirm (Unmapped) and the peer lets it go."""
    p = RemoteEndpoint(uname("peer"), store=store_url, timeout=20, engines={"cuda_ipc": MemfdIpcEngine})
    try:
        p.call("register_data", "w", "float32", [4, 256], 1)
        p.call("register_data", "empty", "int32", [0], 2)
        async with transport.Endpoint(uname("me"), store=store_url, timeout=20, engines={"cuda_ipc": MemfdIpcEngine}) as ep:
            route = await ep.map_route(p.name, "w")
            assert route.plane == "cuda_ipc" and route.reason, route
            view = await ep.map(p.name, "w")
            assert view.dtype == torch.float32 and view.shape == (4, 256)
            assert same_bytes(view, make_tensor("float32", (4, 256), 1))
            # writable, and it is the peer's memory: the peer sees what we write, we see its puts
            view.copy_(make_tensor("float32", (4, 256), 7))
            assert p.call("check", "w", 7), "a write through a cuda_ipc mapping reaches the peer's buffer"
            await ep.put(p.name, {"w": make_tensor("float32", (4, 256), 8)})
            assert same_bytes(view, make_tensor("float32", (4, 256), 8))
            assert (await ep.map(p.name, "empty")).shape == (0,)
            # the peer unregisters: its memory stays ours to read while any view of it lives
            half = view[2:]
            del view
            p.call("unregister", "w")
            await asyncio.sleep(0.5)  # (our reader takes the registry update and retires the export)
            assert p.call("ipc_held"), "the peer let the memory go while a view of it lived here"
            assert same_bytes(half, make_tensor("float32", (4, 256), 8)[2:])
            with pytest.raises(transport.UnknownBufferError):
                await ep.map(p.name, "w")
            del half
            gc.collect()
            await until(lambda: not p.call("ipc_held"), what="the export let go once the last view died")
    finally:
        p.kill()


async def test_map_route_names_the_plane_or_refuses_with_the_reason(store_url, uname):
    p = RemoteEndpoint(uname("peer"), store=store_url, timeout=20, planes=("tcp",))
    try:
        p.call("register_data", "w", "float32", [8], 1)
        async with transport.Endpoint(uname("me"), store=store_url, timeout=20) as ep:
            with pytest.raises(transport.PlaneUnavailableError, match="tcp plane; mapping needs shm"):
                await ep.map_route(p.name, "w")
            with pytest.raises(transport.UnknownBufferError):
                await ep.map_route(p.name, "nope")
    finally:
        p.kill()
