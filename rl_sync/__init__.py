"""rl_sync: versioned weight pushes from trainers to generators, built on :mod:`transport`.

::

    # generator
    sub = WeightSubscriber(ep, model)
    await sub.wait_for_version(3, timeout=60)
    async with sub.hold():
        out = model(batch)

    # trainer
    pub = WeightPublisher(ep, subscribers=["gen-0", "gen-1"], dtype=torch.bfloat16)
    report = await pub.push(model, version=step)

This package uses only ``transport``'s public names; ``transport`` never imports it.
"""

from .blocking import BlockingWeightSubscriber
from .errors import (
    CommitTimeoutError,
    PlanMismatchError,
    PushAbortedError,
    RlSyncError,
    StaleVersionError,
    SubscriberNotReadyError,
    SubscriberRejectedError,
    SyncPhase,
)
from .publisher import WeightPublisher
from .report import PushEvent, PushReport, SubscriberResult
from .subscriber import WeightSubscriber

__all__ = [
    "BlockingWeightSubscriber",
    "CommitTimeoutError",
    "PlanMismatchError",
    "PushAbortedError",
    "PushEvent",
    "PushReport",
    "RlSyncError",
    "StaleVersionError",
    "SubscriberNotReadyError",
    "SubscriberRejectedError",
    "SubscriberResult",
    "SyncPhase",
    "WeightPublisher",
    "WeightSubscriber",
]
