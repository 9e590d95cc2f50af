"""Fuzzing of the frame decoder and of the handshake (hypothesis).

* The decoder (``wire.decode``, ``wire.decode_preauth``) and the checks the endpoint runs on
  what it decoded (``check_hello``, ``specs_from_wire``, an op item's size) get arbitrary
  bytes, byte-level mutations of valid frames of every message type, and structure-level
  mutations (a value anywhere in a valid frame replaced by another msgpack value): they may
  only return, or raise ``msgspec.DecodeError`` / ``ProtocolError``.
* The handshake: a real listening endpoint is fed, over real sockets, fuzzed first frames
  (where the proof goes) and, after a valid proof, fuzzed Hello frames. Each connection must
  be either refused (closed) or adopted (it answers a Sync), the endpoint logs no crash and no
  unretrieved task error, nothing written into its buffer, and it stays usable.

Each test prints the number of inputs it tried and the outcomes (run with ``-s`` to see them
among the dots; they are printed past the capture either way).
"""

from __future__ import annotations

import copy
import logging
import socket
import struct
import uuid
from collections import Counter
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transport
from tests import _wire_peer as peer
from transport import auth, wire
from transport.errors import ProtocolError
from transport.handshake import check_hello, specs_from_wire
from transport.hostinfo import local_host
from transport.planes import nccl_frames
from transport.ranges import item_bytes

_HOST = local_host()
_SHM = wire.ShmHandle(1234, 7, 99, 4096, 0, 5)
_IPC = wire.IpcHandle("memfd", "dev", b"h" * 64, 4096, 0, 6)


def _samples() -> list[wire.Message]:
    """At least one valid message of every type of the union."""
    bufs = [wire.WireBuffer("w", "float32", [4, 4], "cpu", 64),
            wire.WireBuffer("s", "uint8", [4096], "cpu", 4096, _SHM),
            wire.WireBuffer("g", "bfloat16", [2, 3], "cuda:0", 12, None, _IPC)]
    item = wire.Item("w", "float32", 0, 16, [4, 4])
    out: list[wire.Message] = [
        wire.Hello(wire.PROTOCOL_VERSION, "peer", 2**62, _HOST, ["shm", "tcp"], 3, bufs, "a->b", 10000, ["a->b/1"]),
        wire.Registry(4, bufs),
        wire.Put(1, 1, "tcp", [item], b"note", None),
        wire.Put(2, 2, "shm", [wire.Item("s", "uint8", 8, 100)], None, [5]),
        wire.Get(3, 3, [item]),
        wire.Get(4, 4, [wire.Item("s", "uint8", 0, 8)], "shm", [5]),
        wire.Data(3),
        wire.Notify(5, 5, b"payload"),
        wire.Credit(2500),
        wire.Sync(6),
        wire.Ack(7),
        wire.Fail(8, "unknown_buffer", "no such buffer"),
        wire.Unmapped(9),
        nccl_frames.encode(nccl_frames.Setup(b"u" * 128)),
        nccl_frames.encode(nccl_frames.Ready(True, "cuda:0", "")),
        wire.Go(10),
        wire.Ping(),
        wire.Bye("done"),
        wire.Lost(["a->b/1", "a->b/2"]),
        wire.Challenge(wire.PROTOCOL_VERSION, b"n" * 32),
        wire.Proof(b"m" * 32, b"n" * 32),
    ]
    kinds = {type(m) for m in out}
    assert kinds == set(wire.Message.__args__), kinds  # every message type has a sample
    return out


SAMPLES = _samples()
BODIES = [wire.encode_frame(m)[4:] for m in SAMPLES]
HELLO_BODIES = [b for m, b in zip(SAMPLES, BODIES, strict=True) if isinstance(m, wire.Hello)]
PROOF_BODIES = [b for m, b in zip(SAMPLES, BODIES, strict=True) if isinstance(m, (wire.Proof, wire.Challenge))]

_INTS = st.one_of(st.integers(-(2**63), 2**64 - 1),
                  st.sampled_from([0, -1, 1, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]))
_LEAVES = st.one_of(st.none(), st.booleans(), _INTS, st.floats(), st.text(max_size=24), st.binary(max_size=40))
_VALUES = st.recursive(_LEAVES, lambda c: st.one_of(st.lists(c, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), c, max_size=4)),
                       max_leaves=12)
_SPECIAL = st.sampled_from([[2**62, 2**62], [2**63], [2**64 - 1, 0], [-1], [0] * 200, "x" * 5000,
                            "cuda:99999", "float8", "type", {"type": "hello"}, [[[[[]]]]]])


@st.composite
def byte_mutant(draw: Any, bodies: list[bytes]) -> bytes:
    """A valid body with 1-8 byte-level edits (flip, overwrite, insert, delete, truncate, splice)."""
    data = bytearray(draw(st.sampled_from(bodies)))
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "splice"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete" and data:
            del data[pos:pos + draw(st.integers(1, 16))]
        elif op == "truncate":
            del data[pos:]
        elif op == "splice":
            data[pos:pos + draw(st.integers(0, 8))] = draw(st.sampled_from(
                [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                 b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00", b"\xc1",
                 b"\x91" * 64, b"\x81\xa1a" * 64]))
    return bytes(data)


def _slots(node: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out.append((node, k))
        _slots(v, out)
    return out


@st.composite
def tree_mutant(draw: Any, bodies: list[bytes]) -> bytes:
    """A valid body decoded as plain msgpack, 1-3 values anywhere in it replaced (or a key added
    or removed), encoded again."""
    tree = msgspec.msgpack.decode(draw(st.sampled_from(bodies)))
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(tree, [])
        if not slots:
            break
        node, key = slots[draw(st.integers(0, len(slots) - 1))]
        op = draw(st.sampled_from(["replace", "replace", "special", "drop", "add"]))
        if op == "drop":
            del node[key]
        elif op == "add":
            if isinstance(node, dict):
                node[draw(st.text(max_size=8))] = draw(_VALUES)
            else:
                node.insert(key, draw(_VALUES))
        else:
            node[key] = copy.deepcopy(draw(_SPECIAL if op == "special" else _VALUES))  # (never edit a constant)
    return msgspec.msgpack.encode(tree)


def _judge(body: bytes) -> str:
    """What the endpoint would make of ``body``: 'rejected' by the decoder, 'refused' by its
    checks, or 'accepted'. Anything else raised fails the test (a crash)."""
    try:
        wire.decode_preauth(body)
    except msgspec.DecodeError:
        pass
    try:
        msg = wire.decode(body)
    except msgspec.DecodeError:
        return "rejected"
    try:
        if isinstance(msg, wire.Hello):
            check_hello(msg)
        elif isinstance(msg, wire.Registry):
            specs_from_wire(msg.buffers)
        elif isinstance(msg, (wire.Put, wire.Get)):
            for it in msg.items:
                item_bytes(it)
        elif isinstance(msg, wire.LinkFrame):  # (its body is decoded by its plane, as the reader hands it over)
            nccl_frames.decode(msg.body)
    except ProtocolError:
        return "refused"
    return "accepted"


def _report(capsys: Any, what: str, tally: Counter[str]) -> None:
    with capsys.disabled():
        outcomes = ", ".join(f"{n} {k}" for k, n in sorted(tally.items()))
        print(f"\n[fuzz] {what}: {sum(tally.values())} inputs tried ({outcomes}), 0 crashes")


_FAST = settings(max_examples=2500, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_fuzz_decoder_arbitrary_bytes(capsys):
    tally: Counter[str] = Counter()

    @_FAST
    @given(body=st.binary(max_size=512))
    def run(body: bytes) -> None:
        tally[_judge(body)] += 1

    run()
    assert sum(tally.values()) >= 1000
    _report(capsys, "decoder, arbitrary bytes", tally)


def test_fuzz_decoder_byte_mutations_of_every_message_type(capsys):
    tally: Counter[str] = Counter()

    @_FAST
    @given(body=byte_mutant(BODIES))
    def run(body: bytes) -> None:
        tally[_judge(body)] += 1

    run()
    assert sum(tally.values()) >= 1000 and tally["accepted"] and tally["rejected"], tally
    _report(capsys, f"decoder, byte mutations of {len(BODIES)} valid frames", tally)


def test_fuzz_decoder_structure_mutations_of_every_message_type(capsys):
    tally: Counter[str] = Counter()

    @_FAST
    @given(body=tree_mutant(BODIES))
    def run(body: bytes) -> None:
        tally[_judge(body)] += 1

    run()
    assert sum(tally.values()) >= 1000 and tally["accepted"] and tally["rejected"], tally
    _report(capsys, f"decoder, structure mutations of {len(BODIES)} valid frames", tally)


def test_fuzz_link_frame_bodies(capsys):
    """A link frame's body is the plane's to decode (the core carries it opaque): byte and
    structure mutations of its valid bodies, judged as the reader would hand them over."""
    link_bodies = [nccl_frames.encode(m).body for m in (nccl_frames.Setup(b"u" * 128),
                                                        nccl_frames.Ready(True, "cuda:0", ""),
                                                        nccl_frames.Ready(False, "", "why not"))]
    tally: Counter[str] = Counter()

    @_FAST
    @given(body=st.one_of(byte_mutant(link_bodies), tree_mutant(link_bodies)))
    def run(body: bytes) -> None:
        tally[_judge(wire.encode_frame(wire.LinkFrame(body))[4:])] += 1

    run()
    assert sum(tally.values()) >= 1000 and tally["accepted"] and tally["refused"], tally
    _report(capsys, "link frame bodies, byte and structure mutations", tally)


# --------------------------------------------------------------------------- the handshake, over sockets
@pytest.fixture(scope="module")
def target(store_url, tmp_path_factory):
    with transport.BlockingEndpoint(f"fuzz-tgt-{uuid.uuid4().hex[:6]}", store=store_url, timeout=5,
                                    dump_dir=tmp_path_factory.mktemp("fr")) as ep:
        ep.register("w", torch.zeros(16))
        yield ep


def _frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def _outcome(s: socket.socket) -> str:
    """'adopted' if the target answers our Sync (op 99) with an Ack, 'closed' if it hangs up."""
    s.settimeout(10)
    try:
        while True:
            msg = peer.read_msg(s)
            if isinstance(msg, wire.Ack) and msg.op_id == 99:
                return "adopted"
    except (EOFError, ConnectionResetError):
        return "closed"


def _assert_healthy(target: Any, caplog: Any) -> None:
    for r in caplog.records:
        msg = r.getMessage()
        assert "crashed" not in msg and "never retrieved" not in msg and "unexpectedly" not in msg, msg
        assert r.levelno < logging.CRITICAL
    assert bool((target._ep._registry.get("w").tensor == 0).all())  # nothing fuzzed was ever processed


_NET = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
_PUT = wire.encode_frame(wire.Put(1, 1, "tcp", [wire.Item("w", "float32", 0, 16)])) + b"\x01" * 64


def test_fuzz_handshake_first_frame(target, capsys, caplog, store_url):
    """Fuzzed frames where the proof goes (then a put into 'w' and a Sync): always closed,
    never processed."""
    caplog.set_level(logging.WARNING)
    tally: Counter[str] = Counter()
    proof_like = PROOF_BODIES + HELLO_BODIES

    @_NET
    @given(body=st.one_of(st.binary(max_size=300), byte_mutant(proof_like), tree_mutant(proof_like)))
    def run(body: bytes) -> None:
        s = peer.dial(target.address)
        try:
            peer.read_frame(s)  # the challenge
            try:
                s.sendall(_frame(body) + wire.encode_frame(peer.hello()) + _PUT + wire.encode_frame(wire.Sync(99)))
            except OSError:
                pass
            out = _outcome(s)
        finally:
            s.close()
        assert out == "closed", body
        tally[out] += 1

    run()
    _assert_healthy(target, caplog)
    _report(capsys, "handshake, fuzzed frames instead of the proof (real sockets)", tally)


def test_fuzz_handshake_hello_after_a_valid_proof(target, capsys, caplog, store_url):
    """A proved peer sends a fuzzed Hello (then a Sync): refused (closed) or adopted, nothing else;
    the endpoint stays usable."""
    caplog.set_level(logging.WARNING)
    tally: Counter[str] = Counter()
    secret = target._ep._secret
    hellos = [wire.encode_frame(peer.hello(buffers=[wire.WireBuffer("m", "int64", [3, 5], "cpu", 120)]))[4:],
              wire.encode_frame(peer.hello())[4:]] + HELLO_BODIES

    @_NET
    @given(body=st.one_of(byte_mutant(hellos), tree_mutant(hellos), tree_mutant(hellos)))
    def run(body: bytes) -> None:
        s = peer.dial(target.address)
        try:
            peer.authenticate(s, secret, target.address)
            try:
                s.sendall(_frame(body) + wire.encode_frame(wire.Sync(99)))
            except OSError:
                pass
            tally[_outcome(s)] += 1
        finally:
            s.close()

    run()
    assert tally["closed"] and sum(tally.values()) >= 100
    _assert_healthy(target, caplog)
    with transport.BlockingEndpoint(f"fuzz-friend-{uuid.uuid4().hex[:6]}", store=store_url, timeout=10) as friend:
        out = torch.empty(16)
        friend.get(target.name, {"w": out})
        assert bool((out == 0).all())
    _report(capsys, "handshake, fuzzed hellos after a valid proof (real sockets)", tally)


def test_the_proof_is_what_decides(target):
    """The control for the fuzzers: the same frames behind a valid proof and Hello do reach the buffer."""
    s = peer.handshaken(target.address, target._ep._secret)
    try:
        s.sendall(wire.encode_frame(wire.Put(1, 1, "tcp", [wire.Item("w", "float32", 0, 16)]))
                  + torch.full((16,), 3.0).numpy().tobytes() + wire.encode_frame(wire.Sync(99)))
        assert _outcome(s) == "adopted"
        assert bool((target._ep._registry.get("w").tensor == 3.0).all())
    finally:
        s.close()
        target._ep._registry.get("w").tensor.zero_()
    assert auth.NONCE_BYTES == 32
