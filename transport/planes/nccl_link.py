"""The ``nccl`` plane's per-channel link: set-up, the order of posts, the target's half, abort.

One :class:`Link` per channel whose endpoints both offer ``nccl`` (:mod:`transport.planes.nccl`
is the initiator's half; :mod:`transport.planes.nccl_engine` what the link posts on), made by the
connector through :meth:`transport.planes.PlaneOffers.link_for`; the core sees it as a
:class:`~transport.planes.base.PeerLink`. Thread-safe; :attr:`Link.lock` orders every post with
the frame that announces it.

Set-up. The dialer is rank 0: right after the handshake it makes a unique id and sends it
(``Setup``, :mod:`transport.planes.nccl_frames`); both sides then join the communicator on a worker thread (non-blocking mode,
bounded by the endpoint's timeout), each says how that went (``Ready``: ok, the device its
side serves, or why not), and the link is usable only when both said ok. A link that fails is torn
down on both sides and GPU ops with that peer take the staged path, with the reason logged and
shown by ``peer.gpu_plane_reason``: never silently.

Order of operations. NCCL matches a channel's sends and receives per peer in posting order, and
one stream runs them one after the other; if both sides posted their own ops first and the peer's
later, each side's send could wait for a receive the peer queued behind its own send: a deadlock.
So every post of the link follows one total order, the dialer's: the dialer posts its own ops at
once and announces them (their headers); the listener posts the dialer's ops as their headers
arrive, and its own ops only when the dialer's ``Go`` for them arrives, which the dialer sends at
the point where it posts its half. Each side posts under :attr:`Link.lock` together with sending
the frame that tells the peer, so the frame order on the wire is the post order.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..completion import CompletionBridge
from ..errors import (
    PeerLostError,
    Phase,
    PlaneUnavailableError,
    ProtocolError,
    TransportError,
    TransportTimeoutError,
    error_kind,
)
from ..flight_recorder import FlightRecorder, OpState
from ..ranges import item_bytes
from ..wire import Ack, Fail, Get, Go, Item, Message, Put
from .nccl_engine import LinkConn, LinkEngine
from .nccl_frames import Ready, Setup, decode, encode

__all__ = ["Link", "LinkChannel", "bytes_of", "resolve"]

log = logging.getLogger(__name__)


class LinkChannel(Protocol):
    """What a link reads and calls of its channel (:class:`transport.channel.Channel`)."""

    core: Any  # the endpoint (its identity keys the teardowns of links with one peer)
    loop: asyncio.AbstractEventLoop
    peer_name: str
    id: str
    recorder: FlightRecorder

    def send(self, msg: Message) -> None: ...

    def send_quietly(self, msg: Message) -> None: ...

    def lose(self, exc: BaseException) -> None: ...

    def link_changed(self) -> None: ...


# Links of this process still being torn down, per (endpoint, peer name). A new link with that peer
# is joined only once they are over: an op that timed out on a link (which aborted it and closed its
# channel) has raised already when the next op dials a new channel, and whatever the aborted link
# still had in flight (our send of the caller's tensor, the target's receive into its buffer) must be
# over before any op runs over the new one. Each side waits for its own half.
_teardowns: dict[tuple[int, str], set[threading.Event]] = {}
_teardowns_lock = threading.Lock()


def _teardown_started(channel: LinkChannel) -> threading.Event:
    done = threading.Event()
    with _teardowns_lock:
        _teardowns.setdefault((id(channel.core), channel.peer_name), set()).add(done)
    return done


def _teardown_over(channel: LinkChannel, done: threading.Event) -> None:
    key = (id(channel.core), channel.peer_name)
    with _teardowns_lock:
        left = _teardowns.get(key)
        if left is not None:
            left.discard(done)
            if not left:
                del _teardowns[key]
    done.set()


def _await_teardowns(channel: LinkChannel, timeout: float) -> bool:
    """Worker thread: wait (bounded) until the links with this channel's peer that were being torn
    down when it was called are over; False if one is not."""
    with _teardowns_lock:
        pending = list(_teardowns.get((id(channel.core), channel.peer_name), ()))
    end = time.monotonic() + timeout
    return all(done.wait(max(0.0, end - time.monotonic())) for done in pending)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor (what the link moves)."""
    return t.detach().reshape(-1).view(torch.uint8)


class Link:
    """One channel's point-to-point link: set-up, post order, completion, abort.

    Created on the event loop when the channel is adopted, if both endpoints advertise ``nccl``.
    States: ``pending`` (joining), ``ready`` (both sides joined), ``down`` (failed, aborted or
    closed; :attr:`reason` says why). Thread-safe; :attr:`lock` orders posts with their frames.
    """

    def __init__(self, channel: LinkChannel, engine: LinkEngine, *, dialer: bool, timeout: float) -> None:
        self.channel = channel
        self.engine = engine
        self.dialer = dialer
        self.timeout = timeout
        self.lock = threading.RLock()  # posts and the frames that announce them, in one order
        self._state_lock = threading.Lock()
        self.state = "pending"
        self.reason = "the channel's NCCL link is being set up"
        self.conn: LinkConn | None = None
        self.peer_device = ""
        self._mine: tuple[bool, str, str] | None = None
        self._theirs: tuple[bool, str, str] | None = None
        self._announced = False  # our Ready was handed to the channel
        self._settled: asyncio.Future[None] = channel.loop.create_future()
        self.bridge = CompletionBridge(channel.loop, f"transport-nccl-{channel.peer_name}")
        # listener: our ops waiting for the dialer's Go: (post it, drop it unposted with an error or None)
        self.awaiting_go: dict[int, tuple[Callable[[], None], Callable[[BaseException | None], None]]] = {}
        self._answers: queue.SimpleQueue[Callable[[], None] | None] | None = None  # deliver-then-ack worker

    # ------------------------------------------------------------------ set-up
    def start(self) -> None:
        """Dialer (event loop): make the unique id, send it, join as rank 0 on a worker thread."""
        try:
            uid = self.engine.unique_id()
        except Exception as exc:  # noqa: BLE001 - reported to the peer and logged
            self._joined(None, f"no unique id: {type(exc).__name__}: {exc}")
            return
        self.channel.send(encode(Setup(uid)))
        threading.Thread(target=self._join, args=(uid, 0), name="transport-nccl-join", daemon=True).start()

    def on_frame(self, body: bytes) -> None:
        """Reader thread: the dialer's :class:`Setup` (listener) or the peer's :class:`Ready`."""
        msg = decode(body)
        if isinstance(msg, Setup):
            self._on_setup(msg)
        else:
            self._on_ready(msg)

    def _on_setup(self, msg: Setup) -> None:
        """Listener (reader thread): join as rank 1."""
        if self.dialer or self._mine is not None:
            raise ProtocolError("unexpected link Setup")
        threading.Thread(target=self._join, args=(msg.unique_id, 1), name="transport-nccl-join", daemon=True).start()

    def _join(self, uid: bytes, rank: int) -> None:
        if not _await_teardowns(self.channel, self.timeout):
            self._joined(None, f"an earlier NCCL link with {self.channel.peer_name!r} was still being torn down "
                               f"after {self.timeout:g} s")
            return
        try:
            conn = self.engine.connect(uid, rank, self.timeout)
        except Exception as exc:  # noqa: BLE001 - reported to the peer and logged
            self._joined(None, f"joining the link failed: {type(exc).__name__}: {exc}")
            return
        self._joined(conn, "")

    def _joined(self, conn: LinkConn | None, reason: str) -> None:
        with self._state_lock:
            late = self.state == "down"
            if not late:
                self.conn = conn
                self._mine = (conn is not None, self.engine.device, reason)
        if late:  # torn down meanwhile
            if conn is not None:
                conn.abort()
            return
        try:
            self.channel.send(encode(Ready(conn is not None, self.engine.device, reason)))
        except PeerLostError:
            pass
        with self._state_lock:
            self._announced = True  # only now may our own ops use the link: they follow our Ready
        self._maybe_settle()

    def _on_ready(self, msg: Ready) -> None:
        """The peer's verdict (reader thread)."""
        with self._state_lock:
            self._theirs = (msg.ok, msg.device, msg.reason)
        self._maybe_settle()

    def settle_for_peer_op(self) -> None:
        """Reader thread: the peer sent an op over the link, so it is ready, so it had our Ready
        (sent once we joined) and we had its own (frames arrive in order): settle now, even if our
        joining thread has not got round to it yet."""
        self._maybe_settle(peer_op=True)

    def ready_for_peer_op(self, op_id: int) -> None:
        """Reader thread, before serving the peer's op ``op_id`` over the link: settle a pending
        link (:meth:`settle_for_peer_op`); raises :class:`ProtocolError` unless it is ready."""
        if self.state == "pending":
            self.settle_for_peer_op()
        if self.state != "ready":
            raise ProtocolError(f"nccl op #{op_id} on a channel whose NCCL link is {self.state}")

    def take_go(self, op_id: int) -> None:
        """Reader thread: the dialer's ``Go`` for our op ``op_id``: post it now (no-op if it is
        not waiting for one any more)."""
        with self.lock:
            entry = self.awaiting_go.pop(op_id, None)
            if entry is not None:
                entry[0]()

    def _maybe_settle(self, peer_op: bool = False) -> None:
        with self._state_lock:
            if self.state != "pending":
                return
            mine, theirs = self._mine, self._theirs
            if theirs is not None and not theirs[0]:
                why = f"the peer could not join the channel's NCCL link: {theirs[2]}"
            elif mine is not None and not mine[0]:
                why = mine[2]
            elif mine is not None and theirs is not None and (self._announced or peer_op):
                why = ""
            else:
                return
            if why:
                self.state, self.reason = "down", why
                conn, self.conn = self.conn, None
            else:
                self.state, self.peer_device = "ready", theirs[1]  # type: ignore[index]
                self.reason = f"the channel's 2-rank NCCL link is up ({self.engine.device} <-> {self.peer_device})"
                conn = None
        if conn is not None:
            threading.Thread(target=conn.abort, name="transport-nccl-abort", daemon=True).start()
        ch = self.channel
        if why:
            log.warning("channel %s: no NCCL link with %r: %s; its GPU ops take the staged path", ch.id,
                        ch.peer_name, why)
        else:
            log.info("channel %s: %s", ch.id, self.reason)
        try:
            ch.loop.call_soon_threadsafe(self._settle_future)
        except RuntimeError:
            pass

    def _settle_future(self) -> None:
        if not self._settled.done():
            self._settled.set_result(None)
        self.channel.link_changed()

    async def wait(self, deadline: float) -> bool:
        """Event loop: wait (bounded) until the link is set up or failed; True if it is usable."""
        if self.state == "pending":
            try:
                async with asyncio.timeout_at(deadline):
                    await asyncio.shield(self._settled)
            except TimeoutError:
                raise TransportTimeoutError(
                    f"the NCCL link with {self.channel.peer_name!r} was still being set up at the op's deadline",
                    Phase.CONNECT) from None
        return self.state == "ready"

    # ------------------------------------------------------------------ teardown
    def abort(self, why: BaseException | str) -> None:
        """Any thread, idempotent: the link is done. On a worker thread, abort the communicator
        (bounded), which stops whatever is in flight; then the bridge reports what is left. Until
        that is over, no new link with the same peer joins (on this side)."""
        with self.lock, self._state_lock:
            if self.state == "down" and self.conn is None:
                first = False
            else:
                first = True
            self.state = "down"
            if first:
                self.reason = f"aborted: {why}"
            conn, self.conn = self.conn, None
            waiting, self.awaiting_go = list(self.awaiting_go.values()), {}
            answers, self._answers = self._answers, None
        lost = why if isinstance(why, BaseException) else PeerLostError(str(why))
        for _, drop in waiting:  # never posted: they end with the channel's error
            drop(lost)
        if answers is not None:
            answers.put(None)
        teardown = _teardown_started(self.channel)  # (a new link with the peer waits for it: see _join)

        def run() -> None:
            try:
                if conn is not None:
                    try:
                        conn.abort()
                    except Exception:  # noqa: BLE001
                        log.exception("aborting the NCCL link of channel %s failed", self.channel.id)
                end = time.monotonic() + 5.0  # the aborted operations complete (with errors): let the bridge report them
                while self.bridge.pending and time.monotonic() < end:
                    time.sleep(0.01)
            finally:
                _teardown_over(self.channel, teardown)
            self.bridge.close(timeout=5.0)

        threading.Thread(target=run, name="transport-nccl-abort", daemon=True).start()
        try:
            self.channel.loop.call_soon_threadsafe(self._settle_future)
        except RuntimeError:
            pass

    # ------------------------------------------------------------------ posting
    def _conn(self) -> LinkConn:
        conn = self.conn
        if conn is None or self.state != "ready":
            raise PeerLostError(f"the NCCL link with {self.channel.peer_name!r} is down: {self.reason}")
        return conn

    def post(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], after: Any) -> Any:
        """Post (under :attr:`lock`, held by the caller) sends then receives; the last waitable."""
        if not sends and not recvs:
            return None
        return self._conn().post(sends, recvs, after)

    def completed(self, waitable: Any, callback: Callable[[BaseException | None], None]) -> None:
        """``callback(error or None)`` on the bridge thread once ``waitable`` completed (now if None).
        A completion seen once the link is down counts as a failure: after ``ncclCommAbort`` the
        kernels exit and their events complete without an error, over partial data."""
        if waitable is None:
            callback(None)
            return

        def checked(exc: BaseException | None) -> None:
            if exc is None and self.state == "down":
                exc = PeerLostError(f"the NCCL link with {self.channel.peer_name!r} was aborted: {self.reason}")
            callback(exc)

        self.bridge.notify(waitable, checked)

    def not_posted(self, op_id: int) -> bool:
        """Reader thread, on a Fail: an op of ours the dialer rejected before its Go was never
        posted; drop it (True if it was one)."""
        with self.lock:
            entry = self.awaiting_go.pop(op_id, None)
        if entry is None:
            return False
        entry[1](None)
        return True

    def answer(self, job: Callable[[], None]) -> bool:
        """Run ``job`` (deliver a notification, then acknowledge) on this link's answering thread:
        delivery may wait for room in the application's queue, and the completion thread must not.
        False if the link is down: the job is dropped (the peer's op fails with the lost link)."""
        with self._state_lock:
            q = self._answers
            if q is None and self.state != "down":
                q = self._answers = queue.SimpleQueue()
                threading.Thread(target=_answering, args=(q,), name="transport-nccl-answers", daemon=True).start()
            if q is None:
                return False
            q.put(job)  # (under the lock: abort's end-of-queue mark comes after it, so it runs)
        return True

    # ------------------------------------------------------------------ target side
    def serve(self, msg: Put | Get, ranges: list[tuple[Any, int, int]] | None, error: TransportError | None,
              rec: Any, deliver: Callable[[Callable[[], None]], TransportError | None] | None) -> None:
        """Reader thread: the peer's nccl op ``msg`` arrived; ``ranges`` (buffer, offset, nbytes) if
        it was accepted, else ``error``. Post our half (into/from scratch if rejected: the peer's
        half may be posted already), then answer from its completion (``deliver(ack)`` runs first,
        for a put's notification: it calls ``ack`` once the notification is queued)."""
        ch = self.channel
        is_put = isinstance(msg, Put)
        if error is None:
            assert ranges is not None
            views = [bytes_of(buf.tensor)[off : off + n] for buf, off, n in ranges if n]
            wrong = [buf.spec.name for buf, _, n in ranges if n and not self.engine.handles(buf.tensor)]
            if wrong:
                error = PlaneUnavailableError(f"buffers {wrong} are not on the device of this side's NCCL link "
                                              f"({self.engine.device})")
        if error is not None and self.dialer:  # the listener posts only after our Go: it has posted nothing
            ch.recorder.update(rec, OpState.REJECTED, error)
            ch.send(Fail(msg.op_id, error_kind(error), str(error)))
            return
        if error is not None:  # the dialer posted its half already: match it, into or from scratch
            views = self._scratch(msg.items)
        try:
            with self.lock:
                last = self.post([] if is_put else views, views if is_put else [], None)
                if self.dialer:
                    ch.send(Go(msg.op_id))
        except TransportError:
            raise
        except Exception as exc:  # the link cannot follow the peer any more
            raise PeerLostError(f"posting our half of nccl op #{msg.op_id} failed: {exc}") from exc
        op_id = msg.op_id

        def done(exc: BaseException | None) -> None:  # bridge thread
            nonlocal error
            keep = views  # noqa: F841 - the memory stays referenced until the operation is over
            if exc is not None:
                ch.recorder.update(rec, OpState.FAILED, exc)
                ch.lose(PeerLostError(f"the NCCL link with {ch.peer_name!r} failed: {exc}"))
                return
            acked = False

            def ack() -> None:
                nonlocal acked
                acked = True
                ch.recorder.update(rec, OpState.DONE)
                ch.send_quietly(Ack(op_id))

            def reply() -> None:
                nonlocal error
                if error is None and deliver is not None:
                    error = deliver(ack)  # (acknowledged once queued, before our close can send a Bye)
                if error is not None:
                    ch.recorder.update(rec, OpState.REJECTED, error)
                    ch.send_quietly(Fail(op_id, error_kind(error), str(error)))
                elif not acked:
                    ack()

            if error is None and deliver is not None:
                if not self.answer(reply):  # aborted since the completion was checked: never delivered
                    ch.recorder.update(rec, OpState.FAILED, PeerLostError(
                        f"the NCCL link with {ch.peer_name!r} was aborted before the op's notification was "
                        f"delivered: {self.reason}"))
            else:
                reply()

        self.completed(last, done)

    def _scratch(self, items: list[Item]) -> list[torch.Tensor]:
        """One view per non-empty item (the peer posts one operation per item, of its size)."""
        sizes = [n for n in (item_bytes(it) for it in items) if n]
        if not sizes:
            return []
        try:
            mem = self.engine.scratch(sum(sizes))
        except Exception as exc:
            raise ProtocolError(f"cannot allocate {sum(sizes)} bytes of scratch memory to keep the NCCL link in "
                                f"step with a rejected op: {exc}") from exc
        out, pos = [], 0
        for n in sizes:
            out.append(mem[pos : pos + n])
            pos += n
        return out


def _answering(q: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    while True:
        job = q.get()
        if job is None:
            return
        try:
            job()
        except Exception:  # noqa: BLE001 - one answer's failure must not stop the others
            log.exception("answering an nccl op failed")


def resolve(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
