"""Data planes and the one function that picks one per peer.

Only CPU planes exist in this build: ``shm`` (same host) and ``tcp`` (any host).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

from ..errors import PlaneUnavailableError
from ..wire import HostInfo
from .base import DataPlane
from .shm import ShmPlane
from .tcp import TcpPlane

__all__ = ["CPU_PLANES", "PLANES", "DataPlane", "choose_cpu_plane", "validate_planes"]

log = logging.getLogger(__name__)

# In order of preference.
CPU_PLANES: tuple[type[DataPlane], ...] = (ShmPlane, TcpPlane)
PLANES: dict[str, type[DataPlane]] = {p.name: p for p in CPU_PLANES}


def validate_planes(planes: Iterable[str] | None) -> tuple[str, ...]:
    """Normalise the ``planes=`` argument of an endpoint; ``ValueError`` if it names unknown planes."""
    if planes is None:
        return tuple(PLANES)
    out: tuple[str, ...] = tuple(planes) if not isinstance(planes, str) else ()
    if isinstance(planes, str) or not all(isinstance(p, str) for p in out):
        raise ValueError(f"planes must be a sequence of plane names such as ('tcp',), got {planes!r}")
    unknown = [p for p in out if p not in PLANES]
    if unknown or not out:
        raise ValueError(f"unknown planes {unknown or out!r}; known: {sorted(PLANES)}")
    return out


@functools.cache
def _probe(plane: type[DataPlane]) -> tuple[bool, str]:
    """A plane's probe, once per process (the machine does not change under us)."""
    return plane.probe()


def choose_cpu_plane(
    local: HostInfo, remote: HostInfo, mine: tuple[str, ...], theirs: tuple[str, ...]
) -> tuple[type[DataPlane], str]:
    """Pick the plane for CPU buffers of one peer; return it with the reason.

    The first plane (in preference order) that both endpoints allow, that
    works on this machine and that reaches the peer wins. Raises
    :class:`PlaneUnavailableError` listing why each plane was passed over.
    """
    why: list[str] = []
    for plane in CPU_PLANES:
        if plane.name not in mine:
            why.append(f"{plane.name}: not allowed here (planes={mine})")
            continue
        if plane.name not in theirs:
            why.append(f"{plane.name}: not allowed by the peer (planes={theirs})")
            continue
        ok, reason = _probe(plane)
        if not ok:
            why.append(f"{plane.name}: {reason}")
            continue
        ok, reason = plane.reaches(local, remote)
        if not ok:
            why.append(f"{plane.name}: {reason}")
            continue
        return plane, "; ".join([*why, f"{plane.name}: {reason}"])
    raise PlaneUnavailableError("no data plane reaches the peer: " + "; ".join(why))
