"""What an endpoint offers its peers: its registry of named buffers, and each plane's export of them.

:class:`~transport.endpoint.Endpoint` hands ``register``, ``new_buffer`` and ``unregister`` to an
:class:`Exports`, which checks the tensor, keeps the :class:`~transport.registry.LocalRegistry`
and asks each plane's :class:`~transport.planes.Exporter` to export the buffer (``shm``: its
bytes in a memfd segment and a word in the slot table; ``cuda_ipc``: an IPC handle of its
allocation). The registry the endpoint sends its peers (:meth:`Exports.wire_registry`) carries
each exporter's handle in the exporter's own field. This module names no plane.

Before the endpoint opens, buffers are registered but not exported; :meth:`Exports.start`
exports them all. Every method runs on the thread that registers (the event loop's once the
endpoint is open) unless it says otherwise.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .errors import BufferMismatchError, InvalidTensorError
from .planes import Exporter
from .registry import BufferSpec, LocalBuffer, LocalRegistry, check_tensor, dtype_name
from .wire import WireBuffer

__all__ = ["UNHELD_WAIT_S", "Exports"]

log = logging.getLogger("transport.endpoint")

# how long unregister waits for peers' ops moving a buffer's bytes through a channel's stream (a tcp put's
# payload still arriving, a get's reply still being sent, a staged copy) before it breaks their channels
UNHELD_WAIT_S = 2.0
_WIRE_TRIES = 100  # snapshots wire_registry takes at most while the registry keeps changing under it


class Exports:
    """The registry of one endpoint and the exports of its buffers (see the module docstring)."""

    def __init__(self, exporters: list[Exporter]) -> None:
        self.registry = LocalRegistry()
        self.exporters = exporters
        self.live = False  # exports are made (the endpoint is open)

    def exporter(self, plane: str) -> Exporter | None:
        """The exporter of ``plane``, if that plane is allowed and exports anything."""
        return next((e for e in self.exporters if e.plane == plane), None)

    # ------------------------------------------------------------------ the registry
    def register(self, name: str, tensor: torch.Tensor) -> tuple[BufferSpec, bool]:
        """Check and register ``tensor`` as ``name``, exporting it if :attr:`live`. Returns its spec
        and whether the registry changed (the same tensor under the same name again is a no-op).
        Raises :class:`InvalidTensorError`, or :class:`BufferMismatchError` if the name is taken."""
        if not isinstance(name, str) or not name:
            raise InvalidTensorError(f"buffer names are non-empty strings, got {name!r}")
        check_tensor(name, tensor)
        buf = LocalBuffer(BufferSpec.of(name, tensor), tensor)
        old = self.registry.get(name)
        if old is not None:
            if old.tensor is tensor and old.spec == buf.spec:
                return old.spec, False
            raise BufferMismatchError(
                f"buffer {old.spec.describe()} is already registered; unregister it before registering "
                + (f"{buf.spec.describe()}" if old.spec != buf.spec else "another tensor under that name")
            )
        try:  # (an exporter that raises after another exported it: that export is undone too)
            if self.live:
                self._export(buf)
            else:
                buf.ptr = tensor.data_ptr()
            self.registry.add(buf)
        except BaseException:
            self._unexport(buf)
            raise
        return buf.spec, True

    def new_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
        """Register a new zero-filled tensor, in memory an exporter can share without a copy if one
        offers it (else ``torch.zeros``), and return it. ``device``: a CPU or CUDA device (None: the
        CPU). Same errors as :meth:`register`, and :class:`~transport.errors.InvalidTensorError`
        for a bad shape, dtype or device."""
        if not isinstance(dtype, torch.dtype) or any(not isinstance(d, int) or d < 0 for d in shape):
            raise InvalidTensorError(f"{name!r}: new_buffer needs a torch.dtype and a shape of ints >= 0, "
                                     f"got {dtype!r} and {shape!r}")
        try:
            device = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidTensorError(f"{name!r}: new_buffer: bad device {device!r}: {exc}") from exc
        if device.type not in ("cpu", "cuda"):
            raise InvalidTensorError(f"{name!r}: new_buffer makes CPU or CUDA buffers, not {device.type}")
        for exporter in self.exporters:
            tensor = exporter.new_buffer(name, shape, dtype, device)
            if tensor is not None:
                try:
                    self.register(name, tensor)
                except BaseException:
                    exporter.new_buffer_failed(tensor)
                    raise
                return tensor
        tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.register(name, tensor)
        return tensor

    def unregister(self, name: str, *, discard: bool = False, copy_back: bool = True) -> None:
        """Remove ``name`` (:class:`~transport.errors.UnknownBufferError` if absent) and undo its
        exports; see :meth:`transport.Endpoint.unregister` for what happens to the tensor (may
        block for a copy, and up to a plane's bound for peers' copies in flight)."""
        buf = self.registry.remove(name)
        # peers' ops whose bytes move through a channel's stream into or out of it (tcp, staged): wait for them,
        # then break the channels of those still running (their ops fail; none is reported done afterwards)
        held = self.registry.wait_unheld(buf, UNHELD_WAIT_S)
        if held:
            why = (f"buffer {name!r} was unregistered while an op of the peer still moved its bytes "
                   f"({UNHELD_WAIT_S:g} s later)")
            for hold in held:
                hold.revoke(why)
            if self.registry.wait_unheld(buf, UNHELD_WAIT_S):
                log.error("endpoint: buffer %r unregistered while a channel's thread still moves its bytes after "
                          "its channel was broken", name)
        live = [b.tensor for b in self.registry.snapshot()[1]]
        for exporter in self.exporters:
            if exporter.plane not in buf.exports:  # not exported (yet): memory new_buffer made for it, if unused
                exporter.forget_unexported(buf.tensor, live)
        if discard:
            t = buf.tensor
            with torch.no_grad():
                t.set_(torch.empty(0, dtype=t.dtype, device=t.device).untyped_storage(), 0, (0,), (1,))
        self._unexport(buf, detach=copy_back)

    def specs(self) -> dict[str, BufferSpec]:
        """The registered buffers' specs (a copy). Any thread."""
        return self.registry.specs()

    def wire_registry(self) -> tuple[int, list[WireBuffer]]:
        """The registry as peers are told it: its epoch and each buffer with every plane's handle.
        Any thread. The handles are read after the snapshot: an unregister on another thread
        between the two (it leaves the registry, bumping the epoch, then drops its exports) would
        describe the buffer without its exports under the older epoch, so the snapshot is taken
        again until the epoch held still (a peer told that got ``PlaneUnavailableError`` for an
        op racing the re-registration, instead of the stale buffer's typed error)."""
        for _ in range(_WIRE_TRIES):
            epoch, bufs = self.registry.snapshot()
            out = []
            for b in bufs:
                s = b.spec
                handles = {e.wire_field: e.handle(b) for e in self.exporters}
                out.append(WireBuffer(s.name, dtype_name(s.dtype), list(s.shape), s.device, s.nbytes, **handles))
            if self.registry.epoch == epoch:
                break
        return epoch, out

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """The endpoint opens: export every buffer registered so far, and every later one at once."""
        for buf in self.registry.snapshot()[1]:
            self._export(buf)
        self.live = True

    def tick(self) -> None:
        """Every heartbeat interval (event loop)."""
        bufs = self.registry.snapshot()[1]
        for exporter in self.exporters:
            exporter.tick(bufs)

    def close(self) -> None:
        """The endpoint closes: undo every export without waiting for peers, then let each
        exporter release what is left. The registered tensors stay valid for the caller."""
        self.live = False
        for buf in self.registry.snapshot()[1]:
            self._unexport(buf, closing=True)
        for exporter in self.exporters:
            exporter.close()

    # ------------------------------------------------------------------ peers that may map exports
    def watch(self, holder: str, epoch: int, pid: int | None) -> None:
        """``holder`` (process ``pid`` if on this host) may map exports of registries up to ``epoch``."""
        for e in self.exporters:
            e.watch(holder, epoch, pid)

    def forget(self, holder: str) -> None:
        """``holder`` never saw our registry (a handshake that failed early)."""
        for e in self.exporters:
            e.forget(holder)

    def acked(self, holder: str, epoch: int) -> None:
        """``holder`` confirmed registry ``epoch`` (reader thread)."""
        for e in self.exporters:
            e.acked(holder, epoch)

    def closed(self, holder: str, orderly: bool) -> None:
        """``holder``'s channel or handshake closed (``orderly``: the peer promised it was done)."""
        for e in self.exporters:
            e.closed(holder, orderly)

    # ------------------------------------------------------------------ one buffer
    def _export(self, buf: LocalBuffer) -> None:
        try:
            for exporter in self.exporters:
                exporter.export(buf)
        finally:  # (where one raised too: undoing the others' exports needs the tensor's address)
            buf.ptr = buf.tensor.data_ptr()

    def _unexport(self, buf: LocalBuffer, detach: bool = False, closing: bool = False) -> None:
        epoch = self.registry.epoch
        for exporter in reversed(self.exporters):  # (cuda_ipc's CPU stand-in exports through shm's segments)
            exporter.unexport(buf, detach=detach, closing=closing, epoch=epoch)

    def describe(self) -> dict[str, Any]:
        """Which exporters there are (for reports)."""
        return {e.plane: type(e).__name__ for e in self.exporters}
