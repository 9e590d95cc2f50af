"""``cuda_ipc``'s target side at registration: the endpoint's IPC engine, each buffer's export
(an IPC handle of its allocation), and the memory of unregistered exports held while a
same-host peer may still use it (:mod:`transport.planes.cuda_ipc_retention`).

The plane itself (the initiator side) is :mod:`transport.planes.cuda_ipc`; :mod:`transport.planes.cuda_ipc_engine`
explains the engines and why memory is retained.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..errors import PlaneUnavailableError
from ..registry import LocalBuffer
from ..wire import IpcHandle
from .base import Exporter
from .cuda_ipc_engine import IpcEngine, IpcExport, export_ids
from .cuda_ipc_retention import NEVER, Retention
from .shm_slots import ExportSlots

__all__ = ["IpcExporter", "ipc_engine_of"]

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
        self._making = threading.Lock()  # (the engine is made once, whichever thread asks first)
        self.retention = Retention(self._release)
        self.newest_export: int | None = None  # the newest export id made (None: none yet)
        # the words of this endpoint's cuda_ipc exports (one-sided puts and gets, as for shm's; a table
        # of its own, made at the first export; None where OFD locks are missing: ops keep their round trip)
        self.slot_table = ExportSlots(self.plane)

    @property
    def engine(self) -> IpcEngine | None:
        """The engine (made at the first use, by whichever thread asks first; None: see
        :attr:`reason`). A factory that raises raises here (and is asked again next time)."""
        self._make()
        return self._engine

    @property
    def reason(self) -> str:
        """Why there is (or is not) an engine."""
        self._make()
        return self._reason or ""

    def _make(self) -> None:
        if self._reason is None:
            with self._making:
                if self._reason is None:
                    self._engine, self._reason = self._make_engine()

    def status(self) -> tuple[bool, str]:
        """Whether there is an engine, and why. Never starts CUDA: with the default engine and CUDA
        not in use in this process yet, it says so and makes nothing. Any thread; raises nothing."""
        if self._reason is None and self.factory is None and not torch.cuda.is_initialized():
            return True, ("allowed; CUDA's IPC engine is made at the first CUDA buffer or op (CUDA is not in use "
                          "in this process yet)")
        try:
            engine = self.engine
        except Exception as exc:  # noqa: BLE001 - the user's factory: reported, not raised
            return False, f"the engine factory raised {type(exc).__name__}: {exc}"
        return engine is not None, self.reason

    def _make_engine(self) -> tuple[IpcEngine | None, str]:
        if self.factory is not None:
            engine = self.factory()
            return engine, f"engine {engine.name!r} (engines=)"
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
        table = self.slot_table.table()
        if table is not None:  # (an export revoked while a frozen peer's copy held it: wait for that copy)
            table.wait_clear(("cuda_ipc", str(t.device)), t.data_ptr(), t.data_ptr() + buf.spec.nbytes, buf.spec.name)
        try:
            device, handle, size, offset, keep = engine.export(t, self.segments)
        except PlaneUnavailableError as exc:
            log.warning("endpoint %r: buffer %r cannot be exported over cuda_ipc: %s; same-host peers reach it "
                        "through the staged path", self.endpoint, buf.spec.name, exc)
            return
        export_id = next(export_ids)
        slot = table.alloc(export_id) if table is not None else -1
        if slot > 0 and table is not None:
            ipc = IpcHandle(engine.name, device, handle, size, offset, export_id, table.pid, slot, table.fd,
                            table.inode)
        else:
            ipc = IpcHandle(engine.name, device, handle, size, offset, export_id)
        buf.exports["cuda_ipc"] = IpcExport(ipc, (t.untyped_storage(), keep))
        self.newest_export = ipc.export_id

    def unexport(self, buf: LocalBuffer, *, detach: bool, closing: bool, epoch: int) -> None:
        """Revoke the export's slot first (waiting up to
        :data:`~transport.planes.shm_slots.REVOKE_WAIT_S` for peers' copies in flight on it, unless
        ``closing``), so that no peer's one-sided op starts on it or is reported done after its
        copy overlapped this; the memory is then held until every same-host peer confirmed it
        unmapped (see :mod:`transport.planes.cuda_ipc_retention`)."""
        ipc = buf.exports.pop("cuda_ipc", None)
        if ipc is not None:
            h = ipc.handle
            table = self.slot_table.made
            if h.slot and table is not None:  # (the memory may be exported again, a view of it registered: marked)
                table.revoke(h.slot, buf.spec.name, not closing,
                             (("cuda_ipc", str(buf.tensor.device)), buf.ptr, buf.ptr + buf.spec.nbytes))
            self.retention.retire(h.export_id, ipc.keep, NEVER if closing else epoch)

    def tick(self, bufs: list[LocalBuffer]) -> None:
        """Registered tensors re-pointed at other memory since registration: peers' one-sided ops
        carry no header for this endpoint to check, so their slots are marked (every heartbeat
        interval) and peers' later ops fail with :class:`~transport.errors.BufferMismatchError`,
        as a header op's would."""
        self.slot_table.mark_re_pointed(self.endpoint, bufs)

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
        self.slot_table.close()
        self.retention.shutdown(self.newest_export)  # live peers may still write: held until they exit


def ipc_engine_of(core: Any) -> tuple[IpcEngine | None, str]:
    """The ``cuda_ipc`` engine of endpoint ``core`` (None where there is none) and why: its
    :class:`IpcExporter`'s (the engine is made at the first ask), or none where the endpoint does
    not allow the plane."""
    exporter = core.exporter(IpcExporter.plane)
    if exporter is None:
        return None, f"not allowed here (planes={core.planes})"
    return exporter.engine, exporter.reason
