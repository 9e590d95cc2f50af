"""Generators on another "host": run in new pid and mount namespaces (``unshare --pid --mount
--fork --mount-proc``), so that ``transport`` takes them for another host (same boot id, another
pid namespace), while they share one host with each other: one process per generator, children of
this one (in its namespaces).

    unshare --pid --mount --fork --mount-proc python tests/_pidns_host.py STORE_URL MODE NAME [NAME ...]

Each generator runs the GPU planes' CPU stand-in engines (``cuda_ipc``: memfd; ``nccl``: a socket
link), with ``shm`` left out. It prints ``ready`` once every subscriber serves, then answers lines
on stdin: ``check <trainer spec JSON>`` prints a JSON list of ``[version, exact]``, one per
generator in the order named (read inside ``hold()``), ``quit`` ends it. Every wait is bounded.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def generator(store: str, mode: str, names: list[str]) -> None:
    import asyncio
    import json

    import rl_sync
    import transport
    from tests._remote import poisoned, same_bytes
    from tests._rl_remote import seeded
    from tests.test_rl_faults import SPEC
    from transport.planes import SocketLinkEngine
    from transport.planes.cuda_ipc_memfd import MemfdIpcEngine

    kw = {"store": store, "timeout": 30, "planes": ("tcp", "cuda_ipc", "nccl"), "engines": {"cuda_ipc": MemfdIpcEngine, "nccl": SocketLinkEngine}}
    eps = [transport.Endpoint(n, **kw) for n in names]
    for ep in eps:
        await ep.open()
    models = [{n: poisoned(dt, tuple(sh)) for n, (dt, sh) in SPEC.items()} for _ in eps]
    subs = [rl_sync.WeightSubscriber(ep, model, mode=mode) for ep, model in zip(eps, models, strict=True)]
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await asyncio.wait_for(loop.run_in_executor(None, sys.stdin.readline), 600)
            if not line or line.strip() == "quit":
                return
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "check":
                spec = json.loads(arg)
                out = []
                for sub, model in zip(subs, models, strict=True):
                    async with sub.hold(timeout=30) as v:
                        want = seeded(spec, v) if v else {}
                        out.append([v, all(same_bytes(model[n], want[n].to(model[n].dtype)) for n in want)])
                print(json.dumps(out), flush=True)
    finally:
        for sub in subs:
            sub.close()
        for ep in eps:
            await ep.close()


def host(store: str, mode: str, names: list[str]) -> None:
    """One generator process per name (``--one``), its lines relayed."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, __file__, "--one", store, mode, n], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for n in names]
    try:
        for p in procs:
            if p.stdout is None or p.stdout.readline().strip() != "ready":
                raise SystemExit(f"a generator did not start (rc {p.poll()})")
        print("ready", flush=True)
        for line in sys.stdin:
            out = []
            for p in procs:
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write(line)
                p.stdin.flush()
                if line.strip() == "quit":
                    continue
                got = p.stdout.readline()
                out.extend(__import__("json").loads(got) if got else [[None, False]])
            if line.strip() == "quit":
                return
            print(__import__("json").dumps(out), flush=True)
    finally:
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    import asyncio

    if sys.argv[1] == "--one":
        asyncio.run(generator(sys.argv[2], sys.argv[3], sys.argv[4:]))
    else:
        host(sys.argv[1], sys.argv[2], sys.argv[3:])
