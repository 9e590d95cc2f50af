"""Spawned-process helpers for tests/test_hostile_blocking.py.

* :func:`Target`: a RemoteEndpoint (tests/_remote.py) with this module's commands: it registers
  flat uint8 buffers and, for every notification it receives, records (at delivery, on its own
  loop) what the named buffer holds: the number of bytes equal to each value asked about.
* :func:`trainer_main`: an asyncio trainer that pushes stamped versions (every element of every
  tensor == the version) to one subscriber, as fast as it can, then reports.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
import traceback
from typing import Any

import torch

from tests._remote import NOT_MINE, RemoteEndpoint

_CTX = mp.get_context("spawn")


def _count(t: torch.Tensor, value: int) -> int:
    return int((t == value).sum())


def setup(ep: Any, state: dict[str, Any]) -> None:
    """Once the target's endpoint is open (tests._remote's ``commands=`` protocol): record what
    the watched buffer holds at each notification's delivery."""
    bufs = state["bufs"]
    seen = state["seen"] = []
    watch = state["watch"] = {"buf": None, "values": ()}

    def on_note(note: Any) -> None:  # runs on the loop at delivery: what the buffer holds right now
        if note.payload.startswith(b"chk:"):  # chk:NAME:OFFSET:LENGTH:VALUE -> whether that range is all VALUE
            _, bname, off, n, v = note.payload.decode().split(":")
            region = bufs[bname][int(off) : int(off) + int(n)]
            seen.append((note.payload, _count(region, int(v)) == int(n)))
            return
        b = watch["buf"]
        counts = {v: _count(bufs[b], v) for v in watch["values"]} if b else {}
        seen.append((note.payload, counts))

    ep.on_notification(on_note)


async def handle(ep: Any, state: dict[str, Any], cmd: str, args: tuple[Any, ...]) -> Any:
    """The target's commands; NOT_MINE for the others (tests._remote's)."""
    bufs, seen, watch = state["bufs"], state["seen"], state["watch"]  # ("register_fill": tests._remote's)
    if cmd == "watch":
        watch["buf"], watch["values"] = args[0], tuple(args[1])
        return None
    if cmd == "counts":
        bname, values = args
        t = bufs[bname]
        return {v: _count(t, v) for v in values}
    if cmd == "seen":
        return list(seen)
    if cmd == "clear_seen":
        seen.clear()
        return None
    return NOT_MINE


def Target(name: str, **kwargs: Any) -> RemoteEndpoint:  # noqa: N802 (what the tests call it)
    """A spawned target endpoint with :func:`setup` and :func:`handle`'s commands."""
    return RemoteEndpoint(name, commands="tests._hostile_blocking_remote", **kwargs)


def trainer_main(name: str, store_url: str, sub: str, spec: dict[str, tuple[str, tuple[int, ...]]],
                 versions: int, mode_kwargs: dict[str, Any], out: Any) -> None:
    """Push versions 1..``versions`` (stamped) to ``sub``; report ("done", oks, errors)."""
    import rl_sync
    import transport

    async def main() -> None:
        async with transport.Endpoint(name, store=store_url, timeout=20) as ep:
            pub = rl_sync.WeightPublisher(ep, [sub], bucket_bytes=64 << 10, **mode_kwargs)
            oks, errs = 0, []
            for v in range(1, versions + 1):
                model = {n: torch.full(tuple(sh), v, dtype=getattr(torch, dt)) for n, (dt, sh) in spec.items()}
                try:
                    report = await pub.push(model, v, timeout=15)
                except Exception as exc:  # noqa: BLE001
                    errs.append(f"{type(exc).__name__}: {exc}")
                    break
                if report.ok:
                    oks += 1
                else:
                    errs.append(report.summary())
                    if len(errs) > 3:
                        break
            out.put(("done", oks, errs))
            await asyncio.sleep(0.5)

    try:
        asyncio.run(main())
    except BaseException as exc:  # noqa: BLE001
        out.put(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


def start_trainer(name: str, store_url: str, sub: str, spec: Any, versions: int, **mode_kwargs: Any) -> tuple[Any, Any]:
    q = _CTX.Queue()
    p = _CTX.Process(target=trainer_main, args=(name, store_url, sub, spec, versions, mode_kwargs, q), daemon=True)
    p.start()
    return p, q


def wait_reply(q: Any, timeout: float) -> Any:
    end = time.monotonic() + timeout
    import queue

    while True:
        try:
            return q.get(timeout=max(0.1, end - time.monotonic()))
        except queue.Empty:
            if time.monotonic() > end:
                raise TimeoutError("no reply from the trainer") from None
