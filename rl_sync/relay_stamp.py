"""What a subscriber's Pull reads (:func:`pull_ranges`), and the stamps that make a relay's bytes
checkable (:class:`Stamps`, :func:`check_relay`).

A dependent reads its relay's staging arena one-sidedly: the relay's code never sees the read, so
nothing it does can wait for it, and once the relay has committed it may take another publisher's
push into the same bank, make a new :class:`rl_sync.WeightSubscriber` on its endpoint (new arenas,
same names) or be restarted under its name. Each subscriber therefore registers a small buffer,
:data:`STAMP_BUFFER`, holding one stamp per bank: a random non-zero number written when a push's
Begin is served, *before* any byte of that push lands in the bank, and answered with the Begin
(:attr:`rl_sync.messages.Reply.stamp`); it is zeroed when the subscriber closes, and a new
subscriber (or process) starts from zeros. The publisher puts the relay's stamp in each relay Pull;
the dependent reads the bucket, *then* the relay's stamp of that bank: if it still is the one given,
no write of another push began before the read ended (the stamp changes first), so the bytes are
this push's. Otherwise the pull is refused (``error_kind="relay"``) and the publisher moves the
relay's dependents to itself.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import transport

from . import messages as m
from .plan import Bucket

__all__ = ["STAMP_BUFFER", "Stamps", "check_relay", "pull_ranges"]

STAMP_BUFFER = "rl_sync/stamp"


class Stamps:
    """A subscriber's stamp per bank, registered as :data:`STAMP_BUFFER` (int64, in CPU memory,
    whatever the weights' device: a peer always reaches CPU buffers)."""

    def __init__(self, endpoint: transport.Endpoint, nbanks: int) -> None:
        self.tensor = endpoint.new_buffer(STAMP_BUFFER, (max(1, nbanks),), torch.int64)

    def renew(self, bank: int) -> int:
        """A new stamp for ``bank``, written before any byte of the push that fills it (returned)."""
        stamp = (int.from_bytes(os.urandom(8), "little") >> 2) | 1  # (non-zero, fits an int64)
        self.tensor[bank] = stamp
        return stamp

    def clear(self) -> None:
        """No bank holds a push any more (the subscriber closes)."""
        self.tensor.zero_()


async def check_relay(endpoint: transport.Endpoint, msg: m.Pull) -> str | None:
    """After a relay pull's bytes landed: why they cannot be trusted (the relay's stamp of the bank
    is not the one ``msg`` carries any more, or cannot be read), or None."""
    if not msg.stamp:
        return f"the pull from relay {msg.source!r} carries no stamp to check its bytes against"
    got = torch.zeros(1, dtype=torch.int64)
    where = {STAMP_BUFFER: transport.At(got, msg.stamp_at)}
    try:
        if not endpoint.get_now(msg.source, where):
            await endpoint.get(msg.source, where)
    except transport.TransportError as exc:
        return f"the stamp of relay {msg.source!r} could not be read after its bytes ({type(exc).__name__}: {exc})"
    if int(got.item()) != msg.stamp:
        return (f"relay {msg.source!r} no longer holds this push's bytes in bank {msg.stamp_at} (it took another "
                f"push, made a new subscriber or restarted): its stamp changed")
    return None


def pull_ranges(b: Bucket, dest: torch.Tensor, msg: m.Pull) -> dict[str, Any]:
    """What a Pull reads into ``dest`` (bucket ``b``'s bytes in the arena): one range of the
    source's buffer, or, served live, each piece from the source's tensor of its entry."""
    if not msg.live:
        return {msg.buffer: transport.At(dest, msg.offset)}
    if len(msg.live) != len(b.pieces) or len(set(msg.live)) != len(msg.live):
        raise ValueError(f"the pull names {len(msg.live)} live buffers for the {len(b.pieces)} pieces of "
                         f"bucket {b.index}")
    where: dict[str, Any] = {}
    for name, p in zip(msg.live, b.pieces, strict=True):
        view = p.entry.view_in(dest, p.start, p.stop, origin=b.offset, flat=True)
        where[name] = transport.At(view, p.start // view.element_size())
    return where
