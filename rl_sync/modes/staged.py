"""``mode="staged"``: pulls land in staging arenas; the commit copies them into the live weights."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import threading

import torch

from .. import messages as m
from ..device import foreach_copy
from ..errors import PushAbortedError
from ..weights import uncancellable
from .base import CommitMode, Push, Subscriber, readers_late

__all__ = ["StagedMode"]

log = logging.getLogger("rl_sync.subscriber")


class StagedMode(CommitMode):
    """One bank of staging arenas; the commit, holding the writer lock, copies it into the live
    tensors (on the :class:`~rl_sync.device.Copier`). :class:`~rl_sync.modes.swap.SwapMode`
    commits the same way but re-points instead of copying."""

    name = "staged"

    def __init__(self, sub: Subscriber) -> None:
        super().__init__(sub)
        # bank -> (its arenas' addresses, the commit's copies: runs of live tensors and their bank views)
        self._kept: dict[int, tuple[tuple[int, ...], list[tuple[list[torch.Tensor], list[torch.Tensor]]]]] = {}
        self._kept_lock = threading.Lock()
        self._closed = False

    async def commit(self, push: Push, msg: m.Commit) -> None:
        sub = self.sub
        # aborted, superseded or closed while it waits for the readers: it leaves the queue at once (_drop wakes
        # it), so new readers no longer wait behind a commit that can never apply
        if not await sub._lock.acquire_write_async(sub.commit_timeout, abandoned=lambda: sub._push is not push):
            if sub._push is not push:
                if not sub._closed:
                    sub._reply(push.publisher, m.Reply(push.push_id, "commit", -1, "the push was aborted", "other",
                                                       sub._version))
                return
            sub._reply(push.publisher, m.Reply(push.push_id, "commit", -1,
                                               f"readers held the weights for more than {sub.commit_timeout} s",
                                               "timeout", sub._version))
            return
        try:
            ready = await self._readers_left(push)
            if ready:
                await sub._applying.acquire()
        except BaseException:  # (cancelled by close(): never keep the lock)
            sub._lock.release_write()
            raise
        if not ready:
            sub._lock.release_write()  # (GPU reads queued in hold() may still read the live weights)
            sub._reply(push.publisher, m.Reply(push.push_id, "commit", -1, readers_late(sub.commit_timeout), "timeout",
                                               sub._version))
            return
        # dropped while it waited for readers' GPU work (a newer push that began meanwhile, finding _applying
        # free, may be writing the staging arena), or the model's tensors are no longer what it writes: copy nothing
        why, kind = ("the push was aborted", "other") if sub._push is not push else (sub._changed(), "plan")
        if why is not None:
            sub._applying.release()
            sub._lock.release_write()
            sub._reply(push.publisher, m.Reply(push.push_id, "commit", -1, why, kind, sub._version))
            return
        push.applying = self.changed_under_cancel  # (close() leaves its answer to this commit)
        try:
            try:
                await self._change(push)
            except asyncio.CancelledError:  # (close(): the copy ran to its end all the same, uncancellable)
                if self.changed_under_cancel:
                    self._set_version(push.version)
                    with contextlib.suppress(Exception):  # (the publisher learns it committed, as it did)
                        sub._reply(push.publisher, m.Reply(push.push_id, "commit", -1, None, None, sub._version))
                raise
            self._set_version(push.version)
        except PushAbortedError:  # (swap: dropped before anything moved; its publisher was told)
            return
        except Exception as exc:
            log.exception("subscriber %s: commit of version %d failed", sub.endpoint.name, push.version)
            sub._reply(push.publisher, m.Reply(push.push_id, "commit", -1, f"{type(exc).__name__}: {exc}", "other",
                                               sub._version))
            return
        finally:
            sub._lock.release_write()
            sub._applying.release()
            if sub._push is push:
                sub._push = None
        log.debug("subscriber %s: committed version %d", sub.endpoint.name, push.version)
        sub._reply(push.publisher, m.Reply(push.push_id, "commit", -1, None, None, sub._version))

    #: a cancellation that reaches commit() out of _change() comes after the live weights changed
    #: (staged: the copy is uncancellable); swap's comes from its wait, before anything moved
    changed_under_cancel = True

    def _set_version(self, version: int) -> None:
        sub = self.sub
        with sub._version_cond:
            sub._version = version
            sub._version_cond.notify_all()

    async def _readers_left(self, push: Push) -> bool:
        """With the writer lock had: False if GPU work readers queued in hold() is still not done
        (a drop of ``push`` meanwhile ends the wait: True, and the commit then moves nothing)."""
        return await self.sub._readers.wait(self.sub.commit_timeout, abandoned=lambda: push.dropped)

    async def _change(self, push: Push) -> None:
        """Holding the writer lock and ``_applying``: make the live weights those of ``push``."""
        await uncancellable(self.sub._copier.run(functools.partial(self._apply, push.bank)))

    def _apply(self, bank: int) -> None:
        """Copy bank ``bank`` into the live weights: ``_foreach_copy_`` over runs of consecutive
        entries of one (dtype, device), over views of the bank made once per bank and kept while
        its arenas stay where they are. An entry whose live tensor shares memory with another's
        (a tie, views of one fused tensor) is copied on its own, in the manifest's order, as
        before: one kernel never writes the same bytes twice."""
        with torch.no_grad():
            for dests, srcs in self._batches(bank):
                foreach_copy(dests, srcs)

    def _batches(self, bank: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        # views are taken at the first commit, not at construction: registering (at open) moves an arena
        # into shared memory; they are made again if an arena moved since (its address is the key)
        sub = self.sub
        arenas = sub._banks[bank]
        where = tuple(a.data_ptr() for a in arenas)
        kept = self._kept.get(bank)
        if kept is not None and kept[0] == where:
            return kept[1]
        entries = sub.manifest.entries
        lives = [sub._live[e.name] for e in entries]
        memory = collections.Counter((t.device, t.untyped_storage().data_ptr()) for t in lives if t.numel())
        batches: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        run: object = None
        for e, live in zip(entries, lives, strict=True):
            view = e.view_in(arenas[e.arena])
            alone = live.numel() > 0 and memory[(live.device, live.untyped_storage().data_ptr())] > 1
            kind = object() if alone else (live.dtype, live.device)
            if kind != run or alone:
                batches.append(([], []))
                run = kind
            batches[-1][0].append(live)
            batches[-1][1].append(view)
        with self._kept_lock:  # (close() may run meanwhile on another thread: nothing is kept after it)
            if not self._closed:
                self._kept[bank] = (where, batches)
        return batches

    def close(self) -> None:
        with self._kept_lock:
            self._closed = True
            self._kept.clear()  # (the views hold the banks' memory)
