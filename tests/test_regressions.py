"""Regressions: each test reproduces a defect a hostile review found (on b86493f..e953fc2) and
failed on that code; they pass since 11abccb.

Real endpoints, real shared memory, real sockets. A hostile peer is simulated by editing the
shm handle in the initiator's cached copy of the peer's registry (``Channel.remote_wire``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import msgspec
import pytest
import torch

import rl_sync
import transport


async def _pair(store_url, uname):
    t = transport.Endpoint(uname("rf-tgt"), store=store_url, planes=("shm",), timeout=10)
    i = transport.Endpoint(uname("rf-ini"), store=store_url, planes=("shm",), timeout=10)
    await t.open()
    await i.open()
    return t, i


# ---------------------------------------------------------------------------- 1. shm fast path (b80096a)
async def test_fast_path_get_bumps_the_version_counter_like_every_other_path(store_url, uname):
    """run_here's memmove writes into the caller's tensor behind autograd's back: its version counter
    does not move, so a tensor saved for backward that a get overwrote is used silently (gradients
    computed from bytes the forward never saw). Before b80096a (``copy_``) and on the threaded path the
    version moves and backward raises."""
    t, i = await _pair(store_url, uname)
    try:
        t.register("w", torch.full((4,), 3.0))
        await i.get(t.name, {"w": torch.zeros(4)})  # (maps the segment and the slot table: later gets run here)
        dst = torch.zeros(4)
        v0 = dst._version
        await i.get(t.name, {"w": dst})
        assert torch.equal(dst, torch.full((4,), 3.0))
        assert dst._version > v0, "a get wrote into the tensor without bumping its version counter"

        w = torch.zeros(4)
        x = torch.ones(4, requires_grad=True)
        y = (x * w).sum()  # saves w (zeros) for backward
        await i.get(t.name, {"w": w})
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()  # reviewed code: no error, x.grad == 3 (bytes the forward never used)
    finally:
        await i.close()
        await t.close()


async def test_get_into_a_leaf_that_requires_grad_behaves_the_same_small_or_large(store_url, uname):
    """A get into a ``requires_grad`` leaf (an ``nn.Parameter``) now succeeds under 8 MiB (memmove on the
    loop) and raises a raw torch RuntimeError at 8 MiB or more (``copy_`` on a worker thread)."""
    t, i = await _pair(store_url, uname)
    try:
        small, big = 4, 3 << 20  # 16 B and 12 MiB
        t.register("small", torch.full((small,), 3.0))
        t.register("big", torch.full((big,), 3.0))
        await i.get(t.name, {"small": torch.zeros(small)})  # (mapped: the next small get runs here)
        outcomes = []
        for name, n in (("small", small), ("big", big)):
            p = torch.nn.Parameter(torch.zeros(n))
            try:
                await i.get(t.name, {name: p})
                outcomes.append("ok")
            except (RuntimeError, transport.TransportError) as exc:
                outcomes.append(type(exc).__name__)
        assert outcomes[0] == outcomes[1], f"small get: {outcomes[0]}, large get: {outcomes[1]}"
        assert outcomes[0] == "InvalidTensorError", outcomes  # (refused before any byte moves, saying why)
        await i.get(t.name, {"small": p.detach() if small == p.numel() else torch.zeros(small)})  # (.detach(): fine)
    finally:
        await i.close()
        await t.close()


async def test_hostile_negative_handle_offset_is_refused_not_wrapped(store_url, uname):
    """run_here refuses a handle whose range starts before the mapping ("the header's path reports it"),
    but the op then goes to ``_one_sided`` (no header), whose ``seg[start:start + n]`` takes a negative
    start Python-style, from the END of the segment: the put lands in the last bytes of the mapping and
    is reported done."""
    t, i = await _pair(store_url, uname)
    try:
        w = torch.zeros(64)  # a 256-byte segment of its own
        t.register("w", w)
        await i.put(t.name, {"w": torch.zeros(64)})  # (maps it)
        ch = (await i.connect(t.name))._channel
        wb = ch.remote_wire["w"]
        ch.remote_wire["w"] = msgspec.structs.replace(wb, shm=msgspec.structs.replace(wb.shm, offset=-32))
        try:
            await i.put(t.name, {"w": transport.At(torch.full((4,), 7.0), 0)})
        except transport.TransportError:
            pass  # a typed refusal: what the review expects
        landed = (w == 7.0).nonzero().flatten().tolist()
        assert landed == [], f"a hostile offset -32 wrote elements {landed} of the peer's buffer, reported done"
    finally:
        await i.close()
        await t.close()


async def test_hostile_handle_past_the_mapping_raises_a_transport_error(store_url, uname):
    """An offset past the end of the mapping: the one-sided fallback slices an empty view and torch's
    size-mismatch RuntimeError reaches the caller (not a TransportError naming the peer)."""
    t, i = await _pair(store_url, uname)
    try:
        t.register("w", torch.zeros(64))
        await i.put(t.name, {"w": torch.zeros(64)})
        ch = (await i.connect(t.name))._channel
        wb = ch.remote_wire["w"]
        ch.remote_wire["w"] = msgspec.structs.replace(wb, shm=msgspec.structs.replace(wb.shm, offset=1 << 20))
        with pytest.raises(transport.TransportError):
            await i.put(t.name, {"w": torch.ones(64)})
    finally:
        await i.close()
        await t.close()


# ---------------------------------------------------------------------------- 2. remote.py / blocking (10a55ce)
async def test_remote_buffer_names_its_buffer_as_its_docstring_says(store_url, uname):
    """The review found describe_buffer's docstring promised that a descriptor stops working once its
    buffer is re-registered, which nothing checked. The docstring now says what holds: ops fail while
    the name is unregistered, a buffer registered again under the name is reached, and the
    incarnation it carries is the holder's to compare with the connected peer's."""
    t, i = await _pair(store_url, uname)
    try:
        t.register("w", torch.zeros(16))
        desc = transport.RemoteBuffer.from_bytes(transport.describe_buffer(t, "w").to_bytes())
        t.unregister("w")
        with pytest.raises(transport.UnknownBufferError):
            await i.put(desc.endpoint, desc.items(torch.ones(16)))
        fresh = torch.zeros(16)
        t.register("w", fresh)  # another buffer under the old name: reached, as documented
        await i.put(desc.endpoint, desc.items(torch.ones(16)))
        assert torch.equal(fresh, torch.ones(16))
        assert desc.incarnation == (await i.connect(t.name)).incarnation  # (same run of the endpoint)
    finally:
        await i.close()
        await t.close()


def test_blocking_close_resolves_submitted_ops_with_their_own_outcome(store_url, uname, caplog):
    """BlockingEndpoint.close() with a submitted get in flight: the op's task is still pending when the
    loop stops ("Task was destroyed but it is pending!", and its future's exception never retrieved);
    the submit future is then failed by _stop_loop's fallback "closed before the op ended", i.e. without
    the op having ended, which is what the future promises to wait for."""
    n = 64 << 20  # floats: 256 MiB, a threaded copy in 64 MiB chunks
    fallback = []
    with transport.BlockingEndpoint(uname("rf-btgt"), store=store_url, planes=("shm",), timeout=20) as t:
        t.register("big", torch.full((n,), 7.0))
        dst = torch.zeros(n)
        for k in range(4):
            i = transport.BlockingEndpoint(uname("rf-bini"), store=store_url, planes=("shm",), timeout=20)
            i.connect(t.name)
            fut = i.submit_get(t.name, {"big": dst})
            time.sleep(0.01 * k)
            with caplog.at_level(logging.ERROR, logger="asyncio"):
                i.close()
                exc = fut.exception(10)
                gc.collect()
            if exc is not None and "before the op ended" in str(exc):
                fallback.append(k)
    destroyed = [r.getMessage() for r in caplog.records if "destroyed but it is pending" in r.getMessage()]
    assert not fallback and not destroyed, (fallback, destroyed)


# ---------------------------------------------------------------------------- 3. rl_sync shared_memory (67532a8)
def test_swap_accepts_two_parameter_objects_tied_by_data():
    """Two Parameter objects over the same bytes (tied through ``.data``, as older code ties heads): every
    object that shares the memory is in ``live`` and is re-pointed, so nothing is left behind; still
    refused as "views"."""
    a = torch.nn.Parameter(torch.zeros(3, 4))
    b = torch.nn.Parameter(a.data)
    rl_sync.WeightSubscriber(transport.Endpoint("never-opened", store="tcp://127.0.0.1:1"),
                             {"embed": a, "head": b}, mode="swap")


def test_a_meta_model_is_refused_for_its_device_not_as_views():
    """shared_memory runs before the device check: every meta tensor reports storage data_ptr 0, so a
    model on ``meta`` is refused as "share memory (views)" instead of "the model is on meta"."""
    live = {"a": torch.zeros(4, device="meta"), "b": torch.zeros(4, device="meta")}
    with pytest.raises(ValueError, match="meta"):
        rl_sync.WeightSubscriber(transport.Endpoint("never-opened", store="tcp://127.0.0.1:1"), live, mode="swap")


# ---------------------------------------------------------------------------- 6. close() while open() (e953fc2)
def _slow_publish(ep: transport.Endpoint, seconds: float) -> asyncio.Event:
    """Make ``ep``'s publish slow on the store thread (a store under load); the event is set once the
    store thread started writing the record."""
    rdv = ep._rdv
    started = asyncio.Event()
    loop = asyncio.get_running_loop()
    orig = rdv._call

    async def call(fn, *args, deadline):
        if args and isinstance(args[0], str) and args[0].endswith(ep.name) and len(args) == 2:
            def slow(st, *a):
                loop.call_soon_threadsafe(started.set)
                time.sleep(seconds)
                return fn(st, *a)
            return await orig(slow, *args, deadline=deadline)
        return await orig(fn, *args, deadline=deadline)

    rdv._call = call
    return started


async def test_close_during_publish_leaves_no_record_in_the_store(store_url, uname):
    """close() cancels open() while the store thread is writing the record: the write cannot be
    cancelled and completes after open() tore down, and nothing withdraws it, so the store keeps a
    record of an endpoint that is closed (its listener socket is gone)."""
    from torch.distributed import TCPStore

    name = uname("rf-pub")
    ep = transport.Endpoint(name, store=store_url, timeout=10)
    started = _slow_publish(ep, 0.3)
    opening = asyncio.ensure_future(ep.open())
    await asyncio.wait_for(started.wait(), 10)
    await ep.close(timeout=5)
    with pytest.raises(transport.EndpointClosedError):
        await opening
    await asyncio.sleep(0.6)  # the store thread finished its write
    host, port = store_url.removeprefix("tcp://").split(":")
    st = TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    from transport import rendezvous

    key = rendezvous._PREFIX + name
    # (a withdrawn record is an empty value: close() replaces its own record atomically, never a newer one)
    assert not st.check([key]) or st.get(key) == b"", f"the store still holds {key!r} for a closed endpoint"


async def test_close_racing_the_callers_own_cancel_keeps_the_cancel(store_url, uname):
    """The task running open() is cancelled by its owner and, at the same time, close() cancels it: open()
    uncancels once and raises EndpointClosedError, so the owner's cancellation is swallowed: a caller that
    handles EndpointClosedError keeps running although it was cancelled."""
    ep = transport.Endpoint(uname("rf-cxl"), store=store_url, timeout=10)
    started = _slow_publish(ep, 0.2)

    async def owner_task() -> str:
        try:
            await ep.open()
        except transport.EndpointClosedError:
            pass
        await asyncio.sleep(0.3)  # the owner cancelled us: this must not run to its end
        return "ran on after being cancelled"

    task = asyncio.ensure_future(owner_task())
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()  # the owner's cancellation
    await ep.close(timeout=5)  # and close()'s, at the same time
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)


# ---------------------------------------------------------------------------- 4. a stale range (seen in CI as a flake)
async def test_a_range_past_a_re_registered_smaller_buffer_is_refused_typed_and_the_channel_lives(store_url, uname):
    """Our copy of the peer's registry is stale (the update is still on its way) when the peer has
    re-registered a buffer with fewer elements: the put addresses elements past the new buffer. The
    target treated that as a protocol violation and closed the channel (PeerLostError for this op
    and every other pending one); an honest peer sends it, so it is a typed BufferMismatchError and
    the channel goes on. Seen once in a full run: the conformance suite's re-registration case on tcp."""
    t = transport.Endpoint(uname("sr-tgt"), store=store_url, planes=("tcp",), timeout=10)
    i = transport.Endpoint(uname("sr-ini"), store=store_url, planes=("tcp",), timeout=10)
    await t.open()
    await i.open()
    try:
        t.register("w", torch.zeros(4096))
        await i.put(t.name, {"w": torch.ones(4096)})  # our cache: (4096,)
        ch = i._channels[t.name]
        updates: list = []
        real = ch.take_registry
        ch.take_registry = updates.append  # the peer's registry updates are held back (still on the way)
        t.unregister("w")
        w2 = torch.zeros(64, 32)
        t.register("w", w2)
        await asyncio.sleep(0.2)
        assert updates, "the target announced its new registry"
        with pytest.raises(transport.BufferMismatchError, match="2048 elements"):
            await i.put(t.name, {"w": torch.full((4096,), 5.0)})
        assert ch.is_open and i._channels[t.name] is ch, "the channel was closed over a stale range"
        assert bool((w2 == 0).all()), "the refused put wrote into the new buffer"
        ch.take_registry = real
        for msg in updates:
            real(msg)
        await i.put(t.name, {"w": torch.full((64, 32), 6.0)})  # the same channel, the new shape
        assert i._channels[t.name] is ch
    finally:
        await i.close()
        await t.close()
