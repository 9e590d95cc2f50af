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
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from . import auth
from .address import AddressBook, encode_address
from .channel import Channel
from .connector import Connector
from .errors import (
    BufferMismatchError,
    EndpointClosedError,
    InvalidTensorError,
    PeerLostError,
    Phase,
    PlaneUnavailableError,
    ProtocolError,
    StaleBufferError,
    TransportTimeoutError,
    UnknownBufferError,
)
from .exports import Exports
from .flight_recorder import FlightRecorder, OpKind
from .hostinfo import local_host
from .ipc import IpcEngine
from .p2p import LinkEngine, link_engine_probe
from .peer import Notification, Peer, Route
from .planes import make_exporters, validate_planes
from .ranges import At, plan_items
from .registry import BufferSpec
from .rendezvous import EndpointRecord, Rendezvous
from .staging import Staging, StagingConfig
from .wire import MAX_NOTIFY, Notify, Registry, WireBuffer

__all__ = ["Endpoint"]

log = logging.getLogger(__name__)

_Tensors = Mapping[str, "torch.Tensor | At"]
_DUMP_INTERVAL = 5.0  # at most one automatic flight-recorder dump per this many seconds
_WITHDRAW_S = 2.0  # how long an open() that failed while publishing waits to take its record back


def _current_cuda_device() -> int | None:
    """The calling thread's current CUDA device if this process already uses CUDA, else None
    (never starts CUDA)."""
    try:
        return torch.cuda.current_device() if torch.cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - e.g. a forked child of a CUDA process: no nccl here
        return None


class Endpoint:
    """A named endpoint: register buffers, then ``put``/``get`` peers' buffers by name.

    Use it as an async context manager (``async with Endpoint(...) as ep``) or
    call :meth:`open` / :meth:`close`.

    Parameters:
        name: unique name of this endpoint in the store.
        store: ``"tcp://HOST:PORT"``, a ``torch.distributed.Store``, or None
            to use ``MASTER_ADDR``/``MASTER_PORT`` (as set by ``torchrun``).
        host_store: serve the TCPStore from this process (port 0 picks a free
            port; read it back from :attr:`store_url`).
        timeout: default deadline, in seconds, of every operation that takes
            ``timeout=None``.
        planes: allowed data planes, in any order, e.g. ``("tcp",)``: at
            least one CPU plane (``shm``, ``tcp``), plus ``cuda_ipc`` to let
            same-host peers copy straight into and out of this endpoint's
            GPU buffers (and ours); None allows all. The CPU plane per peer is
            chosen by :func:`transport.planes.choose_cpu_plane`, the GPU plane
            by :func:`transport.planes.choose_gpu_plane` (``cuda_ipc``, else
            the staged path, which needs only the channel's socket and is
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
        max_pending_notifications: notifications queued for the application
            before the channels delivering them are back-pressured.
        staging: :class:`transport.StagingConfig` of the staged path
            that moves CUDA tensors (bounce-buffer size and count, stall
            bound); None uses the defaults (4 x 8 MiB per op).
        ipc_engine: a zero-argument factory of the ``cuda_ipc`` plane's
            engine (:class:`transport.ipc.IpcEngine`). None (the default)
            uses CUDA's when CUDA is available. ``transport.ipc_memfd.MemfdIpcEngine``
            runs the plane's protocol over CPU shared memory, for tests and
            debugging without a GPU (both endpoints need it; their CPU
            buffers then travel over ``cuda_ipc`` instead of ``shm``).
        nccl_engine: a zero-argument factory of the ``nccl`` plane's link
            engine (:class:`transport.p2p.LinkEngine`). None (the default)
            uses NCCL on the current CUDA device of the thread that creates
            the endpoint, if the process already uses CUDA then (an endpoint
            never starts CUDA itself) and NCCL loads; if CUDA comes into use
            only later, on the event loop thread's current device as of the
            first channel set up after that (channels set up before keep
            going without a link: their GPU ops are staged); for another device
            pass ``functools.partial(transport.cuda.nccl_link.NcclLinkEngine, index)``.
            Each channel to a peer that offers nccl too then gets its own
            communicator (leave ``nccl`` out of ``planes=`` to avoid that). ``transport.p2p.SocketLinkEngine`` runs the
            plane's protocol over a second TCP connection, on CPU memory (tests
            and debugging without GPUs; both endpoints need it).
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
        ipc_engine: Callable[[], IpcEngine] | None = None,
        nccl_engine: Callable[[], LinkEngine] | None = None,
        secret: str | bytes | None = None,
    ) -> None:
        if not isinstance(name, str) or not name or len(name) > 200 or "/" in name:
            raise ValueError(f"endpoint name must be a non-empty string of <= 200 chars without '/', got {name!r}")
        if timeout <= 0 or heartbeat_interval <= 0 or heartbeat_timeout <= heartbeat_interval:
            raise ValueError("timeout and heartbeat_interval must be > 0 and heartbeat_timeout > heartbeat_interval")
        self.name = name
        self._secret, self.secret_source = auth.explicit_secret(secret)  # (None: the store's, read at open)
        self.incarnation = secrets.randbits(63)
        self.timeout = float(timeout)
        self.planes = validate_planes(planes)
        if staging is not None and not isinstance(staging, StagingConfig):
            raise ValueError(f"staging must be a transport.StagingConfig, got {type(staging).__name__}")
        self.staging = Staging(staging)
        if ipc_engine is not None and not callable(ipc_engine):
            raise ValueError(f"ipc_engine must be a zero-argument factory of an IPC engine, got {ipc_engine!r}")
        # the registry, and each plane's exports of its buffers (shm's segments, cuda_ipc's handles)
        self._exports = Exports(make_exporters(name, self.planes, [], ipc_engine))
        self._registry = self._exports.registry
        if nccl_engine is not None and not callable(nccl_engine):
            raise ValueError(f"nccl_engine must be a zero-argument factory of a link engine, got {nccl_engine!r}")
        self._nccl_factory = nccl_engine
        self.nccl_engine: LinkEngine | None = None  # set at open() when this endpoint can offer nccl
        self.nccl_reason = "not probed yet (the endpoint is not open)"
        # the device an NCCL link would use: the creating thread's current device, if that thread's
        # process already uses CUDA (an endpoint never starts CUDA itself: CPU-only users on GPU
        # machines, and processes forked after CUDA started, must not pay for or trip over it)
        self._nccl_device = _current_cuda_device() if "nccl" in self.planes and nccl_engine is None else None
        self._nccl_probe: asyncio.Future[tuple[LinkEngine | None, str]] | None = None  # see _late_nccl
        self._nccl_probe_device = 0
        self._listen_host = listen_host
        self._hb_interval = heartbeat_interval
        self._hb_timeout = heartbeat_timeout
        self._dump_dir = Path(dump_dir) if dump_dir is not None else None
        self._dump_signal = dump_signal
        self._rdv = Rendezvous(store, host_store=host_store, timeout=timeout)
        self._book = AddressBook()  # peers added from their address records (add_peer)
        self.recorder = FlightRecorder(name, self.incarnation, flight_recorder_size)
        self._connector = Connector(self)  # accepting, dialling, and which channel carries each peer's ops
        self._channels = self._connector.channels
        self._all = self._connector.all
        self._tasks: set[asyncio.Task[Any]] = set()
        self._listener: socket.socket | None = None
        self._record: EndpointRecord | None = None
        self._state = "new"
        self._opening: asyncio.Task[Any] | None = None  # the task running open(), while it runs
        self._cut_open = False  # close() cancelled that task: open() raises EndpointClosedError
        self._notes: asyncio.Queue[Notification] | None = None
        self._notes_room: Any = None
        self._max_notes = max_pending_notifications
        self._on_note: Callable[[Notification], Any] | None = None
        self._routes: dict[bytes, Callable[[Notification], Any]] = {}  # payload prefix -> callback
        self._registry_dirty = False
        self._last_auto_dump = -_DUMP_INTERVAL
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
        self._notes = asyncio.Queue()
        self._notes_room = threading.Semaphore(self._max_notes)
        publishing = False
        try:
            stored = await self._rdv.open(want_secret=self._secret is None)
            if self._secret is None:
                self._secret = stored
            host = self._listen_host or self._guess_listen_host()
            lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((host, 0))
            lsock.listen(128)
            lsock.setblocking(False)
            self._listener = lsock
            self._record = EndpointRecord(self.name, host, lsock.getsockname()[1], self.incarnation, local_host())
            if "nccl" in self.planes and self._nccl_factory is None and self._nccl_device is None:
                self.nccl_reason = ("CUDA was not in use in this process when the endpoint was created (call "
                                    "torch.cuda.set_device(...) first to offer nccl)")
                log.info("endpoint %r does not offer the nccl plane: %s", self.name, self.nccl_reason)
            elif "nccl" in self.planes:
                self.nccl_engine, self.nccl_reason = link_engine_probe(self._nccl_factory, self._nccl_device)
                if self.nccl_engine is None:
                    log.info("endpoint %r does not offer the nccl plane: %s", self.name, self.nccl_reason)
            else:
                self.nccl_reason = f"not allowed here (planes={self.planes})"
            self._exports.start()  # export the buffers registered before open, and every later one at once
            self._spawn(self._connector.accept_loop())
            self._spawn(self._monitor())
            publishing = True
            await self._rdv.publish(self._record, time.monotonic() + self.timeout)
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

    def _guess_listen_host(self) -> str:
        host = self._rdv.host
        if host is None:
            return "127.0.0.1"
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, self._rdv.port or 1))
                return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"

    @property
    def store_url(self) -> str | None:
        """``tcp://HOST:PORT`` of the store (useful with ``host_store=True`` and port 0)."""
        if self._rdv.host is None:
            return None
        return f"tcp://{self._rdv.host}:{self._rdv.port}"

    @property
    def address(self) -> tuple[str, int] | None:
        """``(host, port)`` this endpoint accepts channels on (None until open)."""
        return None if self._record is None else (self._record.host, self._record.port)

    @property
    def is_open(self) -> bool:
        return self._state == "open"

    async def close(self, timeout: float = 5.0) -> None:
        """Close every channel (pending ops fail with :class:`EndpointClosedError`),
        withdraw from the store and release exported memory. Idempotent; bounded by ``timeout``.
        Registered tensors stay valid for the caller. Called while :meth:`open` is still running
        in another task, it cancels that open, which then raises :class:`EndpointClosedError`
        (not :class:`asyncio.CancelledError`) after undoing what it had done, and waits for it
        (bounded by ``timeout``)."""
        if self._state == "opening":  # open() is still running (in another task): stop it, wait for it
            opening = self._opening
            if opening is not None and opening is not asyncio.current_task() and not opening.done():
                self._cut_open = True
                opening.cancel()
                await asyncio.wait({opening}, timeout=timeout)
            return
        if self._state in ("closed", "closing", "new"):
            if self._state == "new":
                self._rdv.close()
                self._exports.close()
            self._state = "closed"
            return
        self._state = "closing"
        if self._dump_signal is not None:
            self.loop.remove_signal_handler(self._dump_signal)
        if self._record is not None:
            await self._rdv.withdraw(self._record, time.monotonic() + min(timeout, 2.0))
        end = time.monotonic() + timeout
        chans = list(self._all)
        if chans:
            await asyncio.to_thread(self._close_channels, chans, max(0.1, end - time.monotonic()))
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=max(0.1, end - time.monotonic()))
        self._state = "closed"
        self._teardown_sync()

    def _close_channels(self, chans: list[Channel], timeout: float) -> None:
        end = time.monotonic() + timeout
        for ch in chans:
            ch.say_bye("endpoint closed")
        for ch in chans:  # the Byes go out in parallel; this waits for all of them, bounded
            ch.close("endpoint closed", max(0.0, min(1.0, end - time.monotonic())))
        for ch in chans:
            ch.join(max(0.0, end - time.monotonic()))

    def _teardown_sync(self) -> None:
        self.staging.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._exports.close()  # (live same-host peers may keep some memory until they exit)
        self._rdv.close()

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _check_open(self) -> None:
        if self._state != "open":
            raise EndpointClosedError(f"endpoint {self.name!r} is {self._state}; use 'async with Endpoint(...)'")

    def _deadline(self, timeout: float | None) -> float:
        t = self.timeout if timeout is None else timeout
        if t <= 0:
            raise ValueError(f"timeout must be > 0, got {t}")
        return time.monotonic() + t

    # ------------------------------------------------------------------ registry
    def register(self, name: str, tensor: torch.Tensor) -> BufferSpec:
        """Make ``tensor`` reachable by peers as ``name``. Non-blocking.

        The tensor must be contiguous, on the CPU or a CUDA device. A CUDA
        tensor stays where it is: peers reach it through the staged path
        (its spec's ``device`` says e.g. ``cuda:0``). If the endpoint allows
        the ``shm`` plane, a CPU tensor's storage is moved into a shared-memory
        segment *in place*: the tensor object (and a Parameter wrapping it)
        keeps working, but other tensors that were views of its old storage no
        longer alias it. Registering the same tensor under the same name again
        is a no-op; the same name with another tensor raises
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
        shape = tuple(shape)
        if not isinstance(dtype, torch.dtype) or any(not isinstance(d, int) or d < 0 for d in shape):
            raise InvalidTensorError(f"{name!r}: new_buffer needs a torch.dtype and a shape of ints >= 0, "
                                     f"got {dtype!r} and {shape!r}")
        try:
            where = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidTensorError(f"{name!r}: new_buffer: bad device {device!r}: {exc}") from exc
        if where.type not in ("cpu", "cuda"):
            raise InvalidTensorError(f"{name!r}: new_buffer makes CPU or CUDA buffers, not {where.type}")
        tensor = self._exports.new_buffer(name, shape, dtype, where)
        self._registry_changed()
        return tensor

    def unregister(self, name: str, *, discard: bool = False) -> None:
        """Remove ``name``; peers' later ops on it fail with :class:`UnknownBufferError`. Non-blocking.

        If the tensor lived alone in a shared-memory segment, its bytes are copied
        back into private memory (blocking for the copy; the tensor object is
        re-pointed in place), so a peer still holding a stale mapping can never
        write into it again. Other tensor objects that shared its storage keep
        the shared segment and no longer alias it. A tensor that shares a segment
        with other registered buffers (a view of an arena) stays where it is.
        ``discard=True`` (for a buffer its owner is done with) skips that copy:
        the tensor object is left empty (no elements) instead (so a second
        name it is registered under must be registered again).
        """
        self._exports.unregister(name, discard=discard)
        self._registry_changed()

    @property
    def buffers(self) -> dict[str, BufferSpec]:
        """This endpoint's registered buffers (a copy)."""
        return self._exports.specs()

    # ------------------------------------------------------------------ cuda_ipc
    @property
    def ipc_engine(self) -> IpcEngine | None:
        """The ``cuda_ipc`` plane's engine of this endpoint, or None (see :attr:`ipc_reason`)."""
        exporter = self._exports.exporter("cuda_ipc")
        return None if exporter is None else exporter.engine  # type: ignore[attr-defined]

    @property
    def ipc_reason(self) -> str:
        """Why this endpoint has (or has not) an IPC engine for ``cuda_ipc``."""
        exporter = self._exports.exporter("cuda_ipc")
        return f"not allowed here (planes={self.planes})" if exporter is None else exporter.reason  # type: ignore[attr-defined]

    def ipc_unmapped(self, ch: Channel, epoch: int) -> None:
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
        epoch, bufs = self.wire_registry()
        for ch in list(self._all):
            if ch.is_open:
                try:
                    ch.send(Registry(epoch, bufs))
                except PeerLostError:
                    pass

    # ------------------------------------------------------------------ channels
    def _offered(self) -> list[str]:
        """The planes this endpoint's Hello offers: those allowed, less nccl if it cannot use it."""
        return [p for p in self.planes if p != "nccl" or self.nccl_engine is not None]

    async def _late_nccl(self) -> None:
        """Before each handshake: an endpoint created before its process used CUDA offers nccl from
        the first channel set up once CUDA is in use (on the event loop thread's current device;
        probed once, on a worker thread: loading NCCL takes a while; logged). Raises nothing but a
        cancellation."""
        if (self._nccl_device is not None or self._nccl_factory is not None or self.nccl_engine is not None
                or "nccl" not in self.planes or self._state != "open"):
            return
        if self._nccl_probe is None:
            device = _current_cuda_device()  # (a cheap check while CUDA is not in use)
            if device is None:
                return
            self._nccl_probe = asyncio.ensure_future(asyncio.to_thread(link_engine_probe, None, device))
            self._nccl_probe_device = device
        probe = self._nccl_probe
        try:
            engine, reason = await asyncio.shield(probe)
        except BaseException:
            if probe.done() and not probe.cancelled() and probe.exception() is not None and self._nccl_probe is probe:
                self._nccl_probe = None  # (no executor any more, at shutdown): a later handshake may try again
            raise
        if self._nccl_device is None:  # the first one back from the probe publishes it
            self._nccl_device = self._nccl_probe_device
            self.nccl_engine, self.nccl_reason = engine, reason
            if engine is None:
                log.info("endpoint %r does not offer the nccl plane: %s", self.name, reason)
            else:
                log.info("endpoint %r offers the nccl plane from now on (CUDA came into use after it was "
                         "created): %s", self.name, reason)

    async def _channel(self, peer: str, deadline: float) -> Channel:
        """The channel that carries ops to ``peer``, dialled if there is none (bounded by ``deadline``)."""
        return await self._connector.channel(peer, deadline)

    def channel_closed(self, ch: Channel, exc: BaseException) -> None:
        """Called on the loop when a channel breaks or closes."""
        self._connector.closed(ch)
        threading.Thread(target=ch.join, args=(2.0,), name="transport-join", daemon=True).start()
        if ch.orderly:
            log.info("channel %s closed by %r", ch.id, ch.peer_name)
        elif isinstance(exc, (PeerLostError, ProtocolError)) and self._state == "open":
            log.warning("channel %s to %r lost: %s", ch.id, ch.peer_name, exc)
            self._auto_dump(f"peer lost: {ch.peer_name}: {exc}")

    def on_timeout(self, ch: Channel, op: Any, exc: TransportTimeoutError) -> None:
        log.warning("%s", exc)
        self._auto_dump(f"timeout: {exc}")

    def _auto_dump(self, reason: str, *, force: bool = False) -> None:
        """Dump the flight recorder on a worker thread; at most once per ``_DUMP_INTERVAL`` s
        unless forced (a burst of timeouts writes one file, not hundreds)."""
        now = time.monotonic()
        if not force and now - self._last_auto_dump < _DUMP_INTERVAL:
            log.debug("flight recorder dump skipped (one was written %.1f s ago): %s", now - self._last_auto_dump,
                      reason)
            return
        self._last_auto_dump = now
        path = None
        if self._dump_dir is not None:
            path = self._dump_dir / f"fr-{self.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}.json"

        def write() -> None:
            try:
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                self.recorder.dump(path, reason=reason)
            except OSError as exc:
                log.error("could not dump the flight recorder: %s", exc)

        threading.Thread(target=write, name="transport-fr-dump", daemon=True).start()

    def _dump_on_signal(self) -> None:
        self._auto_dump("signal", force=True)

    def dump_flight_recorder(self, path: str | Path | None = None) -> Path:
        """Write the flight recorder as JSON (to ``path`` or a new file in the dump dir); return the path."""
        if path is None and self._dump_dir is not None:
            self._dump_dir.mkdir(parents=True, exist_ok=True)
            path = self._dump_dir / f"fr-{self.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}.json"
        return self.recorder.dump(path, reason="request")

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self._hb_interval)
            now = time.monotonic()
            for ch in list(self._all):
                try:
                    ch.tick(now, self._hb_interval, self._hb_timeout)
                except PeerLostError:
                    pass
            self._exports.tick()

    # ------------------------------------------------------------------ operations
    def address_record(self) -> bytes:
        """This open endpoint as opaque bytes a peer passes to :meth:`add_peer`. Non-blocking.

        They carry the address it accepts channels on, its incarnation, its host identity and
        its secret: a credential (see :mod:`transport.address`). Raises
        :class:`EndpointClosedError` unless the endpoint is open."""
        self._check_open()
        assert self._record is not None and self._secret is not None
        return encode_address(self._record, self._secret)

    def add_peer(self, record: bytes) -> str:
        """Make the endpoint that ``record`` (its :meth:`address_record`) describes reachable by
        the name returned, with no store in common. Non-blocking; nothing is dialled yet.

        Dialling it then uses the record, not the store, and proves the record's secret. Adding
        a record of a name again replaces the earlier one (a channel already open stays).
        ``ValueError`` for bytes that are not such a record (:func:`transport.address.decode_address`)."""
        self._check_open()
        return self._book.add(record, own_name=self.name)

    async def connect(self, peer: str, timeout: float | None = None) -> Peer:
        """Open (or reuse) the channel to ``peer``; return its :class:`Peer`.

        Waits until ``peer`` appears in the store. Raises
        :class:`PeerNotFoundError` if it does not before the deadline,
        :class:`TransportTimeoutError` (phase connect/handshake) if it does not
        answer, :class:`PlaneUnavailableError` if no allowed plane reaches it.
        Cancelling it abandons the dial and leaves the endpoint usable.
        """
        ch = await self._channel(peer, self._deadline(timeout))
        return ch.peer

    async def put(self, peer: str, tensors: _Tensors, *, notify: bytes | None = None,
                  timeout: float | None = None) -> None:
        """Write ``tensors`` into ``peer``'s registered buffers of the same names.

        Each value is a tensor of exactly the buffer's dtype and shape, or
        :class:`transport.At` ``(tensor, offset)`` for a sub-range. Returns once
        the target holds the bytes (remote completion). ``notify`` (bytes, at
        most 1 MiB) is delivered to the target's notifications only after all
        bytes have landed. Connects first if needed.

        Bad input raises before any byte moves (:class:`UnknownBufferError`,
        :class:`BufferMismatchError`, :class:`InvalidTensorError`). At the
        deadline (``timeout`` or the endpoint's) it raises
        :class:`TransportTimeoutError`; a lost peer gives :class:`PeerLostError`.

        Timeout and cancellation (of the calling task) leave no writer behind:
        the call raises only once nothing of the op writes into the target's
        buffers any more, or what still does is ordered before every later op of
        this endpoint on them. A copy into the peer's memory (``shm``) stops at
        its next chunk and is waited for; one that cannot be stopped
        (``cuda_ipc``) is waited for; bytes already handed to the channel
        (``tcp``, staged) or posted on its NCCL link still land, before anything
        sent after them (a timeout on the NCCL link closes the channel, and the
        next one's link is set up only once the old one's transfers are over). So
        a put that follows returns only once the target holds exactly its bytes.
        The target's buffer may hold a mix of old and new bytes, and the source
        tensors stay referenced, and may still be read, until the bytes are out.
        The endpoint stays usable. The waits are bounded (seconds; staged copies:
        the staging stall bound) and a second cancellation does not cut them
        short; one that runs out is logged (a timeout's message says so).

        CUDA tensors: the op waits for the work queued on this thread's current
        stream of each tensor's device when it starts (at the call, unless it
        first waits for a connection, a link or an earlier op of the channel);
        leave the source unmodified until the call returns.
        """
        deadline = self._deadline(timeout)
        if notify is not None:
            _check_payload(notify)
        ch = await self._channel(peer, deadline)
        await self._transfer(ch, OpKind.PUT, tensors, deadline, lambda plane, op, pairs: plane.put(op, pairs, notify),
                             here=notify is None)

    async def get(self, peer: str, tensors: _Tensors, *, timeout: float | None = None) -> None:
        """Read ``peer``'s registered buffers into ``tensors`` (same rules as :meth:`put`).

        Returns once every byte is in the local tensors. On timeout or
        cancellation the tensors' contents are unspecified, but nothing of the op
        writes into them once the call has raised, so they can be reused at once:
        a copy still running stops at its next chunk (``shm``, a get reply
        arriving over ``tcp``), one that cannot be stopped (``cuda_ipc``, a staged
        copy) is waited for, and one whose bytes are still trickling in from the
        peer, or an NCCL receive not done 0.25 s (plus its bytes at 1 GB/s) after
        the call gave up, has its
        channel closed (the link aborted; the other pending ops on it fail with
        :class:`PeerLostError`). The waits are bounded as for
        :meth:`put`.
        """
        deadline = self._deadline(timeout)
        ch = await self._channel(peer, deadline)
        await self._transfer(ch, OpKind.GET, tensors, deadline, lambda plane, op, pairs: plane.get(op, pairs),
                             here=True)

    async def route(self, peer: str, tensors: _Tensors, *, timeout: float | None = None) -> Route:
        """Which plane a put or get of ``tensors`` with ``peer`` takes now, and why; no byte moves.

        ``tensors`` is what :meth:`put` or :meth:`get` would be given, and is checked the same way
        (bad input raises the same errors). Connects first if needed, and waits for an NCCL link
        still being set up (bounded by ``timeout``, or the endpoint's); cancellable like
        :meth:`connect`. The answer holds until the peer's registry, the channel or its link
        changes.
        """
        deadline = self._deadline(timeout)
        ch = await self._channel(peer, deadline)
        pairs = await self._plan(ch, tensors, deadline)
        plane = await self._plane(ch, pairs, deadline)
        return Route(plane.name, ch.reason_for(plane))

    async def map(self, peer: str, name: str, *, timeout: float | None = None) -> torch.Tensor:
        """A tensor that *is* ``peer``'s registered buffer ``name``: no copy.

        For a peer on this host: a CPU buffer is mapped over ``shm`` (the channel
        must run it), read-only; a GPU buffer over ``cuda_ipc`` (it must be this
        peer's GPU plane), as a CUDA tensor on the device that holds the
        allocation. Anything else raises :class:`PlaneUnavailableError` saying
        why (:meth:`map_route` tells which plane would map it, without mapping);
        :class:`UnknownBufferError` if the peer has no such buffer. Connects
        first if needed; bounded by ``timeout`` (or the endpoint's), cancellable
        like :meth:`connect` (opening a CUDA mapping runs on a worker thread; a
        cancelled call gives it back).

        The tensor has the buffer's dtype and shape and shows the peer's bytes
        as they are at each read: nothing orders reads with the peer's writes,
        so the application arranges that (rl_sync's ``mode="shared"`` does it
        with a lock per bank, and on a GPU by the publisher waiting for its
        copies before it lets readers in). Writes: an shm mapping is read-only,
        and writing through it kills this process with SIGSEGV rather than
        change what the peer and other readers see; CUDA cannot map peer memory
        read-only, so writes through a ``cuda_ipc`` mapping *do* change the
        peer's buffer, for the peer and every other process mapping it.

        Lifetime: the mapping stays valid while the tensor (or a view of it)
        lives, even after the peer unregisters the buffer; it then shows the
        bytes the buffer last held, not a buffer registered later under the
        same name. An shm mapping also outlives the peer's process. A
        ``cuda_ipc`` mapping keeps the peer's memory retained for this process
        (the peer frees it only after the last view here died), but not past
        the peer's process: CUDA leaves the memory of an exporting process
        that exited undefined, so keep the peer alive while reading. Each call
        reads the peer's registry (one round trip), so it maps the buffer
        registered under ``name`` at the call. One mapping per peer segment or
        allocation is kept, so mapping the same buffer again costs no new
        mapping.
        """
        deadline = self._deadline(timeout)
        ch = await self._channel(peer, deadline)
        await ch.sync_registry(deadline)  # the peer's registry as of now: never a buffer it has replaced
        for retry in (False, True):
            if name not in ch.peer_specs:
                raise UnknownBufferError(f"peer {peer!r} has no buffer {name!r}")
            plane, _ = ch.map_plane(name)
            try:
                async with asyncio.timeout_at(deadline):
                    return await plane.map(name)
            except TimeoutError:
                raise TransportTimeoutError(f"map({peer!r}, {name!r}): opening the mapping timed out",
                                            Phase.CONNECT) from None
            except StaleBufferError:  # re-registered or unregistered since the registry was read
                if retry:
                    raise
                await ch.sync_registry(deadline)
        raise AssertionError("unreachable")

    async def map_route(self, peer: str, name: str, *, timeout: float | None = None) -> Route:
        """Which plane :meth:`map` would map ``peer``'s buffer ``name`` over, and why; maps nothing.
        Raises what :meth:`map` raises when no plane can map it. Connects first if needed and reads
        the peer's registry (one round trip); bounded by ``timeout`` (or the endpoint's)."""
        deadline = self._deadline(timeout)
        ch = await self._channel(peer, deadline)
        await ch.sync_registry(deadline)
        if name not in ch.peer_specs:
            raise UnknownBufferError(f"peer {peer!r} has no buffer {name!r}")
        plane, why = ch.map_plane(name)
        return Route(plane.name, why)

    async def _transfer(self, ch: Channel, kind: OpKind, tensors: _Tensors, deadline: float,
                        start: Callable[[Any, Any, list[Any]], Awaitable[None]], here: bool = False) -> None:
        """Plan, pick the plane and run one put or get (``start(plane, op, pairs)`` sends it).
        ``here``: the op may be done synchronously by its plane (:meth:`DataPlane.run_here`: a put
        without a notification, or a get). Retried once: after a registry sync if the peer
        re-registered a buffer, and staged if a ``cuda_ipc`` mapping could not be opened here
        (logged)."""
        for retry in (False, True):
            pairs = await self._plan(ch, tensors, deadline, into=kind is OpKind.GET)
            plane = await self._plane(ch, pairs, deadline)
            if here and ch.in_order_now():
                try:
                    if plane.run_here(kind, pairs):
                        return
                except StaleBufferError:
                    if retry:
                        raise
                    await ch.sync_registry(deadline)
                    continue
            op = ch.new_op(kind, [it.name for it, _ in pairs], sum(t.nbytes for _, t in pairs), plane)
            try:
                await ch.run(op, lambda: start(plane, op, pairs), deadline)  # noqa: B023
                return
            except PlaneUnavailableError:
                if retry or plane.name != "cuda_ipc":
                    raise
            except StaleBufferError:
                if retry:
                    raise
                await ch.sync_registry(deadline)

    @staticmethod
    async def _plane(ch: Channel, pairs: list[Any], deadline: float) -> Any:
        """The op's plane; an op for the NCCL link while it is being set up waits for it (bounded).
        One that was given the link as it went down (another thread; the state is read without a
        lock) picks again, so it is never posted on a dead link."""
        plane = ch.plane_for(pairs)
        link = ch.link
        if plane.name == "nccl" and link is not None and link.state != "ready":
            await link.wait(deadline)  # (at once unless pending)
            plane = ch.plane_for(pairs)
        return plane

    async def _plan(self, ch: Channel, tensors: _Tensors, deadline: float, into: bool = False) -> list[Any]:
        """Check the call against the peer's registry (``into``: a get, which writes the tensors); on
        a miss, refresh the cache once and check again."""
        try:
            return plan_items(ch.peer_specs, tensors, peer=ch.peer_name, into=into)
        except (UnknownBufferError, BufferMismatchError):
            if not isinstance(tensors, Mapping):
                raise
            await ch.sync_registry(deadline)
            return plan_items(ch.peer_specs, tensors, peer=ch.peer_name, into=into)

    async def notify(self, peer: str, payload: bytes, *, timeout: float | None = None) -> None:
        """Send ``payload`` (bytes, at most 1 MiB) to ``peer``'s notifications; returns once it is queued there.

        Ordered with this endpoint's puts to ``peer``: a notification sent after
        a put arrives after that put's bytes.
        """
        _check_payload(payload)
        deadline = self._deadline(timeout)
        ch = await self._channel(peer, deadline)
        op = ch.new_op(OpKind.NOTIFY, [], len(payload))

        async def _send() -> None:
            ch.send(Notify(op.op_id, op.seq, bytes(payload)), op=op)

        await ch.run(op, _send, deadline)

    # ------------------------------------------------------------------ notifications
    def deliver(self, note: Notification, ch: Channel) -> bool:
        """Channel reader threads hand notifications over here; blocks while the queue is full
        (back-pressure: the channel reads nothing meanwhile). False if the endpoint or the
        channel closed while waiting (the op is then not acknowledged)."""
        while not self._notes_room.acquire(timeout=0.2):
            if self._state != "open" or not ch.is_open:
                return False
            ch.last_rx = time.monotonic()  # we are the ones not reading: the peer is not silent
        try:
            self.loop.call_soon_threadsafe(self._enqueue_note, note)
        except RuntimeError:
            return False
        return True

    def _enqueue_note(self, note: Notification) -> None:
        callback = self._route(note.payload)
        if callback is not None:
            self._notes_room.release()
            try:
                callback(note)
            except Exception:  # a user callback must not kill the channel
                log.exception("notification callback failed")
            return
        assert self._notes is not None
        self._notes.put_nowait(note)

    def _route(self, payload: bytes) -> Callable[[Notification], Any] | None:
        if self._routes:
            best = b""
            for prefix in self._routes:
                if len(prefix) > len(best) and payload.startswith(prefix):
                    best = prefix
            if best:
                return self._routes[best]
        return self._on_note

    def on_notification(self, callback: Callable[[Notification], Any] | None, *, prefix: bytes = b"") -> None:
        """Call ``callback(note)`` on the event loop for each notification instead of queueing it.

        With ``prefix``, only notifications whose payload starts with it go to
        ``callback`` (the longest matching prefix wins); the others keep going
        to the catch-all callback or the queue. This lets libraries built on an
        endpoint (``rl_sync``) take their own messages while the application
        reads the rest. ``callback=None`` removes the handler for ``prefix``.
        Notifications already queued stay in the queue. The callback runs on
        the event loop and must not block; an exception it raises is logged.
        """
        if not isinstance(prefix, bytes):
            raise TypeError(f"prefix must be bytes, got {type(prefix).__name__}")
        if not prefix:
            self._on_note = callback
        elif callback is None:
            self._routes.pop(prefix, None)
        else:
            self._routes[prefix] = callback

    async def next_notification(self, timeout: float | None = None) -> Notification:
        """Wait for the next :class:`Notification`. Raises :class:`TransportTimeoutError` at the deadline,
        :class:`EndpointClosedError` if the endpoint is not open."""
        self._check_open()
        assert self._notes is not None
        try:
            async with asyncio.timeout(self.timeout if timeout is None else timeout):
                note = await self._notes.get()
        except TimeoutError:
            raise TransportTimeoutError("no notification arrived before the deadline", Phase.NOTIFY) from None
        self._notes_room.release()
        return note

    async def notifications(self) -> AsyncIterator[Notification]:
        """Iterate over notifications as they arrive (ends when the endpoint closes)."""
        self._check_open()
        assert self._notes is not None
        while self._state == "open":
            get = asyncio.ensure_future(self._notes.get())
            try:
                while not get.done():
                    await asyncio.wait([get], timeout=0.5)
                    if self._state != "open" and not get.done():
                        get.cancel()
                        return
            except asyncio.CancelledError:
                get.cancel()
                raise
            self._notes_room.release()
            yield get.result()

    # ------------------------------------------------------------------ introspection
    @property
    def peers(self) -> dict[str, Peer]:
        """Peers with an open channel."""
        return {n: ch.peer for n, ch in self._channels.items() if ch.is_open}

    def __repr__(self) -> str:
        return f"<Endpoint {self.name!r} {self._state} buffers={len(self.buffers)} peers={len(self.peers)}>"


def _check_payload(payload: object) -> None:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidTensorError(f"notification payloads are bytes, got {type(payload).__name__}")
    if len(payload) > MAX_NOTIFY:
        raise InvalidTensorError(f"notification payload of {len(payload)} bytes exceeds {MAX_NOTIFY}")
