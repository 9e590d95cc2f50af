"""The engine under the ``nccl`` plane's link: what only a GPU runs, behind one interface, and its CPU stand-in.

The link (:class:`transport.planes.nccl_link.Link`, one 2-rank communicator and one stream per
channel) decides what is posted and in which order: every post follows the dialer's order, so the
two sides' sends and receives always match (see that module). What it posts them on is a
:class:`LinkEngine`: :class:`transport.cuda.nccl_link.NcclLinkEngine` on a GPU
(``ncclCommInitRankConfig``, ``ncclSend``/``ncclRecv`` on the channel's stream, events). The CPU
tests run everything else with :class:`SocketLinkEngine`, whose "communicator" is a second TCP
connection served by one worker thread per side, in posting order, with NCCL's rendezvous: a send
completes only once the peer's receive took the bytes, so posting in different orders deadlocks
there too (it is reported as an error instead of hanging: a send that reads the peer's data where
it waits for its acknowledgement fails the link). :func:`link_engine_probe` says whether an
engine factory can run here, and why not.

Blocking: :meth:`LinkEngine.connect` blocks (on a worker thread); posting returns once the
operation is queued; completion is observed through waitables on a
:class:`~transport.completion.CompletionBridge`. Abort runs on a worker thread and is bounded
(NCCL's ``ncclCommAbort``, about 1 s).
"""

from __future__ import annotations

import logging
import queue
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec
import torch

from ..completion import ThreadDone
from ..errors import PlaneUnavailableError
from ..registry import tensor_bytes

__all__ = ["LinkConn", "LinkEngine", "SocketLinkEngine", "link_engine_probe"]

log = logging.getLogger(__name__)


class LinkConn(Protocol):
    """A connected 2-rank link: ordered point-to-point operations with the one peer."""

    def post(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], after: Any) -> Any:
        """Queue one op's transfers, its sends then its receives (``uint8``, contiguous), as one unit
        (NCCL: one group), behind ``after`` (a mark or None); return a
        :class:`~transport.completion.Waitable` of the unit's completion. Units run in posting
        order. Never waits for the peer, nor for the library (NCCL's ``ncclInProgress`` is waited
        for on the link's own thread): the event loop may call it."""
        ...

    def abort(self) -> None:
        """Stop everything in flight and free the link (any thread; bounded)."""
        ...


class LinkEngine(Protocol):
    """What the ``nccl`` plane needs from the memory and the library it moves bytes with."""

    name: str
    device: str  # the device this side's link serves, as BufferSpec.device spells it ("cuda:0")

    def handles(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` can be a source or destination of this link (on :attr:`device`)."""
        ...

    def unique_id(self) -> bytes:
        """Rank 0: a new id for the peer to join with."""
        ...

    def connect(self, unique_id: bytes, rank: int, timeout: float) -> LinkConn:
        """Join the 2-rank link ``unique_id`` as ``rank`` (blocking, bounded by ``timeout``)."""
        ...

    def mark(self, tensors: Sequence[torch.Tensor]) -> Any:
        """In the caller's thread: the work queued on its current stream(s), for posts to wait on."""
        ...

    def scratch(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of throw-away memory on :attr:`device` (to keep both sides in step when an op
        is rejected after the peer posted its half)."""
        ...


# --------------------------------------------------------------------------- CPU test engine
_LEN = struct.Struct("<Q")
_RTR = b"\xffRTR\xff\xff\xff\xff"  # ready to receive (never a plausible length: the top byte is 0xff)
_ACK = b"\xffACK\xff\xff\xff\xff"  # received


class _SocketConn:
    """One side of a :class:`SocketLinkEngine` link: posted ops run in order on one thread."""

    def __init__(self, sock: socket.socket, delay: float) -> None:
        self._sock = sock
        self._delay = delay
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._broken: BaseException | None = None
        self.aborted = False  # abort() was called (as ncclCommAbort would be)
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name="transport-p2p-socket", daemon=True)
        self._worker.start()

    def post(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], after: Any) -> ThreadDone:
        last = None
        for t in sends:
            last = self._post("send", t)
        for t in recvs:
            last = self._post("recv", t)
        if last is None:  # nothing to move
            last = ThreadDone()
            last.finished.set()
        return last  # (the worker runs them in order: the last one's completion is the unit's)

    def _post(self, kind: str, data: torch.Tensor) -> ThreadDone:
        done = ThreadDone()
        with self._lock:
            if self._broken is not None:
                done.error = self._broken
                done.finished.set()
                return done
            self._jobs.put((kind, data, done))
        return done

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            if self._broken is None:
                self._broken = ConnectionAbortedError("the link was aborted")
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._jobs.put(None)
        if self._worker is not threading.current_thread():
            self._worker.join(5.0)  # what it was doing is over (as after ncclCommAbort)
        self._sock.close()

    def _read(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionResetError("the peer closed the link")
            got += n

    def _expect(self, token: bytes, what: str) -> None:
        got = bytearray(len(token))
        self._read(memoryview(got))
        if bytes(got) != token:
            raise RuntimeError(f"link desynchronised: the peer sent something else where {what} was due "
                               "(both sides sent at once: posts out of order)")

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, data, done = job
            try:
                if self._broken is not None:
                    raise self._broken
                if self._delay:
                    threading.Event().wait(self._delay)
                view = tensor_bytes(data)
                if kind == "send":
                    self._sock.sendall(_LEN.pack(len(view)))
                    self._expect(_RTR, "its readiness to receive")  # both sides sending: out of order
                    self._sock.sendall(view)
                    self._expect(_ACK, "its receive acknowledgement")
                else:
                    head = bytearray(_LEN.size)
                    self._read(memoryview(head))
                    if bytes(head) in (_RTR, _ACK):
                        raise RuntimeError("link desynchronised: a receive met the peer's receive (posts out of order)")
                    (n,) = _LEN.unpack(head)
                    if n != len(view):
                        raise RuntimeError(f"link desynchronised: a receive of {len(view)} bytes met a send of {n}")
                    self._sock.sendall(_RTR)
                    self._read(view)
                    self._sock.sendall(_ACK)
            except BaseException as exc:  # the link is broken from here on
                with self._lock:
                    if self._broken is None:
                        self._broken = exc
                done.error = exc
            finally:
                done.finished.set()
            del job, data, done


class SocketLinkEngine:
    """The ``nccl`` plane's link on CPU memory, over a second TCP connection (tests, debugging
    without GPUs: ``Endpoint(engines={"nccl": SocketLinkEngine})`` on both sides makes their CPU buffers
    travel over the ``nccl`` plane's protocol). The unique id is the address of a listening socket,
    as NCCL's is the address of its bootstrap root. ``delay`` slows every operation (tests)."""

    name = "socket"
    device = "cpu"

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self._listeners: dict[bytes, socket.socket] = {}
        self._lock = threading.Lock()

    def handles(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def unique_id(self) -> bytes:
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        key = secrets.token_bytes(8)
        with self._lock:
            self._listeners[key] = lsock
        return msgspec.msgpack.encode(["127.0.0.1", lsock.getsockname()[1], key])

    def connect(self, unique_id: bytes, rank: int, timeout: float) -> _SocketConn:
        host, port, key = msgspec.msgpack.decode(unique_id)
        if rank == 0:
            with self._lock:
                lsock = self._listeners.pop(key, None)
            if lsock is None:
                raise PlaneUnavailableError("socket link: unknown unique id")
            try:
                lsock.settimeout(timeout)
                sock, _ = lsock.accept()
            finally:
                lsock.close()
            sock.settimeout(None)
        else:
            sock = socket.create_connection((host, port), timeout=timeout)
            sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _SocketConn(sock, self.delay)

    def mark(self, tensors: Sequence[torch.Tensor]) -> Any:
        return None

    def scratch(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


def link_engine_probe(factory: Callable[[], LinkEngine] | None,
                      device: int | None = None) -> tuple[LinkEngine | None, str]:
    """The engine an endpoint's ``nccl`` plane would use here (on CUDA ``device``, default the
    current one), or None and why not. Never raises."""
    if factory is not None:
        engine = factory()
        return engine, f"engine {engine.name!r} (engines=)"
    try:
        from ..cuda.nccl_link import nccl_link_engine

        return nccl_link_engine(device)
    except Exception as exc:  # noqa: BLE001 - ImportError, a CUDA error in a forked child...: no nccl here
        return None, f"the NCCL link engine is unavailable: {type(exc).__name__}: {exc}"
