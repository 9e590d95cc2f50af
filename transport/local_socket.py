"""Channels to a peer on this host over a Unix-domain socket instead of loopback TCP.

Every endpoint listens on TCP (its record's ``host:port``, for peers anywhere) and, on Linux, on
an abstract Unix-domain socket too (:func:`listen`; its name goes in the record's ``unix``). A
dialer whose peer is on the same host (:func:`transport.hostinfo.same_host`) connects to that
socket first: a small ``sendmsg`` on a Unix socket costs about 3 us where loopback TCP's costs
15-25 us on an idle 2-core VM and over 100 us under load (the whole TCP receive path runs in the
sender's system call), and a round trip takes half as long. What goes over the socket is the same either way: the same
handshake with the same secret (its proofs bound to the Unix name instead of ``host:port``), the
same frames; only the socket's family differs. The dialer also checks that the process at the
other end (``SO_PEERCRED``) is the one the record names: anyone on the host can listen on an
abstract name, and a process squatting on a published one is not dialled.

Abstract Unix names belong to a network namespace: a same-host peer in another one (a container,
or the test suite's namespaces standing in for other hosts) refuses the Unix connect, and the
dialer logs that and dials TCP (:attr:`transport.Peer.socket` says which a channel took).
``TRANSPORT_UNIX_SOCKETS=0`` in the environment turns Unix sockets off (every channel on TCP, as
before; ``bench/bench_transport.py`` uses it to measure the ``tcp`` plane over TCP).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
import sys
import time
from typing import Any

from .hostinfo import local_host, same_host

__all__ = ["connect", "connect_record", "enabled", "family_name", "is_unix", "listen", "peer_pid", "proof_address", "unix_address"]

log = logging.getLogger("transport.endpoint")

_PREFIX = "transport-rl/"


def enabled() -> bool:
    """Whether endpoints listen on, and dial, Unix sockets (Linux, ``TRANSPORT_UNIX_SOCKETS`` not off)."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "AF_UNIX"):
        return False
    return os.environ.get("TRANSPORT_UNIX_SOCKETS", "1").strip().lower() not in ("0", "false", "no", "off")


def unix_address(name: str) -> str:
    """The socket address of the abstract name ``name`` (a leading NUL: nothing in the file system)."""
    return "\0" + name


def listen(incarnation: int) -> tuple[socket.socket, str] | None:
    """A non-blocking listening socket on a fresh abstract name, and the name (None: Unix
    sockets are off, or binding failed; then the endpoint is reached over TCP only)."""
    if not enabled():
        return None
    name = f"{_PREFIX}{os.getpid()}/{incarnation:x}/{secrets.token_hex(4)}"
    try:
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:  # (a sandbox that forbids AF_UNIX, no descriptor left)
        return None
    try:
        lsock.bind(unix_address(name))
        lsock.listen(128)
        lsock.setblocking(False)
    except OSError:
        lsock.close()
        return None
    return lsock, name


def connect(name: str) -> socket.socket:
    """A non-blocking socket connected to the abstract name ``name``. A Unix connect completes at
    once or fails: ``BlockingIOError`` when the listener's backlog is full (try again later),
    another ``OSError`` when nobody listens there (or Unix sockets cannot be made here)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect(unix_address(name))
    except BaseException:
        sock.close()
        raise
    return sock


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a connected Unix socket (its listener's, as
    of ``listen``), as this pid namespace numbers it (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", creds)
    return int(pid)


def proof_address(name: str) -> tuple[str, int]:
    """What the handshake's proofs bind a connection over the Unix socket ``name`` to, in place of
    the TCP ``(host, port)``: a proof made for one listener never passes at another."""
    return f"unix:{name}", 0


def is_unix(sock: socket.socket) -> bool:
    """Whether ``sock`` is a Unix-domain socket (else TCP)."""
    return sock.family == getattr(socket, "AF_UNIX", None)


def family_name(sock: socket.socket) -> str:
    """``"unix"`` or ``"tcp"``: the kind of socket a channel runs on."""
    return "unix" if is_unix(sock) else "tcp"


async def connect_record(peer: str, rec: Any, deadline: float) -> socket.socket | None:
    """A connected socket to ``rec``'s Unix-socket listener, if it has one, is on this host,
    takes the connection and is the process the record names (the dialer's first try);
    None: dial TCP (logged when a Unix socket was there to try). A full backlog is retried
    until ``deadline``."""
    name = rec.unix
    if not name or not enabled():
        return None
    if not same_host(local_host(), rec.hostinfo)[0]:
        return None
    if len(name) > 100 or "\0" in name:
        log.warning("endpoint %r publishes an invalid Unix socket name %r; dialling TCP", peer, name)
        return None
    delay = 0.002
    while True:
        try:
            sock = connect(name)
            break
        except BlockingIOError:  # the listener's backlog is full (its loop is busy accepting): again, shortly
            if time.monotonic() + delay >= deadline:
                log.info("endpoint %r: its Unix socket's backlog stayed full until the deadline; dialling TCP",
                         peer)
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        except OSError as exc:
            log.info("endpoint %r is on this host, but its Unix socket refused (%s: another network namespace, "
                     "or gone); dialling TCP at %s:%d", peer, exc, rec.host, rec.port)
            return None
    want = rec.hostinfo.pid
    try:
        got = peer_pid(sock)
    except OSError as exc:
        got, why = -1, str(exc)
    else:
        why = f"pid {got}"
    if want and got != want:
        sock.close()
        log.warning("endpoint %r: the process listening on its Unix socket %r is not the endpoint's (%s, the "
                    "record says pid %d); dialling TCP at %s:%d", peer, name, why, want, rec.host, rec.port)
        return None
    return sock
