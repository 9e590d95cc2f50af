"""A channel's opening: the authenticated handshake on a fresh socket, and the peer's registry checked.

Runs on the event loop before a :class:`~transport.channel.Channel` exists: the challenge and proof
of :mod:`transport.auth`, then the ``Hello`` of each side (protocol version, incarnation, host,
planes, registry), every read bounded by the handshake's deadline and by
:data:`~transport.wire.MAX_PREAUTH_FRAME` before the peer has proved the secret.
:func:`specs_from_wire` turns a peer's registry (from its ``Hello`` or a later ``Registry``) into
specs, refusing whatever a hostile or broken peer could send.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch

from . import auth
from .errors import AuthenticationError, ProtocolError
from .planes import export_fault
from .registry import BufferSpec, dtype_from_name
from .wire import (
    MAX_FRAME,
    MAX_LOST,
    MAX_PREAUTH_FRAME,
    PROTOCOL_VERSION,
    Bye,
    Challenge,
    Hello,
    Message,
    Proof,
    WireBuffer,
    decode,
    decode_preauth,
    encode_frame,
    frame_length,
)

__all__ = ["check_hello", "close_if_cancelled", "hang_up", "handshake", "specs_from_wire"]

_INT64_MAX = (1 << 63) - 1
_DEVICE = re.compile(r"cpu|cuda(:[0-9]{1,4})?")  # devices a peer's buffer may be on


def specs_from_wire(buffers: Sequence[WireBuffer]) -> dict[str, BufferSpec]:
    """Check a peer's registry and turn it into specs; :class:`ProtocolError` if malformed.

    Element counts and sizes are computed with Python ints (no wrap-around): a shape whose
    element count, or byte size, does not fit in int64 is refused, as is one whose byte size
    differs from ``nbytes``. Whatever else goes wrong on the peer's values is a
    :class:`ProtocolError` too."""
    out: dict[str, BufferSpec] = {}
    for b in buffers:
        try:
            out[b.name] = _spec_from_wire(b)
        except ProtocolError:
            raise
        except Exception as exc:  # anything the peer's values make go wrong is the peer's error
            raise ProtocolError(f"peer registry: buffer {b.name[:80]!r} is malformed: {type(exc).__name__}: "
                                f"{str(exc)[:200]}") from None
    return out


def _spec_from_wire(b: WireBuffer) -> BufferSpec:
    try:
        dtype = dtype_from_name(b.dtype)
    except KeyError:
        raise ProtocolError(f"peer registry: buffer {b.name!r} has unknown dtype {b.dtype!r}") from None
    if any(d < 0 for d in b.shape):
        raise ProtocolError(f"peer registry: buffer {b.name!r} has a negative dimension {b.shape[:8]}")
    if not _DEVICE.fullmatch(b.device):
        raise ProtocolError(f"peer registry: buffer {b.name!r} is on an unknown device {b.device[:40]!r}")
    # Python ints (torch.Size.numel() would wrap around), stopped as soon as the count passes int64:
    # a product of a hostile frame's huge dimensions would take quadratic time
    overflow = any(d > _INT64_MAX for d in b.shape)
    numel = 0 if 0 in b.shape else 1
    if numel and not overflow:
        for d in b.shape:
            numel *= d
            if numel * dtype.itemsize > _INT64_MAX:
                overflow = True
                break
    if overflow:
        raise ProtocolError(f"peer registry: buffer {b.name!r} has shape {b.shape[:8]}: its element count "
                            "overflows int64")
    if numel * dtype.itemsize != b.nbytes:
        raise ProtocolError(f"peer registry: buffer {b.name!r} claims {b.nbytes} bytes for {b.dtype}"
                            f"{b.shape[:8]}")
    fault = export_fault(b)  # (each plane checks the handle it announced)
    if fault is not None:
        raise ProtocolError(f"peer registry: buffer {b.name!r} {fault}")
    return BufferSpec(b.name, dtype, torch.Size(b.shape), b.device, b.nbytes)


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise EOFError("connection closed during the handshake")
        got += k
    return bytes(buf)


async def _recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, limit: int = MAX_FRAME) -> bytes:
    """One frame's body; :class:`ProtocolError` if its length exceeds ``limit``."""
    try:
        n = frame_length(await _recv_exact(loop, sock, 4))
    except ValueError as exc:
        raise ProtocolError(f"malformed handshake frame: {exc}") from None
    if n > limit:
        raise ProtocolError(f"handshake frame of {n} bytes where at most {limit} were expected (a peer of another "
                            "protocol version, or not one of ours)")
    return await _recv_exact(loop, sock, n)


async def _recv_preauth(loop: asyncio.AbstractEventLoop, sock: socket.socket, want: str) -> Challenge | Proof | Bye:
    """A frame of a peer that has not proved itself yet: small, and only a few types decoded."""
    body = await _recv_frame(loop, sock, MAX_PREAUTH_FRAME)
    try:
        msg = decode_preauth(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed handshake frame (expected {want}): {exc}") from None
    if isinstance(msg, int):
        if msg != PROTOCOL_VERSION:
            raise ProtocolError(f"peer speaks protocol {msg}, this endpoint speaks {PROTOCOL_VERSION}")
        raise AuthenticationError(f"peer sent its hello without proving that it belongs to the job (expected {want})")
    return msg


def check_hello(msg: Message) -> Hello:
    """A peer's first frame, checked; :class:`ProtocolError` if it is not a usable ``Hello``."""
    if not isinstance(msg, Hello):
        raise ProtocolError(f"expected a hello frame, got {type(msg).__name__}")
    if msg.protocol != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol {msg.protocol}, this endpoint speaks {PROTOCOL_VERSION}")
    if not msg.name:
        raise ProtocolError("peer sent an empty endpoint name")
    if msg.notify_window < 1:
        raise ProtocolError(f"peer granted {msg.notify_window} notification credits (at least 1)")
    if len(msg.lost) > MAX_LOST:
        raise ProtocolError(f"peer named {len(msg.lost)} lost channels (at most {MAX_LOST})")
    specs_from_wire(msg.buffers)
    return msg


def _decode_hello(body: bytes) -> Hello:
    try:  # (decode turns every failure into a DecodeError; check_hello raises ProtocolError only)
        return check_hello(decode(body))
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed hello: {exc}") from None


async def _refuse(loop: asyncio.AbstractEventLoop, sock: socket.socket, reason: str) -> None:
    """Tell a dialer why it is refused (bounded); the caller then hangs up with :func:`hang_up`."""
    try:
        async with asyncio.timeout(1.0):
            await loop.sock_sendall(sock, encode_frame(Bye(reason)))
    except (OSError, TimeoutError):
        pass


def close_if_cancelled(sock: socket.socket) -> Callable[[asyncio.Task[Any]], None]:
    """A done-callback for the task that handles an accepted ``sock``: it closes ``sock`` if that task
    was cancelled. A task cancelled before its first step never runs its body, so its own clean-up
    cannot; one cancelled later never adopted ``sock`` (adopting is its last step, with no await
    after it), so closing it again is harmless."""

    def done(task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            sock.close()

    return done


async def hang_up(sock: socket.socket, bound: float = 1.0) -> None:
    """Close a refused connection without a reset: send FIN, then read and drop what the peer
    still sends (at most ``bound`` s, 4 MiB), so that a Bye already sent reaches it first."""
    loop = asyncio.get_running_loop()
    try:
        sock.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(bound):
            scratch = bytearray(65536)
            for _ in range(64):
                if await loop.sock_recv_into(sock, scratch) == 0:
                    break
    except (OSError, TimeoutError):
        pass
    sock.close()


async def handshake(sock: socket.socket, hello: Hello, deadline: float, *, dialer: bool, secret: bytes,
                    address: tuple[str, int]) -> Hello:
    """Prove membership of the job both ways, then exchange ``Hello`` frames (see
    :mod:`transport.wire` and :mod:`transport.auth`); on the event loop, bounded by ``deadline``.

    ``address`` is the acceptor's published ``(host, port)`` (the dialer's: from the store
    record). The acceptor reads nothing of the dialer but its ``Proof`` until that checked;
    the dialer sends its ``Hello`` only once the acceptor's proof checked.

    ``sock`` must be non-blocking. Raises :class:`AuthenticationError` for a proof that does not
    check (either side) or a refusal, :class:`ProtocolError` for a wrong version or anything
    malformed (whatever the decoder raised), ``TimeoutError`` at the deadline,
    ``OSError``/``EOFError`` for I/O trouble.
    """
    loop = asyncio.get_running_loop()
    host, port = address
    async with asyncio.timeout_at(deadline):
        if dialer:
            msg = await _recv_preauth(loop, sock, "a challenge")
            if not isinstance(msg, Challenge):
                raise ProtocolError(f"expected a challenge, got {type(msg).__name__}")
            if msg.protocol != PROTOCOL_VERSION:
                raise ProtocolError(f"peer speaks protocol {msg.protocol}, this endpoint speaks {PROTOCOL_VERSION}")
            if len(msg.nonce) != auth.NONCE_BYTES:
                raise ProtocolError(f"challenge with a nonce of {len(msg.nonce)} bytes")
            nonce_a, nonce_d = msg.nonce, auth.new_nonce()
            mac = auth.prove(secret, "dialer", nonce_a, nonce_d, host, port)
            await loop.sock_sendall(sock, encode_frame(Proof(mac, nonce_d)))
            msg = await _recv_preauth(loop, sock, "the acceptor's proof")
            if isinstance(msg, Bye):
                raise AuthenticationError(f"the peer refused us: {msg.reason[:300]}")
            if not isinstance(msg, Proof):
                raise ProtocolError(f"expected a proof, got {type(msg).__name__}")
            if not auth.verify(secret, msg.mac, "acceptor", nonce_a, nonce_d, host, port):
                raise AuthenticationError(f"the peer at {host}:{port} did not prove that it belongs to the job (it "
                                          "holds another secret, or none)")
            remote = _decode_hello(await _recv_frame(loop, sock))
            await loop.sock_sendall(sock, encode_frame(hello))
            return remote
        nonce_a = auth.new_nonce()
        await loop.sock_sendall(sock, encode_frame(Challenge(PROTOCOL_VERSION, nonce_a)))
        msg = await _recv_preauth(loop, sock, "a proof")
        if not isinstance(msg, Proof):
            raise ProtocolError(f"expected a proof, got {type(msg).__name__}")
        if len(msg.nonce) != auth.NONCE_BYTES or not auth.verify(secret, msg.mac, "dialer", nonce_a, msg.nonce,
                                                                 host, port):
            await _refuse(loop, sock, "not authenticated: your proof does not match this endpoint's secret (every "
                                      "endpoint of a job needs the same secret: the same secret= or "
                                      f"${auth.SECRET_ENV}, or none, to use the store's)")
            raise AuthenticationError("the peer did not prove that it belongs to the job (wrong or missing secret)")
        mac = auth.prove(secret, "acceptor", nonce_a, msg.nonce, host, port)
        await loop.sock_sendall(sock, encode_frame(Proof(mac)) + encode_frame(hello))
        return _decode_hello(await _recv_frame(loop, sock))
