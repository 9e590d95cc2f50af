"""How busy the event loop and the CPU were while one awaitable was awaited (shared by the CPU and
GPU tests of the completion bridge)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import NamedTuple

__all__ = ["LoopProbe", "probe_wait"]


class LoopProbe(NamedTuple):
    cpu: float  # process CPU seconds during the wait
    wall: float  # seconds the wait took
    ticks: int  # 10 ms sleeps another task completed meanwhile


async def probe_wait(aw: Awaitable[object], timeout: float) -> LoopProbe:
    """Await ``aw`` (bounded by ``timeout``) while a ticker task sleeps 10 ms at a time."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    t = asyncio.create_task(ticker())
    try:
        cpu0, wall0 = time.process_time(), time.monotonic()
        async with asyncio.timeout(timeout):
            await aw
        return LoopProbe(time.process_time() - cpu0, time.monotonic() - wall0, ticks)
    finally:
        t.cancel()
