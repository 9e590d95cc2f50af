"""Whether an endpoint offers the ``nccl`` plane, on which device, and why (or why not).

An endpoint never starts CUDA itself: CPU-only users on GPU machines, and processes forked after
CUDA started, must not pay for or trip over it. So the device an NCCL link would use is the current
device of the thread that creates the endpoint, if that thread's process already uses CUDA then;
an endpoint created before its process used CUDA offers nccl from the first channel set up once
CUDA is in use (:meth:`NcclOffer.late`, on the event loop thread's current device). Loading NCCL
and probing its engine runs on a worker thread, once, and every outcome is logged with its reason.
Runs on the endpoint's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch

from .nccl_engine import LinkEngine, link_engine_probe

__all__ = ["NcclOffer", "current_cuda_device"]

log = logging.getLogger("transport.endpoint")


def current_cuda_device() -> int | None:
    """The calling thread's current CUDA device if this process already uses CUDA, else None
    (never starts CUDA)."""
    try:
        return torch.cuda.current_device() if torch.cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - e.g. a forked child of a CUDA process: no nccl here
        return None


class NcclOffer:
    """The ``nccl`` plane of one endpoint named ``name`` that allows ``planes``; ``factory`` is the
    endpoint's ``engines["nccl"]`` (None: NCCL on the CUDA device in use). :attr:`engine` is the link
    engine once offered (else None) and :attr:`reason` says why."""

    def __init__(self, name: str, planes: tuple[str, ...], factory: Callable[[], LinkEngine] | None) -> None:
        self._name = name
        self._planes = planes
        self._factory = factory
        self.engine: LinkEngine | None = None
        self.reason = "not probed yet (the endpoint is not open)"
        self._device = current_cuda_device() if "nccl" in planes and factory is None else None
        self._probe: asyncio.Future[tuple[LinkEngine | None, str]] | None = None  # see late()
        self._probe_device = 0

    def at_open(self) -> None:
        """Decide at the endpoint's ``open()`` (blocking: a probe loads NCCL; logged)."""
        if "nccl" in self._planes and self._factory is None and self._device is None:
            self.reason = ("CUDA was not in use in this process when the endpoint was created (call "
                           "torch.cuda.set_device(...) first to offer nccl)")
            log.info("endpoint %r does not offer the nccl plane: %s", self._name, self.reason)
        elif "nccl" in self._planes:
            self.engine, self.reason = link_engine_probe(self._factory, self._device)
            if self.engine is None:
                log.info("endpoint %r does not offer the nccl plane: %s", self._name, self.reason)
        else:
            self.reason = f"not allowed here (planes={self._planes})"

    def offered(self) -> list[str]:
        """The planes a Hello offers: those allowed, less nccl if it cannot be used."""
        return [p for p in self._planes if p != "nccl" or self.engine is not None]

    async def late(self, is_open: bool) -> None:
        """Before each handshake of an open endpoint (``is_open``): one created before its process
        used CUDA offers nccl from the first channel set up once CUDA is in use (probed once, on a
        worker thread; logged). Raises nothing but a cancellation."""
        if (self._device is not None or self._factory is not None or self.engine is not None
                or "nccl" not in self._planes or not is_open):
            return
        if self._probe is None:
            device = current_cuda_device()  # (a cheap check while CUDA is not in use)
            if device is None:
                return
            self._probe = asyncio.ensure_future(asyncio.to_thread(link_engine_probe, None, device))
            self._probe_device = device
        probe = self._probe
        try:
            engine, reason = await asyncio.shield(probe)
        except BaseException:
            if probe.done() and not probe.cancelled() and probe.exception() is not None and self._probe is probe:
                self._probe = None  # (no executor any more, at shutdown): a later handshake may try again
            raise
        if self._device is None:  # the first one back from the probe publishes it
            self._device = self._probe_device
            self.engine, self.reason = engine, reason
            if engine is None:
                log.info("endpoint %r does not offer the nccl plane: %s", self._name, reason)
            else:
                log.info("endpoint %r offers the nccl plane from now on (CUDA came into use after it was "
                         "created): %s", self._name, reason)
