"""An endpoint's channels: accepting connections, dialling peers, the handshake, and which
channel carries a peer's ops.

A peer is dialled on the first op that names it (:meth:`Connector.channel`): its record comes from
the endpoint's address book (:meth:`Endpoint.add_peer <transport.Endpoint.add_peer>`) or the
rendezvous store; a refused connect skips that incarnation and looks again. Both sides run the
authenticated handshake (:mod:`transport.handshake`) and adopt the socket as a
:class:`~transport.channel.Channel` (:meth:`Connector.adopt`), with an NCCL link when both offer
nccl. While a handshake runs, the peer may map what our Hello announced: the endpoint's exports
track it as a *holder* (:meth:`~transport.exports.Exports.watch`) until the channel takes over.

Runs on the endpoint's event loop. Every wait is bounded by the op's deadline (dialling) or
:data:`_ACCEPT_HANDSHAKE_S` (an accepted connection's handshake; one completed while our
``open()`` is still finishing, after our record was published, then waits up to the endpoint's
timeout for it to end, rather than being refused); at most
:data:`_MAX_HANDSHAKES` accepted connections may be in their handshake at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any, Protocol

from . import local_socket
from .acceptor import accept_until_cancelled
from .channel import Channel, CoreProtocol
from .errors import (
    AuthenticationError,
    EndpointClosedError,
    PeerLostError,
    PeerNotFoundError,
    Phase,
    PlaneUnavailableError,
    ProtocolError,
    TransportError,
    TransportTimeoutError,
)
from .fence import Fences
from .handshake import close_if_cancelled, handshake, hang_up
from .hostinfo import local_host, same_host
from .incarnations import Replaced, Stale, check_accepted, handshake_unless_replaced
from .planes import PlaneOffers, choose_cpu_plane
from .wire import PROTOCOL_VERSION, Hello, Message, Registry

__all__ = ["Connector"]

log = logging.getLogger("transport.endpoint")

_MAX_HANDSHAKES = 64  # connections accepted but not yet introduced; more are refused
_ACCEPT_HANDSHAKE_S = 10.0  # an accepted connection must introduce itself within this
_REPLACED_LOOKUP_S = 1.0  # the store look-up of an accepted connection's incarnation (incarnations.replaced_by)


class Owner(CoreProtocol, Protocol):
    """What the connector uses of its endpoint (:class:`transport.Endpoint`), beyond what its
    channels use (:class:`~transport.channel.CoreProtocol`)."""

    name: str
    incarnation: int
    planes: tuple[str, ...]
    timeout: float
    _offers: PlaneOffers  # what each plane offers here: the planes a Hello offers, the links' engine
    secret_source: str
    recorder: Any
    loop: asyncio.AbstractEventLoop
    _book: Any  # AddressBook: peers added from their address records
    _exports: Any  # Exports: the holders of a handshake in progress
    _listener: socket.socket | None
    _unix_listener: socket.socket | None  # (transport.local_socket)
    _rdv: Any  # Rendezvous
    _record: Any  # our EndpointRecord
    _registry: Any  # LocalRegistry
    _secret: bytes | None
    _state: str

    def wire_registry(self) -> tuple[int, list[Any]]: ...
    def _check_open(self) -> None: ...
    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]: ...


class _Retry(Exception):
    """A dial attempt that should look the peer up again."""


class Connector:
    """The channels of one endpoint (see the module docstring). ``channels``: the one that carries
    each peer's ops; ``all``: every open channel (both dialled and accepted ones)."""

    def __init__(self, ep: Owner) -> None:
        self.ep = ep
        self.channels: dict[str, Channel] = {}
        self.all: set[Channel] = set()
        self._dial_locks: dict[str, asyncio.Lock] = {}
        # peer -> ops in channel() waiting for (or making) a dial: while any does, a later op takes no
        # open channel at once (open_channel), it queues behind them, so it cannot overtake them
        self._waiting: dict[str, int] = {}
        self._opened: dict[str, asyncio.Event] = {}  # peer -> set when a channel to it is routed (adopt, closed)
        self._dials: set[asyncio.Future[Channel]] = set()  # dials in progress (close() stops them)
        self._stale = Stale()  # incarnations found replaced (refused at once), first-connection look-ups running
        self._handshaking = 0
        self.fences = Fences()  # the peers' ended channels, which their new channels wait for (transport.fence)
        self._holder_ids = itertools.count(1)
        self.unix_name = ""  # the abstract name of the Unix-socket listener ("" none)

    def hello(self, channel_id: str, peer: str | None = None) -> Hello:
        """Our Hello; to ``peer`` (a dial), naming our channels to it that ended (transport.fence)."""
        ep = self.ep
        epoch, bufs = ep.wire_registry()
        return Hello(PROTOCOL_VERSION, ep.name, ep.incarnation, local_host(), ep._offers.offered(), epoch, bufs,
                     channel_id, ep.notify_window, self.fences.lost_ids(peer, self.all) if peer is not None else [])

    def adopt(self, sock: socket.socket, remote: Hello, channel_id: str, sent_epoch: int, *,
               dialer: bool, offered: list[str]) -> Channel:
        ep = self.ep
        plane, reason = choose_cpu_plane(local_host(), remote.host, ep.planes, tuple(remote.planes))
        ch = Channel(ep, sock, remote, channel_id, plane, reason, registry=ep._registry, recorder=ep.recorder)
        # the channel's own link, where both Hellos ask for one (transport.planes.PlaneOffers.link_for)
        ch.link = ep._offers.link_for(ch, offered, remote.planes, same_host(local_host(), remote.host)[0],
                                      dialer=dialer, timeout=ep.timeout)
        old = self.channels.get(remote.name)
        # its reader serves nothing before the readers of the peer's ended (or, it says, lost) channels stopped;
        # every channel still open to another incarnation of the peer (``old`` among them) is broken here
        self.fences.arm(ch, remote.name, remote.incarnation, remote.lost, self.all)
        routed = old is None or not old.is_open or old.incarnation != remote.incarnation
        if routed:
            self.channels[remote.name] = ch
            self._routed(remote.name)
        # else both sides dialled at once (or the peer's dial, started before the channel we use
        # came up, got through late): both channels serve, but our ops stay on the one they went
        # over, open as it is. Moving them would let a later op or post overtake an earlier one
        # still in the old channel's socket; they move only when it closes (closed()).
        self.all.add(ch)
        ch.start()
        if routed and not dialer:  # our ops move to a channel no Hello of ours introduced
            self.fences.introduce(ch, remote.name, self.all)
        if ch.unmap_acks:  # it may map our exports from the registry we sent it (Hello at sent_epoch)
            ch.holder = f"channel-{next(self._holder_ids)}"
            ep._exports.watch(ch.holder, sent_epoch, remote.host.pid)
        if ch.link is not None and dialer:
            ch.link.start()
        log.info("channel %s: %r <-> %r (incarnation %#x) uses plane %s: %s", channel_id, ep.name, remote.name,
                 remote.incarnation, plane.name, reason)
        if ep._registry.epoch != sent_epoch:  # registry changed during the handshake (a channel lost
            epoch, bufs = ep.wire_registry()  # meanwhile needs none; its threads own the socket now)
            ch.send_quietly(Registry(epoch, bufs))
        return ch

    async def accept_loop(self, unix: bool = False) -> None:
        """Accept connections on the endpoint's TCP listener (``unix``: its Unix-socket one) until
        cancelled (:func:`~transport.acceptor.accept_until_cancelled`), each handshaken in a task of its own."""
        ep = self.ep
        listener = ep._unix_listener if unix else ep._listener
        if listener is None:  # (open() failed, or close() cut it short, before this task first ran)
            return

        def handle(sock: socket.socket, addr: Any) -> None:
            task = ep._spawn(self._accept_one(sock, "a local process (Unix socket)" if unix else addr, unix))
            task.add_done_callback(close_if_cancelled(sock))  # (close() may cancel it before its first step)

        await accept_until_cancelled(listener, handle, lambda: ep._state in ("opening", "open"), ep.name)

    async def _accept_one(self, sock: socket.socket, addr: Any, unix: bool = False) -> None:
        ep = self.ep
        if self._handshaking >= _MAX_HANDSHAKES:
            log.warning("refusing a connection from %s: %d handshakes already in progress", addr, self._handshaking)
            sock.close()
            return
        self._handshaking += 1
        try:
            _no_delay(sock)
            await ep._offers.late(ep._state == "open")
            hello = self.hello("")
        except BaseException:
            self._handshaking -= 1
            sock.close()
            raise
        pending = f"handshake-{next(self._holder_ids)}"  # it may map what our Hello announces before adoption
        look = None
        ep._exports.watch(pending, hello.epoch, None)
        adopted = False
        try:
            assert ep._secret is not None and ep._record is not None
            remote = await handshake(sock, hello, time.monotonic() + min(ep.timeout, _ACCEPT_HANDSHAKE_S), dialer=False,
                                     secret=ep._secret,
                                     address=local_socket.proof_address(self.unix_name) if unix
                                     else (ep._record.host, ep._record.port))
            ep._exports.watch(pending, hello.epoch, remote.host.pid if same_host(local_host(), remote.host)[0]
                                      else None)
            end = time.monotonic() + ep.timeout
            while ep._state == "opening" and time.monotonic() < end:  # (our record is published before open()
                await asyncio.sleep(0.002)                           # returns: a peer may dial in between)
            have = self.channels.get(remote.name)  # (a store that does not answer within 1 s: the newer one wins)
            current, look = await check_accepted(ep, have, remote, min(end, time.monotonic() + _REPLACED_LOOKUP_S),
                                                 known=have is not None or self.fences.known(remote.name),
                                                 stale=self._stale)
            if ep._state != "open":  # (after every await: close() may have begun meanwhile)
                raise EndpointClosedError("endpoint is closing" if ep._state != "opening" else
                                          f"endpoint still opening after {ep.timeout} s")
            if current is not None:
                await self._stale.refuse(sock, remote, current)
                return
            channel_id = remote.channel_id or f"{remote.name}->{ep.name}"
            if self.fences.refuse_late(remote.name, channel_id):  # (a later channel's Hello named it lost)
                return
            sock.setblocking(True)
            self.adopt(sock, remote, channel_id, hello.epoch, dialer=False, offered=hello.planes)
            adopted = True
            if look is not None:  # (broken if the look-up, still running, names another incarnation)
                self._stale.unseat_when_replaced(ep, remote, look, self.all)
        except AuthenticationError as exc:
            log.error("refused a connection from %s: %s; connection closed", addr, exc)
            await hang_up(sock)
        except ProtocolError as exc:
            log.error("protocol error from %s during handshake: %s; connection closed", addr, exc)
            sock.close()
        except (OSError, EOFError, TimeoutError, TransportError) as exc:
            log.warning("handshake with %s failed: %s", addr, exc or type(exc).__name__)
            sock.close()
        except Exception:  # a bug (peer bytes are ProtocolErrors): logged here, never an unretrieved task error
            log.exception("handshake with %s failed unexpectedly; connection closed", addr)
            sock.close()
        finally:
            self._handshaking -= 1
            if look is not None and not adopted:
                look.cancel()
            if adopted:  # tracked as its channel from here
                ep._exports.forget(pending)
            else:  # it had our Hello and may have adopted its side: as a channel closed without a Bye
                ep._exports.closed(pending, orderly=False)
                sock.close()  # (cancelled by close(), or an unexpected error: never left to the GC)

    def open_channel(self, peer: str) -> Channel | None:
        """The open channel to ``peer``, or None (then :meth:`channel` dials); non-blocking, so an
        op to a connected peer needs no coroutine for it."""
        ch = self.channels.get(peer) if isinstance(peer, str) else None
        return ch if ch is not None and ch.is_open and not self._waiting.get(peer) else None

    async def channel(self, peer: str, deadline: float) -> Channel:
        ep = self.ep
        ep._check_open()
        if not isinstance(peer, str) or not peer:
            raise PeerNotFoundError(f"peer names are non-empty strings, got {peer!r}")
        ch = self.open_channel(peer)
        if ch is not None:
            return ch
        lock = self._dial_locks.setdefault(peer, asyncio.Lock())  # (its waiters wake in order: FIFO)
        self._waiting[peer] = self._waiting.get(peer, 0) + 1
        try:
            try:  # another op may be dialling this peer with a later deadline: wait for it only until ours
                async with asyncio.timeout_at(deadline):
                    await lock.acquire()
            except TimeoutError:
                raise TransportTimeoutError(f"connecting to {peer!r}: the connect already in progress did not "
                                            "finish before this op's deadline", Phase.CONNECT) from None
            try:
                ep._check_open()  # (close() may have run while we waited for the dial before ours)
                ch = self.channels.get(peer)
                if ch is not None and ch.is_open:
                    return ch
                return await self._dial_or_adopted(peer, deadline)
            finally:
                lock.release()
        finally:  # (our caller hands its op to the channel before it awaits again: in order)
            left = self._waiting[peer] - 1
            if left:
                self._waiting[peer] = left
            else:
                del self._waiting[peer]

    def _routed(self, peer: str) -> None:
        """Event loop: a channel to ``peer`` now carries our ops: a dial waiting for one may stop."""
        ev = self._opened.pop(peer, None)
        if ev is not None:
            ev.set()

    async def _dial_or_adopted(self, peer: str, deadline: float) -> Channel:
        """Our dial to ``peer``, or the peer's channel if it comes up first (our dial is then
        stopped): a dial that hangs (a SYN lost while a link was down) does not keep our ops off
        a channel the peer opened meanwhile."""
        ev = self._opened.setdefault(peer, asyncio.Event())
        dial = asyncio.ensure_future(self._dial(peer, deadline))
        self._dials.add(dial)
        opened = asyncio.ensure_future(ev.wait())
        try:
            await asyncio.wait((dial, opened), return_when=asyncio.FIRST_COMPLETED)
            ch = self.channels.get(peer)
            if not dial.done() and ch is not None and ch.is_open:
                return ch
            try:
                return await dial
            except (asyncio.CancelledError, TransportError):
                task = asyncio.current_task()
                if self.ep._state != "open" and not (task is not None and task.cancelling()):
                    raise EndpointClosedError(f"endpoint {self.ep.name!r} closed while connecting to {peer!r}") \
                        from None
                raise
        finally:
            self._dials.discard(dial)
            opened.cancel()
            if not dial.done():
                dial.cancel()
                await asyncio.gather(dial, return_exceptions=True)  # (it closes its socket)

    async def _dial(self, peer: str, deadline: float) -> Channel:
        ep = self.ep
        skip: set[int] = set()
        while True:
            rec = ep._book.lookup(peer, skip)  # a peer added from its record is not looked for in the store
            if rec is None:
                rec = await ep._rdv.lookup(peer, deadline, skip_incarnations=frozenset(skip))
            channel_id = f"{ep.name}#{ep.incarnation:x}->{peer}#{rec.incarnation:x}/{secrets.token_hex(3)}"
            sock = await local_socket.connect_record(peer, rec, deadline)
            if sock is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:  # (a connect left unanswered, its host gone, gives way to a newer incarnation, as a handshake)
                    async with asyncio.timeout_at(deadline):
                        await handshake_unless_replaced(ep, ep.loop.sock_connect(sock, (rec.host, rec.port)),
                                                        peer, rec, skip, deadline)
                except Replaced:
                    sock.close()
                    continue
                except TimeoutError:
                    sock.close()
                    raise TransportTimeoutError(f"connecting to {peer!r} at {rec.host}:{rec.port} timed out",
                                                Phase.CONNECT) from None
                except OSError as exc:
                    sock.close()
                    log.info("endpoint %r (incarnation %#x) at %s:%d refused: %s; waiting for a new incarnation",
                             peer, rec.incarnation, rec.host, rec.port, exc)
                    skip.add(rec.incarnation)
                    continue
                except BaseException:  # (the dial cancelled: its op's caller, or close())
                    sock.close()
                    raise
                _no_delay(sock)
            pending = f"handshake-{next(self._holder_ids)}"  # it may map what our Hello announces before adoption
            adopted = False
            try:
                ch = await self._dial_once(sock, peer, rec, channel_id, pending, deadline, skip)
                adopted = True
                return ch
            except (_Retry, Replaced):
                continue
            finally:
                if adopted:
                    ep._exports.forget(pending)
                else:  # it may have had our Hello and adopted its side: as a channel closed without a Bye
                    ep._exports.closed(pending, orderly=False)

    async def _dial_once(self, sock: socket.socket, peer: str, rec: Any, channel_id: str, pending: str,
                         deadline: float, skip: set[int]) -> Channel:
        """One handshake with ``peer``'s incarnation ``rec``; raises :class:`_Retry` to look again."""
        ep = self.ep
        try:
            await ep._offers.late(ep._state == "open")
            hello = self.hello(channel_id, peer)
            ep._exports.watch(pending, hello.epoch,
                                      rec.hostinfo.pid if same_host(local_host(), rec.hostinfo)[0] else None)
            assert ep._secret is not None
            unix = local_socket.is_unix(sock)
            remote = await handshake_unless_replaced(
                ep, handshake(sock, hello, deadline, dialer=True, secret=ep._book.secret_for(peer) or ep._secret,
                          address=local_socket.proof_address(rec.unix) if unix else (rec.host, rec.port)),
                peer, rec, skip, deadline)
            sock.setblocking(True)
        except TimeoutError:
            sock.close()
            raise TransportTimeoutError(f"handshake with {peer!r} timed out", Phase.HANDSHAKE) from None
        except AuthenticationError as exc:
            sock.close()
            log.error("endpoint %r could not connect to %r at %s:%d: %s", ep.name, peer, rec.host, rec.port, exc)
            raise AuthenticationError(
                f"connecting to {peer!r} at {rec.host}:{rec.port}: {exc} (this endpoint's secret comes from "
                f"{ep.secret_source}; every endpoint of a job needs the same one)") from None
        except (OSError, EOFError) as exc:
            # hung up before its hello: busy (too many handshakes) or dying. Try the same
            # incarnation again shortly; a dead one refuses the next connect and is skipped.
            sock.close()
            log.info("handshake with %r failed (%s); retrying", peer, exc)
            await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                raise TransportTimeoutError(f"handshake with {peer!r} kept failing: {exc}", Phase.HANDSHAKE) from exc
            raise _Retry from None
        except BaseException:
            sock.close()
            raise
        if remote.name != peer or remote.incarnation != rec.incarnation:
            sock.close()
            skip.add(rec.incarnation)
            raise _Retry
        if ep._state in ("closing", "closed"):  # (close() stops dials; this one's handshake ended first)
            sock.close()
            raise EndpointClosedError(f"endpoint {ep.name!r} closed while connecting to {peer!r}")
        try:
            ch = self.adopt(sock, remote, channel_id, hello.epoch, dialer=True, offered=hello.planes)
        except PlaneUnavailableError:
            sock.close()
            raise
        return self.channels.get(peer) or ch

    def stop_dials(self) -> None:
        """close() began: the dials in progress stop (their ops raise :class:`EndpointClosedError`);
        none adopts a channel any more."""
        for dial in list(self._dials):
            dial.cancel()

    def closed(self, ch: Channel) -> None:
        """``ch`` broke or closed (event loop): it carries no more ops; another open channel to the
        same peer (accepted while we dialled) takes over; the exports stop counting on it once its
        process is done with them (a Bye promised so; else held until that process exits)."""
        self.all.discard(ch)
        self.fences.closed(ch)
        if ch.holder is not None:
            self.ep._exports.closed(ch.holder, ch.orderly)
        if self.channels.get(ch.peer_name) is ch:
            del self.channels[ch.peer_name]
            for other in self.all:
                if other.peer_name == ch.peer_name and other.is_open and other.incarnation == ch.incarnation:
                    self.fences.introduce(other, ch.peer_name, self.all)  # (ahead of our ops: ch's reader first)
                    self.channels[ch.peer_name] = other
                    self._routed(ch.peer_name)
                    break
        threading.Thread(target=ch.join, args=(2.0,), name="transport-join", daemon=True).start()

    # ---------------------------------------------------------------- every channel
    def listen_unix(self) -> socket.socket | None:
        """The endpoint's Unix-socket listener (None: off or unavailable), its name kept for the record."""
        got = local_socket.listen(self.ep.incarnation)
        if got is None:
            self.unix_name = ""
            return None
        lsock, self.unix_name = got
        return lsock

    def listen(self, host: str) -> socket.socket:
        """A non-blocking socket listening on ``host`` and a port the OS picks."""
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((host, 0))
            lsock.listen(128)
            lsock.setblocking(False)
        except BaseException:
            lsock.close()
            raise
        return lsock

    def broadcast(self, msg: Message) -> None:
        """Send ``msg`` on every open channel (event loop; a channel lost meanwhile is skipped)."""
        for ch in list(self.all):
            if ch.is_open:
                try:
                    ch.send(msg)
                except PeerLostError:
                    pass

    def tick(self, now: float, interval: float, timeout: float) -> None:
        """The heartbeat of every channel (event loop): pings idle ones, loses silent ones, checks the
        incarnation of those heard again after a silence (:meth:`Stale.after_silence`)."""
        for ch in list(self.all):
            try:
                ch.tick(now, interval, timeout)
            except PeerLostError:
                pass
        self._stale.after_silence(self.ep, self.all, now, interval)

    @staticmethod
    async def drain_posts(chans: list[Channel], timeout: float) -> None:
        """Give the posts still waiting for their peers' credits up to ``timeout`` s to go out
        before the channels close (event loop): what is left is dropped, logged."""
        pumps = [ch.credits.pump for ch in chans if ch.credits.pump is not None]
        if pumps:
            await asyncio.wait(pumps, timeout=timeout)

    @staticmethod
    def close_all(chans: list[Channel], timeout: float) -> None:
        """Say Bye on ``chans`` and close them, bounded by ``timeout`` in all (blocking: call it on
        a worker thread)."""
        end = time.monotonic() + min(timeout, threading.TIMEOUT_MAX)  # (a thread's join overflows past it)
        for ch in chans:
            ch.say_bye("endpoint closed")
        for ch in chans:  # the Byes go out in parallel; this waits for all of them, bounded
            ch.close("endpoint closed", max(0.0, min(1.0, end - time.monotonic())))
        for ch in chans:
            ch.join(max(0.0, end - time.monotonic()))


def _no_delay(sock: socket.socket) -> None:
    """TCP_NODELAY on a TCP socket (a Unix socket has no Nagle to turn off)."""
    if not local_socket.is_unix(sock):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
