"""Discovery on a ``torch.distributed`` store (a TCPStore in practice).

Each open endpoint publishes one record under ``transport/v1/endpoint/<name>``:
the address it accepts channels on, its incarnation (a random nonce drawn at
every open, so a restarted process is told apart from the dead one) and its
host identity. A peer looks the record up by name, waiting until it appears.

Store calls block, so they run on one daemon worker thread per endpoint (the
store client is not assumed to be thread-safe). Every call is bounded by the
caller's deadline: a store that stops answering gives
:class:`TransportTimeoutError` (phase connect), and a call stuck inside the
store client never holds up the process's exit. Waits poll with ``check``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import msgspec

from .errors import PeerNotFoundError, Phase, TransportError, TransportTimeoutError
from .wire import HostInfo

__all__ = ["EndpointRecord", "Rendezvous", "parse_store_url"]

log = logging.getLogger(__name__)

_PREFIX = "transport/v1/endpoint/"


class EndpointRecord(msgspec.Struct, frozen=True):
    name: str
    host: str
    port: int
    incarnation: int
    hostinfo: HostInfo


_rec_encoder = msgspec.json.Encoder()
_rec_decoder = msgspec.json.Decoder(EndpointRecord)


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
    free port; see :attr:`port`).
    """

    def __init__(self, store: Any, *, host_store: bool, timeout: float) -> None:
        self._calls: queue.SimpleQueue[tuple[Any, tuple[Any, ...], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._worker = threading.Thread(target=self._work, name="transport-store", daemon=True)
        self._store: Any = None
        self._spec = store
        self._host_store = host_store
        self._timeout = timeout
        self.host: str | None = None
        self.port: int | None = None

    def _work(self) -> None:
        while True:
            job = self._calls.get()
            if job is None:
                return
            fn, args, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiting coroutine
                fut.set_exception(exc)

    async def open(self) -> None:
        """Connect to (or serve) the store; raises :class:`TransportTimeoutError` (phase connect)."""
        self._worker.start()
        try:
            self._store = await self._call(self._make_store, deadline=time.monotonic() + self._timeout + 5)
        except TransportError:
            raise
        except Exception as exc:  # torch raises RuntimeError/DistNetworkError
            raise TransportTimeoutError(
                f"could not reach the rendezvous store {self._describe()}: {exc}", Phase.CONNECT
            ) from exc

    def _describe(self) -> str:
        if isinstance(self._spec, str):
            return self._spec
        if self._spec is None:
            return f"tcp://{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} (MASTER_ADDR/PORT)"
        return repr(self._spec)

    def _make_store(self) -> Any:
        from torch.distributed import TCPStore

        spec = self._spec
        if spec is not None and not isinstance(spec, str):
            if self._host_store:
                raise ValueError("host_store=True needs a 'tcp://HOST:PORT' store, not a Store object")
            return spec
        if spec is None:
            addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not addr or not port:
                raise ValueError("no store given and MASTER_ADDR/MASTER_PORT are not set")
            host, port_i = addr, int(port)
        else:
            host, port_i = parse_store_url(spec)
        store = TCPStore(
            host,
            port_i,
            is_master=self._host_store,
            wait_for_workers=False,
            timeout=timedelta(seconds=self._timeout),
        )
        self.host, self.port = host, store.port
        return store

    async def _call(self, fn: Any, *args: Any, deadline: float) -> Any:
        """Run ``fn(*args)`` on the store thread; :class:`TransportTimeoutError` at ``deadline``."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls.put((fn, args, fut))
        try:
            async with asyncio.timeout_at(deadline):
                return await asyncio.wrap_future(fut)
        except TimeoutError:
            fut.cancel()
            raise TransportTimeoutError(
                f"the rendezvous store {self._describe()} did not answer before the deadline", Phase.CONNECT
            ) from None

    async def publish(self, record: EndpointRecord, deadline: float) -> None:
        await self._call(self._store.set, _PREFIX + record.name, _rec_encoder.encode(record), deadline=deadline)

    async def withdraw(self, record: EndpointRecord, deadline: float) -> None:
        """Remove ``record`` if the store still holds it (not a newer incarnation's)."""
        try:
            cur = await self.lookup_now(record.name, deadline)
            if cur is not None and cur.incarnation == record.incarnation:
                await self._call(self._store.delete_key, _PREFIX + record.name, deadline=deadline)
        except Exception as exc:  # the store may be gone already at shutdown
            log.debug("could not withdraw %s from the store: %s", record.name, exc)

    async def lookup_now(self, name: str, deadline: float) -> EndpointRecord | None:
        key = _PREFIX + name

        def _get() -> bytes | None:
            if not self._store.check([key]):
                return None
            return self._store.get(key)

        try:
            raw = await self._call(_get, deadline=deadline)
        except TransportError:
            raise
        except Exception as exc:  # DistStoreError & co: the store is unusable
            raise TransportTimeoutError(f"the rendezvous store failed: {exc}", Phase.CONNECT) from exc
        try:
            return None if raw is None else _rec_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise PeerNotFoundError(f"the store holds a malformed record for {name!r}: {exc}") from exc

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
        self._store = None
        if self._worker.is_alive():
            self._calls.put(None)
