"""Hostile or malformed control frames close that one channel, with a logged
protocol error; the process and its other channels carry on. Frames that follow
the handshake come from a peer that proved it holds the job's secret
(``tests/_wire_peer.py`` does the handshake by hand); see also
``tests/test_auth.py`` and ``tests/test_fuzz_wire.py``."""

from __future__ import annotations

import logging
import socket
import struct

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transport
from tests import _wire_peer as peer
from transport import wire
from transport.planes import nccl_frames


@pytest.fixture(scope="module")
def target(store_url, tmp_path_factory):
    import uuid

    with transport.BlockingEndpoint(f"hostile-tgt-{uuid.uuid4().hex[:6]}", store=store_url, timeout=5,
                                    dump_dir=tmp_path_factory.mktemp("fr")) as ep:
        ep.register("w", torch.zeros(64, dtype=torch.float32))
        yield ep


@pytest.fixture(scope="module")
def friend(store_url, target):
    import uuid

    with transport.BlockingEndpoint(f"friend-{uuid.uuid4().hex[:6]}", store=store_url, timeout=10) as ep:
        ep.connect(target.name)
        yield ep


def _assert_usable(friend, target, value: float) -> None:
    src = torch.full((64,), value)
    friend.put(target.name, {"w": src})
    out = torch.empty(64)
    friend.get(target.name, {"w": out})
    assert torch.equal(out, src)


def _send_and_finish(sock: socket.socket, data: bytes) -> None:
    """Send ``data`` and half-close; the target may hang up first, which is what we test for."""
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:  # EPIPE, ECONNRESET, ENOTCONN: the target already hung up
        pass


def _send_and_probe(sock: socket.socket, data: bytes) -> None:
    """Send ``data`` then a valid Ping, keeping the socket open both ways: only a target that
    rejects ``data`` closes the connection (no EOF from us to hide behind)."""
    try:
        sock.sendall(data + wire.encode_frame(wire.Ping()))
    except OSError:  # the target already hung up
        pass


_closed_by_peer = peer.closed_by_peer


def _dial(target) -> socket.socket:
    return peer.dial(target.address)


def _hello(protocol: int = wire.PROTOCOL_VERSION, name: str = "mallory", buffers=()) -> wire.Hello:
    return peer.hello(protocol, name, buffers)


def _handshaken(target) -> socket.socket:
    return peer.handshaken(target.address, target._ep._secret)


@pytest.mark.parametrize("after_handshake", [False, True], ids=["instead-of-hello", "after-handshake"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(min_size=1, max_size=2048))
def test_random_bytes(target, friend, after_handshake, junk):
    s = _handshaken(target) if after_handshake else _dial(target)
    try:
        _send_and_finish(s, junk)
        assert _closed_by_peer(s)
    finally:
        s.close()


def test_oversize_length_prefix(target, friend, caplog):
    caplog.set_level(logging.ERROR, logger="transport")
    s = _dial(target)
    try:
        _send_and_probe(s, b"\xff\xff\xff\x7f" + b"x" * 100)
        assert _closed_by_peer(s)
    finally:
        s.close()
    assert any("protocol error" in r.getMessage() for r in caplog.records)
    _assert_usable(friend, target, 1.0)


def test_wrong_protocol_version(target, friend, caplog):
    """A peer of another version sends its Hello first (as protocol 2 did): only its version is
    decoded, and the error names it."""
    caplog.set_level(logging.ERROR, logger="transport")
    s = _dial(target)
    try:
        _send_and_probe(s, wire.encode_frame(_hello(protocol=99)))
        assert _closed_by_peer(s)
    finally:
        s.close()
    assert any("protocol 99" in r.getMessage() for r in caplog.records)
    _assert_usable(friend, target, 2.0)


def _nested_maps(depth: int) -> bytes:
    return b"\x81\xa1a" * depth + b"\xc0"


def _deep_frame(tag: str, depth: int = 100_000) -> bytes:
    """A frame ``{"type": tag, "zz": {"a": {"a": ... nil}}}``, nested ``depth`` maps deep (an
    unknown field: msgspec skips it, recursively)."""
    tag_b = tag.encode()
    body = b"\x82\xa4type" + bytes([0xA0 | len(tag_b)]) + tag_b + b"\xa2zz" + _nested_maps(depth)
    return struct.pack("<I", len(body)) + body


def _no_stray_errors(caplog) -> None:
    """Nothing but the logged protocol error: no crashed reader, no unretrieved task exception."""
    for r in caplog.records:
        msg = r.getMessage()
        assert "crashed" not in msg and "never retrieved" not in msg and "unexpectedly" not in msg, msg


def test_deeply_nested_frame_instead_of_the_proof(target, friend, caplog):
    """Nested maps where the proof should be: 100k levels are refused on their length (a frame
    read before the proof is at most 4 KiB), 1300 levels (3.9 KiB) are decoded and refused for
    their depth; both a logged protocol error, that connection closed."""
    caplog.set_level(logging.ERROR)
    for depth, why in ((100_000, "at most 4096"), (1300, "nested too deeply")):
        s = _dial(target)
        try:
            peer.read_frame(s)  # the challenge
            _send_and_probe(s, _deep_frame("proof", depth))
            assert _closed_by_peer(s)
        finally:
            s.close()
        assert any("protocol error" in r.getMessage() and why in r.getMessage() for r in caplog.records), why
    _no_stray_errors(caplog)
    _assert_usable(friend, target, 2.5)


def test_deeply_nested_hello(target, friend, caplog):
    """A proved peer whose Hello nests 100k maps deep: a logged protocol error during the
    handshake (before the fix, a RecursionError escaped the accept task)."""
    caplog.set_level(logging.ERROR)
    s = _dial(target)
    try:
        peer.authenticate(s, target._ep._secret, target.address)
        _send_and_probe(s, _deep_frame("hello"))
        assert _closed_by_peer(s)
    finally:
        s.close()
    assert any("protocol error" in r.getMessage() and "during handshake" in r.getMessage()
               and "nested too deeply" in r.getMessage() for r in caplog.records)
    _no_stray_errors(caplog)
    _assert_usable(friend, target, 2.6)


@pytest.mark.parametrize("tag", ["ping", "registry", "put", "notify"])
def test_deeply_nested_frame_after_the_handshake(target, friend, caplog, tag):
    """The same after the handshake: the reader logs a protocol error (not "reader crashed")
    and closes that channel only."""
    caplog.set_level(logging.ERROR)
    s = _handshaken(target)
    try:
        _send_and_probe(s, _deep_frame(tag))
        assert _closed_by_peer(s)
    finally:
        s.close()
    assert any("protocol error on channel" in r.getMessage() and "nested too deeply" in r.getMessage()
               for r in caplog.records)
    _no_stray_errors(caplog)
    _assert_usable(friend, target, 2.7)


_HUGE = [2**62, 2**62]  # 2**124 elements: torch.Size.numel() wraps to 0


@pytest.mark.timeout(20)
def test_a_shape_of_many_huge_dimensions_is_refused_at_once():
    """The element count stops growing once it passes int64: the product of 200k dimensions of 2**62
    (what a 16 MiB frame can carry, and more) takes quadratic time in Python ints, minutes here."""
    from transport.handshake import specs_from_wire

    bufs = [wire.WireBuffer("w", "float32", [2**62] * 200_000, "cpu", 0)]
    with pytest.raises(transport.ProtocolError, match="overflows int64"):
        specs_from_wire(bufs)


@pytest.mark.parametrize("shape,nbytes", [(_HUGE, 0), ([2**63], 0), ([2**61], 2**63), ([2**64 - 1, 0], 0)],
                         ids=["wraps-to-0", "dim-over-int64", "bytes-over-int64", "uint64-dim-times-0"])
def test_overflowing_shape_in_hello(target, friend, caplog, shape, nbytes):
    caplog.set_level(logging.ERROR)
    bad = wire.WireBuffer("x", "float32", shape, "cpu", nbytes)
    s = _dial(target)
    try:
        peer.authenticate(s, target._ep._secret, target.address)
        _send_and_probe(s, wire.encode_frame(_hello(buffers=[bad])))
        assert _closed_by_peer(s)
    finally:
        s.close()
    assert any("protocol error" in r.getMessage() and "during handshake" in r.getMessage() for r in caplog.records)
    _no_stray_errors(caplog)
    _assert_usable(friend, target, 2.8)


@pytest.mark.parametrize("shape,nbytes", [(_HUGE, 0), ([2**63], 0)], ids=["wraps-to-0", "dim-over-int64"])
def test_overflowing_shape_in_a_registry_update(target, friend, caplog, shape, nbytes):
    msg = wire.Registry(5, [wire.WireBuffer("x", "float32", shape, "cpu", nbytes)])
    _assert_frame_closes_the_channel(target, friend, caplog, msg, 2.9)
    assert any("overflows int64" in r.getMessage() or "malformed" in r.getMessage() for r in caplog.records)
    _no_stray_errors(caplog)


@pytest.mark.parametrize(
    "item",
    [
        wire.Item("w", "float32", -1, 4),  # negative offset
        wire.Item("w", "float32", 0, 2**62),  # absurd size
        wire.Item("w", "no-such-dtype", 0, 4),
    ],
    ids=["negative", "absurd", "bad-dtype"],
)
@pytest.mark.parametrize("kind", ["put", "get"])
def test_out_of_range_ops_close_the_channel(target, friend, caplog, item, kind):
    msg = wire.Put(1, 1, "tcp", [item]) if kind == "put" else wire.Get(1, 1, [item])
    _assert_frame_closes_the_channel(target, friend, caplog, msg)


@pytest.mark.parametrize("kind", ["put", "get"])
def test_a_range_past_the_end_is_rejected_typed_and_drained(target, friend, kind):
    """A range that runs past the end of a registered buffer is what an honest peer sends when its
    copy of the registry is stale (the buffer was re-registered smaller): a typed Fail comes back,
    a put's payload is drained (its size is bounded by the header's checks), nothing is written and
    the channel goes on, like an unknown name (tests/test_regressions.py has the honest case)."""
    before = torch.empty(64)
    friend.get(target.name, {"w": before})
    s = _handshaken(target)
    try:
        item = wire.Item("w", "float32", 60, 10)  # elements [60, 70) of a 64-element buffer
        if kind == "put":
            s.sendall(wire.encode_frame(wire.Put(7, 1, "tcp", [item])) + struct.pack("<10f", *[9.0] * 10))
        else:
            s.sendall(wire.encode_frame(wire.Get(7, 1, [item])))
        msg = _first_answer(s)
        assert isinstance(msg, wire.Fail) and msg.op_id == 7 and msg.kind == "buffer_mismatch", msg
    finally:
        s.close()
    after = torch.empty(64)
    friend.get(target.name, {"w": after})
    assert torch.equal(after, before), "the refused put wrote into the buffer"
    _assert_usable(friend, target, 4.0)


def _first_answer(s: socket.socket) -> wire.Message:
    """Send a Ping behind what was sent on ``s``, then read the first frame the target sends that
    is not a Ping, a Registry or a Lost (naming its earlier channels to "mallory": transport.fence),
    i.e. its answer to the op; bounded by a 10 s socket timeout."""
    s.sendall(wire.encode_frame(wire.Ping()))
    s.settimeout(10)
    while True:
        (n,) = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))
        msg = wire.decode(s.recv(n, socket.MSG_WAITALL))
        if not isinstance(msg, (wire.Ping, wire.Registry, wire.Lost)):
            return msg


def _assert_frame_closes_the_channel(target, friend, caplog, msg, value: float = 3.0) -> None:
    """After a handshake, ``msg`` closes the channel with a logged protocol error; the target
    stays usable for another peer."""
    caplog.set_level(logging.ERROR, logger="transport")
    s = _handshaken(target)
    try:
        _send_and_probe(s, wire.encode_frame(msg))
        assert _closed_by_peer(s)
    finally:
        s.close()
    assert any("protocol error" in r.getMessage() for r in caplog.records)
    _assert_usable(friend, target, value)


def test_unknown_name_is_rejected_and_drained(target, friend):
    """An unknown name is not hostile (a stale cache): the bytes are drained and a Fail comes back."""
    s = _handshaken(target)
    try:
        s.sendall(wire.encode_frame(wire.Put(7, 1, "tcp", [wire.Item("nope", "float32", 0, 4)])) + b"\0" * 16)
        msg = _first_answer(s)
        assert isinstance(msg, wire.Fail) and msg.op_id == 7 and msg.kind == "unknown_buffer"
    finally:
        s.close()
    _assert_usable(friend, target, 4.0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    offset=st.integers(-(2**63), 2**63 - 1),
    count=st.integers(-(2**63), 2**63 - 1),
    dtype=st.sampled_from(["float32", "int64", "uint8", "bogus"]),
)
def test_fuzzed_get_headers_never_hang(target, friend, offset, count, dtype):
    s = _handshaken(target)
    try:
        _send_and_finish(s, wire.encode_frame(wire.Get(1, 1, [wire.Item("w", dtype, offset, count)])))
        assert _closed_by_peer(s)  # either answered then closed at our EOF, or closed for a protocol error
    finally:
        s.close()


@pytest.mark.parametrize("frame", [
    wire.Put(1, 1, "nccl", [wire.Item("w", "float32", 0, 4)]),  # no NCCL link on this channel
    wire.Get(2, 1, [wire.Item("w", "float32", 0, 4)], "nccl"),
    wire.Go(3),
    wire.Put(4, 1, "cuda_ipc", [wire.Item("w", "float32", 0, 4)]),  # no segments
    wire.LinkFrame(b"\xc1 not a link frame"),  # (the link's plane decodes the body)
], ids=["nccl-put", "nccl-get", "go", "ipc-put-no-segments", "link-frame-garbage"])
def test_gpu_plane_frames_out_of_place_close_the_channel(target, friend, caplog, frame):
    _assert_frame_closes_the_channel(target, friend, caplog, frame)


def test_nccl_setup_to_an_endpoint_without_a_link_is_refused(target, friend):
    """A peer that offers no nccl (mallory's Hello) gets no link: its link Setup is answered
    Ready(False), and the channel goes on."""
    s = _handshaken(target)
    try:
        s.sendall(wire.encode_frame(nccl_frames.encode(nccl_frames.Setup(b"x" * 128))))
        s.settimeout(10)
        while True:
            head = s.recv(4, socket.MSG_WAITALL)
            (n,) = struct.unpack("<I", head)
            msg = wire.decode(s.recv(n, socket.MSG_WAITALL))
            if isinstance(msg, wire.LinkFrame):
                msg = nccl_frames.decode(msg.body)
                assert isinstance(msg, nccl_frames.Ready)
                break
        assert msg.ok is False and "does not offer" in msg.reason
    finally:
        s.close()
    _assert_usable(friend, target, 4.0)


def test_a_lost_frame_naming_too_many_channels_closes_the_channel(target, friend, caplog):
    _assert_frame_closes_the_channel(target, friend, caplog, wire.Lost([f"c{i}" for i in range(wire.MAX_LOST + 1)]))


def test_a_hello_naming_too_many_lost_channels_is_refused(target, friend):
    s = peer.dial(target.address)
    try:
        peer.authenticate(s, target._ep._secret, target.address)
        msg = peer.hello()
        msg.lost = [f"c{i}" for i in range(wire.MAX_LOST + 1)]
        _send_and_probe(s, wire.encode_frame(msg))
        assert _closed_by_peer(s)
    finally:
        s.close()
    _assert_usable(friend, target, 6.0)


def test_a_lost_frame_breaks_only_the_senders_own_channels(target, friend):
    """A peer's Lost frame (transport.fence) naming another peer's channel leaves that channel
    alone; one naming the very channel it came on breaks it (and nothing hangs)."""
    theirs = target._ep._connector.channels[friend.name]
    s = _handshaken(target)
    try:
        s.sendall(wire.encode_frame(wire.Lost([theirs.id])) + wire.encode_frame(wire.Ping()))
        assert not _closed_by_peer(s, timeout=1.0)
        s.sendall(wire.encode_frame(wire.Lost([peer.hello().channel_id])))
        assert _closed_by_peer(s)
    finally:
        s.close()
    assert theirs.is_open and target._ep._connector.channels[friend.name] is theirs
    _assert_usable(friend, target, 7.0)


def test_the_endpoint_survived_everything(target, friend):
    _assert_usable(friend, target, 5.0)


def test_decoder_rejects_garbage_with_msgspec_errors():
    deep = _deep_frame("ping")[4:]
    for junk in (b"", b"\x00", b"\xc1", msgspec.msgpack.encode({"type": "put"}), deep):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            wire.decode(junk)
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            wire.decode_preauth(junk)


def test_specs_from_wire_refuses_overflowing_shapes():
    from transport.handshake import specs_from_wire

    for shape, nbytes in ((_HUGE, 0), ([2**63], 0), ([2**32, 2**31], 2**63), ([3], 13)):
        with pytest.raises(transport.ProtocolError):
            specs_from_wire([wire.WireBuffer("x", "float32", shape, "cpu", nbytes)])
    assert specs_from_wire([wire.WireBuffer("x", "float32", [2**20, 2**20], "cpu", 2**42)])["x"].numel == 2**40
