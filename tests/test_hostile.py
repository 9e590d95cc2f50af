"""Hostile or malformed control frames close that one channel, with a logged
protocol error; the process and its other channels carry on."""

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
from transport import wire
from transport.hostinfo import local_host


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


def _closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _dial(target) -> socket.socket:
    return socket.create_connection(target.address, timeout=10)


def _hello(protocol: int = wire.PROTOCOL_VERSION, name: str = "mallory") -> wire.Hello:
    return wire.Hello(protocol, name, 1234, local_host(), ["tcp"], 0, [], "mallory->tgt")


def _handshaken(target) -> socket.socket:
    s = _dial(target)
    s.sendall(wire.encode_frame(_hello()))
    s.settimeout(10)
    head = s.recv(4, socket.MSG_WAITALL)
    (n,) = struct.unpack("<I", head)
    body = s.recv(n, socket.MSG_WAITALL)
    assert isinstance(wire.decode(body), wire.Hello)
    return s


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
    caplog.set_level(logging.ERROR, logger="transport")
    s = _dial(target)
    try:
        _send_and_probe(s, wire.encode_frame(_hello(protocol=99)))
        assert _closed_by_peer(s)
    finally:
        s.close()
    assert any("protocol 99" in r.getMessage() for r in caplog.records)
    _assert_usable(friend, target, 2.0)


@pytest.mark.parametrize(
    "item",
    [
        wire.Item("w", "float32", 60, 10),  # runs past the end
        wire.Item("w", "float32", -1, 4),  # negative offset
        wire.Item("w", "float32", 0, 2**62),  # absurd size
        wire.Item("w", "no-such-dtype", 0, 4),
    ],
    ids=["past-end", "negative", "absurd", "bad-dtype"],
)
@pytest.mark.parametrize("kind", ["put", "get"])
def test_out_of_range_ops_close_the_channel(target, friend, caplog, item, kind):
    msg = wire.Put(1, 1, "tcp", [item]) if kind == "put" else wire.Get(1, 1, [item])
    _assert_frame_closes_the_channel(target, friend, caplog, msg)


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
        s.sendall(wire.encode_frame(wire.Ping()))
        s.settimeout(10)
        while True:
            (n,) = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))
            msg = wire.decode(s.recv(n, socket.MSG_WAITALL))
            if not isinstance(msg, (wire.Ping, wire.Registry)):
                break
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
], ids=["nccl-put", "nccl-get", "go", "ipc-put-no-segments"])
def test_gpu_plane_frames_out_of_place_close_the_channel(target, friend, caplog, frame):
    _assert_frame_closes_the_channel(target, friend, caplog, frame)


def test_nccl_setup_to_an_endpoint_without_a_link_is_refused(target, friend):
    """A peer that offers no nccl (mallory's Hello) gets no link: its NcclSetup is answered
    NcclReady(False), and the channel goes on."""
    s = _handshaken(target)
    try:
        s.sendall(wire.encode_frame(wire.NcclSetup(b"x" * 128)))
        s.settimeout(10)
        while True:
            head = s.recv(4, socket.MSG_WAITALL)
            (n,) = struct.unpack("<I", head)
            msg = wire.decode(s.recv(n, socket.MSG_WAITALL))
            if isinstance(msg, wire.NcclReady):
                break
        assert msg.ok is False and "does not offer" in msg.reason
    finally:
        s.close()
    _assert_usable(friend, target, 4.0)


def test_the_endpoint_survived_everything(target, friend):
    _assert_usable(friend, target, 5.0)


def test_decoder_rejects_garbage_with_msgspec_errors():
    for junk in (b"", b"\x00", b"\xc1", msgspec.msgpack.encode({"type": "put"})):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            wire.decode(junk)
