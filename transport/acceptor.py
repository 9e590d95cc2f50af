"""Accepting connections on a listening socket, with nothing left behind when the endpoint closes.

Connections are taken by a reader callback of the event loop, not by ``loop.sock_accept``: the
callback accepts every pending connection and hands each to its handler at once (the handler
starts that connection's task, synchronously), so no accepted socket ever waits in a future. With
``sock_accept``, a close that cancelled the accepting task after the kernel handed over a
connection but before the task resumed left that socket to the garbage collector (the dialer saw
neither a handshake nor an EOF until then), and Python 3.11's own callback could accept one more
connection into a future already cancelled and drop it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

__all__ = ["accept_until_cancelled"]

log = logging.getLogger("transport.endpoint")

_FATAL = (errno.EBADF, errno.ENOTSOCK, errno.EINVAL)  # the listener itself is gone
_RETRY_S = 0.1  # a transient failure (EMFILE, ENFILE, ENOBUFS, ECONNABORTED, ...) pauses accepting this long
_WARN_EVERY_S = 10.0  # and is logged at most this often (running out of descriptors lasts)


async def accept_until_cancelled(listener: socket.socket, handle: Callable[[socket.socket, Any], None],
                                 accepting: Callable[[], bool], name: str) -> None:
    """Accept connections on ``listener`` (non-blocking) until cancelled, or until the listener
    fails; each accepted socket (non-blocking) goes to ``handle(sock, address)``, called on the
    loop. While ``accepting()`` is false (the endpoint is closing) a connection is closed at once
    instead. Out of descriptors or memory, or a connection aborted before it was taken: accepting
    pauses for 0.1 s, then goes on (logged at most every 10 s); EBADF, ENOTSOCK or EINVAL on the
    listener ends it (logged). Cancelling it removes the reader before it returns: nothing is
    accepted after that."""
    loop = asyncio.get_running_loop()
    fd = listener.fileno()
    ended: asyncio.Future[None] = loop.create_future()
    warned = -1e9
    paused: asyncio.TimerHandle | None = None

    def resume() -> None:
        nonlocal paused
        paused = None
        if not ended.done():
            loop.add_reader(fd, take)

    def take() -> None:
        nonlocal warned, paused
        while not ended.done():
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                loop.remove_reader(fd)
                if exc.errno in _FATAL:
                    log.error("endpoint %r: its listener failed (%s); it accepts no more connections", name, exc)
                    ended.set_result(None)
                    return
                now = time.monotonic()
                if now - warned >= _WARN_EVERY_S:
                    warned = now
                    log.warning("endpoint %r: accepting a connection failed: %s; retrying every %g s", name, exc,
                                _RETRY_S)
                paused = loop.call_later(_RETRY_S, resume)
                return
            if not accepting():
                sock.close()
                continue
            try:
                sock.setblocking(False)
                handle(sock, address)
            except BaseException:
                sock.close()
                raise

    loop.add_reader(fd, take)
    try:
        await ended
    finally:
        if not ended.done():
            ended.cancel()
        if paused is not None:
            paused.cancel()
        loop.remove_reader(fd)
