"""Where a model's weights live, and how rl_sync's own copies on them are ordered.

rl_sync copies weights itself in three places: the publisher packs (and casts) buckets into its
send slots, the subscriber's staged commit copies its staging arenas into the live weights, and
direct mode's first push moves the live weights into the arena. On the CPU a copy runs on a worker
thread and nothing else needs ordering: readers are held off by the subscriber's lock.

On a GPU the lock is not enough: a reader's kernels queued inside :meth:`WeightSubscriber.hold`
may still run after it left the block, and the trainer's optimizer step may still be queued when
``push()`` is called. So:

- :class:`Copier` runs a batch of copies on a dedicated stream of the device, first making that
  stream wait (on the GPU) for the events it is given, and returns once the copies are done (the
  wait for the batch's event sleeps on a worker thread, never on the event loop).
- :class:`ReaderMarks` keeps, per stream, the newest event recorded where a reader left ``hold()``
  (on its thread's current stream, and on any stream it names). Events recorded on one stream
  complete in order, so the newest covers the older. Before rl_sync overwrites or re-points
  weights that readers read, it waits for them (:meth:`ReaderMarks.wait`, bounded).
- :func:`caller_marks` records events on the calling thread's current streams: what a pack waits
  for, so that it reads the weights as the caller's queued work leaves them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["Copier", "ReaderMarks", "caller_marks", "foreach_copy", "normal_device", "one_device", "pack_device",
           "wait_events"]

# an uncast copy is a copy of bytes: it runs viewed as the integer type of the dtype's width, the one kernel
# every build has (CUDA's _foreach_copy_ dispatches no uint16/32/64 nor the bit and sub-byte types)
_SAME_BYTES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# the dtypes CUDA's _foreach_copy_ casts between (ATen's foreach_tensor_copy dispatch); others cast one by one
_FOREACH_CASTS = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
                  torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128}


def foreach_copy(into: list[torch.Tensor], out_of: list[torch.Tensor], *, as_bytes: bool | None = None) -> None:
    """``into[i].copy_(out_of[i])`` for every i, in one ``torch._foreach_copy_`` where it can:
    the batch is of one (destination dtype, source dtype) pair and on one device. On a GPU an
    uncast batch of a dtype CUDA's kernel does not dispatch (uint16/32/64, bit and sub-byte types)
    runs as a byte copy of the integer type of its width (``as_bytes``: that way or not, on any
    device; default: only where needed, the views cost ~1 us per tensor); a cast between types it
    does not dispatch runs one ``copy_`` per tensor."""
    if not into:
        return
    dd, sd = into[0].dtype, out_of[0].dtype
    one_by_one = dd != sd and (dd not in _FOREACH_CASTS or sd not in _FOREACH_CASTS)
    if dd == sd:
        if as_bytes is None:
            as_bytes = into[0].is_cuda and dd not in _FOREACH_CASTS
        alias = _SAME_BYTES.get(into[0].element_size()) if as_bytes else None
        if alias is not None and alias != dd:  # (not one pair, or a lazy conj/neg view: one by one)
            one_by_one = any(t.dtype != dd or t.is_conj() or t.is_neg() for t in (*into, *out_of))
            if not one_by_one:
                into, out_of = [t.view(alias) for t in into], [t.view(alias) for t in out_of]
    if one_by_one:
        for d, src in zip(into, out_of, strict=True):
            d.copy_(src)
    else:
        torch._foreach_copy_(into, out_of)


def one_device(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    """The one device all of ``tensors`` are on; ``ValueError`` naming the devices if several."""
    devices: dict[torch.device, list[str]] = {}
    for name, t in tensors.items():
        devices.setdefault(normal_device(t.device), []).append(name)
    if len(devices) > 1:
        listed = "; ".join(f"{d}: {names[:3]}{' ...' if len(names) > 3 else ''}" for d, names in devices.items())
        raise ValueError(f"the model's tensors are on several devices ({listed}): one WeightSubscriber receives "
                         "onto one device (make one per device, or move the model first)")
    return next(iter(devices), torch.device("cpu"))


def pack_device(devices: Iterable[torch.device]) -> torch.device:
    """Where the publisher packs: the first CUDA device among those of the trainer's tensors
    (``devices``, in their order), else the CPU."""
    for d in devices:
        if d.type == "cuda":
            return normal_device(d)
    return torch.device("cpu")


def normal_device(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` is the current CUDA device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def caller_marks(devices: Iterable[torch.device]) -> list[Any]:
    """On the caller's thread: one event per CUDA device of ``devices`` (those of the tensors to
    pack), recorded on that device's current stream (what a :class:`Copier` batch waits for).
    Empty for the CPU."""
    events = []
    for device in {normal_device(d) for d in devices if d.type == "cuda"}:
        event = torch.cuda.Event(blocking=True)  # (a host wait on it sleeps: spinning would take a core from the trainer)
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return events


class Copier:
    """rl_sync's copies on one device (see the module docstring). Any thread may call :meth:`run`;
    batches of one copier run one after the other on its stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = normal_device(device)
        self.is_cuda = self.device.type == "cuda"
        self._stream: Any = None  # made at the first batch, on the device
        self._lock = threading.Lock()

    async def run(self, copies: Callable[[], None], after: Sequence[Any] = ()) -> None:
        """Run ``copies()`` (which queues ``copy_`` calls) and return once they are done.

        CPU: on a worker thread. CUDA: on a worker thread, inside the copier's stream, which
        first waits for the events ``after``; then the batch's event is waited for there.
        Cancelling the awaiting task does not stop a batch already started: its copies finish.
        """
        await asyncio.to_thread(self.run_blocking, copies, after)

    def run_blocking(self, copies: Callable[[], None], after: Sequence[Any] = ()) -> None:
        """:meth:`run` on the calling thread (blocks until the copies are done)."""
        if not self.is_cuda:
            with torch.no_grad():
                copies()
            return
        with self._lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.device)
            stream = self._stream
            with torch.cuda.device(self.device), torch.cuda.stream(stream), torch.no_grad():
                for event in after:
                    stream.wait_event(event)
                copies()
                done = torch.cuda.Event(blocking=True)  # synchronize() sleeps instead of spinning
                done.record(stream)
        done.synchronize()


class ReaderMarks:
    """Where readers of weights on a GPU left ``hold()``: the newest event per stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = normal_device(device)
        self.active = self.device.type == "cuda"
        self._events: dict[tuple[int, int], Any] = {}  # (device index, stream handle) -> its newest mark
        self._lock = threading.Lock()

    def leave(self, streams: Sequence[Any] = ()) -> None:
        """A reader leaves ``hold()`` (its thread): record an event on its current stream of the
        device and on each of ``streams``. Nothing on the CPU."""
        if not self.active:
            return
        marks = []
        for stream in (torch.cuda.current_stream(self.device), *streams):
            event = torch.cuda.Event()
            event.record(stream)
            marks.append(((stream.device.index, stream.cuda_stream), event))
        with self._lock:
            self._events.update(marks)

    def pending(self) -> list[Any]:
        """The events recorded so far (kept: :meth:`wait` forgets them only once they are done)."""
        with self._lock:
            return list(self._events.values())

    async def wait(self, timeout: float, abandoned: Callable[[], bool] | None = None) -> bool:
        """Wait until the GPU work readers queued before leaving ``hold()`` is done (polled on a
        worker thread, at most ``timeout`` s). Events are forgotten only once done, so concurrent or
        later waits (a superseding push, a retry after a timeout) still see the ones not done.
        False at the deadline. True at once on the CPU. ``abandoned`` (called on the worker thread
        between polls, every 5 ms at most): once it is true the wait ends at once, returning True
        (the caller, whose push was dropped meanwhile, must check that and move nothing). A
        cancelled wait's worker thread polls on until the work is done or ``timeout``, unless
        ``abandoned`` ends it first."""
        events = self.pending()
        if not events:
            return True
        late = await asyncio.to_thread(wait_events, events, timeout, abandoned)
        done = {id(e) for e in events} - {id(e) for e in late}
        with self._lock:
            for key in [k for k, e in self._events.items() if id(e) in done]:
                del self._events[key]
        return not late or (abandoned is not None and abandoned())


def wait_events(events: list[Any], timeout: float, abandoned: Callable[[], bool] | None = None) -> list[Any]:
    """Poll ``events`` (CUDA events) until done, ``timeout`` s, or ``abandoned()`` is true, sleeping
    between polls (blocking: not on the event loop); the ones not done."""
    deadline = time.monotonic() + timeout
    delay = 50e-6
    while True:
        events = [e for e in events if not e.query()]
        if not events or time.monotonic() >= deadline or (abandoned is not None and abandoned()):
            return events
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)
