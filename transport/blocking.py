"""``BlockingEndpoint``: the same operations for programs without asyncio.

An inference engine's worker is usually plain synchronous Python. This facade
runs an :class:`~transport.Endpoint` on an event loop in a background thread
and turns each call into a blocking one. Every call is bounded: it waits at
most its ``timeout`` (or the endpoint's) plus a small grace for the loop to
answer, then raises :class:`TransportTimeoutError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from .endpoint import Endpoint
from .errors import EndpointClosedError, Phase, TransportError, TransportTimeoutError
from .peer import Notification, Peer, Route
from .ranges import At
from .registry import BufferSpec

__all__ = ["BlockingEndpoint"]

T = TypeVar("T")
_GRACE = 5.0
# put/get: how long, past the grace, a call that gave up on the loop still waits for the cancelled op
# to end (it ends only once nothing of it writes any more; cuda_ipc's copies are waited for up to 30 s)
_SETTLE = 30.0


class BlockingEndpoint:
    """A blocking :class:`~transport.Endpoint`; takes the same arguments.

    Use it as a context manager (``with BlockingEndpoint("gen-0", store=...) as ep:``)
    or call :meth:`close`. Opening blocks until the endpoint is published.
    Methods block the calling thread; they must not be called from the
    facade's own loop thread (e.g. from a notification callback).
    """

    def __init__(self, name: str, **kwargs: Any) -> None:
        self._ep = Endpoint(name, **kwargs)  # bad arguments raise before any thread starts
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_run, args=(self._loop,), name=f"transport-loop-{name}", daemon=True)
        self._thread.start()
        self.timeout = self._ep.timeout
        self._submitted: set[concurrent.futures.Future[None]] = set()  # submit_put/get futures not yet resolved
        self._running: set[asyncio.Task[None]] = set()  # their ops' tasks (the loop thread's only)
        # the blocking calls waiting on the loop: failed with EndpointClosedError if it stops under them
        self._calls: dict[concurrent.futures.Future[Any], Coroutine[Any, Any, Any]] = {}
        self._closing = False  # close() began: new calls are refused
        self._close_lock = threading.Lock()  # one close() at a time; a second waits for the first
        try:
            self._call(self._ep.open(), None)
        except BaseException:
            self._stop_loop()
            raise
        # dropped without close(): the endpoint is closed and the loop stopped on its own thread (never waited for)
        self._finalizer = weakref.finalize(self, _close_unreferenced, self._ep, self._loop)

    def _may_call(self, coro: Coroutine[Any, Any, Any], closing: bool = False) -> None:
        """Raise (closing ``coro``) if the loop is gone (or closing, unless this is the close), or
        this is the loop's own thread."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("BlockingEndpoint methods cannot be called from its own event loop thread (e.g. a "
                               "notification callback): call them from another thread")
        if not self._thread.is_alive() or (self._closing and not closing):
            coro.close()
            raise EndpointClosedError("the blocking endpoint is closed" if self._closing else
                                      "the blocking endpoint's loop has stopped")

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None, *, settle: bool = False,
              closing: bool = False) -> T:
        self._may_call(coro, closing)
        over = None
        if settle:  # a put/get given up on below is cancelled, and waited for until it ended (bounded)
            over = threading.Event()
            coro = _until_over(coro, over)
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop closed meanwhile
            coro.close()
            raise EndpointClosedError("the blocking endpoint's loop has stopped") from None
        self._calls[fut] = coro
        fut.add_done_callback(self._forget_call)
        # how long to wait for the loop's answer: the timeout plus a grace; a bad timeout (< 0, NaN) just the
        # grace, in which the endpoint raises its ValueError; an infinite one (as asked) no bound
        t = self.timeout if timeout is None else timeout
        limit = max(t, 0.0) + _GRACE if math.isfinite(t) else (None if t > 0 else _GRACE)
        if limit is not None and limit > threading.TIMEOUT_MAX:  # (a wait past it overflows: unbounded, as inf)
            limit = None
        try:
            return fut.result(limit)
        except TransportError:  # the endpoint's own error (TransportTimeoutError is a TimeoutError too)
            raise
        except concurrent.futures.TimeoutError:
            if fut.done():
                return fut.result()
            fut.cancel()
            still = over is not None and not over.wait(_SETTLE)
            raise TransportTimeoutError(f"the endpoint's loop did not answer within {limit:.1f} s"
                                        + (f"; the op had not ended {_SETTLE:g} s after it was cancelled and may "
                                           "still be writing" if still else ""), Phase.TRANSFER) from None

    @property
    def on_loop_thread(self) -> bool:
        """Whether the calling thread is this endpoint's loop thread (where its blocking calls raise)."""
        return threading.current_thread() is self._thread

    @property
    def endpoint(self) -> Endpoint:
        """The asyncio :class:`~transport.Endpoint` underneath (use it only on :meth:`call_in_loop`)."""
        return self._ep

    def call_in_loop(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn()`` on the endpoint's loop thread and return its result (or raise its exception).

        For libraries built on the async endpoint (``rl_sync``'s blocking
        subscriber). Blocks at most ``timeout`` (default the endpoint's) plus a grace.
        """
        return self._call(_as_coro(fn), timeout)

    def __enter__(self) -> BlockingEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def name(self) -> str:
        return self._ep.name

    @property
    def store_url(self) -> str | None:
        return self._ep.store_url

    @property
    def address(self) -> tuple[str, int] | None:
        return self._ep.address

    @property
    def buffers(self) -> dict[str, BufferSpec]:
        return self._ep.buffers

    def _read(self, fn: Callable[[], T]) -> T:
        """``fn()``, an accessor of the async endpoint that never blocks, where it may run: at once
        on the loop thread (a notification callback) or once the loop has stopped; else on the
        loop thread, waited for (bounded), closing or not. The answer is the async endpoint's."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return fn()
        try:
            return self._call(_as_coro(fn), None, closing=True)
        except EndpointClosedError:  # (the loop stopped meanwhile: nothing changes the endpoint any more)
            return fn()

    @property
    def peers(self) -> dict[str, Peer]:
        """See :attr:`Endpoint.peers` (read on the loop thread; also there and after close)."""
        return self._read(lambda: self._ep.peers)

    def peer(self, name: str) -> Peer | None:
        """See :meth:`Endpoint.peer`: the open channel's :class:`Peer`, else None; never dials.
        The Peer is a live view of the channel: read its attributes soon, or ask again."""
        return self._read(lambda: self._ep.peer(name))

    def plane_status(self, plane: str) -> tuple[bool, str]:
        """See :meth:`Endpoint.plane_status` (read on the loop thread; also there and after close)."""
        return self._read(lambda: self._ep.plane_status(plane))

    def route(self, peer: str, tensors: Mapping[str, torch.Tensor | At], *, timeout: float | None = None) -> Route:
        """See :meth:`Endpoint.route`: the plane a put or get of ``tensors`` would take, and why."""
        return self._call(self._ep.route(peer, tensors, timeout=timeout), timeout)

    def register(self, name: str, tensor: torch.Tensor) -> BufferSpec:
        """See :meth:`Endpoint.register`."""
        return self._call(_as_coro(self._ep.register, name, tensor), None)

    def new_buffer(self, name: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """See :meth:`Endpoint.new_buffer`."""
        return self._call(_as_coro(self._ep.new_buffer, name, shape, dtype), None)

    def unregister(self, name: str, *, discard: bool = False, copy_back: bool = True) -> None:
        """See :meth:`Endpoint.unregister`."""
        self._call(_as_coro(functools.partial(self._ep.unregister, discard=discard, copy_back=copy_back), name), None)

    def connect(self, peer: str, timeout: float | None = None) -> Peer:
        """See :meth:`Endpoint.connect`."""
        return self._call(self._ep.connect(peer, timeout), timeout)

    def put(self, peer: str, tensors: Mapping[str, torch.Tensor | At], *, notify: bytes | None = None,
            timeout: float | None = None) -> None:
        """See :meth:`Endpoint.put`; a timeout means the same (the call cannot be cancelled otherwise).

        A put without ``notify`` that :meth:`Endpoint.put_now` can do (a small ``shm`` copy into the
        peer's mapped memory) is done by the calling thread, without a hand-off to the loop, unless
        an op of :meth:`submit_put`/:meth:`submit_get` is still unresolved. (:meth:`get` likewise.)

        Should the endpoint's loop itself not answer within ``timeout`` (or the endpoint's) plus 5 s,
        the op is cancelled and the call waits (at most 30 s more) until it ended, which it does only
        once nothing of it writes any more, then raises :class:`TransportTimeoutError` (which says
        so if it had not ended by then).
        """
        if notify is None and self._may_now(timeout) and self._ep.put_now(peer, tensors):
            return
        self._call(self._ep.put(peer, tensors, notify=notify, timeout=timeout), timeout, settle=True)

    def _may_now(self, timeout: float | None) -> bool:
        """Whether a put or get may try :meth:`Endpoint.put_now` / ``get_now`` on the calling
        thread first (no hand-off to the loop): not on the loop thread, not while closing or while
        a submitted op is unresolved (it starts first), and not for a bad ``timeout`` (the loop's
        path raises)."""
        return (not self._submitted and not self._closing and threading.current_thread() is not self._thread
                and (timeout is None or timeout > 0) and self._thread.is_alive())

    def get(self, peer: str, tensors: Mapping[str, torch.Tensor | At], *, timeout: float | None = None) -> None:
        """See :meth:`Endpoint.get`; timeouts as for :meth:`put`."""
        if self._may_now(timeout) and self._ep.get_now(peer, tensors):
            return
        self._call(self._ep.get(peer, tensors, timeout=timeout), timeout, settle=True)

    def submit_put(self, peer: str, tensors: Mapping[str, torch.Tensor | At], *, notify: bytes | None = None,
                   timeout: float | None = None) -> concurrent.futures.Future[None]:
        """Start :meth:`Endpoint.put` on the endpoint's loop and return at once with its future.

        Non-blocking: the calling thread only schedules the op (any thread but the loop's).
        The future resolves once the op has ended: with None when the target holds the bytes,
        or with the put's exception (bad input, :class:`TransportTimeoutError` at its deadline,
        :class:`PeerLostError`, :class:`EndpointClosedError` if the endpoint closes first). It
        resolves only once nothing of the op writes any more (as when an awaited put raises),
        so a failed op's buffers may be reused as soon as it has. ``timeout`` (default the
        endpoint's) is the op's deadline, not a bound on waiting for the future: bound that
        with ``future.result(timeout)``. The op cannot be cancelled: ``future.cancel()``
        returns False; it ends at its deadline at the latest. Ops submitted one after another
        start in submission order; as with concurrent awaited puts, nothing orders when they
        land. ``tensors`` must stay unmodified until the future has resolved.
        """
        return self._submit(self._ep.put(peer, tensors, notify=notify, timeout=timeout))

    def submit_get(self, peer: str, tensors: Mapping[str, torch.Tensor | At], *,
                   timeout: float | None = None) -> concurrent.futures.Future[None]:
        """Start :meth:`Endpoint.get` on the endpoint's loop and return at once with its future.

        As :meth:`submit_put`: the future resolves with None once every byte is in ``tensors``,
        or with the get's exception once nothing of the op writes into them any more; the op
        cannot be cancelled and ends at ``timeout`` (its deadline) at the latest. Do not read
        or reuse ``tensors`` before the future has resolved.
        """
        return self._submit(self._ep.get(peer, tensors, timeout=timeout))

    def _submit(self, coro: Coroutine[Any, Any, None]) -> concurrent.futures.Future[None]:
        self._may_call(coro)
        out: concurrent.futures.Future[None] = concurrent.futures.Future()
        out.set_running_or_notify_cancel()  # running from here on: cancel() returns False
        self._submitted.add(out)
        out.add_done_callback(self._submitted.discard)

        def settle(task: asyncio.Task[None]) -> None:
            if out.done():
                return
            if task.cancelled():
                out.set_exception(EndpointClosedError("the op was cancelled: the blocking endpoint closed"))
            elif task.exception() is not None:
                out.set_exception(task.exception())
            else:
                out.set_result(None)

        def start() -> None:
            if out.done():  # (failed by close() before the loop ran this)
                coro.close()
                return
            task = self._loop.create_task(coro)
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            task.add_done_callback(settle)

        try:
            self._loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop closed meanwhile
            coro.close()
            out.set_exception(EndpointClosedError("the blocking endpoint's loop has stopped"))
        return out

    def map(self, peer: str, name: str, *, timeout: float | None = None) -> torch.Tensor:
        """See :meth:`Endpoint.map`."""
        return self._call(self._ep.map(peer, name, timeout=timeout), timeout)

    def map_route(self, peer: str, name: str, *, timeout: float | None = None) -> Route:
        """See :meth:`Endpoint.map_route`."""
        return self._call(self._ep.map_route(peer, name, timeout=timeout), timeout)

    def notify(self, peer: str, payload: bytes, *, timeout: float | None = None) -> None:
        """See :meth:`Endpoint.notify`."""
        self._call(self._ep.notify(peer, payload, timeout=timeout), timeout)

    def post(self, peer: str, payload: bytes, *, timeout: float | None = None, reply_expected: bool = False) -> None:
        """See :meth:`Endpoint.post`."""
        self._call(self._ep.post(peer, payload, timeout=timeout, reply_expected=reply_expected), timeout)

    def next_notification(self, timeout: float | None = None) -> Notification:
        """See :meth:`Endpoint.next_notification`."""
        return self._call(self._ep.next_notification(timeout), timeout)

    def dump_flight_recorder(self, path: str | Path | None = None) -> Path:
        return self._call(_as_coro(self._ep.dump_flight_recorder, path), None)

    def _forget_call(self, fut: concurrent.futures.Future[Any]) -> None:
        self._calls.pop(fut, None)

    def close(self, timeout: float = 5.0) -> None:
        """Close the endpoint and stop the loop thread. Idempotent; a close from another thread
        meanwhile waits for this one to end. Bounded by ``timeout``, plus up to the settle bound
        (30 s) for submitted ops still ending: their futures resolve with their own outcome
        (closing fails them with :class:`EndpointClosedError` once nothing of them writes any
        more) before the loop stops. Calls made once it began, and those still waiting on the
        loop when it stops, raise :class:`EndpointClosedError`. Tasks of the layers above left on
        the loop (a subscriber's commit) are cancelled and given up to 5 s to end before it stops,
        as ``asyncio.run`` does. ``RuntimeError`` on the loop's own thread (a notification
        callback): nothing is closed then."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("BlockingEndpoint.close() cannot be called from its own event loop thread (e.g. a "
                               "notification callback): call it from another thread")
        with self._close_lock:
            if not self._thread.is_alive():
                return
            self._closing = True
            try:
                self._call(self._close_settled(timeout), timeout + _SETTLE, closing=True)
            finally:
                self._stop_loop()
                self._finalizer.detach()

    async def _close_settled(self, timeout: float) -> None:
        await self._ep.close(timeout)
        running = [t for t in self._running if not t.done()]
        if running:
            await asyncio.wait(running, timeout=_SETTLE)
        await _cancel_the_rest()

    def _stop_loop(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._loop.stop)
        except RuntimeError:  # (closed already)
            pass
        self._thread.join(_GRACE)
        if not self._thread.is_alive():
            self._loop.close()
            for fut in list(self._submitted):  # never started, or the loop stopped under them: nothing runs them now
                if not fut.done():
                    fut.set_exception(EndpointClosedError("the blocking endpoint closed before the op ended"))
            for fut, coro in list(self._calls.items()):  # calls the loop never answered: they raise now
                if not fut.done():
                    with contextlib.suppress(Exception):
                        coro.close()  # (never started, or left suspended by the stopped loop)
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        fut.set_exception(EndpointClosedError("the blocking endpoint closed before the call ended"))


async def _cancel_the_rest() -> None:
    """Cancel every other task of this loop (those of the layers above, e.g. a subscriber's commit
    waiting for readers) and give them up to ``_GRACE`` to end, as ``asyncio.run`` does before it
    closes its loop: a task left suspended on a stopped loop never runs its ``finally`` blocks
    (a waiting commit would keep new readers of its lock out for good)."""
    rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    for t in rest:
        t.cancel()
    if rest:
        await asyncio.wait(rest, timeout=_GRACE)


async def _as_coro(fn: Any, *args: Any) -> Any:
    return fn(*args)


def _close_unreferenced(ep: Endpoint, loop: asyncio.AbstractEventLoop) -> None:
    """A BlockingEndpoint dropped without ``close()`` (its finalizer, on whichever thread collected
    it, maybe the loop's own): close the endpoint on its loop, then stop the loop and close it
    there; nothing waits for it."""
    async def close() -> None:
        try:
            await ep.close()
            await _cancel_the_rest()
        finally:
            loop.stop()

    with contextlib.suppress(RuntimeError):  # (the loop closed already)
        loop.call_soon_threadsafe(lambda: loop.create_task(close()))


def _run(loop: asyncio.AbstractEventLoop) -> None:
    """The loop thread: run the loop until stopped, then close it (idempotent; ``_stop_loop``
    closes it too, after joining)."""
    loop.run_forever()
    loop.close()


async def _until_over(coro: Coroutine[Any, Any, T], over: threading.Event) -> T:
    try:
        return await coro
    finally:
        over.set()
