"""No allowed plane reaches the peer: the connection is refused at once, saying why, both ways.

An endpoint that allows only ``shm`` and a peer (a spawned process) that allows only ``tcp``
share no plane: ``connect``, ``put`` and ``get`` raise :class:`transport.PlaneUnavailableError`
naming each plane and why it was passed over, well before the endpoint's timeout, and the same
endpoint's channels to other peers are untouched. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint, make_tensor, same_bytes

TIMEOUT = 30.0  # the endpoints' own bound: a refusal must come long before it


async def test_no_plane_that_reaches_the_peer_is_refused_at_once_and_other_peers_are_untouched(store_url, uname):
    tcp_only = RemoteEndpoint(uname("tcp-only"), store=store_url, planes=("tcp",), timeout=TIMEOUT)
    shm_peer = RemoteEndpoint(uname("shm-peer"), store=store_url, planes=("shm",), timeout=TIMEOUT)
    try:
        tcp_only.call("register", "w", "float32", [64])
        shm_peer.call("register", "w", "float32", [64])
        async with transport.Endpoint(uname("shm-only"), store=store_url, planes=("shm",), timeout=TIMEOUT) as ep:
            ep.register("w", torch.zeros(64))
            for attempt in ("connect", "put", "get"):
                start = time.monotonic()
                with pytest.raises(transport.PlaneUnavailableError) as err:
                    if attempt == "connect":
                        await ep.connect(tcp_only.name)
                    elif attempt == "put":
                        await ep.put(tcp_only.name, {"w": torch.ones(64)})
                    else:
                        await ep.get(tcp_only.name, {"w": torch.empty(64)})
                assert time.monotonic() - start < 5.0, attempt  # (not the 30 s timeout)
                assert "shm: not allowed by the peer" in str(err.value) and "tcp: not allowed here" in str(err.value)
            # the other way round: the peer's put to us is refused as well, saying why
            refused = await asyncio.to_thread(tcp_only.call, "put_error", ep.name, {"w": ("float32", [64], 5)}, 10.0)
            assert refused.startswith("PlaneUnavailableError"), refused
            assert bool((ep._registry.get("w").tensor == 0).all())
            # a peer that shares a plane is reached as usual, by the same endpoint
            await ep.put(shm_peer.name, {"w": make_tensor("float32", (64,), 9)})
            assert await asyncio.to_thread(shm_peer.call, "check", "w", 9)
            back = torch.empty(64)
            await ep.get(shm_peer.name, {"w": back})
            assert same_bytes(back, make_tensor("float32", (64,), 9))
    finally:
        tcp_only.stop()
        shm_peer.stop()
