"""What the core's target half and handshake must know of each plane's frames and handles.

:func:`wire_semantics`: how the target serves an op whose header names a plane
(:mod:`transport.serving`); :func:`export_fault`: whether the handles a peer announced for a
buffer are sound (:mod:`transport.handshake`). The planes' names live here, not in the core.
"""

from __future__ import annotations

from typing import NamedTuple

from ..wire import WireBuffer
from .shm_export import handle_fault

__all__ = ["WireSemantics", "export_fault", "wire_semantics"]


class WireSemantics(NamedTuple):
    """What the target's half (:mod:`transport.serving`) must do with an op whose header names a
    plane, as :func:`wire_semantics` says."""

    inline: bool  # the payload follows the header in the stream (tcp, and the staged path riding on it)
    segments: bool  # the initiator copied into or out of the exports the header names (shm, cuda_ipc)
    via_link: bool  # the bytes go over the channel's NCCL link; the link serves the op (nccl)
    own_plane: bool  # only a channel whose CPU plane this is may carry it (shm)


_WIRE = {
    "tcp": WireSemantics(inline=True, segments=False, via_link=False, own_plane=False),
    "shm": WireSemantics(inline=False, segments=True, via_link=False, own_plane=True),
    "cuda_ipc": WireSemantics(inline=False, segments=True, via_link=False, own_plane=False),
    "nccl": WireSemantics(inline=False, segments=False, via_link=True, own_plane=False),
}


def export_fault(b: WireBuffer) -> str | None:
    """What is wrong with the plane handles a peer announced for its buffer ``b`` (each plane
    checks its own: a handle's bytes must fit where it says they lie), or None."""
    if b.shm is not None:
        return handle_fault(b.shm, b.nbytes)
    return None


def wire_semantics(plane: str) -> WireSemantics | None:
    """How the target serves an op whose header names ``plane``; None for a name no header may
    carry (a hostile or corrupt one)."""
    return _WIRE.get(plane)


