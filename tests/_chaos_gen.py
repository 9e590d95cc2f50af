"""A generator process for the chaos soak (``tests/test_chaos_soak.py``), started with the spawn method.

It runs a :class:`rl_sync.WeightSubscriber` on its own Endpoint and, on a thread of its own, a
reader that reads the weights under ``hold_blocking()`` over and over: each read hashes every
tensor inside the hold and compares, outside it, with the sha256 of the version it held (every
version's bytes are known from the version: ``tests._netns_gen.weights``; version 0 is the
poisoned initial state). Its counters live in shared memory the test owns (``counters``:
reads, mixed-version reads, hold timeouts), so they outlive a SIGKILL. The pipe answers
``status`` (version and sha256 read under ``hold()``) and ``stop``; nothing else is needed from
the test: faults come from outside (signals, sockets destroyed with ``ss -K``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

READS, MIXED, HOLD_TIMEOUTS, LAST_VERSION = range(4)


async def warm_default_executor(workers: int = 8) -> None:
    """Give the loop a default executor and start all its threads now: the executor starts threads
    lazily, up to its maximum, which would otherwise read as growth between the samples."""
    import concurrent.futures

    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="asyncio"))
    await asyncio.gather(*[loop.run_in_executor(None, time.sleep, 0.1) for _ in range(workers)])


def generator_main(name: str, store_url: str, mode: str, spec: dict[str, Any], hb: float, conn: Any,
                   counters: Any, log_path: str) -> None:
    import collections

    import torch

    import rl_sync
    import transport
    from tests._netns_gen import digest, weights
    from tests._remote import poisoned

    logging.basicConfig(filename=log_path, level=logging.INFO,
                        format=f"%(asctime)s {os.getpid()} %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    model = {n: poisoned(dt, tuple(sh)) for n, (dt, sh) in spec.items()}
    initial = digest(model)  # version 0: the poisoned state nothing has been pushed into
    expected: collections.OrderedDict[int, str] = collections.OrderedDict()

    def want(version: int) -> str:
        if version == 0:
            return initial
        if version not in expected:
            expected[version] = digest(weights(spec, version))
            while len(expected) > 16:
                expected.popitem(last=False)
        return expected[version]

    async def open_() -> tuple[Any, Any]:
        ep = transport.Endpoint(name, store=store_url, timeout=10, heartbeat_interval=hb / 6, heartbeat_timeout=hb)
        await ep.open()
        return ep, rl_sync.WeightSubscriber(ep, model, mode=mode, commit_timeout=3.0)

    try:
        loop.run_until_complete(warm_default_executor())
        ep, sub = loop.run_until_complete(open_())
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}"))
        return
    stop = threading.Event()

    def reader() -> None:
        log = logging.getLogger("soak.reader")
        while not stop.is_set():
            try:
                with sub.hold_blocking(timeout=2.0) as v:
                    got = digest(model)
            except transport.TransportTimeoutError:
                counters[HOLD_TIMEOUTS] += 1
                continue
            except rl_sync.RlSyncError:
                return  # closed
            counters[READS] += 1
            counters[LAST_VERSION] = v
            if got != want(v):
                counters[MIXED] += 1
                log.error("MIXED READ: held version %d but the weights' sha256 is %s, not %s", v, got, want(v))
            time.sleep(0.02)

    threading.Thread(target=reader, name="soak-reader", daemon=True).start()
    conn.send(("ok", {"pid": os.getpid(), "address": list(ep.address), "incarnation": ep.incarnation}))

    async def status() -> dict[str, Any]:
        async with sub.hold(timeout=5.0) as v:
            return {"version": v, "sha256": await asyncio.to_thread(digest, model), "torn": sub.torn}

    def serve() -> None:
        while True:
            try:
                if not conn.poll(0.2):
                    continue
                cmd = conn.recv()
            except (EOFError, OSError):
                break
            if cmd == "stop":
                break
            try:
                conn.send(("ok", asyncio.run_coroutine_threadsafe(status(), loop).result(20)))
            except BaseException as exc:
                conn.send(("err", f"{type(exc).__name__}: {exc}"))
        stop.set()
        loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=serve, name="soak-control", daemon=True).start()
    loop.run_forever()
    sub.close()
    loop.run_until_complete(ep.close(timeout=3))
    try:
        conn.send(("ok", "stopped"))
    except OSError:
        pass
