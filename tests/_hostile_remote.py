"""A spawned Endpoint driven over a pipe, with the few commands tests/test_hostile_registry.py
needs that tests/_remote.py's RemoteEndpoint lacks (timed take-backs with reuse of the memory,
gets that report which bytes they read, puts that report their error). Same pipe protocol as
RemoteEndpoint (it is one, with ``commands=`` this module), so every wait is bounded."""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any

import torch

from tests._remote import NOT_MINE, RemoteEndpoint


def _summary(t: torch.Tensor) -> dict[str, int]:
    """value -> how many elements hold it (int64 view, at most 16 distinct values kept)."""
    vals, counts = torch.unique(t.reshape(-1).view(torch.int64), return_counts=True)
    return {int(v): int(c) for v, c in list(zip(vals.tolist(), counts.tolist(), strict=True))[:16]}


def err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


async def handle(ep: Any, state: dict[str, Any], cmd: str, a: tuple[Any, ...]) -> Any:
    """This file's commands (tests._remote's ``commands=`` protocol); NOT_MINE for the others."""
    import transport

    bufs = state["bufs"]
    if cmd == "register_int64":  # int64 buffer of n elements, each `value`
        bname, n, value = a
        t = torch.full((n,), value, dtype=torch.int64)
        bufs[bname] = t
        ep.register(bname, t)
        return None
    if cmd == "summary":
        return _summary(bufs[a[0]])
    if cmd == "put":  # int64 tensor of n elements each `value` into `bname` (At offset if given); error or ""
        peer, bname, n, value, notify, timeout, *off = a
        t = torch.full((n,), value, dtype=torch.int64)
        tensors = {bname: transport.At(t, off[0]) if off else t}
        try:
            await ep.put(peer, tensors, notify=notify, timeout=timeout)
        except transport.TransportError as exc:
            return err(exc)
        return ""
    if cmd == "get":  # int64 tensor of n elements from `bname`: (error or "", summary of what it holds)
        peer, bname, n, timeout = a
        out = torch.full((n,), -1, dtype=torch.int64)
        try:
            await ep.get(peer, {bname: out}, timeout=timeout)
        except transport.TransportError as exc:
            return err(exc), _summary(out)
        return "", _summary(out)
    if cmd == "gets":  # `count` gets of `bname`: list of (error or "", summary)
        peer, bname, n, count, timeout = a
        res = []
        for _ in range(count):
            out = torch.full((n,), -1, dtype=torch.int64)
            try:
                await ep.get(peer, {bname: out}, timeout=timeout)
                res.append(("", _summary(out)))
            except transport.TransportError as exc:
                res.append((err(exc), {}))
        return res
    if cmd == "puts_notify":  # puts i = first..last of value i at element i, each with notify=str(i)
        peer, bname, first, last, timeout = a
        out = []
        for i in range(first, last):
            try:
                await ep.put(peer, {bname: transport.At(torch.tensor([i]), i)}, notify=str(i).encode(),
                             timeout=timeout)
                out.append((i, ""))
            except transport.TransportError as exc:
                out.append((i, type(exc).__name__))
        return out
    if cmd == "churn_reuse":  # `cycles` times, after a random 0..`jitter` s: unregister `bname` (plain:
        # then write `reuse` into the memory taken back), register a fresh int64 buffer of n elements
        # filled with `fresh`. Returns the summaries of each taken-back tensor after `settle` s
        bname, cycles, jitter, reuse, fresh, settle, discard, seed, n = a
        rng = random.Random(seed)
        old = []
        for _ in range(cycles):
            await asyncio.sleep(rng.uniform(0, jitter))
            t = bufs[bname]
            ep.unregister(bname, discard=discard)
            if not discard:
                t.fill_(reuse)
                old.append(t)
            nt = torch.full((n,), fresh, dtype=torch.int64)
            bufs[bname] = nt
            ep.register(bname, nt)
        await asyncio.sleep(settle)
        return [_summary(t) for t in old]
    if cmd == "churn_gens":  # `cycles` times, after a random 0..`jitter` s: re-register `bname` as a fresh
        # int64 buffer of sizes[k % 2] elements, each holding its generation number (2, 3, ...)
        bname, cycles, jitter, sizes, seed = a
        rng = random.Random(seed)
        for k in range(cycles):
            await asyncio.sleep(rng.uniform(0, jitter))
            ep.unregister(bname)
            nt = torch.full((sizes[k % 2],), k + 2, dtype=torch.int64)
            bufs[bname] = nt
            ep.register(bname, nt)
        return cycles + 1
    return NOT_MINE


class HostileRemote(RemoteEndpoint):
    """A RemoteEndpoint with this file's commands (see the module docstring)."""

    def __init__(self, name: str, ready_timeout: float = 60.0, **kwargs: Any) -> None:
        super().__init__(name, ready_timeout, commands="tests._hostile_remote", **kwargs)


def wait_gone(pid: int, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} still exists after {timeout} s")
