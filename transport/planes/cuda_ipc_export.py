"""``cuda_ipc``'s target side at registration: the endpoint's IPC engine, each buffer's export
(an IPC handle of its allocation), and the memory of unregistered exports held while a
same-host peer may still use it (:mod:`transport.retention`).

The plane itself (the initiator side) is :mod:`transport.planes.cuda_ipc`; :mod:`transport.ipc`
explains the engines and why memory is retained.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..errors import PlaneUnavailableError
from ..ipc import IpcEngine, IpcExport, export_ids
from ..registry import LocalBuffer
from ..retention import NEVER, Retention
from ..wire import IpcHandle
from .base import Exporter

__all__ = ["IpcExporter"]

log = logging.getLogger(__name__)


class IpcExporter(Exporter):
    """``cuda_ipc``'s :class:`~transport.planes.base.Exporter`. The engine is made at first use
    (:attr:`engine`): ``factory()`` if given (a CPU stand-in such as
    :class:`~transport.planes.cuda_ipc_memfd.MemfdIpcEngine`), else CUDA's; :attr:`reason` says which, or
    why there is none. ``segments``: the endpoint's memfd segments (a stand-in engine exports CPU
    tensors through them)."""

    plane = "cuda_ipc"
    wire_field = "ipc"

    def __init__(self, endpoint: str, segments: list[Any], factory: Callable[[], IpcEngine] | None) -> None:
        self.endpoint = endpoint
        self.segments = segments
        self.factory = factory
        self._engine: IpcEngine | None = None
        self._reason: str | None = None
        self.retention = Retention(self._release)
        self.newest_export: int | None = None  # the newest export id made (None: none yet)

    @property
    def engine(self) -> IpcEngine | None:
        """The engine (made at the first use; None: see :attr:`reason`)."""
        if self._reason is None:
            self._engine, self._reason = self._make_engine()
        return self._engine

    @property
    def reason(self) -> str:
        """Why there is (or is not) an engine."""
        if self._reason is None:
            self._engine, self._reason = self._make_engine()
        return self._reason

    def _make_engine(self) -> tuple[IpcEngine | None, str]:
        if self.factory is not None:
            engine = self.factory()
            return engine, f"engine {engine.name!r} (ipc_engine=)"
        try:
            from ..cuda.ipc import cuda_ipc_engine
        except ImportError as exc:  # a torch without CUDA bindings
            return None, f"the CUDA IPC engine cannot be imported: {exc}"
        return cuda_ipc_engine()

    def export(self, buf: LocalBuffer) -> None:
        t = buf.tensor
        if "cuda_ipc" in buf.exports or not buf.spec.nbytes:
            return
        if not t.is_cuda and self.factory is None:  # (no CUDA engine for a CPU tensor)
            return
        engine = self.engine
        if engine is None or not engine.handles(t):
            return
        try:
            device, handle, size, offset, keep = engine.export(t, self.segments)
        except PlaneUnavailableError as exc:
            log.warning("endpoint %r: buffer %r cannot be exported over cuda_ipc: %s; same-host peers reach it "
                        "through the staged path", self.endpoint, buf.spec.name, exc)
            return
        ipc = IpcHandle(engine.name, device, handle, size, offset, next(export_ids))
        buf.exports["cuda_ipc"] = IpcExport(ipc, (t.untyped_storage(), keep))
        self.newest_export = ipc.export_id

    def unexport(self, buf: LocalBuffer, *, detach: bool, closing: bool, epoch: int) -> None:
        """Held until every same-host peer confirmed it unmapped (see :mod:`transport.retention`)."""
        ipc = buf.exports.pop("cuda_ipc", None)
        if ipc is not None:
            self.retention.retire(ipc.handle.export_id, ipc.keep, NEVER if closing else epoch)

    def new_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor | None:
        """A CUDA buffer of its own driver allocation (``cuMemAlloc``), which CUDA IPC can export
        whatever torch's allocator is set to (CUDA's engine only)."""
        if device.type != "cuda" or self.factory is not None or not torch.Size(shape).numel():
            return None
        from ..cuda.ipc import exportable_zeros

        return exportable_zeros(shape, dtype, device)

    def _release(self, keep: Any) -> None:
        _storage, engine_keep = keep
        if self._engine is not None and engine_keep is not None:
            self._engine.release(engine_keep)

    def watch(self, holder: str, epoch: int, pid: int | None) -> None:
        self.retention.watch(holder, epoch, pid)

    def forget(self, holder: str) -> None:
        self.retention.forget(holder)

    def acked(self, holder: str, epoch: int) -> None:
        self.retention.acked(holder, epoch)

    def closed(self, holder: str, orderly: bool) -> None:
        self.retention.closed(holder, None if orderly else self.newest_export)

    def close(self) -> None:
        self.retention.shutdown(self.newest_export)  # live peers may still write: held until they exit
