"""Spawned-process helpers for tests/test_hostile_blocking.py.

* :func:`target_main`: an asyncio Endpoint that registers flat uint8 buffers and, for every
  notification it receives, records (at delivery, on its own loop) what the named buffer holds:
  the number of bytes equal to each value asked about. Driven over a pipe, every reply bounded.
* :func:`trainer_main`: an asyncio trainer that pushes stamped versions (every element of every
  tensor == the version) to one subscriber, as fast as it can, then reports.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
import time
import traceback
from typing import Any

import torch

from tests._remote import serve_commands

_CTX = mp.get_context("spawn")


def _count(t: torch.Tensor, value: int) -> int:
    return int((t == value).sum())


def target_main(conn: Any, name: str, kwargs: dict[str, Any]) -> None:
    import logging

    import transport

    logging.basicConfig(level=logging.WARNING)
    loop = asyncio.new_event_loop()
    bufs: dict[str, torch.Tensor] = {}
    seen: list[tuple[bytes, dict[int, int]]] = []
    watch: dict[str, Any] = {"buf": None, "values": ()}
    try:
        ep = transport.Endpoint(name, **kwargs)
        loop.run_until_complete(ep.open())
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return

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
    conn.send(("ok", os.getpid(), ""))

    async def handle(cmd: str, args: tuple[Any, ...]) -> Any:
        if cmd == "register_fill":
            bname, nbytes, value = args
            t = torch.full((nbytes,), value, dtype=torch.uint8)
            bufs[bname] = t
            ep.register(bname, t)
            return None
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
        raise ValueError(cmd)


    threading.Thread(target=serve_commands, args=(conn, loop, handle, 60), daemon=True).start()
    loop.run_forever()
    loop.run_until_complete(ep.close())
    loop.close()


class Target:
    def __init__(self, name: str, **kwargs: Any) -> None:
        from tests._remote import pipe_reply

        self._pipe_reply = pipe_reply
        self.name = name
        self._conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=target_main, args=(child, name, kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.pid = self._pipe_reply(self._conn, name, 60)

    def call(self, cmd: str, *args: Any, timeout: float = 30.0) -> Any:
        self._conn.send((cmd, args))
        return self._pipe_reply(self._conn, self.name, timeout)

    def kill(self) -> None:
        import signal

        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
        self.proc.join(10)
        self._conn.close()


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
