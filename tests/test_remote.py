"""transport.remote: peer addresses, remote-buffer descriptors as bytes, byte-range views, and
BlockingEndpoint.submit_put/submit_get; and that the torch backend uses only public names.

Real endpoints with no common store (each an in-process HashStore), reached through address
records, over real sockets and shared memory."""

from __future__ import annotations

import ast
import concurrent.futures
import json
from pathlib import Path

import pytest
import torch
from torch.distributed import HashStore

import transport

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parent.parent


def _pair(planes: tuple[str, ...]) -> tuple[transport.Endpoint, transport.Endpoint]:
    return (transport.Endpoint("ra", store=HashStore(), planes=planes, timeout=10),
            transport.Endpoint("rb", store=HashStore(), planes=planes, timeout=10))


async def test_peer_address_reads_a_record_without_its_secret():
    async with transport.Endpoint("pa", store=HashStore(), timeout=10) as ep:
        addr = transport.peer_address(ep.address_record())
        assert addr == transport.PeerAddress("pa", ep.incarnation, *ep.address)
        assert not hasattr(addr, "secret")
    with pytest.raises(ValueError, match="not an endpoint address record"):
        transport.peer_address(b'{"kind": "something else"}')
    with pytest.raises(TypeError):
        transport.peer_address("not bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize("planes", [("tcp",), ("shm", "tcp")])
async def test_a_descriptor_sent_as_bytes_addresses_a_byte_range_of_a_typed_buffer(planes):
    a, b = _pair(planes)
    async with a, b:
        target = torch.zeros(16, dtype=torch.float32)  # 64 bytes
        b.register("w", target)
        wire = transport.describe_buffer(b, "w", offset=8, length=32).to_bytes()  # elements [2, 10)
        assert b"secret" not in wire and len(wire) < 256
        a.add_peer(b.address_record())
        desc = transport.RemoteBuffer.from_bytes(wire)
        assert (desc.endpoint, desc.incarnation, desc.buffer, desc.dtype, desc.offset, desc.length) == (
            "rb", b.incarnation, "w", torch.float32, 8, 32)
        src = torch.arange(8, dtype=torch.float32)
        await a.put(desc.endpoint, desc.items(transport.byte_view(src)), timeout=10)
        want = torch.zeros(16)
        want[2:10] = src
        assert torch.equal(target, want)
        # a sub-range, read back into the bytes of a tensor of another dtype
        part = desc.slice(16, 8)  # elements [6, 8)
        out = torch.zeros(8, dtype=torch.uint8)
        await a.get(part.endpoint, part.items(out), timeout=10)
        assert torch.equal(out.view(torch.float32), src[4:6])


def test_byte_view_shares_storage_and_checks_its_range():
    t = torch.arange(4, dtype=torch.int32)
    v = transport.byte_view(t, 4, 8)
    assert v.dtype == torch.uint8 and v.numel() == 8 and v.data_ptr() == t.data_ptr() + 4
    v.zero_()
    assert t.tolist() == [0, 0, 0, 3]
    with pytest.raises(ValueError, match="outside"):
        transport.byte_view(t, 12, 8)
    with pytest.raises(ValueError, match="contiguous"):
        transport.byte_view(torch.zeros(4, 4).t())


def _wire(**over: object) -> bytes:
    doc = {"kind": "transport-rl/remote-buffer", "version": 1, "endpoint": "e", "incarnation": 1,
           "buffer": "w", "dtype": "float32", "offset": 0, "length": 16}
    doc.update(over)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("data, match", [
    (b"\xff\x00", "not a remote-buffer descriptor"),
    (_wire(kind="transport-rl/address"), "kind"),
    (_wire(version=2), "version 2"),
    (_wire(dtype="complex1024"), "unknown dtype"),
    (_wire(offset=2), "whole 4-byte elements"),
    (_wire(length=-4), "length must be an int >= 0"),
    (_wire(endpoint=""), "endpoint must be a non-empty string"),
    (_wire(extra=1), "not a remote-buffer descriptor"),
    (b" " * 5000, "at most 4096 bytes"),
])
def test_hostile_descriptors_are_refused(data, match):
    assert transport.RemoteBuffer.from_bytes(_wire()).length == 16
    with pytest.raises(ValueError, match=match):
        transport.RemoteBuffer.from_bytes(data)


def test_items_refuse_what_does_not_fit():
    desc = transport.RemoteBuffer("e", 1, "w", torch.float32, 0, 16)
    with pytest.raises(ValueError, match="do not fit"):
        desc.items(torch.zeros(5, dtype=torch.float32))
    with pytest.raises(ValueError, match="whole number"):
        desc.items(torch.zeros(6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="aligned"):
        desc.items(torch.zeros(9, dtype=torch.uint8)[1:5])
    with pytest.raises(ValueError, match="outside"):
        desc.slice(8, 12)


async def test_describe_buffer_needs_a_registered_buffer():
    async with transport.Endpoint("db", store=HashStore(), timeout=10) as ep:
        with pytest.raises(transport.UnknownBufferError):
            transport.describe_buffer(ep, "nope")


@pytest.mark.parametrize("planes, moves", [(("tcp",), False), (("shm", "tcp"), True)])
async def test_which_planes_move_storage_at_registration(planes, moves):
    """The README's claim: with shm allowed registration moves a CPU tensor's bytes into a
    shared segment (a view taken before stops aliasing); tcp alone leaves storage in place."""
    async with transport.Endpoint("mv", store=HashStore(), planes=planes, timeout=10) as ep:
        t = torch.zeros(1024, dtype=torch.uint8)
        before, view = t.data_ptr(), t[:16]
        ep.register("t", t)
        t.fill_(7)
        assert (t.data_ptr() != before) is moves
        assert bool((view == 7).all()) is not moves


def test_submit_put_and_get_return_futures_that_resolve_when_the_op_ends():
    with (transport.BlockingEndpoint("sa", store=HashStore(), timeout=10) as a,
          transport.BlockingEndpoint("sb", store=HashStore(), timeout=10) as b):
        target = torch.zeros(32, dtype=torch.uint8)
        b.register("t", target)
        a.call_in_loop(lambda: a.endpoint.add_peer(b.endpoint.address_record()))
        src = torch.arange(32, dtype=torch.uint8)
        fut = a.submit_put("sb", {"t": src}, timeout=10)
        assert isinstance(fut, concurrent.futures.Future) and not fut.cancel()
        assert fut.result(15) is None and torch.equal(target, src)
        out = torch.zeros(8, dtype=torch.uint8)
        assert a.submit_get("sb", {"t": transport.At(out, offset=4)}, timeout=10).result(15) is None
        assert torch.equal(out, src[4:12])
        bad = a.submit_put("sb", {"nope": src}, timeout=10)
        with pytest.raises(transport.UnknownBufferError):
            bad.result(15)
        lost = a.submit_get("nobody", {"t": out}, timeout=0.5)  # no record, no store entry
        with pytest.raises(transport.PeerNotFoundError):
            lost.result(10)


def test_submitted_ops_resolve_when_the_endpoint_closes():
    a = transport.BlockingEndpoint("sc", store=HashStore(), timeout=10)
    fut = a.submit_get("nobody", {"t": torch.zeros(4, dtype=torch.uint8)}, timeout=30)
    a.close()
    with pytest.raises(transport.TransportError):
        fut.result(10)
    with pytest.raises(transport.EndpointClosedError):
        a.submit_put("nobody", {"t": torch.zeros(4, dtype=torch.uint8)})


def test_the_torch_backend_uses_only_public_names():
    """transport/torch_backend imports from the library only ``transport`` itself and uses only
    names in ``transport.__all__`` (point 3 of the integration issue: the backend is a client)."""
    public = set(transport.__all__)
    for path in sorted((ROOT / "transport" / "torch_backend").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                where = f"{path.name}:{node.lineno}"
                assert node.level <= 1, f"{where}: relative import out of the package"
                if node.level == 0 and (node.module or "").split(".")[0] == "transport":
                    assert node.module == "transport", f"{where}: imports internal module {node.module}"
                    assert {a.name for a in node.names} <= public, where
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("transport."), f"{path.name}:{node.lineno}: {alias.name}"
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "transport"):
                assert node.attr in public, f"{path.name}:{node.lineno}: transport.{node.attr} is not public"
