"""Same-host puts and gets with and without their round trip, per plane, in one run.

One target process on this host, one initiator (this process). For ``shm`` and for ``cuda_ipc``
(its CPU stand-in engine, ``MemfdIpcEngine``: copies on a worker thread, as a CUDA stream would
run them; the real engine runs in ``bench/bench_gpu.py`` on a GPU machine) and each size: the
median of ``--reps`` sequential ops of each kind:

- ``put``: no notification, so one-sided (the export's word in the target's slot table is locked
  and checked around the copy; no message);
- ``put+notify``: the same copy, then the header and the target's acknowledgement (the round trip
  a one-sided op saves; the notification itself is a few bytes);
- ``get``: one-sided.

Prints the medians and ``put+notify / put`` (> 1: what the round trip costs on top). The planes are
checked in the initiator's flight recorder; the target is asked how many op headers it served.

    python bench/one_sided.py [--reps 400] [--sizes 4096,65536,1048576]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

PLANES = ("shm", "cuda_ipc")


def _kwargs(plane: str) -> dict[str, Any]:
    if plane == "shm":
        return {"planes": ("shm",)}
    from transport.planes.cuda_ipc_memfd import MemfdIpcEngine

    return {"engines": {"cuda_ipc": MemfdIpcEngine}}  # (CPU buffers take cuda_ipc: its exports are preferred)


def _target(name: str, url: str, plane: str, sizes: list[int], ready: Any, stop: Any, headers: Any) -> None:
    import transport

    torch.set_num_threads(1)

    async def main() -> None:
        async with transport.Endpoint(name, store=url, timeout=30, **_kwargs(plane)) as ep:
            for size in sizes:
                ep.register(f"buf{size}", torch.zeros(size, dtype=torch.uint8))
            async def drain() -> None:  # the notifications, read as they come (nobody needs them)
                while True:
                    await ep.next_notification(timeout=3600)

            reader = asyncio.ensure_future(drain())
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            reader.cancel()
            headers.value = sum(1 for r in ep.recorder.snapshot() if r["role"] == "target" and r["kind"] in
                                ("put", "get"))

    asyncio.run(main())


async def _measure(plane: str, url: str, target: str, sizes: list[int], reps: int) -> tuple[dict, set]:
    import transport

    out: dict[tuple[str, int], float] = {}
    async with transport.Endpoint(f"init-{plane}", store=url, timeout=30, **_kwargs(plane)) as ep:
        await ep.connect(target)
        for size in sizes:
            src = torch.ones(size, dtype=torch.uint8)
            name = f"buf{size}"
            for kind in ("put", "put+notify", "get"):
                times = []
                for i in range(reps + 20):
                    t0 = time.perf_counter()
                    if kind == "get":
                        await ep.get(target, {name: src})
                    elif kind == "put":
                        await ep.put(target, {name: src})
                    else:
                        await ep.put(target, {name: src}, notify=b"n")
                    if i >= 20:  # (warm-up: maps, first faults)
                        times.append(time.perf_counter() - t0)
                out[(kind, size)] = statistics.median(times)
        planes = {r["plane"] for r in ep.recorder.snapshot() if r["kind"] in ("put", "get") and r["nbytes"]}
    return out, planes


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--sizes", default="4096,65536,1048576")
    ap.add_argument("--planes", default=",".join(PLANES))
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    url = f"tcp://127.0.0.1:{store.port}"
    ctx = mp.get_context("spawn")
    print(f"one-sided ops against the same copy with its round trip; median of {args.reps} sequential ops")
    print(f"{'plane':9} {'size':>7} {'put':>10} {'put+notify':>11} {'get':>10} {'round trip / put':>17}")
    for plane in args.planes.split(","):
        ready, stop, headers = ctx.Event(), ctx.Event(), ctx.Value("i", -1)
        name = f"tgt-{plane}"
        proc = ctx.Process(target=_target, args=(name, url, plane, sizes, ready, stop, headers), daemon=True)
        proc.start()
        try:
            if not ready.wait(60):
                raise SystemExit(f"the {plane} target did not start")
            out, used = asyncio.run(_measure(plane, url, name, sizes, args.reps))
        finally:
            stop.set()
            proc.join(30)
        if used != {plane}:
            raise SystemExit(f"{plane}: the ops took {sorted(used)}")
        for size in sizes:
            put, note, get = (out[(k, size)] for k in ("put", "put+notify", "get"))
            print(f"{plane:9} {_size(size):>7} {put * 1e6:8.0f}us {note * 1e6:9.0f}us {get * 1e6:8.0f}us "
                  f"{note / put:16.2f}x")
        # every put+notify is served by the target; the one-sided puts and gets are not
        want = len(sizes) * (args.reps + 20)
        print(f"{plane:9} target served {headers.value} op headers ({want} put+notify sent)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
