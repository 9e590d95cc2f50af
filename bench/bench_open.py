"""Time ``Endpoint.open()`` over many open/connect/put/close cycles (a generator restarting).

A spawned process serves the TCPStore and a target endpoint; this process opens an endpoint,
connects to the target, puts 4 KiB, closes, ``--cycles`` times, and prints the total, the
median and every cycle slower than ``--slow`` seconds (with the part spent in ``open()``).

    python bench/bench_open.py --cycles 300
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time

import torch


def _serve(q, stop) -> None:
    import transport

    async def main() -> None:
        async with transport.Endpoint("bench-open-target", store="tcp://127.0.0.1:0", host_store=True,
                                      timeout=30) as ep:
            ep.register("w", torch.zeros(1024))
            q.put(ep.store_url)
            while not stop.is_set():
                await asyncio.sleep(0.1)

    asyncio.run(main())


async def _cycles(url: str, n: int) -> list[tuple[float, float]]:
    import transport

    out = []
    src = torch.ones(1024)
    for i in range(n):
        t0 = time.monotonic()
        ep = transport.Endpoint(f"bench-open-{i}", store=url, timeout=30)
        await ep.open()
        t1 = time.monotonic()
        await ep.connect("bench-open-target")
        await ep.put("bench-open-target", {"w": src})
        await ep.close()
        out.append((time.monotonic() - t0, t1 - t0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--slow", type=float, default=1.0)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_serve, args=(q, stop), daemon=True)
    p.start()
    try:
        url = q.get(timeout=60)
        t0 = time.monotonic()
        res = asyncio.run(_cycles(url, args.cycles))
        total = time.monotonic() - t0
    finally:
        stop.set()
        p.join(10)
        if p.is_alive():
            p.kill()
    slow = [(i, c, o) for i, (c, o) in enumerate(res) if c > args.slow]
    print(f"{args.cycles} cycles in {total:.1f} s; median cycle {statistics.median(c for c, _ in res) * 1e3:.1f} ms, "
          f"median open {statistics.median(o for _, o in res) * 1e3:.1f} ms; {len(slow)} cycles over {args.slow} s"
          f" ({sum(c for _, c, _ in slow):.1f} s in them)")
    for i, c, o in slow:
        print(f"  cycle {i}: {c:.2f} s, of which open {o:.2f} s")


if __name__ == "__main__":
    main()
