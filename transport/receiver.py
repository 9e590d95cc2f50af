"""The receiving half of a channel's socket: frames and payloads, read by the reader thread only.

Bytes are read ahead into a small buffer: one ``recv`` takes whatever the kernel holds (up to
:data:`READ_AHEAD` bytes), so a small op's frame header, body and payload (a 4 KiB put, an ack)
usually arrive in a single system call instead of one per part, and a burst of acks in one.
Everything read from the socket goes through :meth:`Receiver.recv_into`, which serves buffered
bytes first; a payload larger than what is buffered is received straight into its destination.

Large payloads: receiving one of ``LOWAT_FROM`` bytes or more, the receiver raises SO_RCVLOWAT so
that the kernel wakes it once a chunk of a quarter of the payload (at most ``LOWAT_MAX``) has
arrived, instead of for every few segments: on loopback each wake-up of the reader costs the
sending side an inter-processor wake-up, and those made a 64 MiB put 20-30% slower than a plain
socket. The first chunk is copied while the rest still arrives; SO_RCVLOWAT never exceeds what is
still to come of the payload from the socket (so the wait always ends; read-ahead bytes are
consumed before the socket is asked for more), nor a quarter of the socket's receive buffer (above
that the kernel clamps the receive window to it, and the bytes waited for might never be let in).

Every wait ends within ``RX_POLL_S``, so a slow payload still counts as traffic (:attr:`last_rx`)
and the wait ends with ``EOFError`` once ``is_open()`` turns false.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Callable

from .local_socket import is_unix
from .wire import MAX_FRAME

__all__ = ["LOWAT_FROM", "READ_AHEAD", "RX_POLL_S", "Receiver"]

LOWAT_FROM = 512 << 10
LOWAT_MAX = 2 << 20
LOWAT_MIN = 64 << 10  # smaller chunks are not worth a setsockopt
RX_POLL_S = 1.0  # the longest wait in one call: the caller rechecks the channel and a payload's progress
READ_AHEAD = 64 << 10  # bytes one read of the socket may take beyond what is asked for
_SCRATCH = 1 << 20
_LEN = struct.Struct("<I")


class Receiver:
    """Reads one socket's frames and payloads (one thread only; not thread-safe)."""

    def __init__(self, sock: socket.socket, is_open: Callable[[], bool]) -> None:
        self._sock = sock
        self._is_open = is_open
        self._buf = bytearray(READ_AHEAD)
        self._view = memoryview(self._buf)
        self._start = 0  # buffered bytes are self._buf[_start:_end]
        self._end = 0
        self._lowat = 1  # the socket's SO_RCVLOWAT
        self._rx_cap = 0  # the largest SO_RCVLOWAT for the payload being received
        # a Unix socket's readiness ignores SO_RCVLOWAT (Linux's unix_poll): large payloads are read as they come
        self._use_lowat = not is_unix(sock)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self.last_rx = time.monotonic()  # the last time bytes arrived

    def seen(self) -> None:
        """Count now as traffic (:attr:`last_rx`): the reader waits on purpose, not for the peer."""
        self.last_rx = time.monotonic()

    def start(self) -> None:
        """Bound every blocking ``recv`` (see :meth:`recv_into`); the writer's sends are not affected."""
        tv = struct.pack("ll", int(RX_POLL_S), int((RX_POLL_S % 1) * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)

    # ------------------------------------------------------------------ frames
    def read_frame(self) -> memoryview | bytes:
        """The next frame's body (valid until the next call). Waits for it, polling rather than
        blocking in ``recv``: a thread blocked in ``recv`` is woken, to no purpose, every time the
        kernel frees send space on the same socket, i.e. all the way through our own writer's large
        ``sendall``; ``poll`` is woken for incoming bytes only. Raises ``ValueError`` for an
        oversize length, ``EOFError`` once the peer or the channel closed."""
        if self._end - self._start < 4:
            self._fill(4)
        (n,) = _LEN.unpack_from(self._buf, self._start)
        if n > MAX_FRAME:
            raise ValueError(f"frame length {n} exceeds the limit of {MAX_FRAME} bytes")
        if 4 + n <= READ_AHEAD:
            if self._end - self._start < 4 + n:
                self._fill(4 + n)
            s = self._start + 4
            self._start = s + n
            return self._view[s : s + n]
        self._start += 4  # a frame larger than the buffer (a registry, a notification): its own copy
        body = bytearray(n)
        self.recv_into(memoryview(body))
        return bytes(body)

    def _fill(self, want: int) -> None:
        """Read until ``want`` bytes are buffered (``want`` <= READ_AHEAD)."""
        if self._start and READ_AHEAD - self._start < want:  # compact: the frame must fit in one piece
            left = self._end - self._start
            self._buf[:left] = self._view[self._start : self._end]
            self._start, self._end = 0, left
        self._set_lowat(1)  # a payload may have left it raised
        while self._end - self._start < want:
            while not self._poll.poll(RX_POLL_S * 1000):
                if not self._is_open():
                    raise EOFError("channel closed")
            try:
                k = self._sock.recv_into(self._view[self._end :], READ_AHEAD - self._end, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if k == 0:
                raise EOFError("connection closed by peer")
            self._end += k
            self.last_rx = time.monotonic()

    # ------------------------------------------------------------------ the event loop's reads
    # (transport.loop_reads: used only by whoever owns the socket's reading at the time, never both)
    def buffered(self) -> bool:
        """Whether read-ahead bytes are waiting to be parsed."""
        return self._end > self._start

    def fill_nowait(self) -> int:
        """Take whatever the kernel holds now (up to what the buffer has room for) without
        waiting; the bytes read. Raises ``EOFError`` once the peer closed, ``OSError`` on a
        socket error."""
        if self._start:  # compact: a frame must fit in one piece
            left = self._end - self._start
            self._buf[:left] = self._view[self._start : self._end]
            self._start, self._end = 0, left
        if self._end == READ_AHEAD:
            return 0
        try:
            k = self._sock.recv_into(self._view[self._end :], READ_AHEAD - self._end, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        if k == 0:
            raise EOFError("connection closed by peer")
        self._end += k
        self.last_rx = time.monotonic()
        return k

    def peek_frame(self) -> memoryview | None:
        """The body of the next frame if it is buffered whole, without consuming it (valid until
        the next read); None if it is not (yet), or if it could never be (larger than the buffer,
        or than the limit: only :meth:`read_frame` handles those, see :meth:`whole_frame_fits`)."""
        have = self._end - self._start
        if have < 4:
            return None
        (n,) = _LEN.unpack_from(self._buf, self._start)
        if 4 + n > READ_AHEAD or have < 4 + n:
            return None
        s = self._start + 4
        return self._view[s : s + n]

    def whole_frame_fits(self) -> bool:
        """False if the next frame's length is known and it could never be buffered whole."""
        if self._end - self._start < 4:
            return True
        (n,) = _LEN.unpack_from(self._buf, self._start)
        return 4 + n <= READ_AHEAD

    def payload_fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` of payload behind the frame :meth:`peek_frame` returned could be
        buffered whole with it (else only the thread's :meth:`recv_into` can take them)."""
        (n,) = _LEN.unpack_from(self._buf, self._start)
        return 4 + n + nbytes <= READ_AHEAD

    def peek_payload(self, nbytes: int) -> memoryview | None:
        """The ``nbytes`` of payload behind the frame :meth:`peek_frame` returned, if they are
        buffered whole (valid until the next read); None if not yet (ask :meth:`payload_fits`
        first: one that does not fit never will be)."""
        (n,) = _LEN.unpack_from(self._buf, self._start)
        s = self._start + 4 + n
        if self._end - s < nbytes:
            return None
        return self._view[s : s + nbytes]

    def consume_frame(self, payload: int = 0) -> None:
        """Step over the frame :meth:`peek_frame` returned (and the ``payload`` bytes behind it,
        which :meth:`peek_payload` returned)."""
        (n,) = _LEN.unpack_from(self._buf, self._start)
        self._start += 4 + n + payload
        if self._start == self._end:
            self._start = self._end = 0

    def reset_lowat(self) -> None:
        """SO_RCVLOWAT back to 1 (a payload may have raised it): readiness means any byte again."""
        self._set_lowat(1)

    # ------------------------------------------------------------------ payloads
    def _set_lowat(self, lowat: int) -> None:
        if lowat != self._lowat:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            self._lowat = lowat

    def recv_into(self, view: memoryview, more: int = 0, total: int = 0) -> None:
        """Fill ``view``: read-ahead bytes first, then from the socket. ``view`` is part of a payload
        of ``total`` bytes, of which ``more`` follow it.

        With SO_RCVLOWAT at 1, a blocking ``recv_into`` (GIL released). Raised, a ``poll`` for it,
        then a non-blocking ``recv_into`` of whatever is queued: a blocking ``recv`` that already
        took some bytes would sleep until SO_RCVLOWAT *more* arrived, which the tail of a payload
        never provides.
        """
        n = len(view)
        got = 0
        have = self._end - self._start
        if have:
            got = min(have, n)
            view[:got] = self._view[self._start : self._start + got]
            self._start += got
            if self._start == self._end:
                self._start = self._end = 0
            if got == n:
                return
        sock = self._sock
        cap = 0
        if total >= LOWAT_FROM and self._use_lowat:
            if n + more == total:  # the payload's first part: size its chunks once
                self._rx_cap = min(LOWAT_MAX, total // 4, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4)
            cap = self._rx_cap
        while got < n:
            want = n - got
            left = want + more  # what the socket still owes of the payload (nothing of it is buffered now)
            lowat = min(cap, left) if cap >= LOWAT_MIN and left >= LOWAT_MIN else 1
            self._set_lowat(lowat)
            try:
                if lowat == 1:
                    k = sock.recv_into(view[got:], want)
                else:
                    self._poll.poll(RX_POLL_S * 1000)
                    k = sock.recv_into(view[got:], want, socket.MSG_DONTWAIT)
            except BlockingIOError:  # nothing arrived within RX_POLL_S
                if not self._is_open():
                    raise EOFError("channel closed") from None
                continue
            if k == 0:
                raise EOFError("connection closed by peer")
            got += k
            self.last_rx = time.monotonic()

    def drain(self, n: int, more: int = 0, total: int = 0) -> None:
        """Receive ``n`` bytes of a payload into scratch (a rejected op's bytes, an abandoned get's)."""
        scratch = memoryview(bytearray(min(max(n, 1), _SCRATCH)))
        total = total or n
        while n > 0:
            k = min(n, len(scratch))
            n -= k
            self.recv_into(scratch[:k], n + more, total)
