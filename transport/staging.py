"""The staged path: bytes of GPU tensors through small host bounce buffers.

A GPU tensor's bytes cannot be handed to a socket. On the staged path they go
through a ring of at most ``buffers`` host *bounce buffers* of ``chunk_bytes``
each (pinned memory when the engine is CUDA's), one op at a time, in
pipelined chunks, over the channel's ordinary byte stream (tcp framing: the
payload follows the op's header). Memory is bounded: one op never holds more
than ``buffers`` bounce buffers, whatever its size.

Sending is :func:`~transport.bounce.stage_out` (a generator the channel's
writer thread iterates), receiving :func:`~transport.bounce.stage_in` (run
by the reader thread that owns the socket): the pipeline lives in
:mod:`transport.bounce`. Both are generic over a
:class:`~transport.copy_engine.CopyEngine` (issue an asynchronous copy,
wait for it with a bound; :mod:`transport.copy_engine`). The CUDA engine
(dedicated streams, events, pinned memory) lives in
:mod:`transport.cuda.staging`; :class:`ThreadCopyEngine` runs copies on a
worker thread and is what the CPU tests drive the same pipeline with
(``StagingConfig(cpu_engine=ThreadCopyEngine)`` stages CPU tensors too,
end to end through endpoints). This module is the per-endpoint part
(:class:`StagingConfig`, :class:`Staging`) and re-exports the engines and
the pipeline's names.

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
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .bounce import BounceRing, stage_in, stage_out
from .completion import CompletionBridge
from .copy_engine import CopyEngine, CopyHandle, ThreadCopyEngine
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


# ---------------------------------------------------------------------------- config
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
