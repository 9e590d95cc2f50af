"""Child-side commands for ``tests/test_rl_hostile2.py`` (``RemoteEndpoint(..., commands=...)``).

Everything else (``sub_create``, ``sub_check_stamp``, ...) falls through to ``tests/_rl_remote.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch

from tests._remote import NOT_MINE


def _stamp_of(model: dict[str, torch.Tensor], v: int) -> tuple[bool, list[Any]]:
    bad = []
    for name, t in model.items():
        if not t.numel():
            continue
        lo, hi = t.min().item(), t.max().item()
        if lo != hi or (v > 0 and lo != v):
            bad.append((v, name, lo, hi))
    return not bad, bad


async def handle(ep: Any, state: dict[str, Any], cmd: str, args: tuple[Any, ...]) -> Any:
    if cmd == "h2_crowd_start":  # n reader tasks on the loop, each in and out of hold(): stamps checked inside
        n, inside = args
        sub, model = state["sub"], state["model"]
        stats = state["crowd"] = {"checks": 0, "bad": [], "versions": set(), "errors": []}

        async def reader() -> None:
            while True:
                try:
                    async with sub.hold() as v:
                        ok, bad = _stamp_of(model, v)
                        stats["bad"] += bad
                        stats["checks"] += 1
                        stats["versions"].add(v)
                        await asyncio.sleep(inside)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # (a hold that fails: counted, not fatal)
                    stats["errors"].append(repr(exc))
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0)

        state["crowd_tasks"] = [asyncio.ensure_future(reader()) for _ in range(n)]
        return None
    if cmd == "h2_crowd_stop":
        tasks = state.pop("crowd_tasks")
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=30)
        stats = state.pop("crowd")
        return stats["checks"], stats["bad"][:10], sorted(stats["versions"]), stats["errors"][:5]
    if cmd == "h2_thread_readers_start":  # n plain threads, each in and out of hold_blocking()
        n, inside = args
        sub, model = state["sub"], state["model"]
        stop = threading.Event()
        stats = state["threads"] = {"checks": 0, "bad": [], "errors": [], "stop": stop}
        lock = threading.Lock()

        def reader() -> None:
            while not stop.is_set():
                try:
                    with sub.hold_blocking(timeout=30) as v:
                        ok, bad = _stamp_of(model, v)
                        with lock:
                            stats["bad"] += bad
                            stats["checks"] += 1
                        time.sleep(inside)
                except Exception as exc:
                    with lock:
                        stats["errors"].append(repr(exc))
                    time.sleep(0.01)

        ts = state["thread_list"] = [threading.Thread(target=reader, daemon=True) for _ in range(n)]
        for t in ts:
            t.start()
        return None
    if cmd == "h2_thread_readers_stop":
        stats = state.pop("threads")
        stats["stop"].set()
        for t in state.pop("thread_list"):
            await asyncio.to_thread(t.join, 30)
        return stats["checks"], stats["bad"][:10], stats["errors"][:5]
    if cmd == "h2_slow_reader_marks":  # readers' GPU work looks pending: every ReaderMarks.wait takes `seconds`
        seconds = args[0]
        sub = state["sub"]

        async def slow_wait(timeout: float, abandoned=None) -> bool:
            await asyncio.sleep(seconds)
            return True

        sub._readers.wait = slow_wait
        return None
    if cmd == "h2_replace_param":  # the model's tensor `name` replaced by a new one of the same shape (poisoned)
        name = args[0]
        model = state["model"]
        model[name] = torch.full_like(model[name], -1)
        return None
    if cmd == "h2_set_data":  # the model's tensor `name` given new memory in place (p.data = ...), `dtype` or not
        name, dtype = args
        model = state["model"]
        t = model[name]
        new = torch.full(t.shape, -1, dtype=getattr(torch, dtype) if dtype else t.dtype)
        t.data = new
        return None
    if cmd == "h2_stamp_of":  # no hold(): the version and whether every tensor carries it
        sub, model = state["sub"], state["model"]
        v = sub.version
        return v, _stamp_of(model, v)[0], {n: (str(t.dtype), tuple(t.shape)) for n, t in model.items()}
    if cmd == "h2_check_now":  # (version, exact) inside hold(timeout), or ("torn", version) for torn weights
        sub, model = state["sub"], state["model"]
        if sub.torn:
            return "torn", sub.version
        async with sub.hold(timeout=args[0]) as v:
            return v, _stamp_of(model, v)[0]
    return NOT_MINE
