"""Data planes and the functions that pick one per peer.

CPU buffers: ``shm`` (same host) or ``tcp`` (any host), chosen by
:func:`choose_cpu_plane` when a channel is set up. GPU buffers: chosen by
:func:`choose_gpu_plane`, in the order ``cuda_ipc`` (same host: copies straight
into the peer's mapped device memory), ``nccl`` (the channel's own 2-rank NCCL
communicator, set up with the channel when both endpoints offer it), ``staged``
(any host; GPU bytes through host bounce buffers, inline on the channel's
socket). ``planes=`` of an endpoint names the planes it allows: at least one
CPU plane, plus ``cuda_ipc`` and/or ``nccl`` if GPU buffers may use them (None
allows all); the staged path needs nothing but the channel's socket and is
always available.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

from ..errors import PlaneUnavailableError
from ..hostinfo import same_host
from ..wire import HostInfo
from .base import DataPlane
from .shm import ShmPlane
from .tcp import TcpPlane

__all__ = ["CPU_PLANES", "GPU_PLANES", "PLANES", "DataPlane", "choose_cpu_plane", "choose_gpu_plane",
           "validate_planes"]

log = logging.getLogger(__name__)

# In order of preference.
CPU_PLANES: tuple[type[DataPlane], ...] = (ShmPlane, TcpPlane)
PLANES: dict[str, type[DataPlane]] = {p.name: p for p in CPU_PLANES}
# For GPU buffers, in order of preference.
GPU_PLANES: tuple[str, ...] = ("cuda_ipc", "nccl", "staged")
_ALLOWABLE = (*PLANES, "cuda_ipc", "nccl")  # what planes= may name


def validate_planes(planes: Iterable[str] | None) -> tuple[str, ...]:
    """Normalise the ``planes=`` argument of an endpoint; ``ValueError`` if it names unknown
    planes, or no CPU plane (every channel needs one for its CPU buffers)."""
    if planes is None:
        return _ALLOWABLE
    out: tuple[str, ...] = tuple(planes) if not isinstance(planes, str) else ()
    if isinstance(planes, str) or not all(isinstance(p, str) for p in out):
        raise ValueError(f"planes must be a sequence of plane names such as ('tcp',), got {planes!r}")
    unknown = [p for p in out if p not in _ALLOWABLE]
    if unknown or not out:
        raise ValueError(f"unknown planes {unknown or out!r}; known: {sorted(_ALLOWABLE)}")
    if not any(p in PLANES for p in out):
        raise ValueError(f"planes={out!r} names no CPU plane; name at least one of {sorted(PLANES)}")
    return tuple(dict.fromkeys(out))


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


def choose_gpu_plane(local: HostInfo, remote: HostInfo, mine: tuple[str, ...] = _ALLOWABLE,
                     theirs: tuple[str, ...] = _ALLOWABLE,
                     ipc_engine: tuple[bool, str] = (False, "no IPC engine"),
                     link: tuple[str, str] | None = None) -> tuple[str, str]:
    """Pick the plane for ops that touch GPU memory with one peer; return its name and the reason.

    Preference: ``cuda_ipc`` (same host, another process, both endpoints allow it, and this
    process has an IPC engine: ``ipc_engine`` is ``(available, why)``), then ``nccl`` (the
    channel's NCCL link, ``link`` = ``(state, why)``, is set up or being set up), then
    ``staged``. The reason says why each plane before the chosen one was passed over. Channels
    log the choice (again whenever the link comes up or goes down); ``peer.gpu_plane_reason``
    and the doctor show it. An op whose buffers do not suit the chosen plane still goes staged
    (logged once per reason).
    """
    same, where = same_host(local, remote)
    if not same:
        why = [f"cuda_ipc: the peer is not on this host ({where})"]
    elif local.pid == remote.pid:
        why = ["cuda_ipc: the peer is in this process (CUDA cannot map a process's own IPC handles)"]
    elif "cuda_ipc" not in mine:
        why = [f"cuda_ipc: not allowed here (planes={mine})"]
    elif "cuda_ipc" not in theirs:
        why = [f"cuda_ipc: not allowed by the peer (planes={theirs})"]
    elif not ipc_engine[0]:
        why = [f"cuda_ipc: {ipc_engine[1]}"]
    else:
        return "cuda_ipc", f"cuda_ipc: {where}; {ipc_engine[1]}"
    if link is not None and link[0] in ("pending", "ready"):
        return "nccl", "; ".join([*why, f"nccl: {link[1]}"])
    if link is not None:
        why.append(f"nccl: {link[1]}")
    elif "nccl" not in mine:
        why.append(f"nccl: not allowed here (planes={mine})")
    elif "nccl" not in theirs:
        why.append("nccl: the peer does not offer it (not allowed there, or no CUDA/NCCL there)")
    else:
        why.append("nccl: no NCCL link on this channel (this endpoint cannot use NCCL, or the peer is on this host "
                   "and both allow cuda_ipc)")
    why.append("staged: GPU bytes through host bounce buffers, inline on the channel's socket (tcp framing)")
    return "staged", "; ".join(why)
