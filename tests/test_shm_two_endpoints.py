"""One tensor registered with two endpoints of one process (``shm``): both keep reaching it.

Registering a CPU tensor for ``shm`` moves its storage into a memfd segment in place. A tensor
registered with a second endpoint of the same process (a trainer serving two groups, one
``torch.distributed._transport`` transport per peer over the same weights) already lies in the
first endpoint's segment: the second exports that segment too and never moves the tensor again,
which would leave the first endpoint's export on memory the tensor no longer uses (its peers'
puts lost, their gets stale). The segment lives until neither endpoint exports it. Real
processes: a spawned peer puts and gets through both endpoints (blocking endpoints: each runs its
own event loop thread, as the peer's calls block this one); every wait is bounded.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import transport
from tests._remote import RemoteEndpoint, make_tensor, same_bytes

N = 4096
SPEC = ("float32", [N])


def _put(peer: RemoteEndpoint, target: str, seed: int) -> None:
    peer.call("put", target, {"w": (*SPEC, seed)}, 10.0)


@contextlib.contextmanager
def _peer_and_two_endpoints(store_url: str, uname: Any) -> Iterator[tuple[RemoteEndpoint, Any, Any]]:
    """A spawned peer, and two blocking endpoints of this process: ``a`` and ``b``."""
    peer = RemoteEndpoint(uname("peer"), store=store_url, timeout=10)
    try:
        with transport.BlockingEndpoint(uname("a"), store=store_url, timeout=10) as a, \
                transport.BlockingEndpoint(uname("b"), store=store_url, timeout=10) as b:
            yield peer, a, b
    finally:
        peer.stop()


def test_a_tensor_registered_with_two_endpoints_is_reached_through_both(store_url, uname):
    with _peer_and_two_endpoints(store_url, uname) as (peer, a, b):
        w = torch.zeros(N)
        a.register("w", w)
        at = w.data_ptr()
        b.register("w", w)
        assert w.data_ptr() == at  # not moved again
        for ep, seed in ((a, 1), (b, 2), (a, 3)):
            _put(peer, ep.name, seed)
            assert same_bytes(w, make_tensor("float32", (N,), seed)), ep.name
        w.copy_(make_tensor("float32", (N,), 4))  # the owner writes; a get through either reads it
        for ep in (a, b):
            assert peer.call("get_check", ep.name, {"w": (*SPEC, 4)}, 10.0) == {"w": True}, ep.name
        assert peer.call("op_planes", "put") == ["shm"] and peer.call("op_planes", "get") == ["shm"]

        a.unregister("w")  # b still exports it: it stays where it is
        assert w.data_ptr() == at
        _put(peer, b.name, 5)
        assert same_bytes(w, make_tensor("float32", (N,), 5))
        assert "UnknownBufferError" in peer.call("put_error", a.name, {"w": (*SPEC, 6)}, 10.0)

        b.unregister("w")  # the last export: the tensor moves to private memory, keeping its bytes
        assert w.data_ptr() != at and same_bytes(w, make_tensor("float32", (N,), 5))
        assert "UnknownBufferError" in peer.call("put_error", b.name, {"w": (*SPEC, 7)}, 10.0)
        assert same_bytes(w, make_tensor("float32", (N,), 5))


def test_closing_one_endpoint_leaves_the_other_s_registration_whole(store_url, uname):
    """The first endpoint closes (its exports end, its segments close unless another endpoint
    still exports them): the second still reaches the tensor, in place."""
    peer = RemoteEndpoint(uname("peer"), store=store_url, timeout=10)
    try:
        with transport.BlockingEndpoint(uname("b"), store=store_url, timeout=10) as b:
            w = torch.zeros(N)
            with transport.BlockingEndpoint(uname("a"), store=store_url, timeout=10) as a:
                a.register("w", w)
                b.register("w", w)
                _put(peer, a.name, 11)
                assert same_bytes(w, make_tensor("float32", (N,), 11))
            at = w.data_ptr()
            _put(peer, b.name, 12)
            assert w.data_ptr() == at and same_bytes(w, make_tensor("float32", (N,), 12))
            assert peer.call("get_check", b.name, {"w": (*SPEC, 12)}, 10.0) == {"w": True}
    finally:
        peer.stop()


def test_two_threads_registering_and_taking_back_one_tensor_never_break_either_export(store_url, uname):
    """Two blocking endpoints on two threads register and unregister the same tensors over and
    over (the segments' counts are shared): after every round, a tensor still registered with
    either endpoint is reached through it, in place."""
    with _peer_and_two_endpoints(store_url, uname) as (peer, a, b):
        ws = [torch.zeros(N) for _ in range(4)]
        errors: list[BaseException] = []

        def churn(ep: transport.BlockingEndpoint, rounds: int) -> None:
            try:
                for _ in range(rounds):
                    for i, w in enumerate(ws):
                        ep.register(f"w{i}", w)
                    for i in range(len(ws)):
                        ep.unregister(f"w{i}")
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        threads = [threading.Thread(target=churn, args=(ep, 60)) for ep in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads) and not errors, errors
        for i, w in enumerate(ws):  # whatever happened, both can register them again and be reached
            a.register(f"w{i}", w)
            b.register(f"w{i}", w)
        for seed, ep in ((21, a), (22, b)):
            peer.call("put", ep.name, {f"w{i}": (*SPEC, seed + 10 * i) for i in range(len(ws))}, 10.0)
            for i, w in enumerate(ws):
                assert same_bytes(w, make_tensor("float32", (N,), seed + 10 * i)), (ep.name, i)


def test_a_registration_racing_the_other_endpoints_last_unregister_keeps_the_tensor(store_url, uname,
                                                                                      monkeypatch):
    """Endpoint b lets go of the tensor's segment (its last export) and copies the tensor back
    into private memory; endpoint a registers the same tensor meanwhile. a's registration waits
    for that move and then moves the tensor into a segment of its own: a's export is where the
    tensor is, so a peer's put through a lands in it. (Before, a moved the tensor into its new
    segment in the middle of b's move out, which then re-pointed it to private memory: a's
    peers' puts were reported done and lost.) Held deterministically: b's copy out waits."""
    with _peer_and_two_endpoints(store_url, uname) as (peer, a, b):
        w = torch.zeros(N)
        b.register("w", w)
        real = torch.empty_like
        moving, go = threading.Event(), threading.Event()

        def held_copy_out(t, *args, **kwargs):  # b's move back into private memory, held
            if t is w:
                moving.set()
                assert go.wait(10)
            return real(t, *args, **kwargs)

        monkeypatch.setattr(torch, "empty_like", held_copy_out)
        out: dict[str, BaseException] = {}

        def run(name: str, fn) -> threading.Thread:
            def body() -> None:
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001 - reported by the test
                    out[name] = exc
            thread = threading.Thread(target=body)
            thread.start()
            return thread

        unregistering = run("unregister", lambda: b.unregister("w"))
        assert moving.wait(10)
        registering = run("register", lambda: a.register("w", w))
        threading.Timer(0.3, go.set).start()
        unregistering.join(20)
        registering.join(20)
        assert not unregistering.is_alive() and not registering.is_alive() and not out, out
        monkeypatch.setattr(torch, "empty_like", real)
        _put(peer, a.name, 31)
        assert same_bytes(w, make_tensor("float32", (N,), 31))
        assert peer.call("get_check", a.name, {"w": (*SPEC, 31)}, 10.0) == {"w": True}


@pytest.mark.parametrize("last", [True, False])
def test_a_copy_back_asked_by_one_endpoint_is_made_by_the_last_to_let_go(store_url, uname, last):
    """Endpoint a unregisters the tensor asking for the copy back (the default) while b still exports
    it: nothing moves yet. b then unregisters it last, with or without ``copy_back``: the copy is made
    either way (before, b's copy_back=False left the tensor in the segment a's peers had mapped, and a
    stale mapping of it still wrote the tensor)."""
    from transport.planes.shm_export import map_segment

    with transport.BlockingEndpoint(uname("a"), store=store_url, timeout=10) as a, \
            transport.BlockingEndpoint(uname("b"), store=store_url, timeout=10) as b:
        w = torch.zeros(N)
        a.register("w", w)
        b.register("w", w)
        h = a._ep._exports.registry.get("w").exports["shm"].handle
        stale = map_segment(h)  # what a same-host peer of a holds after an op on "w"
        a.unregister("w")
        b.unregister("w", copy_back=last)
        stale[h.offset:h.offset + 4].view(torch.float32)[0] = 42.0  # a late write through that mapping
        assert float(w[0]) == 0.0, "the tensor still lies in the segment a's peers mapped"


def test_a_copy_back_is_made_only_for_the_tensor_that_asked(store_url, uname):
    """A view registered beside its base shares the base's segment: unregistering the view (asking for
    the copy back) moves nothing, since the base is still registered, and nothing is owed later either:
    closing the endpoint leaves the base where it is (no copy on the loop at close); a view let go with
    copy_back=False after its base stays a view of it (the copy asked for one tensor was made for
    another, the last to let go, before)."""
    with transport.BlockingEndpoint(uname("a"), store=store_url, timeout=10) as a:
        big = torch.zeros(N)
        a.register("big", big)
        head = big[:64]
        a.register("head", head)
        at = big.data_ptr()
        a.unregister("head")
        a.close()
        assert big.data_ptr() == at and head.data_ptr() == at, "a copy was made at close for what another asked"
    with transport.BlockingEndpoint(uname("b"), store=store_url, timeout=10) as b:
        arena = torch.zeros(N)
        b.register("arena", arena)
        head = arena[:64]
        b.register("head", head)
        b.unregister("arena")  # head still registered: arena stays where it is
        b.unregister("head", copy_back=False)
        arena[0] = 5.0
        assert float(head[0]) == 5.0, "head was copied out of its segment against copy_back=False"


def test_a_registration_that_a_later_exporter_refuses_leaves_no_segment_open(store_url, uname):
    """``shm`` exports a tensor (moving it into a segment) and a later exporter of the endpoint
    raises: the registration fails, and the shm export is undone with it (it stayed in its
    segment's exports before: the segment's fd was never closed, for the life of the process)."""
    from transport.planes import shm_export
    from transport.planes.base import Exporter

    class Refuses(Exporter):
        plane = "refuses"
        wire_field = ""

        def export(self, buf: Any) -> None:
            raise transport.BufferMismatchError("refused by a later exporter (a peer's frozen copy, say)")

    with transport.BlockingEndpoint(uname("a"), store=store_url, timeout=10) as a:
        exporters = a._ep._exports.exporters
        shm = next(e for e in exporters if e.plane == "shm")
        exporters.append(Refuses())
        w = torch.arange(N, dtype=torch.float32)
        with pytest.raises(transport.BufferMismatchError, match="refused by a later exporter"):
            a.register("w", w)
        exporters.pop()
        assert "w" not in a.buffers
        assert [s for s in shm.segments if s.fd >= 0] == [], "a segment of the refused registration is still open"
        assert not any(s.holds(w) for s in shm_export._LIVE.values())
        assert torch.equal(w, torch.arange(N, dtype=torch.float32))
        a.register("w", w)  # and it can be registered again, once nothing refuses
        assert "w" in a.buffers
