"""A buffer that changes under a peer's feet: re-registered, tied, re-pointed; and a get
abandoned mid-transfer. Nothing is lost silently and nothing lands late."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
import torch

import transport


async def test_tied_weights_registered_under_two_names(pair):
    a, b = pair
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as in most language models
    sd = {"embed.weight": emb.weight, "lm_head.weight": head.weight}
    for n, t in sd.items():
        b.register(n, t)
    assert head.weight is emb.weight
    src = torch.randn(10, 4)
    await a.put(b.name, {"embed.weight": src})
    assert torch.equal(emb.weight.detach(), src) and torch.equal(head.weight.detach(), src)
    src2 = torch.randn(10, 4)
    await a.put(b.name, {"lm_head.weight": src2})
    assert torch.equal(emb.weight.detach(), src2)


async def test_a_view_of_a_registered_arena_shares_it(pair):
    a, b = pair
    arena = torch.zeros(100)
    b.register("arena", arena)
    b.register("slice", arena[10:20])
    await a.put(b.name, {"slice": torch.arange(10.0)})
    assert torch.equal(arena[10:20], torch.arange(10.0))
    assert torch.equal(arena[:10], torch.zeros(10))


async def test_a_re_pointed_tensor_is_refused_not_corrupted(pair):
    a, b = pair
    lin = torch.nn.Linear(8, 8)
    b.register("w", lin.weight)
    await a.put(b.name, {"w": torch.ones(8, 8)})
    lin.weight.data = torch.zeros(8, 8)  # what module.to()/.half() do under the hood
    # tcp refuses at the op; shm's puts need no message, so its owner looks every heartbeat
    # interval (1 s here) and marks the export: puts until then land in the old segment
    deadline = time.monotonic() + 5.0
    while True:
        try:
            await a.put(b.name, {"w": torch.full((8, 8), 3.0)})
        except transport.BufferMismatchError as exc:
            assert "re-register" in str(exc), exc
            break
        assert time.monotonic() < deadline, "the re-pointed tensor was never noticed"
        await asyncio.sleep(0.05)
    assert torch.equal(lin.weight.detach(), torch.zeros(8, 8))
    with pytest.raises(transport.BufferMismatchError, match="re-register"):
        await a.get(b.name, {"w": torch.empty(8, 8)})
    b.register("z", torch.zeros(2))  # the channel survived
    await a.put(b.name, {"z": torch.ones(2)})


async def test_re_registering_a_re_pointed_tensor_gets_a_fresh_segment(pair):
    a, b = pair
    params = [torch.zeros(1 << 20) for _ in range(4)]
    for i, p in enumerate(params):
        b.register(f"p{i}", p)
    for i, p in enumerate(params):
        p.data = p.data.to(torch.float64)  # re-pointed, the old memory is no longer the tensor's
        b.unregister(f"p{i}")
        b.register(f"p{i}", p)
    src = torch.full((1 << 20,), 3.0, dtype=torch.float64)
    for i, p in enumerate(params):
        await a.put(b.name, {f"p{i}": src})
        assert torch.equal(p, src), f"p{i}: the acknowledged put did not land"


async def test_a_name_re_registered_elsewhere_in_the_same_arena(pair):
    a, b = pair
    arena = torch.arange(300.0)
    b.register("arena", arena)
    b.register("w", arena[0:100])
    out = torch.empty(100)
    await a.get(b.name, {"w": out})  # a caches w at offset 0
    assert torch.equal(out, torch.arange(100.0))
    b.unregister("w")
    b.register("w", arena[100:200])
    await a.get(b.name, {"w": out})
    assert torch.equal(out, torch.arange(100.0, 200.0)), "the get read the old place"
    await a.put(b.name, {"w": torch.full((100,), -1.0)})
    assert torch.equal(arena[100:200], torch.full((100,), -1.0)), "the put missed the new place"


def test_a_byte_view_keeps_the_memory_it_shows_when_the_tensor_is_re_pointed():
    """The byte views that tcp sends from and receives into (and a get reply queued for the writer)
    keep the memory they show alive: a tensor re-pointed meanwhile (an unregister that moves it, a
    ``set_``, ``.data =``) must not free it under them. In a subprocess: a view of freed memory
    crashes the interpreter (a 16 MiB tensor is its own mapping, unmapped when freed)."""
    code = """
import gc, torch
from transport.registry import BufferSpec, LocalBuffer, tensor_bytes
def empty():
    return torch.empty(0, dtype=torch.uint8).untyped_storage()
t = torch.full((16 << 20,), 7, dtype=torch.uint8)
view = tensor_bytes(t)[:8]
t.set_(empty(), 0, (0,), (1,))
u = torch.full((16 << 20,), 9, dtype=torch.uint8)
buf = LocalBuffer(BufferSpec("w", torch.uint8, torch.Size([16 << 20]), "cpu", 16 << 20), u)
reply = buf.byte_view()[:8]
u.data = torch.zeros(4, dtype=torch.uint8)
gc.collect()
print(bytes(view).hex(), bytes(reply).hex(), len(buf.byte_view()))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ["07" * 8, "09" * 8, "4"], r.stdout
