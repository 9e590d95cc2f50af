"""The ``torch.distributed.Work`` of one transfer that runs on the backend's event loop."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import Work
from torch.distributed._transport._work import _validate_timeout

__all__ = ["TransportRLWork"]

_ENDED = threading.Event()  # the shared "ended" of Works whose transfer ended before they were returned
_ENDED.set()
_NOT_YET = threading.Event()  # (never set: a Work is returned only once attached to its transfer, or ended)


class TransportRLWork(Work):
    """One read or write: completed (successfully or not) once the endpoint's put or get ended.

    ``wait(timeout)`` blocks at most ``timeout`` (``timedelta(0)``: the timeout the transfer was
    submitted with) and raises ``TimeoutError`` when it passes; the transfer goes on, and this
    Work keeps its buffers until it ends. A failed transfer's error is raised by ``wait`` and
    set on the future. ``get_future()`` resolves to ``[]`` on success; its callbacks run on the
    backend's loop thread, or, for a Work returned completed (a transfer the caller's thread did
    itself: ``TransportRL._now``), at once on the thread that adds them. Thread-safe.
    """

    def __init__(self, buffers: tuple[Any, ...], timeout: float, on_done: Callable[[TransportRLWork], None]) -> None:
        super().__init__()
        self._timeout = timeout  # (validated by the transport)
        self._buffers: tuple[Any, ...] | None = buffers  # retained until the transfer ended
        self._on_done: Callable[[TransportRLWork], None] | None = on_done
        self._error: BaseException | None = None
        # set once the transfer ended: its own event for a transfer on the loop (_attach), the shared set
        # one for a transfer that ended before the Work was returned (_end_now: no event made per op)
        self._done: threading.Event = _NOT_YET
        self._future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()

    def _attach(self, fut: concurrent.futures.Future[Any]) -> None:
        """The transfer runs on the loop as ``fut``; the Work ends when it does."""
        self._done = threading.Event()
        fut.add_done_callback(self._settle)

    def _settle(self, fut: concurrent.futures.Future[Any] | None) -> None:
        if fut is not None:
            if fut.cancelled():
                self._error = RuntimeError("the transfer was cancelled: its event loop stopped")
            else:
                self._error = fut.exception()
        on_done = self._on_done
        if on_done is not None:
            on_done(self)
        self._buffers = None  # (a Work the caller keeps does not keep the registration's memory)
        if self._done is _NOT_YET:
            self._done = _ENDED
        else:
            self._done.set()
        error = self._error
        if error is None:
            self._future.set_result([])
        else:
            failure = error if isinstance(error, Exception) else RuntimeError(str(error))
            self._future.set_exception(failure)  # type: ignore[arg-type]  # (torch stubs type it as the result)

    def _end_now(self, error: BaseException | None) -> None:
        """The transfer ended on the submitting thread before this Work was returned (the
        backend's fast path, never handed to the loop: nothing to tell the transport), with
        ``error``."""
        self._error = error
        self._on_done = None
        self._settle(None)

    def _wait(self, seconds: float) -> None:
        if not self._done.wait(seconds):
            raise TimeoutError("transport wait timed out; operation remains pending")
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        """Whether the transfer ended. Non-blocking; one that has not yet ended yields the GIL once
        (``time.sleep(0)``): the transfer runs on this backend's loop thread, in this process, and a
        caller polling in a tight loop would otherwise starve it for a whole switch interval (5 ms)."""
        if self._done.is_set():
            return True
        time.sleep(0)
        return self._done.is_set()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds()
        _validate_timeout(seconds)
        self._wait(seconds or self._timeout)
        return True

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return []

    def synchronize(self) -> None:
        self.wait()
