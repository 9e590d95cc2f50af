"""Errors raised by :mod:`rl_sync`.

Transport failures (a lost peer, a deadline) keep their :mod:`transport`
types (:class:`transport.PeerLostError`, :class:`transport.TransportTimeoutError`);
a commit that did not happen in time is a :class:`CommitTimeoutError`, a
:class:`transport.TransportTimeoutError` whose ``phase`` is :attr:`SyncPhase.COMMIT`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import transport

__all__ = ["CommitTimeoutError", "PlanMismatchError", "PushAbortedError", "RlSyncError", "StaleVersionError",
           "SubscriberNotReadyError", "SubscriberRejectedError", "SyncPhase"]


class SyncPhase(str, enum.Enum):
    """The phases of a push that :mod:`transport`'s :class:`~transport.Phase` does not name (a
    :class:`CommitTimeoutError`'s ``phase``); each compares equal to its string."""

    COMMIT = "commit"


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


class SubscriberNotReadyError(RlSyncError):
    """A subscriber's endpoint answers but runs no :class:`~rl_sync.WeightSubscriber` yet (its
    process is still loading its model, or restarting): only its entry of the push fails, and
    the first push that finds its subscriber gives it everything."""


class SubscriberRejectedError(RlSyncError):
    """A subscriber refused a step of a push (its reason is the message)."""


class CommitTimeoutError(RlSyncError, transport.TransportTimeoutError):
    """A commit did not happen in time: readers stayed in ``hold()`` past ``commit_timeout``, a
    subscriber's commit did not come back before the push's deadline, or ``hold()``/``wait_for``
    waited past their ``timeout``. Also a :class:`transport.TransportTimeoutError` (and a
    ``TimeoutError``) whose ``phase`` is :attr:`SyncPhase.COMMIT` (``== "commit"``), and an
    :class:`RlSyncError`: catch it before ``RlSyncError`` where a timeout means something else."""

    def __init__(self, message: str) -> None:
        transport.TransportTimeoutError.__init__(self, message, SyncPhase.COMMIT)


class PushAbortedError(RlSyncError):
    """The push to this subscriber stopped before its commit (cancelled, or its relay source failed)."""
