"""One NCCL communicator: :class:`Communicator` (init, groups, send/recv, abort, close).

Non-blocking calls that answer ``ncclInProgress`` are finished here by polling
``ncclCommGetAsyncError`` against a deadline; every call goes through :data:`NCCL_LOCK`. The
communicator handle never leaves :class:`Communicator`. Needs a loaded
:class:`~transport.cuda.nccl_loader.NcclLibrary`; imports torch only when a device is named.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator

from ..errors import Phase, TransportTimeoutError
from .nccl_loader import NcclError, NcclLibrary, NcclUnavailableError, check
from .nccl_table import BYTES, NcclConfig, NcclResult, NcclUniqueId, _as_result, _comm_t, _result_t

__all__ = ["NCCL_LOCK", "Communicator"]

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Communicator
# ---------------------------------------------------------------------------------------------

_POLL_FIRST_S = 1e-5
_POLL_MAX_S = 2e-3
_ABORT_LOCK_WAIT_S = 2.0


class _ClosedError(NcclError):
    """A call on a communicator that was already closed or aborted."""


def _warn_unclosed(handle: int, version: str) -> None:
    warnings.warn(
        f"NCCL {version} communicator 0x{handle:x} was garbage-collected without close() or abort(); "
        "its GPU and network resources stay allocated until the process exits",
        ResourceWarning,
        stacklevel=2,
    )


@contextlib.contextmanager
def _current_device(device: int | None) -> Iterator[None]:
    """Make ``device`` the current CUDA device for the block (torch imported only if one is given)."""
    if device is None:
        yield
        return
    import torch

    if not torch.cuda.is_available():
        raise NcclUnavailableError(f"device={device} was requested but torch sees no CUDA device")
    with torch.cuda.device(device):
        yield


#: Held around every NCCL call a :class:`Communicator` makes (init, send/recv, group start/end,
#: queries, finalize/destroy/abort), across all communicators of the process: NCCL's "Thread
#: Safety" section makes concurrent calls on communicators of one device unsafe, and a channel's
#: calls come from several threads (the event loop, reader threads, link set-up threads). One lock
#: for the process rather than one per device: a process drives one device in practice, and every
#: call it guards returns at once on a non-blocking communicator (the waits for ``ncclInProgress``
#: poll outside it). A *blocking* communicator's calls may wait without bound while holding it.
NCCL_LOCK = threading.RLock()


class Communicator:
    """One NCCL communicator (``ncclComm_t``), owned; build it with :meth:`init_rank`.

    Blocking behaviour. With ``blocking=False`` (the default, what channels use) NCCL never blocks
    the calling thread: calls that return ``ncclInProgress`` are finished here by polling
    ``ncclCommGetAsyncError`` until a deadline (the call's ``timeout``, else the communicator's).
    On a deadline the communicator is aborted and :class:`~transport.errors.TransportTimeoutError`
    is raised; when NCCL reports an asynchronous error (``ncclRemoteError`` when the peer died...)
    it is aborted and :class:`NcclError` is raised. An error returned directly by a call (bad
    arguments) raises :class:`NcclError` and leaves the communicator usable. With
    ``blocking=True`` NCCL itself may wait without bound (init until every rank joins,
    ``ncclGroupEnd`` until connections are set up, close until the node's ranks finalize);
    timeouts cannot be enforced in that mode.

    Threads: use a communicator from one thread at a time (NCCL's rule). :meth:`abort` is the
    exception: any thread may call it, and it waits at most 2 s for a call in progress to return
    before aborting anyway (which is how NCCL unblocks a stuck blocking call).

    Lifetime: :meth:`close` (finalize, then destroy) and :meth:`abort` are idempotent; after either,
    every call raises :class:`NcclError` (``ncclInvalidUsage``). A communicator dropped without
    either is not torn down (teardown may need the peers); a ``ResourceWarning`` says so.
    """

    def __init__(self, lib: NcclLibrary, handle: int, *, blocking: bool, timeout: float) -> None:
        # Private: use init_rank(). Takes ownership of ``handle``.
        self._lib = lib
        self._handle: int | None = handle
        self._blocking = blocking
        self._timeout = timeout
        self._lock = NCCL_LOCK  # (process-wide: see NCCL_LOCK)
        self._tls = threading.local()
        self._nranks = -1
        self._rank = -1
        self._device = -1
        self._finalizer = weakref.finalize(self, _warn_unclosed, handle, lib.version_string)

    @classmethod
    def init_rank(
        cls,
        lib: NcclLibrary,
        nranks: int,
        unique_id: bytes | bytearray | memoryview,
        rank: int,
        *,
        blocking: bool = False,
        device: int | None = None,
        timeout: float = 60.0,
    ) -> Communicator:
        """Join communicator ``unique_id`` as ``rank`` of ``nranks`` on ``device`` (default: current).

        Uses ``ncclCommInitRankConfig`` when the library has it (required for ``blocking=False``:
        :class:`NcclUnavailableError` otherwise, never a silent switch to blocking mode), else
        ``ncclCommInitRank``. Non-blocking: returns once NCCL reports the communicator ready, or
        aborts it and raises :class:`TransportTimeoutError` (phase ``connect``) after ``timeout``
        seconds, or :class:`NcclError` if NCCL fails. ``timeout`` is also the default deadline of
        every later call. Blocking: returns when every rank has joined, however long that takes.
        """
        init_name = "ncclCommInitRankConfig" if lib.has("ncclCommInitRankConfig") else "ncclCommInitRank"
        if nranks < 1 or not 0 <= rank < nranks:
            raise NcclError(NcclResult.INVALID_ARGUMENT, init_name, f"rank {rank} is not in 0..{nranks - 1}")
        if timeout <= 0:
            raise NcclError(NcclResult.INVALID_ARGUMENT, init_name, f"timeout must be positive, got {timeout}")
        uid = NcclUniqueId.from_bytes(unique_id)
        if not blocking:
            for name in ("ncclCommInitRankConfig", "ncclCommGetAsyncError", "ncclCommAbort"):
                if not lib.has(name):
                    raise NcclUnavailableError(
                        f"a non-blocking NCCL communicator needs {name}, which NCCL {lib.version_string} "
                        f"from {lib.path} lacks ({lib.unavailable.get(name)}); pass blocking=True to "
                        "accept unbounded waits"
                    )
        if not blocking and os.environ.get("NCCL_COMM_BLOCKING") == "1":
            log.warning("NCCL_COMM_BLOCKING=1 overrides blocking=False: NCCL calls may now wait without a deadline")
        deadline = time.monotonic() + timeout
        out = _comm_t()
        with _current_device(device), NCCL_LOCK:
            if init_name == "ncclCommInitRankConfig":
                config = NcclConfig.make(blocking=blocking)
                rc = lib._fn(init_name)(ctypes.byref(out), nranks, uid, rank, ctypes.byref(config))
            else:
                rc = lib._fn(init_name)(ctypes.byref(out), nranks, uid, rank)
        handle = out.value
        if rc not in (NcclResult.SUCCESS, NcclResult.IN_PROGRESS):
            error = NcclError.from_result(rc, lib, init_name, handle)
            if handle:  # a non-blocking init can fail after creating the communicator
                cls(lib, handle, blocking=blocking, timeout=timeout).abort()
            raise error
        if not handle:
            raise NcclError(NcclResult.INTERNAL_ERROR, init_name, "NCCL reported success but returned no communicator")
        # NCCL_COMM_BLOCKING in the environment overrides the config: an in-progress answer means
        # the communicator is non-blocking whatever was asked for.
        comm = cls(lib, handle, blocking=blocking and rc != NcclResult.IN_PROGRESS, timeout=timeout)
        try:
            if not comm._blocking:
                comm._wait_ready(deadline, init_name, Phase.CONNECT)
            comm._nranks = comm._query_int("ncclCommCount")
            comm._rank = comm._query_int("ncclCommUserRank")
            comm._device = comm._query_int("ncclCommCuDevice")
        except BaseException:
            comm.abort()
            raise
        return comm

    # -- state -------------------------------------------------------------------------------

    @property
    def lib(self) -> NcclLibrary:
        return self._lib

    @property
    def nranks(self) -> int:
        return self._nranks

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def device(self) -> int:
        """The CUDA device ordinal NCCL bound this communicator to."""
        return self._device

    @property
    def blocking(self) -> bool:
        return self._blocking

    @property
    def closed(self) -> bool:
        return self._handle is None

    def __repr__(self) -> str:
        state = "closed" if self._handle is None else ("blocking" if self._blocking else "non-blocking")
        return f"<Communicator rank {self._rank}/{self._nranks} device {self._device} {state} NCCL {self._lib.version_string}>"

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _live(self, what: str) -> int:
        handle = self._handle
        if handle is None:
            raise _ClosedError(NcclResult.INVALID_USAGE, what, "the communicator is closed (aborted or destroyed)")
        return handle

    def _error(self, rc: int, what: str) -> NcclError:
        # Only a live handle goes to ncclGetLastError; after abort/destroy it is freed memory.
        return NcclError.from_result(rc, self._lib, what, self._handle)

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (self._timeout if timeout is None else timeout)

    def _query_int(self, name: str) -> int:
        value = ctypes.c_int(-1)
        with self._lock:
            handle = self._live(name)
            rc = self._lib._fn(name)(handle, ctypes.byref(value))
        if rc != NcclResult.SUCCESS:
            raise self._error(rc, name)
        return value.value

    # -- asynchronous state ------------------------------------------------------------------

    def async_error(self) -> NcclResult | int:
        """``ncclCommGetAsyncError``: ``SUCCESS``, ``IN_PROGRESS`` (an operation is still being
        set up) or the error that broke the communicator. Does not block, does not raise for the
        state it reports (only if the query itself fails)."""
        state = _result_t(0)
        with self._lock:
            handle = self._live("ncclCommGetAsyncError")
            rc = self._lib._fn("ncclCommGetAsyncError")(handle, ctypes.byref(state))
        if rc != NcclResult.SUCCESS:
            raise self._error(rc, "ncclCommGetAsyncError")
        return _as_result(state.value)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Poll until NCCL leaves ``ncclInProgress``; abort and raise on a deadline or an error."""
        self._wait_ready(self._deadline(timeout), "ncclCommGetAsyncError", Phase.TRANSFER)

    def _wait_ready(self, deadline: float, what: str, phase: Phase) -> None:
        delay = _POLL_FIRST_S
        while True:
            state = self.async_error()
            if state == NcclResult.SUCCESS:
                return
            if state != NcclResult.IN_PROGRESS:
                error = self._error(state, what)
                self.abort()
                raise error
            now = time.monotonic()
            if now >= deadline:
                self.abort()
                raise TransportTimeoutError(
                    f"{what}: NCCL still in progress at the deadline (rank {self._rank} of {self._nranks}); "
                    "the communicator was aborted",
                    phase,
                )
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, _POLL_MAX_S)

    def _group_depth(self) -> int:
        return int(getattr(self._tls, "depth", 0))

    def _settle(self, rc: int, what: str, timeout: float | None) -> None:
        if rc == NcclResult.SUCCESS:
            return
        if rc == NcclResult.IN_PROGRESS and not self._blocking:
            if self._group_depth() == 0:  # inside a group, the outermost ncclGroupEnd waits
                self._wait_ready(self._deadline(timeout), what, Phase.TRANSFER)
            return
        raise self._error(rc, what)

    # -- point to point ----------------------------------------------------------------------

    def send(self, ptr: int, nbytes: int, peer: int, stream: int = 0, *, timeout: float | None = None) -> None:
        """``ncclSend`` of ``nbytes`` bytes at device address ``ptr`` to rank ``peer`` on ``stream``.

        Returns once NCCL has queued the transfer on ``stream`` (inside :meth:`group`: once it has
        recorded it); completion is observed on the stream, not here. Waits as described in the
        class docstring, bounded by ``timeout``.
        """
        self._p2p("ncclSend", ptr, nbytes, peer, stream, timeout)

    def recv(self, ptr: int, nbytes: int, peer: int, stream: int = 0, *, timeout: float | None = None) -> None:
        """``ncclRecv`` of ``nbytes`` bytes into device address ``ptr`` from ``peer``; as :meth:`send`."""
        self._p2p("ncclRecv", ptr, nbytes, peer, stream, timeout)

    def _p2p(self, what: str, ptr: int, nbytes: int, peer: int, stream: int, timeout: float | None) -> None:
        if ptr < 0 or nbytes < 0 or (nbytes and not ptr):
            raise NcclError(NcclResult.INVALID_ARGUMENT, what, f"bad buffer: ptr=0x{ptr:x}, nbytes={nbytes}")
        if not 0 <= peer < self._nranks:
            raise NcclError(NcclResult.INVALID_ARGUMENT, what, f"peer {peer} is not in 0..{self._nranks - 1}")
        if stream < 0:
            raise NcclError(NcclResult.INVALID_ARGUMENT, what, f"bad stream handle {stream}")
        with self._lock:
            handle = self._live(what)
            rc = self._lib._fn(what)(ptr, nbytes, BYTES, peer, handle, stream)
        self._settle(rc, what, timeout)

    @contextlib.contextmanager
    def group(self, *, timeout: float | None = None) -> Iterator[Communicator]:
        """``ncclGroupStart`` ... ``ncclGroupEnd`` around the block (sends and receives that must
        progress together, a send to oneself with its receive).

        The outermost ``ncclGroupEnd`` launches the group; in non-blocking mode its
        ``ncclInProgress`` is waited for, bounded by ``timeout``. If the block raises,
        ``ncclGroupEnd`` still runs (NCCL cannot cancel a group), launching whatever was queued,
        and the block's exception propagates: abort the communicator unless the peer is known to
        post the matching operations.
        """
        self._live("ncclGroupStart")
        with self._lock:
            rc = self._lib._fn("ncclGroupStart")()
        check(rc, self._lib, "ncclGroupStart")
        depth = self._group_depth()
        self._tls.depth = depth + 1
        body_ok = False
        try:
            yield self
            body_ok = True
        finally:
            self._tls.depth = depth
            with self._lock:
                rc = self._lib._fn("ncclGroupEnd")()
            if body_ok:
                self._settle(rc, "ncclGroupEnd", timeout)
            elif rc not in (NcclResult.SUCCESS, NcclResult.IN_PROGRESS):
                log.warning("ncclGroupEnd after a failed group body: %s", self._error(rc, "ncclGroupEnd"))

    # -- teardown ----------------------------------------------------------------------------

    def abort(self) -> None:
        """``ncclCommAbort``: stop everything in flight and free the communicator. Idempotent.

        Local: needs no peer. Bounded: NCCL's abort flag makes its internal waits give up. The
        communicator is freed before ``ncclCommAbort`` returns (NCCL reclaims it inline outside a
        group), so its handle is never touched again, not even to poll an error. A failure is
        logged, not raised, since abort runs on paths that are already handling an error.
        """
        acquired = self._lock.acquire(timeout=_ABORT_LOCK_WAIT_S)
        try:
            handle = self._handle
            if handle is None:
                return
            fn = self._lib._fn("ncclCommAbort")  # raises, communicator kept, if NCCL has no abort
            self._handle = None
            self._finalizer.detach()
            rc = fn(handle)
            if rc not in (NcclResult.SUCCESS, NcclResult.IN_PROGRESS):  # (older NCCL: in progress, finishing alone)
                log.warning("%s", NcclError.from_result(rc, self._lib, "ncclCommAbort"))
        finally:
            if acquired:
                self._lock.release()

    def close(self, *, timeout: float | None = None) -> None:
        """``ncclCommFinalize`` (when available) then ``ncclCommDestroy``. Idempotent.

        Finalize waits for this rank's operations to finish and may wait for the other ranks on
        this node. Non-blocking: bounded by ``timeout``; at the deadline, or if NCCL fails, the
        communicator is aborted and the error raised. Blocking: may wait without bound; call
        :meth:`abort` instead when a peer may be gone.
        """
        deadline = self._deadline(timeout)
        try:
            if self._lib.has("ncclCommFinalize"):
                with self._lock:
                    if self._handle is None:
                        return
                    rc = self._lib._fn("ncclCommFinalize")(self._handle)
                if rc == NcclResult.IN_PROGRESS and not self._blocking:
                    # Polls take the lock one at a time, so abort() from another thread gets in.
                    self._wait_ready(deadline, "ncclCommFinalize", Phase.TRANSFER)
                elif rc != NcclResult.SUCCESS:
                    raise self._error(rc, "ncclCommFinalize")
            with self._lock:
                handle = self._handle
                if handle is None:
                    return
                self._handle = None
                self._finalizer.detach()
                rc = self._lib._fn("ncclCommDestroy")(handle)
            if rc != NcclResult.SUCCESS:
                raise NcclError.from_result(rc, self._lib, "ncclCommDestroy")
        except _ClosedError:
            return  # aborted by another thread meanwhile: closed all the same
        except NcclError:
            self.abort()  # no-op if already aborted or destroyed
            raise

    destroy = close
