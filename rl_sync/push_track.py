"""One push's state and how it reacts (:class:`PushTracker`, the base of
:class:`rl_sync.push_run.PushRun`): the replies (Begin, each pull, Commit), the pulls it sends,
stalls (a slot taken back), relays that fail, stall or go silent (their dependents pull from the
publisher), commits, failures (with the Abort owed) and the watchdog (lost channels, the deadline).
Internal to :mod:`rl_sync.publisher` (see its theory of operation)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import transport
from transport.errors import Phase

from . import messages as m
from .device import Copier
from .errors import CommitTimeoutError, SubscriberRejectedError
from .plan import arena_name
from .posting import REPLY_EXPECTED, InOrder
from .push_state import Group, Publisher, Pull, Target, rejection
from .report import PushEvent

__all__ = ["POLL", "PushTracker"]

log = logging.getLogger("rl_sync.publisher")

_STALL_MIN = 0.25  # seconds: the least a slot's puller is given before the slot is taken back from it
_STALL_FACTOR = 4.0  # ... and how many times the slowest answered pull of that slot
_STALL_SHARE = 8.0  # ... its slack capped at 1/STALL_SHARE of the push's time (never below 2x an answered pull)
POLL = 0.05


class PushTracker:
    """The state of one push (its targets, their progress, its tasks) and its reactions to replies
    and to time; :class:`rl_sync.push_run.PushRun` drives the push on top of it."""

    def __init__(self, pub: Publisher, push_id: int, version: int, deadline: float, t0: float) -> None:
        self.pub = pub
        self.ep = pub.endpoint
        self.push_id = push_id
        self.version = version
        self.deadline = deadline
        self.t0 = t0
        self.budget: float | None = None  # the push's time from its first Begin to its deadline (set by execute())
        self.targets: dict[str, Target] = {}
        self.changed = asyncio.Event()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.packed_bytes = 0
        self.bar: Any = None
        self.groups: list[Group] = []
        # how long the latest answered pulls took (the relay stall bound's yardstick; the watchdog takes
        # its median every tick, so only the newest few are kept)
        self.took: collections.deque[float] = collections.deque(maxlen=256)
        self.copier: Copier = Copier(torch.device("cpu"))  # where packs run (set by push())
        self.marks: list[Any] = []  # the caller's GPU work queued when push() was called
        self._marks_wait: asyncio.Future[Any] | None = None  # live pulls: the host wait for those marks
        self._order = InOrder(self.ep)  # each subscriber's messages in order (_send)

    # ------------------------------------------------------------------ events
    def emit(self, t: Target, kind: str, bucket: int = -1, source: str | None = None, detail: str = "") -> None:
        observer = self.pub.observer
        if observer is None:
            return
        try:
            observer(PushEvent(self.push_id, self.version, t.name, kind, bucket, source or self.ep.name, len(t.have),
                               len(t.layout.buckets), time.monotonic() - self.t0, detail))
        except Exception:
            log.exception("push %d: the observer raised on %s of %s; ignored", self.push_id, kind, t.name)

    def _stall_bound(self, took: float | None, group: Group | None = None) -> float:
        """How long a pull may go unanswered while it holds up others: ``4x`` the slowest answered
        pull it is compared with (at least 0.25 s); with none, ``4x`` the median pull from the
        publisher of ``group`` (:meth:`_yardstick`); ``stall_timeout`` with nothing at all. The
        slack is capped at an eighth of the push's time, so that where every pull is slow (a
        loaded host) or nothing was ever answered (the first push) a frozen one still leaves the
        others most of the deadline; but a bound is never below twice a pull that was answered (a
        healthy subscriber whose pulls take longer than the cap would otherwise be stalled at every
        pull, its answers thrown away, and never finish)."""
        if took is None and group is not None:
            took = self._yardstick(group)
        cap = None if self.budget is None else max(_STALL_MIN, self.budget / _STALL_SHARE)
        if took is None:
            return self.pub.stall_timeout if cap is None else min(self.pub.stall_timeout, cap)
        bound = max(_STALL_MIN, _STALL_FACTOR * took)
        return bound if cap is None else min(bound, max(cap, 2.0 * took))

    def _yardstick(self, group: Group) -> float | None:
        """The median answered pull from the publisher of ``group`` in this push, else in the
        latest push of its layout that had one (None: none yet). A bucket whose only puller froze
        has no answered pull of its own to compare with: without this, the frozen one would keep
        both send slots for ``stall_timeout`` and hold up everyone still to be served (a late
        Begin, a dropped relay's dependents). Only the group's pulls from the publisher count:
        relay pulls over shared memory are no yardstick for pulls over the network."""
        if group.took or group.late:  # (late answers of pulls taken back: this push's only, never the next's)
            return statistics.median(group.took or group.late)
        return self.pub._pull_medians.get(group.digest)

    def _took(self, t: Target, p: Pull, now: float, late: bool = False) -> None:
        """``t`` answered pull ``p`` (``late``: one taken back): how long it took feeds the stall
        bounds (:meth:`_stall_bound`)."""
        self.took.append(now - p.sent)
        if p.source is None and t.group is not None:
            (t.group.late if late else t.group.took).append(now - p.sent)

    def _pull(self, t: Target, k: int, source: Target | None, buffer: str, offset: int, slot: int | None,
              live: tuple[str, ...] = ()) -> None:
        """Tell ``t`` to pull bucket ``k`` from ``source`` (a relay, with its stamp to check; None: the publisher)."""
        t.orphaned.discard(k)
        name = source.name if source is not None else None
        p = t.inflight[k] = Pull(next(t.attempts), name, slot, time.monotonic())
        self.emit(t, "pull_sent", k, name)
        stamp, at = (source.stamp, source.bank) if source is not None else (0, 0)
        self._send(t, m.Pull(self.push_id, k, name or self.ep.name, buffer, offset, p.attempt, live, stamp, at))

    def _stall(self, t: Target, why: str) -> None:
        """Take every slot back from ``t``: its slot pulls are superseded (repaired once it answers)."""
        if not t.stalled:
            t.stalled = True
            t.stalled_at = time.monotonic()
            log.warning("push %d (version %d): %s stalled: %s; its slots go on without it, its dependents pull from "
                        "the publisher", self.push_id, self.version, t.name, why)
            self.emit(t, "stalled", detail=why)
        g = t.group
        for k, p in list(t.inflight.items()):
            if p.slot is not None:
                if g is not None:
                    g.slot_users[p.slot].discard(t.name)
                t.superseded[p.attempt] = t.inflight.pop(k)
                t.orphaned.add(k)
        for d in t.dependents:
            if d.alive and d.source == t.name:
                self._resource(d, f"its relay {t.name} stalled")
        self.changed.set()

    def _resource(self, d: Target, why: str) -> None:
        """``d`` pulls from the publisher from now on: what it misses, relay pulls in flight included
        (superseded), comes in the repair pass, the rest in the main pass."""
        d.source = None
        served = d.group.served if d.group is not None else 0
        for k, p in list(d.inflight.items()):
            if p.source is not None:
                d.superseded[p.attempt] = d.inflight.pop(k)
        d.orphaned |= {k for k in range(served) if k not in d.have and k not in d.inflight}
        log.info("push %d: %s pulls from the publisher from now on (%s)", self.push_id, d.name, why)
        self.emit(d, "resourced", detail=why)
        self.changed.set()

    def _unusable(self, src: Target) -> str | None:
        """Why relay ``src`` cannot serve its dependents now (None: it can). Once committed it is
        free to take another push, make a new subscriber or restart: its arena serves on only while
        its channel is the one it committed over (and its dependents check its stamp after each read)."""
        if src.error is not None or src.stalled:
            return "stalled" if src.stalled else "failed"
        if src.unrelayable is not None:
            return src.unrelayable
        if src.committed:
            p = self.ep.peer(src.name)
            if p is None or p.incarnation != src.layout.incarnation:
                return "committed, and its channel is gone since"
        return None

    def _check_source(self, d: Target) -> None:
        """Once the main pass runs, a begun subscriber whose relay has not begun (or is stalled,
        failed, or can no longer serve this push) pulls from the publisher instead: a relay late to
        begin never holds it up."""
        src = self.targets.get(d.source) if d.source is not None else None
        if src is not None and d.alive and d.begun and (not src.begun or (why := self._unusable(src)) is not None):
            self._resource(d, f"its relay {src.name} has not begun" if not src.begun else f"its relay {src.name} "
                              f"is {why}")

    def _feed(self, d: Target) -> None:
        """Tell ``d`` (begun, relaying from a live source) to pull what its source already holds."""
        src = self.targets.get(d.source) if d.source is not None else None
        if src is None or not d.alive or not d.begun:
            return
        if self._unusable(src) is not None:
            self._check_source(d)
            return
        for k in sorted(src.have):
            if k not in d.have and k not in d.inflight:
                b = d.layout.buckets[k]
                self._pull(d, k, src, arena_name(src.bank, b.arena), b.offset, None)

    def _unrelay(self, src: Target, why: str) -> None:
        """A dependent found that ``src``'s arena no longer holds this push (its stamp changed):
        none of its dependents pulls from it any more."""
        if src.unrelayable is None:
            src.unrelayable = f"no longer holding this push ({why})"
            log.warning("push %d (version %d): relay %s no longer holds this push: %s; its dependents pull from the "
                        "publisher", self.push_id, self.version, src.name, why)
        for d in src.dependents:
            if d.alive and d.source == src.name:
                self._resource(d, f"its relay {src.name} no longer holds this push")

    def on_reply(self, t: Target, r: m.Reply) -> None:
        now = time.monotonic()
        t.heard = now
        if t.stalled and r.stage == "pull":  # it answers again: what it missed meanwhile is repaired
            t.stalled = False
            log.info("push %d: %s answers again after %.2f s stalled", self.push_id, t.name, now - t.stalled_at)
            g = t.group
            if t.source is None and g is not None:  # (the main pass skipped it while it was stalled)
                t.orphaned |= {k for k in range(g.served) if k not in t.have and k not in t.inflight}
            else:
                self._feed(t)
        if r.stage == "begin":
            if t.begun:
                return
            if r.error is None:
                t.begun = True
                t.bank, t.stamp = r.bank, r.stamp
                self.emit(t, "begun")
                g = t.group
                if g is not None and g.served and not t.shared:  # began after the main pass started
                    self._check_source(t)
                    if t.source is None:
                        t.orphaned |= {k for k in range(g.served) if k not in t.have}
                    else:
                        self._feed(t)
                for d in t.dependents:  # relaying to subscribers that began first
                    self._feed(d)
                self._maybe_commit(t)  # a layout with no bytes at all, or a sealed bank
            else:
                self.fail(t, rejection(t.name, r))
        elif r.stage == "pull":
            p = t.inflight.get(r.bucket)
            if p is None or p.attempt != r.attempt:
                old = t.superseded.pop(r.attempt, None)
                if old is not None and r.error is None:  # (its bytes may be torn, but it took that long: a pull
                    self._took(t, old, now, late=True)   # slower than the bound must raise the bound, or every
                self.changed.set()                       # attempt is taken back in turn and none ever counts)
                return  # a superseded attempt: a newer pull (or the repair) follows
            del t.inflight[r.bucket]
            g = t.group
            if p.slot is not None and g is not None:
                g.slot_users[p.slot].discard(t.name)
                took = now - g.slot_ready[p.slot]
                g.slot_took[p.slot] = max(took, g.slot_took[p.slot] or 0.0)
            if r.error is None:
                self._took(t, p, now)
                t.have.add(r.bucket)
                if r.plane:
                    t.planes[r.plane] = r.route
                self.emit(t, "pulled", r.bucket, p.source)
                for d in t.dependents:
                    if d.source == t.name:
                        self._feed(d)
                self._maybe_commit(t)
            elif p.source is not None:
                log.info("push %d: %s could not pull bucket %d from relay %s (%s); it will come from the publisher",
                         self.push_id, t.name, r.bucket, p.source, r.error)
                t.orphaned.add(r.bucket)
                if r.error_kind == "relay" and (src := self.targets.get(p.source)) is not None:
                    self._unrelay(src, r.error or "its stamp changed")
            else:
                self.fail(t, SubscriberRejectedError(f"{t.name} failed to pull bucket {r.bucket}: {r.error}"))
        elif r.stage == "dropped":  # another push (another publisher's) superseded this one there
            if not t.committed:
                self.fail(t, SubscriberRejectedError(f"{t.name} dropped the push: {r.error}"))
        elif r.stage == "commit":
            if not t.committing:  # never told to commit (shared: its Commit goes with its Begin): no progress
                log.warning("push %d: %s answered a Commit it was never sent; ignored", self.push_id, t.name)
                return
            if r.error is None:
                if not t.begun:  # (shared: a Begin with its Commit behind it is not answered on its own)
                    t.begun = True
                    self.emit(t, "begun")
                t.committed = True
                t.finished_at = now
                if r.plane:  # (shared: the plane the bank was mapped over)
                    t.planes[r.plane] = r.route
                self.emit(t, "committed")
            elif r.error_kind == "timeout":
                self.fail(t, CommitTimeoutError(f"{t.name}: {r.error}"))
            else:
                self.fail(t, SubscriberRejectedError(f"{t.name} refused the commit: {r.error}"))
        self.changed.set()

    def _maybe_commit(self, t: Target) -> None:
        # (a shared subscriber's Commit travels inside its Begin, sent once the bank is sealed: PushRun._begin)
        if t.alive and (t.begun or (t.shared and t.begin_sent)) and t.complete and not t.committing:
            msg = self._commit_message(t)
            if msg is not None:
                self._committing(t)
                self._send(t, msg)

    def _commit_message(self, t: Target) -> m.Commit | None:
        """The Commit for ``t`` (shared: naming the push's bank, once sealed; else None)."""
        g = t.group
        if not t.shared:
            return m.Commit(self.push_id, self.version)
        if g is not None and g.sealed and g.bank is not None and g.banks is not None:
            return m.Commit(self.push_id, self.version, g.bank, tuple(g.banks.names(g.bank)), g.banks.path(g.bank))
        return None

    def _committing(self, t: Target) -> None:
        t.committing = True
        t.commit_at = time.monotonic()
        self.emit(t, "commit_sent")

    def fail(self, t: Target, exc: BaseException) -> None:
        if t.error is not None or t.committed:
            return
        t.error = exc
        t.finished_at = time.monotonic()
        log.warning("push %d (version %d): %s failed: %s: %s", self.push_id, self.version, t.name,
                    type(exc).__name__, exc)
        self.emit(t, "failed", detail=f"{type(exc).__name__}: {exc}")
        if t.group is not None:
            for users in t.group.slot_users:
                users.discard(t.name)
        for d in t.dependents:  # they pull what they still miss from the publisher
            if d.source == t.name and d.alive:
                self._resource(d, f"its relay {t.name} failed")
        if t.begun or t.begin_sent:  # a direct-mode Begin may still be waiting for the subscriber's readers
            self._send(t, m.Abort(self.push_id, f"{type(exc).__name__}: {exc}"), best_effort=True)
        self.changed.set()

    def _send(self, t: Target, msg: m.Message, best_effort: bool = False) -> None:
        if best_effort:  # an abort goes only over a channel still open to the same incarnation, never a new dial
            p = self.ep.peer(t.name)
            if p is None or p.incarnation != t.layout.incarnation:
                return
        limit = 2.0 if best_effort else max(0.5, self.deadline - time.monotonic())
        payload = m.encode(msg)

        def sent() -> None:
            if t.channel is None and not best_effort:  # (no await since the post: the channel it went over)
                p = self.ep.peer(t.name)
                if p is None:
                    raise transport.PeerLostError(f"the channel to {t.name!r} broke as the push began")
                t.channel = p.channel_id

        # the common case: the channel is open and nothing is held back on it, and no earlier message to
        # this subscriber still waits in a task (it would be overtaken): posted right here. A failure is
        # taken on the next turn of the loop, as a task's would be (not inside the caller's loops)
        try:
            if self._order.now(t.name, payload):
                sent()
                return
        except Exception as exc:  # (the channel broke just now, a message too large to post, ...)
            if not best_effort:
                asyncio.get_running_loop().call_soon(self._post_failed, t, exc)
            return

        async def send() -> None:
            try:
                await self.ep.post(t.name, payload, timeout=limit,  # (answered by its Reply, not an Ack)
                                   reply_expected=REPLY_EXPECTED)
                sent()
            except transport.TransportTimeoutError as exc:
                if not best_effort and t.alive:  # (it ran into the push's deadline)
                    err = self._overdue(t, time.monotonic())
                    err.__cause__ = exc
                    self.fail(t, err)
            except transport.PeerLostError as exc:
                if not best_effort and t.alive:
                    self.fail(t, self._lost_error(t, time.monotonic(), exc))
            except Exception as exc:
                if not best_effort:
                    self.fail(t, exc)

        task = asyncio.ensure_future(send())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self._order.behind(t.name, task)  # (later messages queue behind it)

    def _post_failed(self, t: Target, exc: Exception) -> None:
        """A message to ``t`` could not be posted (raised by ``post_nowait``): ``t`` fails."""
        if isinstance(exc, transport.PeerLostError):
            if t.alive:
                self.fail(t, self._lost_error(t, time.monotonic(), exc))
        else:
            self.fail(t, exc)

    async def _until(self, cond: Callable[[], bool]) -> None:
        while not cond():
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL):
                    await self.changed.wait()

    async def _watchdog(self) -> None:
        """Fails targets whose channel is lost (or answered by another incarnation) or that pass the
        deadline; moves subscribers whose relay leaves their pulls unanswered past the bound to the
        publisher."""
        while True:
            now = time.monotonic()
            took = statistics.median(self.took) if self.took else None
            targets = [t for t in self.targets.values() if t.alive]
            # per group: with no answered pull yet, the pushes before are the yardstick
            bounds = {id(t.group): self._stall_bound(took, t.group) for t in targets}
            for t in targets:
                if not t.alive:  # (failed earlier in this pass)
                    continue
                relay_bound = bounds[id(t.group)]
                p = self.ep.peer(t.name)
                gone = (p is None or p.incarnation != t.layout.incarnation
                        or (t.channel is not None and p.channel_id != t.channel))  # (what was posted may be lost)
                was_gone, t.gone_seen = t.gone_seen, gone
                if gone:
                    # failed at the next pass: a channel is seen closed (its reader thread read the Bye) before
                    # the loop took what the subscriber sent ahead of it (its commit's Reply, queued on the loop)
                    if was_gone:
                        self.fail(t, self._lost_error(t, now))
                elif now >= self.deadline:
                    self.fail(t, self._overdue(t, now))
                elif t.stalled or not t.begun:
                    continue
                elif (now - max(t.heard, t.begin_at) >= relay_bound
                      and (hung := [q for q in t.inflight.values() if now - q.sent >= relay_bound])
                      and any(d.alive and d.source == t.name for d in t.dependents)):
                    if any(q.source is None for q in hung):
                        # a relay that went silent with pulls from the publisher outstanding: its dependents
                        # must not wait for it
                        self._stall(t, f"silent for {now - max(t.heard, t.begin_at):.2f} s with pulls outstanding, "
                                       f"while subscribers relay from it")
                    else:
                        # only its pulls from its own relay hang: that says nothing about it (a get over tcp needs
                        # that relay's process to serve it, and that one may be the frozen one). Its dependents
                        # move to the publisher now, as if it were stalled; it is moved there itself at the next
                        # pass (below), and stalled like any other if its pulls from the publisher hang too
                        for d in t.dependents:
                            if d.alive and d.source == t.name:
                                self._resource(d, f"its relay {t.name} waits for its own relay's answers")
                elif t.source is not None:
                    late = [k for k, q in t.inflight.items() if q.source is not None and now - q.sent >= relay_bound]
                    if late:  # (the relay, or this subscriber itself, is frozen or slow: it is served anew)
                        self._resource(t, f"its pulls of buckets {late} from its relay {t.source} went unanswered "
                                          f"for {relay_bound:.2f} s")
            await asyncio.sleep(POLL)

    def _overdue(self, t: Target, now: float) -> transport.TransportTimeoutError:
        msg = f"subscriber {t.name!r} did not finish version {self.version} before the deadline ({t.doing(now)})"
        if t.committing and (t.begun or t.shared):  # (a shared one is told to commit right behind its Begin)
            return CommitTimeoutError(msg)
        return transport.TransportTimeoutError(msg, Phase.TRANSFER)

    def _lost_error(self, t: Target, now: float, cause: BaseException | None = None) -> transport.PeerLostError:
        err = transport.PeerLostError(f"subscriber {t.name!r} was lost during the push ({t.doing(now)})")
        err.__cause__ = cause
        return err
