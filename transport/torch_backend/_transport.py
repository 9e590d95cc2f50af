"""``TransportRL``: torch's one-sided byte-range Transport contract on a :class:`transport.Endpoint`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import math
import os
import secrets
import threading
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import torch
from torch.distributed import HashStore
from torch.distributed._transport import Memory, MemoryView, MutableMemoryView, RemoteBuffer, Transport, Work
from torch.distributed._transport._work import _validate_timeout, wait_all

import transport  # the public API only (transport.__all__): this backend is a client of the library like any other

from ._memory import (
    Registration,
    TransportRLMemory,
    TransportRLMemoryView,
    TransportRLMutableMemoryView,
    TransportRLRemoteBuffer,
)
from ._work import TransportRLWork

__all__ = ["PLANES", "TransportRL"]

T = TypeVar("T")
PLANES = ("tcp", "shm")
_LOOP_GRACE = 2.0  # how long past a call's own bound the caller waits for the loop to answer
_names = itertools.count(1)


class TransportRL(Transport):
    """torch's one-sided Transport over one :class:`transport.Endpoint` (backend ``"transport_rl"``).

    Made by ``torch.distributed._transport.new_transport("transport_rl", "cpu", **options)``:

    - ``plane``: ``"tcp"`` (default) or ``"shm"``, the only plane the endpoint may use. With
      ``"tcp"`` registered memory stays where it is, as with any torch backend. With ``"shm"``
      (peers on this host only; connecting to another host raises
      :class:`transport.PlaneUnavailableError`) registration moves the tensor's storage into a
      shared-memory segment in place: the tensor object you registered keeps working and sees
      every transfer, but other tensor objects that shared its old storage no longer alias it
      (a view of another tensor is refused; register its base). Unregistering and closing move
      it back into private memory, in place.
    - ``timeout`` (default 30 s): the default bound of every wait; see below.
    - ``transfer_timeout`` (default 300 s): how long a transfer may take, from its submission
      (its turn behind earlier transfers included), before its Work fails with
      :class:`transport.TransportTimeoutError` (at least the timeout it was submitted with).
    - ``name``, ``secret``, ``listen_host``: the endpoint's (``listen_host`` is the address it
      accepts on, 127.0.0.1 by default: set it to reach peers on other hosts over tcp).

    CPU memory only: CUDA tensors are refused (``ValueError``), and the stream-ordered
    ``write_stream``/``read_stream`` raise ``NotImplementedError``.

    The endpoint runs on an event loop of its own, on a daemon thread; it has an in-process
    store and no other (``bind()`` bytes are its :meth:`transport.Endpoint.address_record`,
    ``connect()`` passes the peer's to :meth:`transport.Endpoint.add_peer` and dials it). Those
    bytes are a credential: they carry the secret a peer proves when it dials this endpoint.

    Transfers run one at a time, in the order they were submitted (from any thread): a read
    submitted after a write sees the written bytes. torch's contract does not promise that
    (independent transfers may overlap there), so code meant for other backends must still
    wait before submitting a dependent transfer. With ``plane="shm"``, a transfer submitted
    while none is pending is copied by the calling thread itself when it can be (the peer's
    memory mapped here after a first transfer, under 8 MiB; an ``async_op`` one's Work is then
    returned completed), without a round trip through the loop thread.

    Timeouts bound the caller's wait, never the transfer: a write or read whose wait times
    out goes on (its Work keeps its buffers) until it ends or ``transfer_timeout`` passes.
    A tcp write failed by ``transfer_timeout`` after its bytes were handed to the socket (a peer
    that stopped reading) is not taken back: until they are out, or the channel is closed, its
    source may still be read and they may still land in the peer's buffer (the library keeps
    the memory referenced meanwhile); the peer's buffer is undefined after a failed write.
    Blocking calls (``bind``, ``connect``, ``register_memory``, ``unregister_memory``, the
    synchronous ``write``/``read``, ``close``) wait at most ``timeout`` (``None``: the
    transport's) for the transport's lock and then for the loop, plus 2 s for the loop to
    answer (``timeout=0``: the lock must be free; a transfer must already be done). A ``register_memory``
    whose wait timed out may still complete; close releases it. ``close``/``close_async``
    first reject new operations, then wait for pending transfers: on timeout or cancellation
    they raise and keep every resource, and a later close finishes the job.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        plane: str = "tcp",
        timeout: float = 30.0,
        transfer_timeout: float = 300.0,
        name: str | None = None,
        secret: str | bytes | None = None,
        listen_host: str | None = None,
    ) -> None:
        super().__init__(device)
        if self.device is not None and self.device.type != "cpu":
            raise ValueError(f"the transport_rl backend registers CPU memory only, not {self.device}")
        if plane not in PLANES:
            raise ValueError(f"plane must be one of {PLANES}, got {plane!r}")
        _validate_timeout(timeout)
        if not math.isfinite(transfer_timeout) or transfer_timeout <= 0:
            raise ValueError("transfer_timeout must be finite and positive")
        self.plane = plane
        self._timeout = timeout
        self._default_timeout = timeout
        self._transfer_timeout = float(transfer_timeout)
        self._lock = threading.RLock()  # operations; never taken on the loop thread
        self._pending_lock = threading.Lock()  # _pending only; taken by completions on the loop thread
        self._pending: dict[int, TransportRLWork] = {}
        self._registrations: dict[tuple[int, int], Registration] = {}
        self._peer: str | None = None
        self._peer_incarnation = 0
        self._closing = False
        self._closed = False
        self._ep_close: concurrent.futures.Future[None] | None = None
        self._in_order = asyncio.Lock()  # transfers run one at a time, in submission order (on the loop)
        self._ep = transport.Endpoint(name or f"torch-{os.getpid()}-{secrets.token_hex(6)}", store=HashStore(),
                            planes=(plane,), timeout=self._transfer_timeout, listen_host=listen_host, secret=secret)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"transport-rl-{self._ep.name}",
                                        daemon=True)
        self._thread.start()
        try:
            self._on_loop(self._ep.open(), max(timeout, 5.0))
        except BaseException:
            self._stop_loop()
            raise

    # ------------------------------------------------------------------ plumbing
    @staticmethod
    def supported() -> bool:
        """Whether this process can use the backend (torch.distributed is available)."""
        return bool(torch.distributed.is_available())

    def _wait_for(self, timeout: float | None) -> float:
        timeout = self._timeout if timeout is None else timeout
        _validate_timeout(timeout)
        return timeout

    @contextmanager
    def _locked(self, timeout: float) -> Iterator[None]:
        if not self._lock.acquire(timeout=timeout):
            raise TimeoutError("transport lock wait timed out")
        try:
            yield
        finally:
            self._lock.release()

    def _ensure_open(self) -> None:
        if self._closing or self._closed:
            raise RuntimeError("transport is closed")

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("transport_rl methods cannot be called from the backend's own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _on_loop(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop; wait at most ``timeout`` plus the loop grace (it goes on after)."""
        fut = self._submit(coro)
        try:
            return fut.result(timeout + _LOOP_GRACE)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the transport's event loop did not answer within {timeout + _LOOP_GRACE:.3g} s; "
                               "the operation may still complete") from None

    # ------------------------------------------------------------------ connection
    def bind(self, *, timeout: float | None = None) -> bytes:
        """This endpoint's connection bytes (its address record, a credential). Non-blocking."""
        self._wait_for(timeout)
        self._ensure_open()
        return self._ep.address_record()

    def connect(self, peer_url: bytes, *, timeout: float | None = None) -> int:
        """Connect to the peer whose ``bind()`` bytes these are and dial it; return 0.

        Blocks until the channel is up, at most ``timeout``. ``RuntimeError`` if already
        connected; ``ValueError`` for bytes that are not a record; the endpoint's errors
        (:class:`transport.PeerNotFoundError`, :class:`transport.AuthenticationError`,
        :class:`transport.PlaneUnavailableError`, a ``TimeoutError``) if it cannot be reached.
        """
        t = self._wait_for(timeout)
        if type(peer_url) is not bytes:
            raise TypeError("peer_url must be bytes from the peer's bind()")
        peer = transport.peer_address(peer_url)
        with self._locked(t):
            self._ensure_open()
            if self._peer is not None:
                raise RuntimeError("transport is already connected")
            self._on_loop(self._dial(peer_url, max(t, 1e-3)), t)
            self._peer, self._peer_incarnation = peer.name, peer.incarnation
        return 0

    async def _dial(self, peer_url: bytes, timeout: float) -> None:
        await self._ep.connect(self._ep.add_peer(peer_url), timeout)

    def connected(self) -> bool:
        return self._peer is not None and not self._closing and not self._closed

    # ------------------------------------------------------------------ registration
    def register_memory(self, tensor: torch.Tensor, *, timeout: float | None = None) -> TransportRLMemory:
        """Register a contiguous, non-empty CPU tensor (again: another handle of the same
        registration, see ``reused_registration()``). Blocks at most ``timeout``."""
        t = self._wait_for(timeout)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError("tensor must be a torch.Tensor")
        if not tensor.is_contiguous():
            raise ValueError("the transport_rl backend requires a contiguous tensor")
        if tensor.numel() == 0:
            raise ValueError("cannot register an empty tensor")
        self._check_device(tensor.device)
        if tensor.device.type != "cpu":
            raise ValueError(f"the transport_rl backend registers CPU memory only, not {tensor.device}")
        with self._locked(t):
            self._ensure_open()
            key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
            reg = self._registrations.get(key)
            if reg is not None and reg.active:
                return TransportRLMemory(self, reg, reused=True)
            if self.plane == "shm" and tensor._is_view():
                raise ValueError("with plane='shm' registration moves the tensor's storage into shared memory in "
                                 "place, which would separate this view from its base: register the base tensor")
            name = f"m{next(_names)}-{secrets.token_hex(4)}"
            reg = self._on_loop(self._register(tensor, name), t)
            self._registrations[(reg.address, reg.length)] = reg
            return TransportRLMemory(self, reg, reused=False)

    async def _register(self, tensor: torch.Tensor, name: str) -> Registration:
        base = None
        if self.plane == "shm":  # the caller's tensor first: its storage moves; the flat view then shares it
            base = f"{name}.t"
            self._ep.register(base, tensor)
        flat = transport.byte_view(tensor)
        try:
            self._ep.register(name, flat)
        except BaseException:
            if base is not None:
                self._ep.unregister(base)
            raise
        return Registration(tensor, flat, name, base, tensor.data_ptr(), flat.numel())

    async def _unregister(self, reg: Registration) -> None:
        if reg.name in self._ep.buffers:
            self._ep.unregister(reg.name)
        if reg.base_name is not None and reg.base_name in self._ep.buffers:
            self._ep.unregister(reg.base_name)  # copies it back into private memory, in place

    def unregister_memory(self, memory: Memory, *, timeout: float | None = None) -> None:
        """Unregister ``memory`` and every handle of its registration (again: a no-op).

        ``RuntimeError`` while transfers of it are pending, or once closed; ``TypeError`` for
        memory of another transport. Blocks at most ``timeout``."""
        t = self._wait_for(timeout)
        with self._locked(t):
            self._ensure_open()
            if not isinstance(memory, TransportRLMemory) or memory._transport is not self:
                raise TypeError("memory was not registered by this transport")
            reg = memory._registration
            if not reg.active:
                return
            with self._pending_lock:
                busy = any(w._buffers is not None and w._buffers[0]._memory._registration is reg
                           for w in self._pending.values())
            if busy:
                raise RuntimeError("memory has pending transfers; wait before unregistering")
            self._on_loop(self._unregister(reg), t)
            reg.active = False
            self._registrations = {k: r for k, r in self._registrations.items() if r is not reg}

    def _descriptor(self, reg: Registration) -> TransportRLRemoteBuffer:
        self._ensure_open()
        mine = transport.describe_buffer(self._ep, reg.name)  # (a flat uint8 buffer: byte offsets are element offsets)
        return TransportRLRemoteBuffer(mine.endpoint, mine.incarnation, mine.buffer, mine.length)

    # ------------------------------------------------------------------ transfers
    def _check_transfer(self, local_buffer: MemoryView, remote_buffer: RemoteBuffer, *, mutable: bool) -> None:
        kind = TransportRLMutableMemoryView if mutable else TransportRLMemoryView
        if not isinstance(local_buffer, kind) or local_buffer._memory._transport is not self:
            raise TypeError("local_buffer was not registered by this transport"
                            + (" (a read needs a to_mutable_view())" if mutable else ""))
        if not isinstance(remote_buffer, TransportRLRemoteBuffer):
            raise TypeError("remote_buffer was not registered by a transport_rl transport")
        if self._peer is None:
            raise RuntimeError("transport is not connected")
        if (remote_buffer.endpoint, remote_buffer.incarnation) != (self._peer, self._peer_incarnation):
            raise ValueError("remote buffer does not belong to the connected peer")
        if local_buffer.size() > remote_buffer.length:
            raise ValueError("local view does not fit in the remote buffer")
        reg = local_buffer._memory._registration
        reg.ensure_active()
        if reg.replaced():
            raise RuntimeError("registered tensor was resized or its storage was replaced")

    def _finished(self, work: TransportRLWork) -> None:
        with self._pending_lock:
            self._pending.pop(id(work), None)

    def _start(self, write: bool, local: MemoryView, remote: RemoteBuffer, *, async_op: bool,
               timeout: float | None) -> int | Work:
        t = self._wait_for(timeout)
        deadline = time.monotonic() + t
        if not self._lock.acquire(timeout=t):  # (not _locked(): a context manager costs a small transfer ~1 us)
            raise TimeoutError("transport lock wait timed out")
        try:
            self._ensure_open()
            self._check_transfer(local, remote, mutable=not write)
            view = cast(TransportRLMemoryView, local)
            desc = cast(TransportRLRemoteBuffer, remote)
            work = TransportRLWork((view, desc), t, self._finished)
            if view.size() == 0:
                work._settle(None)
            else:
                # (the peer's flat uint8 buffer from its start: the byte view itself, at element 0; its size was
                # checked against the buffer's above)
                ops = {desc.buffer: transport.At(view._bytes(), 0)}
                bound = max(t, self._transfer_timeout)
                peer = desc.endpoint
                if not self._now(write, peer, ops, work):
                    with self._pending_lock:
                        self._pending[id(work)] = work
                    try:
                        fut = self._submit(self._transfer(write, peer, ops, time.monotonic() + bound))
                    except BaseException:  # (the loop's own thread, or the loop gone): never pending
                        with self._pending_lock:
                            self._pending.pop(id(work), None)
                        raise
                    work._attach(fut)
        finally:
            self._lock.release()
        if async_op:
            return work
        work._wait(max(0.0, deadline - time.monotonic()))
        return 0

    def _now(self, write: bool, peer: str, ops: dict[str, transport.At], work: TransportRLWork) -> bool:
        """The transfer done right here by the calling thread (under the transport's lock), if
        it can be (:meth:`transport.Endpoint.put_now`: an shm copy under 8 MiB into or out of the
        peer's mapped memory, which the event loop would do inline too; its result or error
        settles ``work``): no hand-off to the loop thread and back, which costs a small transfer
        far more than its copy. Only while no transfer is pending (they run in submission order)."""
        if self.plane != "shm" or self._pending:  # (read unlocked: it fills only under self._lock, which the
            return False  # caller holds; a transfer ending meanwhile only sends this one the loop's way)
        try:
            done = self._ep.put_now(peer, ops) if write else self._ep.get_now(peer, ops)
        except Exception as exc:  # (the op's own error, as the loop's path would give it)
            work._end_now(exc)
            return True
        if done:
            work._end_now(None)
        return done

    async def _transfer(self, write: bool, peer: str, ops: dict[str, transport.At], end: float) -> None:
        # asyncio.Lock is FIFO and these coroutines start in submission order (run_coroutine_threadsafe)
        async with self._in_order:
            left = end - time.monotonic()  # (the bound counts from submission: the turn waited included)
            if left <= 0:
                raise transport.TransportTimeoutError(
                    f"the {'write' if write else 'read'} waited for the transfers submitted before it past its "
                    f"bound (transfer_timeout={self._transfer_timeout} s); it never started")
            if write:
                await self._ep.put(peer, ops, timeout=left)
            else:
                await self._ep.get(peer, ops, timeout=left)

    def write(self, local_buffer: MemoryView, remote_buffer: RemoteBuffer, *, async_op: bool = False,
              timeout: float | None = None) -> int | Work:
        """Write the local view into the start of the peer's buffer (a ``put``); see the class."""
        return self._start(True, local_buffer, remote_buffer, async_op=async_op, timeout=timeout)

    def read(self, local_buffer: MutableMemoryView, remote_buffer: RemoteBuffer, *, async_op: bool = False,
             timeout: float | None = None) -> int | Work:
        """Read the start of the peer's buffer into the local view (a ``get``); see the class."""
        return self._start(False, local_buffer, remote_buffer, async_op=async_op, timeout=timeout)

    def write_stream(self, local_buffer: MemoryView, remote_buffer: RemoteBuffer, *,
                     stream: torch.cuda.Stream | None = None, timeout: float | None = None) -> None:
        """Not supported: this backend registers CPU memory only (``NotImplementedError``)."""
        raise NotImplementedError("transport_rl: stream-ordered transfers need CUDA memory, and this backend "
                                  "registers CPU memory only; use write()/write_async()")

    def read_stream(self, local_buffer: MutableMemoryView, remote_buffer: RemoteBuffer, *,
                    stream: torch.cuda.Stream | None = None, timeout: float | None = None) -> None:
        """Not supported: this backend registers CPU memory only (``NotImplementedError``)."""
        raise NotImplementedError("transport_rl: stream-ordered transfers need CUDA memory, and this backend "
                                  "registers CPU memory only; use read()/read_async()")

    # ------------------------------------------------------------------ close
    def _begin_close(self, timeout: float) -> list[TransportRLWork]:
        self._closing = True
        with self._locked(timeout), self._pending_lock:
            return list(self._pending.values())

    async def _release_on_loop(self) -> None:
        for name in sorted(self._ep.buffers, key=lambda n: n.endswith(".t")):  # flat views before their bases
            self._ep.unregister(name)
        await self._ep.close()

    def _release(self, timeout: float) -> None:
        """Unregister everything, close the endpoint and stop the loop (retryable on timeout)."""
        if self._closed:
            return
        if self._ep_close is None:
            self._ep_close = self._submit(self._release_on_loop())
        try:
            self._ep_close.result(timeout + _LOOP_GRACE)
        except concurrent.futures.TimeoutError:
            raise TimeoutError("closing the endpoint timed out; close again to finish") from None
        finally:
            if self._ep_close.done() and self._ep_close.exception() is not None:
                self._ep_close = None  # failed: the next close tries again
        self._stop_loop()
        for reg in self._registrations.values():
            reg.active = False
        self._registrations.clear()
        self._peer = None
        self._closed = True

    def _stop_loop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()

    def close(self, *, timeout: float | None = None) -> None:
        """Reject new operations, wait for pending transfers, release everything; idempotent.

        Blocks at most ``timeout``. ``TimeoutError`` while transfers are still pending (or the
        endpoint did not close in time): resources are kept and closing again finishes. A
        transfer pending at the call that failed has its error raised after the release."""
        self._close_cuda_streams()
        t = self._wait_for(timeout)
        if self._closed:
            return
        deadline = time.monotonic() + t
        pending = self._begin_close(t)
        error: BaseException | None = None
        for work in pending:
            try:
                work._wait(max(0.0, deadline - time.monotonic()))
            except BaseException as failure:
                if not work.is_completed():
                    raise
                error = error or failure
        with self._locked(max(0.0, deadline - time.monotonic())):
            self._release(max(0.0, deadline - time.monotonic()))
        if error is not None:
            raise error

    async def close_async(self, *, timeout: float | None = None) -> None:
        """As :meth:`close`, awaiting pending transfers without blocking the calling loop.

        Cancellation or timeout keeps every resource and rejects new operations; await it
        again to finish. The final release (the endpoint's close) runs on a worker thread."""
        self._close_cuda_streams()
        t = self._wait_for(timeout)
        if self._closed:
            return
        deadline = time.monotonic() + t
        self._closing = True  # (new operations are refused from here, even if this is cancelled right away)
        # (under the operations' lock, as close() takes it: a transfer past its open check is then pending)
        pending = await asyncio.to_thread(self._begin_close, t)
        error: BaseException | None = None
        try:
            await wait_all(pending, timeout=max(0.0, deadline - time.monotonic()))
        except BaseException as failure:
            if isinstance(failure, asyncio.CancelledError) or not all(w.is_completed() for w in pending):
                raise
            error = failure
        await asyncio.to_thread(self._release_locked, deadline)
        if error is not None:
            raise error

    def _release_locked(self, deadline: float) -> None:
        with self._locked(max(0.0, deadline - time.monotonic())):
            self._release(max(0.0, deadline - time.monotonic()))
