"""Generator side: receive buffers, serve pushes, apply commits atomically.

A :class:`WeightSubscriber` registers its staging arenas and its manifest on the endpoint and then serves
pushes on the endpoint's event loop, with no call from the application: it answers the publisher's
``Begin``, pulls each bucket into its staging arena when told to (a one-sided ``get`` from the bucket's
source), and on ``Commit`` copies staging into the live weights while holding the writer side of a
readers-writer lock. Readers (:meth:`WeightSubscriber.hold`) therefore never see two versions at once, and a
push that fails or is cancelled before its commit leaves the live weights untouched. ``mode="direct"``
trades that last property for memory: the live weights are the arena, written while readers are held off for
the whole push, and a push that fails after its first byte leaves them *torn*: :meth:`hold` then waits for
the next successful commit. ``mode="shared"`` registers no arenas at all: it is sent no pulls, and its
commit re-points the live weights into the publisher's bank that holds the version (:mod:`rl_sync.banks`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

import msgspec
import torch

import transport

from . import messages as m
from .device import Copier, ReaderMarks, one_device
from .given import GivenTensors
from .holding import Holding
from .modes import MODES, CommitMode, Push, make_mode
from .plan import (
    MANIFEST_BUFFER,
    Bucket,
    Manifest,
    build_manifest,
    encode_manifest,
    host_key,
    make_buckets,
    plan_hash,
)
from .posting import InOrder, post_in_order
from .relay_stamp import STAMP_BUFFER, Stamps, check_relay, pull_ranges
from .rwlock import RWLock
from .weights import live_tensors, repoint, shared_memory

__all__ = ["WeightSubscriber", "host_key", "live_tensors"]

log = logging.getLogger("rl_sync.subscriber")


class WeightSubscriber(Holding):
    """Receives versioned weight pushes into ``model_or_state_dict``.

    Constructing it registers its buffers on ``endpoint`` (one staging arena
    per ``arena_bytes`` of weights, per bank, plus a small manifest; shared
    mode: the manifest only) and starts serving
    pushes for as long as the endpoint is open; the endpoint may be open
    already or opened later. Call it on the endpoint's event loop thread.

    Parameters:
        endpoint: an open (or not yet opened) :class:`transport.Endpoint`.
        model_or_state_dict: an ``nn.Module`` (its ``state_dict()``) or a
            mapping of name -> tensor; the tensors are updated in place.
        mode: ``"staged"`` (default): bytes land in staging arenas while
            readers keep running on the current weights; the commit copies
            them in while :meth:`hold` is blocked. ``"swap"``: two banks of
            arenas; a push fills the bank the weights do not use and the
            commit re-points every live tensor into it (``Tensor.set_``, no
            copy), so a commit costs microseconds instead of a pass over the
            weights. Swap needs a model (CPU or GPU) that keeps no other
            alias of its weights (a view taken before a commit keeps the old
            bank, which the next push overwrites: take views inside
            :meth:`hold` and drop them when it ends). The modes that
            re-point (swap, direct, shared) refuse tensors that share memory
            with other tensors given (views of one tensor, e.g. a fused
            weight given as row views: use staged, which copies into them);
            one tensor under several names (tied weights) is fine. Memory is the same in
            both modes, the live weights plus one copy, except that in swap
            mode the tensors the model was built with stay allocated until
            the first commit re-points them.
            ``"direct"``: one copy of the weights, no more: the live tensors
            are re-pointed into the arenas (as in swap, with the same
            requirements) and a push writes into them while :meth:`hold`
            is blocked, from ``Begin`` (which waits for readers to leave, up
            to ``commit_timeout``) to the commit. A push that fails after
            its first byte landed leaves the weights torn (:attr:`torn`):
            :meth:`hold` waits until a later push commits. For models that
            cannot afford a second copy and can pause reading for a push.
            ``"shared"``: no copy of the weights of its own: on the
            publisher's host, every shared subscriber's live tensors point
            into one of the publisher's banks (:mod:`rl_sync.banks`); a
            push is packed once into a bank no subscriber uses, and the
            commit re-points the live tensors into it (as in swap, with the
            same requirements). N local subscribers cost the trainer one
            pass over the weights and themselves nothing. CPU weights: the
            banks are in the trainer's shared memory, mapped read-only;
            writing into the weights kills the process (SIGSEGV) instead of
            changing the other subscribers' weights. GPU weights: the banks
            are on the trainer's GPU (which must be the model's), mapped
            over ``cuda_ipc``; CUDA maps them read-write, so a write into
            the weights (an in-place op, a fused kernel writing its input)
            changes the bank, and with it every subscriber reading that
            bank, until the next push re-points them into a fresh one:
            keep the weights read-only in your code. A bank is let go only
            once the GPU work that readers queued inside :meth:`hold` is
            done. The generators also depend on the trainer process: CUDA
            leaves the memory of an exporting process that exited
            undefined, so if the trainer dies, close or restart them.
            :meth:`close` copies the weights into private memory (one
            pass, once no reader is in :meth:`hold`), so the model keeps
            its last version and becomes writable. CPU readers fault the
            pages of each bank in on their first pass over it. A publisher
            on another host fails this subscriber's entry (it cannot map
            the banks).
        arena_bytes: largest arena (a tensor larger than that gets an arena
            of its own).
        commit_timeout: how long a commit waits for readers to leave
            :meth:`hold` before it fails (the push then reports a timeout
            for this subscriber and the weights stay as they were). In
            direct mode: how long ``Begin`` waits for readers, and how long
            a push may go without progress before the subscriber gives it up
            and lets readers back in (a publisher that died mid-push).
    """

    def __init__(self, endpoint: transport.Endpoint, model_or_state_dict: Any, *, mode: str = "staged",
                 arena_bytes: int = 1 << 30, commit_timeout: float = 30.0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if arena_bytes < 64:
            raise ValueError(f"arena_bytes must be >= 64, got {arena_bytes}")
        self.endpoint = endpoint
        self.mode = mode
        self.commit_timeout = commit_timeout
        self._strategy: CommitMode = make_mode(mode, self)  # what differs between the modes (rl_sync.modes)
        self._live = live_tensors(model_or_state_dict, keep_vars=self._strategy.repoints)
        self._places: dict[Any, Any] = {}  # repoint()'s memo for the whole manifest
        # the model's own tensor objects (staged: _live holds detached aliases of them): a commit refuses
        # tensors the application gave other memory or another dtype since (rl_sync.given)
        self._given = GivenTensors(self._live if self._strategy.repoints
                                   else live_tensors(model_or_state_dict, keep_vars=True), self._live,
                                   dtype_only=self._strategy.repoints and not self._strategy.writes_live)
        if not self._live:
            raise ValueError("the model has no tensors to receive")
        self.device = one_device(self._live)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"the model is on {self.device}: rl_sync receives into CPU or CUDA tensors")
        if self._strategy.repoints and (aliased := shared_memory(self._live)):
            raise ValueError(f"mode={mode!r} re-points each tensor into an arena (Tensor.set_), which would leave "
                             f"the tensors sharing its memory behind: {'; '.join(', '.join(g) for g in aliased)} "
                             f"share memory (views); pass one tensor per memory, or use mode='staged', which "
                             f"copies into the tensors (views included)")
        self._copier = Copier(self.device)  # the staged commit's copies and direct mode's first move (GPU: a stream)
        self._readers = ReaderMarks(self.device)  # GPU: where readers left hold(), waited for before weights change
        self.manifest: Manifest = build_manifest(self._live, arena_bytes, host_key(), shared=self._strategy.shared)
        self._banks: list[list[torch.Tensor]] = []
        self._live_bank: int | None = None  # swap/direct: the bank the live tensors point into (None: their own memory)
        self._torn = False  # direct: a push wrote into the live weights and did not commit
        self._plans: dict[int, tuple[list[Bucket], str]] = {}
        self._lock = RWLock()
        self._version = 0
        self._version_cond = threading.Condition()
        self._push: Push | None = None
        self._starting: set[Push] = set()  # pushes whose Begin is being served (waiting for a commit, pulls, readers)
        # (publisher, push id) of each Begin being served -> the Commit that came with it (shared mode: inside
        # the Begin) or meanwhile, served once that Begin is
        self._beginning: dict[tuple[str, int], m.Commit | None] = {}
        # Aborts that came before their push's Begin was served (the Begin's task had not run yet): that
        # Begin is refused (a frozen subscriber, let go, reads both at once); the newest few are kept
        self._aborted: collections.deque[tuple[str, int]] = collections.deque(maxlen=64)
        self._draining: set[asyncio.Task[Any]] = set()  # pulls of dropped pushes, cancelled, not yet over
        self._applying = asyncio.Lock()  # held while a commit copies staging into the live weights
        self._tasks: set[asyncio.Task[Any]] = set()
        self._replies: set[asyncio.Task[Any]] = set()  # replies posted by a task: close() lets them go out
        self._order = InOrder(endpoint)  # replies to each publisher in order (_reply)
        self._closed = False
        self._names: list[str] = []
        self._stamps: Stamps | None = None  # each bank's stamp: relays' dependents check their bytes (not shared)
        manifest_bytes = encode_manifest(self.manifest)
        self._manifest_tensor = torch.frombuffer(bytearray(manifest_bytes), dtype=torch.uint8)
        try:
            self._strategy.make_banks()  # (shared: none, the publisher's banks are mapped at commit)
            if not self._strategy.shared:
                self._stamps = Stamps(endpoint, self._strategy.nbanks)
                self._names.append(STAMP_BUFFER)
            endpoint.register(MANIFEST_BUFFER, self._manifest_tensor)
            self._names.append(MANIFEST_BUFFER)
        except BaseException:
            self._unregister()
            raise
        endpoint.on_notification(self._on_message, prefix=m.TO_SUBSCRIBER)
        log.info("subscriber %s: %d tensors, %.1f MiB in %d arenas x %d banks, mode %s", endpoint.name,
                 len(self._live), sum(self.manifest.arenas) / 2**20, len(self.manifest.arenas), self._strategy.nbanks, mode)

    # ------------------------------------------------------------------ public
    @property
    def version(self) -> int:
        """The committed version (0 before the first commit)."""
        return self._version

    @property
    def nbytes(self) -> int:
        return sum(self.manifest.arenas)

    @property
    def torn(self) -> bool:
        """Direct mode only: a push wrote into the live weights and never committed. :meth:`hold`
        waits while this is true; the next successful push clears it."""
        return self._torn

    def close(self) -> None:
        """Stop serving pushes and unregister the buffers (idempotent). Call on the loop thread."""
        if self._closed:
            return
        self._closed = True
        with self._version_cond:  # blocking holders waiting for torn weights to heal: they now raise
            self._version_cond.notify_all()
        refuse = weakref.WeakMethod(self._refuse_closed)  # later Begins: a prompt no (the route keeps no subscriber)
        self.endpoint.on_notification(lambda note: (f := refuse()) is not None and f(note), prefix=m.TO_SUBSCRIBER)
        pending = {(p.publisher, p.push_id) for p in (self._push, *self._starting) if p is not None and not p.applying}
        for push in [p for p in (self._push, *self._starting) if p is not None]:
            self._drop(push, "the subscriber was closed")
        # their publishers (and those of Begins not started) are told; a commit changing the weights answers itself
        for peer, push_id in sorted(pending | set(self._beginning)) if self.endpoint.is_open else ():
            self._reply(peer, m.Reply(push_id, "dropped", -1, "the subscriber was closed", "other", self._version))
        self._beginning.clear()
        if self._stamps is not None:  # (first: no bank holds a push for the relays' dependents any more)
            self._stamps.clear()
        for t in list(self._tasks):
            t.cancel()
        self._strategy.close()  # shared: the weights move out of the publisher's bank, then it is let go
        if self.endpoint.is_open:
            self._unregister()

    def _refuse_closed(self, note: transport.Notification) -> None:
        with contextlib.suppress(ValueError, msgspec.DecodeError):
            if isinstance(msg := m.decode(note.payload), m.Begin) and self.endpoint.is_open:
                self._reply(note.peer, m.Reply(msg.push_id, "begin", -1, "the subscriber was closed", "other",
                                               self._version))

    def _unregister(self) -> None:
        for name in self._names:  # (no copy back: the live tensors keep their arena's segment, no peer writes it)
            with contextlib.suppress(transport.TransportError):
                self.endpoint.unregister(name, copy_back=False)
        self._names.clear()

    # ------------------------------------------------------------------ serving
    def plan(self, bucket_bytes: int) -> tuple[list[Bucket], str]:
        got = self._plans.get(bucket_bytes)
        if got is None:  # (a few kept: one per publisher's bucket size, not one per size ever asked for)
            buckets = make_buckets(self.manifest, bucket_bytes)
            if len(self._plans) >= 4:
                self._plans.pop(next(iter(self._plans)))
            got = self._plans[bucket_bytes] = (buckets, plan_hash(self.manifest, buckets))
        return got

    def _on_message(self, note: transport.Notification) -> None:
        try:
            msg = m.decode(note.payload)
        except (ValueError, msgspec.DecodeError) as exc:
            log.warning("subscriber %s: malformed rl_sync message from %s dropped: %s", self.endpoint.name, note.peer, exc)
            return
        if isinstance(msg, m.Begin):
            key = (note.peer, msg.push_id)
            self._beginning.setdefault(key, None)
            if msg.commit is not None and msg.commit.push_id == msg.push_id:  # (shared: served once it began)
                self._beginning[key] = msg.commit
            self._spawn(self._begin(note.peer, msg))
        elif isinstance(msg, m.Pull):
            push = self._current(note.peer, msg.push_id)
            if push is None:
                self._reply(note.peer, m.Reply(msg.push_id, "pull", msg.bucket, "no such push in progress", "other"))
            elif not 0 <= msg.bucket < len(push.buckets):
                self._reply(note.peer, m.Reply(msg.push_id, "pull", msg.bucket, f"bucket {msg.bucket} is out of range", "plan"))
            else:
                push.pulled = True
                push.progress = time.monotonic()
                # a newer Pull of a bucket supersedes the older one (the publisher took its slot back, or
                # gave up its relay): that pull is cancelled and the new one starts once it is over
                older = push.by_bucket.get(msg.bucket)
                if older is not None:
                    older.cancel()
                task = self._spawn(self._pull(push, msg, older))
                push.by_bucket[msg.bucket] = task
                push.pulls.add(task)
                task.add_done_callback(push.pulls.discard)
        elif isinstance(msg, m.Commit):
            push = self._current(note.peer, msg.push_id)
            key = (note.peer, msg.push_id)
            if push is None and self._strategy.shared and key in self._beginning and self._beginning[key] is None:
                self._beginning[key] = msg  # sent right behind its Begin (shared mode): served once that Begin is
            else:
                self._commit(note.peer, push, msg)
        elif isinstance(msg, m.Abort):
            push = self._current(note.peer, msg.push_id)
            if push is None:  # its Begin may still be waiting (for a commit, old pulls, readers): it will not begin
                push = next((p for p in self._starting if (p.publisher, p.push_id) == (note.peer, msg.push_id)), None)
            if push is not None:
                log.info("subscriber %s: push %d aborted by %s: %s", self.endpoint.name, msg.push_id, note.peer, msg.reason)
                self._drop(push, f"aborted by {note.peer}: {msg.reason}")
            else:
                self._aborted.append((note.peer, msg.push_id))
        else:
            log.warning("subscriber %s: unexpected %s from %s", self.endpoint.name, type(msg).__name__, note.peer)

    def _commit(self, peer: str, push: Push | None, msg: m.Commit,
                spawn: bool = True) -> Coroutine[Any, Any, None] | None:
        """Serve a Commit for ``push`` (None: not the push in progress: refused, answered) in a task
        of its own; ``spawn=False``: return the commit's coroutine for the caller to await instead
        (None when refused)."""
        if push is not None:
            push.progress = time.monotonic()
        if push is None or push.version != msg.version:
            self._reply(peer, m.Reply(msg.push_id, "commit", -1, "no such push in progress", "other"))
        elif not self._strategy.shared and len(push.done) != len(push.buckets):  # (shared: no pulls)
            self._reply(peer, m.Reply(msg.push_id, "commit", -1,
                                      f"{len(push.buckets) - len(push.done)} buckets missing", "other"))
        elif not spawn:
            return self._strategy.commit(push, msg)
        else:
            self._spawn(self._strategy.commit(push, msg))
        return None

    def _current(self, peer: str, push_id: int) -> Push | None:
        push = self._push
        return push if push is not None and push.publisher == peer and push.push_id == push_id else None

    async def _begin(self, peer: str, msg: m.Begin) -> None:
        try:
            await self._begin_checked(peer, msg)
        except BaseException:  # a Commit that came while this Begin was served is served now (refused unless it began)
            early = self._beginning.pop((peer, msg.push_id), None)
            if early is not None:
                self._commit(peer, self._current(peer, msg.push_id), early)
            raise
        early = self._beginning.pop((peer, msg.push_id), None)
        if early is not None:  # (shared mode's Commit inside its Begin: served in this task, no other one)
            commit = self._commit(peer, self._current(peer, msg.push_id), early, spawn=False)
            if commit is not None:
                await commit

    async def _begin_checked(self, peer: str, msg: m.Begin) -> None:
        if (peer, msg.push_id) in self._aborted:
            self._reply(peer, m.Reply(msg.push_id, "begin", -1, "the push was aborted before it began", "other",
                                      self._version))
            return
        if msg.version <= self._version:
            self._reply(peer, m.Reply(msg.push_id, "begin", -1,
                                      f"version {msg.version} is not newer than the committed {self._version}", "stale",
                                      self._version))
            return
        try:
            buckets, digest = self.plan(msg.bucket_bytes)
        except ValueError as exc:
            self._reply(peer, m.Reply(msg.push_id, "begin", -1, str(exc), "plan", self._version))
            return
        if digest != msg.plan_hash:
            self._reply(peer, m.Reply(msg.push_id, "begin", -1,
                                      f"plan hash {msg.plan_hash} differs from the subscriber's {digest}", "plan",
                                      self._version))
            return
        moving = self._strategy.moving  # (direct: checked before any byte lands; not while its first move re-points)
        if self._strategy.writes_live and not moving and (why := self._changed()) is not None:
            self._reply(peer, m.Reply(msg.push_id, "begin", -1, why, "plan", self._version))
            return
        push = Push(peer, msg.push_id, msg.version, buckets, 0)
        push.unchecked = moving
        # a later Begin supersedes what has not committed (its publisher is told, else it waits for its deadline; a
        # commit whose copy runs commits, answering itself); this one can then be aborted or superseded in turn
        for old in [p for p in (self._push, *self._starting) if p is not None]:
            self._drop(old, f"superseded by push {msg.push_id} of {peer}")
            if not old.applying:
                self._reply(old.publisher, m.Reply(old.push_id, "dropped", -1, f"superseded by push {msg.push_id} "
                                                   f"of {peer}", "other", self._version))
        self._starting.add(push)
        try:
            await self._start(push)
        finally:
            self._starting.discard(push)

    async def _start(self, push: Push) -> None:
        peer, push_id = push.publisher, push.push_id
        # a commit still applying reads the staging arenas: the next push may write them only after it
        async with self._applying:
            pass
        if self._draining:  # the superseded pushes' pulls were cancelled: none may write once this one begins
            _, late = await asyncio.wait(set(self._draining), timeout=self.commit_timeout)
            if late and not push.dropped:
                self._reply(peer, m.Reply(push_id, "begin", -1,
                                          f"{len(late)} pulls of an abandoned push are still running", "other",
                                          self._version))
                return
        if push.dropped or push.version <= self._version:  # aborted, superseded or overtaken meanwhile
            self._reply(peer, m.Reply(push_id, "begin", -1, "the push was aborted or superseded" if push.dropped else
                                      f"version {push.version} is not newer than the committed {self._version}",
                                      "other" if push.dropped else "stale", self._version))
            return
        if not await self._strategy.begin(push) or push.dropped:  # (direct: the writer lock; swap: readers' GPU work;
            return  # dropped meanwhile: its publisher was told, and a newer push may be current: it must stay so)
        push.bank = 0 if self._live_bank is None or len(self._banks) != 2 else 1 - self._live_bank
        # a new stamp for the bank before any byte of this push lands there (relays' dependents: rl_sync.relay_stamp)
        stamp = self._stamps.renew(push.bank) if self._stamps is not None else 0
        if self._push is not None:  # (cannot be: every Begin drops it; kept as a guard)
            self._drop(self._push, f"superseded by push {push_id} of {peer}")
        self._push = push
        if self._strategy.shared and self._beginning.get((peer, push_id)) is not None:
            return  # its Commit came right behind it and is served next: that answer says it began (one message)
        self._reply(peer, m.Reply(push_id, "begin", -1, None, None, self._version, push.bank, stamp=stamp))

    def _drop(self, push: Push, why: str) -> None:
        """Forget ``push`` (aborted, superseded, stalled, closed): cancel its pulls (the next Begin waits for them to
        end: none writes late); its commit (direct: Begin) waiting for the writer lock leaves the queue; direct: readers in."""
        push.dropped = True
        if self._push is push:
            self._push = None
        self._lock.wake()  # (its waiting commit stops keeping new readers out: acquire_write_async(abandoned=))
        for task in list(push.pulls):
            task.cancel()
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)
        if push.locked and not push.moving:  # (a move in progress gives the lock back itself once it ended)
            push.locked = False
            self._lock.release_write()
            log.debug("subscriber %s: push %d dropped (%s); torn=%s", self.endpoint.name, push.push_id, why, self._torn)

    async def _pull(self, push: Push, msg: m.Pull, older: asyncio.Task[Any] | None = None) -> None:
        b = push.buckets[msg.bucket]
        dest = self._banks[push.bank][b.arena][b.offset:b.offset + b.nbytes]
        if older is not None:  # superseded and cancelled: its get leaves nothing behind once it is over
            await asyncio.wait({older})
        if push.dropped:
            return
        if self._strategy.writes_live:  # direct
            if not push.locked:  # given up meanwhile: the live weights are no longer ours to write
                self._reply(push.publisher, m.Reply(push.push_id, "pull", msg.bucket, "the push was given up", "other"))
                return
            self._torn = True  # from here on, the live weights may hold bytes of an uncommitted version
        try:
            where = pull_ranges(b, dest, msg)
        except ValueError as exc:
            self._reply(push.publisher, m.Reply(push.push_id, "pull", msg.bucket, str(exc), "plan", attempt=msg.attempt))
            return
        push.done.discard(msg.bucket)  # (its bytes are being replaced)
        try:
            route = push.routes.get(msg.source)
            if route is None:  # which plane its bytes take, and why: for the push report (once per source)
                route = push.routes[msg.source] = await self.endpoint.route(msg.source, where)
            await self.endpoint.get(msg.source, where)
            # from a relay: its bytes count only if its stamp of the bank, read after them, is still this push's
            if (stale := await check_relay(self.endpoint, msg) if msg.source != push.publisher else None) is not None:
                self._reply(push.publisher, m.Reply(push.push_id, "pull", msg.bucket, stale, "relay",
                                                    attempt=msg.attempt))
                return
        except Exception as exc:
            self._reply(push.publisher, m.Reply(push.push_id, "pull", msg.bucket, f"{type(exc).__name__}: {exc}", "other",
                                                attempt=msg.attempt))
            return
        finally:
            push.progress = time.monotonic()  # finished either way: the publisher may now repair it
        push.done.add(msg.bucket)
        self._reply(push.publisher, m.Reply(push.push_id, "pull", msg.bucket, attempt=msg.attempt, plane=route.plane,
                                            route=route.reason))

    def _repoint(self, bank: int, arenas: Sequence[torch.Tensor] | Mapping[int, torch.Tensor] | None = None,
                 entries: Sequence[Any] | None = None) -> None:
        """Point every live tensor (or those of ``entries``) into ``arenas`` (default: our bank ``bank``)."""
        arenas = self._banks[bank] if arenas is None else arenas
        if entries is None:  # (the whole manifest: its places are kept per arena geometry)
            repoint(self._live, self.manifest.entries, arenas, self._places)
        else:
            repoint(self._live, entries, arenas)
        self._given.moved(self._live, (e.name for e in (self.manifest.entries if entries is None else entries)))
        if entries is None:
            self._live_bank = bank

    def _changed(self) -> str | None:
        """Why the model's tensors are no longer what this subscriber writes (:mod:`rl_sync.given`)."""
        return self._given.changed()

    def _reply(self, peer: str, reply: m.Reply) -> None:
        # (in order; unanswered. A reply's task is not one close() cancels: a commit's reply must reach its
        # publisher when the application closes right after it; the post is bounded by the endpoint's timeout)
        post_in_order(self._order, self.endpoint, peer, m.encode(reply), lambda c: self._spawn(c, self._replies))

    def _spawn(self, coro: Any, tasks: set[asyncio.Task[Any]] | None = None) -> asyncio.Task[Any]:
        tasks = self._tasks if tasks is None else tasks
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    def __repr__(self) -> str:
        return f"<WeightSubscriber {self.endpoint.name!r} version={self._version} pid={os.getpid()}>"
