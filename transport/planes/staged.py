"""``staged``: GPU tensors through host bounce buffers, inline on the channel's socket.

The GPU plane used today for every op that touches GPU memory on either side
(see :func:`transport.planes.choose_gpu_plane`). On the wire it *is* the
``tcp`` plane: the header says ``tcp`` and the payload follows it in the
channel's stream, so the peer needs nothing special and decides on its own
whether to stage what it receives or sends (by its buffer's device). Staging
is local to each side (:mod:`transport.staging`):

- put: the header is queued with a payload iterator; the channel's writer
  thread drains it, so each chunk of a GPU tensor is copied device -> host
  into a bounce buffer right before it is sent (CPU tensors of the same op go
  straight from their memory). The target's reader receives each chunk into
  a bounce buffer and copies it host -> device if its buffer is on a GPU.
- get: the target's writer stages its GPU buffer out the same way; our reader
  stages the reply into the caller's GPU tensors.

Ordering with the caller's GPU work: before the op is handed to the channel
(a put's header and payload, a get's request), the plane awaits, on the
event loop, an event recorded on the caller's current stream at the call
(:func:`await_callers_work`, which the ``shm`` plane's staged ops use too); the copies are then issued
waiting for nothing, so no channel thread, and no copy stream shared by all
channels, ever waits on an application's stream.

It works over any channel, whatever its CPU plane (a peer's GPU buffer is
never in shared memory). On the sending side the header goes out once the
first chunk is staged: if that fails, nothing is sent, the op fails with
:class:`~transport.errors.StagingError` and the channel stays usable; a later
chunk that cannot be staged fails the op and closes the channel (the peer saw
part of the payload). On the receiving side the rest of the payload is
drained, the op fails with ``StagingError``, and the channel stays usable.

Cancellation and timeouts are ``tcp``'s: a put's payload that reached the writer
still goes out (staged chunk by chunk) and lands on the target before anything
sent after it on the channel; a get waits, before it raises, for the copies into
the caller's tensors already under way (bounded by the staging stall bound).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..completion import CompletionError
from ..errors import PeerLostError, StagingError
from ..registry import tensor_bytes
from ..wire import Get, HostInfo, Item, Put
from .base import DataPlane
from .tcp import TcpPlane

__all__ = ["StagedPlane", "await_callers_work"]


async def await_callers_work(channel: Any, op: Any, tensors: list[torch.Tensor]) -> None:
    """Await, on the event loop, the work the caller queued on its current stream(s) before
    the call (per staged device, an event the engine records there): the op's copies must
    see the tensors as that work leaves them. Only then is the op handed to the channel,
    and its copies are issued waiting for nothing, so the channel's reader and writer (and
    the engine's streams, shared by every channel) never wait on an application's stream.
    The wait runs on a :class:`~transport.completion.CompletionBridge` thread (blocking-sync
    events: no spinning), bounded by the op's deadline; it fails the op with
    :class:`StagingError` if that work failed."""
    staging = channel.staging
    marks = staging.mark(tensors)  # here, in the caller's thread: on its current streams
    for device, mark in marks.items():
        if mark is None:
            continue
        try:
            done = mark.query()  # done already: no need to queue behind other callers' marks
        except Exception as exc:  # the work it tracks failed
            raise StagingError(f"{op.kind.value} #{op.op_id}: the work queued on {device} before the call "
                               f"failed: {exc}") from exc
        if done:
            continue
        try:
            await staging.bridge(device, getattr(mark, "stream", None)).wait(mark)
        except CompletionError as exc:
            raise StagingError(f"{op.kind.value} #{op.op_id}: the work queued on {device} before the call "
                               f"failed: {exc}") from exc


class StagedPlane(DataPlane):
    name = "staged"
    inline_payload = True
    sends_at_once = False  # it awaits the caller's CUDA work first (see _after_callers_work)
    wire_plane = TcpPlane.name  # what the header says: the framing is tcp's

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return True, "needs only the channel's own socket"

    @classmethod
    def reaches(cls, local: HostInfo, remote: HostInfo) -> tuple[bool, str]:
        return True, "the channel's socket reaches any host"

    async def _after_callers_work(self, op: Any, tensors: list[torch.Tensor]) -> None:
        await await_callers_work(self.channel, op, tensors)

    async def put(self, op: Any, pairs: list[tuple[Item, torch.Tensor]], notify: bytes | None) -> None:
        tensors = [t for _, t in pairs]
        op.keep = tensors
        await self._after_callers_work(op, tensors)
        header = Put(op.op_id, op.seq, self.wire_plane, [it for it, _ in pairs], notify)
        peer = self.channel.peer_name

        def early(exc: StagingError) -> None:  # before the header went out: the channel is intact
            err = StagingError(f"put #{op.op_id} to {peer!r}: {exc}")
            err.__cause__ = exc
            self.channel.fail_op(op, err)

        self.channel.send(header, self._payload(op, tensors), op=op, early=early)

    def _payload(self, op: Any, tensors: list[torch.Tensor]) -> Iterator[memoryview]:
        started = False
        try:
            for view in self.channel.staging.payload(tensors):
                started = True
                yield view
        except StagingError as exc:
            if not started:
                raise  # the channel's _chain reports it: nothing was sent
            # the peer saw part of the payload: the channel cannot go on
            peer = self.channel.peer_name
            self.channel.fail_op(
                op,
                StagingError(f"put #{op.op_id} to {peer!r}: {exc}; the channel was closed (the peer had seen "
                             "part of the payload)"),
                PeerLostError(f"channel to {peer!r} closed: a staged payload could not be completed and the peer "
                              f"had seen part of it ({exc})"),
            )
            raise

    async def get(self, op: Any, pairs: list[tuple[Item, torch.Tensor]]) -> None:
        staging = self.channel.staging
        tensors = [t for _, t in pairs]
        op.keep = tensors
        await self._after_callers_work(op, tensors)  # before the request: the reply lands after that work
        op.staged = True  # (its copies wait for nothing more: the caller's work is done)
        op.dests = [t.detach().reshape(-1).view(torch.uint8) if staging.stages(t.device) else tensor_bytes(t)
                    for t in tensors]
        op.keep = tensors
        self.channel.send(Get(op.op_id, op.seq, [it for it, _ in pairs], self.wire_plane), op=op)
