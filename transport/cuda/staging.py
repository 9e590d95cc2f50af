"""The CUDA copy engine of the staged path (:mod:`transport.staging`): dedicated streams per
device (one for device->host, one for host->device, so a channel's outgoing and incoming
payloads can use both copy engines at once), pinned bounce buffers, completion observed through
CUDA events.

Only this module touches CUDA for staging; the pipeline's logic (chunking, ordering, bounded
memory, errors) is :mod:`transport.bounce`'s (the engine interface: :mod:`transport.copy_engine`)
and is tested on CPU with a thread engine.

Ordering: :meth:`CudaCopyEngine.mark` records a blocking-sync event on the *caller's* current
stream when the op is issued (in the caller's thread); the staged plane awaits it on the event loop
(a :class:`~transport.completion.CompletionBridge`) before the op reaches the channel, so a put sees
the tensor as the caller's stream had it at the call, and a get never writes into memory the
caller's stream is still using. Its copies are then issued with ``after=None``: the dedicated
streams, shared by every channel, never wait on an application's stream (``copy(after=...)`` still
orders a copy after an event, for direct users of the pipeline). Work on other streams must be synchronized by the
caller before the call. (The caller's thread is the one running the event loop; with a
``BlockingEndpoint`` that is not the application's thread.)

Blocking: :meth:`CudaCopyHandle.wait` polls the copy's event (never ``synchronize()``) until it
has completed or the bound passes (:class:`~transport.errors.StagingError`); CUDA errors surface
there as :class:`StagingError` too.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ..errors import StagingError

__all__ = ["CudaCopyEngine", "CudaCopyHandle", "StreamMark", "cuda_engine"]


class CudaCopyHandle:
    """One copy on the engine's stream: an event recorded right behind it."""

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def done(self) -> bool:
        try:
            return bool(self._event.query())
        except RuntimeError:  # finished, with an error
            return True

    def wait(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        delay = 1e-5
        try:
            while not self._event.query():
                if time.monotonic() >= end:
                    raise StagingError(f"a staged CUDA copy did not complete within {timeout:g} s")
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
        except RuntimeError as exc:  # a CUDA error reported through the event
            raise StagingError(f"a staged CUDA copy failed: {exc}") from exc


class StreamMark:
    """A caller's mark: the event recorded on its current stream, and that stream (``stream``: its
    handle), so that marks of different streams are awaited independently."""

    __slots__ = ("event", "stream")

    def __init__(self, event: torch.cuda.Event, stream: int) -> None:
        self.event = event
        self.stream = stream

    def query(self) -> bool:
        return bool(self.event.query())

    def synchronize(self) -> None:
        self.event.synchronize()


class CudaCopyEngine:
    """Copies between one CUDA device and pinned host memory on dedicated streams."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device=device)
        self.h2d = torch.cuda.Stream(device=device)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def mark(self) -> Any:
        stream = torch.cuda.current_stream(self.device)
        event = torch.cuda.Event(blocking=True)  # awaited by a CompletionBridge thread: sleeps, no spin
        event.record(stream)
        return StreamMark(event, stream.cuda_stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> CudaCopyHandle:
        after = after.event if isinstance(after, StreamMark) else after
        stream = self.h2d if dst.device.type == "cuda" else self.d2h
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return CudaCopyHandle(event)


_engines: dict[int, CudaCopyEngine] = {}
_lock = threading.Lock()


def cuda_engine(device: torch.device) -> CudaCopyEngine:
    """The process's engine for ``device`` (created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        engine = _engines.get(index)
        if engine is None:
            engine = _engines[index] = CudaCopyEngine(torch.device("cuda", index))
        return engine
