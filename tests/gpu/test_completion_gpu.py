"""The completion bridge (transport/completion.py) on real CUDA events.

A kernel that keeps the GPU busy for about a second (``torch.cuda._sleep``) is followed by a
blocking-sync event; awaiting it through the bridge must leave the event loop serving other tasks
and must not burn a core. A copy's event then gates a byte-exact check of its destination.
Plain ``asyncio.run`` inside sync tests: the device machine has no pytest-asyncio.
"""

from __future__ import annotations

import asyncio

import torch

from tests._loop_probe import LoopProbe, probe_wait
from transport.completion import CompletionBridge

MiB = 1 << 20


def _cycles_for(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for to last about ``seconds``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    ms = max(start.elapsed_time(end), 1e-3)
    return int(10_000_000 * seconds * 1000 / ms)


def test_long_gpu_wait_keeps_the_loop_serving_and_idle() -> None:
    cycles = _cycles_for(1.0)
    stream = torch.cuda.Stream()

    async def main() -> LoopProbe:
        bridge = CompletionBridge(asyncio.get_running_loop(), name="gpu-test-bridge")
        try:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
                ev = torch.cuda.Event(blocking=True)
                ev.record(stream)
            return await probe_wait(bridge.wait(ev), timeout=30)
        finally:
            bridge.close(2.0)

    cpu, wall, ticks = asyncio.run(main())
    assert wall > 0.5, f"the GPU sleep lasted only {wall:.2f} s; the test proves nothing"
    assert ticks >= 0.5 * wall / 0.01 * 0.5, f"the loop served {ticks} ticks of 10 ms in {wall:.2f} s"
    assert cpu < 0.5 * wall, f"{cpu:.2f} s of CPU while waiting {wall:.2f} s for the GPU: something spins"


def test_copy_event_gates_the_result() -> None:
    src = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8, device="cuda")
    dst = torch.full_like(src, 0xA5)  # poisoned
    stream = torch.cuda.Stream()

    async def main() -> bool:
        bridge = CompletionBridge(asyncio.get_running_loop())
        try:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event(blocking=True)
                ev.record(stream)
            async with asyncio.timeout(30):
                await bridge.wait(ev)
            return ev.query()
        finally:
            bridge.close(2.0)

    assert asyncio.run(main())
    assert torch.equal(dst, src)
