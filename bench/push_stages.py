"""Where the time of one small ``rl_sync`` push goes: the demo's push, stage by stage.

A trainer (this process) pushes the demo's policy (``examples/_toy_rl.py``, 270 KiB of float32)
to ``--generators`` spawned subscriber processes in ``--mode`` (default ``shared``, the demo's CPU
mode) ``--pushes`` times, and prints the median push time and, from the publisher's observer
(:class:`rl_sync.PushEvent`), when the last subscriber reached each stage (Begin sent, begun,
Commit sent, committed), and when the publisher started and ended packing and sealed the bank;
plus each subscriber's median time in its commit handler. The first 10 pushes are warm-up. It
wraps the publisher's and subscriber's methods in this script only; the library is not changed.

Usage: ``python bench/push_stages.py [--mode shared] [--generators 2] [--tensors N] [--pushes 60] [--gap-ms MS]``.
``--gap-ms 100`` idles before each push as the demo does (it samples and trains between pushes): on
this VM that makes every stage several times slower than back to back (cold caches, idle CPUs), and
the push times the demo prints are of that kind. This is a
diagnostic, not a benchmark with targets: compare two checkouts by alternating runs
(``PYTHONPATH``); this machine's speed drifts between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

WARMUP = 10


def _model(tensors: int, seed: int) -> torch.nn.Module:
    """The demo's policy, or (``tensors`` > 0) that many float32 parameters of 256 elements: a push
    whose cost is mostly per tensor (a real model has hundreds)."""
    if not tensors:
        from _toy_rl import build_policy

        return build_policy(seed)
    return torch.nn.ParameterDict({f"p{i}": torch.nn.Parameter(torch.full((256,), float(seed + i)))
                                   for i in range(tensors)})


def _generator(store: str, name: str, mode: str, tensors: int, q: Any, stop: Any) -> None:
    import rl_sync
    import transport
    from rl_sync.modes import base

    torch.set_num_threads(1)
    took: list[float] = []
    served: dict[type, Any] = {}

    def timed(cls: type) -> None:
        commit = served[cls] = cls.commit

        async def run(self: Any, push: Any, msg: Any) -> None:
            t = time.perf_counter()
            await commit(self, push, msg)
            took.append(time.perf_counter() - t)

        cls.commit = run  # type: ignore[method-assign]

    for cls in base.CommitMode.__subclasses__():
        timed(cls)

    async def run() -> None:
        ep = transport.Endpoint(name, store=store, timeout=30)
        rl_sync.WeightSubscriber(ep, _model(tensors, 0), mode=mode)
        async with ep:
            q.put("ready")
            while not stop.is_set():
                await asyncio.sleep(0.05)
        d = sorted(took[WARMUP:])
        q.put((name, d[len(d) // 2] if d else float("nan")))

    asyncio.run(run())


async def _trainer(args: argparse.Namespace) -> None:
    from torch.distributed import TCPStore

    import rl_sync
    import transport
    from rl_sync import banks, push_run

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = f"tcp://127.0.0.1:{server.port}"
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    names = [f"gen-{i}" for i in range(args.generators)]
    procs = [ctx.Process(target=_generator, args=(store, n, args.mode, args.tensors, q, stop), daemon=True) for n in names]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            if q.get(timeout=120) != "ready":
                raise RuntimeError("a generator did not start")
        marks: dict[str, list[float]] = collections.defaultdict(list)
        run_now: list[Any] = []
        pack, seal, execute = push_run.PushRun._pack_into, banks.BankSet.seal, push_run.PushRun.execute

        async def pack_w(self: Any, *a: Any) -> None:
            marks["pack started"].append(time.monotonic() - self.t0)
            await pack(self, *a)
            marks["pack ended"].append(time.monotonic() - self.t0)

        def seal_w(self: Any, *a: Any) -> None:
            seal(self, *a)
            marks["bank sealed"].append(time.monotonic() - run_now[0].t0)

        async def execute_w(self: Any, *a: Any) -> None:
            run_now[:] = [self]
            marks["planned"].append(time.monotonic() - self.t0)
            await execute(self, *a)

        push_run.PushRun._pack_into = pack_w  # type: ignore[method-assign]
        banks.BankSet.seal = seal_w  # type: ignore[method-assign]
        push_run.PushRun.execute = execute_w  # type: ignore[method-assign]
        policy = _model(args.tensors, 1)
        nbytes = sum(t.numel() * t.element_size() for t in policy.state_dict().values())
        events: list[rl_sync.PushEvent] = []
        stages: list[dict[str, float]] = []
        times: list[float] = []
        async with transport.Endpoint("trainer", store=store, timeout=30) as ep:
            pub = rl_sync.WeightPublisher(ep, names, observer=events.append)
            for v in range(1, args.pushes + 1):
                events.clear()
                if args.gap_ms:
                    await asyncio.sleep(args.gap_ms / 1e3)
                t = time.perf_counter()
                report = await pub.push(policy, v)
                dt = time.perf_counter() - t
                if not report.ok:
                    raise RuntimeError(report.summary())
                if v > WARMUP:
                    times.append(dt)
                    last: dict[str, float] = {}
                    for e in events:
                        last[e.kind] = max(last.get(e.kind, 0.0), e.seconds)
                    stages.append(last)
            pub.close()
        stop.set()
        handlers = dict(q.get(timeout=60) for _ in procs)
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for k, v in list(marks.items()):
        marks[k] = v[WARMUP:]
    times.sort()
    what = f"{args.tensors} tensors" if args.tensors else "the demo's policy"
    gap = f", {args.gap_ms:g} ms apart" if args.gap_ms else ""
    print(f"{args.mode} push of {nbytes / 1024:.0f} KiB ({what}) to {args.generators} generators, {len(times)} pushes{gap}: "
          f"median {times[len(times) // 2] * 1e3:.2f} ms, fastest {times[0] * 1e3:.2f} ms")
    rows: list[tuple[str, float]] = []
    for kind in dict.fromkeys(k for s in stages for k in s):
        vals = sorted(s[kind] for s in stages if kind in s)
        rows.append((f"{kind} (last subscriber)", vals[len(vals) // 2]))
    for kind, vals in marks.items():
        vals = sorted(vals)
        if vals:
            rows.append((kind, vals[len(vals) // 2]))
    print(f"{'stage':<34} {'ms after push()':>16}")
    for kind, at in sorted(rows, key=lambda r: r[1]):
        print(f"{kind:<34} {at * 1e3:16.2f}")
    for name, took in sorted(handlers.items()):
        print(f"{name}: commit handler median {took * 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="shared", choices=("staged", "swap", "direct", "shared"))
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--tensors", type=int, default=0,
                    help="push N float32 tensors of 256 elements instead of the demo's policy (per-tensor costs)")
    ap.add_argument("--pushes", type=int, default=60, help=f"pushes, the first {WARMUP} of them warm-up (default 60)")
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="idle time before each push (default 0: back to back). The demo pushes after ~100 ms "
                         "of sampling and training: its caches and the VM's CPUs are cold by then")
    args = ap.parse_args()
    if args.pushes <= WARMUP or args.generators < 1 or args.tensors < 0 or not 0 <= args.gap_ms <= 10_000:
        ap.error(f"--pushes must be > {WARMUP}, --generators >= 1, --tensors >= 0 and --gap-ms in [0, 10000]")
    torch.set_num_threads(1)
    asyncio.run(_trainer(args))


if __name__ == "__main__":
    main()
