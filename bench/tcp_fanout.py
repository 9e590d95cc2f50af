"""tcp puts with a feature of the initiator's on and off, in one run: the event loop reading its ops'
answers (``--switch loop_reads``, transport.loop_reads), small ops reading their own answers
before they sleep (``--switch spin``, transport.answer_spin), or ops over 64 KiB doing so once all
their bytes are in the kernel (``--switch sent_spin``: answer_spin.SENT_SPIN_MAX_BYTES, 0 when off).

One initiator process and ``--peers`` target processes on this host, every channel on ``tcp``.
For each size: a put to one peer (sequential, one op at a time) and a put to every peer at once
(``asyncio.gather``: the fan-out of a trainer pushing to several generators), timed as the
median of ``--reps`` repetitions. Each round opens a fresh initiator Endpoint with the feature
on, then one with it off (the order alternates between rounds), against the same targets, so
both see the same machine. Prints the medians and on/off ratios (> 1: faster with the feature
on); a raw-socket reference is in ``bench/bench_transport.py``'s raw phase.

    python bench/tcp_fanout.py [--switch loop_reads|spin|sent_spin] [--peers 4] [--rounds 3] [--reps 200]
                               [--sizes 4096,1048576,16777216]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

STORE_TIMEOUT = 60.0


def _target(name: str, url: str, sizes: list[int], ready: Any, stop: Any) -> None:
    import transport

    torch.set_num_threads(1)

    async def main() -> None:
        async with transport.Endpoint(name, store=url, planes=("tcp",), timeout=30) as ep:
            for size in sizes:
                ep.register(f"buf{size}", torch.zeros(size, dtype=torch.uint8))
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.1)

    asyncio.run(main())


async def _measure(switch: str, on: bool, url: str, names: list[str], sizes: list[int], reps: int,
                   rnd: int) -> dict[tuple[str, int], float]:
    import transport
    from transport import answer_spin

    if switch == "loop_reads":
        os.environ["TRANSPORT_LOOP_READS"] = "1" if on else "0"  # (read when a channel is made)
    prev = answer_spin.SENT_SPIN_MAX_BYTES
    if switch == "sent_spin" and not on:
        answer_spin.SENT_SPIN_MAX_BYTES = 0  # (read at each op; restored below)
    try:
        out: dict[tuple[str, int], float] = {}
        async with transport.Endpoint(f"init-{rnd}-{int(on)}", store=url, planes=("tcp",), timeout=30) as ep:
            for n in names:
                await ep.connect(n)
                if switch == "spin" and not on:
                    ep._channels[n].ops.spin.budget = 0.0  # (the channel's policy; on: TRANSPORT_SPIN_US's budget)
            for size in sizes:
                src = torch.ones(size, dtype=torch.uint8)
                n_reps = max(10, reps * 4096 // max(size, 4096)) if size > 1 << 20 else reps
                for case in ("one peer", f"{len(names)} peers at once"):
                    times = []
                    for i in range(n_reps + n_reps // 10):
                        t0 = time.perf_counter()
                        if case == "one peer":
                            await ep.put(names[0], {f"buf{size}": src})
                        else:
                            await asyncio.gather(*(ep.put(n, {f"buf{size}": src}) for n in names))
                        if i >= n_reps // 10:
                            times.append(time.perf_counter() - t0)
                    out[(case, size)] = statistics.median(times)
    finally:
        answer_spin.SENT_SPIN_MAX_BYTES = prev
    return out


def _label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


async def _run(args: argparse.Namespace) -> None:
    import transport

    sizes = [int(s) for s in args.sizes.split(",")]
    os.environ["TRANSPORT_UNIX_SOCKETS"] = "0"  # over TCP, as from other hosts (inherited by the targets)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    async with transport.Endpoint("store-host", store="tcp://127.0.0.1:0", host_store=True, planes=("tcp",),
                                  timeout=30) as host:
        names = [f"target{i}" for i in range(args.peers)]
        procs = []
        for n in names:
            ready = ctx.Event()
            p = ctx.Process(target=_target, args=(n, host.store_url, sizes, ready, stop), daemon=True)
            p.start()
            procs.append((p, ready))
        try:
            for _, ready in procs:
                if not await asyncio.to_thread(ready.wait, STORE_TIMEOUT):
                    raise RuntimeError("a target did not start")
            res: dict[bool, list[dict[tuple[str, int], float]]] = {True: [], False: []}
            for rnd in range(args.rounds):
                for mode in ((True, False) if rnd % 2 == 0 else (False, True)):
                    url = host.store_url
                    assert url is not None
                    res[mode].append(await _measure(args.switch, mode, url, names, sizes, args.reps, rnd))
                    print(f"  round {rnd + 1}/{args.rounds}: {args.switch} {'on' if mode else 'off'} done", flush=True)
        finally:
            stop.set()
            for p, _ in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    print(f"\ntcp put, median per op over {args.rounds} rounds (median of round medians); "
          f"{args.peers} target processes; ratio = off / on (> 1: {args.switch} on is faster)")
    print(f"{'case':<20} {'size':>8} {args.switch + ' on':>14} {'off':>10} {'ratio':>7}")
    for size in sizes:
        for case in ("one peer", f"{args.peers} peers at once"):
            on = statistics.median(r[(case, size)] for r in res[True])
            off = statistics.median(r[(case, size)] for r in res[False])
            fmt = (lambda v: f"{v * 1e6:8.0f} us") if size < 1 << 20 else (lambda v: f"{v * 1e3:8.2f} ms")
            print(f"{case:<20} {_label(size):>8} {fmt(on):>14} {fmt(off):>10} {off / on:6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--switch", choices=("loop_reads", "spin", "sent_spin"), default="loop_reads",
                    help="the feature turned on and off (default: loop_reads)")
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--sizes", default="4096,1048576,16777216")
    args = ap.parse_args()
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
