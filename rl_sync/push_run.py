"""The state machine of one push (:class:`PushRun`): Begin to every subscriber, then per group the
main pass (pack each bucket into a free send slot or the push's bank, or serve it live, and tell
its pullers), the bank's seal, the repair pass, and the finish (Aborts for whoever did not commit).
Its reactions to replies and time are :class:`rl_sync.push_track.PushTracker`'s. Internal to
:mod:`rl_sync.publisher` (see its theory of operation)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import statistics
import time
from collections.abc import Callable, Mapping

import torch

from . import messages as m
from .errors import PushAbortedError, RlSyncError
from .packing import pack
from .plan import Bucket
from .push_state import Group, Target
from .push_track import POLL, PushTracker

__all__ = ["INLINE_PACK", "PushRun"]

INLINE_PACK = 512 << 10  # CPU buckets up to this size are packed on the event loop, larger ones on a worker thread

log = logging.getLogger("rl_sync.publisher")


class PushRun(PushTracker):
    """The state of one push: targets, their progress, and the tasks driving them.

    Progress is per subscriber: nothing waits for every subscriber at once.
    The main pass packs bucket after bucket and tells the subscribers that
    have begun and pull from the publisher to pull each one; a subscriber
    whose Begin answer comes later gets the buckets it missed in the repair
    pass that follows. A send slot is reused once the pulls of its bucket
    answered; one that a subscriber leaves unanswered past the stall bound
    (see :meth:`_stall_bound`) is taken back from it: that subscriber is
    *stalled* (no new pulls until it answers anything), its unanswered slot
    pulls are superseded (the bytes it reads may be torn; a later Pull of the
    same bucket, with a newer attempt number, makes it cancel that pull and
    pull again) and they are repaired once it answers. Its dependents pull
    from the publisher instead, as do those of a relay whose pulls go
    unanswered past the bound. The push's deadline fails whoever is still
    in progress, with what it was doing.
    """

    # ------------------------------------------------------------------ driving
    async def execute(self, groups: list[Group], progress: bool) -> None:
        if progress:
            from tqdm.auto import tqdm

            total = sum(b.nbytes for g in groups for b in g.buckets)
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"push v{self.version}")
        watchdog = asyncio.ensure_future(self._watchdog())
        self.groups = groups
        try:
            now = time.monotonic()
            self.budget = max(0.0, self.deadline - now)
            for t in self.targets.values():
                t.begin_at = now
                if not _bank_first(t.group):
                    self._begin(t)
            if len(groups) == 1:  # (the usual push: no task for it, no turn of the loop before its first pack)
                await self._run_group(groups[0])
            else:
                await asyncio.gather(*(self._run_group(g) for g in groups))
            await self._until(lambda: not any(t.alive for t in self.targets.values()))
        finally:
            watchdog.cancel()  # (not awaited: it is parked in a sleep, and the push's end need not wait a turn of the loop)
            if self.bar is not None:
                self.bar.close()

    def _begin(self, t: Target, commit: m.Commit | None = None) -> None:
        """Send ``t`` its Begin (with its ``commit`` inside: a shared subscriber once its bank is sealed)."""
        t.begin_sent = True
        t.begin_at = time.monotonic()
        self.emit(t, "begin_sent")  # (before the send: an observer sees it before any answer)
        if commit is not None:
            self._committing(t)
        self._send(t, m.Begin(self.push_id, self.version, t.layout.digest, self.pub.bucket_bytes, commit))

    async def _run_group(self, group: Group) -> None:
        n = len(group.buckets)
        # the first Begin answer starts the group; the others are given as long again to be in the main
        # pass from its first bucket (later ones get what they missed in the repair pass). A group of
        # shared subscribers only does not wait and sends nothing first: its bank is packed and sealed, then
        # each one gets its Begin with its Commit inside, and answers the Commit only (one message each way
        # per push; a Begin it refuses is still answered)
        if not _bank_first(group):
            t0 = time.monotonic()
            await self._until(lambda: any(t.begun for t in group.targets) or not any(t.alive for t in group.targets))
            grace = time.monotonic() + max(0.02, time.monotonic() - t0)
            await self._until(lambda: all(t.begun or not t.alive for t in group.targets) or time.monotonic() >= grace)
        for t in group.targets:  # a relay that has not begun yet would hold its dependents up
            self._check_source(t)
        self._take_bank(group)
        for k in range(n):
            def pick(k: int = k) -> list[Target]:
                return [t for t in group.targets if t.alive and t.begun and not t.stalled and not t.shared
                        and t.source is None and k not in t.have and k not in t.inflight]
            if pick() or (group.bank is not None and any(t.alive for t in group.targets if t.shared)):
                await self._serve(group, k, pick)
            group.served = k + 1
        if group.bank is not None and group.banks is not None and len(group.packed) == n:
            group.banks.seal(group.bank, self.version, self.push_id)
            group.sealed = True
            for t in group.targets:
                if t.shared and t.alive:
                    t.have = set(range(n))
                    if not t.begin_sent:  # (its Commit inside its Begin: one message)
                        self._begin(t, self._commit_message(t))
                    else:
                        self._maybe_commit(t)
        # repair: buckets a subscriber missed (it began late, its relay failed or stalled, its slot was
        # taken back) come from the publisher, once it is not stalled and has no pull of them outstanding
        while True:
            def due() -> list[Target]:
                return [t for t in group.targets if t.alive and t.begun and not t.stalled
                        and any(k not in t.inflight for k in t.orphaned)]
            await self._until(lambda: bool(due()) or not any(t.alive and not t.complete for t in group.targets))
            todo = sorted({k for t in due() for k in t.orphaned if k not in t.inflight})
            if not todo:
                return
            for k in todo:
                def pick_repair(k: int = k) -> list[Target]:
                    return [t for t in group.targets if t.alive and t.begun and not t.stalled and k in t.orphaned
                            and k not in t.inflight]
                if pick_repair():
                    await self._serve(group, k, pick_repair)

    def _take_bank(self, group: Group) -> None:
        """With shared subscribers in ``group``: take the bank this push packs into (exclusively,
        until sealed); if none can be had, only the shared subscribers fail."""
        shared = [t for t in group.targets if t.shared and t.alive]
        if not shared or group.banks is None:
            return
        try:
            group.bank, added = group.banks.acquire()
        except Exception as exc:  # allocating a bank failed
            for t in shared:
                self.fail(t, RlSyncError(f"no shared bank could be had for version {self.version}: "
                                         f"{type(exc).__name__}: {exc}"))
            return
        if added:
            last = self.pub.version
            behind = sorted(f"{name} (version {v})" for name, v in self.pub._committed.items() if v < last)
            log.warning("push %d: every shared bank is held by subscribers on older versions (%s); bank %d added, "
                        "%d now", self.push_id, ", ".join(behind) or "?", group.bank, len(group.banks))

    async def _serve(self, group: Group, k: int, pick: Callable[[], list[Target]]) -> None:
        """Pack bucket ``k`` into a free slot (or into the push's bank, once) and tell those ``pick``
        returns then to pull it."""
        bucket = group.buckets[k]
        slot: int | None = None
        if group.live is not None:  # straight from the trainer's tensors: no slot, no pack
            await self._marks_done()
            live = tuple(group.live[p.entry.name] for p in bucket.pieces)
            for t in pick():
                self._pull(t, k, None, "", 0, None, live)
            return
        if group.bank is not None and group.banks is not None:
            if k not in group.packed:
                await self._pack_into(bucket, group.sources, group.banks.arena(group.bank, bucket), bucket.offset)
                group.packed.add(k)
            buffer, offset = group.banks.names(group.bank)[bucket.arena], bucket.offset
        else:
            if not group.slots:
                group.slots, group.slot_tensors = self.pub._slot(group.layout, self.copier.device)
            slot = await self._free_slot(group, pick)
            if slot is None:  # nobody wants the bucket any more (failed, stalled meanwhile): a later beginner repairs it
                return
            await self._pack_into(bucket, group.sources, group.slot_tensors[slot], 0)
            buffer, offset = group.slots[slot], 0
            group.slot_ready[slot] = time.monotonic()
            group.slot_took[slot] = None
        for t in pick():
            if slot is not None:
                group.slot_users[slot].add(t.name)
            self._pull(t, k, None, buffer, offset, slot)

    async def _free_slot(self, group: Group, pick: Callable[[], list[Target]]) -> int | None:
        """A send slot nobody reads any more, for a bucket those ``pick`` returns want (None once
        nobody does). While both are read, a reader that leaves one unanswered past the stall bound
        gives it up (it is stalled), but only while a subscriber that holds no slot wants the
        bucket: subscribers slow on their own (a slower link) are never stalled for their own or
        each other's sake; a stalled one gets what it missed once it answers again."""
        while True:
            for i, users in enumerate(group.slot_users):
                if not users:
                    return i
            wanting = {t.name for t in pick()}
            if not wanting:
                return None
            waiting = wanting.difference(*group.slot_users)  # (holders that want it too wait on each other)
            now = time.monotonic()
            for i, users in enumerate(group.slot_users):
                bound = self._stall_bound(group.slot_took[i], group)
                for name in list(users):
                    t = self.targets[name]
                    p = next((p for p in t.inflight.values() if p.slot == i), None)
                    if p is None:  # (cannot be: a user has a pull of the slot) never let it hold the slot
                        users.discard(name)
                    elif now - p.sent >= bound and waiting:
                        self._stall(t, f"its pull of slot {i} went unanswered for {now - p.sent:.2f} s "
                                       f"(bound {bound:.2f} s) while {', '.join(sorted(waiting))} "
                                       "waited for a slot")
            if any(not users for users in group.slot_users):
                continue
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL):
                    await self.changed.wait()

    async def _marks_done(self) -> None:
        """Live pulls read the trainer's tensors from other processes: first the work the caller
        queued on its streams at ``push()`` must be done (a host wait, on a worker thread, once)."""
        if self._marks_wait is None:
            marks = self.marks
            self._marks_wait = asyncio.ensure_future(asyncio.to_thread(lambda: [e.synchronize() for e in marks]))
        await asyncio.shield(self._marks_wait)

    async def _pack_into(self, bucket: Bucket, sources: Mapping[str, torch.Tensor], dest: torch.Tensor,
                         start: int) -> None:
        # a small CPU bucket on the loop (~50 us for the demo's 270 KiB of 30 tensors: less than the hand-over to a
        # worker thread and back, which on a busy machine costs ~1 ms); else on a worker thread; with the weights
        # on a GPU, on the copier's stream once the caller's work queued at push() is done. The pulls are sent only
        # once the bytes are in the slot
        if not self.copier.is_cuda and bucket.nbytes <= INLINE_PACK:
            # (after the push's first pack, first a turn of the loop: the previous bucket's pulls go out, the
            # watchdog and replies run, so that a bank of many small buckets never holds the loop for long)
            if self.packed_bytes:
                await asyncio.sleep(0)
            _pack(bucket, sources, dest, start)
        else:
            pack = asyncio.ensure_future(self.copier.run(functools.partial(_pack, bucket, sources, dest, start),
                                                         self.marks))
            self.pub._packing.add(pack)
            pack.add_done_callback(self.pub._packing.discard)
            await asyncio.shield(pack)
        self.packed_bytes += bucket.nbytes
        if self.bar is not None:
            self.bar.update(bucket.nbytes)

    async def finish(self) -> None:
        """Abort whatever did not commit (cancellation included). Nothing waits for the Aborts: each is
        bounded on its own, and a later push's Begin supersedes an unfinished push anyway."""
        for g in self.groups:  # the next push's stall yardstick until it has answered pulls of its own
            if g.took:
                self.pub._pull_medians[g.digest] = statistics.median(g.took)
        for t in self.targets.values():
            if t.alive:
                self.fail(t, PushAbortedError(f"the push of version {self.version} stopped before {t.name} committed "
                                              f"({t.doing(time.monotonic())})"))
        for g in self.groups:
            if g.bank is not None and g.banks is not None and not g.sealed:
                g.banks.release(g.bank)  # unsealed: its stamp says it holds nothing, no commit names it
        background = self.pub._background
        queued = bool(self.tasks)
        for task in self.tasks:
            background.add(task)
            task.add_done_callback(background.discard)
        self.tasks = set()
        if queued:
            await asyncio.sleep(0)  # let the Aborts (and messages) queued in tasks go out before the push returns


def _bank_first(group: Group | None) -> bool:
    """Whether ``group``'s subscribers are all shared (their bank is packed before their Begin)."""
    return group is not None and group.banks is not None and all(t.shared for t in group.targets)


_pack = pack  # (a module attribute: bench/bench_rl_sync.py times the packs through it)
