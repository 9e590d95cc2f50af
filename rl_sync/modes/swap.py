"""``mode="swap"``: two banks of arenas; the commit re-points the live weights into the one just filled."""

from __future__ import annotations

from .. import messages as m
from ..errors import CommitTimeoutError, PushAbortedError
from .base import Push, readers_late
from .staged import StagedMode

__all__ = ["SwapMode"]


class SwapMode(StagedMode):
    """A push fills the bank the weights do not use; the commit (as staged's, holding the writer
    lock) re-points every live tensor into it (``Tensor.set_``, no copy)."""

    name = "swap"
    nbanks = 2
    repoints = True
    changed_under_cancel = False  # (a cancellation reaches it only in its wait for readers: nothing moved)

    async def begin(self, push: Push) -> bool:
        sub = self.sub
        if not await sub._readers.wait(sub.commit_timeout, abandoned=lambda: push.dropped):
            # (the bank this push fills was the live one until the last commit: GPU reads of it may be queued)
            if not push.dropped:
                sub._reply(push.publisher, m.Reply(push.push_id, "begin", -1, readers_late(sub.commit_timeout),
                                                   "timeout", sub._version))
            return False
        return True

    async def _readers_left(self, push: Push) -> bool:
        return True  # (swap waits for readers' GPU work at Begin, and before its first re-point)

    async def _change(self, push: Push) -> None:
        sub = self.sub
        if sub._live_bank is None and not await sub._readers.wait(sub.commit_timeout, abandoned=lambda: push.dropped):
            # (the first re-point lets the model's own memory go: GPU reads of it may be queued)
            raise CommitTimeoutError(readers_late(sub.commit_timeout))
        if push.dropped:  # superseded, aborted or closed while it waited for those reads: nothing moves
            raise PushAbortedError("the push was dropped while its commit waited for the readers' GPU work")
        sub._repoint(push.bank)  # microseconds: no need to leave the loop
