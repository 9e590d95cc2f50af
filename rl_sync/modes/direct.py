"""``mode="direct"``: the live weights are the arena; a push writes them with readers held off from Begin."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time

import torch

import transport

from .. import messages as m
from ..plan import arena_name
from ..weights import uncancellable
from .base import CommitMode, Push, Subscriber, readers_late

__all__ = ["DirectMode"]

log = logging.getLogger("rl_sync.subscriber")


class DirectMode(CommitMode):
    """One copy of the weights: at the first push the live tensors move into the arenas
    (:meth:`_adopt`); every push takes the writer lock at ``Begin`` and keeps it to the commit,
    which only bumps the version. A pull marks the weights torn until a commit."""

    name = "direct"
    repoints = True
    writes_live = True

    def __init__(self, sub: Subscriber) -> None:
        super().__init__(sub)
        self._moves = 0  # moves of the weights into the arenas begun (at most one runs: it holds the writer lock)
        self._moving = False

    @property
    def moving(self) -> bool:
        return self._moving

    def make_banks(self) -> None:
        self.sub._banks.append([])  # made at the first push, one at a time as the weights move in: see _adopt

    async def begin(self, push: Push) -> bool:
        """Take the writer lock for the whole push (direct mode); False (and a reply) if not had.

        While it waits for readers to leave, an Abort of it, a later Begin, or close() drops it (it is
        in ``_starting``): it then leaves the lock's queue at once, so new readers stop waiting behind it."""
        sub = self.sub
        moves = self._moves
        got = await sub._lock.acquire_write_async(sub.commit_timeout, abandoned=lambda: push.dropped)
        if not got:
            if push.dropped:
                if not sub._closed:
                    sub._reply(push.publisher, m.Reply(push.push_id, "begin", -1, "the push was aborted", "other",
                                                       sub._version))
            else:
                if self._moving or self._moves != moves:  # (the lock was held by an earlier push's move, not readers)
                    why = (f"an earlier push was moving the weights into the arenas (direct mode's first push moves "
                           f"them once) for more than {sub.commit_timeout} s")
                else:
                    why = f"readers held the weights for more than {sub.commit_timeout} s"
                sub._reply(push.publisher, m.Reply(push.push_id, "begin", -1, why, "timeout", sub._version))
            return False
        push.locked = True
        if push.dropped or push.version <= sub._version:  # aborted, superseded, or overtaken while it waited
            why = "the push was aborted" if push.dropped else f"version {push.version} is not newer than the committed {sub._version}"
            sub._drop(push, why)
            sub._reply(push.publisher, m.Reply(push.push_id, "begin", -1, why, "other" if push.dropped else "stale",
                                               sub._version))
            return False
        if push.unchecked and (changed := sub._changed()) is not None:  # (Begin's check skipped: a move ran then)
            sub._drop(push, changed)
            sub._reply(push.publisher, m.Reply(push.push_id, "begin", -1, changed, "plan", sub._version))
            return False
        # GPU reads queued in hold() before it was left (a drop meanwhile ends the wait: checked below)
        if not await sub._readers.wait(sub.commit_timeout, abandoned=lambda: push.dropped):
            dropped = push.dropped
            sub._drop(push, "readers' GPU work was not done")
            if not dropped:
                sub._reply(push.publisher, m.Reply(push.push_id, "begin", -1, readers_late(sub.commit_timeout),
                                                   "timeout", sub._version))
            return False
        if push.dropped:  # aborted or superseded during that wait (which gave the lock back)
            return False
        try:
            if sub._live_bank is None:  # first push: the live tensors move into the arenas, once
                push.moving = True  # (an Abort meanwhile must not let readers in mid-move: _drop keeps the lock)
                self._moving = True
                self._moves += 1
                try:
                    await self._adopt()
                finally:
                    push.moving = self._moving = False
        except BaseException as exc:  # including a cancellation by close(): never keep the lock
            sub._drop(push, f"moving the weights into the arena failed: {exc!r}")
            if not isinstance(exc, Exception):
                raise
            log.exception("subscriber %s: moving the weights into the arena failed", sub.endpoint.name)
            sub._reply(push.publisher, m.Reply(push.push_id, "begin", -1, f"{type(exc).__name__}: {exc}", "other",
                                               sub._version))
            return False
        if push.dropped:  # close() or an Abort during the move, which left the lock to us until it ended
            if push.locked:
                push.locked = False
                sub._lock.release_write()
            return False
        push.progress = time.monotonic()
        sub._spawn(self._watch(push))
        return True

    async def _watch(self, push: Push) -> None:
        """Direct mode: give up a push that stops moving, so that readers are not locked out forever.

        Progress is any Pull or Commit of the push arriving, or a pull finishing; a pull in flight
        is bounded by the endpoint's own timeout. Before the first Pull the allowance is twice
        ``commit_timeout``: the publisher may send the first pull late (it waits a moment for the
        other subscribers' Begin answers, and its send slots may be held by a slow subscriber until
        its stall bound)."""
        sub = self.sub
        period = max(0.05, min(1.0, sub.commit_timeout / 4))
        while push.locked:
            await asyncio.sleep(period)
            allowed = sub.commit_timeout if push.pulled else 2 * sub.commit_timeout
            if push.locked and not push.pulls and time.monotonic() - push.progress > allowed:
                log.warning("subscriber %s: push %d of %s made no progress for %.1f s; given up%s", sub.endpoint.name,
                            push.push_id, push.publisher, allowed,
                            ", the weights are torn until the next push commits" if sub._torn else "")
                sub._drop(push, "no progress")

    async def commit(self, push: Push, msg: m.Commit) -> None:
        self._commit_direct(push)

    def _commit_direct(self, push: Push) -> None:
        sub = self.sub
        if not push.locked or sub._push is not push:
            sub._reply(push.publisher, m.Reply(push.push_id, "commit", -1, "the push was given up", "other",
                                               sub._version))
            return
        with sub._version_cond:
            sub._version = push.version
            sub._torn = False
            sub._version_cond.notify_all()
        sub._drop(push, "committed")
        log.debug("subscriber %s: committed version %d (direct)", sub.endpoint.name, push.version)
        sub._reply(push.publisher, m.Reply(push.push_id, "commit", -1, None, None, sub._version))

    async def _adopt(self) -> None:
        """Direct mode, first push: make the arenas one at a time, copying each one's weights in and
        re-pointing them there, so that at most one arena more than the weights is held at once
        (an arena's old tensors are freed as it is adopted, unless the application keeps other
        references to them; on a GPU the freed blocks are handed back to the driver before the next
        arena is allocated). A failure leaves every tensor whole, in its arena or its old memory,
        and the next push goes on from the arenas adopted."""
        sub = self.sub
        arenas = sub._banks[0]
        for i, n in enumerate(sub.manifest.arenas):
            if i < len(arenas):
                continue  # adopted by an earlier, failed, attempt
            arena = sub.endpoint.new_buffer(arena_name(0, i), (n,), device=sub.device)
            sub._names.append(arena_name(0, i))
            try:
                await uncancellable(sub._copier.run(functools.partial(self._adopt_arena, i, arena)))
            except BaseException:
                sub._names.remove(arena_name(0, i))
                with contextlib.suppress(transport.TransportError):
                    sub.endpoint.unregister(arena_name(0, i), discard=True)
                raise
            arenas.append(arena)
            if sub.device.type == "cuda":  # (off the loop: freeing device memory waits for the device)
                await asyncio.to_thread(torch.cuda.empty_cache)
        sub._live_bank = 0

    def _adopt_arena(self, i: int, arena: torch.Tensor) -> None:
        """Copy the weights of arena ``i`` into ``arena`` and re-point them there (a Copier batch)."""
        sub = self.sub
        entries = [e for e in sub.manifest.entries if e.arena == i]
        for e in entries:
            src = sub._live[e.name]
            e.view_in(arena).copy_(src)
            if src.is_cuda:  # its memory is let go at the re-point below, before this stream read it
                src.record_stream(torch.cuda.current_stream(src.device))
        sub._repoint(0, {i: arena}, entries)
