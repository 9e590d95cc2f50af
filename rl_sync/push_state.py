"""The bookkeeping of one push, shared by the publisher's modules: a subscriber's cached layout
(:class:`Layout`), one outstanding pull (:class:`Pull`), one subscriber during a push
(:class:`Target`), the subscribers sharing a layout and where their buckets are packed
(:class:`Group`), what a push uses of its publisher (:class:`Publisher`), and small helpers: why a
shared subscriber cannot map the banks, the route a subscriber's bytes took, a Begin's rejection as
an error. Internal to :mod:`rl_sync.publisher` (see its theory of operation)."""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Callable
from typing import Any, Protocol

import torch

import transport

from . import messages as m
from .banks import BankSet
from .errors import CommitTimeoutError, PlanMismatchError, StaleVersionError, SubscriberRejectedError
from .plan import Bucket, Manifest
from .report import PushEvent

__all__ = ["SLOTS", "Group", "Layout", "Publisher", "Pull", "Target", "rejection", "route_of", "unshareable"]

SLOTS = 2


class Layout:
    """A subscriber's manifest and buckets, cached for one incarnation."""

    def __init__(self, incarnation: int, manifest: Manifest, buckets: list[Bucket], digest: str, same_host: bool,
                 maps_cpu: bool, maps_gpu: bool, spec: Any = None) -> None:
        self.incarnation = incarnation
        # the manifest's BufferSpec as announced when it was read: a subscriber made anew on the same endpoint
        # (another model, mode or arena size) registers another, so the publisher reads the manifest again
        self.spec = spec
        self.manifest = manifest
        self.buckets = buckets
        self.digest = digest
        self.same_host = same_host  # on the publisher's host (transport's Peer.same_host)
        # ... and its CPU (GPU) buffers are mapped into ours and ours into it (transport's Peer.maps_memory:
        # shm, cuda_ipc), what mode="shared" maps the CPU (GPU) banks through
        self.maps_cpu = maps_cpu
        self.maps_gpu = maps_gpu
        # fan-out: it reads the publisher's slots with its own copy engine (shm, or cuda_ipc for GPU
        # buffers), so it never costs the publisher a send: "auto" serves it from the publisher
        self.local = same_host and (maps_cpu or maps_gpu)
        self.shared = manifest.shared  # mode="shared": it reads the publisher's banks


class Pull:
    """One outstanding Pull of one bucket by one subscriber."""

    __slots__ = ("attempt", "sent", "slot", "source")

    def __init__(self, attempt: int, source: str | None, slot: int | None, sent: float) -> None:
        self.attempt = attempt
        self.source = source  # None: the publisher (a slot, or the push's bank); else the relaying subscriber
        self.slot = slot  # the send slot it reads (None: a bank or a relay's arena)
        self.sent = sent


class Target:
    """One subscriber during one push."""

    def __init__(self, name: str, layout: Layout) -> None:
        self.name = name
        self.layout = layout
        self.source: str | None = None
        self.dependents: list[Target] = []
        self.begun = False
        self.begin_sent = False  # an Abort is owed from here on (a Begin may be waiting for readers)
        self.begin_at = 0.0
        # the channel its Begin went over: messages are posted (no answer per message), so one lost with a broken
        # channel shows as another channel (or none) to the subscriber, which the watchdog takes as losing it
        self.channel: str | None = None
        self.bank = 0  # the subscriber's arena bank this push fills
        self.stamp = 0  # ... and the stamp it wrote for that bank (its dependents check their relay pulls against it)
        self.unrelayable: str | None = None  # why its arena can no longer serve this push to its dependents
        self.have: set[int] = set()
        self.inflight: dict[int, Pull] = {}  # bucket -> its outstanding pull (the newest attempt)
        # attempt -> a pull taken back (stalled, re-sourced): its late answer still says how long a pull takes
        self.superseded: dict[int, Pull] = {}
        self.attempts = itertools.count(1)
        self.orphaned: set[int] = set()  # buckets to pull (again) from the publisher: repaired after the main pass
        self.stalled = False  # a pull went unanswered past the stall bound: no new pulls until it answers
        self.stalled_at = 0.0
        self.committing = False
        self.commit_at = 0.0
        self.committed = False
        self.heard = 0.0  # when it last answered anything
        self.gone_seen = False  # the watchdog's last pass saw its channel gone (it fails it if the next one does too)
        self.planes: dict[str, str] = {}  # the transport planes its pulls took, and why (from its replies)
        self.error: BaseException | None = None
        self.finished_at = 0.0
        self.group: Group | None = None

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
        if self.committing and (self.begun or self.shared):  # (shared: its Commit goes right behind its Begin, and
            return "commit"  # only the Commit is answered)
        return "begin" if not self.begun else "transfer"

    def doing(self, now: float) -> str:
        """What it was doing, for an error message: stage, buckets, outstanding pulls, last heard."""
        heard = f"last heard from {now - self.heard:.1f} s ago" if self.heard else "not heard from during this push"
        n = len(self.layout.buckets)
        if not self.begin_sent:
            return f"its Begin not sent yet: the publisher's bank was still being packed ({now - self.begin_at:.1f} s)"
        if self.committing and (self.begun or self.shared):
            return f"told to commit {now - self.commit_at:.1f} s ago, no answer; {heard}"
        if not self.begun:
            return f"no answer to Begin after {now - self.begin_at:.1f} s; {heard}"
        what = f"transfer, {len(self.have)}/{n} buckets"
        if self.inflight:
            oldest = min(p.sent for p in self.inflight.values())
            what += f", pulls of buckets {sorted(self.inflight)} outstanding for up to {now - oldest:.1f} s"
        if self.stalled:
            what += f", stalled for {now - self.stalled_at:.1f} s"
        return f"{what}; {heard}"


class Group:
    """Subscribers sharing one layout, and where their buckets are packed: two send slots, or,
    when shared subscribers are among them, one whole bank (everyone then pulls from the bank)."""

    def __init__(self, digest: str, layout: Layout, sources: dict[str, torch.Tensor]) -> None:
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
        self.targets: list[Target] = []
        self.served = 0  # buckets whose pulls the main pass has sent (later beginners repair the rest)
        # how long its answered pulls from the publisher took (the newest few: a stall yardstick)
        self.took: collections.deque[float] = collections.deque(maxlen=64)
        self.late: collections.deque[float] = collections.deque(maxlen=64)  # ... of pulls taken back (this push only)
        self.live: dict[str, str] | None = None  # entry -> the trainer tensor's buffer, when served live


class Publisher(Protocol):
    """What a push (:class:`rl_sync.push_run.PushRun`) uses of its :class:`rl_sync.WeightPublisher`;
    a Protocol, so that the push's modules do not import the publisher's."""

    endpoint: transport.Endpoint
    bucket_bytes: int
    stall_timeout: float
    _pull_medians: dict[str, float]  # layout digest -> the median pull from the publisher of its latest push
    observer: Callable[[PushEvent], Any] | None
    _committed: dict[str, int]
    _background: set[asyncio.Task[Any]]
    _packing: set[asyncio.Future[Any]]

    @property
    def version(self) -> int: ...

    def _slot(self, layout: Layout, device: torch.device) -> tuple[list[str], list[torch.Tensor]]: ...


def unshareable(ep: transport.Endpoint, name: str, layout: Layout, device: torch.device) -> str | None:
    """Why subscriber ``name`` (mode='shared') cannot map banks on ``device``, or None."""
    p = ep.peer(name)
    if not layout.same_host:
        where = f"it is not on the publisher's host (reached over {p.plane if p is not None else 'no channel'})"
    elif device.type == "cuda" and not layout.maps_gpu:
        where = (f"GPU buffers with it use {p.gpu_plane} ({p.gpu_plane_reason}), not cuda_ipc" if p is not None
                 else "it has no channel")
    elif device.type != "cuda" and not (layout.maps_cpu or layout.maps_gpu):
        where = (f"its channel runs {p.plane if p is not None else 'no plane'}, not shm (planes= must allow shm "
                 "on both sides)")
    else:
        return None
    over = "a GPU bank through cuda_ipc" if device.type == "cuda" else "a CPU bank through shm"
    return f"{name} runs mode='shared', which maps the publisher's weights ({over}), but {where}; use another mode there"


def route_of(t: Target) -> tuple[str, str]:
    """The plane(s) a subscriber's bytes took during the push, and why."""
    if t.shared:
        how = "; ".join(f"mapped over {p}: {why}" for p, why in sorted(t.planes.items())) or "mapped"
        return "shared", f"mode='shared': its weights point into the publisher's bank ({how}); no bytes are copied to it"
    if not t.planes:
        return "", ""
    if len(t.planes) == 1:
        return next(iter(t.planes.items()))
    return "+".join(sorted(t.planes)), "; ".join(f"{p}: {why}" for p, why in sorted(t.planes.items()))


def rejection(name: str, r: m.Reply) -> Exception:
    if r.error_kind == "timeout":  # a direct-mode subscriber's readers did not leave in time
        return CommitTimeoutError(f"{name}: {r.error}")
    if r.error_kind == "stale":
        return StaleVersionError(f"{name}: {r.error}")
    if r.error_kind == "plan":
        return PlanMismatchError([r.error or "plan mismatch"], subscriber=name)
    return SubscriberRejectedError(f"{name}: {r.error}")
