"""Trainer side: plan once per subscriber, then each step pack -> pull -> commit.

Theory of operation, one :meth:`WeightPublisher.push`:

1. **Plan** (cached per subscriber incarnation): connect, ``get`` the
   subscriber's manifest, cut it into buckets, hash the layout, and check the
   trainer's tensors against it (names through ``name_map``, shapes, dtypes
   after the ``dtype`` cast). Any difference raises :class:`PlanMismatchError`
   listing all of them, before any byte moves. Subscribers with the same
   layout form a *group* and share the publisher's send slots.
2. **Begin**: every subscriber checks the version (strictly newer) and the
   plan hash, and answers. Nothing waits for all of them: a group starts at
   its first answer (the others are given as long again), and a subscriber
   that answers later gets what it missed in the repair pass.
3. **Buckets**: per group, the publisher packs bucket k (casting to the
   subscriber's dtype) into a free send slot of two (double buffering:
   packing k+1 overlaps the pulls of k) and tells each subscriber that has
   begun and whose source is the publisher to pull it; a subscriber that has
   a bucket tells the publisher, which then tells the subscribers relaying
   from it (see :mod:`rl_sync.fanout`). A slot is reused once every
   subscriber pulling from it answered, or, when one leaves it unanswered
   past the *stall bound* (4x the slowest answered pull of that slot, at
   least 0.25 s; with none, 4x the median answered pull of the push, or of
   the previous push; ``stall_timeout`` before any pull ever answered; its
   slack capped at an eighth of the push's timeout, but never below twice an
   answered pull; at least 0.25 s) while a subscriber that holds no slot
   waits for one, without it: that subscriber is *stalled* (no new pulls
   until it answers a pull, and then everything it missed meanwhile is
   repaired;
   its unanswered slot pulls are superseded by a newer attempt later, since
   the slot's bytes changed under them) and its dependents pull from the
   publisher. A relay that has not begun when the group starts, or that goes
   silent with pulls outstanding while others relay from it, is dropped as
   a source the same way. After the main pass, the *repair pass* serves each
   subscriber what it misses (a late Begin, a superseded pull, a failed
   relay) from the publisher.
4. **Commit**: a subscriber holding every bucket is told to commit, and
   applies the version atomically with respect to its readers. A
   ``mode="shared"`` subscriber pulls nothing: a group of them only is
   packed into a bank without waiting for the Begin answers, and each is
   told to commit once the bank is sealed, answered or not (the Commit
   follows the Begin on the channel; see :mod:`rl_sync.banks`).

Failures are per subscriber: a lost peer (its channel closed, or another
incarnation answers), an error reply, or the push's deadline fail that
subscriber's entry only (its message says what it was doing: no answer to
Begin, the buckets it held and its pulls outstanding, or no answer to
Commit), and it is told to abort (nothing applied; the push does not wait
for that message). A subscriber whose relay source fails or stalls pulls
the missing buckets from the publisher instead. The publisher's memory stays
bounded: two slots of at most ``bucket_bytes`` per group.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

import transport

from . import messages as m
from .banks import BankSet
from .device import Copier, caller_marks, pack_device
from .errors import PlanMismatchError, RlSyncError, StaleVersionError, SubscriberNotReadyError
from .fanout import FANOUTS, assign_sources
from .plan import MANIFEST_BUFFER, NameMap, SourceMemo, decode_manifest, make_buckets, plan_hash
from .pub_buffers import PublisherBuffers
from .push_run import PushRun
from .push_state import Group, Layout, Target, route_of, unshareable
from .report import PushEvent, PushReport, SubscriberResult
from .subscriber import live_tensors

__all__ = ["WeightPublisher"]

log = logging.getLogger("rl_sync.publisher")

_PROBE = 0.5  # seconds a push waits for a planned subscriber that has no channel (lost, killed, restarting)


class WeightPublisher(PublisherBuffers):
    """Pushes versions of a model's weights to subscribers (generators).

    Parameters:
        endpoint: the trainer's open :class:`transport.Endpoint`.
        subscribers: endpoint names of the :class:`rl_sync.WeightSubscriber` s;
            change the set later with :meth:`add_subscriber` / :meth:`remove_subscriber`.
        dtype: cast floating-point tensors on the way: a dtype (float32 trainer
            -> ``torch.bfloat16`` generators), ``"auto"`` (to whatever floating-point
            dtype each subscriber holds for that tensor, for mixed-precision
            generators), or None (no cast; dtypes must match). Integer and bool
            tensors are never cast.
        bucket_bytes: largest bucket (rounded down to a multiple of 64); the
            publisher holds two send slots of at most this size per layout.
        name_map: trainer name -> generator name, as a mapping (names not in it
            are kept) or a callable (returning None drops the tensor; it must give
            the same answer for the same name: a push calls it again only when the
            trainer's names, shapes or dtypes changed).
        fanout: ``"auto"`` (same host: everyone reads the one packed copy; other
            hosts: a two-level tree), ``"direct"`` or ``"chain"``; see :mod:`rl_sync.fanout`.
        connect_timeout: how long a push waits for each subscriber to answer
            the connect and manifest read; one that does not fails its entry.
            A subscriber planned before that has no channel now (lost at an
            earlier push, or killed since) is waited for 0.5 s only, so a dead
            one delays the others' push by at most that.
        shared_banks: for subscribers in ``mode="shared"``: how many whole
            copies of their layout the publisher keeps (made at the first push
            that has one; see :mod:`rl_sync.banks`). A push writes one that no
            subscriber's weights use; while subscribers stuck on older versions
            hold every bank, one more is made (logged) and later dropped.
        stall_timeout: how long a pull of a send slot may go unanswered, while
            another subscriber waits for a slot, before the slot is taken
            back from it, when no pull has ever been answered to compare it
            with (see :meth:`push`). With a comparison, the bound is ``4x``
            the slowest answered pull of the slot, or with none ``4x`` the
            median answered pull of the push (or of the previous push), at
            least 0.25 s. The slack is capped at an eighth of the push's
            ``timeout`` (never below twice an answered pull), so a frozen
            subscriber leaves the others most of the deadline even on a first
            push or a loaded host, while a healthy slow one still finishes.
        observer: called on the event loop with a :class:`rl_sync.PushEvent`
            at every step of every subscriber (begin, each bucket, stalls,
            commit, failure); for progress displays, tests and benchmarks. It
            must not block; an exception it raises is logged and ignored.
        live: serve pulls from the trainer's own tensors, with no send slot
            and no pack: each subscriber copies the bytes straight out of
            them (``cuda_ipc``: one device-to-device copy into its arena,
            which in ``mode="direct"`` is its live weights; the colocated RL
            case). Taken per layout, when no tensor needs a cast and every
            one is contiguous, and none of the layout's subscribers is in
            ``mode="shared"``. ``"auto"`` (default): when the trainer's
            tensors are on a GPU (registering a GPU tensor moves nothing).
            ``True``: on the CPU too, where registering copies a tensor that
            is not in shared memory already into a segment of the endpoint's
            (an alias of it is registered; the trainer's tensor is untouched),
            at every push, so it saves nothing over packing: for tests, and for
            tensors made by :meth:`transport.Endpoint.new_buffer`. ``False``:
            always pack. The tensors stay registered on the endpoint until
            :meth:`close` (registered again when their memory changes);
            subscribers read them during the push, after the work queued on
            the caller's stream at ``push()``, so they must not change until
            it returns.

    One push runs at a time; call it from the endpoint's event loop.
    """

    def __init__(self, endpoint: transport.Endpoint, subscribers: list[str] | tuple[str, ...], *,
                 dtype: torch.dtype | str | None = None, bucket_bytes: int = 256 << 20, name_map: NameMap | None = None,
                 fanout: str = "auto", connect_timeout: float = 5.0, shared_banks: int = 2,
                 stall_timeout: float = 5.0, observer: Callable[[PushEvent], Any] | None = None,
                 live: bool | str = "auto") -> None:
        if dtype is not None and dtype != "auto" and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype, 'auto' or None, got {dtype!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 64:
            raise ValueError(f"bucket_bytes must be an int >= 64, got {bucket_bytes!r}")
        if fanout not in FANOUTS:
            raise ValueError(f"fanout must be one of {FANOUTS}, got {fanout!r}")
        if name_map is not None and not (callable(name_map) or isinstance(name_map, Mapping)):
            raise TypeError("name_map must be a mapping or a callable")
        self.endpoint = endpoint
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes // 64 * 64
        self.name_map = name_map
        self.fanout = fanout
        if connect_timeout <= 0:
            raise ValueError(f"connect_timeout must be > 0, got {connect_timeout}")
        self.connect_timeout = connect_timeout
        if isinstance(shared_banks, bool) or not isinstance(shared_banks, int) or shared_banks < 2:
            raise ValueError(f"shared_banks must be an int >= 2, got {shared_banks!r}")
        self.shared_banks = shared_banks
        if not stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0, got {stall_timeout!r}")
        if observer is not None and not callable(observer):
            raise TypeError("observer must be callable")
        if live not in (True, False, "auto"):
            raise ValueError(f"live must be True, False or 'auto', got {live!r}")
        self.live = live
        self._live: dict[str, torch.Tensor] = {}  # buffer name -> the alias of a trainer tensor registered under it
        self.stall_timeout = float(stall_timeout)
        self._pull_medians: dict[str, float] = {}  # layout digest -> its latest push's median pull (push_track)
        self.observer = observer
        self._background: set[asyncio.Task[Any]] = set()  # best-effort Aborts of ended pushes, each bounded
        self._bank_sets: dict[str, BankSet] = {}
        self._committed: dict[str, int] = {}  # subscriber -> the last version it committed from this publisher
        self._lock_dir: str | None = None
        self._lock_dir_gone: Callable[[], Any] = lambda: None
        self._subscribers: list[str] = []
        for s in subscribers:
            self.add_subscriber(s)
        self._version = 0
        self._layouts: dict[str, Layout] = {}
        self._sources = SourceMemo()  # the trainer's tensors mapped onto each layout's entries
        self._slots: dict[str, tuple[list[str], list[torch.Tensor]]] = {}
        self._push_ids = itertools.count(secrets.randbits(40))
        self._run: PushRun | None = None
        self._pushing = False  # a push() is under way (from its checks on: _run is set only after awaits)
        self._lost: set[str] = set()  # subscribers lost or unreachable at the last push
        self._not_ready: set[str] = set()  # subscribers that answered without a WeightSubscriber last time
        self._packing: set[asyncio.Future[Any]] = set()  # pack threads still running (a cancelled push's too)
        self._copiers: dict[torch.device, Copier] = {}  # where packs run: a stream per GPU of the trainer's weights
        # this publisher's registered buffers: slots and banks (several publishers may share an endpoint)
        self._prefix = f"rl_sync/pub/{secrets.token_hex(4)}/"
        _attach(self)

    # ------------------------------------------------------------------ membership
    @property
    def subscribers(self) -> list[str]:
        return list(self._subscribers)

    @property
    def version(self) -> int:
        """The newest version at least one subscriber committed (0 before that)."""
        return self._version

    def add_subscriber(self, name: str) -> None:
        """Include ``name`` from the next push on (it gets the full weights then)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"subscriber names are non-empty strings, got {name!r}")
        if name == self.endpoint.name:
            raise ValueError("a publisher cannot subscribe to itself")
        if name not in self._subscribers:
            self._subscribers.append(name)

    def remove_subscriber(self, name: str) -> None:
        if name in self._subscribers:
            self._subscribers.remove(name)
        self._layouts.pop(name, None)
        self._committed.pop(name, None)

    def close(self) -> None:
        """Stop taking replies and unregister the send slots, live buffers and shared banks
        (idempotent). A publisher dropped without it is freed too, but what it registered
        stays registered, and so in memory, until its endpoint closes."""
        _detach(self)
        for names, _ in self._slots.values():
            for n in names:
                with contextlib.suppress(transport.TransportError):
                    self.endpoint.unregister(n, discard=True)
        self._slots.clear()
        for n in self._live:
            with contextlib.suppress(transport.TransportError):
                self.endpoint.unregister(n)
        self._live.clear()
        for bs in self._bank_sets.values():
            bs.close()
        self._bank_sets.clear()
        if self._lock_dir is not None:
            self._lock_dir_gone()  # (the finalizer: removes the folder once)
            self._lock_dir = None

    # ------------------------------------------------------------------ push
    async def push(self, weights: Any, version: int, timeout: float | None = None, *,
                   progress: bool = False) -> PushReport:
        """Push ``weights`` (an ``nn.Module`` or name -> tensor) as ``version`` to every subscriber.

        Returns a :class:`PushReport` once every subscriber has committed or
        failed; one subscriber's failure never fails the others, and nobody
        waits for a dead, frozen or slow one: the others commit at most one
        stall bound later than they would without it (see the module's
        theory of operation), while it is given up on when its channel is
        lost (heartbeats) or at the deadline, so the push returns by then. The deadline is ``timeout`` (default the endpoint's)
        after the planning phase, which takes at most ``connect_timeout``
        (only for subscribers not connected yet or restarted). Raises
        :class:`StaleVersionError` if ``version`` is not newer than the last
        pushed one and :class:`PlanMismatchError` if the weights do not fit a
        subscriber's layout, both before any byte moves (``ValueError`` for a
        ``timeout`` not > 0, NaN included, or a ``version`` of 2**64 or more). The source tensors
        must not change until it returns. Cancelling it tells every
        subscriber not yet told to commit to abort (their weights stay as
        they were); subscribers already told to commit may still commit.
        ``progress=True`` shows a tqdm bar of the bytes packed.
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int, got {version!r}")
        if version >= 1 << 64 or (timeout is not None and not timeout > 0):  # (NaN: a deadline never reached)
            raise ValueError(f"version must be below 2**64 and timeout > 0, got {version!r} and {timeout!r}")
        if version <= self._version:
            raise StaleVersionError(f"version {version} is not newer than the last pushed version {self._version}")
        if self._run is not None or self._pushing:
            raise RuntimeError("a push is already running on this publisher")
        if not self._subscribers:
            raise ValueError("the publisher has no subscribers")
        self._pushing = True  # (claimed before the first await: a second push() meanwhile is refused)
        try:
            return await self._push(weights, version, timeout, progress)
        finally:
            self._pushing = False

    async def _push(self, weights: Any, version: int, timeout: float | None, progress: bool) -> PushReport:
        tensors = live_tensors(weights, keep_vars=True)  # (a module's own objects: packing runs under no_grad)
        devices = list(dict.fromkeys(t.device for t in tensors.values() if t.is_cuda))  # (one pass, in order)
        marks = caller_marks(devices)  # the caller's queued GPU work: packing reads after it
        device = pack_device(devices)
        t0 = time.monotonic()
        limit = self.endpoint.timeout if timeout is None else timeout
        report = PushReport(version)
        if self._packing:  # a cancelled push's packs may still be writing a slot or a bank
            await asyncio.wait(set(self._packing))
        run = PushRun(self, next(self._push_ids), version, t0 + min(limit, self.connect_timeout), t0)
        copier = self._copiers.get(device)
        if copier is None:
            copier = self._copiers[device] = Copier(device)
        run.copier, run.marks = copier, marks
        self._run = run
        try:
            groups = await self._prepare(run, tensors, report)
            run.deadline = time.monotonic() + limit
            if run.targets:
                await run.execute(groups, progress)
        finally:
            # first, with no await (a second cancellation must not skip it), even when cancelled: a version
            # some subscriber was told to commit is never pushed again (it may commit it, answered or not)
            if any(t.committed or t.committing for t in run.targets.values()):
                self._version = max(self._version, version)
            self._committed.update(dict.fromkeys((n for n, t in run.targets.items() if t.committed), version))
            try:
                await run.finish()
            finally:
                self._run = None
        for name, t in run.targets.items():
            plane, why = route_of(t)
            report.results[name] = SubscriberResult(
                ok=t.committed, error=t.error, bytes=sum(b.nbytes for b in t.layout.buckets) if t.committed else 0,
                seconds=(t.finished_at or time.monotonic()) - t0, source=t.source or self.endpoint.name,
                stage=t.stage, plane=plane, plane_reason=why)
        report.seconds = time.monotonic() - t0
        report.packed_bytes = run.packed_bytes
        self._lost = {n for n, r in report.results.items()
                      if isinstance(r.error, (transport.PeerLostError, transport.PeerNotFoundError))}
        level = logging.INFO if report.ok else logging.WARNING
        if log.isEnabledFor(level):  # (the summary costs more than the rest of a small push's ending)
            log.log(level, "push %s", report.summary())
        return report

    async def _prepare(self, run: PushRun, tensors: dict[str, torch.Tensor], report: PushReport) -> list[Group]:
        names = list(self._subscribers)
        # planning waits for every subscriber, so one that was planned before and has no channel now (lost
        # at an earlier push, or since: killed between pushes) is only probed briefly: a dead one must not
        # cost the others connect_timeout; a restarted one is picked up by whichever push first finds it
        # answering. Only a subscriber never planned yet is given connect_timeout.
        ep = self.endpoint
        brief = {s for s in names if s in self._lost or s in self._not_ready or (s in self._layouts and (
            (p := ep.peer(s)) is None or p.incarnation == self._layouts[s].incarnation))}  # (same one: a new manifest)
        got: list[Layout | BaseException | None] = [self._known_layout(s) for s in names]  # (no coroutine for those)
        todo = [i for i, s in enumerate(names) if got[i] is None]
        if todo:
            found = await asyncio.gather(*(self._layout(names[i], min(run.deadline, run.t0 + _PROBE)
                                                        if names[i] in brief else run.deadline) for i in todo),
                                         return_exceptions=True)
            for i, planned in zip(todo, found, strict=True):
                got[i] = planned
        mismatches: list[str] = []
        groups: dict[str, Group] = {}
        for name, res in zip(names, got, strict=True):
            if isinstance(res, PlanMismatchError):
                mismatches += [f"{name}: {d}" for d in res.differences]
                continue
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res
                if isinstance(res, SubscriberNotReadyError):  # (the next pushes probe it briefly: _PROBE)
                    self._not_ready.add(name)
                report.results[name] = SubscriberResult(error=res, seconds=time.monotonic() - run.t0, stage="plan")
                continue
            self._not_ready.discard(name)
            assert res is not None
            layout = res
            why = unshareable(self.endpoint, name, layout, run.copier.device) if layout.shared else None
            if why is not None:
                report.results[name] = SubscriberResult(error=RlSyncError(why), seconds=time.monotonic() - run.t0,
                                                        stage="plan")
                continue
            group = groups.get(layout.digest)
            try:  # (one check per layout: its subscribers' manifests have the same entries)
                sources = group.sources if group is not None else self._sources.sources(
                    layout.digest, tensors, layout.manifest, dtype=self.dtype, name_map=self.name_map,
                    subscriber=name)
            except PlanMismatchError as exc:
                mismatches += [f"{name}: {d}" for d in exc.differences]
                continue
            if group is None:
                group = groups[layout.digest] = Group(layout.digest, layout, sources)
                group.live = self._live_buffers(layout, sources)
            if layout.shared and group.banks is None:
                try:
                    group.banks = self._bank_set(layout, run.copier.device)
                except Exception as exc:  # (memory, /dev/shm, the temp dir): the shared subscribers miss this push
                    log.exception("publisher %s: no shared banks for layout %s", self.endpoint.name, layout.digest[:16])
                    report.results[name] = SubscriberResult(error=RlSyncError(
                        f"the publisher could not make its shared banks: {type(exc).__name__}: {exc}"),
                        seconds=time.monotonic() - run.t0, stage="plan")
                    if not group.targets:
                        del groups[layout.digest]
                    continue
            target = Target(name, layout)
            target.group = group
            group.targets.append(target)
            run.targets[name] = target
        if mismatches:
            run.targets.clear()
            raise PlanMismatchError(mismatches)
        for group in groups.values():
            if group.live is not None and any(t.shared for t in group.targets):
                group.live = None  # (shared subscribers read the bank: the layout is packed anyway)
        self._drop_unused_slots(set(groups))
        self._sources.forget(set(groups))
        self._drop_unused_banks()
        for group in groups.values():
            by_name = {t.name: t for t in group.targets if not t.shared}  # shared ones read the bank itself
            src = assign_sources(list(by_name), {n: t.layout.local for n, t in by_name.items()},
                                 {n: t.layout.manifest.host for n, t in by_name.items()}, self.fanout)
            for name, source in src.items():
                by_name[name].source = source
                if source is not None:
                    by_name[source].dependents.append(by_name[name])
        return list(groups.values())

    def _known_layout(self, name: str) -> Layout | None:
        """``name``'s layout as planned before, if a channel to that incarnation is open (the
        common case of a push: no coroutine, no wait), else None (:meth:`_layout` plans it)."""
        peer = self.endpoint.peer(name)
        cached = self._layouts.get(name) if peer is not None and name not in self._lost else None
        # (and the manifest it was read from: a subscriber made anew on that endpoint registers another one)
        return cached if (cached is not None and peer is not None and cached.incarnation == peer.incarnation
                          and peer.buffers.get(MANIFEST_BUFFER) is cached.spec) else None

    async def _layout(self, name: str, deadline: float) -> Layout:
        ep = self.endpoint
        peer = await ep.connect(name, timeout=max(0.001, deadline - time.monotonic()))
        spec = peer.buffers.get(MANIFEST_BUFFER)  # (the object: another one once the peer registers anew)
        cached = self._layouts.get(name)
        if cached is not None and cached.incarnation == peer.incarnation and spec is cached.spec:
            return cached
        while spec is None:  # its endpoint is up, its WeightSubscriber not yet (a generator still loading its
            # model, or restarting): it registers the manifest when made, and its registry update reaches us
            if time.monotonic() >= deadline:
                raise SubscriberNotReadyError(f"{name!r} runs no WeightSubscriber (no {MANIFEST_BUFFER!r} buffer) "
                                              "yet; it gets everything at the first push that finds one")
            await asyncio.sleep(0.05)
            if not peer.connected:
                peer = await ep.connect(name, timeout=max(0.001, deadline - time.monotonic()))
            spec = peer.buffers.get(MANIFEST_BUFFER)
        raw = torch.empty(spec.nbytes, dtype=torch.uint8)  # (a manifest that appeared at the bound still gets a moment)
        await ep.get(name, {MANIFEST_BUFFER: raw}, timeout=max(_PROBE, deadline - time.monotonic()))
        manifest = decode_manifest(raw.numpy().tobytes())
        buckets = make_buckets(manifest, self.bucket_bytes)
        layout = Layout(peer.incarnation, manifest, buckets, plan_hash(manifest, buckets), peer.same_host,
                        peer.maps_memory(), peer.maps_memory(gpu=True), spec)
        self._layouts[name] = layout
        log.info("publisher %s: planned %s (%d tensors, %d buckets, %.1f MiB, via %s)", ep.name, name,
                 len(manifest.entries), len(buckets), sum(manifest.arenas) / 2**20, peer.plane)
        return layout

    def _on_reply(self, note: transport.Notification) -> None:
        try:
            msg = m.decode(note.payload)
        except Exception as exc:
            log.warning("publisher %s: malformed rl_sync reply from %s dropped: %s", self.endpoint.name, note.peer, exc)
            return
        run = self._run
        if not isinstance(msg, m.Reply) or run is None or msg.push_id != run.push_id:
            return  # a late reply to an earlier push
        target = run.targets.get(note.peer)
        if target is not None and target.error is None:
            run.on_reply(target, msg)


# Replies reach publishers through one route per endpoint (several may share one), holding them weakly: a
# publisher dropped without close() is freed, and its endpoint once closed and dropped (see close()).
_PUBLISHERS: weakref.WeakKeyDictionary[transport.Endpoint, weakref.WeakSet[WeightPublisher]] = weakref.WeakKeyDictionary()


def _attach(pub: WeightPublisher) -> None:
    pubs = _PUBLISHERS.get(pub.endpoint)
    if pubs is None:
        pubs = _PUBLISHERS[pub.endpoint] = weakref.WeakSet()

        def route(note: transport.Notification) -> None:
            for p in list(pubs):
                p._on_reply(note)

        pub.endpoint.on_notification(route, prefix=m.TO_PUBLISHER)
    pubs.add(pub)


def _detach(pub: WeightPublisher) -> None:
    pubs = _PUBLISHERS.get(pub.endpoint)
    if pubs is not None and pub in pubs:
        pubs.discard(pub)
        if not pubs:
            del _PUBLISHERS[pub.endpoint]
            pub.endpoint.on_notification(None, prefix=m.TO_PUBLISHER)
