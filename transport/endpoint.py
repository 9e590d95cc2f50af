"""``Endpoint``: the user's handle on the transport.

An endpoint has a name, publishes itself in a rendezvous store, accepts
channels from peers and dials them on demand. It owns the local registry of
named buffers; peers ``put`` into and ``get`` from those buffers by name
without the application posting any receive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from . import auth
from .address import AddressBook
from .channel import Channel
from .connector import Connector
from .errors import EndpointClosedError, PeerLostError, ProtocolError, TransportTimeoutError
from .exports import Exports
from .flight_recorder import FlightRecorder
from .fr_autodump import Dumps
from .hostinfo import local_host
from .inbox import Inbox
from .operations import Operations
from .peer import Notification, Peer
from .planes import Exporter, PlaneOffers, validate_planes
from .registry import BufferSpec
from .rendezvous import EndpointRecord, Rendezvous, listen_host
from .staging import Staging, StagingConfig
from .wire import Registry, WireBuffer

__all__ = ["Endpoint"]

log = logging.getLogger(__name__)

_WITHDRAW_S = 2.0  # how long an open() that failed while publishing waits to take its record back


class Endpoint(Operations):
    """A named endpoint: register buffers, then ``put``/``get`` peers' buffers by name.

    Its one-sided operations (:meth:`connect`, :meth:`put`, :meth:`get`, :meth:`route`,
    :meth:`map`, :meth:`map_route`, :meth:`notify`) and addressing (:meth:`address_record`,
    :meth:`add_peer`) are documented in :class:`transport.operations.Operations`.

    Use it as an async context manager (``async with Endpoint(...) as ep``) or
    call :meth:`open` / :meth:`close`.

    Parameters:
        name: unique name of this endpoint in the store.
        store: ``"tcp://HOST:PORT"``, a ``torch.distributed.Store``, or None
            to use ``MASTER_ADDR``/``MASTER_PORT`` (as set by ``torchrun``).
        host_store: serve the TCPStore from this process (port 0 picks a free
            port; read it back from :attr:`store_url`).
        timeout: default deadline, in seconds, of every operation that takes ``timeout=None``.
        planes: allowed data planes, in any order, e.g. ``("tcp",)``: at
            least one CPU plane (``shm``, ``tcp``), plus ``cuda_ipc`` to let
            same-host peers copy straight into and out of this endpoint's
            GPU buffers (and ours) and/or ``nccl`` for GPU buffers over a
            channel's own NCCL communicator; None allows all. The CPU plane per peer is
            chosen by :func:`transport.planes.choose_cpu_plane`, the GPU plane
            by :func:`transport.planes.choose_gpu_plane` (``cuda_ipc``, then
            ``nccl``, else the staged path, which needs only the channel's socket and is
            always available); both choices are logged.
        listen_host: address to accept channels on; default: the local
            address that reaches the store's host (127.0.0.1 for a loopback store).
        heartbeat_interval / heartbeat_timeout: a channel sends a ping when
            idle for ``heartbeat_interval`` s and is declared lost after
            ``heartbeat_timeout`` s without any traffic from the peer.
        flight_recorder_size: records kept in the ring (default 2000).
        dump_dir: where automatic flight-recorder dumps go (default
            ``$TRANSPORT_FR_DIR`` or ``<tmp>/transport-fr``).
        dump_signal: a signal (e.g. ``signal.SIGUSR1``) that dumps the flight
            recorder; None installs no handler.
        max_pending_notifications: each peer's notifications held here that
            the application has not taken yet, at most: the peer's credits
            (its notify/put-with-notify wait for one, its posts queue there).
        staging: :class:`transport.StagingConfig` of the staged path
            that moves CUDA tensors (bounce-buffer size and count, stall
            bound); None uses the defaults (4 x 8 MiB per op).
        engines: for the planes that take an engine
            (:data:`transport.planes.ENGINE_PLANES`), the plane's name -> a
            zero-argument factory of it; a plane not named (or named with None) uses its default.
            ``"cuda_ipc"``: an IPC engine (:class:`transport.planes.cuda_ipc_engine.IpcEngine`;
            default CUDA's when CUDA is available);
            ``transport.planes.cuda_ipc_memfd.MemfdIpcEngine`` runs the plane's
            protocol over CPU shared memory, for tests and debugging without a
            GPU (both endpoints need it; their CPU buffers then travel over
            ``cuda_ipc`` instead of ``shm``). ``"nccl"``: a link engine
            (:class:`transport.planes.LinkEngine`); the default uses NCCL on the
            current CUDA device of the thread that creates the endpoint, if the
            process already uses CUDA then (an endpoint never starts CUDA
            itself) and NCCL loads; if CUDA comes into use only later, on the
            event loop thread's current device as of the first channel set up
            after that (channels set up before keep going without a link: their
            GPU ops are staged); for another device pass
            ``functools.partial(transport.cuda.nccl_link.NcclLinkEngine, index)``.
            Each channel to a peer that offers nccl too then gets its own
            communicator (leave ``nccl`` out of ``planes=`` to avoid that).
            ``transport.planes.SocketLinkEngine`` runs the plane's protocol over
            a second TCP connection, on CPU memory (tests and debugging without
            GPUs; both endpoints need it). :meth:`plane_status` says what each
            plane's engine came to. ``ValueError`` for another key, or a value
            that is not callable.
        secret: the job's secret (str or bytes) that every peer must prove it
            holds in the handshake before anything else it sends is read
            (:mod:`transport.auth`). None: ``$TRANSPORT_SECRET`` if set, else
            the secret kept in the store (drawn by the first endpoint to open
            on it, normally the one that serves it): then anyone who can read
            the store can join. Every endpoint of a job must use the same
            source. A peer that fails the proof is refused and logged; dialling
            it raises :class:`transport.AuthenticationError`.
    """

    def __init__(
        self,
        name: str,
        *,
        store: Any = None,
        host_store: bool = False,
        timeout: float = 30.0,
        planes: Any = None,
        listen_host: str | None = None,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        flight_recorder_size: int = 2000,
        dump_dir: str | Path | None = None,
        dump_signal: int | None = None,
        max_pending_notifications: int = 10000,
        staging: StagingConfig | None = None,
        engines: Mapping[str, Callable[[], Any] | None] | None = None,
        secret: str | bytes | None = None,
    ) -> None:
        if not isinstance(name, str) or not name or len(name) > 200 or "/" in name:
            raise ValueError(f"endpoint name must be a non-empty string of <= 200 chars without '/', got {name!r}")
        if not (timeout > 0 and heartbeat_interval > 0 and heartbeat_timeout > heartbeat_interval):  # (NaN too)
            raise ValueError("timeout and heartbeat_interval must be > 0 and heartbeat_timeout > heartbeat_interval")
        self.name = name
        self._secret, self.secret_source = auth.explicit_secret(secret)  # (None: the store's, read at open)
        self.incarnation = secrets.randbits(63)
        self.timeout = float(timeout)
        self.planes = validate_planes(planes)
        if staging is not None and not isinstance(staging, StagingConfig):
            raise ValueError(f"staging must be a transport.StagingConfig, got {type(staging).__name__}")
        self.staging = Staging(staging)
        self._offers = PlaneOffers(name, self.planes, engines)  # what each plane offers here (its engine, its link)
        # the registry, and each plane's exports of its buffers
        self._exports = Exports(self._offers.exporters)
        self._registry = self._exports.registry
        self._listen_host = listen_host
        self._hb_interval = heartbeat_interval
        self._hb_timeout = heartbeat_timeout
        self._dump_signal = dump_signal
        self._rdv = Rendezvous(store, host_store=host_store, timeout=timeout)
        self._book = AddressBook()  # peers added from their address records (add_peer)
        self.recorder = FlightRecorder(name, self.incarnation, flight_recorder_size)
        self._dumps = Dumps(self.recorder, name, dump_dir)
        self._connector = Connector(self)  # accepting, dialling, and which channel carries each peer's ops
        self._channels = self._connector.channels
        self._all = self._connector.all
        self._tasks: set[asyncio.Task[Any]] = set()
        self._listener: socket.socket | None = None
        self._unix_listener: socket.socket | None = None  # same-host peers dial it (transport.local_socket)
        self._record: EndpointRecord | None = None
        self._state = "new"
        self._opening: asyncio.Task[Any] | None = None  # the task running open(), while it runs
        self._closing: asyncio.Future[None] | None = None  # the close, once one started (close())
        self._cut_open = False  # close() cancelled that task: open() raises EndpointClosedError
        self._inbox = Inbox(max_pending_notifications, lambda: self._state == "open")
        self.notify_window = self._inbox.window  # each peer's credits (transport.credits)
        self._registry_dirty = False
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Endpoint:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        """Connect to the store, start accepting channels, publish this endpoint.

        Raises :class:`TransportTimeoutError` (phase connect) if the store
        cannot be reached within ``timeout``.
        """
        if self._state == "closed":
            raise EndpointClosedError(f"endpoint {self.name!r} is closed (closed before it was opened, or already "
                                      "used): make a new one")
        if self._state != "new":
            raise EndpointClosedError(f"endpoint {self.name!r} was already opened")
        self._state = "opening"
        self._opening = asyncio.current_task()
        self.loop = asyncio.get_running_loop()
        self._inbox.attach(self.loop)
        publishing = False
        try:
            stored = await self._rdv.open(want_secret=self._secret is None)
            if self._secret is None:
                self._secret = stored
            host = self._listen_host or listen_host(self._rdv)
            self._listener = lsock = self._connector.listen(host)
            self._unix_listener = self._connector.listen_unix()
            self._record = EndpointRecord(self.name, host, lsock.getsockname()[1], self.incarnation, local_host(),
                                          self._connector.unix_name)
            self._offers.at_open()
            self._exports.start()  # export the buffers registered before open, and every later one at once
            self._spawn(self._connector.accept_loop())
            if self._unix_listener is not None:
                self._spawn(self._connector.accept_loop(unix=True))
            self._spawn(self._monitor())
            publishing = True
            await self._rdv.publish(self._record, time.monotonic() + self.timeout)
            self._watch_pauses()  # (transport.pauses: stopped by the store's close, _teardown_sync)
        except BaseException as exc:
            self._state = "closed"
            for task in list(self._tasks):  # (the accept loop and the monitor, if they were started)
                task.cancel()
            cut = self._cut_open and isinstance(exc, asyncio.CancelledError)
            me = asyncio.current_task()
            if cut and me is not None and me.uncancel() > 0:
                cut = False  # (the caller cancelled it too: its cancellation stands)
            if publishing and self._record is not None:
                # the store's thread may still write the record after the publish was given up on: withdraw
                # it behind that write (its calls run in order), bounded, so no peer finds a closed endpoint
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(
                        self._rdv.withdraw(self._record, time.monotonic() + _WITHDRAW_S)), _WITHDRAW_S + 0.5)
            self._teardown_sync()
            if cut:
                raise EndpointClosedError(f"endpoint {self.name!r} was closed while it was opening") from None
            raise
        finally:
            self._opening = None
        if self._dump_signal is not None:
            self.loop.add_signal_handler(self._dump_signal, self._dump_on_signal)
        self._state = "open"
        log.info("endpoint %r open on %s:%d (incarnation %#x, planes %s, secret from %s)", self.name, host,
                 self._record.port, self.incarnation, ",".join(self.planes), self.secret_source)

    @property
    def store_url(self) -> str | None:
        """``tcp://HOST:PORT`` of the store (useful with ``host_store=True`` and port 0)."""
        return None if self._rdv.host is None else f"tcp://{self._rdv.host}:{self._rdv.port}"

    @property
    def address(self) -> tuple[str, int] | None:
        """``(host, port)`` this endpoint accepts channels on (None until open)."""
        return None if self._record is None else (self._record.host, self._record.port)

    @property
    def is_open(self) -> bool:
        return self._state == "open"

    async def close(self, timeout: float = 5.0) -> None:
        """Close every channel (pending ops, and ops still connecting, fail with :class:`EndpointClosedError`),
        withdraw from the store and release exported memory. Idempotent; bounded by ``timeout``.
        Registered tensors stay valid. Called while :meth:`open` is still running
        in another task, it cancels that open, which then raises :class:`EndpointClosedError`
        (not :class:`asyncio.CancelledError`) after undoing what it had done, and waits for it
        (bounded by ``timeout``). Called while another task closes it, it returns once that close
        ended. Cancelled, it stops waiting only: the close goes on (a task of its own) to its end."""
        if self._state == "open":
            self._state, self._closing = "closing", asyncio.ensure_future(self._close(timeout))
        if self._state == "closing" and self._closing is not None:
            await asyncio.wait({self._closing})  # (its own waits are bounded)
            return self._closing.result()
        if self._state == "opening":  # open() is still running (in another task): stop it, wait for it
            opening = self._opening
            if opening is not None and opening is not asyncio.current_task() and not opening.done():
                self._cut_open = True
                opening.cancel()
                await asyncio.wait({opening}, timeout=timeout)
            return
        if self._state == "new":
            self._rdv.close()
            self._exports.close()
        self._state = "closed"

    async def _close(self, timeout: float) -> None:
        self._inbox.close()  # (next_notification waiters raise EndpointClosedError now)
        self._connector.stop_dials()  # (so do ops connecting: no channel is adopted any more)
        if self._dump_signal is not None:
            self.loop.remove_signal_handler(self._dump_signal)
        if self._record is not None:
            await self._rdv.withdraw(self._record, time.monotonic() + min(timeout, 2.0))
        end = time.monotonic() + timeout
        if chans := list(self._all):  # (posts waiting for credits: up to 1 s to go out)
            await self._connector.drain_posts(chans, min(1.0, max(0.0, end - time.monotonic())))
            await asyncio.to_thread(self._connector.close_all, chans, max(0.1, end - time.monotonic()))
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=max(0.1, end - time.monotonic()))
        self._state = "closed"
        self._teardown_sync()

    def _teardown_sync(self) -> None:
        self.staging.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._unix_listener is not None:
            self._unix_listener.close()
            self._unix_listener = None
        self._exports.close()  # (live same-host peers may keep some memory until they exit)
        self._rdv.close()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        (task := self.loop.create_task(coro)).add_done_callback(self._tasks.discard)
        self._tasks.add(task)
        return task

    # ------------------------------------------------------------------ registry
    def register(self, name: str, tensor: torch.Tensor) -> BufferSpec:
        """Make ``tensor`` reachable by peers as ``name``. Non-blocking.

        The tensor must be contiguous, on the CPU or a CUDA device. A CUDA tensor stays where it is:
        peers reach it over ``cuda_ipc`` or ``nccl``, else through the staged path (its spec's
        ``device`` says e.g. ``cuda:0``). If the
        endpoint allows the ``shm`` plane, a CPU tensor's storage is moved into a shared-memory segment
        *in place*: the tensor object (and a Parameter wrapping it) keeps working, but other tensors
        that were views of its old storage no longer alias it. Registering the same tensor under the
        same name again is a no-op; the same name with another tensor raises
        :class:`BufferMismatchError`. Connected peers learn of the change.
        """
        if self._state in ("closing", "closed"):
            raise EndpointClosedError(f"endpoint {self.name!r} is closed")
        spec, changed = self._exports.register(name, tensor)
        if changed:
            self._registry_changed()
        return spec

    def new_buffer(self, name: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.uint8, *,
                   device: torch.device | str | None = None) -> torch.Tensor:
        """Register a new zero-filled tensor under ``name`` and return it. Non-blocking.

        Like ``register(name, torch.zeros(shape, dtype=dtype, device=device))``, except where the
        memory comes from. A CPU buffer (the default), with the ``shm`` plane allowed, is made in
        shared memory from the start: nothing is copied, and its pages are zero-filled by the
        kernel when first touched (by whoever writes it first), so a buffer of many GiB costs the
        event loop microseconds. A CUDA buffer, with ``cuda_ipc`` allowed and CUDA's IPC engine
        in use, is one driver allocation of its own (``cuMemAlloc``), which CUDA IPC can export
        whatever torch's allocator is set to (expandable segments, ``cudaMallocAsync`` and
        cuMem-based pools cannot be exported); it is freed when the last view of it dies and is
        not counted by ``torch.cuda.memory_allocated()``. Same errors as :meth:`register`, and
        :class:`PlaneUnavailableError` if the driver refuses the allocation.
        """
        if self._state in ("closing", "closed"):
            raise EndpointClosedError(f"endpoint {self.name!r} is closed")
        tensor = self._exports.new_buffer(name, tuple(shape), dtype, device)
        self._registry_changed()
        return tensor

    def unregister(self, name: str, *, discard: bool = False, copy_back: bool = True) -> None:
        """Remove ``name``; peers' later ops on it fail with :class:`UnknownBufferError`.

        Blocks while same-host peers' one-sided copies into or out of it are in flight (``shm``,
        ``cuda_ipc``: up to 2 s, then the buffer is taken back anyway and those ops fail: none is
        reported done after this returned), and while peers' ops move its bytes through a channel
        (tcp, staged: up to 2 s, then those channels are broken, their ops fail with
        :class:`PeerLostError`). A frozen peer's shm copy past that bound may still write it.
        If the tensor lived alone in a shared-memory segment, its bytes are copied back into private
        memory (blocking for the copy; the tensor object is re-pointed in place), so a stale mapping
        of a peer can never write into it again (other tensor objects sharing its storage keep the
        segment); while another endpoint of this process exports this same tensor, the last of them
        to unregister or close makes it. One sharing a segment with other registered tensors stays.
        ``copy_back=False`` skips the copy (unless another unregister of it asked): the tensor stays
        in its segment, which peers' stale mappings may still write (for memory no peer writes).
        ``discard=True`` (a buffer its owner is done with) leaves the tensor object empty instead (no
        elements; a second name it is registered under must be registered again).
        """
        self._exports.unregister(name, discard=discard, copy_back=copy_back)
        self._registry_changed()

    @property
    def buffers(self) -> dict[str, BufferSpec]:
        """This endpoint's registered buffers (a copy)."""
        return self._exports.specs()

    # ------------------------------------------------------------------ planes' exports
    def exporter(self, plane: str) -> Exporter | None:
        """The exporter of plane ``plane`` (the plane's half that exports this endpoint's buffers
        at registration and says what peers see of them), or None if that plane is not allowed
        here or exports nothing. Non-blocking. A plane reaches its own endpoint-wide state (an
        engine, a slot table) through it."""
        return self._exports.exporter(plane)

    def unmapped(self, ch: Channel, epoch: int) -> None:
        """A peer confirmed registry ``epoch`` (reader thread): release what no one may use any more."""
        if ch.holder is not None:
            self._exports.acked(ch.holder, epoch)

    # ------------------------------------------------------------------ exports
    def wire_registry(self) -> tuple[int, list[WireBuffer]]:
        """The registry as peers are told it (any thread)."""
        return self._exports.wire_registry()

    def _registry_changed(self) -> None:
        if self._state != "open" or self._registry_dirty:
            return
        self._registry_dirty = True
        self.loop.call_soon(self._flush_registry)

    def _flush_registry(self) -> None:
        self._registry_dirty = False
        self._connector.broadcast(Registry(*self.wire_registry()))

    # ------------------------------------------------------------------ channels
    def plane_status(self, plane: str) -> tuple[bool, str]:
        """Whether this endpoint offers ``plane`` to its peers, and why or why not: not allowed by
        ``planes=``, its engine could not be made (a ``cuda_ipc`` engine is made at its first use,
        possibly by this call), or, for ``nccl``, CUDA was not in use when the endpoint was created
        or NCCL did not load (decided at :meth:`open`, or at a later handshake once CUDA is in use).
        Non-blocking but for making an engine; ``ValueError`` for an unknown plane."""
        return self._offers.status(plane)

    def channel_closed(self, ch: Channel, exc: BaseException) -> None:
        """Called on the loop when a channel breaks or closes."""
        self._connector.closed(ch)
        if ch.orderly:
            log.info("channel %s closed by %r", ch.id, ch.peer_name)
        elif isinstance(exc, (PeerLostError, ProtocolError)) and self._state == "open":
            log.warning("channel %s to %r lost: %s", ch.id, ch.peer_name, exc)
            self._auto_dump(f"peer lost: {ch.peer_name}: {exc}")

    def on_timeout(self, ch: Channel, op: Any, exc: TransportTimeoutError) -> None:
        log.warning("%s", exc)
        self._auto_dump(f"timeout: {exc}")

    def _auto_dump(self, reason: str, *, force: bool = False) -> None:
        self._dumps.auto(reason, force=force)

    def _dump_on_signal(self) -> None:
        self._dumps.auto("signal", force=True)

    def dump_flight_recorder(self, path: str | Path | None = None) -> Path:
        """Write the flight recorder as JSON (to ``path`` or a new file in the dump dir); return the
        path. Blocks for the write."""
        return self._dumps.now(path)

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self._hb_interval)
            self._connector.tick(time.monotonic(), self._hb_interval, self._hb_timeout)
            self._exports.tick()

    # ------------------------------------------------------------------ notifications
    def deliver(self, note: Notification, ch: Channel, here: bool = False, ack: Callable[[], None] | None = None) -> bool:
        """Channel reader threads (``here``: the event loop) hand notifications over here, then
        ``ack``; never blocks (:meth:`Inbox.deliver <transport.inbox.Inbox.deliver>`, ``deliver_here``)."""
        return (self._inbox.deliver_here if here else self._inbox.deliver)(note, ch.credits, ack)

    def on_notification(self, callback: Callable[[Notification], Any] | None, *, prefix: bytes = b"") -> None:
        """Call ``callback(note)`` on the event loop for each notification instead of queueing it.

        With ``prefix``, only notifications whose payload starts with it go to
        ``callback`` (the longest matching prefix wins); the others keep going
        to the catch-all callback or the queue. This lets libraries built on an
        endpoint (``rl_sync``) take their own messages while the application
        reads the rest. ``callback=None`` removes the handler for ``prefix``.
        Notifications already queued stay in the queue. The callback runs on
        the event loop and must not block; an exception it raises is logged.
        Non-blocking; ``TypeError`` for a ``prefix`` that is not bytes.
        """
        self._inbox.on_notification(callback, prefix)

    async def next_notification(self, timeout: float | None = None) -> Notification:
        """Wait for the next :class:`Notification`. Raises :class:`TransportTimeoutError` at the deadline,
        :class:`EndpointClosedError` if the endpoint is not open, ``ValueError`` for a negative or NaN timeout."""
        self._check_open()
        return await self._inbox.next(self.timeout if timeout is None else timeout)

    async def notifications(self) -> AsyncIterator[Notification]:
        """Iterate over notifications as they arrive (ends when the endpoint closes)."""
        self._check_open()
        async with contextlib.aclosing(self._inbox.iterate()) as notes:
            async for note in notes:
                yield note

    # ------------------------------------------------------------------ introspection
    @property
    def peers(self) -> dict[str, Peer]:
        """Peers with an open channel."""
        return {n: ch.peer for n, ch in self._channels.items() if ch.is_open}

    def __repr__(self) -> str:
        return f"<Endpoint {self.name!r} {self._state} buffers={len(self.buffers)} peers={len(self.peers)}>"
