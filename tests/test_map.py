"""``Endpoint.map``: a read-only view of a same-host peer's registered CPU buffer, no copy."""

from __future__ import annotations

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint, backing, make_tensor, same_bytes


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
