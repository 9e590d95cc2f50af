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
   least 0.25 s; ``stall_timeout`` with nothing to compare), without it:
   that subscriber is *stalled* (no new pulls until it answers anything;
   its unanswered slot pulls are superseded by a newer attempt later, since
   the slot's bytes changed under them) and its dependents pull from the
   publisher. A relay that has not begun when the group starts, or that goes
   silent with pulls outstanding while others relay from it, is dropped as
   a source the same way. After the main pass, the *repair pass* serves each
   subscriber what it misses (a late Begin, a superseded pull, a failed
   relay) from the publisher.
4. **Commit**: a subscriber holding every bucket is told to commit, and
   applies the version atomically with respect to its readers.

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
import collections
import contextlib
import functools
import itertools
import logging
import secrets
import statistics
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

import transport
from transport.errors import Phase

from . import messages as m
from .banks import BankSet, make_lock_dir, remove_lock_dir
from .device import Copier, caller_marks, pack_device
from .errors import PlanMismatchError, PushAbortedError, RlSyncError, StaleVersionError, SubscriberRejectedError
from .fanout import FANOUTS, assign_sources
from .plan import (
    MANIFEST_BUFFER,
    Bucket,
    Manifest,
    NameMap,
    arena_name,
    check_sources,
    decode_manifest,
    dtype_from_name,
    dtype_name,
    make_buckets,
    plan_hash,
)
from .report import PushEvent, PushReport, SubscriberResult
from .subscriber import live_tensors

__all__ = ["WeightPublisher"]

log = logging.getLogger("rl_sync.publisher")

SLOTS = 2
_STALL_MIN = 0.25  # seconds: the least a slot's puller is given before the slot is taken back from it
_STALL_FACTOR = 4.0  # ... and how many times the slowest answered pull of that slot
_PROBE = 0.5  # seconds a push waits for a planned subscriber that has no channel (lost, killed, restarting)
_POLL = 0.05


class _Layout:
    """A subscriber's manifest and buckets, cached for one incarnation."""

    def __init__(self, incarnation: int, manifest: Manifest, buckets: list[Bucket], digest: str, same_host: bool,
                 shm: bool, cuda_ipc: bool) -> None:
        self.incarnation = incarnation
        self.manifest = manifest
        self.buckets = buckets
        self.digest = digest
        self.same_host = same_host  # on the publisher's host (transport's Peer.same_host)
        self.shm = shm  # ... and its channel runs shm (what mode="shared" maps CPU banks through)
        self.cuda_ipc = cuda_ipc  # ... and its GPU plane is cuda_ipc (what mode="shared" maps GPU banks through)
        # fan-out: it reads the publisher's slots with its own copy engine (shm, or cuda_ipc for GPU
        # buffers), so it never costs the publisher a send: "auto" serves it from the publisher
        self.local = same_host and (shm or cuda_ipc)
        self.shared = manifest.shared  # mode="shared": it reads the publisher's banks


class _Pull:
    """One outstanding Pull of one bucket by one subscriber."""

    __slots__ = ("attempt", "sent", "slot", "source")

    def __init__(self, attempt: int, source: str | None, slot: int | None, sent: float) -> None:
        self.attempt = attempt
        self.source = source  # None: the publisher (a slot, or the push's bank); else the relaying subscriber
        self.slot = slot  # the send slot it reads (None: a bank or a relay's arena)
        self.sent = sent


class _Target:
    """One subscriber during one push."""

    def __init__(self, name: str, layout: _Layout) -> None:
        self.name = name
        self.layout = layout
        self.source: str | None = None
        self.dependents: list[_Target] = []
        self.begun = False
        self.begin_sent = False  # an Abort is owed from here on (a Begin may be waiting for readers)
        self.begin_at = 0.0
        self.bank = 0  # the subscriber's arena bank this push fills
        self.have: set[int] = set()
        self.inflight: dict[int, _Pull] = {}  # bucket -> its outstanding pull (the newest attempt)
        self.attempts = itertools.count(1)
        self.orphaned: set[int] = set()  # buckets to pull (again) from the publisher: repaired after the main pass
        self.stalled = False  # a pull went unanswered past the stall bound: no new pulls until it answers
        self.stalled_at = 0.0
        self.committing = False
        self.commit_at = 0.0
        self.committed = False
        self.heard = 0.0  # when it last answered anything
        self.planes: dict[str, str] = {}  # the transport planes its pulls took, and why (from its replies)
        self.error: BaseException | None = None
        self.finished_at = 0.0
        self.group: _Group | None = None

    @property
    def alive(self) -> bool:
        return self.error is None and not self.committed

    @property
    def shared(self) -> bool:
        return self.layout.shared

    @property
    def complete(self) -> bool:
        return len(self.have) == len(self.layout.buckets)

    @property
    def stage(self) -> str:
        if self.committed:
            return "committed"
        if not self.begun:
            return "begin"
        return "commit" if self.committing else "transfer"

    def doing(self, now: float) -> str:
        """What it was doing, for an error message: stage, buckets, outstanding pulls, last heard."""
        heard = f"last heard from {now - self.heard:.1f} s ago" if self.heard else "not heard from during this push"
        n = len(self.layout.buckets)
        if not self.begun:
            return f"no answer to Begin after {now - self.begin_at:.1f} s; {heard}"
        if self.committing:
            return f"told to commit {now - self.commit_at:.1f} s ago, no answer; {heard}"
        what = f"transfer, {len(self.have)}/{n} buckets"
        if self.inflight:
            oldest = min(p.sent for p in self.inflight.values())
            what += f", pulls of buckets {sorted(self.inflight)} outstanding for up to {now - oldest:.1f} s"
        if self.stalled:
            what += f", stalled for {now - self.stalled_at:.1f} s"
        return f"{what}; {heard}"


class _Group:
    """Subscribers sharing one layout, and where their buckets are packed: two send slots, or,
    when shared subscribers are among them, one whole bank (everyone then pulls from the bank)."""

    def __init__(self, digest: str, layout: _Layout, sources: dict[str, torch.Tensor]) -> None:
        self.digest = digest
        self.layout = layout
        self.buckets = layout.buckets
        self.sources = sources  # generator name -> trainer tensor
        self.slots: list[str] = []  # made at the first bucket packed into a slot
        self.slot_tensors: list[torch.Tensor] = []
        self.slot_users: list[set[str]] = [set() for _ in range(SLOTS)]  # who still reads each slot
        self.slot_ready: list[float] = [0.0] * SLOTS  # when its bucket's pulls were sent
        self.slot_took: list[float | None] = [None] * SLOTS  # the slowest answered pull of its bucket
        self.banks: BankSet | None = None  # shared subscribers: the layout's banks
        self.bank: int | None = None  # the bank this push writes (held exclusively until sealed)
        self.sealed = False
        self.packed: set[int] = set()  # buckets packed into the bank
        self.targets: list[_Target] = []
        self.served = 0  # buckets whose pulls the main pass has sent (later beginners repair the rest)
        self.live: dict[str, str] | None = None  # entry -> the trainer tensor's buffer, when served live


class WeightPublisher:
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
            are kept) or a callable (returning None drops the tensor).
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
        stall_timeout: how long a pull of a send slot may go unanswered, when no
            other subscriber's pull of that slot answered to compare it with,
            before the slot is taken back from it (see :meth:`push`). With a
            comparison, the bound is ``4x`` the slowest answered pull of the
            slot, at least 0.25 s.
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
        self._live: dict[str, torch.Tensor] = {}  # buffer name -> the trainer tensor registered under it
        self.stall_timeout = float(stall_timeout)
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
        self._layouts: dict[str, _Layout] = {}
        self._slots: dict[str, tuple[list[str], list[torch.Tensor]]] = {}
        self._push_ids = itertools.count(secrets.randbits(40))
        self._run: _Run | None = None
        self._lost: set[str] = set()  # subscribers lost or unreachable at the last push
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
        """Stop taking replies and unregister the send slots (idempotent)."""
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
        subscriber's layout, both before any byte moves. The source tensors
        must not change until it returns. Cancelling it tells every
        subscriber not yet told to commit to abort (their weights stay as
        they were); subscribers already told to commit may still commit.
        ``progress=True`` shows a tqdm bar of the bytes packed.
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int, got {version!r}")
        if version <= self._version:
            raise StaleVersionError(f"version {version} is not newer than the last pushed version {self._version}")
        if self._run is not None:
            raise RuntimeError("a push is already running on this publisher")
        if not self._subscribers:
            raise ValueError("the publisher has no subscribers")
        tensors = live_tensors(weights)
        marks = caller_marks(tensors.values())  # the caller's queued GPU work: packing reads after it
        device = pack_device(tensors.values())
        t0 = time.monotonic()
        limit = self.endpoint.timeout if timeout is None else timeout
        report = PushReport(version)
        if self._packing:  # a cancelled push's packs may still be writing a slot or a bank
            await asyncio.wait(set(self._packing))
        run = _Run(self, next(self._push_ids), version, t0 + min(limit, self.connect_timeout), t0)
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
            await run.finish()
            self._run = None
        for name, t in run.targets.items():
            plane, why = _route_of(t)
            report.results[name] = SubscriberResult(
                ok=t.committed, error=t.error, bytes=sum(b.nbytes for b in t.layout.buckets) if t.committed else 0,
                seconds=(t.finished_at or time.monotonic()) - t0, source=t.source or self.endpoint.name,
                stage=t.stage, plane=plane, plane_reason=why)
        report.seconds = time.monotonic() - t0
        report.packed_bytes = run.packed_bytes
        if any(r.ok for r in report.results.values()):
            self._version = version
        self._committed.update({n: version for n, r in report.results.items() if r.ok})
        self._lost = {n for n, r in report.results.items()
                      if isinstance(r.error, (transport.PeerLostError, transport.PeerNotFoundError))}
        (log.info if report.ok else log.warning)("push %s", report.summary())
        return report

    async def _prepare(self, run: _Run, tensors: dict[str, torch.Tensor], report: PushReport) -> list[_Group]:
        names = list(self._subscribers)
        # planning waits for every subscriber, so one that was planned before and has no channel now (lost
        # at an earlier push, or since: killed between pushes) is only probed briefly: a dead one must not
        # cost the others connect_timeout; a restarted one is picked up by whichever push first finds it
        # answering. Only a subscriber never planned yet is given connect_timeout.
        peers = self.endpoint.peers
        brief = {s for s in names if s in self._lost or (s in self._layouts and s not in peers)}
        got = await asyncio.gather(*(self._layout(s, min(run.deadline, run.t0 + _PROBE) if s in brief
                                                  else run.deadline) for s in names), return_exceptions=True)
        mismatches: list[str] = []
        groups: dict[str, _Group] = {}
        for name, res in zip(names, got, strict=True):
            if isinstance(res, PlanMismatchError):
                mismatches += [f"{name}: {d}" for d in res.differences]
                continue
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res
                report.results[name] = SubscriberResult(error=res, seconds=time.monotonic() - run.t0, stage="plan")
                continue
            layout = res
            why = _unshareable(self.endpoint, name, layout, run.copier.device) if layout.shared else None
            if why is not None:
                report.results[name] = SubscriberResult(error=RlSyncError(why), seconds=time.monotonic() - run.t0,
                                                        stage="plan")
                continue
            try:
                sources = check_sources(tensors, layout.manifest, dtype=self.dtype, name_map=self.name_map,
                                        subscriber=name)
            except PlanMismatchError as exc:
                mismatches += [f"{name}: {d}" for d in exc.differences]
                continue
            group = groups.get(layout.digest)
            if group is None:
                group = groups[layout.digest] = _Group(layout.digest, layout, sources)
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
            target = _Target(name, layout)
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

    async def _layout(self, name: str, deadline: float) -> _Layout:
        ep = self.endpoint
        peer = await ep.connect(name, timeout=max(0.001, deadline - time.monotonic()))
        cached = self._layouts.get(name)
        if cached is not None and cached.incarnation == peer.incarnation:
            return cached
        spec = peer.buffers.get(MANIFEST_BUFFER)
        if spec is None:
            raise PlanMismatchError([f"{name!r} runs no WeightSubscriber (no {MANIFEST_BUFFER!r} buffer)"])
        raw = torch.empty(spec.nbytes, dtype=torch.uint8)
        await ep.get(name, {MANIFEST_BUFFER: raw}, timeout=max(0.001, deadline - time.monotonic()))
        manifest = decode_manifest(raw.numpy().tobytes())
        buckets = make_buckets(manifest, self.bucket_bytes)
        layout = _Layout(peer.incarnation, manifest, buckets, plan_hash(manifest, buckets), peer.same_host,
                         peer.plane == "shm", peer.gpu_plane == "cuda_ipc")
        self._layouts[name] = layout
        log.info("publisher %s: planned %s (%d tensors, %d buckets, %.1f MiB, via %s)", ep.name, name,
                 len(manifest.entries), len(buckets), sum(manifest.arenas) / 2**20, peer.plane)
        return layout

    def _slot(self, layout: _Layout, device: torch.device) -> tuple[list[str], list[torch.Tensor]]:
        """The layout's send slots, on ``device`` (where the trainer's weights are: a GPU's are packed there)."""
        size = max((b.nbytes for b in layout.buckets), default=64)
        have = self._slots.get(layout.digest)
        if have is not None and have[1][0].numel() >= size and have[1][0].device == device:
            return have
        names = [f"{self._prefix}{layout.digest[:16]}/slot{i}" for i in range(SLOTS)]
        tensors = []
        for n in names:
            if n in self.endpoint.buffers:  # ours, too small: made again
                self.endpoint.unregister(n, discard=True)
            tensors.append(self.endpoint.new_buffer(n, (size,), device=device))  # (CPU: in shared memory, no copy)
        self._slots[layout.digest] = (names, tensors)
        return names, tensors

    def _live_buffers(self, layout: _Layout, sources: dict[str, torch.Tensor]) -> dict[str, str] | None:
        """Register the trainer's tensors to be pulled from directly (see ``live``), or None."""
        if self.live is False or layout.shared:
            return None
        entries = layout.manifest.entries
        if self.live == "auto" and not all(sources[e.name].is_cuda for e in entries):
            return None
        for e in entries:
            t = sources[e.name]
            if dtype_name(t.dtype) != e.dtype or not t.is_contiguous() or t.nbytes != e.nbytes:
                return None  # a cast (or a strided tensor): packed into slots
        names = {}
        for e in entries:
            t, name = sources[e.name], f"{self._prefix}live/{e.name}"
            have = self._live.get(name)
            # (state_dict() gives new alias objects every push: the same memory is the same buffer)
            if (have is None or name not in self.endpoint.buffers or have.data_ptr() != t.data_ptr()
                    or have.device != t.device or have.dtype != t.dtype or have.shape != t.shape):
                if name in self.endpoint.buffers:
                    self.endpoint.unregister(name, discard=True)
                self.endpoint.register(name, t)
                self._live[name] = t
            names[e.name] = name
        return names

    def _bank_set(self, layout: _Layout, device: torch.device) -> BankSet:
        """The layout's shared banks, on ``device`` (where the trainer's weights are packed)."""
        bs = self._bank_sets.get(layout.digest)
        if bs is not None and bs.device != device:  # the trainer's weights moved: banks where they are now
            self._bank_sets.pop(layout.digest).close()
            bs = None
        if bs is None:
            if self._lock_dir is None:
                self._lock_dir = make_lock_dir(self.endpoint.name)
                # a publisher dropped without close() (or at exit) still removes its lock folder
                self._lock_dir_gone = weakref.finalize(self, remove_lock_dir, self._lock_dir)
            bs = self._bank_sets[layout.digest] = BankSet(self.endpoint, self._prefix, layout.digest[:16],
                                                          layout.manifest.arenas, self.shared_banks, self._lock_dir,
                                                          device)
            log.info("publisher %s: %d shared banks of %.1f MiB on %s for layout %s", self.endpoint.name,
                     self.shared_banks, sum(layout.manifest.arenas) / 2**20, device, layout.digest[:16])
        return bs

    def _drop_unused_banks(self) -> None:
        keep = {lay.digest for lay in self._layouts.values() if lay.shared}
        for digest in [d for d in self._bank_sets if d not in keep]:
            self._bank_sets.pop(digest).close()

    def _drop_unused_slots(self, keep: set[str]) -> None:
        for digest in list(self._slots):
            if digest not in keep:
                for n in self._slots.pop(digest)[0]:
                    with contextlib.suppress(transport.TransportError):
                        self.endpoint.unregister(n, discard=True)

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


# Replies reach publishers through one route per endpoint (several publishers may share an endpoint).
_PUBLISHERS: weakref.WeakKeyDictionary[transport.Endpoint, list[WeightPublisher]] = weakref.WeakKeyDictionary()


def _attach(pub: WeightPublisher) -> None:
    pubs = _PUBLISHERS.get(pub.endpoint)
    if pubs is None:
        pubs = _PUBLISHERS[pub.endpoint] = []

        def route(note: transport.Notification) -> None:
            for p in list(pubs):
                p._on_reply(note)

        pub.endpoint.on_notification(route, prefix=m.TO_PUBLISHER)
    if pub not in pubs:
        pubs.append(pub)


def _detach(pub: WeightPublisher) -> None:
    pubs = _PUBLISHERS.get(pub.endpoint)
    if pubs is not None and pub in pubs:
        pubs.remove(pub)
        if not pubs:
            del _PUBLISHERS[pub.endpoint]
            pub.endpoint.on_notification(None, prefix=m.TO_PUBLISHER)


class _Run:
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

    def __init__(self, pub: WeightPublisher, push_id: int, version: int, deadline: float, t0: float) -> None:
        self.pub = pub
        self.ep = pub.endpoint
        self.push_id = push_id
        self.version = version
        self.deadline = deadline
        self.t0 = t0
        self.targets: dict[str, _Target] = {}
        self.changed = asyncio.Event()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.packed_bytes = 0
        self.bar: Any = None
        self.groups: list[_Group] = []
        # how long the latest answered pulls took (the relay stall bound's yardstick; the watchdog takes
        # its median every tick, so only the newest few are kept)
        self.took: collections.deque[float] = collections.deque(maxlen=256)
        self.copier: Copier = Copier(torch.device("cpu"))  # where packs run (set by push())
        self.marks: list[Any] = []  # the caller's GPU work queued when push() was called
        self._marks_wait: asyncio.Future[Any] | None = None  # live pulls: the host wait for those marks

    # ------------------------------------------------------------------ events
    def emit(self, t: _Target, kind: str, bucket: int = -1, source: str | None = None, detail: str = "") -> None:
        observer = self.pub.observer
        if observer is None:
            return
        try:
            observer(PushEvent(self.push_id, self.version, t.name, kind, bucket, source or self.ep.name, len(t.have),
                               len(t.layout.buckets), time.monotonic() - self.t0, detail))
        except Exception:
            log.exception("push %d: the observer raised on %s of %s; ignored", self.push_id, kind, t.name)

    # ------------------------------------------------------------------ driving
    async def execute(self, groups: list[_Group], progress: bool) -> None:
        if progress:
            from tqdm.auto import tqdm

            total = sum(b.nbytes for g in groups for b in g.buckets)
            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"push v{self.version}")
        watchdog = asyncio.ensure_future(self._watchdog())
        self.groups = groups
        try:
            now = time.monotonic()
            for t in self.targets.values():
                t.begin_sent = True
                t.begin_at = now
                self._send(t, m.Begin(self.push_id, self.version, t.layout.digest, self.pub.bucket_bytes))
                self.emit(t, "begin_sent")
            await asyncio.gather(*(self._run_group(g) for g in groups))
            await self._until(lambda: not any(t.alive for t in self.targets.values()))
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
            if self.bar is not None:
                self.bar.close()

    async def _run_group(self, group: _Group) -> None:
        n = len(group.buckets)
        # the first Begin answer starts the group; the others are given as long again to be in the main
        # pass from its first bucket (later ones get what they missed in the repair pass)
        t0 = time.monotonic()
        await self._until(lambda: any(t.begun for t in group.targets) or not any(t.alive for t in group.targets))
        grace = time.monotonic() + max(0.02, time.monotonic() - t0)
        await self._until(lambda: all(t.begun or not t.alive for t in group.targets) or time.monotonic() >= grace)
        for t in group.targets:  # a relay that has not begun yet would hold its dependents up
            self._check_source(t)
        self._take_bank(group)
        for k in range(n):
            def pick(k: int = k) -> list[_Target]:
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
                    self._maybe_commit(t)
        # repair: buckets a subscriber missed (it began late, its relay failed or stalled, its slot was
        # taken back) come from the publisher, once it is not stalled and has no pull of them outstanding
        while True:
            def due() -> list[_Target]:
                return [t for t in group.targets if t.alive and t.begun and not t.stalled
                        and any(k not in t.inflight for k in t.orphaned)]
            await self._until(lambda: bool(due()) or not any(t.alive and not t.complete for t in group.targets))
            todo = sorted({k for t in due() for k in t.orphaned if k not in t.inflight})
            if not todo:
                return
            for k in todo:
                def pick_repair(k: int = k) -> list[_Target]:
                    return [t for t in group.targets if t.alive and t.begun and not t.stalled and k in t.orphaned
                            and k not in t.inflight]
                if pick_repair():
                    await self._serve(group, k, pick_repair)

    def _take_bank(self, group: _Group) -> None:
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

    async def _serve(self, group: _Group, k: int, pick: Callable[[], list[_Target]]) -> None:
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
                await self._pack_into(bucket, group.sources, group.banks.region(group.bank, bucket))
                group.packed.add(k)
            buffer, offset = group.banks.names(group.bank)[bucket.arena], bucket.offset
        else:
            if not group.slots:
                group.slots, group.slot_tensors = self.pub._slot(group.layout, self.copier.device)
            slot = await self._free_slot(group)
            await self._pack_into(bucket, group.sources, group.slot_tensors[slot])
            buffer, offset = group.slots[slot], 0
            group.slot_ready[slot] = time.monotonic()
            group.slot_took[slot] = None
        for t in pick():
            if slot is not None:
                group.slot_users[slot].add(t.name)
            self._pull(t, k, None, buffer, offset, slot)

    async def _free_slot(self, group: _Group) -> int:
        """A send slot nobody reads any more; while both are read, whoever leaves one unanswered past
        the stall bound gives it up (it is stalled)."""
        while True:
            for i, users in enumerate(group.slot_users):
                if not users:
                    return i
            now = time.monotonic()
            for i, users in enumerate(group.slot_users):
                bound = self._stall_bound(group.slot_took[i])
                for name in list(users):
                    t = self.targets[name]
                    p = next((p for p in t.inflight.values() if p.slot == i), None)
                    if p is None:  # (cannot be: a user has a pull of the slot) never let it hold the slot
                        users.discard(name)
                    elif now - p.sent >= bound:
                        self._stall(t, f"its pull of slot {i} went unanswered for {now - p.sent:.2f} s "
                                       f"(bound {bound:.2f} s)")
            if any(not users for users in group.slot_users):
                continue
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_POLL):
                    await self.changed.wait()

    def _stall_bound(self, took: float | None) -> float:
        """How long a pull may go unanswered while it holds up others: ``4x`` the slowest answered
        pull it is compared with (at least 0.25 s), or ``stall_timeout`` with nothing to compare."""
        if took is None:
            return self.pub.stall_timeout
        return max(_STALL_MIN, _STALL_FACTOR * took)

    def _pull(self, t: _Target, k: int, source: str | None, buffer: str, offset: int, slot: int | None,
              live: tuple[str, ...] = ()) -> None:
        t.orphaned.discard(k)
        p = t.inflight[k] = _Pull(next(t.attempts), source, slot, time.monotonic())
        self._send(t, m.Pull(self.push_id, k, source or self.ep.name, buffer, offset, p.attempt, live))
        self.emit(t, "pull_sent", k, source)

    def _stall(self, t: _Target, why: str) -> None:
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
                del t.inflight[k]
                t.orphaned.add(k)
        for d in t.dependents:
            if d.alive and d.source == t.name:
                self._resource(d, f"its relay {t.name} stalled")
        self.changed.set()

    def _resource(self, d: _Target, why: str) -> None:
        """``d`` pulls from the publisher from now on: what it misses, relay pulls in flight included
        (superseded), comes in the repair pass, the rest in the main pass."""
        d.source = None
        served = d.group.served if d.group is not None else 0
        for k, p in list(d.inflight.items()):
            if p.source is not None:
                del d.inflight[k]
        d.orphaned |= {k for k in range(served) if k not in d.have and k not in d.inflight}
        log.info("push %d: %s pulls from the publisher from now on (%s)", self.push_id, d.name, why)
        self.emit(d, "resourced", detail=why)
        self.changed.set()

    def _check_source(self, d: _Target) -> None:
        """Once the main pass runs, a begun subscriber whose relay has not begun (or is stalled, or
        failed) pulls from the publisher instead: a relay late to begin never holds it up."""
        src = self.targets.get(d.source) if d.source is not None else None
        if src is not None and d.alive and d.begun and (not src.begun or src.stalled or src.error is not None):
            self._resource(d, f"its relay {src.name} has not begun" if not src.begun else f"its relay {src.name} "
                              f"is {'stalled' if src.stalled else 'failed'}")

    def _feed(self, d: _Target) -> None:
        """Tell ``d`` (begun, relaying from a live source) to pull what its source already holds."""
        src = self.targets.get(d.source) if d.source is not None else None
        if src is None or not d.alive or not d.begun or src.error is not None or src.stalled:
            return
        for k in sorted(src.have):
            if k not in d.have and k not in d.inflight:
                b = d.layout.buckets[k]
                self._pull(d, k, src.name, arena_name(src.bank, b.arena), b.offset, None)

    async def _marks_done(self) -> None:
        """Live pulls read the trainer's tensors from other processes: first the work the caller
        queued on its streams at ``push()`` must be done (a host wait, on a worker thread, once)."""
        if self._marks_wait is None:
            marks = self.marks
            self._marks_wait = asyncio.ensure_future(asyncio.to_thread(lambda: [e.synchronize() for e in marks]))
        await asyncio.shield(self._marks_wait)

    async def _pack_into(self, bucket: Bucket, sources: Mapping[str, torch.Tensor], dest: torch.Tensor) -> None:
        # on a worker thread; with the weights on a GPU, on the copier's stream once the caller's work queued
        # at push() is done: the pulls are sent only once the bytes are in the slot
        pack = asyncio.ensure_future(self.copier.run(functools.partial(_pack, bucket, sources, dest), self.marks))
        self.pub._packing.add(pack)
        pack.add_done_callback(self.pub._packing.discard)
        await asyncio.shield(pack)
        self.packed_bytes += bucket.nbytes
        if self.bar is not None:
            self.bar.update(bucket.nbytes)

    def on_reply(self, t: _Target, r: m.Reply) -> None:
        now = time.monotonic()
        t.heard = now
        if t.stalled and r.stage == "pull":  # it answers again: its superseded buckets are repaired
            t.stalled = False
            log.info("push %d: %s answers again after %.2f s stalled", self.push_id, t.name, now - t.stalled_at)
        if r.stage == "begin":
            if t.begun:
                return
            if r.error is None:
                t.begun = True
                t.bank = r.bank
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
                self.fail(t, _rejection(t.name, r))
        elif r.stage == "pull":
            p = t.inflight.get(r.bucket)
            if p is None or p.attempt != r.attempt:
                self.changed.set()
                return  # a superseded attempt: its bytes may be torn, a newer pull (or the repair) follows
            del t.inflight[r.bucket]
            g = t.group
            if p.slot is not None and g is not None:
                g.slot_users[p.slot].discard(t.name)
                took = now - g.slot_ready[p.slot]
                g.slot_took[p.slot] = max(took, g.slot_took[p.slot] or 0.0)
            if r.error is None:
                self.took.append(now - p.sent)
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
            else:
                self.fail(t, SubscriberRejectedError(f"{t.name} failed to pull bucket {r.bucket}: {r.error}"))
        elif r.stage == "commit":
            if r.error is None:
                t.committed = True
                t.finished_at = now
                if r.plane:  # (shared: the plane the bank was mapped over)
                    t.planes[r.plane] = r.route
                self.emit(t, "committed")
            elif r.error_kind == "timeout":
                self.fail(t, transport.TransportTimeoutError(f"{t.name}: {r.error}", Phase.COMMIT))
            else:
                self.fail(t, SubscriberRejectedError(f"{t.name} refused the commit: {r.error}"))
        self.changed.set()

    def _maybe_commit(self, t: _Target) -> None:
        if t.alive and t.begun and t.complete and not t.committing:
            g = t.group
            if not t.shared:
                msg: m.Commit | None = m.Commit(self.push_id, self.version)
            elif g is not None and g.sealed and g.bank is not None and g.banks is not None:
                msg = m.Commit(self.push_id, self.version, g.bank, tuple(g.banks.names(g.bank)), g.banks.path(g.bank))
            else:
                msg = None
            if msg is not None:
                t.committing = True
                t.commit_at = time.monotonic()
                self._send(t, msg)
                self.emit(t, "commit_sent")

    def fail(self, t: _Target, exc: BaseException) -> None:
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

    def _send(self, t: _Target, msg: m.Message, best_effort: bool = False) -> None:
        if best_effort:  # an abort goes only over a channel still open to the same incarnation, never a new dial
            p = self.ep.peers.get(t.name)
            if p is None or p.incarnation != t.layout.incarnation:
                return
        limit = 2.0 if best_effort else max(0.5, self.deadline - time.monotonic())

        async def send() -> None:
            try:
                await self.ep.notify(t.name, m.encode(msg), timeout=limit)
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

    async def _until(self, cond: Callable[[], bool]) -> None:
        while not cond():
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_POLL):
                    await self.changed.wait()

    async def _watchdog(self) -> None:
        """Fails targets whose channel is lost (or answered by another incarnation) or that pass the
        deadline; moves subscribers whose relay leaves their pulls unanswered past the bound to the
        publisher."""
        while True:
            now = time.monotonic()
            peers = self.ep.peers
            relay_bound = self._stall_bound(statistics.median(self.took) if self.took else None)
            for t in list(self.targets.values()):
                if not t.alive:
                    continue
                p = peers.get(t.name)
                if p is None or p.incarnation != t.layout.incarnation:
                    self.fail(t, self._lost_error(t, now))
                elif now >= self.deadline:
                    self.fail(t, self._overdue(t, now))
                elif t.stalled or not t.begun:
                    continue
                elif (now - max(t.heard, t.begin_at) >= relay_bound and any(now - q.sent >= relay_bound
                                                                            for q in t.inflight.values())
                      and any(d.alive and d.source == t.name for d in t.dependents)):
                    # a relay that went silent with pulls outstanding: its dependents must not wait for it
                    self._stall(t, f"silent for {now - max(t.heard, t.begin_at):.2f} s with pulls outstanding, "
                                   f"while subscribers relay from it")
                elif t.source is not None:
                    late = [k for k, q in t.inflight.items() if q.source is not None and now - q.sent >= relay_bound]
                    if late:
                        self._resource(t, f"its relay {t.source} left its pulls of buckets {late} unanswered for "
                                          f"{relay_bound:.2f} s")
            await asyncio.sleep(_POLL)

    def _overdue(self, t: _Target, now: float) -> transport.TransportTimeoutError:
        phase = Phase.COMMIT if t.committing else Phase.TRANSFER
        return transport.TransportTimeoutError(
            f"subscriber {t.name!r} did not finish version {self.version} before the deadline ({t.doing(now)})", phase)

    def _lost_error(self, t: _Target, now: float, cause: BaseException | None = None) -> transport.PeerLostError:
        err = transport.PeerLostError(f"subscriber {t.name!r} was lost during the push ({t.doing(now)})")
        err.__cause__ = cause
        return err

    async def finish(self) -> None:
        """Abort whatever did not commit (cancellation included). Nothing waits for the Aborts: each is
        bounded on its own, and a later push's Begin supersedes an unfinished push anyway."""
        for t in self.targets.values():
            if t.alive:
                self.fail(t, PushAbortedError(f"the push of version {self.version} stopped before {t.name} committed "
                                              f"({t.doing(time.monotonic())})"))
        for g in self.groups:
            if g.bank is not None and g.banks is not None and not g.sealed:
                g.banks.release(g.bank)  # unsealed: its stamp says it holds nothing, no commit names it
        background = self.pub._background
        for task in self.tasks:
            background.add(task)
            task.add_done_callback(background.discard)
        self.tasks = set()
        await asyncio.sleep(0)  # let the Aborts go out before the push returns


def _unshareable(ep: transport.Endpoint, name: str, layout: _Layout, device: torch.device) -> str | None:
    """Why subscriber ``name`` (mode='shared') cannot map banks on ``device``, or None."""
    p = ep.peers.get(name)
    if not layout.same_host:
        where = f"it is not on the publisher's host (reached over {p.plane if p is not None else 'no channel'})"
    elif device.type == "cuda" and not layout.cuda_ipc:
        where = (f"GPU buffers with it use {p.gpu_plane} ({p.gpu_plane_reason}), not cuda_ipc" if p is not None
                 else "it has no channel")
    elif device.type != "cuda" and not (layout.shm or layout.cuda_ipc):
        where = (f"its channel runs {p.plane if p is not None else 'no plane'}, not shm (planes= must allow shm "
                 "on both sides)")
    else:
        return None
    over = "a GPU bank through cuda_ipc" if device.type == "cuda" else "a CPU bank through shm"
    return f"{name} runs mode='shared', which maps the publisher's weights ({over}), but {where}; use another mode there"


def _route_of(t: _Target) -> tuple[str, str]:
    """The plane(s) a subscriber's bytes took during the push, and why."""
    if t.shared:
        how = "; ".join(f"mapped over {p}: {why}" for p, why in sorted(t.planes.items())) or "mapped"
        return "shared", f"mode='shared': its weights point into the publisher's bank ({how}); no bytes are copied to it"
    if not t.planes:
        return "", ""
    if len(t.planes) == 1:
        return next(iter(t.planes.items()))
    return "+".join(sorted(t.planes)), "; ".join(f"{p}: {why}" for p, why in sorted(t.planes.items()))


def _rejection(name: str, r: m.Reply) -> Exception:
    if r.error_kind == "timeout":  # a direct-mode subscriber's readers did not leave in time
        return transport.TransportTimeoutError(f"{name}: {r.error}", Phase.COMMIT)
    if r.error_kind == "stale":
        return StaleVersionError(f"{name}: {r.error}")
    if r.error_kind == "plan":
        return PlanMismatchError([r.error or "plan mismatch"], subscriber=name)
    return SubscriberRejectedError(f"{name}: {r.error}")


def _pack(bucket: Bucket, sources: Mapping[str, torch.Tensor], slot: torch.Tensor) -> None:
    """Copy (and cast) the pieces of ``bucket`` into ``slot``. Runs on a worker thread."""
    with torch.no_grad():
        for p in bucket.pieces:
            e = p.entry
            dt = dtype_from_name(e.dtype)
            size = dt.itemsize
            src = sources[e.name].reshape(-1)[p.start // size:p.stop // size]
            at = e.offset + p.start - bucket.offset
            slot[at:at + p.stop - p.start].view(dt).copy_(src)
