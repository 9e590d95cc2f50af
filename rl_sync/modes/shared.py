"""``mode="shared"``: no arenas of its own; the commit re-points the live weights into the publisher's bank."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping

import torch

import transport

from .. import messages as m
from ..banks import BankLease
from ..device import normal_device, wait_events
from .base import CommitMode, Push, Subscriber

__all__ = ["SharedMode"]

log = logging.getLogger("rl_sync.subscriber")


class SharedMode(CommitMode):
    """The live tensors point into a bank of the publisher's (:mod:`rl_sync.banks`), held locked
    shared (:class:`~rl_sync.banks.BankLease`) while they do; a commit maps the bank of its push
    and re-points them there, and :meth:`close` moves them out into private memory."""

    name = "shared"
    nbanks = 0  # the publisher's banks, mapped at commit
    repoints = True
    shared = True

    def __init__(self, sub: Subscriber) -> None:
        super().__init__(sub)
        self._lease: BankLease | None = None  # the lock on the publisher's bank the live tensors point into
        # the publishers' banks mapped here: (publisher, its incarnation, the bank's buffer names) -> (route,
        # arenas). A publisher never registers other memory under a bank's names (they carry a token of the
        # publisher object and a bank index never reused in its process), so a commit naming a bank mapped
        # before needs no registry round trip. An entry goes once the publisher's registry (as it last
        # announced it) no longer names the bank, or its channel is gone (see _prune)
        self._mapped: dict[tuple[str, int, tuple[str, ...]], tuple[transport.Route | None, list[torch.Tensor]]] = {}

    async def commit(self, push: Push, msg: m.Commit) -> None:
        """Shared mode: map the publisher's bank; then, readers held off, lock it shared (checking its
        stamp) and re-point."""
        sub = self.sub

        def refuse(why: str, kind: str = "other") -> None:
            sub._reply(push.publisher, m.Reply(push.push_id, "commit", -1, why, kind, sub._version))

        if len(msg.buffers) != len(sub.manifest.arenas) or not msg.lock:
            refuse(f"the commit names {len(msg.buffers)} bank arenas, the layout has {len(sub.manifest.arenas)}",
                   "plan")
            return
        try:
            route, arenas = await self._map(push.publisher, msg.buffers)
            short = [i for i, (a, n) in enumerate(zip(arenas, sub.manifest.arenas, strict=True)) if a.numel() < n]
            if short:
                refuse(f"bank arenas {short} are smaller than the layout's", "plan")
                return
            away = sorted({str(a.device) for a in arenas if normal_device(a.device) != sub.device})
            if away:  # (a bank on another GPU of this host: the weights would move to that device)
                refuse(f"the publisher's bank is on {', '.join(away)} as mapped here and the model on {sub.device}: "
                       "mode='shared' needs the trainer's weights on the generator's GPU (use another mode)", "plan")
                return
        except Exception as exc:  # (transport, a view that does not fit): refused, answered
            refuse(f"cannot use the publisher's bank {msg.bank}: {type(exc).__name__}: {exc}")
            return
        # no lease on the bank while it waits for readers: one that waits in vain (its push aborted or superseded:
        # it then leaves the lock's queue at once) must not keep the publisher from rewriting the bank
        if not await sub._lock.acquire_write_async(sub.commit_timeout, abandoned=lambda: sub._push is not push):
            if sub._push is not push:
                if not sub._closed:
                    refuse("the push was aborted")
                return
            refuse(f"readers held the weights for more than {sub.commit_timeout} s", "timeout")
            return
        lease: BankLease | None = None
        try:
            if sub._push is not push or sub._closed:  # aborted, superseded or closed meanwhile
                refuse("the push was aborted")
                return
            if (why := sub._changed()) is not None:  # (a tensor of another dtype would read the bank as it)
                refuse(why, "plan")
                return
            try:  # the bank is checked now, with the lock had: a bank rewritten while it waited is refused
                lease = BankLease(msg.lock, push.version, push.push_id)
            except Exception as exc:  # (a stale bank, a lock file that cannot be opened)
                refuse(f"cannot use the publisher's bank {msg.bank}: {type(exc).__name__}: {exc}")
                return
            try:
                sub._repoint(msg.bank, arenas)
            except Exception as exc:  # nothing moved (every place is checked first)
                refuse(f"the bank does not fit the layout: {type(exc).__name__}: {exc}", "plan")
                return
            old, self._lease, lease = self._lease, lease, None
            if old is not None:  # the weights left that bank: the publisher may rewrite it once read
                self._let_go_after_reads(old)
            with sub._version_cond:
                sub._version = push.version
                sub._version_cond.notify_all()
        finally:
            if lease is not None:  # not adopted: let the publisher have that bank back
                lease.release()
            sub._lock.release_write()
            if sub._push is push:
                sub._push = None
        log.debug("subscriber %s: committed version %d (shared bank %d)", sub.endpoint.name, push.version, msg.bank)
        sub._reply(push.publisher, m.Reply(push.push_id, "commit", -1, None, None, sub._version,
                                           plane=route.plane if route else "", route=route.reason if route else ""))

    async def _map(self, publisher: str, buffers: tuple[str, ...]) -> tuple[transport.Route | None,
                                                                           list[torch.Tensor]]:
        """The publisher's bank arenas ``buffers`` mapped here, and the plane that maps them: kept
        from an earlier commit to that bank, else mapped now (a registry round trip per buffer)."""
        ep = self.sub.endpoint
        self._prune()
        before = ep.peer(publisher)
        key = (publisher, before.incarnation, buffers) if before is not None and buffers else None
        hit = self._mapped.get(key) if key is not None else None
        if hit is not None:
            return hit
        route = await ep.map_route(publisher, buffers[0]) if buffers else None
        arenas = [await ep.map(publisher, name) for name in buffers]
        after = ep.peer(publisher)
        if key is not None and after is not None and after.incarnation == key[1]:  # (not across a restart)
            self._mapped[key] = (route, arenas)
        return route, arenas

    def _prune(self) -> None:
        """Let go of the banks their publisher no longer registers (dropped, or the publisher
        closed: its last announced registry does not name them) and those of publishers whose
        channel is gone or answered by another incarnation: their memory is then freed once the
        live weights (if they point into one) leave it too."""
        ep = self.sub.endpoint
        names: dict[str, tuple[int, Mapping[str, object]]] = {}
        for key in list(self._mapped):
            publisher, incarnation, buffers = key
            if publisher not in names:
                peer = ep.peer(publisher)
                names[publisher] = (peer.incarnation, peer.buffers) if peer is not None else (-1, {})  # (a copy)
            live_incarnation, registered = names[publisher]
            if live_incarnation != incarnation or any(b not in registered for b in buffers):
                del self._mapped[key]

    def _let_go_after_reads(self, lease: BankLease) -> None:
        """The weights left ``lease``'s bank: let the publisher have it once the GPU work that
        readers queued inside :meth:`hold` before now is done (they may still read it); at once on
        the CPU. Waits on a thread of its own (not cancelled by :meth:`close`): a reader's kernel
        that never ends keeps that bank, and the publisher writes another."""
        events = self.sub._readers.pending()
        if not events:
            lease.release()
            return

        def wait() -> None:
            while wait_events(events, 60.0):
                log.warning("subscriber %s: GPU reads of an old shared bank still running after 60 s; the bank "
                            "stays locked until they end", self.sub.endpoint.name)
            lease.release()

        threading.Thread(target=wait, name="rl_sync-bank-let-go", daemon=True).start()

    def close(self) -> None:
        """Shared mode, at close: once no reader is in :meth:`hold` (now, or when the last one
        leaves, in whichever thread or task that is), copy the live weights out of the
        publisher's bank into private memory, re-point them there and let the bank go: the model
        keeps its version and the publisher may then rewrite the bank. Until then the bank stays
        locked, so a reader's views of it stay valid. Nothing waits for the readers (no task, no
        waiting writer): new and nested holds go on as before. The copy runs on a thread of its
        own when this is called on an event loop. Any thread."""
        self._mapped.clear()  # (the live tensors keep the mapping of the bank they point into)
        if self._lease is None:
            return
        self.sub._lock.on_idle = self._try_leave
        self._try_leave()

    def _try_leave(self) -> None:
        sub = self.sub
        if self._lease is None or not sub._lock.acquire_write(0):
            return  # readers (or a commit) hold the lock: the last to leave calls this again (on_idle)
        sub._lock.on_idle = None
        try:  # the writer lock is had: nobody reads, so the copy may run on any thread, never the event loop's
            asyncio.get_running_loop()
        except RuntimeError:
            self._leave_locked()
            return
        # (not a daemon: the interpreter's exit waits for the copy; a daemon thread still copying when the
        # process ended took the GIL during finalization and aborted the process, "terminate called")
        try:
            threading.Thread(target=self._leave_locked, name="rl_sync-leave-bank", daemon=False).start()
        except RuntimeError:  # no thread to be had (at the interpreter's exit, say): copy here, never keep the lock
            self._leave_locked()

    def _leave_locked(self) -> None:
        """With the writer lock had: move the weights into private memory, let the bank go, unlock.
        On a GPU the copies run on the copier's stream once the reads queued in :meth:`hold` are
        done, and the bank goes only after the copies are."""
        sub = self.sub

        def move() -> None:
            for t, own in zip(sub._live.values(), owns, strict=True):
                own.copy_(t)
                t.set_(own.untyped_storage(), 0, own.shape, own.stride())

        try:  # (allocated on this thread's current stream, as the model's own memory is: not the copier's)
            owns = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in sub._live.values()]
            sub._copier.run_blocking(move, sub._readers.pending())
            sub._live_bank = None
            if self._lease is not None:
                self._lease.release()
                self._lease = None
        except Exception:  # (out of memory): keep the bank locked, so the weights stay whole where they are
            log.exception("subscriber %s: could not copy the weights out of the publisher's bank at close; "
                          "the bank stays locked while this process lives", sub.endpoint.name)
        finally:
            sub._lock.release_write()
