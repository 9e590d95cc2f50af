"""The bounce-buffer pipeline of the staged path: a ring of bounce buffers, :func:`stage_out`, :func:`stage_in`.

One op's bytes go through a ring of at most ``count`` host bounce buffers of ``chunk_bytes``
each (:class:`BounceRing`), in pipelined chunks, generic over a
:class:`~transport.copy_engine.CopyEngine`. The ring reports the buffers it takes and gives back,
and the copies it parks, to its owner (a :class:`RingOwner`: the endpoint's
:class:`~transport.staging.Staging`).

Sending (:func:`stage_out`, a generator the channel's writer thread iterates):
copies of the first ``buffers`` chunks are issued at once (device -> host,
asynchronous); each chunk is handed to the writer as soon as its copy has
completed, and its bounce buffer is refilled with the next chunk only once
the writer asks for the next view, i.e. after it has sent the previous one.

Receiving (:func:`stage_in`, run by the reader thread that owns the socket):
each chunk is received into the next bounce buffer of the ring, then copied
to the device asynchronously; before a bounce buffer is refilled, its
previous copy is waited for. All copies have completed when it returns.

Both block their calling thread (each step of :func:`stage_out`, all of :func:`stage_in`); every
wait is bounded by ``stall_timeout``, past which :class:`~transport.errors.StagingError` is raised.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable
from typing import Any, Protocol

import torch

from .copy_engine import CopyEngine, CopyHandle
from .errors import StagingError
from .registry import tensor_bytes

__all__ = ["BounceRing", "RingOwner", "stage_in", "stage_out"]


class RingOwner(Protocol):
    """What a :class:`BounceRing` reports to (:class:`transport.staging.Staging` is one): bounce
    buffers taken and given back, and copies that outlived their bound (any thread)."""

    def _took(self, n: int) -> None: ...
    def _gave(self, n: int) -> None: ...
    def _park(self, handle: CopyHandle, *tensors: torch.Tensor | None) -> None: ...


class BounceRing:
    """At most ``count`` bounce buffers of ``chunk_bytes`` for one transfer, allocated on first
    use and dropped by :meth:`release` (pinned host memory is cached by torch's host allocator)."""

    def __init__(self, staging: RingOwner, engine: CopyEngine, count: int, chunk_bytes: int) -> None:
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
