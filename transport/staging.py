"""The staged path: bytes of GPU tensors through small host bounce buffers.

A GPU tensor's bytes cannot be handed to a socket. On the staged path they go
through a ring of at most ``buffers`` host *bounce buffers* of ``chunk_bytes``
each (pinned memory when the engine is CUDA's), one op at a time, in
pipelined chunks, over the channel's ordinary byte stream (tcp framing: the
payload follows the op's header). Memory is bounded: one op never holds more
than ``buffers`` bounce buffers, whatever its size.

Sending (:func:`stage_out`, a generator the channel's writer thread iterates):
copies of the first ``buffers`` chunks are issued at once (device -> host,
asynchronous); each chunk is handed to the writer as soon as its copy has
completed, and its bounce buffer is refilled with the next chunk only once
the writer asks for the next view, i.e. after it has sent the previous one.

Receiving (:func:`stage_in`, run by the reader thread that owns the socket):
each chunk is received into the next bounce buffer of the ring, then copied
to the device asynchronously; before a bounce buffer is refilled, its
previous copy is waited for. All copies have completed when it returns.

Both are generic over a :class:`CopyEngine` (issue an asynchronous copy,
wait for it with a bound). The CUDA engine (dedicated streams, events, pinned
memory) lives in :mod:`transport.cuda.staging`; :class:`ThreadCopyEngine`
runs copies on a worker thread and is what the CPU tests drive the same
pipeline with (``StagingConfig(cpu_engine=ThreadCopyEngine)`` stages CPU
tensors too, end to end through endpoints).

Blocking: :func:`stage_in`, :meth:`Staging.receive` and each step of
:func:`stage_out` / :meth:`Staging.payload` block their calling thread (the
channel's reader or writer, never the event loop); :meth:`Staging.mark`,
:meth:`Staging.stages`, :meth:`Staging.ring` and :meth:`Staging.statistics`
do not block. Timeouts: every wait is bounded by ``stall_timeout`` (one
chunk's copy must complete within it); past it,
:class:`~transport.errors.StagingError` is raised. Cancellation: nothing
here is cancelled from outside. Cancelling ``await ep.put()`` stops the
caller's wait only; the writer still stages and sends the whole payload
(the source stays referenced). The channel stops a receive through ``stop``
(copies already issued are waited for, the rest of the bytes is drained;
a copy that outlives ``stall_timeout`` is parked with its memory, see
:func:`stage_in`),
and a send that cannot finish after its first chunk breaks its channel (a
peer that saw part of a payload cannot be resynchronised).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .completion import CompletionBridge
from .errors import InvalidTensorError, StagingError
from .registry import tensor_bytes

__all__ = [
    "DEFAULT_BUFFERS",
    "DEFAULT_CHUNK_BYTES",
    "MAX_STREAM_BRIDGES",
    "BounceRing",
    "CopyEngine",
    "CopyHandle",
    "Staging",
    "StagingConfig",
    "StagingStats",
    "ThreadCopyEngine",
    "stage_in",
    "stage_out",
]

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 8 << 20
DEFAULT_BUFFERS = 4
MAX_STREAM_BRIDGES = 8  # per device: threads awaiting callers' marks, one per stream seen


class CopyHandle(Protocol):
    """One copy issued by an engine."""

    def wait(self, timeout: float) -> None:
        """Block until the copy has completed, at most ``timeout`` seconds. Raises
        :class:`StagingError` if it failed or is still running at the bound."""

    def done(self) -> bool:
        """Whether the copy is over (successfully or not); never blocks."""


class CopyEngine(Protocol):
    """Asynchronous copies between a device and host bounce buffers.

    ``mark()`` is called in the thread that issued the op (the caller's) and
    returns what the op must wait for (e.g. a blocking-sync CUDA event on the
    caller's current stream), or None: a :class:`~transport.completion.Waitable`
    (``query``/``synchronize``), which the staged plane awaits on the event loop
    before the op reaches the channel; ``copy(after=...)`` can also order one
    copy after it, for direct users of the pipeline. ``copy`` issues ``dst.copy_(src)`` without
    waiting for it (it may raise :class:`StagingError` if it cannot issue it).
    ``host_buffer`` allocates one bounce buffer (a ``uint8`` CPU tensor).
    """

    name: str

    def host_buffer(self, nbytes: int) -> torch.Tensor: ...
    def mark(self) -> Any: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> CopyHandle: ...


# ---------------------------------------------------------------------------- CPU engine
class _ThreadHandle:
    __slots__ = ("error", "finished")

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: float) -> None:
        if not self.finished.wait(timeout):
            raise StagingError(f"a staged copy did not complete within {timeout:g} s")
        if self.error is not None:
            raise StagingError(f"a staged copy failed: {self.error!r}") from self.error


class ThreadCopyEngine:
    """Copies run on one worker thread, in issue order, and complete asynchronously.

    The CPU counterpart of a CUDA copy stream: the staging pipeline cannot tell
    it apart, so CPU tests exercise the real ordering, chunking and bounds.
    The worker starts on the first copy and exits after a second idle.
    ``_copy`` is the one place a copy happens (tests subclass it to inject
    slowness or failures).
    """

    name = "cpu-thread"

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[torch.Tensor, torch.Tensor, _ThreadHandle]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running = False

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def mark(self) -> Any:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> CopyHandle:
        handle = _ThreadHandle()
        with self._lock:
            self._jobs.put((dst, src, handle))
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="transport-stage-copy", daemon=True).start()
        return handle

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def _run(self) -> None:
        while True:
            try:
                dst, src, handle = self._jobs.get(timeout=1.0)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._running = False
                        return
                continue
            try:
                self._copy(dst, src)
            except BaseException as exc:  # reported to the waiter
                handle.error = exc
            finally:
                handle.finished.set()
            del dst, src, handle


# ---------------------------------------------------------------------------- config, rings
@dataclass(frozen=True)
class StagingConfig:
    """How the staged path stages, per endpoint (``Endpoint(staging=...)``).

    ``chunk_bytes``: size of one bounce buffer (and of one copy);
    ``buffers``: bounce buffers per op at most (memory per op in flight:
    ``buffers * chunk_bytes``); ``stall_timeout``: seconds one chunk's copy
    may take before the op fails with :class:`StagingError`;
    ``cpu_engine``: a factory of a :class:`CopyEngine` to stage CPU tensors
    too (tests and debugging: it runs the GPU path's pipeline on a CPU
    machine; None, the default, sends CPU tensors straight from their memory).
    ``cpu_engine_peers``: with ``cpu_engine``, whether peers' CPU buffers are
    taken for GPU buffers too (the default: ops on them travel inline on the
    channel's socket, as ops on a peer's GPU buffer do); False leaves them
    what they are, so that over ``shm`` our staged tensors are copied through
    the bounce buffers into the peer's segments, as a GPU tensor of ours with
    a peer's CPU buffer is.
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    buffers: int = DEFAULT_BUFFERS
    stall_timeout: float = 30.0
    cpu_engine: Callable[[], CopyEngine] | None = None
    cpu_engine_peers: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be an int >= 1, got {self.chunk_bytes!r}")
        if isinstance(self.buffers, bool) or not isinstance(self.buffers, int) or self.buffers < 1:
            raise ValueError(f"buffers must be an int >= 1, got {self.buffers!r}")
        if not self.stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0, got {self.stall_timeout!r}")


@dataclass(frozen=True)
class StagingStats:
    """Bounce buffers of one :class:`Staging`: held now, the most ever held at once, allocated in all."""

    in_use: int
    peak_in_use: int
    allocated: int


class BounceRing:
    """At most ``count`` bounce buffers of ``chunk_bytes`` for one transfer, allocated on first
    use and dropped by :meth:`release` (pinned host memory is cached by torch's host allocator)."""

    def __init__(self, staging: Staging, engine: CopyEngine, count: int, chunk_bytes: int) -> None:
        self._staging = staging
        self.engine = engine
        self.count = count
        self.chunk_bytes = chunk_bytes
        self._bufs: list[torch.Tensor | None] = [None] * count
        self._released = False

    def buffer(self, slot: int) -> torch.Tensor:
        buf = self._bufs[slot]
        if buf is None:
            if self._released:
                raise StagingError("bounce ring used after release")
            try:
                buf = self.engine.host_buffer(self.chunk_bytes)
            except Exception as exc:  # e.g. pinned memory exhausted
                raise StagingError(f"{self.engine.name}: cannot allocate a {self.chunk_bytes}-byte bounce buffer: "
                                   f"{exc}") from exc
            self._bufs[slot] = buf
            self._staging._took(1)
        return buf

    @property
    def allocated(self) -> int:
        return sum(b is not None for b in self._bufs)

    def release(self, stuck: Iterable[tuple[int, CopyHandle]] = (), keep: torch.Tensor | None = None) -> None:
        """Give the buffers back. A slot in ``stuck`` is still read or written by a copy that did
        not complete in time: its buffer, and ``keep`` (the tensor at the copy's other end), are
        parked (held, never handed back to an allocator) until that copy is over."""
        if self._released:
            return
        self._released = True
        n = self.allocated
        for slot, handle in stuck:
            buf = self._bufs[slot]
            self._staging._park(handle, buf, keep)
        self._bufs = [None] * self.count
        self._staging._gave(n)


def _wait_quietly(handles: Iterable[tuple[int, CopyHandle]], timeout: float) -> list[tuple[int, CopyHandle]]:
    """Wait for copies still in flight (errors are already being reported); return those
    that did not complete in time. Once one is stuck, the others get ``min(timeout, 0.1)`` s
    each (copies complete in issue order: those behind a stuck one are stuck too), so the
    whole wait stays within about one ``timeout``."""
    stuck: list[tuple[int, CopyHandle]] = []
    for slot, h in handles:
        try:
            h.wait(min(timeout, 0.1) if stuck else timeout)
        except StagingError:
            if not h.done():
                stuck.append((slot, h))
    return stuck


def _issue(engine: CopyEngine, dst: torch.Tensor, src: torch.Tensor, after: Any) -> CopyHandle:
    try:
        return engine.copy(dst, src, after)
    except StagingError:
        raise
    except Exception as exc:
        raise StagingError(f"{engine.name}: cannot issue a staged copy: {exc}") from exc


def stage_out(src: torch.Tensor, ring: BounceRing, stall_timeout: float,
              after: Any = None) -> Generator[memoryview, None, None]:
    """Yield the bytes of ``src`` (a flat ``uint8`` tensor on the engine's device) chunk by chunk,
    each one a view of a bounce buffer whose copy has completed.

    A bounce buffer is refilled only when the consumer asks for the next view, so the
    consumer must be done with a view (have sent it) before calling ``next`` again. At
    most ``ring.count`` copies are in flight. Blocks in ``next`` while the head chunk's
    copy runs (bounded by ``stall_timeout``; then :class:`StagingError`). Closing the
    generator early waits for the copies in flight (bounded) before the caller releases
    the ring.
    """
    engine, size, n = ring.engine, ring.chunk_bytes, src.numel()
    pending: deque[tuple[int, int, CopyHandle]] = deque()  # slot, bytes, copy
    free = deque(range(ring.count))
    pos = 0
    try:
        while pos < n or pending:
            while free and pos < n:
                slot, k = free.popleft(), min(size, n - pos)
                pending.append((slot, k, _issue(engine, ring.buffer(slot)[:k], src[pos : pos + k], after)))
                pos += k
            slot, k, handle = pending[0]
            handle.wait(stall_timeout)
            pending.popleft()
            yield tensor_bytes(ring.buffer(slot)[:k])
            free.append(slot)  # the consumer is back: that view has been sent
    finally:
        if pending:
            stuck = _wait_quietly([(s, h) for s, _, h in pending], stall_timeout)
            if stuck:
                ring.release(stuck, keep=src)


def stage_in(
    dst: torch.Tensor,
    ring: BounceRing,
    stall_timeout: float,
    fill: Callable[[memoryview, int], None],
    *,
    after: Any = None,
    stop: Callable[[], bool] | None = None,
    on_stop: Callable[[], None] | None = None,
    on_stuck: Callable[[], None] | None = None,
) -> bool:
    """Receive ``dst.numel()`` bytes into ``dst`` (a flat ``uint8`` tensor on the engine's device).

    ``fill(view, more)`` fills ``view`` from the source (``more``: bytes of ``dst`` that follow
    it). Each chunk lands in the next bounce buffer and is copied to ``dst`` asynchronously;
    a bounce buffer is refilled only after its previous copy completed. Every byte is always
    consumed from the source, so the stream stays in sync: if a copy fails, or ``stop()``
    turns True (checked before each chunk), no further copy is issued, the ones in flight
    are waited for, ``on_stop()`` is called (once nothing more will be written to ``dst``)
    and the remaining bytes are received into scratch memory and dropped. Returns True if
    every byte reached ``dst``, False if stopped; raises :class:`StagingError` (after
    consuming every byte) if a copy failed or stalled. An error of ``fill`` propagates at
    once (the source is broken), after the copies in flight were waited for (bounded).

    A copy that is still running past ``stall_timeout`` (*stuck*) cannot be called back: its
    bounce buffer is never refilled (the rest is drained through scratch memory) and, with
    ``dst``, is parked (:meth:`BounceRing.release`) until the copy ends, so neither memory is
    reused meanwhile. ``on_stuck()`` is called when the first copy is found stuck (or, after
    an error of ``fill``, when a copy in flight is), ``on_stop`` is then *not* called
    (something may still be written to ``dst``), and the :class:`StagingError` raised says so. Once one copy is stuck, the others
    still in flight are given ``min(stall_timeout, 0.1)`` s each (copies complete in issue
    order on an engine's stream: those behind a stuck one are stuck too).
    """
    engine, size, count, n = ring.engine, ring.chunk_bytes, ring.count, dst.numel()
    handles: list[CopyHandle | None] = [None] * count  # copies not yet known to be over
    stuck: set[int] = set()  # slots whose copy outlived its bound (handles kept)
    error: StagingError | None = None
    writing = True
    scratch: memoryview | None = None

    def settle(slot: int) -> None:
        nonlocal error
        h = handles[slot]
        if h is None or slot in stuck:
            return
        try:
            h.wait(min(stall_timeout, 0.1) if stuck else stall_timeout)
        except StagingError as exc:
            error = error or exc
            if not h.done():  # still running: keep it, never reuse its buffer
                if not stuck and on_stuck is not None:
                    on_stuck()
                stuck.add(slot)
                return
        handles[slot] = None

    def halt() -> None:  # no copy from here on; the ones in flight end first
        nonlocal writing
        writing = False
        for s in range(count):
            settle(s)
        if on_stop is not None and not stuck:
            on_stop()

    pos, i = 0, 0
    try:
        while pos < n:
            slot, k = i % count, min(size, n - pos)
            i += 1
            settle(slot)
            if writing and (error is not None or (stop is not None and stop())):
                halt()
            if writing:
                try:
                    buf = ring.buffer(slot)[:k]
                except StagingError as exc:  # no bounce buffer: drain through scratch memory instead
                    error = error or exc
                    halt()
            if not writing:  # drained through scratch: a bounce buffer may still be read by a stuck copy
                if scratch is None:
                    scratch = memoryview(bytearray(size))
                fill(scratch[:k], n - pos - k)
                pos += k
                continue
            fill(tensor_bytes(buf), n - pos - k)
            try:
                handles[slot] = _issue(engine, dst[pos : pos + k], buf, after)
            except StagingError as exc:
                error = exc
            pos += k
        for s in range(count):
            settle(s)
    finally:
        left = [(s, h) for s, h in enumerate(handles) if h is not None and s in stuck]
        busy = [(s, h) for s, h in enumerate(handles) if h is not None and s not in stuck]
        if busy:
            late = _wait_quietly(busy, stall_timeout)
            if late and not stuck and on_stuck is not None:
                on_stuck()
            left += late
        if left:
            ring.release(left, keep=dst)
    if error is not None:
        if stuck:
            raise StagingError(f"{error}; {len(stuck)} copy(ies) into the destination are still outstanding and "
                               "may write into it later (it is held until they end)") from error
        raise error
    return writing


# ---------------------------------------------------------------------------- per endpoint
class Staging:
    """The staged path of one endpoint: which devices stage, their engines, bounce-buffer accounting."""

    def __init__(self, config: StagingConfig | None = None) -> None:
        self.config = config or StagingConfig()
        self._lock = threading.Lock()
        self._cpu_engine: CopyEngine | None = None
        self._in_use = 0
        self._peak = 0
        self._allocated = 0
        # copies that outlived their bound, with the memory they may still touch (held until they end)
        self._parked: list[tuple[CopyHandle, tuple[torch.Tensor, ...]]] = []
        self._bridges: dict[tuple[torch.device, Any], CompletionBridge] = {}  # awaiting callers' marks, per stream

    def stages(self, device: str | torch.device) -> bool:
        """Whether bytes of a tensor on ``device`` go through bounce buffers."""
        kind = device.type if isinstance(device, torch.device) else device.partition(":")[0]
        return kind != "cpu" or self.config.cpu_engine is not None

    def engine(self, device: torch.device) -> CopyEngine:
        """The copy engine for ``device`` (CUDA's is shared by the process, two streams per device).
        :class:`StagingError` if it cannot be set up (e.g. CUDA fails to initialise)."""
        if device.type == "cuda":
            try:
                from .cuda.staging import cuda_engine

                return cuda_engine(device)
            except Exception as exc:
                raise StagingError(f"cannot set up the staging copy engine for {device}: {exc}") from exc
        if device.type != "cpu":
            raise InvalidTensorError(f"tensors on {device} cannot be staged (only cuda)")
        factory = self.config.cpu_engine
        if factory is None:
            raise InvalidTensorError("CPU tensors are not staged by this endpoint")
        with self._lock:
            if self._cpu_engine is None:
                try:
                    self._cpu_engine = factory()
                except Exception as exc:
                    raise StagingError(f"cannot set up the staging copy engine for {device}: {exc}") from exc
            return self._cpu_engine

    def ring(self, engine: CopyEngine, nbytes: int) -> BounceRing:
        """A ring for one transfer of ``nbytes``: no bigger than the transfer needs."""
        size = max(1, min(self.config.chunk_bytes, nbytes))
        count = max(1, min(self.config.buffers, -(-nbytes // size)))
        return BounceRing(self, engine, count, size)

    def mark(self, tensors: Iterable[torch.Tensor]) -> dict[torch.device, Any]:
        """Call in the caller's thread: per staged device, what the op must wait for (see
        :class:`CopyEngine`)."""
        out: dict[torch.device, Any] = {}
        for t in tensors:
            if self.stages(t.device) and t.device not in out:
                engine = self.engine(t.device)
                try:
                    out[t.device] = engine.mark()
                except Exception as exc:
                    raise StagingError(f"{engine.name}: cannot order the op after the caller's work: {exc}") from exc
        return out

    def payload(self, tensors: Iterable[torch.Tensor]) -> Iterator[memoryview]:
        """The bytes of ``tensors`` in order, for a sender: CPU tensors straight from their memory,
        staged ones chunk by chunk through a ring (see :func:`stage_out`)."""
        for t in tensors:
            if not t.numel():
                continue
            if not self.stages(t.device):
                yield tensor_bytes(t)
                continue
            flat = t.detach().reshape(-1).view(torch.uint8)
            ring = self.ring(self.engine(t.device), flat.numel())
            try:
                yield from stage_out(flat, ring, self.config.stall_timeout)
            finally:
                ring.release()

    def receive(self, dst: torch.Tensor, fill: Callable[[memoryview, int], None], *, after: Any = None,
                stop: Callable[[], bool] | None = None, on_stop: Callable[[], None] | None = None,
                on_stuck: Callable[[], None] | None = None) -> bool:
        """Receive into ``dst`` (any contiguous tensor on a staged device) through a ring;
        see :func:`stage_in`."""
        flat = dst.detach().reshape(-1).view(torch.uint8)
        try:
            engine = self.engine(dst.device)
        except StagingError:  # consume the bytes all the same: the stream stays in sync
            scratch = memoryview(bytearray(min(self.config.chunk_bytes, flat.numel())))
            left = flat.numel()
            while left:
                k = min(len(scratch), left)
                left -= k
                fill(scratch[:k], left)
            raise
        ring = self.ring(engine, flat.numel())
        try:
            return stage_in(flat, ring, self.config.stall_timeout, fill, after=after, stop=stop, on_stop=on_stop,
                            on_stuck=on_stuck)
        finally:
            ring.release()

    def bridge(self, device: torch.device, stream: Any = None) -> CompletionBridge:
        """The bridge that awaits callers' marks on ``device``'s ``stream`` (event loop thread;
        created on first use). One per stream, since the marks of one stream complete in order
        while those of different streams do not (a long kernel on one must not hold up a mark of
        another); past :data:`MAX_STREAM_BRIDGES` streams of one device, the others share one."""
        loop = asyncio.get_running_loop()
        key = (device, stream)
        b = self._bridges.get(key)
        if b is None and stream is not None and sum(1 for d, _ in self._bridges if d == device) >= MAX_STREAM_BRIDGES:
            key = (device, None)
            b = self._bridges.get(key)
        if b is None or b.loop is not loop:
            if b is not None:
                b.close(0.0)
            b = self._bridges[key] = CompletionBridge(loop, f"transport-mark-{device}")
        return b

    def close(self) -> None:
        """Stop the bridges (any thread): waits still pending fail with EndpointClosedError."""
        bridges, self._bridges = list(self._bridges.values()), {}
        for b in bridges:
            b.close(0.5)

    def statistics(self) -> StagingStats:
        with self._lock:
            return StagingStats(self._in_use, self._peak, self._allocated)

    def _took(self, n: int) -> None:
        with self._lock:
            self._in_use += n
            self._allocated += n
            self._peak = max(self._peak, self._in_use)

    def _gave(self, n: int) -> None:
        with self._lock:
            self._in_use -= n

    def _park(self, handle: CopyHandle, *tensors: torch.Tensor | None) -> None:
        """Hold ``tensors`` (a bounce buffer, the tensor at the copy's other end) until ``handle``'s
        copy is over: it may still read or write them, so their memory must not be reused."""
        held = tuple(t for t in tensors if t is not None)
        with self._lock:
            self._parked = [p for p in self._parked if not p[0].done()]
            self._parked.append((handle, held))
        log.error("a staged copy did not complete within its bound; its bounce buffer and the tensor it %s are held "
                  "until it does (%s)", "copies", ", ".join(f"{t.numel() * t.element_size()} bytes on {t.device}"
                                                            for t in held))

    def parked(self) -> int:
        """Copies that outlived their bound and have not ended yet (their memory is held)."""
        with self._lock:
            self._parked = [p for p in self._parked if not p[0].done()]
            return len(self._parked)
