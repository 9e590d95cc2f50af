"""One put, get or mapping on a channel, from the caller's tensors to the plane that moves them.

:func:`plan` checks the call against the peer's registry (refreshed once on a miss);
:func:`pick_plane` picks the op's plane, waiting (bounded) for an NCCL link being set up;
:func:`transfer` runs the op, synchronously when its plane can do it on the spot
(:meth:`DataPlane.run_here <transport.planes.base.DataPlane.run_here>`), else as an op of the
channel, retried once after a registry sync (the peer re-registered a buffer) or staged (a
``cuda_ipc`` mapping could not be opened here). :func:`map_buffer` and :func:`map_plane` are
:meth:`Endpoint.map <transport.Endpoint.map>`'s halves. All run on the endpoint's event loop and
are bounded by ``deadline`` (``time.monotonic()``). :func:`transfer_now` is :func:`transfer`'s
synchronous fast path on its own, for any thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import torch

from .channel import Channel
from .errors import (
    BufferMismatchError,
    Phase,
    PlaneUnavailableError,
    StaleBufferError,
    TransportTimeoutError,
    UnknownBufferError,
)
from .flight_recorder import OpKind
from .peer import Route
from .ranges import At, plan_items

__all__ = ["Tensors", "map_buffer", "map_plane", "pick_plane", "plan", "transfer", "transfer_now"]

Tensors = Mapping[str, "torch.Tensor | At"]


async def plan(ch: Channel, tensors: Tensors, deadline: float, into: bool = False) -> list[Any]:
    """Check the call against the peer's registry (``into``: a get, which writes the tensors); on
    a miss, refresh the cache once and check again."""
    try:
        return plan_items(ch.peer_specs, tensors, peer=ch.peer_name, into=into)
    except (UnknownBufferError, BufferMismatchError):
        if not isinstance(tensors, Mapping):
            raise
        await ch.sync_registry(deadline)
        return plan_items(ch.peer_specs, tensors, peer=ch.peer_name, into=into)


async def pick_plane(ch: Channel, pairs: list[Any], deadline: float) -> Any:
    """The op's plane; an op for the NCCL link while it is being set up waits for it (bounded).
    One that was given the link as it went down (another thread; the state is read without a
    lock) picks again, so it is never posted on a dead link."""
    plane = ch.plane_for(pairs)
    link = ch.link
    if plane.via_link and link is not None and link.state != "ready":
        await link.wait(deadline)  # (at once unless pending)
        plane = ch.plane_for(pairs)
    return plane


async def transfer(ch: Channel, kind: OpKind, tensors: Tensors, deadline: float,
                   start: Callable[[Any, Any, list[Any]], Awaitable[None]], here: bool = False,
                   note: bool = False) -> None:
    """Plan, pick the plane and run one put or get (``start(plane, op, pairs)`` sends it).
    ``here``: the op may be done synchronously by its plane (a put without a notification, or a
    get); ``note``: it carries a notification (it spends a credit: :mod:`transport.credits`).
    Retried once: after a registry sync if the peer re-registered a buffer (a put only where no
    later op of the channel started meanwhile: its retry would land after that op, a notification
    called after the put before its bytes), and staged if a ``cuda_ipc`` mapping could not be
    opened here (logged). Either retry keeps the op's place in the channel's call order: an op
    called meanwhile waits behind the retry."""
    into = kind is OpKind.GET
    stamp = ch.ops.called()
    place = None  # the op's place in the call order, taken before its first await (OpTable.reserve)
    try:
        for retry in (False, True):
            try:  # (the common case first, without the coroutines of plan and pick_plane: a 4 KiB op is ~20 us)
                pairs = plan_items(ch.peer_specs, tensors, peer=ch.peer_name, into=into)
            except (UnknownBufferError, BufferMismatchError):
                place = place or ch.reserve()
                pairs = await plan(ch, tensors, deadline, into=into)
            plane = ch.plane_for(pairs)
            if plane.via_link:
                place = place or ch.reserve()
                plane = await pick_plane(ch, pairs, deadline)
            if here and place is None and ch.in_order_now():
                try:
                    if plane.run_here(kind, pairs):
                        return
                except StaleBufferError as exc:
                    if retry or not exc.retry_safe:
                        raise
                    place = ch.reserve()
                    await ch.sync_registry(deadline)
                    continue
            op = ch.new_op(kind, [it.name for it, _ in pairs], sum(t.nbytes for _, t in pairs), plane,
                           answered=not (here and plane.one_sided))  # (no answer to read if it is done here)
            op.note = note
            mine, place = place, None  # (run consumes it)
            fallback = not retry and plane.staged_on_unavailable
            if fallback:  # its retry on the staged path (the mapping refused) keeps this place: run keeps it taken
                mine = mine or ch.reserve()
            try:
                await ch.run(op, lambda: start(plane, op, pairs), deadline, mine,  # noqa: B023
                             keep_on=PlaneUnavailableError if fallback else None)
                return
            except PlaneUnavailableError:
                if not fallback:
                    raise
                place = mine  # (still taken: no op called meanwhile went ahead of the retry)
            except StaleBufferError as exc:
                if retry or not exc.retry_safe or (kind is OpKind.PUT and ch.ops.calls != stamp):
                    raise
                place = ch.reserve()  # (the retry keeps its place: no op called from now on overtakes it)
                await ch.sync_registry(deadline)
    finally:
        if place is not None:  # (it ended, or raised, before it was handed over)
            ch.give_back(place)


def transfer_now(ch: Channel, kind: OpKind, tensors: Tensors) -> bool:
    """One put (no notification) or get done right now on the calling thread, if the channel's
    own plane can do it without waiting for anything (:meth:`DataPlane.run_here
    <transport.planes.base.DataPlane.run_here>`: a one-sided shm copy into or out of slotted,
    mapped exports) and no earlier op of the channel is held back; False, nothing done, else
    (and where our copy of the peer's registry misses, or a buffer was replaced and the op can be
    retried: :func:`transfer` refreshes it). Any thread; never waits. Raises the caller's errors
    (:class:`~transport.errors.InvalidTensorError`) and what the op raised when it cannot be
    retried (a put whose bytes may have reached memory the peer reused, a lost peer)."""
    ch.ops.called()
    try:
        pairs = plan_items(ch.peer_specs, tensors, peer=ch.peer_name, into=kind is OpKind.GET)
    except (UnknownBufferError, BufferMismatchError):
        return False
    plane = ch.planes.own_plane_now(pairs)
    if plane is None or not ch.in_order_now():
        return False
    try:
        return plane.run_here(kind, pairs)
    except StaleBufferError as exc:
        if exc.retry_safe:
            return False
        raise


async def map_buffer(ch: Channel, name: str, deadline: float) -> torch.Tensor:
    """The peer's buffer ``name`` mapped here (see :meth:`transport.Endpoint.map`): the peer's
    registry is read first, and once more if the buffer was replaced meanwhile."""
    await ch.sync_registry(deadline)  # the peer's registry as of now: never a buffer it has replaced
    for retry in (False, True):
        if name not in ch.peer_specs:
            raise UnknownBufferError(f"peer {ch.peer_name!r} has no buffer {name!r}")
        plane, _ = ch.map_plane(name)
        try:
            async with asyncio.timeout_at(deadline):
                return await plane.map(name)  # type: ignore[no-any-return]
        except TimeoutError:
            raise TransportTimeoutError(f"map({ch.peer_name!r}, {name!r}): opening the mapping timed out",
                                        Phase.CONNECT) from None
        except StaleBufferError:  # re-registered or unregistered since the registry was read
            if retry:
                raise
            await ch.sync_registry(deadline)
    raise AssertionError("unreachable")


async def map_plane(ch: Channel, name: str, deadline: float) -> Route:
    """Which plane :func:`map_buffer` would map the peer's buffer ``name`` over, and why."""
    await ch.sync_registry(deadline)
    if name not in ch.peer_specs:
        raise UnknownBufferError(f"peer {ch.peer_name!r} has no buffer {name!r}")
    plane, why = ch.map_plane(name)
    return Route(plane.name, why)
