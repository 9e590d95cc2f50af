"""Which plane each op of a channel takes, and why: :class:`PlaneChoice` (one per channel).

CPU buffers on both sides take the channel's CPU plane (``shm`` or ``tcp``, chosen at the
handshake). An op touching GPU memory on either side takes this peer's GPU plane
(:func:`~transport.planes.choose_gpu_plane`: ``cuda_ipc``, ``nccl`` or the staged path), decided on
the first such op and again whenever the NCCL link comes up or goes down; an op the chosen plane
cannot take (a buffer without an export, a tensor on another device than the link's) is staged,
and the reason is logged once per reason and kept in :attr:`PlaneChoice.last_refusal`. The GPU
planes are made on their first op. This module is the only one outside a plane's own that names
concrete planes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..errors import PeerLostError, PlaneUnavailableError, StaleBufferError
from ..hostinfo import local_host, same_host
from ..registry import BufferSpec
from ..wire import HostInfo, Item
from .base import ChannelPort, DataPlane, Exporter, PeerLink
from .cuda_ipc_export import IpcExporter, ipc_engine_of
from .shm import ShmPlane
from .shm_export import ShmExporter
from .tcp import TcpPlane

if TYPE_CHECKING:
    from .cuda_ipc import CudaIpcPlane
    from .nccl import NcclPlane
    from .staged import StagedPlane

__all__ = ["CPU_PLANES", "GPU_PLANES", "PLANES", "STAGED", "ChoosingChannel", "PlaneChoice",
           "choose_cpu_plane", "choose_gpu_plane", "make_exporters", "make_link", "needs_unmap_acks", "plane_features",
           "validate_planes",
           "wants_link"]

log = logging.getLogger(__name__)


# In order of preference.
CPU_PLANES: tuple[type[DataPlane], ...] = (ShmPlane, TcpPlane)
PLANES: dict[str, type[DataPlane]] = {p.name: p for p in CPU_PLANES}
# For GPU buffers, in order of preference.
GPU_PLANES: tuple[str, ...] = ("cuda_ipc", "nccl", "staged")
_ALLOWABLE = (*PLANES, "cuda_ipc", "nccl")  # what planes= may name
STAGED = "staged"  # the staged path's name in records and reports (GPU bytes through bounce buffers)


def wants_link(ours: Sequence[str], theirs: Sequence[str], same_host_peer: bool) -> bool:
    """Whether a channel gets an NCCL link, decided alike on both sides from both Hellos' planes
    (``ours``: what our Hello offered): both offer nccl, and they are not two same-host
    endpoints that both allow cuda_ipc (which then carries their GPU bytes)."""
    if "nccl" not in ours or "nccl" not in theirs:
        return False
    return not ("cuda_ipc" in ours and "cuda_ipc" in theirs and same_host_peer)


def needs_unmap_acks(ours: Sequence[str], theirs: Sequence[str], same_host_other_process: bool) -> bool:
    """Whether a same-host peer in another process confirms each registry update (``Unmapped``):
    both allow cuda_ipc, so it may map our exports, and the owner of an unregistered export holds
    its memory until the peer confirmed (:class:`transport.planes.cuda_ipc_retention.Retention`)."""
    return "cuda_ipc" in ours and "cuda_ipc" in theirs and same_host_other_process


def make_exporters(endpoint: str, planes: tuple[str, ...], segments: list[Any],
                   ipc_engine: Any = None) -> list[Exporter]:
    """The :class:`~transport.planes.base.Exporter` of each plane in ``planes`` that exports
    buffers at registration, in the order they export (``shm`` first: ``cuda_ipc``'s CPU stand-in
    exports CPU tensors through the segments ``shm`` made). ``segments``: the endpoint's memfd
    segments, shared by both; ``ipc_engine``: the endpoint's ``engines["cuda_ipc"]`` factory."""
    out: list[Exporter] = []
    if "shm" in planes:
        out.append(ShmExporter(endpoint, segments))
    if "cuda_ipc" in planes:
        out.append(IpcExporter(endpoint, segments, ipc_engine))
    return out


def make_link(channel: Any, engine: Any, *, dialer: bool, timeout: float) -> PeerLink:
    """The ``nccl`` plane's link for ``channel`` (:class:`transport.planes.nccl_link.Link`) over the
    endpoint's link ``engine``: the connector makes one per channel that :func:`wants_link`; its
    module is imported only here, when one is made."""
    from .nccl_link import Link

    return Link(channel, engine, dialer=dialer, timeout=timeout)


def plane_features(name: str) -> dict[str, tuple[bool, str]]:
    """The optional features of plane ``name`` on this machine, ``feature -> (have, why)`` (its
    class's :meth:`~transport.planes.base.DataPlane.features`; a GPU plane's module is imported
    only here, when asked). Raises ``KeyError`` for a name that is no plane."""
    if name in PLANES:
        return PLANES[name].features()
    if name == "cuda_ipc":
        from .cuda_ipc import CudaIpcPlane

        return CudaIpcPlane.features()
    if name == "nccl":
        from .nccl import NcclPlane

        return NcclPlane.features()
    raise KeyError(name)


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


class ChoosingChannel(ChannelPort, Protocol):
    """What the choice reads of its channel beyond what planes do."""

    id: str
    plane: DataPlane  # the channel's CPU plane
    plane_reason: str
    host: HostInfo  # the peer's
    remote_planes: tuple[str, ...]


class PlaneChoice:
    """The planes of one channel beyond its CPU plane, and the choice among them per op (event
    loop, except :meth:`quiesce` and :meth:`close`: any thread)."""

    def __init__(self, channel: ChoosingChannel) -> None:
        self.ch = channel
        self._staged: StagedPlane | None = None  # ops touching GPU memory (created on the first)
        self._staged_of: dict[str, BufferSpec] | None = None  # the peer_specs _staged_names was computed from
        self._staged_shm: DataPlane | None = None  # shm ops whose tensors here are staged
        self._staged_names: frozenset[str] = frozenset()  # the peer's buffers not in CPU memory (on GPUs)
        self._ipc_names: frozenset[str] = frozenset()  # the peer's buffers with a cuda_ipc export
        self._ipc: CudaIpcPlane | None = None  # ops over cuda_ipc (created on the first)
        self._refused: set[str] = set()  # reasons already logged for ops that could not use the GPU plane
        self.last_refusal = ""  # why the latest op that could not use the GPU plane was staged
        self._nccl: NcclPlane | None = None
        self._bye = False  # say_bye ran: no new cuda_ipc plane (its copies were quiesced)
        self.gpu_plane: str | None = None  # the plane for GPU buffers and why (decided on the first such op)
        self.gpu_plane_reason: str | None = None

    def plane_for(self, pairs: Sequence[tuple[Item, torch.Tensor]]) -> DataPlane:
        """The plane for one op (event loop). CPU memory on both sides: the channel's plane.
        GPU memory on either side: the GPU plane of this peer (see :meth:`gpu_plane_choice`):
        ``cuda_ipc`` when it was chosen and every buffer of the op has an export this process
        can map (else the reason is logged once and the op is staged), otherwise the staged
        path, except that a GPU tensor of ours meeting the peer's CPU buffers over ``shm`` goes
        through our bounce buffers straight into (or out of) the peer's mapped segments
        (:class:`~transport.planes.shm.StagedShmPlane`). A peer's GPU buffer is never in shared
        memory, so staged ops on one travel inline on this channel's socket."""
        self.last_refusal = ""
        specs = self.ch.peer_specs  # replaced whole by the reader on a registry update
        if specs is not self._staged_of:
            wire = self.ch.remote_wire
            cfg = self.ch.staging.config
            cpu_too = cfg.cpu_engine is not None and cfg.cpu_engine_peers  # (tests: see StagingConfig)
            self._staged_names = frozenset(n for n, sp in specs.items() if sp.device != "cpu" or cpu_too)
            self._ipc_names = frozenset(n for n, wb in wire.items() if wb.ipc is not None)
            self._staged_of = specs
        remote = local = ipc = False
        if self._staged_names:  # plain loops: this runs for every op
            for it, _ in pairs:
                if it.name in self._staged_names:
                    remote = True
                    break
        if self._ipc_names:
            for it, _ in pairs:
                if it.name in self._ipc_names:
                    ipc = True
                    break
        if self.ch.staging.config.cpu_engine is not None:
            local = True
        else:
            for _, t in pairs:
                if t.is_cuda:
                    local = True
                    break
        cpu_link = False  # CPU buffers only, offered to a link engine on CPU memory
        if not (remote or local):
            link = self.ch.link
            if link is not None and link.engine.device == "cpu" and link.state != "down":
                local = cpu_link = True  # a link engine on CPU memory (tests: SocketLinkEngine) moves CPU buffers
            elif not ipc:
                return self.ch.plane
        self._choose_gpu_plane()
        if self.gpu_plane == "nccl" and (remote or local):
            if self._usable("nccl", self._nccl_refusal(pairs)):
                if self._nccl is None:
                    from .nccl import NcclPlane

                    self._nccl = NcclPlane(self.ch)
                return self._nccl
        if cpu_link and not ipc:  # the link went down (another thread) since the look above: CPU bytes take our plane
            return self.ch.plane
        if self.gpu_plane == "cuda_ipc" and (remote or ipc):
            if self._usable("cuda_ipc", self._ipc_refusal(pairs)):
                return self._ipc_plane()
        if cpu_link or not (remote or local):  # (CPU buffers that neither stand-in engine took)
            return self.ch.plane
        if not remote and not self.ch.plane.inline_payload:  # the peer's buffers are in its shm segments
            for _, t in pairs:
                if self.ch.staging.stages(t.device):  # through our pinned bounce buffers, into the segments
                    if self._staged_shm is None:
                        self._staged_shm = self.ch.plane.staged_twin()
                    if self._staged_shm is not None:
                        return self._staged_shm
                    break
            return self.ch.plane
        if self._staged is None:
            from .staged import StagedPlane

            self._staged = StagedPlane(self.ch)
        return self._staged

    def own_plane_now(self, pairs: Sequence[tuple[Item, torch.Tensor]]) -> DataPlane | None:
        """The channel's own plane if :meth:`plane_for` gives it to ``pairs`` with nothing to decide
        (CPU tensors here, CPU buffers there, no link or stand-in engine that could take them);
        None otherwise. Any thread: it reads the channel's state and changes nothing."""
        ch = self.ch
        if ch.link is not None or ch.staging.config.cpu_engine is not None:
            return None
        specs, wire = ch.peer_specs, ch.remote_wire  # (each replaced whole on a registry update)
        for it, t in pairs:
            spec, wb = specs.get(it.name), wire.get(it.name)
            if not t.is_cpu or spec is None or spec.device != "cpu" or (wb is not None and wb.ipc is not None):
                return None
        return ch.plane

    def reason_for(self, plane: DataPlane) -> str:
        """Why an op that :meth:`plane_for` gave ``plane`` takes it (event loop)."""
        if plane is self.ch.plane:
            return self.ch.plane_reason
        if plane is self._staged_shm:
            return (f"a GPU tensor here with the peer's CPU buffer: through this side's bounce buffers into its "
                    f"{self.ch.plane.name} segment")
        if plane.name == self.gpu_plane:
            return self.gpu_plane_reason or ""
        refused = f"; {self.last_refusal}" if self.last_refusal else ""
        return f"GPU buffers with this peer use {self.gpu_plane} ({self.gpu_plane_reason}){refused}"

    def _choose_gpu_plane(self) -> None:
        if self.gpu_plane is not None:
            return
        self.gpu_plane, self.gpu_plane_reason = self.gpu_plane_choice()
        log.info("channel %s: ops on GPU buffers with %r use %s: %s%s", self.ch.id, self.ch.peer_name, self.gpu_plane,
                 self.gpu_plane_reason,
                 "" if self.ch.plane.inline_payload or self.gpu_plane == "cuda_ipc" else
                 f" (the channel's CPU plane is {self.ch.plane.name}, but a peer's GPU buffer is never in shared "
                 "memory: ops on one travel inline on the channel's socket; a GPU tensor of ours put into or "
                 "read from a CPU buffer of the peer goes through our bounce buffers into or out of its "
                 f"{self.ch.plane.name} segment)")

    def _ipc_plane(self) -> DataPlane:
        if self._ipc is None:
            if self._bye:
                raise PeerLostError(f"channel to {self.ch.peer_name!r} is closing")
            from .cuda_ipc import CudaIpcPlane

            self._ipc = CudaIpcPlane(self.ch)
        return self._ipc

    def map_plane(self, name: str) -> tuple[DataPlane, str]:
        """The plane that aliases the peer's buffer ``name`` in this process
        (:meth:`transport.Endpoint.map`), and why (event loop): ``cuda_ipc`` for a buffer the peer
        exports through its IPC engine (every GPU buffer; CPU ones too with a CPU stand-in engine)
        when that is this peer's GPU plane, else the channel's own plane for a CPU buffer if it
        maps peer memory (``shm``). Raises :class:`PlaneUnavailableError` saying why none can."""
        spec = self.ch.peer_specs.get(name)
        if spec is None:
            raise StaleBufferError(f"{self.ch.peer_name!r} has no buffer {name!r} any more")
        wb = self.ch.remote_wire.get(name)
        if wb is not None and wb.ipc is not None:
            self._choose_gpu_plane()
            if self.gpu_plane == "cuda_ipc":
                engine, _ = ipc_engine_of(self.ch.core)
                if engine is None:
                    why: str | None = "no IPC engine here"
                else:
                    from .cuda_ipc_engine import mapping_cache

                    why = engine.reachable(wb.ipc) or mapping_cache(engine).refusal(wb.ipc)
                if why is None:
                    return self._ipc_plane(), f"cuda_ipc: {self.gpu_plane_reason}"
                raise PlaneUnavailableError(f"{name!r} cannot be mapped over cuda_ipc: {why}")
            if spec.device != "cpu":
                raise PlaneUnavailableError(
                    f"{name!r} is on {spec.device} and GPU buffers with {self.ch.peer_name!r} use {self.gpu_plane} "
                    f"({self.gpu_plane_reason}): mapping a GPU buffer needs cuda_ipc (a peer on this host)")
        if spec.device != "cpu":
            raise PlaneUnavailableError(f"{name!r} is on {spec.device} and the peer exports no CUDA IPC handle for "
                                        "it: only CPU buffers (over shm) and exported GPU buffers (over cuda_ipc) "
                                        "can be mapped")
        if not self.ch.plane.maps_peer_memory:
            raise PlaneUnavailableError(
                f"the channel runs the {self.ch.plane.name} plane; mapping needs shm (a peer on this host, with shm "
                "allowed by planes= on both sides)")
        return self.ch.plane, f"{self.ch.plane.name}: a CPU buffer of a peer on this host, mapped read-only"

    def _usable(self, plane: str, why: str | None) -> bool:
        """Whether the chosen GPU plane takes this op (``why`` it cannot: logged once per reason)."""
        if why is None:
            return True
        self.last_refusal = f"{plane} cannot take it: {why}"
        if why not in self._refused:
            self._refused.add(why)
            log.warning("channel %s: an op with %r cannot use %s (%s); it goes through the staged path",
                        self.ch.id, self.ch.peer_name, plane, why)
        return False

    def gpu_plane_choice(self) -> tuple[str, str]:
        """This peer's plane for GPU buffers and why (:func:`~transport.planes.choose_gpu_plane`)."""
        link = self.ch.link
        engine, why = ipc_engine_of(self.ch.core)
        return choose_gpu_plane(local_host(), self.ch.host, self.ch.core.planes, self.ch.remote_planes,
                                (engine is not None, why),
                                (link.state, link.reason) if link is not None else None)

    def maps_gpu_memory(self) -> bool:
        """Whether the peer's GPU buffers are mapped into this process for ops: its GPU plane is
        one that maps peer memory (``cuda_ipc``; :attr:`DataPlane.maps_peer_memory`): the choice
        already made for this channel (:attr:`gpu_plane`), else the one it would make now."""
        return (self.gpu_plane or self.gpu_plane_choice()[0]) == "cuda_ipc"

    def link_changed(self) -> None:
        """Event loop: the NCCL link was set up or went down: choose the GPU plane again (logged)."""
        self.gpu_plane = self.gpu_plane_reason = None
        self._refused.clear()

    def _nccl_refusal(self, pairs: Sequence[tuple[Item, torch.Tensor]]) -> str | None:
        """Why this op cannot go over the NCCL link (None if it can): every buffer, ours and the
        peer's, must be on the device its side's link serves."""
        link = self.ch.link
        if link is None:
            return "no NCCL link"
        if link.state == "pending":
            return None  # the plane waits for it (Endpoint.put/get)
        if link.state == "down":  # (another thread) before link_changed() reached the event loop
            return f"the NCCL link is down: {link.reason}"
        specs = self.ch.peer_specs
        for it, t in pairs:
            if not it.count:
                continue
            if not link.engine.handles(t):
                return f"our tensor for {it.name!r} is on {t.device}, the link serves {link.engine.device}"
            sp = specs.get(it.name)
            if sp is None or sp.device != link.peer_device:
                return (f"the peer's {it.name!r} is on {sp.device if sp else '?'}, its link serves "
                        f"{link.peer_device}")
        return None

    def _ipc_refusal(self, pairs: Sequence[tuple[Item, torch.Tensor]]) -> str | None:
        """Why this op cannot go over cuda_ipc (None if it can): a buffer without an export
        (a CPU buffer of the peer, or one its engine could not export) or one not mappable here."""
        engine, _ = ipc_engine_of(self.ch.core)
        if engine is None:
            return "no IPC engine here"
        from .cuda_ipc_engine import mapping_cache

        cache = mapping_cache(engine)
        wire = self.ch.remote_wire
        for it, t in pairs:
            if not it.count:
                continue
            wb = wire.get(it.name)
            if wb is None or wb.ipc is None:
                where = "a CPU buffer" if wb is not None and wb.device == "cpu" else "not exported by the peer"
                return f"{it.name!r} has no cuda_ipc export ({where})"
            if not engine.handles(t):  # (a host<->device copy of pageable memory would block the event loop)
                return f"our tensor for {it.name!r} is on {t.device}"
            why = engine.reachable(wb.ipc) or cache.refusal(wb.ipc)
            if why is not None:
                return f"{it.name!r}: {why}"
        return None

    # ------------------------------------------------------------------ lifecycle
    def quiesce(self, bound: float) -> bool:
        """The channel is closing (any thread but the loop's): no new cuda_ipc copy starts, and the
        ones running are waited for (at most ``bound`` s); False if some still run."""
        self._bye = True
        return self._ipc is None or self._ipc.quiesce(bound)

    def retire(self, old: dict[str, Any], new: dict[str, Any], epoch: int) -> bool:
        """The peer's registry went from ``old`` to ``new`` (name -> WireBuffer) at ``epoch``: the
        exports that left it or changed, which a plane of ours may have mapped, are confirmed
        (``Unmapped``) by that plane once nothing of ours uses them. False if no such plane was
        ever made here (nothing of ours mapped them: the channel confirms at once)."""
        if self._ipc is None:
            return False
        gone = [wb.ipc for name, wb in old.items()
                if wb.ipc is not None and ((nb := new.get(name)) is None or nb.ipc != wb.ipc)]
        self._ipc.retire(gone, epoch)
        return True

    def close(self) -> None:
        """The channel is gone: the GPU planes drop what they hold."""
        for plane in (self._ipc, self._nccl, self._staged, self._staged_shm):
            if plane is not None:
                plane.close()
