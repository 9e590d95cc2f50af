"""What a commit mode sees of its subscriber, the state of one push, and the mode interface.

A :class:`CommitMode` holds what differs between the subscriber's modes: how
many banks of arenas it makes, what ``Begin`` does before the pulls, how a
commit changes the live weights, and what :meth:`WeightSubscriber.close`
lets go. It is given its subscriber as a :class:`Subscriber` (the
subscriber's state and the few calls it needs), never the class itself.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch

import transport

from .. import messages as m
from ..device import Copier, ReaderMarks
from ..plan import Bucket, Manifest, arena_name
from ..rwlock import RWLock

__all__ = ["CommitMode", "Push", "Subscriber", "readers_late"]


class Push:
    __slots__ = ("applying", "bank", "buckets", "by_bucket", "done", "dropped", "locked", "moving", "progress",
                 "publisher", "pulled", "pulls", "push_id", "routes", "unchecked", "version")

    def __init__(self, publisher: str, push_id: int, version: int, buckets: list[Bucket], bank: int) -> None:
        self.bank = bank
        self.publisher = publisher
        self.push_id = push_id
        self.version = version
        self.buckets = buckets
        self.done: set[int] = set()
        self.locked = False  # direct mode: this push holds the writer lock
        self.moving = False  # direct mode: its Begin is moving the weights into the arenas (the lock stays held)
        self.unchecked = False  # direct mode: Begin came during a move, the model's tensors are checked under the lock
        self.dropped = False  # aborted, superseded or given up: it never commits
        self.applying = False  # its commit changes the live weights now, and answers even if cancelled (staged)
        self.progress = time.monotonic()  # direct mode: when it last moved (the watchdog's clock)
        self.pulled = False  # a Pull of it arrived
        self.pulls: set[asyncio.Task[Any]] = set()  # its pulls still running
        self.by_bucket: dict[int, asyncio.Task[Any]] = {}  # the newest pull of each bucket
        self.routes: dict[str, transport.Route] = {}  # source -> the plane its pulls take, and why


class Subscriber(Protocol):
    """The subscriber as its commit mode uses it (:class:`rl_sync.WeightSubscriber`)."""

    endpoint: transport.Endpoint
    manifest: Manifest
    device: torch.device
    commit_timeout: float
    _live: dict[str, torch.Tensor]
    _banks: list[list[torch.Tensor]]
    _live_bank: int | None
    _torn: bool
    _names: list[str]
    _lock: RWLock
    _readers: ReaderMarks
    _copier: Copier
    _version: int
    _version_cond: threading.Condition
    _push: Push | None
    _closed: bool
    _applying: asyncio.Lock

    def _reply(self, peer: str, reply: m.Reply) -> None: ...

    def _changed(self) -> str | None: ...

    def _spawn(self, coro: Any) -> asyncio.Task[Any]: ...

    def _drop(self, push: Push, why: str) -> None: ...

    def _repoint(self, bank: int, arenas: Sequence[torch.Tensor] | Mapping[int, torch.Tensor] | None = None,
                 entries: Sequence[Any] | None = None) -> None: ...


def readers_late(commit_timeout: float) -> str:
    return (f"GPU work that readers queued inside hold() was not done within {commit_timeout} s "
            "(commit_timeout)")


class CommitMode:
    """One commit mode of a subscriber (``mode=``): the hooks the subscriber calls where modes differ."""

    name: ClassVar[str]
    nbanks: ClassVar[int] = 1  # banks of arenas of its own (shared: none, the publisher's banks are mapped)
    repoints: ClassVar[bool] = False  # re-points the live tensors into arenas (they are kept as the model's objects)
    shared: ClassVar[bool] = False  # the manifest says shared: the publisher packs into its banks, no pulls
    writes_live: ClassVar[bool] = False  # pulls write the live weights (they are torn until the commit)

    def __init__(self, sub: Subscriber) -> None:
        self.sub = sub

    @property
    def moving(self) -> bool:
        """Whether the live weights are being re-pointed off the event loop now (direct mode's first
        move, under the writer lock): a check of their places must wait for that lock."""
        return False

    def make_banks(self) -> None:
        """At construction: make and register the banks of arenas (``nbanks`` of them)."""
        sub = self.sub
        for bank in range(self.nbanks):
            sub._banks.append([])
            for i, n in enumerate(sub.manifest.arenas):
                # CPU: in shared memory at once (with shm allowed), no copy, pages appear as pulls write
                # them; CUDA: an allocation of its own that CUDA IPC can export (Endpoint.new_buffer)
                sub._banks[bank].append(sub.endpoint.new_buffer(arena_name(bank, i), (n,), device=sub.device))
                sub._names.append(arena_name(bank, i))

    async def begin(self, push: Push) -> bool:
        """Before ``Begin`` is answered (its checks passed): False if this push must not begin (answered)."""
        return True

    async def commit(self, push: Push, msg: m.Commit) -> None:
        """Serve ``Commit`` (its push is current; it has every bucket unless the mode is shared)."""
        raise NotImplementedError

    def close(self) -> None:
        """At :meth:`WeightSubscriber.close` (or a blocking subscriber's close after its endpoint's)."""
