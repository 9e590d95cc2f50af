"""A peer that speaks the wire protocol by hand over a raw socket (hostile and fuzz tests).

It does what an endpoint's handshake does, step by step, so that a test can stop, skip or
corrupt any step: read the acceptor's challenge, send a proof (right or wrong), read the
acceptor's proof and Hello, send a Hello.
"""

from __future__ import annotations

import socket
import struct

from transport import auth, wire
from transport.hostinfo import local_host


def dial(address: tuple[str, int], timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(address, timeout=timeout)
    s.settimeout(timeout)
    return s


def read_frame(s: socket.socket) -> bytes:
    """One frame's body (``EOFError`` if the peer hung up first)."""
    head = s.recv(4, socket.MSG_WAITALL)
    if len(head) < 4:
        raise EOFError("closed")
    (n,) = struct.unpack("<I", head)
    body = s.recv(n, socket.MSG_WAITALL)
    if len(body) < n:
        raise EOFError("closed")
    return body


def read_msg(s: socket.socket) -> wire.Message:
    return wire.decode(read_frame(s))


def hello(protocol: int = wire.PROTOCOL_VERSION, name: str = "mallory", buffers=()) -> wire.Hello:
    return wire.Hello(protocol, name, 1234, local_host(), ["tcp"], 0, list(buffers), "mallory->tgt", notify_window=64)


def prove(s: socket.socket, secret: bytes, address: tuple[str, int]) -> tuple[bytes, bytes]:
    """Read the challenge and send the dialer's proof; the two nonces."""
    ch = read_msg(s)
    assert isinstance(ch, wire.Challenge), ch
    nonce_d = auth.new_nonce()
    s.sendall(wire.encode_frame(wire.Proof(auth.prove(secret, "dialer", ch.nonce, nonce_d, *address), nonce_d)))
    return ch.nonce, nonce_d


def authenticate(s: socket.socket, secret: bytes, address: tuple[str, int]) -> wire.Hello:
    """Prove, check the acceptor's proof, and read its Hello (ours is not sent yet)."""
    nonce_a, nonce_d = prove(s, secret, address)
    p = read_msg(s)
    assert isinstance(p, wire.Proof), p
    assert auth.verify(secret, p.mac, "acceptor", nonce_a, nonce_d, *address)
    remote = read_msg(s)
    assert isinstance(remote, wire.Hello)
    return remote


def handshaken(address: tuple[str, int], secret: bytes, msg: wire.Hello | None = None) -> socket.socket:
    """A socket through the whole handshake (our Hello sent): what follows is a channel's traffic."""
    s = dial(address)
    authenticate(s, secret, address)
    s.sendall(wire.encode_frame(msg or hello()))
    return s


def closed_by_peer(s: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the peer closes the connection within ``timeout`` (what it sends is read and dropped)."""
    s.settimeout(timeout)
    try:
        while True:
            if not s.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
