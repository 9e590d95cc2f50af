"""A target Endpoint in a spawned process for tests/test_cancel_race.py.

It registers flat ``uint8`` buffers that each hold one byte value and says, cheaply, what a
buffer holds (the race tests move hundreds of MiB per round: random data and seed-based checks,
as in tests/_remote.py, would cost more than the transfers). Every reply is awaited with a bound.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
import traceback
from typing import Any

import numpy as np
import torch

from tests._remote import pipe_reply

_CTX = mp.get_context("spawn")


def describe(t: torch.Tensor, value: int) -> dict[str, Any] | None:
    """None if every byte of ``t`` is ``value``; else where the others are and what they hold."""
    lo, hi = torch.aminmax(t)  # (fast: a 256 MiB buffer in ~20 ms)
    if int(lo) == int(hi) == value:
        return None
    other = t != value
    n = int(other.sum())
    if n == 0:
        return None
    first = int(torch.argmax(other.to(torch.uint8)))
    last = t.numel() - 1 - int(torch.argmax(other.flip(0).to(torch.uint8)))
    values = torch.unique(t[first : last + 1]).tolist()
    return {"wrong_bytes": n, "first": first, "last": last, "values": values[:8]}


def count(t: torch.Tensor, value: int) -> int:
    """How many bytes of ``t`` are ``value``, counted in whole aligned 8-byte words (fast)."""
    words = t[: t.numel() // 8 * 8].numpy().view(np.int64)
    return int(np.count_nonzero(words == int.from_bytes(bytes([value]) * 8, "little", signed=True))) * 8


def _child(conn: Any, name: str, kwargs: dict[str, Any]) -> None:
    import logging

    import transport

    logging.basicConfig(level=logging.WARNING)
    loop = asyncio.new_event_loop()
    bufs: dict[str, torch.Tensor] = {}
    try:
        ep = transport.Endpoint(name, **kwargs)
        loop.run_until_complete(ep.open())
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    conn.send(("ok", os.getpid(), ""))

    async def register(bname: str, nbytes: int, value: int) -> None:
        t = torch.full((nbytes,), value, dtype=torch.uint8)
        bufs[bname] = t
        ep.register(bname, t)

    def serve() -> None:
        while True:
            try:
                if not conn.poll(0.2):
                    continue
                cmd, args = conn.recv()
            except (EOFError, OSError):
                break
            if cmd == "stop":
                break
            try:
                if cmd == "register":
                    out: Any = asyncio.run_coroutine_threadsafe(register(*args), loop).result(60)
                elif cmd == "holds":  # (off the loop: the endpoint keeps serving meanwhile)
                    out = describe(bufs[args[0]], args[1])
                elif cmd == "count":
                    out = count(bufs[args[0]], args[1])
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                conn.send(("ok", out, ""))
            except BaseException as exc:  # report any failure to the test
                conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=serve, daemon=True).start()
    loop.run_forever()
    loop.run_until_complete(ep.close())
    loop.close()


class RaceTarget:
    """Handle on the target process; :meth:`call` blocks (tests call it through ``asyncio.to_thread``)."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        self.name = name
        self._conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=_child, args=(child, name, kwargs), daemon=True)
        self.proc.start()
        child.close()
        self._lock = threading.Lock()
        self.pid = self._reply(60.0)

    def _reply(self, timeout: float) -> Any:
        return pipe_reply(self._conn, self.name, timeout)

    def call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        with self._lock:
            self._conn.send((cmd, args))
            return self._reply(timeout)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("stop", ()))
            except OSError:
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self._conn.close()
