"""The few commands tests/test_core_hostile2.py needs in its spawned endpoints (tests._remote's
``commands=`` protocol: same pipe, every wait bounded)."""

from __future__ import annotations

from typing import Any

import torch

from tests._remote import NOT_MINE


async def handle(ep: Any, state: dict[str, Any], cmd: str, a: tuple[Any, ...]) -> Any:
    bufs = state["bufs"]
    if cmd == "zeros_int64":  # a zero int64 buffer of n elements
        name, n = a
        bufs[name] = t = torch.zeros(n, dtype=torch.int64)
        ep.register(name, t)
        return None
    if cmd == "values":  # the buffer's elements, as a list
        return bufs[a[0]].reshape(-1).tolist()
    if cmd == "post_flood":  # `count` posts b"flood <i>" to `peer`, as fast as post() returns
        peer, count = a
        for i in range(count):
            await ep.post(peer, b"flood %d" % i, timeout=30)
        return None
    return NOT_MINE
