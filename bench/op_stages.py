"""Where the time of one small put goes: a per-stage breakdown across both processes.

Two processes on this host (an initiator and a target, the plane forced with ``--plane``), the
target's registered buffer ``--size`` bytes. Both sides stamp ``time.perf_counter_ns`` (one
monotonic clock for the whole host) at the points below, by wrapping the channel's methods in this
script only; the library is not changed. After a warm-up, ``--ops`` puts run one after another;
ops whose stamps came in the usual order are kept, and the median gap between consecutive stamps
is printed per stage::

    I call          the initiator's ``await ep.put`` starts
    I send:Put      its channel hands the header to the sender
    I sent          ... and the sender returned (the fast path's sendmsg)
    T woke          the target's reader has bytes (poll returned and they were read)
    T parsed:Put    ... and decoded the header
    T send:Ack      the target hands its answer to the sender (the bytes are in the buffer)
    T sent
    I woke          the initiator's reader has the answer's bytes
    I parsed:Ack
    I dispatched    ... and asked the event loop to settle the op (call_soon_threadsafe)
    I settle        the event loop settles it
    I return        ``await ep.put`` returns

The wrappers cost about a microsecond per stamp. Usage: ``python bench/op_stages.py [--size N]
[--ops N] [--plane tcp]``. Compare runs of two checkouts alternately (``PYTHONPATH``): this
machine's speed drifts between runs by more than most changes move a stage.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_pc = time.perf_counter_ns


def _instrument(stamps: list[tuple[str, int]]) -> None:
    from transport import channel as channel_mod
    from transport import dispatch as dispatch_mod
    from transport import op_table as op_table_mod
    from transport import receiver as receiver_mod

    chan: Any = channel_mod.Channel
    reader: Any = dispatch_mod.Dispatcher
    ops: Any = op_table_mod.OpTable
    recv: Any = receiver_mod.Receiver
    send, dispatch, settle, fill = chan.send, reader.dispatch, ops.settle, recv._fill

    def send_w(self: Any, msg: Any, *a: Any, **k: Any) -> None:
        stamps.append(("send:" + type(msg).__name__, _pc()))
        send(self, msg, *a, **k)
        stamps.append(("sent", _pc()))

    def dispatch_w(self: Any, msg: Any) -> None:
        stamps.append(("parsed:" + type(msg).__name__, _pc()))
        dispatch(self, msg)
        stamps.append(("dispatched", _pc()))

    def settle_w(self: Any, op: Any, exc: Any) -> None:
        stamps.append(("settle", _pc()))
        settle(self, op, exc)

    def fill_w(self: Any, want: int) -> None:
        fill(self, want)
        stamps.append(("woke", _pc()))

    chan.send, reader.dispatch, ops.settle, recv._fill = send_w, dispatch_w, settle_w, fill_w


def _target(store: str, plane: str, size: int, q: Any, stop: Any) -> None:
    if plane == "tcp":  # over TCP, as from another host (not a same-host Unix socket: transport.local_socket)
        os.environ["TRANSPORT_UNIX_SOCKETS"] = "0"
    import transport

    torch.set_num_threads(1)
    stamps: list[tuple[str, int]] = []
    _instrument(stamps)

    async def run() -> None:
        async with transport.Endpoint("stages-target", store=store, planes=(plane,), timeout=30) as ep:
            ep.register("x", torch.zeros(size, dtype=torch.uint8))
            q.put("ready")
            while not stop.is_set():
                await asyncio.sleep(0.05)

    asyncio.run(run())
    q.put(stamps)


async def _initiator(args: argparse.Namespace) -> None:
    if args.plane == "tcp":
        os.environ["TRANSPORT_UNIX_SOCKETS"] = "0"
    from torch.distributed import TCPStore

    import transport

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = f"tcp://127.0.0.1:{server.port}"
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_target, args=(store, args.plane, args.size, q, stop), daemon=True)
    proc.start()
    try:
        if q.get(timeout=120) != "ready":
            raise RuntimeError("the target did not start")
        stamps: list[tuple[str, int]] = []
        _instrument(stamps)
        async with transport.Endpoint("stages-initiator", store=store, planes=(args.plane,), timeout=30) as ep:
            await ep.connect("stages-target", timeout=30)
            src = torch.ones(args.size, dtype=torch.uint8)
            for _ in range(args.ops):
                await ep.put("stages-target", {"x": src})
            stamps.clear()
            for _ in range(args.ops):
                stamps.append(("call", _pc()))
                await ep.put("stages-target", {"x": src})
                stamps.append(("return", _pc()))
        stop.set()
        theirs = q.get(timeout=60)
    finally:
        stop.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    merged = sorted([("I " + k, t) for k, t in stamps] + [("T " + k, t) for k, t in theirs], key=lambda s: s[1])
    ops: list[list[tuple[str, int]]] = []
    cur: list[tuple[str, int]] | None = None
    for k, t in merged:
        if k == "I call":
            cur = [(k, t)]
        elif cur is not None:
            cur.append((k, t))
            if k == "I return":
                ops.append(cur)
                cur = None
    if not ops:
        raise RuntimeError("no complete op was stamped")
    shape = collections.Counter(tuple(k for k, _ in op) for op in ops).most_common(1)[0][0]
    kept = [op for op in ops if tuple(k for k, _ in op) == shape]
    print(f"{args.plane} put of {args.size} bytes: {len(kept)} of {len(ops)} ops in the usual order; medians:")
    print(f"{'from':<16} {'to':<16} {'us':>8}")
    for i in range(1, len(shape)):
        gaps = sorted((op[i][1] - op[i - 1][1]) / 1000 for op in kept)
        print(f"{shape[i - 1]:<16} {shape[i]:<16} {gaps[len(gaps) // 2]:8.1f}")
    total = sorted((op[-1][1] - op[0][1]) / 1000 for op in kept)
    print(f"{'whole put':<33} {total[len(total) // 2]:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=4096, help="bytes per put (default 4096)")
    ap.add_argument("--ops", type=int, default=500, help="puts to warm up with, then to measure (default 500)")
    ap.add_argument("--plane", default="tcp", choices=("tcp", "shm"), help="the plane both sides allow")
    args = ap.parse_args()
    torch.set_num_threads(1)
    asyncio.run(_initiator(args))


if __name__ == "__main__":
    main()
