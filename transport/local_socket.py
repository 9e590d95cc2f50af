"""Channels to a peer on this host over a Unix-domain socket instead of loopback TCP.

Every endpoint listens on TCP (its record's ``host:port``, for peers anywhere) and, on Linux, on
an abstract Unix-domain socket too (:func:`listen`; its name goes in the record's ``unix``). A
dialer whose peer is on the same host (:func:`transport.hostinfo.same_host`) connects to that
socket first: a small ``sendmsg`` on a Unix socket costs about 3 us where loopback TCP's costs
15-25 us on an idle 2-core VM and over 100 us under load (the whole TCP receive path runs in the
sender's system call), and a round trip takes half as long (``bench/README.md``). What goes over the socket is the same either way: the same
handshake with the same secret, the same frames; only the socket's family differs.

Abstract Unix names belong to a network namespace: a same-host peer in another one (a container,
or the test suite's namespaces standing in for other hosts) refuses the Unix connect, and the
dialer logs that and dials TCP (:attr:`transport.Peer.socket` says which a channel took).
``TRANSPORT_UNIX_SOCKETS=0`` in the environment turns Unix sockets off (every channel on TCP, as
before; ``bench/bench_transport.py`` uses it to measure the ``tcp`` plane over TCP).
"""

from __future__ import annotations

import os
import secrets
import socket
import sys

__all__ = ["enabled", "family_name", "listen", "unix_address"]

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
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lsock.bind(unix_address(name))
        lsock.listen(128)
        lsock.setblocking(False)
    except OSError:
        lsock.close()
        return None
    return lsock, name


def family_name(sock: socket.socket) -> str:
    """``"unix"`` or ``"tcp"``: the kind of socket a channel runs on."""
    return "unix" if sock.family == getattr(socket, "AF_UNIX", None) else "tcp"
