"""Replies read on the event loop: who reads a channel's socket, the reader thread or the loop.

Without this, the answer to an op (an ``Ack``) wakes the channel's reader thread, which parses it
and wakes the event loop (``call_soon_threadsafe``): two wake-ups on the op's critical path, each
50-180 us on a loaded VM. While the loop has ops of its own waiting on a channel, or posted to
the peer (most often answered by a post of the peer's: rl_sync's requests and replies), it reads
that channel's socket itself (``add_reader``), settles the ops whose answers it finds and delivers
the peer's notifications itself: one wake-up.

Only the thread serves the peer's ops (the target's half never depends on the application's loop),
and only one of them reads at a time: :class:`LoopReads` hands the socket over at frame boundaries.
A channel uses it only where a peer's registry update may wait for the loop (``tcp`` and ``shm``:
every op is checked against the live export; see ``DataPlane.answers_on_loop``).

Theory of operation (owner of the reads)::

    owner   event                                            next     effect
    THREAD  the loop starts an op or posts (wants replies)   THREAD   the thread is woken (wake pipe)
    THREAD  the loop wants, no frame for HOLD_S (or the      LOOP     SO_RCVLOWAT 1; the loop add_reader()s
            last was an answer to its op, or a Notify), the loop ran the
            last hand-over (it is not behind), and nothing
            handed back to the thread is left unread
    LOOP    Ack / Fail / Ping whole in the read-ahead; a     LOOP     consumed and handled on the loop
            get's Data into CPU tensors, with its payload
            (frame and payload fit in the read-ahead); a
            Notify the endpoint's queue has room for
    LOOP    any other frame (a peer's op, a staged get's     THREAD   left unread for the thread; the loop
            Data or a larger one, a registry, a frame                 remove_reader()s and wakes the thread
            larger than the buffer), EOF
    LOOP    bytes waiting STALL_S, the loop not reading      THREAD   taken back by the thread (checked every
            (busy, or blocked by the application)                     WATCH_S); the loop stops wanting
    LOOP    no op pending and nothing read for WATCH_S       THREAD   taken back, likewise
    any     the channel closes                               -        the loop unregisters; the thread exits

While the thread reads after the loop wanted, it keeps reading until no frame came for ``HOLD_S``
(so two-way traffic does not hand over at every frame), unless its last frame was an answer to
one of the loop's ops (a reply handed back to it, e.g. a get's too large for the read-ahead) and
none of the peer's own frames came for ``HOLD_S``: then it hands the reads over again at once, or
back-to-back ops would keep it reading for good. The loop reads only under :attr:`lock`
with the owner ``LOOP``; the owner becomes ``LOOP`` only by the thread's hand-over, so the thread
never reads while the loop may. The loop registers a ``dup`` of the socket's descriptor, closed
when it unregisters: a socket closed from another thread meanwhile can never leave the loop's
selector watching a descriptor number reused by another file.

``TRANSPORT_LOOP_READS=0`` in the environment turns this off (every frame read by the thread, as
before; for comparison in ``bench/bench_transport.py``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence, Sized
from typing import Any, Protocol

import msgspec

from .errors import ERROR_KINDS, RemoteError
from .receiver import READ_AHEAD, RX_POLL_S, Receiver
from .wire import Ack, Credit, Data, Fail, Notify, Ping, decode

__all__ = ["HOLD_S", "LOOP_DATA_MAX", "STALL_S", "WATCH_S", "LoopReads", "Owner", "enabled", "loop_takes", "rejected"]

log = logging.getLogger("transport.channel")

WATCH_S = 0.02  # while the loop reads: how often the thread checks that it still does
STALL_S = 0.02  # bytes left unread this long while the loop owns the reads: the thread takes them back
HOLD_S = 0.005  # the thread keeps reading after a frame that was its own until none came for this long
LOOP_DATA_MAX = READ_AHEAD - 4096  # the largest get reply payload the loop takes (whole, from the read-ahead)


def loop_takes(dests: Sequence[object]) -> bool:
    """Whether the loop takes a get's reply into ``dests`` itself: CPU byte views (not a staged
    get's tensors) of at most :data:`LOOP_DATA_MAX` bytes in all."""
    total = 0
    for d in dests:
        if type(d) is not memoryview:
            return False
        total += len(d)
    return total <= LOOP_DATA_MAX


def rejected(ch: Any, op: Any, msg: Fail) -> BaseException:
    """The error a ``Fail`` frame settles ``op`` of channel ``ch`` with; a notified op's credit is
    refunded (refused, its notification was never queued there)."""
    if op.note:
        ch.credits.refund()
    return ERROR_KINDS.get(msg.kind, RemoteError)(f"{ch.peer_name!r} rejected the op: {msg.message}")


def enabled() -> bool:
    """Whether channels let their event loop read replies (``TRANSPORT_LOOP_READS``, default on)."""
    return os.environ.get("TRANSPORT_LOOP_READS", "1").strip().lower() not in ("0", "false", "no", "off")


class Owner(enum.Enum):
    THREAD = "thread"
    LOOP = "loop"


class _Channel(Protocol):
    loop: asyncio.AbstractEventLoop
    peer_name: str
    link: Any  # the NCCL link (its Fail frames are the thread's: link.not_posted)
    credits: Any  # the channel's notification credits (transport.credits.NoteCredits)
    core: Any  # the endpoint (its pauses: transport.pauses)

    @property
    def is_open(self) -> bool: ...


class _Ops(Protocol):
    pending: dict[int, Any]

    def pop(self, op_id: int) -> Any: ...

    def settle(self, op: Any, exc: BaseException | None) -> None: ...


class LoopReads:
    """Who reads one channel's socket (see the module's theory of operation). The thread calls
    :meth:`wait_turn` and :meth:`thread_read`; the loop :meth:`want_replies` and :meth:`close`."""

    def __init__(self, channel: _Channel, sock: socket.socket, rx: Receiver, ops: _Ops,
                 notify: Callable[[Notify, Callable[[Callable[[], None]], None]], bool] | None = None) -> None:
        self.ch = channel
        # serves a notification on the loop (False: it is the thread's); its answer, if any, is handed to
        # the second argument, and sent by _on_readable as soon as it let go of the lock (this same turn)
        self._notify = notify
        self._answers: list[Callable[[], None]] = []
        self.loop = channel.loop
        self.sock = sock
        self.rx = rx
        self.ops = ops
        self.lock = threading.Lock()
        self.owner = Owner.THREAD
        self.want = False  # the loop has ops waiting on this channel (event loop sets; either clears)
        self.loop_seen = 0.0  # when the loop last read (or was handed the reads)
        self.thread_seen = 0.0  # when the thread last handled a frame
        self.loop_frames = 0  # frames the loop handled (tests, doctor)
        self.handovers = 0  # times the reads went to the loop
        self._gen = 0  # bumped at each hand-over to the loop: only that hand-over's _arm lets the loop read
        self._armed = -1  # the hand-over the loop armed for
        self._seen_gen = 0  # the latest hand-over whose _arm the loop ran (it is not behind: it may get another)
        self._must_read = False  # handed back (or taken back) for bytes waiting: read them before giving again
        self._answers_only = False  # the thread's last frame was an answer to one of the loop's ops
        self._peer_seen = 0.0  # when the thread last handled a frame that was not such an answer
        self._unread_since: float | None = None  # (the thread's stall check) when it first saw bytes unread
        self._go = threading.Event()  # the thread, waiting while the loop reads: the reads are back, or closed
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll = select.poll()  # the thread's wait between frames: the socket, and the loop's wake-ups
        self._poll.register(sock, select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)
        self._peek = select.poll()  # whether bytes wait on the socket (the thread's stall check)
        self._peek.register(sock, select.POLLIN)
        self._fd: int | None = None  # the loop's dup of the socket's descriptor, while registered
        self._closed = False

    # ------------------------------------------------------------------ the reader thread
    def wait_turn(self) -> bool:
        """Reader thread, at a frame boundary: wait until the thread should read the next frame
        (bytes are buffered or arrived, and the reads are the thread's). False once the channel
        is no longer open. Hands the reads to the loop while it wants them."""
        ch = self.ch
        while ch.is_open:
            if self.owner is Owner.LOOP:
                self._go.wait(WATCH_S)
                self._go.clear()
                self._check_loop()
                continue
            if self.rx.buffered():
                return True
            timeout = RX_POLL_S
            if self.want and not self._must_read:
                if self._seen_gen != self._gen:  # the loop has not run the last hand-over yet (busy, blocked)
                    timeout = WATCH_S
                else:
                    now = time.monotonic()
                    idle = now - self.thread_seen
                    if idle >= HOLD_S or (self._answers_only and now - self._peer_seen >= HOLD_S):
                        self._give()
                        continue
                    timeout = HOLD_S - idle
            self.rx.reset_lowat()  # (a payload may have raised it: a small frame would never wake the poll)
            ready = False
            for fd, _ in self._poll.poll(timeout * 1000):
                if fd == self._wake_r:
                    self._drain_wake()
                else:
                    ready = True
            if ready:
                return True
        return False

    def thread_read(self, answer: bool = False) -> None:
        """Reader thread: it handled a frame; ``answer``: one the loop could have (an answer to
        an op of ours: ``Ack``, ``Fail``, ``Data``; or a notification, most often the answer to
        one of our posts)."""
        self.thread_seen = time.monotonic()
        self._must_read = False
        self._answers_only = answer
        if not answer:
            self._peer_seen = self.thread_seen

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 64):
                pass
        except (BlockingIOError, OSError):
            pass

    def _give(self) -> None:
        """Reader thread: the reads go to the loop. The loop reads only once this hand-over's
        ``_arm`` ran: it is queued behind the settlements this thread queued before it, so ops
        settle in the order their answers came (a callback of an earlier hand-over reads nothing)."""
        with self.lock:
            if not self.ch.is_open or self._closed:
                return
            self.rx.reset_lowat()
            self.owner = Owner.LOOP
            self.loop_seen = time.monotonic()
            self._unread_since = None
            self.handovers += 1
            self._gen += 1
            gen = self._gen
        try:
            self.loop.call_soon_threadsafe(self._arm, gen)
        except RuntimeError:  # the loop is closed: the thread keeps reading
            with self.lock:
                self.owner = Owner.THREAD
                self.want = False

    def _check_loop(self) -> None:
        """Reader thread, every WATCH_S while the loop reads: take the reads back from a loop that
        leaves bytes unread (busy or blocked) or has no op waiting any more."""
        now = time.monotonic()
        with self.lock:
            if self.owner is not Owner.LOOP:
                return
            unread = self.rx.buffered() or bool(self._peek.poll(0))
            if not unread or (self._unread_since is not None and self.loop_seen >= self._unread_since):
                self._unread_since = now if unread else None  # (the loop read since: a new wait starts)
            elif self._unread_since is None:
                self._unread_since = now
            if self._closed or not self.ch.is_open:
                why = "closed"
            elif self._unread_since is not None and now - self._unread_since >= STALL_S:
                why = f"the loop left bytes unread for {(now - self._unread_since) * 1e3:.0f} ms"
            elif now - self.loop_seen >= WATCH_S and not self.ops.pending:
                why = ""
            else:
                return
            self.owner = Owner.THREAD
            self._must_read = self._unread_since is not None
            self._unread_since = None
            self.want = False  # the loop asks again with its next op ...
            if self.ops.pending:  # (... unless one came just now: its want_replies may have seen want still set)
                self.want = True
            self.thread_seen = now  # (it reads before it may give again)
        if why and why != "closed":
            log.debug("channel to %r: reads taken back by the thread: %s", self.ch.peer_name, why)

    # ------------------------------------------------------------------ the event loop
    def want_replies(self) -> None:
        """Event loop: an op of ours now waits for its answer on this channel. Not on a channel
        with an NCCL link: its ops trade frames both ways (set-up, ``Go``) that only the thread
        handles, so the reads would change hands at every op."""
        if self.want or self.ch.link is not None:
            return
        self.want = True
        if self.owner is Owner.THREAD:
            self._poke(b"w")

    def _poke(self, what: bytes) -> None:
        """Any thread: wake the thread from its wait between frames (never once the pipe is closed)."""
        with self.lock:
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, what)
            except (BlockingIOError, OSError):  # (full: it is awake anyway)
                pass

    def _arm(self, gen: int) -> None:
        """Event loop: the thread handed the reads over: watch the socket, and read what is there."""
        with self.lock:
            self._seen_gen = max(self._seen_gen, gen)
            if self.owner is not Owner.LOOP or self._closed or not self.ch.is_open or gen != self._gen:
                return
            self._armed = gen
            if self._fd is None:
                try:
                    self._fd = os.dup(self.sock.fileno())
                    self.loop.add_reader(self._fd, self._on_readable)
                except (OSError, ValueError, RuntimeError) as exc:  # the socket was closed meanwhile, no fd left
                    self._unregister()
                    self.want = False  # (until the next op: never a hand-over per frame that cannot work)
                    self._hand_back(f"cannot watch the socket: {exc}")
                    return
        self._on_readable()

    def _on_readable(self) -> None:
        """Event loop: read what the socket holds; handle the answers, leave the rest to the thread.
        The answers to the peer's notifications read here go out before it returns (outside the
        lock: a send that fails breaks the channel, which takes it), never on a later turn of the
        loop, which the application's code may hold up."""
        if not self.lock.acquire(blocking=False):
            return  # the thread is taking the reads back: the selector calls again if it did not
        try:
            self._read_locked()
        finally:
            self.lock.release()
            if self._answers:  # (a list swapped only when there is something to send: every read passes here)
                answers, self._answers = self._answers, []
                for answer in answers:
                    answer()

    def _read_locked(self) -> None:
        """Event loop, under the lock: :meth:`_on_readable`'s reads."""
        if self.owner is not Owner.LOOP or self._closed or not self.ch.is_open:
            self._unregister()
            return
        if self._armed != self._gen:  # a callback of an earlier hand-over: this one's _arm comes next
            return
        rx, watch = self.rx, self.ch.core.pauses
        self.loop_seen = time.monotonic()
        try:
            rx.fill_nowait()
        except (EOFError, OSError) as exc:  # the thread meets it too, and breaks the channel
            self._hand_back(f"the socket ended: {exc}")
            return
        while True:
            body = rx.peek_frame()
            if body is None:
                if not rx.whole_frame_fits():
                    self._hand_back("a frame larger than the read-ahead")
                return
            if watch is not None and watch.paused():  # (no frame handled before the check: transport.pauses)
                self._hand_back("this process was paused: the thread waits for the store's answer")
                return
            try:
                msg = decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                self._hand_back("a frame that does not parse")  # (the thread breaks the channel)
                return
            if isinstance(msg, Ack):
                rx.consume_frame()
                op = self.ops.pop(msg.op_id)
                if op is not None:
                    self.ops.settle(op, None)
            elif isinstance(msg, Ping):
                rx.consume_frame()
            elif isinstance(msg, Credit):
                rx.consume_frame()
                self.ch.credits.returned(msg.total)
            elif isinstance(msg, Data):
                if not self._take_data(msg):
                    return
            elif isinstance(msg, Notify) and self._notify is not None:
                if not self._notify(msg, self._answers.append):  # (the thread waits for room; no hand-over per frame meanwhile)
                    self.want = bool(self.ops.pending)
                    self._hand_back("a notification the loop cannot deliver (too large, past its credits, or the "
                                    "endpoint is closing)")
                    return
                rx.consume_frame()
            elif isinstance(msg, Fail) and self.ch.link is None:
                rx.consume_frame()
                op = self.ops.pop(msg.op_id)
                if op is not None:
                    self.ops.settle(op, rejected(self.ch, op, msg))
            else:
                self._hand_back("")
                return
            self.loop_frames += 1

    def spin(self, fut: asyncio.Future[Any], budget: float, ready: Sized) -> bool | None:
        """Event loop: read the socket right here (as :meth:`_on_readable` does when the selector
        calls it) until ``fut`` is done, ``budget`` seconds passed, or the loop has something to
        run (``ready``, its queue of ready callbacks, is not empty: an answer read here woke
        another task) (:mod:`transport.answer_spin`). True: ``fut`` is done; False: the budget
        ran out; None: it stopped for another reason (the reads are not, or no longer, the
        loop's; the loop has work), or never started."""
        if self.owner is not Owner.LOOP or self._armed != self._gen:
            return None
        end = time.perf_counter() + budget
        while not fut.done():
            self._on_readable()
            if fut.done():
                break
            if self.owner is not Owner.LOOP or ready:
                return None
            if time.perf_counter() >= end:
                return False
        return True

    def _take_data(self, msg: Data) -> bool:
        """Event loop, under the lock: a get's reply (``Data`` and its payload) into the caller's
        CPU tensors, if it is buffered whole; True if it was consumed. Not yet whole: False, and
        the selector calls again as the rest arrives. One that could never be buffered whole, or
        of a get the thread must serve (staged, unknown): handed back. An op abandoned meanwhile
        (on this loop) gets nothing written: its bytes are stepped over."""
        op = self.ops.pending.get(msg.op_id)
        dests = None if op is None else op.dests
        if op is None or dests is None or not loop_takes(dests):
            self._hand_back("")  # (the thread's: unknown, staged, or larger than the read-ahead)
            return False
        nbytes = sum(len(d) for d in dests)
        if not self.rx.payload_fits(nbytes):
            self._hand_back("a get reply larger than the read-ahead")
            return False
        payload = self.rx.peek_payload(nbytes)
        if payload is None:  # (not whole yet: the selector calls again as the rest arrives)
            return False
        if not op.abandoned:
            off = 0
            for d in dests:
                d[:] = payload[off : off + len(d)]
                off += len(d)
        self.rx.consume_frame(nbytes)
        if self.ops.pop(msg.op_id) is not None:
            self.ops.settle(op, None)
        return True

    def _hand_back(self, why: str) -> None:
        """Event loop, under the lock: the reads go back to the thread (the next frame is its, or
        the end of the socket: it reads before it may give the reads again)."""
        self.owner = Owner.THREAD
        self.thread_seen = time.monotonic()
        self._must_read = True
        self._unregister()
        self._go.set()
        if why:
            log.debug("channel to %r: reads back to the thread: %s", self.ch.peer_name, why)

    def _unregister(self) -> None:
        """Event loop: stop watching the socket."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                self.loop.remove_reader(fd)
            except (ValueError, RuntimeError):
                pass
            os.close(fd)

    def wake(self) -> None:
        """Any thread: the channel closed: let the thread notice at once."""
        self._go.set()
        self._poke(b"c")

    def close(self) -> None:
        """Event loop, once the channel closed: stop watching the socket and release the thread."""
        with self.lock:
            self._closed = True
            self.owner = Owner.THREAD
            self._unregister()
        self.wake()

    def release(self) -> None:
        """Any thread, once the reader thread has exited: close the wake pipe (and the loop's
        descriptor, if the loop is gone and never unregistered it). Idempotent."""
        with self.lock:
            if self._fd is not None and self.loop.is_closed():
                fd, self._fd = self._fd, None
                os.close(fd)
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
