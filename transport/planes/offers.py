"""What one endpoint offers of its planes: ``PlaneOffers``.

An endpoint (and its connector) holds one and names no plane: the planes that take an engine
(``Endpoint(engines={plane: factory})``: :data:`ENGINE_PLANES`), the exporters of its buffers
(:func:`~transport.planes.choice.make_exporters`), the planes its Hello offers, and the engine of
the plane that gives a channel a link of its own (``nccl``: :class:`~transport.planes.nccl_offer.NcclOffer`)
are all decided here. Runs on the endpoint's event loop, except :meth:`PlaneOffers.status` (any thread).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .base import Exporter, PeerLink
from .choice import PLANES, STAGED, make_exporters, make_link, wants_link
from .nccl_offer import NcclOffer

__all__ = ["ENGINE_PLANES", "PlaneOffers", "check_engines"]

# The planes that take an engine, and what its factory makes: ``cuda_ipc`` an
# :class:`transport.planes.cuda_ipc_engine.IpcEngine` (default: CUDA's; ``transport.planes.cuda_ipc_memfd.MemfdIpcEngine``
# runs the protocol on CPU shared memory), ``nccl`` a :class:`transport.planes.LinkEngine`
# (default: NCCL on the CUDA device in use; ``transport.planes.SocketLinkEngine`` runs it over a socket).
ENGINE_PLANES: tuple[str, ...] = ("cuda_ipc", "nccl")
_LINK_PLANE = "nccl"  # the plane whose engine gives each channel a link (PlaneOffers.link_for)


def check_engines(engines: Mapping[str, Callable[[], Any] | None] | None) -> dict[str, Callable[[], Any]]:
    """``engines=`` of an endpoint as a dict (a None factory: the plane's default); ``ValueError``
    for a plane that takes no engine or a factory that is not callable."""
    if engines is None:
        return {}
    if not isinstance(engines, Mapping):
        raise ValueError(f"engines must map a plane's name to a zero-argument factory of its engine, got "
                         f"{type(engines).__name__}")
    out: dict[str, Callable[[], Any]] = {}
    for plane, factory in engines.items():
        if plane not in ENGINE_PLANES:
            raise ValueError(f"engines: plane {plane!r} takes no engine (those that do: {', '.join(ENGINE_PLANES)})")
        if factory is not None and not callable(factory):
            raise ValueError(f"engines[{plane!r}] must be a zero-argument factory of the plane's engine, got {factory!r}")
        if factory is not None:  # (None: the plane's default)
            out[plane] = factory
    return out


class PlaneOffers:
    """The planes of endpoint ``endpoint`` that allows ``planes`` (validated), with ``engines``
    (see :func:`check_engines`). :attr:`exporters` go to the endpoint's Exports."""

    def __init__(self, endpoint: str, planes: tuple[str, ...],
                 engines: Mapping[str, Callable[[], Any] | None] | None = None) -> None:
        factories = check_engines(engines)
        self.planes = planes
        self.exporters: list[Exporter] = make_exporters(endpoint, planes, [], factories.get("cuda_ipc"))
        self._link = NcclOffer(endpoint, planes, factories.get(_LINK_PLANE))

    def at_open(self) -> None:
        """At the endpoint's ``open()`` (blocking: probing a link engine may load a library; logged)."""
        self._link.at_open()

    async def late(self, is_open: bool) -> None:
        """Before each handshake: a plane that could not be offered at open may be offered now (the
        process started using CUDA since). Raises nothing but a cancellation."""
        await self._link.late(is_open)

    def offered(self) -> list[str]:
        """The planes a Hello offers: those allowed, less those that cannot be used here."""
        return self._link.offered()

    def link_for(self, channel: Any, offered: list[str], theirs: list[str] | tuple[str, ...], same_host_peer: bool, *,
                 dialer: bool, timeout: float) -> PeerLink | None:
        """``channel``'s own link, or None: both Hellos (``offered``: ours, ``theirs``) decide alike on
        both sides (:func:`~transport.planes.choice.wants_link`), and only an endpoint with a link
        engine makes one."""
        if self._link.engine is None or not wants_link(offered, theirs, same_host_peer):
            return None
        return make_link(channel, self._link.engine, dialer=dialer, timeout=timeout)

    def status(self, plane: str) -> tuple[bool, str]:
        """Whether this endpoint offers ``plane`` to its peers, and why (or why not). May make the
        plane's engine (a ``cuda_ipc`` engine is made at its first use; never CUDA's while CUDA is not in use
        here); raises only ``ValueError``, for an unknown plane (a factory that raises is reported)."""
        if not isinstance(plane, str):
            raise ValueError(f"a plane's name is a str, got {type(plane).__name__}")
        if plane == STAGED:
            return True, "always available: GPU bytes through host bounce buffers over the channel's socket"
        if plane not in PLANES and plane not in ENGINE_PLANES:
            raise ValueError(f"unknown plane {plane!r} (planes: {', '.join((*PLANES, *ENGINE_PLANES, STAGED))})")
        if plane not in self.planes:
            return False, f"not allowed here (planes={self.planes})"
        if plane == _LINK_PLANE:
            return self._link.engine is not None, self._link.reason
        for exporter in self.exporters:
            if exporter.plane == plane:
                return exporter.status()
        return True, "allowed"
