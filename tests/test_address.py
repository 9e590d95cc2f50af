"""Endpoints that share no store reach each other through address records (transport.address)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch.distributed import HashStore

import transport
from transport.address import decode_address, encode_address

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("planes", [("tcp",), ("shm", "tcp")])
async def test_put_get_between_endpoints_without_a_common_store(planes):
    async with (
        transport.Endpoint("a", store=HashStore(), planes=planes, timeout=10) as a,
        transport.Endpoint("b", store=HashStore(), planes=planes, timeout=10) as b,
    ):
        assert a.add_peer(b.address_record()) == "b"
        assert b.add_peer(a.address_record()) == "a"
        target = torch.zeros(64, dtype=torch.uint8)
        b.register("t", target)
        src = torch.arange(64, dtype=torch.uint8)
        await a.put("b", {"t": src}, timeout=10)
        assert torch.equal(target, src)
        out = torch.zeros(16, dtype=torch.uint8)
        await a.get("b", {"t": transport.At(out, offset=8)}, timeout=10)
        assert torch.equal(out, src[8:24])
        peer = await b.connect("a", timeout=10)
        assert peer.plane == planes[0]


async def test_without_the_record_the_peer_is_not_found():
    async with (
        transport.Endpoint("a", store=HashStore(), timeout=10) as a,
        transport.Endpoint("b", store=HashStore(), timeout=10),
    ):
        with pytest.raises(transport.PeerNotFoundError):
            await a.connect("b", timeout=0.3)


async def test_a_record_with_another_secret_is_refused():
    async with (
        transport.Endpoint("a", store=HashStore(), timeout=10) as a,
        transport.Endpoint("b", store=HashStore(), timeout=10) as b,
    ):
        rec, _ = decode_address(b.address_record())
        a.add_peer(encode_address(rec, b"not-the-secret"))
        with pytest.raises(transport.AuthenticationError):
            await a.connect("b", timeout=5)


async def test_a_gone_incarnation_fails_at_once_not_at_the_deadline():
    async with transport.Endpoint("a", store=HashStore(), timeout=10) as a:
        b = transport.Endpoint("b", store=HashStore(), timeout=10)
        await b.open()
        a.add_peer(b.address_record())
        await b.close()
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(transport.PeerNotFoundError, match="refused the connection"):
            await a.connect("b", timeout=20)
        assert loop.time() - started < 5


@pytest.mark.parametrize("data", [b"", b"{}", b"[1,2]", b"\xff" * 8, b'{"kind":"other","version":1}'])
async def test_malformed_records_are_value_errors(data):
    async with transport.Endpoint("a", store=HashStore(), timeout=10) as a:
        with pytest.raises(ValueError):
            a.add_peer(data)
        with pytest.raises(ValueError, match="itself"):
            a.add_peer(a.address_record())


async def test_record_needs_an_open_endpoint():
    ep = transport.Endpoint("a", store=HashStore(), timeout=10)
    with pytest.raises(transport.EndpointClosedError):
        ep.address_record()
