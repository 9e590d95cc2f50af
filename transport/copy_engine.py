"""The staged path's copy engines: the interface (:class:`CopyEngine`, :class:`CopyHandle`) and the CPU engine.

A copy engine issues asynchronous copies between a device and host bounce buffers and lets the
pipeline (:mod:`transport.bounce`) wait for each one with a bound. The CUDA engine (dedicated
streams, events, pinned memory) lives in :mod:`transport.cuda.staging`; :class:`ThreadCopyEngine`
runs copies on one worker thread of its own (``transport-stage-copy``), in issue order, and is what
the CPU tests drive the same pipeline with. ``mark`` runs in the caller's thread; ``copy`` never
blocks; :meth:`CopyHandle.wait` blocks its caller (the channel's reader or writer) for at most its
bound.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Protocol

import torch

from .errors import StagingError

__all__ = ["CopyEngine", "CopyHandle", "ThreadCopyEngine"]


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
