"""Errors raised by :mod:`rl_sync`.

Transport failures (a lost peer, a deadline) keep their :mod:`transport`
types (:class:`transport.PeerLostError`, :class:`transport.TransportTimeoutError`
with ``phase`` ``commit`` for a commit that did not come back in time).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PlanMismatchError", "PushAbortedError", "RlSyncError", "StaleVersionError", "SubscriberRejectedError"]


class RlSyncError(Exception):
    """Root of the errors :mod:`rl_sync` raises itself."""


class StaleVersionError(RlSyncError):
    """A push named a version that is not newer than the one already pushed (or held)."""


class PlanMismatchError(RlSyncError):
    """The trainer's tensors and a subscriber's layout differ; ``differences`` lists every one."""

    def __init__(self, differences: Sequence[str], *, subscriber: str | None = None) -> None:
        self.differences = list(differences)
        self.subscriber = subscriber
        who = f" for subscriber {subscriber!r}" if subscriber else ""
        lines = "\n  ".join(self.differences)
        super().__init__(f"the weights do not match the plan{who} ({len(self.differences)} differences):\n  {lines}")


class SubscriberRejectedError(RlSyncError):
    """A subscriber refused a step of a push (its reason is the message)."""


class PushAbortedError(RlSyncError):
    """The push to this subscriber stopped before its commit (cancelled, or its relay source failed)."""
