"""``tcp``: any host. Bytes travel in the channel's own stream, behind the header.

The target's reader thread receives them with ``recv_into`` straight into the
registered tensor: no intermediate copy on either side (the sender hands the
tensor's memory to ``sendall``).

Cancellation and timeouts: a put whose header was handed to the sender goes on
(its source tensor stays referenced and is read until its last byte is sent) and
the target still writes its bytes, but strictly before anything sent after it on
the channel: a later put or get of the same buffer over the channel lands or
reads after them. A get stops writing into the caller's tensors at the reader's
next chunk and drains the rest; if its bytes are still trickling in, the channel
is closed instead; either way the call raises only once nothing more is written.
"""

from __future__ import annotations

import socket

import torch

from ..registry import tensor_bytes
from ..wire import Get, HostInfo, Item, Put
from .base import DataPlane

__all__ = ["TcpPlane"]


class TcpPlane(DataPlane):
    name = "tcp"
    inline_payload = True
    answers_on_loop = True  # (the target checks each op against its registry as it serves it)

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
        except OSError as exc:
            return False, f"cannot bind a TCP socket: {exc}"
        return True, "TCP sockets work"

    @classmethod
    def reaches(cls, local: HostInfo, remote: HostInfo) -> tuple[bool, str]:
        return True, "TCP reaches any host"

    async def put(self, op, pairs: list[tuple[Item, torch.Tensor]], notify: bytes | None) -> None:
        header = Put(op.op_id, op.seq, self.name, [it for it, _ in pairs], notify)
        payload = [tensor_bytes(t) for _, t in pairs if t.numel()]
        op.keep = [t for _, t in pairs]
        self.channel.send(header, payload, op=op)

    async def get(self, op, pairs: list[tuple[Item, torch.Tensor]]) -> None:
        op.dests = [tensor_bytes(t) for _, t in pairs]
        op.keep = [t for _, t in pairs]
        self.channel.send(Get(op.op_id, op.seq, [it for it, _ in pairs]), op=op)
