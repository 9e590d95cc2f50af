"""``nccl``: GPU buffers of a peer on another host, over the channel's own 2-rank NCCL communicator.

:class:`~transport.planes.nccl_link.Link` (one per channel) sets the communicator up and keeps every post in
the dialer's order (see :mod:`transport.planes.nccl_engine`); :class:`NcclPlane` runs the initiator's half of puts
and gets, and :meth:`~transport.planes.nccl_link.Link.serve` the target's half, from the channel's reader thread. The bytes never touch the
channel's socket: a put sends a small header, the initiator's ``ncclSend`` and the target's
``ncclRecv`` (posted by the target's endpoint when the header arrives; its application does
nothing) move them on each side's channel stream, and the target acknowledges from the receive's
completion. A get mirrors it; the initiator's op ends once its receive completed *and* the target
acknowledged (a target that rejects an op still posts its half, into or from scratch memory, so
that both streams stay in step, and answers ``Fail``).

Posts wait (on the GPU) for the work queued on the caller's current stream at the call; completion
is a blocking-sync event awaited by the link's :class:`~transport.completion.CompletionBridge`
thread: the loop stays free and no core spins while a long transfer runs.

Failures: NCCL operations cannot be cancelled. An op that times out, a lost channel (peer dead,
frozen past the heartbeat timeout, socket error) or a failed operation aborts the channel's
communicator (``ncclCommAbort``, on a worker thread, bounded) and closes the channel: its pending
ops fail with :class:`~transport.errors.PeerLostError`, the timed-out one with
:class:`~transport.errors.TransportTimeoutError`; other channels are untouched; the next op dials
a new channel, with a new communicator, which each side joins only once the aborted one's
operations are over (see :mod:`transport.planes.nccl_link`): nothing of the timed-out op runs beside a later
one. A get abandoned mid-receive returns only once the abort has stopped the receive (bounded), so
nothing is written into the caller's tensors afterwards. A cancelled op (the caller's task, not the
deadline) leaves the link up if it can: a get waits 0.25 s (plus its bytes at 1 GB/s) for its
receive to complete; one still pending then (a frozen or slow peer) aborts the link and closes the channel, and the get raises once
the abort stopped the receive (bounded), so a cancelled get never waits on a frozen peer. A put's
send, once posted, completes, and every later op of the channel is posted after it on the link (the
target's receive of a later put ends after the cancelled one's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from ..errors import PeerLostError, PlaneUnavailableError
from ..op import Op
from ..wire import Get, HostInfo, Item, Put
from .base import ChannelPort, DataPlane
from .nccl_link import Link, bytes_of, resolve

if TYPE_CHECKING:
    import asyncio

__all__ = ["NcclPlane"]


class NcclPlane(DataPlane):
    """Initiator side of the ``nccl`` plane (one per channel with a link)."""

    name = "nccl"
    inline_payload = False
    via_link = True
    sends_at_once = True  # posts and headers go out in the call, under the link's lock

    def __init__(self, channel: ChannelPort) -> None:
        super().__init__(channel)
        link = channel.link
        if link is None:
            raise PlaneUnavailableError("nccl: the channel has no NCCL link")
        self.link: Link = cast(Link, link)  # (the core holds it as a PeerLink: the nccl plane made it)

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return True, "decided per channel by its NCCL link"

    @classmethod
    def reaches(cls, local: HostInfo, remote: HostInfo) -> tuple[bool, str]:
        return True, "any host the channel reaches"

    def _start(self, op: Op, pairs: list[tuple[Item, torch.Tensor]], header: Put | Get, into_local: bool) -> None:
        link = self.link
        engine = link.engine
        tensors = [t for it, t in pairs if it.count]
        op.keep = [t for _, t in pairs]
        op.via_link = True
        after = engine.mark(tensors) if tensors else None
        views = [bytes_of(t) for t in tensors]
        loop = self.channel.loop
        after_fut: asyncio.Future[None] = loop.create_future()
        op.after = after_fut

        def finished(exc: BaseException | None) -> None:  # bridge thread (or here)
            if into_local:
                op.quiet.set()
            if exc is not None:
                self.channel.lose(PeerLostError(f"the NCCL link with {self.channel.peer_name!r} failed: {exc}"))
            try:
                loop.call_soon_threadsafe(resolve, after_fut, exc)
            except RuntimeError:
                pass

        def post() -> None:  # under link.lock
            targets = views
            if into_local:
                with op.lock:
                    if op.abandoned:  # (a listener's get given up before its Go) the post must still happen
                        targets = [engine.scratch(v.numel()) for v in views]
                    else:
                        op.busy = True
            try:
                last = link.post([] if into_local else targets, targets if into_local else [], after)
            except BaseException as exc:
                finished(exc)
                raise
            # (the scratch buffers live until the receive into them is done: freed before, the caching allocator
            # could hand their memory to another tensor while NCCL still writes it)
            def done(exc: BaseException | None, _keep: list[torch.Tensor] = targets) -> None:
                finished(exc)

            link.completed(last, done)

        if link.dialer:
            with link.lock:
                post()
                self.channel.send(header, op=op)
        else:
            def on_go() -> None:  # reader thread, under link.lock
                try:
                    post()
                except BaseException as exc:  # noqa: BLE001 - the op fails; the channel is lost by then
                    self.channel.fail_op(op, PeerLostError(f"posting nccl {op.kind.value} #{op.op_id} failed: {exc}"))

            def on_drop(exc: BaseException | None) -> None:  # never posted (rejected, or the link went down)
                if into_local:
                    op.quiet.set()
                try:
                    loop.call_soon_threadsafe(resolve, after_fut, exc)
                except RuntimeError:
                    pass

            with link.lock:
                link.awaiting_go[op.op_id] = (on_go, on_drop)
            try:
                self.channel.send(header, op=op)
            except BaseException:
                with link.lock:
                    link.awaiting_go.pop(op.op_id, None)
                raise

    async def put(self, op: Op, pairs: list[tuple[Item, torch.Tensor]], notify: bytes | None) -> None:
        self._start(op, pairs, Put(op.op_id, op.seq, self.name, [it for it, _ in pairs], notify), into_local=False)

    async def get(self, op: Op, pairs: list[tuple[Item, torch.Tensor]]) -> None:
        self._start(op, pairs, Get(op.op_id, op.seq, [it for it, _ in pairs], self.name), into_local=True)
