"""A process that closes a shared-mode subscriber on its event loop and exits at once: the copy of
its weights out of the publisher's bank (on a thread of its own) must end before the interpreter
does (tests/test_rl_lifecycle.py runs it)."""

import asyncio
import sys

import torch
from torch.distributed import HashStore

import rl_sync
import transport


async def main() -> int:
    store = HashStore()
    spec = {f"w{i}": torch.zeros(2048, 4096) for i in range(16)}  # 512 MiB: the copy takes a while
    async with transport.Endpoint("trainer", store=store, timeout=30) as ep, \
            transport.Endpoint("gen", store=store, timeout=30) as gep:
        sub = rl_sync.WeightSubscriber(gep, spec, mode="shared")
        pub = rl_sync.WeightPublisher(ep, ["gen"])
        report = await pub.push({n: torch.ones_like(t) for n, t in spec.items()}, 1, timeout=60)
        assert report.ok, report.summary()
        sub.close()  # on the loop: the copy out of the bank runs on a thread of its own
        pub.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
