"""The subscriber's commit modes (``WeightSubscriber(mode=...)``), one strategy class each.

``staged`` (:mod:`.staged`), ``swap`` (:mod:`.swap`), ``direct`` (:mod:`.direct`) and ``shared``
(:mod:`.shared`); :mod:`.base` has their interface and what they see of the subscriber.
"""

from __future__ import annotations

from .base import CommitMode, Push, Subscriber
from .direct import DirectMode
from .shared import SharedMode
from .staged import StagedMode
from .swap import SwapMode

__all__ = ["MODES", "CommitMode", "DirectMode", "Push", "SharedMode", "StagedMode", "Subscriber", "SwapMode",
           "make_mode"]

_BY_NAME: dict[str, type[CommitMode]] = {c.name: c for c in (StagedMode, SwapMode, DirectMode, SharedMode)}
MODES = tuple(_BY_NAME)  # ("staged", "swap", "direct", "shared")


def make_mode(name: str, sub: Subscriber) -> CommitMode:
    """The commit mode ``name`` (one of :data:`MODES`) of ``sub``."""
    return _BY_NAME[name](sub)
