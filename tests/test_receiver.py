"""The receiving half of a channel's socket (transport.receiver), over real loopback TCP.

A writer thread sends frames and payloads cut at random byte boundaries with random pauses; the
receiver must hand back every frame body and payload byte exactly, whatever its read-ahead took,
and must never wait for bytes that are not coming (a raised SO_RCVLOWAT beyond what the socket still
owes would stall each such wait for a whole poll interval).
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

import pytest

from transport import receiver as rxmod
from transport.receiver import LOWAT_FROM, READ_AHEAD, Receiver
from transport.wire import MAX_FRAME


@pytest.fixture
def conn():
    ls = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(ls.getsockname())
    b, _ = ls.accept()
    ls.close()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    yield a, b
    a.close()
    b.close()


def _frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def _writer(sock: socket.socket, data: bytes, rng: random.Random, errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            i = 0
            while i < len(data):
                k = rng.choice([1, 3, 17, 4096, 65536, 300_000, 2 << 20])
                sock.sendall(data[i : i + k])
                i += k
                if rng.random() < 0.05:
                    time.sleep(0.002)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_frames_and_payloads_cut_anywhere_arrive_whole(conn):
    a, b = conn
    rng = random.Random(7)
    ops = []
    stream = bytearray()
    for _ in range(120):
        body = rng.randbytes(rng.choice([0, 1, 19, 300, READ_AHEAD - 4, READ_AHEAD - 3, READ_AHEAD + 10, 200_000]))
        payload = rng.randbytes(rng.choice([0, 0, 5, 4096, READ_AHEAD, LOWAT_FROM, 3 << 20]))
        cuts = sorted(rng.sample(range(len(payload) + 1), k=min(3, len(payload) + 1)))
        ops.append((body, payload, cuts))
        stream += _frame(body) + payload
    errors: list[BaseException] = []
    w = _writer(a, bytes(stream), rng, errors)
    rx = Receiver(b, lambda: True)
    rx.start()
    waits = []
    real_poll = rx._poll.poll

    def timed_poll(ms):
        t0 = time.monotonic()
        r = real_poll(ms)
        waits.append((time.monotonic() - t0, bool(r)))
        return r

    rx._poll = type("P", (), {"poll": staticmethod(timed_poll)})()
    for i, (body, payload, cuts) in enumerate(ops):
        got = bytes(rx.read_frame())
        assert got == body, f"frame {i}: body differs"
        out = bytearray(len(payload))
        view = memoryview(out)
        bounds = [0, *cuts, len(payload)]
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            rx.recv_into(view[lo:hi], len(payload) - hi, len(payload))
        assert out == payload, f"op {i}: payload differs"
    w.join(30)
    assert not errors
    stalls = [d for d, ready in waits if not ready]
    assert not stalls, f"{len(stalls)} polls waited {rxmod.RX_POLL_S} s for bytes that were not coming"


def test_drain_skips_exactly_the_payload(conn):
    a, b = conn
    a.sendall(_frame(b"one") + b"x" * (LOWAT_FROM + 5) + _frame(b"two"))
    rx = Receiver(b, lambda: True)
    rx.start()
    assert bytes(rx.read_frame()) == b"one"
    rx.drain(LOWAT_FROM + 5)
    assert bytes(rx.read_frame()) == b"two"


def test_peer_closing_mid_frame_is_eof(conn):
    a, b = conn
    a.sendall(_frame(b"abcdef")[:6])
    a.close()
    rx = Receiver(b, lambda: True)
    rx.start()
    with pytest.raises(EOFError):
        rx.read_frame()


def test_oversize_length_is_refused_before_reading_it(conn):
    a, b = conn
    a.sendall(struct.pack("<I", MAX_FRAME + 1))
    rx = Receiver(b, lambda: True)
    rx.start()
    with pytest.raises(ValueError, match="exceeds"):
        rx.read_frame()


def test_a_closed_channel_ends_the_wait(conn):
    _, b = conn
    is_open = threading.Event()
    is_open.set()
    rx = Receiver(b, is_open.is_set)
    rx.start()
    threading.Timer(0.2, is_open.clear).start()
    t0 = time.monotonic()
    with pytest.raises(EOFError, match="channel closed"):
        rx.read_frame()
    assert time.monotonic() - t0 < 10 * rxmod.RX_POLL_S
