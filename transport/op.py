"""One in-flight op of the initiator's side (:class:`Op`), as the channel and the planes share it.

The channel makes it (:meth:`transport.channel.Channel.new_op`), a plane moves its bytes and sends
its header, and whoever learns of its end (the channel's reader, a copy thread, a device's
completion) settles its future. The flags a plane sets while it writes into memory (``busy``,
``quiet``, ``stuck``) tell the channel's abandon what is still running once the caller gave up
(see :mod:`transport.planes.base`).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import torch

from .flight_recorder import OpKind, Record

__all__ = ["Op"]


class _Quiet:
    """A ``threading.Event`` for "the op writes no more", made cheap for the common case where
    nobody waits: the real event is created only by a waiter (``set`` and ``wait`` from any
    thread). A waiter re-reads the flag after creating the event, so a ``set`` that ran between
    its first look and the creation is never missed."""

    __slots__ = ("_event", "_set")

    def __init__(self) -> None:
        self._set = False
        self._event: threading.Event | None = None

    def set(self) -> None:
        self._set = True
        event = self._event
        if event is not None:
            event.set()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        with _QUIET_LOCK:
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        if self._set:
            return True
        return event.wait(timeout)


_QUIET_LOCK = threading.Lock()


class Op:
    """One in-flight op of this side: its future, sequence number and record."""

    __slots__ = ("abandon_bound", "abandoned", "after", "busy", "dests", "future", "gated", "inline", "keep", "kind", "lock",
                 "note", "on_wire", "op_id", "quiet", "record", "seq", "staged", "stuck", "via_link")

    def __init__(self, loop: asyncio.AbstractEventLoop, op_id: int, seq: int, kind: OpKind, record: Record,
                 inline: bool = True) -> None:
        self.op_id = op_id
        self.seq = seq
        self.kind = kind
        self.record = record
        self.future: asyncio.Future[None] = loop.create_future()
        # tcp/staged get: where the reply's bytes go (a memoryview of CPU memory, or a tensor to stage into)
        self.dests: list[memoryview | torch.Tensor] | None = None
        self.staged = False  # a get whose reply is staged into the caller's tensors (copies may lag the socket)
        self.keep: Any = None  # tensors referenced until the op is over
        self.inline = inline  # the op's bytes travel in the channel's stream (tcp framing)
        self.gated = False  # its plane may wait before sending: later ops are kept behind it (OpTable.run)
        self.note = kind in (OpKind.NOTIFY, OpKind.POST)  # it carries a notification: it spends a credit (transport.credits)
        self.abandoned = False
        self.on_wire = False  # its header was handed to the sender
        # Writing into the caller's tensors or the peer's buffer (a get's payload, a local copy, an shm or
        # cuda_ipc put's copy): ``busy`` is set under
        # ``lock`` when it starts, unless the op was abandoned first; ``quiet`` is set once it
        # will write no more.
        self.lock = threading.Lock()
        self.busy = False
        self.quiet = _Quiet()
        self.stuck = False  # a staged copy into the caller's tensor outlived its bound (may still write)
        self.via_link = False  # its bytes move over the channel's link: posted work that cannot be called
        # back (a timeout aborts the link, and the channel with it; see OpTable)
        # the op's own posted work (its sends and receives on the link): the op ends only once it completed too
        self.after: asyncio.Future[None] | None = None
        self.abandon_bound = 1.0  # how long an abandoned op may still be writing (the caller's tensors, the peer's buffer)
