"""Generator side: receive buffers, serve pushes, apply commits atomically.

A :class:`WeightSubscriber` registers its staging arenas and its manifest on
the endpoint and then serves pushes on the endpoint's event loop, with no
call from the application: it answers the publisher's ``Begin``, pulls each
bucket into its staging arena when told to (a one-sided ``get`` from the
bucket's source), and on ``Commit`` copies staging into the live weights
while holding the writer side of a readers-writer lock. Readers
(:meth:`WeightSubscriber.hold`) therefore never see two versions at once, and
a push that fails or is cancelled before its commit leaves the live weights
untouched. ``mode="direct"`` trades that last property for memory: the live
weights are the arena, written while readers are held off for the whole push,
and a push that fails after its first byte leaves them *torn*: :meth:`hold`
then waits for the next successful commit. ``mode="shared"`` registers no
arenas at all: it is sent no pulls, and its commit re-points the live weights
into the publisher's bank that holds the version (:mod:`rl_sync.banks`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import msgspec
import torch

import transport
from transport.errors import Phase

from . import messages as m
from .banks import BankLease
from .device import Copier, ReaderMarks, normal_device, one_device, wait_events
from .errors import RlSyncError
from .plan import (
    MANIFEST_BUFFER,
    Bucket,
    Manifest,
    arena_name,
    build_manifest,
    dtype_from_name,
    encode_manifest,
    make_buckets,
    plan_hash,
)
from .rwlock import RWLock

__all__ = ["WeightSubscriber", "host_key", "live_tensors"]

log = logging.getLogger("rl_sync.subscriber")

MODES = ("staged", "swap", "direct", "shared")
_REPOINTING = ("swap", "direct", "shared")  # modes that re-point the live tensors into arenas


def host_key() -> str:
    """Which host this process runs on (hostname and kernel boot id)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def live_tensors(model_or_state_dict: Any, *, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The tensors a push writes: an ``nn.Module``'s state dict, or a mapping of name -> tensor.

    ``keep_vars=True`` returns the module's own parameter and buffer objects (not detached
    aliases), so that they can be re-pointed in place.
    """
    if isinstance(model_or_state_dict, torch.nn.Module):
        state = model_or_state_dict.state_dict(keep_vars=keep_vars)
    elif isinstance(model_or_state_dict, Mapping):
        state = dict(model_or_state_dict)
    else:
        raise TypeError(f"expected an nn.Module or a mapping of name -> tensor, got {type(model_or_state_dict).__name__}")
    for name, t in state.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"state entries are str -> tensor, got {name!r} -> {type(t).__name__}")
    return state if keep_vars else {name: t.detach() for name, t in state.items()}


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


async def _uncancellable(coro: Any) -> Any:
    """Await ``coro`` to its end even if the caller is cancelled meanwhile (then re-raise the
    cancellation): copies into the live weights must be over before the lock that guards them is
    let go."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


class _Push:
    __slots__ = ("bank", "buckets", "by_bucket", "done", "dropped", "locked", "progress", "publisher", "pulled", "pulls",
                 "push_id", "routes", "version")

    def __init__(self, publisher: str, push_id: int, version: int, buckets: list[Bucket], bank: int) -> None:
        self.bank = bank
        self.publisher = publisher
        self.push_id = push_id
        self.version = version
        self.buckets = buckets
        self.done: set[int] = set()
        self.locked = False  # direct mode: this push holds the writer lock
        self.dropped = False  # aborted, superseded or given up: it never commits
        self.progress = time.monotonic()  # direct mode: when it last moved (the watchdog's clock)
        self.pulled = False  # a Pull of it arrived
        self.pulls: set[asyncio.Task[Any]] = set()  # its pulls still running
        self.by_bucket: dict[int, asyncio.Task[Any]] = {}  # the newest pull of each bucket
        self.routes: dict[str, transport.Route] = {}  # source -> the plane its pulls take, and why


class WeightSubscriber:
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
            weights. Swap needs CPU tensors and a model that keeps no other
            alias of its weights (a view taken before a commit keeps the old
            bank, which the next push overwrites: take views inside
            :meth:`hold` and drop them when it ends). Memory is the same in
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
        self._live = live_tensors(model_or_state_dict, keep_vars=mode in _REPOINTING)
        if not self._live:
            raise ValueError("the model has no tensors to receive")
        self.device = one_device(self._live)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"the model is on {self.device}: rl_sync receives into CPU or CUDA tensors")
        self._copier = Copier(self.device)  # the staged commit's copies and direct mode's first move (GPU: a stream)
        self._readers = ReaderMarks(self.device)  # GPU: where readers left hold(), waited for before weights change
        self.manifest: Manifest = build_manifest(self._live, arena_bytes, host_key(), shared=mode == "shared")
        nbanks = {"swap": 2, "shared": 0}.get(mode, 1)  # shared: the publisher's banks, mapped at commit
        self._banks: list[list[torch.Tensor]] = []
        self._live_bank: int | None = None  # swap/direct: the bank the live tensors point into (None: their own memory)
        self._lease: BankLease | None = None  # shared: the lock on the publisher's bank the live tensors point into
        self._torn = False  # direct: a push wrote into the live weights and did not commit
        self._plans: dict[int, tuple[list[Bucket], str]] = {}
        self._lock = RWLock()
        self._version = 0
        self._version_cond = threading.Condition()
        self._push: _Push | None = None
        self._starting: set[_Push] = set()  # pushes whose Begin is being served (waiting for a commit, pulls, readers)
        # Aborts that came before their push's Begin was served (the Begin's task had not run yet): that
        # Begin is refused (a frozen subscriber, let go, reads both at once); the newest few are kept
        self._aborted: collections.deque[tuple[str, int]] = collections.deque(maxlen=64)
        self._draining: set[asyncio.Task[Any]] = set()  # pulls of dropped pushes, cancelled, not yet over
        self._applying = asyncio.Lock()  # held while a commit copies staging into the live weights
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._names: list[str] = []
        manifest_bytes = encode_manifest(self.manifest)
        self._manifest_tensor = torch.frombuffer(bytearray(manifest_bytes), dtype=torch.uint8)
        try:
            for bank in range(nbanks):
                self._banks.append([])
                if mode == "direct":  # made at the first push, one at a time as the weights move in: see _adopt
                    break
                for i, n in enumerate(self.manifest.arenas):
                    # CPU: in shared memory at once (with shm allowed), no copy, pages appear as pulls write
                    # them; CUDA: an allocation of its own that CUDA IPC can export (Endpoint.new_buffer)
                    self._banks[bank].append(endpoint.new_buffer(arena_name(bank, i), (n,), device=self.device))
                    self._names.append(arena_name(bank, i))
            endpoint.register(MANIFEST_BUFFER, self._manifest_tensor)
            self._names.append(MANIFEST_BUFFER)
        except BaseException:
            self._unregister()
            raise
        endpoint.on_notification(self._on_message, prefix=m.TO_SUBSCRIBER)
        log.info("subscriber %s: %d tensors, %.1f MiB in %d arenas x %d banks, mode %s", endpoint.name,
                 len(self._live), sum(self.manifest.arenas) / 2**20, len(self.manifest.arenas), nbanks, mode)

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

    async def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Wait until a version >= ``version`` is committed; return the committed version.

        Raises :class:`transport.TransportTimeoutError` (phase ``commit``) at
        the deadline; ``timeout=None`` waits as long as it takes. Cancelling
        it only stops the wait.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._version < version:
            if deadline is not None and time.monotonic() >= deadline:
                raise transport.TransportTimeoutError(
                    f"version {version} was not committed within {timeout} s (holding {self._version})", Phase.COMMIT)
            await asyncio.sleep(0.005)
        return self._version

    def wait_for_version_blocking(self, version: int, timeout: float | None = None) -> int:
        """:meth:`wait_for_version` for a thread that is not the event loop's."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._version_cond:
            while self._version < version:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise transport.TransportTimeoutError(
                        f"version {version} was not committed within {timeout} s (holding {self._version})",
                        Phase.COMMIT)
                self._version_cond.wait(left)
            return self._version

    @contextlib.asynccontextmanager
    async def hold(self, timeout: float | None = None, *, streams: Sequence[Any] = ()) -> AsyncIterator[int]:
        """Keep the weights from changing inside the block; yields the version held.

        Many holders may overlap; a commit waits until all have left, and
        holders that arrive while a commit waits queue behind it. Raises
        :class:`transport.TransportTimeoutError` if the lock is not had
        within ``timeout``. Direct mode: while the weights are torn (a push
        failed after writing them) it waits for the next commit, and raises
        :class:`rl_sync.RlSyncError` if the subscriber is closed meanwhile.

        Weights on a GPU: the GPU work queued inside the block on this
        thread's current stream, and on each of ``streams`` (side streams, a
        stream a CUDA graph is replayed on), is part of the read: leaving the
        block records an event on each of them, and a commit (or a swap or
        direct push's Begin) waits until those events are done before it
        overwrites or re-points what the work reads (bounded by
        ``commit_timeout``; past it the commit fails and nothing changes).
        Work queued after a commit returned sees the new version on any
        stream: the commit's own copies are done before it lets readers in.
        Queue GPU work that reads the weights only inside the block, or on a
        stream named here. Swap and direct re-point the tensors (direct: at
        the first push), so a CUDA graph captured before a re-point keeps
        reading the old memory: capture graphs over staged weights, or after
        a direct subscriber's first commit.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not await self._lock.acquire_read_async(left):
                raise transport.TransportTimeoutError(f"hold() waited {timeout} s for a commit to finish", Phase.COMMIT)
            if self._readable():
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise transport.TransportTimeoutError(
                    f"hold() waited {timeout} s: the weights are torn by a failed direct push", Phase.COMMIT)
            await asyncio.sleep(0.005)
        try:
            yield self._version
        finally:
            try:
                self._readers.leave(streams)
            finally:
                self._lock.release_read()

    def _readable(self) -> bool:
        """With the read lock had: True if the weights may be read (keep the lock); else (torn by a
        failed direct push) give the lock back and return False, or raise if closed."""
        if not self._torn:
            return True
        self._lock.release_read()
        if self._closed:
            raise RlSyncError("the subscriber is closed and its weights are torn by a failed direct push")
        return False

    @contextlib.contextmanager
    def hold_blocking(self, timeout: float | None = None, *, streams: Sequence[Any] = ()) -> Any:
        """:meth:`hold` for a thread that is not the event loop's (``streams`` likewise)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._lock.acquire_read(left):
                raise transport.TransportTimeoutError(f"hold() waited {timeout} s for a commit to finish", Phase.COMMIT)
            if self._readable():
                break
            with self._version_cond:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise transport.TransportTimeoutError(
                        f"hold() waited {timeout} s: the weights are torn by a failed direct push", Phase.COMMIT)
                if self._torn and not self._closed:
                    self._version_cond.wait(left)
        try:
            yield self._version
        finally:
            try:
                self._readers.leave(streams)
            finally:
                self._lock.release_read()

    def close(self) -> None:
        """Stop serving pushes and unregister the buffers (idempotent). Call on the loop thread."""
        if self._closed:
            return
        self._closed = True
        with self._version_cond:  # blocking holders waiting for torn weights to heal: they now raise
            self._version_cond.notify_all()
        self.endpoint.on_notification(None, prefix=m.TO_SUBSCRIBER)
        for push in (self._push, *self._starting):
            if push is not None:
                self._drop(push, "the subscriber was closed")
        for t in list(self._tasks):
            t.cancel()
        if self._lease is not None:  # shared: the weights move out of the publisher's bank, then it is let go
            self._leave_bank()
        if self.endpoint.is_open:
            self._unregister()

    def _unregister(self) -> None:
        for name in self._names:
            with contextlib.suppress(transport.TransportError):
                self.endpoint.unregister(name)
        self._names.clear()

    # ------------------------------------------------------------------ serving
    def plan(self, bucket_bytes: int) -> tuple[list[Bucket], str]:
        got = self._plans.get(bucket_bytes)
        if got is None:
            buckets = make_buckets(self.manifest, bucket_bytes)
            got = self._plans[bucket_bytes] = (buckets, plan_hash(self.manifest, buckets))
        return got

    def _on_message(self, note: transport.Notification) -> None:
        try:
            msg = m.decode(note.payload)
        except (ValueError, msgspec.DecodeError) as exc:
            log.warning("subscriber %s: malformed rl_sync message from %s dropped: %s", self.endpoint.name, note.peer, exc)
            return
        if isinstance(msg, m.Begin):
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
            if push is not None:
                push.progress = time.monotonic()
            if push is None or push.version != msg.version:
                self._reply(note.peer, m.Reply(msg.push_id, "commit", -1, "no such push in progress", "other"))
            elif self.mode == "shared":
                self._spawn(self._commit_shared(push, msg))
            elif len(push.done) != len(push.buckets):
                self._reply(note.peer, m.Reply(msg.push_id, "commit", -1,
                                               f"{len(push.buckets) - len(push.done)} buckets missing", "other"))
            else:
                self._spawn(self._commit(push))
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

    def _current(self, peer: str, push_id: int) -> _Push | None:
        push = self._push
        if push is None or push.publisher != peer or push.push_id != push_id:
            return None
        return push

    async def _begin(self, peer: str, msg: m.Begin) -> None:
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
        push = _Push(peer, msg.push_id, msg.version, buckets, 0)
        # a later Begin supersedes what has not committed; from here on this one can be aborted or
        # superseded in turn (it is in _starting) through every wait below
        for old in (self._push, *self._starting):
            if old is not None:
                self._drop(old, f"superseded by push {msg.push_id} of {peer}")
        self._starting.add(push)
        try:
            await self._start(push)
        finally:
            self._starting.discard(push)

    async def _start(self, push: _Push) -> None:
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
        if self.mode == "direct" and not await self._begin_direct(push):
            return
        if self.mode == "swap" and not await self._readers.wait(self.commit_timeout):
            # (the bank this push fills was the live one until the last commit: GPU reads of it may be queued)
            if not push.dropped:
                self._reply(peer, m.Reply(push_id, "begin", -1, self._readers_late(), "timeout", self._version))
            return
        push.bank = 0 if self._live_bank is None or len(self._banks) != 2 else 1 - self._live_bank
        if self._push is not None:  # (cannot be: every Begin drops it; kept as a guard)
            self._drop(self._push, f"superseded by push {push_id} of {peer}")
        self._push = push
        self._reply(peer, m.Reply(push_id, "begin", -1, None, None, self._version, push.bank))

    async def _begin_direct(self, push: _Push) -> bool:
        """Take the writer lock for the whole push (direct mode); False (and a reply) if not had.

        While it waits for readers to leave, an Abort of it, or a later Begin, drops it (it is in
        ``_starting``), and it then gives the lock back as soon as it gets it."""
        got = await self._lock.acquire_write_async(self.commit_timeout)
        if not got:
            if not push.dropped:
                self._reply(push.publisher, m.Reply(push.push_id, "begin", -1,
                                                    f"readers held the weights for more than {self.commit_timeout} s",
                                                    "timeout", self._version))
            return False
        push.locked = True
        if push.dropped or push.version <= self._version:  # aborted, superseded, or overtaken while it waited
            why = "the push was aborted" if push.dropped else f"version {push.version} is not newer than the committed {self._version}"
            self._drop(push, why)
            self._reply(push.publisher, m.Reply(push.push_id, "begin", -1, why, "other" if push.dropped else "stale",
                                                self._version))
            return False
        if not await self._readers.wait(self.commit_timeout):  # GPU reads queued in hold() before it was left
            dropped = push.dropped
            self._drop(push, "readers' GPU work was not done")
            if not dropped:
                self._reply(push.publisher, m.Reply(push.push_id, "begin", -1, self._readers_late(), "timeout",
                                                    self._version))
            return False
        if push.dropped:  # aborted or superseded during that wait (which gave the lock back)
            return False
        try:
            if self._live_bank is None:  # first push: the live tensors move into the arenas, once
                await self._adopt()
        except BaseException as exc:  # including a cancellation by close(): never keep the lock
            self._drop(push, f"moving the weights into the arena failed: {exc!r}")
            if not isinstance(exc, Exception):
                raise
            log.exception("subscriber %s: moving the weights into the arena failed", self.endpoint.name)
            self._reply(push.publisher, m.Reply(push.push_id, "begin", -1, f"{type(exc).__name__}: {exc}", "other",
                                                self._version))
            return False
        if push.dropped:  # close() or an Abort during the move
            return False
        push.progress = time.monotonic()
        self._spawn(self._watch_direct(push))
        return True

    async def _watch_direct(self, push: _Push) -> None:
        """Direct mode: give up a push that stops moving, so that readers are not locked out forever.

        Progress is any Pull or Commit of the push arriving, or a pull finishing; a pull in flight
        is bounded by the endpoint's own timeout. Before the first Pull the allowance is twice
        ``commit_timeout``: the publisher may send the first pull late (it waits a moment for the
        other subscribers' Begin answers, and its send slots may be held by a slow subscriber until
        its stall bound)."""
        period = max(0.05, min(1.0, self.commit_timeout / 4))
        while push.locked:
            await asyncio.sleep(period)
            allowed = self.commit_timeout if push.pulled else 2 * self.commit_timeout
            if push.locked and not push.pulls and time.monotonic() - push.progress > allowed:
                log.warning("subscriber %s: push %d of %s made no progress for %.1f s; given up%s", self.endpoint.name,
                            push.push_id, push.publisher, allowed,
                            ", the weights are torn until the next push commits" if self._torn else "")
                self._drop(push, "no progress")

    def _drop(self, push: _Push, why: str) -> None:
        """Forget ``push`` (aborted, superseded, stalled): cancel its pulls (the next Begin waits for
        them to be over, so that none writes late); direct mode: let readers back in."""
        push.dropped = True
        if self._push is push:
            self._push = None
        for task in list(push.pulls):
            task.cancel()
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)
        if push.locked:
            push.locked = False
            self._lock.release_write()
            log.debug("subscriber %s: push %d dropped (%s); torn=%s", self.endpoint.name, push.push_id, why, self._torn)

    async def _pull(self, push: _Push, msg: m.Pull, older: asyncio.Task[Any] | None = None) -> None:
        b = push.buckets[msg.bucket]
        dest = self._banks[push.bank][b.arena][b.offset:b.offset + b.nbytes]
        if older is not None:  # superseded and cancelled: its get leaves nothing behind once it is over
            await asyncio.wait({older})
        if push.dropped:
            return
        if self.mode == "direct":
            if not push.locked:  # given up meanwhile: the live weights are no longer ours to write
                self._reply(push.publisher, m.Reply(push.push_id, "pull", msg.bucket, "the push was given up", "other"))
                return
            self._torn = True  # from here on, the live weights may hold bytes of an uncommitted version
        try:
            where = self._where(b, dest, msg)
        except ValueError as exc:
            self._reply(push.publisher, m.Reply(push.push_id, "pull", msg.bucket, str(exc), "plan", attempt=msg.attempt))
            return
        try:
            route = push.routes.get(msg.source)
            if route is None:  # which plane its bytes take, and why: for the push report (once per source)
                route = push.routes[msg.source] = await self.endpoint.route(msg.source, where)
            await self.endpoint.get(msg.source, where)
        except Exception as exc:
            self._reply(push.publisher, m.Reply(push.push_id, "pull", msg.bucket, f"{type(exc).__name__}: {exc}", "other",
                                                attempt=msg.attempt))
            return
        finally:
            push.progress = time.monotonic()  # finished either way: the publisher may now repair it
        push.done.add(msg.bucket)
        self._reply(push.publisher, m.Reply(push.push_id, "pull", msg.bucket, attempt=msg.attempt, plane=route.plane,
                                            route=route.reason))

    @staticmethod
    def _where(b: Bucket, dest: torch.Tensor, msg: m.Pull) -> dict[str, Any]:
        """What a Pull reads into ``dest`` (bucket ``b``'s bytes in the arena): one range of the
        source's buffer, or, served live, each piece from the source's tensor of its entry."""
        if not msg.live:
            return {msg.buffer: transport.At(dest, msg.offset)}
        if len(msg.live) != len(b.pieces) or len(set(msg.live)) != len(msg.live):
            raise ValueError(f"the pull names {len(msg.live)} live buffers for the {len(b.pieces)} pieces of "
                             f"bucket {b.index}")
        where: dict[str, Any] = {}
        for name, p in zip(msg.live, b.pieces, strict=True):
            dt = dtype_from_name(p.entry.dtype)
            at = p.entry.offset + p.start - b.offset
            where[name] = transport.At(dest[at:at + p.stop - p.start].view(dt), p.start // dt.itemsize)
        return where

    async def _commit(self, push: _Push) -> None:
        if self.mode == "direct":
            self._commit_direct(push)
            return
        if not await self._lock.acquire_write_async(self.commit_timeout):
            self._reply(push.publisher, m.Reply(push.push_id, "commit", -1,
                                                f"readers held the weights for more than {self.commit_timeout} s",
                                                "timeout", self._version))
            return
        if self._push is not push:  # aborted (or superseded) while waiting for the readers: apply nothing
            self._lock.release_write()
            self._reply(push.publisher, m.Reply(push.push_id, "commit", -1, "the push was aborted", "other",
                                                self._version))
            return
        if self.mode == "staged" and not await self._readers.wait(self.commit_timeout):
            self._lock.release_write()  # (GPU reads queued in hold() may still read the live weights)
            self._reply(push.publisher, m.Reply(push.push_id, "commit", -1, self._readers_late(), "timeout",
                                                self._version))
            return
        await self._applying.acquire()
        try:
            if self.mode == "swap":
                if self._live_bank is None and not await self._readers.wait(self.commit_timeout):
                    # (the first re-point lets the model's own memory go: GPU reads of it may be queued)
                    raise transport.TransportTimeoutError(self._readers_late(), Phase.COMMIT)
                self._repoint(push.bank)  # microseconds: no need to leave the loop
            else:
                await _uncancellable(self._copier.run(functools.partial(self._apply, push.bank)))
            with self._version_cond:
                self._version = push.version
                self._version_cond.notify_all()
        except Exception as exc:
            log.exception("subscriber %s: commit of version %d failed", self.endpoint.name, push.version)
            self._reply(push.publisher, m.Reply(push.push_id, "commit", -1, f"{type(exc).__name__}: {exc}", "other",
                                                self._version))
            return
        finally:
            self._lock.release_write()
            self._applying.release()
            if self._push is push:
                self._push = None
        log.debug("subscriber %s: committed version %d", self.endpoint.name, push.version)
        self._reply(push.publisher, m.Reply(push.push_id, "commit", -1, None, None, self._version))

    async def _commit_shared(self, push: _Push, msg: m.Commit) -> None:
        """Shared mode: map the publisher's bank, lock it shared, then (readers held off) re-point."""
        def refuse(why: str, kind: str = "other") -> None:
            self._reply(push.publisher, m.Reply(push.push_id, "commit", -1, why, kind, self._version))

        if len(msg.buffers) != len(self.manifest.arenas) or not msg.lock:
            refuse(f"the commit names {len(msg.buffers)} bank arenas, the layout has {len(self.manifest.arenas)}",
                   "plan")
            return
        try:
            route = await self.endpoint.map_route(push.publisher, msg.buffers[0]) if msg.buffers else None
            arenas = [await self.endpoint.map(push.publisher, name) for name in msg.buffers]
            short = [i for i, (a, n) in enumerate(zip(arenas, self.manifest.arenas, strict=True)) if a.numel() < n]
            if short:
                refuse(f"bank arenas {short} are smaller than the layout's", "plan")
                return
            away = sorted({str(a.device) for a in arenas if normal_device(a.device) != self.device})
            if away:  # (a bank on another GPU of this host: the weights would move to that device)
                refuse(f"the publisher's bank is on {', '.join(away)} as mapped here and the model on {self.device}: "
                       "mode='shared' needs the trainer's weights on the generator's GPU (use another mode)", "plan")
                return
            lease: BankLease | None = BankLease(msg.lock, push.version, push.push_id)
        except Exception as exc:  # (transport, stale bank, lock file, a view that does not fit): refused, answered
            refuse(f"cannot use the publisher's bank {msg.bank}: {type(exc).__name__}: {exc}")
            return
        try:
            if not await self._lock.acquire_write_async(self.commit_timeout):
                refuse(f"readers held the weights for more than {self.commit_timeout} s", "timeout")
                return
            try:
                if self._push is not push or self._closed:  # aborted, superseded or closed meanwhile
                    refuse("the push was aborted")
                    return
                try:
                    self._repoint(msg.bank, arenas)
                except Exception as exc:  # nothing moved (every place is checked first)
                    refuse(f"the bank does not fit the layout: {type(exc).__name__}: {exc}", "plan")
                    return
                old, self._lease, lease = self._lease, lease, None
                if old is not None:  # the weights left that bank: the publisher may rewrite it once read
                    self._let_go_after_reads(old)
                with self._version_cond:
                    self._version = push.version
                    self._version_cond.notify_all()
            finally:
                self._lock.release_write()
                if self._push is push:
                    self._push = None
        finally:
            if lease is not None:  # not adopted: let the publisher have that bank back
                lease.release()
        log.debug("subscriber %s: committed version %d (shared bank %d)", self.endpoint.name, push.version, msg.bank)
        self._reply(push.publisher, m.Reply(push.push_id, "commit", -1, None, None, self._version,
                                            plane=route.plane if route else "", route=route.reason if route else ""))

    def _let_go_after_reads(self, lease: BankLease) -> None:
        """The weights left ``lease``'s bank: let the publisher have it once the GPU work that
        readers queued inside :meth:`hold` before now is done (they may still read it); at once on
        the CPU. Waits on a thread of its own (not cancelled by :meth:`close`): a reader's kernel
        that never ends keeps that bank, and the publisher writes another."""
        events = self._readers.pending()
        if not events:
            lease.release()
            return

        def wait() -> None:
            while wait_events(events, 60.0):
                log.warning("subscriber %s: GPU reads of an old shared bank still running after 60 s; the bank "
                            "stays locked until they end", self.endpoint.name)
            lease.release()

        threading.Thread(target=wait, name="rl_sync-bank-let-go", daemon=True).start()

    def _commit_direct(self, push: _Push) -> None:
        if not push.locked or self._push is not push:
            self._reply(push.publisher, m.Reply(push.push_id, "commit", -1, "the push was given up", "other",
                                                self._version))
            return
        with self._version_cond:
            self._version = push.version
            self._torn = False
            self._version_cond.notify_all()
        self._drop(push, "committed")
        log.debug("subscriber %s: committed version %d (direct)", self.endpoint.name, push.version)
        self._reply(push.publisher, m.Reply(push.push_id, "commit", -1, None, None, self._version))

    def _readers_late(self) -> str:
        return (f"GPU work that readers queued inside hold() was not done within {self.commit_timeout} s "
                "(commit_timeout)")

    async def _adopt(self) -> None:
        """Direct mode, first push: make the arenas one at a time, copying each one's weights in and
        re-pointing them there, so that at most one arena more than the weights is held at once
        (an arena's old tensors are freed as it is adopted, unless the application keeps other
        references to them; on a GPU the freed blocks are handed back to the driver before the next
        arena is allocated). A failure leaves every tensor whole, in its arena or its old memory,
        and the next push goes on from the arenas adopted."""
        arenas = self._banks[0]
        for i, n in enumerate(self.manifest.arenas):
            if i < len(arenas):
                continue  # adopted by an earlier, failed, attempt
            arena = self.endpoint.new_buffer(arena_name(0, i), (n,), device=self.device)
            self._names.append(arena_name(0, i))
            try:
                await _uncancellable(self._copier.run(functools.partial(self._adopt_arena, i, arena)))
            except BaseException:
                self._names.remove(arena_name(0, i))
                with contextlib.suppress(transport.TransportError):
                    self.endpoint.unregister(arena_name(0, i), discard=True)
                raise
            arenas.append(arena)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self._live_bank = 0

    def _adopt_arena(self, i: int, arena: torch.Tensor) -> None:
        """Copy the weights of arena ``i`` into ``arena`` and re-point them there (a Copier batch)."""
        entries = [e for e in self.manifest.entries if e.arena == i]
        for e in entries:
            src = self._live[e.name]
            arena[e.offset:e.offset + e.nbytes].view(dtype_from_name(e.dtype)).view(e.shape).copy_(src)
            if src.is_cuda:  # its memory is let go at the re-point below, before this stream read it
                src.record_stream(torch.cuda.current_stream(src.device))
        self._repoint(0, {i: arena}, entries)

    def _leave_bank(self) -> None:
        """Shared mode, at close: once no reader is in :meth:`hold` (now, or when the last one
        leaves, in whichever thread or task that is), copy the live weights out of the
        publisher's bank into private memory, re-point them there and let the bank go: the model
        keeps its version and the publisher may then rewrite the bank. Until then the bank stays
        locked, so a reader's views of it stay valid. Nothing waits for the readers (no task, no
        waiting writer): new and nested holds go on as before. The copy runs on a thread of its
        own when this is called on an event loop. Any thread."""
        if self._lease is None:
            return
        self._lock.on_idle = self._try_leave
        self._try_leave()

    def _try_leave(self) -> None:
        if self._lease is None or not self._lock.acquire_write(0):
            return  # readers (or a commit) hold the lock: the last to leave calls this again (on_idle)
        self._lock.on_idle = None
        try:  # the writer lock is had: nobody reads, so the copy may run on any thread, never the event loop's
            asyncio.get_running_loop()
        except RuntimeError:
            self._leave_locked()
            return
        threading.Thread(target=self._leave_locked, name="rl_sync-leave-bank", daemon=True).start()

    def _leave_locked(self) -> None:
        """With the writer lock had: move the weights into private memory, let the bank go, unlock.
        On a GPU the copies run on the copier's stream once the reads queued in :meth:`hold` are
        done, and the bank goes only after the copies are."""
        def move() -> None:
            for t in self._live.values():
                own = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                own.copy_(t)
                t.set_(own.untyped_storage(), 0, own.shape, own.stride())

        try:
            self._copier.run_blocking(move, self._readers.pending())
            self._live_bank = None
            if self._lease is not None:
                self._lease.release()
                self._lease = None
        except Exception:  # (out of memory): keep the bank locked, so the weights stay whole where they are
            log.exception("subscriber %s: could not copy the weights out of the publisher's bank at close; "
                          "the bank stays locked while this process lives", self.endpoint.name)
        finally:
            self._lock.release_write()

    def _apply(self, bank: int) -> None:
        # views are taken here, not at construction: registering (at open) moves an arena into shared memory
        arenas = self._banks[bank]
        with torch.no_grad():
            for e in self.manifest.entries:
                view = arenas[e.arena][e.offset:e.offset + e.nbytes].view(dtype_from_name(e.dtype))
                self._live[e.name].copy_(view.view(e.shape))

    def _repoint(self, bank: int, arenas: Sequence[torch.Tensor] | Mapping[int, torch.Tensor] | None = None,
                 entries: Sequence[Any] | None = None) -> None:
        """Point every live tensor (or those of ``entries``) into ``arenas`` (default: bank ``bank``
        of this subscriber's own)."""
        arenas = self._banks[bank] if arenas is None else arenas
        moves = []  # every place is checked before any tensor moves: a bad layout leaves them all as they were
        for e in (self.manifest.entries if entries is None else entries):
            arena = arenas[e.arena]
            size = dtype_from_name(e.dtype).itemsize
            start = arena.storage_offset() + e.offset
            if start % size or e.offset + e.nbytes > arena.numel():
                raise RuntimeError(f"{e.name!r}: arena offset {start} is not a multiple of {size}, or the entry "
                                   f"overruns its arena of {arena.numel()} bytes")
            moves.append((self._live[e.name], arena.untyped_storage(), start // size, e.shape))
        with torch.no_grad():
            for t, storage, offset, shape in moves:
                t.set_(storage, offset, shape, _contiguous_strides(shape))
        if entries is None:
            self._live_bank = bank

    def _reply(self, peer: str, reply: m.Reply) -> None:
        async def send() -> None:
            try:
                await self.endpoint.notify(peer, m.encode(reply))
            except transport.TransportError as exc:
                log.warning("subscriber %s: reply to %s failed: %s", self.endpoint.name, peer, exc)

        self._spawn(send())

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __repr__(self) -> str:
        return f"<WeightSubscriber {self.endpoint.name!r} version={self._version} pid={os.getpid()}>"
