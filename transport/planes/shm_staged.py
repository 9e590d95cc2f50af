"""``shm`` for ops whose tensors on this side are on a GPU (staged), with the peer's buffers in its
CPU segments: :class:`StagedShmPlane`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..staging import stage_out
from ..wire import Item, Message
from .shm import _ABANDON_S, ShmPlane

__all__ = ["StagedShmPlane"]


class StagedShmPlane(ShmPlane):
    """``shm`` for ops whose tensors on this side are staged (on a GPU), with the peer's buffers
    in its CPU segments: the bytes go through this endpoint's pinned bounce buffers
    (:mod:`transport.staging`), in pipelined chunks with bounded memory, between the device and
    the peer's mapped segment. A put copies chunk after chunk device -> bounce buffer
    (asynchronously, up to the ring's size ahead) and bounce buffer -> segment; a get copies
    segment -> bounce buffer, then bounce buffer -> device. Before any of it, the caller's
    queued GPU work is awaited on the event loop (:func:`~transport.planes.staged.await_callers_work`),
    as on the staged plane: the op is *gated* (later ops on the channel go out after it), and
    its copies wait for nothing. The wire is ``shm``'s: the header follows the copy. A copy that
    fails or stalls fails the op with :class:`~transport.errors.StagingError`; nothing was sent,
    the channel stays usable, and a put may have written part of the peer's buffer (as any
    failed or cancelled ``shm`` put). It shares the channel's ``shm`` plane's mappings."""

    sends_at_once = False
    always_threaded = True
    one_sided = False  # (its copies wait for the staging engine: kept on the header's path)

    def __init__(self, channel, base: ShmPlane) -> None:
        super().__init__(channel)
        self._maps = base._maps  # one mapping per segment for both (the base drops stale ones)

    @property
    def _abandon_bound(self) -> float:  # (a chunk may wait for the staging engine, up to its stall bound)
        cfg = self.channel.staging.config
        return cfg.stall_timeout + 0.1 * cfg.buffers + 1.0 + _ABANDON_S

    async def _copy(self, op, pairs: list[tuple[Item, torch.Tensor]], into_peer: bool,
                    header: Callable[[list[int]], Message]) -> None:
        from .staged import await_callers_work

        await await_callers_work(self.channel, op, [t for _, t in pairs])
        if not into_peer:
            op.staged = True  # an abandoned get waits for its copies up to the staging bound
        await super()._copy(op, pairs, into_peer, header)

    def _copy_one(self, op, t: torch.Tensor, remote: torch.Tensor, into_peer: bool) -> bool:
        staging = self.channel.staging
        if not staging.stages(t.device):
            return super()._copy_one(op, t, remote, into_peer)
        flat = t.detach().reshape(-1).view(torch.uint8)
        if into_peer:
            ring = staging.ring(staging.engine(t.device), flat.numel())
            chunks = stage_out(flat, ring, staging.config.stall_timeout)
            try:
                pos = 0
                for view in chunks:
                    if op.abandoned:
                        return False
                    chunk = torch.frombuffer(view, dtype=torch.uint8)
                    remote[pos : pos + chunk.numel()].copy_(chunk)
                    pos += chunk.numel()
            finally:
                chunks.close()  # waits for the copies in flight (bounded)
                ring.release()
            return True
        pos, halted = 0, False

        def fill(view: memoryview, more: int) -> None:
            nonlocal pos
            n = len(view)
            if not halted:  # once no more is written, the rest needs no reading: no stream to keep in step
                torch.frombuffer(view, dtype=torch.uint8).copy_(remote[pos : pos + n])
            pos += n

        def halt() -> None:
            nonlocal halted
            halted = True

        def stuck() -> None:
            op.stuck = True
            halt()

        return staging.receive(flat, fill, stop=lambda: op.abandoned, on_stop=halt, on_stuck=stuck)
