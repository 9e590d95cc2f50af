"""Discovery on a ``torch.distributed`` store (a TCPStore in practice).

Each open endpoint publishes one record under ``transport/v1/endpoint/<name>``:
the address it accepts channels on, its incarnation (a random nonce drawn at
every open, so a restarted process is told apart from the dead one) and its
host identity. A peer looks the record up by name, waiting until it appears.
The job's default secret (:mod:`transport.auth`) lives in the same store.

Store clients: the endpoints of one process that name the same store by URL
(or ``MASTER_ADDR``/``MASTER_PORT``) share one TCPStore client, made at the first
open and kept for the process's life (a client whose call fails or times out is
dropped, and the next open makes a new one; a forked child starts without any).
Connecting a TCPStore client can stall for 5 s: before it connects, torch's client
socket formats the store's address with ``getnameinfo``, a reverse DNS look-up,
and when the resolver's UDP query goes unanswered glibc waits out its default
5 s ``timeout`` before asking again (about one connect in 25 on a machine whose
DNS server drops some queries, whatever the store's address, libuv or not).
Sharing the client pays that at most once per process and store, not at every
open. An endpoint that serves the store (``host_store=True``) or is handed a
``Store`` object keeps a client of its own.

Store calls block, so they run on one daemon worker thread per client (the
store client is not assumed to be thread-safe). Every call is bounded by the
caller's deadline: a store that stops answering gives
:class:`TransportTimeoutError` (phase connect), and a call stuck inside the
store client never holds up the process's exit. Waits poll with ``check``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import msgspec

from . import auth
from .errors import PeerNotFoundError, Phase, TransportError, TransportTimeoutError
from .wire import HostInfo

if TYPE_CHECKING:
    from .pauses import PauseWatch

__all__ = ["EndpointRecord", "Rendezvous", "StoreClient", "listen_host", "parse_store_url", "shared_client"]

log = logging.getLogger(__name__)

_PREFIX = "transport/v1/endpoint/"
# what a Store without compare_set raises for it: a Python subclass of torch's Store that does not define
# it raises RuntimeError ("Not implemented"), some others NotImplementedError or AttributeError
_NO_COMPARE_SET = (NotImplementedError, AttributeError, RuntimeError)


class StoreClient:
    """A store client and the one daemon thread that makes it and runs every call on it.

    ``make`` runs on that thread at the first call (or again after it failed). Jobs are
    ``fn(store, *args)``. ``shared``: kept in the process's cache (see :func:`shared_client`)."""

    def __init__(self, make: Callable[[], Any], key: tuple[str, int] | None = None) -> None:
        self._make = make
        self.key = key
        self.store: Any = None
        self.broken = False
        self._calls: queue.SimpleQueue[tuple[Any, tuple[Any, ...], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._worker = threading.Thread(target=self._work, name="transport-store", daemon=True)
        self._worker.start()

    def _work(self) -> None:
        while True:
            job = self._calls.get()
            if job is None:
                self.store = None
                return
            fn, args, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                if self.store is None:
                    self.store = self._make()
                fut.set_result(fn(self.store, *args))
            except BaseException as exc:  # handed to the waiting coroutine
                fut.set_exception(exc)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls.put((fn, args, fut))
        return fut

    def stop(self) -> None:
        """No more calls: the thread ends once those queued ran (a call stuck in the store stays so)."""
        self._calls.put(None)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the thread to end (after :meth:`stop`); True if it did."""
        self._worker.join(timeout)
        return not self._worker.is_alive()


def _store_timeout(timeout: float) -> timedelta:
    """A TCPStore's own timeout for an endpoint's ``timeout``, capped: past ~1e10 s it overflows
    inside the store client (whose connect then fails at once); every call is bounded by the
    caller's deadline anyway."""
    return timedelta(seconds=min(timeout, _STORE_TIMEOUT_MAX))


_STORE_TIMEOUT_MAX = 1e6  # s (11.6 days)
_shared: dict[tuple[str, int], StoreClient] = {}
_shared_lock = threading.Lock()


def shared_client(host: str, port: int, timeout: float) -> tuple[StoreClient, bool]:
    """The process's client of the TCPStore at ``host:port`` (made on first use), and whether it
    existed already."""
    key = (host, port)
    with _shared_lock:
        client = _shared.get(key)
        if client is not None and not client.broken:
            return client, True

        def make() -> Any:
            from torch.distributed import TCPStore

            return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=_store_timeout(timeout))

        client = _shared[key] = StoreClient(make, key)
        return client, False


def _drop_shared(client: StoreClient) -> None:
    """``client`` failed: the next open makes a new one (endpoints that hold it keep it)."""
    with _shared_lock:
        client.broken = True
        if client.key is not None and _shared.get(client.key) is client:
            del _shared[client.key]


def _forget_shared_in_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()
    _shared.clear()  # (their threads did not survive the fork, and their sockets are the parent's)


os.register_at_fork(after_in_child=_forget_shared_in_child)


def _close_shared_at_exit() -> None:
    """At interpreter exit: end the shared clients' threads (each drops its store on its own thread),
    so that no store client is torn down by the interpreter's finalization while its thread still
    runs. Bounded: a call stuck in the store is left to the daemon thread."""
    with _shared_lock:
        clients = list(_shared.values())
        _shared.clear()
    for client in clients:
        client.stop()
    deadline = time.monotonic() + 2.0
    for client in clients:
        client.join(max(0.0, deadline - time.monotonic()))


atexit.register(_close_shared_at_exit)


class EndpointRecord(msgspec.Struct, frozen=True):
    name: str
    host: str
    port: int
    incarnation: int
    hostinfo: HostInfo
    unix: str = ""  # the abstract Unix socket it also accepts channels on ("" none; transport.local_socket)


def record_problem(rec: EndpointRecord) -> str | None:
    """What makes ``rec`` impossible to dial (None: nothing): a store's records and address records
    are checked alike, so a bad one is a typed error, not what ``socket.connect`` raises for it."""
    if not rec.name or "/" in rec.name or len(rec.name) > 200:
        return f"an invalid endpoint name {rec.name!r}"
    try:
        ok_host = bool(rec.host) and len(rec.host) <= 253 and bool(rec.host.encode("idna"))
    except UnicodeError:
        ok_host = False
    if not ok_host or not 0 < rec.port < 65536:
        return f"an invalid address {rec.host!r}:{rec.port}"
    if rec.unix and (len(rec.unix) > 100 or "\0" in rec.unix):
        return f"an invalid Unix socket name {rec.unix!r}"
    return None


_rec_encoder = msgspec.json.Encoder()
_rec_decoder = msgspec.json.Decoder(EndpointRecord)


def _raw_record(store: Any, key: str) -> bytes | None:
    """The store's bytes under ``key`` (None if it holds none); on the store's thread."""
    return store.get(key) if store.check([key]) else None  # type: ignore[no-any-return]


def parse_store_url(url: str) -> tuple[str, int]:
    """``"tcp://HOST:PORT"`` -> ``(HOST, PORT)``; ``ValueError`` otherwise."""
    parsed = urlparse(url)
    if parsed.scheme != "tcp" or not parsed.hostname or parsed.port is None:
        raise ValueError(f"store must look like 'tcp://HOST:PORT', got {url!r}")
    return parsed.hostname, parsed.port


class Rendezvous:
    """Publish and look up endpoint records on a store.

    ``store`` is a URL, a ``torch.distributed.Store``, or None (then
    ``MASTER_ADDR``/``MASTER_PORT`` name the store, as under ``torchrun``).
    With ``host_store=True`` this process serves the TCPStore (port 0 picks a
    free port; see :attr:`port`). A URL (or MASTER_ADDR/PORT) store is reached
    through the process's shared client (:func:`shared_client`).
    """

    def __init__(self, store: Any, *, host_store: bool, timeout: float) -> None:
        self._client: StoreClient | None = None
        self._spec = store
        self._host_store = host_store
        self._timeout = timeout
        self.host: str | None = None
        self.port: int | None = None
        self.pauses: PauseWatch | None = None  # the endpoint's, once it published (stopped by close())

    async def open(self, *, want_secret: bool) -> bytes | None:
        """Connect to (or serve) the store; with ``want_secret``, return the job's secret from it
        (drawn now if no endpoint drew it yet: :mod:`transport.auth`). Raises
        :class:`TransportTimeoutError` (phase connect)."""
        deadline = time.monotonic() + self._timeout + 5
        first = self._secret_from_store if want_secret else self._ping
        try:
            if isinstance(self._spec, str) or self._spec is None:
                host, port = self._address()
                if not self._host_store:
                    self._client, reused = shared_client(host, port, self._timeout)
                    try:
                        secret = await self._call(first, deadline=deadline)
                    except Exception:
                        if not reused:
                            raise
                        # a client kept from an earlier open whose store went away (or restarted):
                        # it was dropped by _call; connect anew, once
                        self._client, _ = shared_client(host, port, self._timeout)
                        secret = await self._call(first, deadline=deadline)
                    self.host, self.port = host, port
                    return secret

                def serve() -> Any:
                    from torch.distributed import TCPStore

                    store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                                     timeout=_store_timeout(self._timeout))
                    self.host, self.port = host, store.port
                    return store

                self._client = StoreClient(serve)
            else:
                if self._host_store:
                    raise ValueError("host_store=True needs a 'tcp://HOST:PORT' store, not a Store object")
                spec = self._spec
                self._client = StoreClient(lambda: spec)
            return await self._call(first, deadline=deadline)  # type: ignore[no-any-return]
        except TransportError:
            raise
        except Exception as exc:  # torch raises RuntimeError/DistNetworkError
            raise TransportTimeoutError(
                f"could not reach the rendezvous store {self._describe()}: {exc}", Phase.CONNECT
            ) from exc

    @staticmethod
    def _ping(store: Any) -> None:
        store.check([auth.STORE_KEY])

    @staticmethod
    def _secret_from_store(store: Any) -> bytes:
        drawn = auth.new_secret()
        try:
            got = store.compare_set(auth.STORE_KEY, "", drawn)  # atomic: the first endpoint's draw wins
        except _NO_COMPARE_SET:  # a Store without compare_set (a custom one; a store that failed fails again below)
            if not store.check([auth.STORE_KEY]):
                store.set(auth.STORE_KEY, drawn)
            got = store.get(auth.STORE_KEY)
        if not got:
            raise TransportError(f"the store holds an empty secret under {auth.STORE_KEY!r}")
        return bytes(got)

    def _address(self) -> tuple[str, int]:
        if self._spec is None:
            addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not addr or not port:
                raise ValueError("no store given and MASTER_ADDR/MASTER_PORT are not set")
            return addr, int(port)
        return parse_store_url(self._spec)

    def _describe(self) -> str:
        if isinstance(self._spec, str):
            return self._spec
        if self._spec is None:
            return f"tcp://{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} (MASTER_ADDR/PORT)"
        return repr(self._spec)

    async def _call(self, fn: Any, *args: Any, deadline: float) -> Any:
        """Run ``fn(store, *args)`` on the store thread; :class:`TransportTimeoutError` at ``deadline``.
        A shared client whose call fails or times out is dropped from the process's cache."""
        client = self._client
        if client is None:
            raise TransportError("the rendezvous store is closed")
        fut = client.submit(fn, *args)
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.wrap_future(fut)
        except TimeoutError:
            fut.cancel()
            if client.key is not None:
                _drop_shared(client)
            raise TransportTimeoutError(
                f"the rendezvous store {self._describe()} did not answer before the deadline", Phase.CONNECT
            ) from None
        except Exception:
            if client.key is not None:
                _drop_shared(client)
            raise

    async def publish(self, record: EndpointRecord, deadline: float) -> None:
        await self._call(lambda st, k, v: st.set(k, v), _PREFIX + record.name, _rec_encoder.encode(record),
                         deadline=deadline)

    async def withdraw(self, record: EndpointRecord, deadline: float) -> None:
        """Remove ``record`` if the store still holds it, never a newer incarnation's record published
        meanwhile: one ``compare_set`` to an empty value (read as no record), atomic in the store; a
        store without ``compare_set`` (a custom one) is asked, then the key deleted."""
        key, mine = _PREFIX + record.name, _rec_encoder.encode(record)

        def _withdraw(store: Any) -> None:
            try:
                store.compare_set(key, mine, b"")
                return
            except _NO_COMPARE_SET:  # (a store that failed fails again below)
                pass
            if store.check([key]) and store.get(key) == mine:
                store.delete_key(key)

        try:
            await self._call(_withdraw, deadline=deadline)
        except Exception as exc:  # the store may be gone already at shutdown
            log.debug("could not withdraw %s from the store: %s", record.name, exc)

    async def lookup_now(self, name: str, deadline: float) -> EndpointRecord | None:
        try:
            raw = await self._call(_raw_record, _PREFIX + name, deadline=deadline)
        except TransportError:
            raise
        except Exception as exc:  # DistStoreError & co: the store is unusable
            raise TransportTimeoutError(f"the rendezvous store failed: {exc}", Phase.CONNECT) from exc
        try:
            rec = None if not raw else _rec_decoder.decode(raw)  # (empty: withdrawn)
        except Exception as exc:  # DecodeError, RecursionError (deep nesting), ...: whoever wrote it
            raise PeerNotFoundError(f"the store holds a malformed record for {name!r}: "
                                    f"{type(exc).__name__}: {exc}") from None
        if rec is not None and (why := record_problem(rec)) is not None:
            raise PeerNotFoundError(f"the store holds a malformed record for {name!r}: {why}")
        return rec

    def incarnation_now(self, name: str) -> concurrent.futures.Future[int | None] | None:
        """Any thread, without waiting: ask the store which incarnation it names for ``name``
        (:class:`~transport.pauses.PauseWatch`'s look-up): a future of it (None: no record, or a
        withdrawn or malformed one; the store's error if it failed), or None if the store is closed."""
        client, key = self._client, _PREFIX + name
        if client is None:
            return None

        def ask(store: Any) -> int | None:
            raw = _raw_record(store, key)
            try:
                return _rec_decoder.decode(raw).incarnation if raw else None
            except Exception:  # (a malformed record names no incarnation of anyone's)
                return None

        return client.submit(ask)

    async def lookup(
        self, name: str, deadline: float, *, skip_incarnations: frozenset[int] = frozenset()
    ) -> EndpointRecord:
        """Wait until ``name`` is published (with an incarnation not in ``skip_incarnations``).

        Raises :class:`PeerNotFoundError` when ``deadline`` (``time.monotonic``) passes.
        """
        delay = 0.01
        while True:
            # a call already under way when the deadline passes may finish (a second's grace), so
            # that a missing peer is reported as PeerNotFoundError, a silent store as a timeout
            rec = await self.lookup_now(name, max(deadline, time.monotonic()) + 1.0)
            if rec is not None and rec.incarnation not in skip_incarnations:
                return rec
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if rec is None:
                    raise PeerNotFoundError(f"no endpoint named {name!r} appeared in the store in time")
                raise PeerNotFoundError(
                    f"endpoint {name!r} is registered but unreachable (incarnation {rec.incarnation:#x} "
                    "is gone and no new one appeared in time)"
                )
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.25)

    def close(self) -> None:
        """Let the store client go: a shared one stays for the process's other (and later)
        endpoints; one of our own (served store, Store object) is dropped."""
        if self.pauses is not None:
            self.pauses.stop()
        client, self._client = self._client, None
        if client is not None and client.key is None:
            client.stop()  # (its thread drops the store when it ends)


def listen_host(rdv: Rendezvous) -> str:
    """The local address that reaches the store's host (127.0.0.1 for a loopback store, or when
    there is no store host): the address an endpoint listens on by default."""
    if rdv.host is None:
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((rdv.host, rdv.port or 1))
            return s.getsockname()[0]  # type: ignore[no-any-return]
    except OSError:
        return "127.0.0.1"
