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

from .base import ChannelPort, DataPlane, Exporter, PeerLink, SendingChannel
from .choice import (
    CPU_PLANES,
    GPU_PLANES,
    PLANES,
    STAGED,
    PlaneChoice,
    choose_cpu_plane,
    choose_gpu_plane,
    make_exporters,
    make_link,
    needs_unmap_acks,
    plane_features,
    validate_planes,
    wants_link,
)
from .nccl_engine import LinkConn, LinkEngine, SocketLinkEngine, link_engine_probe
from .nccl_frames import link_refusal
from .nccl_offer import NcclOffer
from .offers import ENGINE_PLANES, PlaneOffers, check_engines
from .wire_rules import WireSemantics, export_fault, wire_semantics

__all__ = ["CPU_PLANES", "ChannelPort", "DataPlane", "ENGINE_PLANES", "Exporter", "GPU_PLANES", "LinkConn",
           "LinkEngine", "NcclOffer", "PLANES", "PeerLink", "PlaneChoice", "PlaneOffers", "STAGED",
           "SendingChannel", "SocketLinkEngine", "WireSemantics", "check_engines", "choose_cpu_plane",
           "choose_gpu_plane", "export_fault", "link_engine_probe", "link_refusal", "make_exporters",
           "make_link", "needs_unmap_acks", "plane_features", "validate_planes", "wants_link",
           "wire_semantics"]
