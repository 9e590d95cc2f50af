#!/usr/bin/env python
"""Throughput and latency of ``transport`` against the machine's limits and today's alternatives.

Usage::

    python bench/bench_transport.py [--quick] [--max-mib N] [--threads N] [--rounds N] [--only PHASES]
                                    [--nixl-python PATH] [--json PATH]

``--only raw,tcp`` runs just those phases (copy, raw, gloo, shm, tcp), e.g. to repeat the
``tcp`` against raw-socket comparison many times; ratios whose reference did not run are left out.
``--nixl-python PATH`` adds the torch-API phases (below: NIXL, and this repository's ``transport_rl``
backend per plane) whatever ``--only`` says: PATH is the python of another virtual environment
with torch >= 2.15 and ``nixl`` (bench/README.md has the recipe).

This is a benchmark, not a test: it never asserts on a number. It prints a
table and a "targets" section (PASS/MISS) and writes everything as JSON
(default ``bench/results/transport.json``, git-ignored).

Every measurement runs between real processes started with the ``spawn``
method; the orchestrator (this process) only starts phases, collects their
results over queues and kills whatever is left when a phase ends. Each phase
has a deadline; a phase that misses it or crashes becomes an error row and
the run goes on.

Phases (each one runs ``--rounds`` times, default 3, in an order rotated
every round, and the repetitions of all rounds are pooled, so that a slow
drift of a shared machine spreads over every case instead of biasing one):

* ``copy_``: ``dst.copy_(src)`` in one process, per size: the memcpy limit
  that the ``shm`` plane (which copies straight into the peer's mapping)
  is compared with.
* raw socket: two processes, blocking ``sendall`` of the buffer over
  loopback, receiver ``recv_into`` a preallocated, pre-touched buffer, then a
  1-byte ack back (so the timing is "until the receiver holds the bytes",
  the same completion rule as ``transport``'s ``put``). Plus a 4 KiB
  send+ack round trip, the floor for the latency row.
* Gloo: two ranks of ``torch.distributed`` over loopback; ``send``/``recv``
  per size (+ 1-element ack), and the state dict pushed with one
  ``broadcast`` per tensor (+ ack), which is what RL frameworks do today.
* transport ``shm`` and ``tcp``: a target process registers one float32
  buffer per size (then unregisters it, so at most one size is alive at a
  time) and idles; an initiator process times, per repetition, the plane's
  reference, ``await ep.put`` and ``await ep.get``, in an order that rotates
  every repetition, then the state dict in one call with a dict of all
  names, then 4 KiB put/get round trips. The reference is the ``copy_``
  phase's measurement (``shm``: a ``copy_`` between two private tensors of
  the initiator) or the raw-socket phase's (``tcp``: blocking ``sendall`` +
  1-byte ack, to a receiver thread of the target process over a loopback
  connection of its own). A put's or get's ratio is against the reference
  measured in its own repetitions (at most a second apart, under the same
  load); its ratio against the separate phase is printed next to it. The
  two references differ: on this 2-core VM the interleaved ``copy_`` runs
  5-30% slower than the ``copy_`` phase up to 64 MiB, most where ``copy_``
  alone runs from cache (the put and get between its repetitions leave
  other data in the caches), and the speed of both drifts between phases
  run seconds apart. The 4 KiB ``tcp`` latency rows compare with 4 KiB
  raw-socket send+acks interleaved the same way between the same two
  processes (the raw-socket phase's own 4 KiB p50 swings 15-65 us between
  runs here, with where the scheduler puts its two processes); ``shm``'s
  with the raw-socket phase. Both endpoints are forced onto the plane with ``planes=(plane,)``.
  After the timed ops, one more get checks the fetched bytes against what
  was put (a run with a mismatch says so).
* CPU time per op (``tcp`` phase, after the rest): user + system CPU time
  of the initiator process and of the target process (``getrusage``)
  around blocks of raw-socket send+acks and of puts, at 4 KiB and 1 MiB
  (raw, put, raw, put per size, after a warm-up), printed per op (means)
  with the put's extra CPU time against the raw socket: an upper bound on
  the part of the ``tcp`` gap that overlap with the copies has to hide (the
  wall column shows how much did not).
* ``torch.distributed._transport`` (PyTorch >= 2.15), with ``--nixl-python
  PATH``: three phases, ``nixl``, ``torchapi_shm`` and ``torchapi_tcp``, each
  ``PATH bench/_nixl_peer.py --backend B`` as a subprocess under the phase
  deadline: ``new_transport("nixl", "cpu")``, and ``new_transport("transport_rl",
  "cpu", plane=P)`` (this repository's backend, ``P`` = shm, tcp; the
  subprocess gets ``PYTHONPATH`` = this checkout, and the peer registers the
  backend with ``register_transport`` when the venv has no entry point for it;
  the NIXL run gets no ``PYTHONPATH`` and imports nothing of this repository),
  all three with the sizes, repetitions, warm-ups and 4 KiB iterations of the
  ``shm`` phase and the same measurement. It
  starts a target process that registers a pre-touched buffer per size and
  sends its serialized ``RemoteBuffer`` over a pipe, after both exchanged
  ``bind()`` bytes and connected; the initiator times ``write`` (put) and
  ``read`` (get) of the whole buffer from and into registered tensors of its
  own, alternating their order, each op polled with ``Work.is_completed()``
  until done, then 4 KiB writes and reads; one more write and read per size
  are checked byte for byte. The report prints the rows "NIXL write"/"NIXL
  read" and a table "ours / NIXL": shm put's GB/s over NIXL write's, shm
  get's over NIXL read's per size, and the 4 KiB p50s (ours / NIXL, lower is
  better). Then rows "torch API transport_rl shm|tcp write|read" (ratio: over
  our native put/get of the same plane, measured in this run; the note: over
  NIXL) and a table "torch API side by side": per size and op NIXL,
  transport_rl shm and tcp through torch's API, our native shm and tcp, and
  the ratios transport_rl / NIXL and transport_rl / native per plane (the
  cost of the torch API layer). All run on the same CPUs, in separate phases
  seconds apart.
  Without the flag, only whether this process's torch can import
  ``torch.distributed._transport`` and ``nixl`` is reported.

Throughput is bytes / seconds in GB/s (1e9 bytes/s); the reported figure is
the median of the timed repetitions after warm-up (the best one is in the
JSON and in the "best" column). ``torch.set_num_threads(--threads)`` is set
the same way in every benchmark process (default: half the usable cores, at
least 1, since every measurement keeps two processes busy; more OpenMP
threads than free cores makes parallel ``copy_`` calls stall on a
descheduled thread).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import json
import math
import multiprocessing as mp
import os
import queue
import resource
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import _common  # noqa: E402  (bench/_common.py)
import torch  # noqa: E402
from _common import loadavg, usable_cpus  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
FULL_SIZES_MIB = (1, 4, 16, 64, 256, 1024)
QUICK_SIZES_MIB = (1, 4, 16)
TARGET_NAME = "bench-target"
INIT_NAME = "bench-initiator"
LAT_BYTES = 4096
COST_SIZES = (LAT_BYTES, MiB)  # sizes of the tcp phase's CPU-per-op blocks
COST_BLOCKS = 2  # of each kind per size: raw, put, raw, put
STARTUP_TIMEOUT = 60.0  # a child waiting for its peer's address / store url
CMD_TIMEOUT = 120.0  # a target waiting for its next command
OP_TIMEOUT = 120.0  # transport endpoint timeout of every op

CTX = mp.get_context("spawn")


# ---------------------------------------------------------------------------- configuration
def make_config(args: argparse.Namespace) -> dict[str, Any]:
    quick = bool(args.quick)
    sizes_mib: tuple[int, ...] = QUICK_SIZES_MIB if quick else FULL_SIZES_MIB
    if args.max_mib is not None:
        sizes_mib = tuple(s for s in sizes_mib if s <= args.max_mib)
    sizes = [s * MiB for s in sizes_mib]
    rounds = args.rounds if args.rounds is not None else (1 if quick else 3)
    if quick:
        reps = {s: 3 for s in sizes}
        warm = {s: 1 for s in sizes}
        sd = {"d": 128, "layers": 24, "vocab": 8192, "ctx": 256}
        sd_reps, sd_warm = 3, 1
        lat_iters, lat_warm = 200, 20
        cost_ops, cost_warm = 50, 10
        phase_timeout = 90.0
    else:
        # per round: about 1 GiB / rounds timed per (case, size); over all rounds 6 to 60 repetitions
        reps = {s: max(2, min(20, math.ceil(GiB / rounds / s))) for s in sizes}
        warm = {s: 2 if s < 64 * MiB else 1 for s in sizes}
        sd = {"d": 384, "layers": 24, "vocab": 32000, "ctx": 1024}
        sd_reps, sd_warm = max(2, math.ceil(12 / rounds)), 1
        lat_iters, lat_warm = math.ceil(1200 / rounds), 100
        cost_ops, cost_warm = math.ceil(600 / rounds), 50
        phase_timeout = 300.0
    shapes = state_dict_shapes(**sd)
    return {
        "mode": "quick" if quick else "full",
        "threads": int(args.threads),
        "rounds": rounds,
        "sizes": sizes,
        "reps": {str(k): v for k, v in reps.items()},
        "warmup": {str(k): v for k, v in warm.items()},
        "statedict": {
            "model": sd,
            "shapes": shapes,
            "tensors": len(shapes),
            "nbytes": sum(4 * math.prod(s) for _, s in shapes),
            "reps": sd_reps,
            "warmup": sd_warm,
        },
        "latency": {"bytes": LAT_BYTES, "iters": lat_iters, "warmup": lat_warm},
        # tcp phase: CPU time per op, raw socket vs put, over blocks of ``ops`` (see _cpu_per_op)
        "cost": {"sizes": list(COST_SIZES), "ops": cost_ops, "warmup": cost_warm},
        "phase_timeout_s": phase_timeout,
    }


def state_dict_shapes(d: int, layers: int, vocab: int, ctx: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a small GPT-like transformer (12 tensors per layer)."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("tok_emb.weight", (vocab, d)), ("pos_emb.weight", (ctx, d))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes += [
            (p + "ln1.weight", (d,)),
            (p + "ln1.bias", (d,)),
            (p + "attn.qkv.weight", (3 * d, d)),
            (p + "attn.qkv.bias", (3 * d,)),
            (p + "attn.out.weight", (d, d)),
            (p + "attn.out.bias", (d,)),
            (p + "ln2.weight", (d,)),
            (p + "ln2.bias", (d,)),
            (p + "mlp.fc1.weight", (4 * d, d)),
            (p + "mlp.fc1.bias", (4 * d,)),
            (p + "mlp.fc2.weight", (d, 4 * d)),
            (p + "mlp.fc2.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def _reps(cfg: dict[str, Any], size: int) -> tuple[int, int]:
    return cfg["warmup"][str(size)], cfg["reps"][str(size)]


def _pattern(numel: int, offset: float = 0.0) -> torch.Tensor:
    t = torch.arange(numel, dtype=torch.float32)
    if offset:
        t.add_(offset)
    return t


def _statedict_tensors(shapes: list[tuple[str, tuple[int, ...]]], fill: bool) -> dict[str, torch.Tensor]:
    out = {}
    for i, (name, shape) in enumerate(shapes):
        if fill:
            out[name] = _pattern(math.prod(shape), float(i)).reshape(shape)
        else:
            out[name] = torch.zeros(shape, dtype=torch.float32)
    return out


def _time_sync(fn: Any, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


async def _time_async(fn: Any, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        await fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return times


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("peer closed the connection")
        got += k


def _send_and_ack(sock: socket.socket, view: memoryview, ack: memoryview) -> None:
    """One raw-socket transfer: the bytes, then wait for the receiver's 1-byte ack."""
    sock.sendall(view)
    _recv_exact_into(sock, ack)


def _recv_and_ack(conn: socket.socket, view: memoryview, times: int) -> None:
    """The receiving side of ``times`` :func:`_send_and_ack` calls."""
    for _ in range(times):
        _recv_exact_into(conn, view)
        conn.sendall(b"\x01")


def _tensor_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- child process plumbing
def _child_main(role: str, fn_name: str, threads: int, result_q: Any, args: tuple[Any, ...]) -> None:
    """Entry point of every benchmark process: set threads, run, report result or traceback."""
    try:
        torch.set_num_threads(threads)
        out = globals()[fn_name](*args)
        result_q.put(("result", role, out))
    except BaseException:  # report everything, including KeyboardInterrupt, then exit non-zero
        result_q.put(("error", role, f"{role} (pid {os.getpid()}): {traceback.format_exc()}"))
        sys.exit(1)


class PhaseError(RuntimeError):
    pass


STRAGGLERS: list[str] = []  # processes killed by the orchestrator, for the report


def _reap(procs: list[Any], grace: float) -> None:
    """Join every process within ``grace`` s, then terminate/kill the stragglers (bounded)."""
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            STRAGGLERS.append(f"{p.name} (pid {p.pid})")
            p.terminate()
            p.join(3.0)
            if p.is_alive():
                p.kill()
                p.join(3.0)


def run_phase(name: str, roles: list[tuple[str, str, tuple[Any, ...]]], cfg: dict[str, Any],
              queues: int = 0) -> dict[str, Any]:
    """Start one process per role (``role, function name, args``), each getting ``queues``
    extra shared queues appended to its args; wait (bounded) for every role's result."""
    timeout = cfg["phase_timeout_s"]
    result_q = CTX.Queue()
    extra = tuple(CTX.Queue() for _ in range(queues))
    procs = []
    results: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    ok = False
    try:
        for role, fn_name, args in roles:
            p = CTX.Process(target=_child_main, name=f"bench-{name}-{role}",
                            args=(role, fn_name, cfg["threads"], result_q, (*args, *extra)), daemon=True)
            p.start()
            procs.append(p)
        want = {r for r, _, _ in roles}
        all_exited_at: float | None = None
        while want - results.keys():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PhaseError(f"phase {name!r} timed out after {timeout:.0f} s waiting for "
                                 f"{sorted(want - results.keys())}")
            try:
                kind, role, payload = result_q.get(timeout=min(0.5, remaining))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    # give its traceback a moment to arrive before blaming the exit code
                    try:
                        kind, role, payload = result_q.get(timeout=2.0)
                    except queue.Empty:
                        raise PhaseError(f"{dead[0].name} died with exit code {dead[0].exitcode}") from None
                elif all(p.exitcode is not None for p in procs):
                    all_exited_at = all_exited_at or time.monotonic()
                    if time.monotonic() - all_exited_at > 3.0:
                        raise PhaseError(f"phase {name!r}: every process exited without reporting "
                                         f"{sorted(want - results.keys())}") from None
                    continue
                else:
                    continue
            if kind == "error":
                raise PhaseError(payload)
            results[role] = payload
        ok = True
        return results
    finally:
        # after a success the processes are closing their endpoints: let them; after a failure, don't wait
        _reap(procs, grace=15.0 if ok else 2.0)
        for q in (result_q, *extra):
            q.close()
            q.cancel_join_thread()


# ---------------------------------------------------------------------------- peer (a): copy_
def peer_copy(cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": {}, "torch_threads": torch.get_num_threads()}
    for size in cfg["sizes"]:
        n = size // 4
        src = _pattern(n)
        dst = torch.zeros(n, dtype=torch.float32)
        w, r = _reps(cfg, size)
        out["sizes"][str(size)] = _time_sync(functools.partial(dst.copy_, src), w, r)
        del src, dst
    # the state dict copied tensor by tensor: the memcpy limit of the shm state-dict put
    sd = cfg["statedict"]
    srcs = _statedict_tensors(sd["shapes"], fill=True)
    dsts = _statedict_tensors(sd["shapes"], fill=False)

    def loop() -> None:
        for k, t in srcs.items():
            dsts[k].copy_(t)

    out["statedict"] = _time_sync(loop, sd["warmup"], sd["reps"])
    return out


# ---------------------------------------------------------------------------- peer (b): raw socket
def peer_raw_receiver(cfg: dict[str, Any], port_q: Any) -> dict[str, Any]:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    srv.settimeout(STARTUP_TIMEOUT)
    conn, _ = srv.accept()
    srv.close()
    conn.settimeout(None)  # blocking, like transport's channel sockets; the phase deadline bounds it
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for size in cfg["sizes"]:
        buf = torch.zeros(size, dtype=torch.uint8)
        view = _tensor_view(buf)
        w, r = _reps(cfg, size)
        _recv_and_ack(conn, view, w + r)
        ok = bool(torch.equal(buf.view(torch.float32), _pattern(size // 4)))
        if not ok:
            raise RuntimeError(f"raw socket: received bytes differ from the pattern at size {size}")
        del buf, view
    lat = cfg["latency"]
    _recv_and_ack(conn, memoryview(bytearray(lat["bytes"])), lat["warmup"] + lat["iters"])
    conn.close()
    return {"verified": True}


def peer_raw_sender(cfg: dict[str, Any], port_q: Any) -> dict[str, Any]:
    port = port_q.get(timeout=STARTUP_TIMEOUT)
    sock = socket.create_connection(("127.0.0.1", port), timeout=STARTUP_TIMEOUT)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = memoryview(bytearray(1))
    out: dict[str, Any] = {"sizes": {}, "torch_threads": torch.get_num_threads()}
    for size in cfg["sizes"]:
        src = _pattern(size // 4)
        w, r = _reps(cfg, size)
        out["sizes"][str(size)] = _time_sync(functools.partial(_send_and_ack, sock, _tensor_view(src), ack), w, r)
        del src
    lat = cfg["latency"]
    rtt = functools.partial(_send_and_ack, sock, memoryview(bytes(lat["bytes"])), ack)
    out["latency"] = _time_sync(rtt, lat["warmup"], lat["iters"])
    sock.close()
    return out


# ---------------------------------------------------------------------------- peers (c), (d): Gloo
def peer_gloo(rank: int, cfg: dict[str, Any], port_q: Any) -> dict[str, Any]:
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, like the other peers
    tmo = timedelta(seconds=cfg["phase_timeout_s"])
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=tmo, wait_for_workers=False)
        port_q.put(store.port)
    else:
        port = port_q.get(timeout=STARTUP_TIMEOUT)
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=tmo)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=tmo)
    peer = 1 - rank
    ack = torch.zeros(1)
    out: dict[str, Any] = {"sizes": {}, "torch_threads": torch.get_num_threads()}
    try:
        for size in cfg["sizes"]:
            n = size // 4
            t = _pattern(n) if rank == 0 else torch.zeros(n, dtype=torch.float32)
            w, r = _reps(cfg, size)
            times = []
            for i in range(w + r):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(t, peer)
                    dist.recv(ack, peer)
                else:
                    dist.recv(t, peer)
                    dist.send(ack, peer)
                if i >= w:
                    times.append(time.perf_counter() - t0)
            if rank == 1 and not torch.equal(t, _pattern(n)):
                raise RuntimeError(f"gloo: received bytes differ from the pattern at size {size}")
            out["sizes"][str(size)] = times
            del t
        sd = cfg["statedict"]
        tensors = list(_statedict_tensors(sd["shapes"], fill=(rank == 0)).values())
        times = []
        for i in range(sd["warmup"] + sd["reps"]):
            dist.barrier()
            t0 = time.perf_counter()
            for t in tensors:
                dist.broadcast(t, src=0)
            if rank == 0:
                dist.recv(ack, peer)
            else:
                dist.send(ack, peer)
            if i >= sd["warmup"]:
                times.append(time.perf_counter() - t0)
        if rank == 1:
            want = _statedict_tensors(sd["shapes"], fill=True)
            if not all(torch.equal(a, b) for a, b in zip(tensors, want.values(), strict=True)):
                raise RuntimeError("gloo: the broadcast state dict differs from the source")
        out["statedict"] = times
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------- transport
def _tcp_over_tcp(plane: str) -> None:
    """The ``tcp`` plane is measured over TCP, as a peer on another host reaches it: both processes
    of this host turn the Unix-socket channels to same-host peers off (``transport.local_socket``)."""
    if plane == "tcp":
        os.environ["TRANSPORT_UNIX_SOCKETS"] = "0"


def transport_target(plane: str, cfg: dict[str, Any], ctrl_q: Any, resp_q: Any) -> dict[str, Any]:
    _tcp_over_tcp(plane)
    srv = None
    if plane == "tcp":  # the raw-socket reference, interleaved with the puts and gets (see _raw_receiver)
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
    try:
        return asyncio.run(_target_main(plane, cfg, ctrl_q, resp_q, srv))
    finally:
        if srv is not None:
            srv.close()


def _bounded_blocking(sock: socket.socket, seconds: float) -> None:
    """Blocking mode, like the raw-socket phase's sockets (``settimeout`` would poll before every
    call), with each send and receive still bounded by ``SO_SNDTIMEO``/``SO_RCVTIMEO``."""
    sock.settimeout(None)
    tv = struct.pack("ll", int(seconds), 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _raw_receiver(srv: socket.socket, cfg: dict[str, Any], resp_q: Any, errors: list[BaseException]) -> None:
    """Thread of the ``tcp`` target: the receiver of :func:`peer_raw_receiver` for the reference
    sends that the initiator interleaves with its puts and gets (same sizes and counts), plus one
    untimed send per size: its bytes are checked, and the next size's buffer made, before it is
    acknowledged, so none of that runs while the initiator times an op. A failure closes the
    connection (the initiator's next send or receive fails at once) and is put on ``resp_q``."""
    conn = None
    try:
        srv.settimeout(STARTUP_TIMEOUT)
        conn, _ = srv.accept()
        _bounded_blocking(conn, CMD_TIMEOUT)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sizes = cfg["sizes"]
        buf = torch.zeros(sizes[0], dtype=torch.uint8)
        for i, size in enumerate(sizes):
            view = _tensor_view(buf)
            w, r = _reps(cfg, size)
            _recv_and_ack(conn, view, w + r)
            _recv_exact_into(conn, view)  # the untimed one
            if not torch.equal(buf.view(torch.float32), _pattern(size // 4)):
                raise RuntimeError(f"raw socket (interleaved): received bytes differ from the pattern at size {size}")
            del view
            buf = torch.zeros(sizes[i + 1], dtype=torch.uint8) if i + 1 < len(sizes) else torch.zeros(0)
            conn.sendall(b"\x01")
        lat = cfg["latency"]  # the 4 KiB reference send+acks interleaved with the latency puts and gets
        buf = torch.zeros(lat["bytes"], dtype=torch.uint8)
        view = _tensor_view(buf)
        _recv_and_ack(conn, view, lat["warmup"] + lat["iters"])
        _recv_exact_into(conn, view)
        if not torch.equal(buf.view(torch.float32), _pattern(lat["bytes"] // 4, 7.0)):
            raise RuntimeError("raw socket (4 KiB, interleaved): received bytes differ from the pattern")
        del view
        conn.sendall(b"\x01")
        cost = cfg["cost"]
        for size in cost["sizes"]:  # the raw blocks of _cpu_per_op, then one untimed send checked before its ack
            buf = torch.zeros(size, dtype=torch.uint8)
            view = _tensor_view(buf)
            _recv_and_ack(conn, view, cost["warmup"] + COST_BLOCKS * cost["ops"])
            _recv_exact_into(conn, view)
            if not torch.equal(buf.view(torch.float32), _pattern(size // 4)):
                raise RuntimeError(f"raw socket (CPU per op): received bytes differ from the pattern at size {size}")
            del view
            conn.sendall(b"\x01")
    except BaseException as exc:  # reported by the target's main thread, and to the initiator
        errors.append(exc)
        resp_q.put(("raw-error", f"{type(exc).__name__}: {exc}"))
    finally:
        if conn is not None:
            conn.close()


def _cpu_seconds() -> tuple[float, float]:
    """User and system CPU time of this whole process (every thread) so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _raw_reference(sock: socket.socket, view: memoryview, ack: memoryview, resp_q: Any) -> None:
    """One reference send of the ``tcp`` phase; if the target's receiver failed, its error."""
    try:
        _send_and_ack(sock, view, ack)
    except (OSError, EOFError) as exc:
        try:
            reply = resp_q.get(timeout=5.0)
        except queue.Empty:
            raise exc from None
        raise RuntimeError(f"the target's raw-socket receiver failed: {reply!r}") from exc


async def _target_main(plane: str, cfg: dict[str, Any], ctrl_q: Any, resp_q: Any,
                       srv: socket.socket | None) -> dict[str, Any]:
    import threading

    from transport import Endpoint

    served = 0
    raw_errors: list[BaseException] = []
    raw = None
    if srv is not None:
        raw = threading.Thread(target=_raw_receiver, args=(srv, cfg, resp_q, raw_errors), name="raw-receiver",
                               daemon=True)
        raw.start()
    async with Endpoint(TARGET_NAME, store="tcp://127.0.0.1:0", host_store=True, planes=(plane,),
                        timeout=OP_TIMEOUT) as ep:
        resp_q.put(("url", ep.store_url, srv.getsockname()[1] if srv is not None else None))
        bufs: dict[str, torch.Tensor] = {}
        while True:
            cmd = await asyncio.to_thread(ctrl_q.get, True, CMD_TIMEOUT)
            served += 1
            op = cmd[0]
            if op == "register":
                for name, shape in cmd[1]:
                    # tcp: pre-touched like the raw-socket receiver's buffer; shm: register() copies
                    # the tensor into a memfd segment anyway (which touches every page)
                    t = torch.empty(shape) if plane == "shm" else torch.zeros(shape)
                    ep.register(name, t)
                    bufs[name] = t
            elif op == "unregister":
                for name in cmd[1]:
                    ep.unregister(name)
                    del bufs[name]
            elif op == "cpu":
                resp_q.put(("ok", len(bufs), _cpu_seconds()))
                continue
            elif op != "quit":
                raise RuntimeError(f"unknown command {cmd!r}")
            resp_q.put(("ok", len(bufs)))
            if op == "quit":
                break
    if raw is not None:
        raw.join(CMD_TIMEOUT)
        if raw_errors:
            raise raw_errors[0]
        if raw.is_alive():
            raise RuntimeError("the interleaved raw-socket receiver did not finish")
    return {"commands": served}


def transport_initiator(plane: str, cfg: dict[str, Any], ctrl_q: Any, resp_q: Any) -> dict[str, Any]:
    _tcp_over_tcp(plane)
    return asyncio.run(_initiator_main(plane, cfg, ctrl_q, resp_q))


async def _initiator_main(plane: str, cfg: dict[str, Any], ctrl_q: Any, resp_q: Any) -> dict[str, Any]:
    from transport import Endpoint

    kind, url, raw_port = resp_q.get(timeout=STARTUP_TIMEOUT)
    assert kind == "url", kind
    sock = None
    if raw_port is not None:
        sock = socket.create_connection(("127.0.0.1", raw_port), timeout=STARTUP_TIMEOUT)
        _bounded_blocking(sock, CMD_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = memoryview(bytearray(1))

    async def command(*cmd: Any) -> tuple[Any, ...]:
        ctrl_q.put(cmd)
        reply = await asyncio.to_thread(resp_q.get, True, CMD_TIMEOUT)
        if reply[0] != "ok":
            raise RuntimeError(f"target answered {reply!r} to {cmd[0]}")
        return tuple(reply)

    out: dict[str, Any] = {"sizes": {}, "torch_threads": torch.get_num_threads()}
    try:
        async with Endpoint(INIT_NAME, store=url, planes=(plane,), timeout=OP_TIMEOUT) as ep:
            peer = await ep.connect(TARGET_NAME)
            if peer.plane != plane:
                raise RuntimeError(f"asked for plane {plane!r}, got {peer.plane!r}: {peer.plane_reason}")
            out["plane"], out["plane_reason"] = peer.plane, peer.plane_reason

            # -- throughput per size (one buffer alive at a time). Each repetition times the plane's
            # reference (shm: copy_ between two private tensors of this process; tcp: a raw socket
            # send + ack to a thread of the target), a put and a get, in an order that rotates every
            # repetition (so none of them always follows the same one): the reference and the ops
            # it is compared with run at most a second apart, under the same load.
            for size in cfg["sizes"]:
                name = f"buf_{size}"
                await command("register", [(name, (size // 4,))])
                src = _pattern(size // 4)
                dst = torch.zeros(size // 4, dtype=torch.float32)
                reference: Any
                if sock is None:
                    reference = functools.partial(torch.zeros(size // 4, dtype=torch.float32).copy_, src)
                else:
                    reference = functools.partial(_raw_reference, sock, _tensor_view(src), ack, resp_q)
                do_put = functools.partial(ep.put, TARGET_NAME, {name: src})
                do_get = functools.partial(ep.get, TARGET_NAME, {name: dst})
                times = await _interleaved(reference, do_put, do_get, *_reps(cfg, size))
                if sock is not None:
                    reference()  # untimed: the receiver checks the bytes before it answers (see _raw_receiver)
                await do_get()  # untimed: the last timed op may have been the put
                out["sizes"][str(size)] = {**times, "verified": bool(torch.equal(src, dst))}
                del src, dst, reference, do_put, do_get
                await command("unregister", [name])

            # -- the state dict in one call
            sd = cfg["statedict"]
            await command("register", sd["shapes"])
            srcs = _statedict_tensors(sd["shapes"], fill=True)
            dsts = _statedict_tensors(sd["shapes"], fill=False)
            put = await _time_async(functools.partial(ep.put, TARGET_NAME, srcs), sd["warmup"], sd["reps"])
            get = await _time_async(functools.partial(ep.get, TARGET_NAME, dsts), sd["warmup"], sd["reps"])
            ok = all(torch.equal(srcs[k], dsts[k]) for k in srcs)
            out["statedict"] = {"put": put, "get": get, "verified": ok}
            del srcs, dsts
            await command("unregister", [n for n, _ in sd["shapes"]])

            # -- 4 KiB round trips
            lat = cfg["latency"]
            await command("register", [("lat", (lat["bytes"] // 4,))])
            src = _pattern(lat["bytes"] // 4, 7.0)
            dst = torch.zeros(lat["bytes"] // 4, dtype=torch.float32)
            do_put = functools.partial(ep.put, TARGET_NAME, {"lat": src})
            do_get = functools.partial(ep.get, TARGET_NAME, {"lat": dst})
            if sock is None:
                put = await _time_async(do_put, lat["warmup"], lat["iters"])
                get = await _time_async(do_get, lat["warmup"], lat["iters"])
                out["latency"] = {"put": put, "get": get, "verified": bool(torch.equal(src, dst))}
            else:  # the raw socket's send+ack between the same two processes, interleaved (as for the sizes)
                reference = functools.partial(_raw_reference, sock, _tensor_view(src), ack, resp_q)
                lat_times = await _interleaved(reference, do_put, do_get, lat["warmup"], lat["iters"])
                reference()  # untimed: the receiver checks the bytes before it answers (see _raw_receiver)
                out["latency"] = {**lat_times, "verified": bool(torch.equal(src, dst))}
            await command("unregister", ["lat"])

            if sock is not None:  # -- CPU time per op: raw socket send+ack against put
                out["cost"] = await _cpu_per_op(ep, sock, ack, cfg["cost"], command, resp_q)
    finally:
        # the endpoint is closed (it withdraws from the target's store) before the target may exit
        ctrl_q.put(("quit",))
        if sock is not None:
            sock.close()
    return out


async def _interleaved(reference: Any, do_put: Any, do_get: Any, warmup: int, reps: int) -> dict[str, list[float]]:
    """Seconds of each repetition of ``reference()`` (the reference, synchronous), ``do_put()``
    and ``do_get()`` (awaited), interleaved in a rotating order, after ``warmup`` untimed rounds."""
    steps: list[tuple[str, Any]] = [("ref", reference), ("put", do_put), ("get", do_get)]
    times: dict[str, list[float]] = {"ref": [], "put": [], "get": []}
    for i in range(warmup + reps):
        k = i % len(steps)
        for key, fn in steps[k:] + steps[:k]:
            t0 = time.perf_counter()
            if key == "ref":
                fn()
            else:
                await fn()
            if i >= warmup:
                times[key].append(time.perf_counter() - t0)
    return times


async def _cpu_per_op(ep: Any, sock: socket.socket, ack: memoryview, cost: dict[str, Any], command: Any,
                      resp_q: Any) -> dict[str, Any]:
    """User+system CPU time of the initiator and of the target process per raw-socket send+ack and
    per ``put`` of the same size, from ``getrusage`` around blocks of ``cost["ops"]`` ops (raw, put,
    raw, put per size, after a warm-up of each). The target's figure is its whole process: the
    raw-socket receiver thread for the raw blocks, the endpoint's threads for the puts, and in both
    the handling of the two "cpu" commands that read it. On loopback the kernel's receive path runs
    partly in the sending thread's context, so the columns are per process, not sender work against
    receiver work. A put's CPU time beyond the raw socket's is an upper bound on what overlap with
    the copies has to hide; the wall times show how much of it did not."""
    out: dict[str, Any] = {}
    n = cost["ops"]
    for size in cost["sizes"]:
        name = f"cost_{size}"
        await command("register", [(name, (size // 4,))])
        src = _pattern(size // 4)
        raw = functools.partial(_raw_reference, sock, _tensor_view(src), ack, resp_q)
        put = functools.partial(ep.put, TARGET_NAME, {name: src})
        for _ in range(cost["warmup"]):
            raw()
            await put()
        entry: dict[str, dict[str, list[float]]] = {k: {"wall": [], "initiator": [], "target": [], "ops": []}
                                                    for k in ("raw", "put")}
        for _ in range(COST_BLOCKS):
            for kind in ("raw", "put"):
                tgt0 = (await command("cpu"))[2]
                own0 = _cpu_seconds()
                t0 = time.perf_counter()
                for _ in range(n):
                    if kind == "raw":
                        raw()
                    else:
                        await put()
                wall = time.perf_counter() - t0
                own1 = _cpu_seconds()
                tgt1 = (await command("cpu"))[2]
                e = entry[kind]
                e["wall"].append(wall)
                e["initiator"].append(sum(own1) - sum(own0))
                e["target"].append(sum(tgt1) - sum(tgt0))
                e["ops"].append(float(n))
        raw()  # untimed: the receiver checks the bytes (and makes its next buffer) before it answers
        out[str(size)] = entry
        del src, raw, put
        await command("unregister", [name])
    return out


# ---------------------------------------------------------------------------- (e) torch.distributed._transport
def probe_torch_transport() -> dict[str, Any]:
    """Whether PyTorch's own transport (2.15+) with NIXL can be imported here. Never benchmarks a guess."""
    info: dict[str, Any] = {"torch": torch.__version__}
    for module in ("torch.distributed._transport", "nixl"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            info.update(available=False, reason=f"import {module}: {type(exc).__name__}: {exc}")
            return info
    info.update(available=True, reason="importable here; run with --nixl-python PATH (this or another "
                                       "venv's python) to measure it")
    return info


NIXL_PEER = ROOT / "bench" / "_nixl_peer.py"
# phases that run bench/_nixl_peer.py with --nixl-python: name -> (new_transport backend, plane option)
TORCH_API_PHASES: dict[str, tuple[str, str | None]] = {
    "nixl": ("nixl", None),
    "torchapi_shm": ("transport_rl", "shm"),
    "torchapi_tcp": ("transport_rl", "tcp"),
}


def run_nixl_phase(python: str, cfg: dict[str, Any], backend: str = "nixl", plane: str | None = None,
                   phase: str = "nixl") -> dict[str, Any]:
    """``python bench/_nixl_peer.py --backend BACKEND`` with the ``shm`` phase's sizes and counts, in
    its own process group, killed whole at the phase deadline; its one json line of results, or a
    PhaseError. ``transport_rl`` runs with ``PYTHONPATH`` = this checkout (the other venv need not
    have it installed; the peer registers the backend itself when the entry point is missing)."""
    timeout = cfg["phase_timeout_s"]
    sizes = cfg["sizes"]
    lat = cfg["latency"]
    cmd = [python, str(NIXL_PEER), "--backend", backend,
           "--sizes", ",".join(str(s) for s in sizes),
           "--reps", ",".join(str(_reps(cfg, s)[1]) for s in sizes),
           "--warmup", ",".join(str(_reps(cfg, s)[0]) for s in sizes),
           "--lat-iters", str(lat["iters"]), "--lat-warmup", str(lat["warmup"]),
           "--threads", str(cfg["threads"]), "--timeout", str(min(CMD_TIMEOUT, timeout))]
    if plane is not None:
        cmd += ["--plane", plane]
    # the peer's venv has its own torch: keep this process's paths out of its sys.path, except this
    # checkout's root for transport_rl (the package under test; its deps msgspec and numpy are the venv's)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if backend == "transport_rl":
        env["PYTHONPATH"] = str(ROOT)
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    except OSError as exc:
        raise PhaseError(f"--nixl-python {python}: {exc}") from None
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the peer and its target process
        except ProcessLookupError:
            pass
        proc.communicate()
        STRAGGLERS.append(f"{NIXL_PEER.name} --backend {backend} (pid {proc.pid}, process group)")
        raise PhaseError(f"phase {phase!r} timed out after {timeout:.0f} s") from None
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    try:
        doc = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = "\n".join(stderr.strip().splitlines()[-20:])
        raise PhaseError(f"{NIXL_PEER.name} exited with code {proc.returncode} without a json line:\n{tail}") from None
    if not doc.get("ok"):
        raise PhaseError(f"{NIXL_PEER.name} --backend {backend}: {doc.get('traceback', '')}{doc.get('error')}")
    return doc


# ---------------------------------------------------------------------------- analysis
def _med(times: list[float]) -> float:
    return statistics.median(times)


def _gbps(nbytes: int, t: float) -> float:
    return nbytes / t / 1e9 if t > 0 else float("nan")


def _pct(times: list[float], q: float) -> float:
    s = sorted(times)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _size_label(n: int) -> str:
    if n >= GiB and n % GiB == 0:
        return f"{n // GiB} GiB"
    if n >= MiB:
        return f"{n / MiB:.0f} MiB" if n % MiB == 0 else f"{n / MiB:.1f} MiB"
    return f"{n // 1024} KiB"


NIXL_OP = {"put": "write", "get": "read"}  # our op -> the torch.distributed._transport op it is compared with


def _tput_row(case: str, group: str, nbytes: int, times: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "case": case,
        "group": group,
        "size_bytes": nbytes,
        "reps": len(times),
        "times_s": times,
        "median_s": _med(times),
        "best_s": min(times),
        "gbps": _gbps(nbytes, _med(times)),
        "gbps_best": _gbps(nbytes, min(times)),
        **extra,
    }


def build_rows(cfg: dict[str, Any], res: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    sd = cfg["statedict"]
    copy_ = res.get("copy")
    raw = res.get("raw")
    gloo = res.get("gloo")
    nixl = res.get("nixl")

    def ref(peer: dict[str, Any] | None, size: int) -> float | None:
        if peer is None or str(size) not in peer["sizes"]:
            return None
        return _gbps(size, _med(peer["sizes"][str(size)]))

    for size in cfg["sizes"]:
        k = str(size)
        if copy_:
            rows.append(_tput_row("copy_ (memcpy)", "limit", size, copy_["sizes"][k]))
        if raw:
            rows.append(_tput_row("raw socket", "limit", size, raw["sizes"][k]))
        if gloo:
            rows.append(_tput_row("gloo send/recv", "peer", size, gloo["sizes"][k]))
            r = ref(raw, size)
            if r:
                rows[-1].update(ratio=rows[-1]["gbps"] / r, ratio_vs="raw socket")
        for plane, limit, limit_name in (("shm", copy_, "copy_"), ("tcp", raw, "raw socket")):
            tr = res.get(f"transport_{plane}")
            if not tr:
                continue
            entry = tr["sizes"][k]
            # the reference measured in the same repetitions as the ops (see _initiator_main)
            rows.append(_tput_row(f"{limit_name} (interleaved with {plane} ops)", "limit", size, entry["ref"]))
            paired = rows[-1]["gbps"]
            for op in ("put", "get"):
                row = _tput_row(f"transport {plane} {op}", "transport", size, entry[op], verified=entry["verified"])
                row.update(ratio=row["gbps"] / paired, ratio_vs=f"{limit_name}, interleaved")
                r = ref(limit, size)
                if r:
                    row["ratio_vs_phase"] = row["gbps"] / r
                g = ref(gloo, size)
                if g:
                    row["ratio_vs_gloo"] = row["gbps"] / g
                if plane == "shm" and nixl and k in nixl["sizes"]:
                    # ours / NIXL: shm put against NIXL write, shm get against NIXL read
                    row["ratio_vs_nixl"] = row["gbps"] / _gbps(size, _med(nixl["sizes"][k][NIXL_OP[op]]))
                rows.append(row)
        if nixl and k in nixl["sizes"]:
            entry = nixl["sizes"][k]
            for op in ("write", "read"):
                row = _tput_row(f"NIXL {op}", "nixl", size, entry[op], verified=entry["verified"])
                r = ref(copy_, size)
                if r:
                    row.update(ratio=row["gbps"] / r, ratio_vs="copy_ (separate phase)")
                rows.append(row)
        for plane in ("shm", "tcp"):  # transport_rl through torch's API, against our native API and NIXL
            api = res.get(f"torchapi_{plane}")
            if not (api and k in api["sizes"]):
                continue
            entry = api["sizes"][k]
            native = res.get(f"transport_{plane}")
            for op, nop in NIXL_OP.items():
                row = _tput_row(f"torch API transport_rl {plane} {nop}", "torchapi", size, entry[nop],
                                verified=entry["verified"])
                if native and k in native["sizes"]:
                    row.update(ratio=row["gbps"] / _gbps(size, _med(native["sizes"][k][op])),
                               ratio_vs=f"transport {plane} {op} (native API)")
                if nixl and k in nixl["sizes"]:
                    row["ratio_vs_nixl"] = row["gbps"] / _gbps(size, _med(nixl["sizes"][k][nop]))
                rows.append(row)

    # state dict
    nb, nt = sd["nbytes"], sd["tensors"]
    sd_label = f"{nt} tensors"
    gloo_t = _med(gloo["statedict"]) if gloo else None
    copy_t = _med(copy_["statedict"]) if copy_ else None
    if copy_:
        rows.append(_tput_row(f"statedict copy_ loop ({sd_label})", "limit", nb, copy_["statedict"]))
    if gloo:
        rows.append(_tput_row(f"statedict gloo broadcast/tensor ({sd_label})", "peer", nb, gloo["statedict"]))
    for plane in ("shm", "tcp"):
        tr = res.get(f"transport_{plane}")
        if not tr:
            continue
        for op in ("put", "get"):
            times = tr["statedict"][op]
            row = _tput_row(f"statedict transport {plane} {op} ({sd_label})", "transport", nb, times,
                            verified=tr["statedict"]["verified"])
            if gloo_t:
                row.update(ratio=gloo_t / _med(times), ratio_vs="gloo broadcast/tensor (speedup)")
            if plane == "shm" and copy_t:
                row["ratio_vs_copy_loop"] = copy_t / _med(times)
            rows.append(row)

    # latency
    raw_p50 = _pct(raw["latency"], 0.5) if raw else None
    if raw:
        rows.append(_lat_row("4 KiB raw socket send+ack", "limit", raw["latency"]))
    for plane in ("shm", "tcp"):
        tr = res.get(f"transport_{plane}")
        if not tr:
            continue
        paired_p50 = None
        if tr["latency"].get("ref"):  # (tcp: the raw socket measured between the same processes, interleaved)
            rows.append(_lat_row("4 KiB raw socket send+ack (interleaved with tcp ops)", "limit", tr["latency"]["ref"]))
            paired_p50 = rows[-1]["p50_us"]
        for op in ("put", "get"):
            row = _lat_row(f"4 KiB transport {plane} {op}", "transport", tr["latency"][op],
                           verified=tr["latency"]["verified"])
            if paired_p50:
                row.update(ratio=row["p50_us"] / paired_p50,
                           ratio_vs="raw socket p50, interleaved (lower is better)")
                if raw_p50:
                    row["ratio_vs_phase"] = row["p50_us"] / (raw_p50 * 1e6)
            elif raw_p50:
                row.update(ratio=row["p50_us"] / (raw_p50 * 1e6), ratio_vs="raw socket p50 (lower is better)")
            if plane == "shm" and nixl:
                row["p50_vs_nixl"] = row["p50_us"] / (_pct(nixl["latency"][NIXL_OP[op]], 0.5) * 1e6)
            rows.append(row)
    if nixl:
        for op in ("write", "read"):
            row = _lat_row(f"4 KiB NIXL {op}", "nixl", nixl["latency"][op], verified=nixl["latency"]["verified"])
            if raw_p50:
                row.update(ratio=row["p50_us"] / (raw_p50 * 1e6), ratio_vs="raw socket p50 (lower is better)")
            rows.append(row)
    for plane in ("shm", "tcp"):
        api = res.get(f"torchapi_{plane}")
        if not api:
            continue
        native = res.get(f"transport_{plane}")
        for op, nop in NIXL_OP.items():
            row = _lat_row(f"4 KiB torch API transport_rl {plane} {nop}", "torchapi", api["latency"][nop],
                           verified=api["latency"]["verified"])
            if native:
                row.update(ratio=row["p50_us"] / (_pct(native["latency"][op], 0.5) * 1e6),
                           ratio_vs=f"transport {plane} {op} p50, native API (lower is better)")
            if nixl:
                row["p50_vs_nixl"] = row["p50_us"] / (_pct(nixl["latency"][nop], 0.5) * 1e6)
            rows.append(row)

    # CPU time per op (tcp phase)
    cost = (res.get("transport_tcp") or {}).get("cost") or {}
    for size in cfg["cost"]["sizes"]:
        entry = cost.get(str(size))
        if not entry:
            continue
        raw_row = _cpu_row("raw socket send+ack", size, entry["raw"])
        put_row = _cpu_row("transport tcp put", size, entry["put"])
        put_row["extra_cpu_us"] = put_row["total_us"] - raw_row["total_us"]
        rows += [raw_row, put_row]
    return rows


def _cpu_row(what: str, size: int, e: dict[str, list[float]]) -> dict[str, Any]:
    """Per-op means over every block of one kind (see _cpu_per_op)."""
    ops = sum(e["ops"])
    init, target, wall = sum(e["initiator"]) / ops, sum(e["target"]) / ops, sum(e["wall"]) / ops
    return {
        "case": f"CPU per op: {what}",
        "group": "cost",
        "size_bytes": size,
        "ops": int(ops),
        "cpu": True,
        "wall_us": wall * 1e6,
        "initiator_us": init * 1e6,
        "target_us": target * 1e6,
        "total_us": (init + target) * 1e6,
        "cores_busy": (init + target) / wall if wall > 0 else float("nan"),
    }


def _lat_row(case: str, group: str, times: list[float], **extra: Any) -> dict[str, Any]:
    return {
        "case": case,
        "group": group,
        "size_bytes": LAT_BYTES,
        "reps": len(times),
        "p50_us": _pct(times, 0.5) * 1e6,
        "p99_us": _pct(times, 0.99) * 1e6,
        "mean_us": statistics.fmean(times) * 1e6,
        "max_us": max(times) * 1e6,
        "latency": True,
        **extra,
    }


def nixl_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ours / NIXL per size (shm put / NIXL write, shm get / NIXL read, GB/s of the medians: > 1 means
    ours is faster) and at 4 KiB (p50 / p50: < 1 means ours is faster)."""
    by = {(r["case"], r["size_bytes"]): r for r in rows if not r.get("cpu")}
    out: list[dict[str, Any]] = []
    sizes = sorted({s for c, s in by if c == "NIXL write"})
    for size in sizes:
        for op, nop in NIXL_OP.items():
            ours, theirs = by.get((f"transport shm {op}", size)), by.get((f"NIXL {nop}", size))
            if ours and theirs:
                out.append({"size_bytes": size, "ours": ours["case"], "nixl": theirs["case"], "ours_gbps": ours["gbps"],
                            "nixl_gbps": theirs["gbps"], "ratio": ours["gbps"] / theirs["gbps"],
                            "verified": ours.get("verified", True) and theirs.get("verified", True)})
    for op, nop in NIXL_OP.items():
        ours, theirs = by.get((f"4 KiB transport shm {op}", LAT_BYTES)), by.get((f"4 KiB NIXL {nop}", LAT_BYTES))
        if ours and theirs:
            out.append({"size_bytes": LAT_BYTES, "latency": True, "ours": ours["case"], "nixl": theirs["case"],
                        "ours_p50_us": ours["p50_us"], "nixl_p50_us": theirs["p50_us"],
                        "ratio": ours["p50_us"] / theirs["p50_us"],
                        "verified": ours.get("verified", True) and theirs.get("verified", True)})
    return out


SIDE_COLS = ("nixl", "api_shm", "api_tcp", "native_shm", "native_tcp")  # the side-by-side table's columns


def torch_api_side_by_side(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size and op (write = put, read = get) and at 4 KiB: NIXL and transport_rl (shm, tcp)
    through torch's API, and our native API (shm, tcp) from the same run, with the ratios
    transport_rl / NIXL and transport_rl through torch's API / native, per plane. GB/s of the
    medians (ratio > 1: the first is faster) or, at 4 KiB, p50 us (ratio > 1: the first is slower)."""
    by = {(r["case"], r["size_bytes"]): r for r in rows if not r.get("cpu")}
    out: list[dict[str, Any]] = []
    sizes = sorted({s for c, s in by if c.startswith(("NIXL ", "torch API transport_rl "))})
    for latency in (False, True):
        for size in [LAT_BYTES] if latency else sizes:
            for op, nop in NIXL_OP.items():
                pre = "4 KiB " if latency else ""
                cases = {"nixl": f"{pre}NIXL {nop}", "api_shm": f"{pre}torch API transport_rl shm {nop}",
                         "api_tcp": f"{pre}torch API transport_rl tcp {nop}",
                         "native_shm": f"{pre}transport shm {op}", "native_tcp": f"{pre}transport tcp {op}"}
                found = {col: by.get((case, size)) for col, case in cases.items()}
                if not (found["api_shm"] or found["api_tcp"] or found["nixl"]):
                    continue
                key = "p50_us" if latency else "gbps"
                e: dict[str, Any] = {"size_bytes": size, "latency": latency, "op": nop, "native_op": op,
                                     "unit": "p50 us" if latency else "GB/s",
                                     "verified": all(r.get("verified", True) for r in found.values() if r)}
                for col in SIDE_COLS:
                    e[col] = found[col][key] if found[col] else None
                for plane in ("shm", "tcp"):
                    api = e[f"api_{plane}"]
                    e[f"api_{plane}_vs_nixl"] = api / e["nixl"] if api and e["nixl"] else None
                    native = e[f"native_{plane}"]
                    e[f"api_{plane}_vs_native"] = api / native if api and native else None
                out.append(e)
    return out


def nixl_section(python: str, peer: dict[str, Any] | None, rows: list[dict[str, Any]],
                 api: dict[str, dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """The results' "nixl" section: which python ran the peer, its versions and settings, and the
    ratios; ``api``: the torchapi_* phases' results (transport_rl through torch's API), per phase."""
    out: dict[str, Any] = {"python": python, "ran": peer is not None}
    if peer:
        for k in ("torch", "python", "nixl", "nixl-cu12", "nixl-cu13", "plugin", "completion", "torch_threads",
                  "ucx_env", "setup_s"):
            if k in peer:
                out["peer_python" if k == "python" else k] = peer[k]
    out["ours_vs_nixl"] = nixl_ratios(rows)
    out["torch_api"] = {name: ({k: doc[k] for k in ("backend", "options", "registration", "torch", "completion",
                                                    "transport_path", "setup_s") if k in doc} | {"ran": True}
                               if doc else {"ran": False})
                        for name, doc in (api or {}).items()}
    out["torch_api_side_by_side"] = torch_api_side_by_side(rows)
    return out


def _format_side_by_side(sec: dict[str, Any]) -> list[str]:
    entries = sec.get("torch_api_side_by_side") or []
    api = sec.get("torch_api") or {}
    if not entries:
        return []
    reg = sorted({d["registration"] for d in api.values() if d.get("registration")})
    torch_v = next((d["torch"] for d in api.values() if d.get("torch")), sec.get("torch"))
    lines = ["", f"torch API side by side: new_transport(backend, \"cpu\") for NIXL and transport_rl (plane=shm, "
                 f"plane=tcp), torch {torch_v}, each op polled with Work.is_completed(), same sizes and "
                 "repetitions, separate phases; native = our Endpoint put/get in the same run",
             f"  transport_rl registered in that venv by: {'; '.join(reg) or '-'}"]
    for name, d in api.items():
        if not d.get("ran"):
            lines.append(f"  {name}: the phase failed (see ERRORS)")
    h = (f"{'size':>9} {'op':<5} {'NIXL':>8} {'trl shm':>8} {'trl tcp':>8} {'nat shm':>8} {'nat tcp':>8}  "
         f"{'shm/NIXL':>8} {'tcp/NIXL':>8}  {'shm/nat':>7} {'tcp/nat':>7}")
    lines.append(h)

    def num(v: float | None, lat: bool) -> str:
        return f"{'-':>8}" if v is None else (f"{v:5.0f} us" if lat else f"{v:8.2f}")

    def ratio(v: float | None, width: int) -> str:
        return f"{'-':>{width}}" if v is None else f"{v:{width - 1}.2f}x"

    for e in entries:
        lat = e["latency"]
        label = "4 KiB p50" if lat else _size_label(e["size_bytes"])
        bad = "  !! DATA MISMATCH" if not e["verified"] else ""
        lines.append(f"{label:>9} {e['op']:<5} " + " ".join(num(e[c], lat) for c in SIDE_COLS) + "  "
                     + f"{ratio(e['api_shm_vs_nixl'], 8)} {ratio(e['api_tcp_vs_nixl'], 8)}  "
                     + f"{ratio(e['api_shm_vs_native'], 7)} {ratio(e['api_tcp_vs_native'], 7)}{bad}")
    lines.append("GB/s rows: ratio > 1 means transport_rl (through torch's API) is faster than NIXL / than our "
                 "native API; 4 KiB p50 rows (us per op): ratio > 1 means it is slower; trl = transport_rl, "
                 "nat = native (write = put, read = get)")
    return lines


def _format_nixl(sec: dict[str, Any]) -> list[str]:
    if not sec["ran"]:
        return [f"{'torch.distributed._transport (NIXL)':<48} {'-':>9} {'n/a':>8}  the nixl phase failed "
                "(see ERRORS)"] + _format_side_by_side(sec)
    lines = [f"ours / NIXL: transport shm against torch.distributed._transport (torch {sec.get('torch')}, "
             f"nixl {sec.get('nixl')}, {sec.get('plugin')}; completion: {sec.get('completion')} Work), "
             "same sizes and repetitions, separate phases:"]
    h = (f"{'size':>9}  {'shm put':>8} {'NIXL write':>10} {'ours/NIXL':>9}   {'shm get':>8} {'NIXL read':>9} "
         f"{'ours/NIXL':>9}")
    lines.append(h)
    by = {(e["size_bytes"], e.get("latency", False), e["ours"].split()[-1]): e for e in sec["ours_vs_nixl"]}
    for size in sorted({e["size_bytes"] for e in sec["ours_vs_nixl"] if not e.get("latency")}):
        cells = []
        for op in ("put", "get"):
            e = by.get((size, False, op))
            bad = "!" if e and not e["verified"] else " "
            cells.append(f"{e['ours_gbps']:8.2f} {e['nixl_gbps']:{10 if op == 'put' else 9}.2f} "
                         f"{e['ratio']:8.2f}x{bad}" if e else f"{'-':>8} {'-':>10} {'-':>9} ")
        lines.append(f"{_size_label(size):>9}  {cells[0]}  {cells[1]}")
    lat = [by.get((LAT_BYTES, True, op)) for op in ("put", "get")]
    if any(lat):
        cells = []
        for op, e in zip(("put", "get"), lat, strict=True):
            bad = "!" if e and not e["verified"] else " "
            cells.append(f"{e['ours_p50_us']:5.0f} us {e['nixl_p50_us']:{7 if op == 'put' else 6}.0f} us "
                         f"{e['ratio']:8.2f}x{bad}" if e else f"{'-':>8} {'-':>10} {'-':>9} ")
        lines.append(f"{'4 KiB p50':>9}  {cells[0]}  {cells[1]}")
    if not sec["ours_vs_nixl"]:
        lines.append("  (no shm phase ran: nothing to compare; the NIXL rows are in the table above)")
        return lines + _format_side_by_side(sec)
    lines.append("GB/s rows: ours/NIXL > 1 means ours is faster; 4 KiB p50 row (us per op): ours/NIXL < 1 means "
                 "ours is faster; '!' = a data mismatch")
    return lines + _format_side_by_side(sec)


def evaluate_targets(cfg: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["case"], r["size_bytes"]): r for r in rows}
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: float, higher: bool, detail: str) -> None:
        if value is None or math.isnan(value):
            out.append({"target": name, "status": "N/A", "value": None, "goal": goal, "detail": detail})
            return
        ok = value >= goal if higher else value <= goal
        out.append({"target": name, "status": "PASS" if ok else "MISS", "value": value, "goal": goal,
                    "detail": detail})

    def detail(r: dict[str, Any] | None, phase: str) -> str:
        if r is None:
            return "not measured"
        own = f"; {r['ratio_vs_phase']:.2f}x the {phase} phase" if "ratio_vs_phase" in r else ""
        return f"{r['gbps']:.2f} GB/s{own}"

    # the targets of the cost-per-op issue: shm against NIXL (when --nixl-python ran it) and copy_,
    # tcp against the raw socket
    for n in nixl_ratios(rows):
        if n.get("latency"):
            add(f"{n['ours']} p50 <= {n['nixl']}'s", n["ratio"], 1.0, False,
                f"{n['ours_p50_us']:.0f} us vs {n['nixl_p50_us']:.0f} us")
        else:
            add(f"{n['ours']} >= 1.0x {n['nixl']} @ {_size_label(n['size_bytes'])}", n["ratio"], 1.0, True,
                f"{n['ours_gbps']:.2f} vs {n['nixl_gbps']:.2f} GB/s")
    big = [s for s in cfg["sizes"] if s >= 64 * MiB]
    if not big:
        add("shm >= 0.9x copy_ at >= 64 MiB", None, 0.9, True, "no size >= 64 MiB was measured")
    for op in ("put", "get"):
        for s in big:
            r = by.get((f"transport shm {op}", s))
            add(f"shm {op} >= 0.9x copy_ @ {_size_label(s)}", r.get("ratio") if r else None, 0.9, True,
                detail(r, "copy_"))
    for op in ("put", "get"):
        for s in cfg["sizes"]:
            r = by.get((f"transport tcp {op}", s))
            add(f"tcp {op} >= 0.9x raw socket @ {_size_label(s)}", r.get("ratio") if r else None, 0.9, True,
                detail(r, "raw socket"))
    # the raw socket between the same two processes, interleaved with the ops; else the raw phase's
    raw = by.get(("4 KiB raw socket send+ack (interleaved with tcp ops)", LAT_BYTES)) \
        or by.get(("4 KiB raw socket send+ack", LAT_BYTES))
    for op in ("put", "get"):
        r = by.get((f"4 KiB transport tcp {op}", LAT_BYTES))
        add(f"4 KiB tcp {op} p50 <= 1.5x the raw socket's send+ack",
            r["p50_us"] / raw["p50_us"] if r and raw else None, 1.5, False,
            f"{r['p50_us']:.0f} us vs {raw['p50_us']:.0f} us "
            f"({'interleaved' if 'interleaved' in raw['case'] else 'the raw phase'})"
            if r and raw else "not measured")
    return out


def format_report(cfg: dict[str, Any], env: dict[str, Any], rows: list[dict[str, Any]],
                  targets: list[dict[str, Any]], errors: list[dict[str, Any]], nixl: dict[str, Any],
                  nixl_run: dict[str, Any] | None = None) -> str:
    """``nixl``: the import probe of this process; ``nixl_run``: the "nixl" section of the results
    (see :func:`nixl_section`) when ``--nixl-python`` was given."""
    lines = []
    sd = cfg["statedict"]
    lines.append(f"transport benchmark ({cfg['mode']}), torch {env['torch']}, python {env['python']}, "
                 f"{env['cpu_count']} CPUs ({env['usable_cpus']} usable), {env['date']}")
    idle = env.get("cpu_idle_before_start")
    if idle is not None:
        busy = " -- other processes were using the CPUs: expect noisy numbers" if idle < 0.9 else ""
        la0, la1 = env.get("loadavg_start") or [float("nan")], env.get("loadavg_end") or [float("nan")]
        lines.append(f"CPU idle in the second before the run: {idle:.0%}; 1-min load average at start "
                     f"{la0[0]:.2f}, at end {la1[0]:.2f}{busy}")
    lines.append(f"torch.set_num_threads({cfg['threads']}) in every benchmark process "
                 "(copy_, raw socket, gloo, transport target and initiator)")
    lines.append(f"GB/s = 1e9 bytes/s of the median repetition after warm-up, repetitions pooled over "
                 f"{cfg['rounds']} round(s) of every phase; 'best' = fastest repetition; "
                 "put/send timings include the target's ack (remote completion)")
    lines.append(f"state dict: {sd['tensors']} float32 tensors, {_size_label(sd['nbytes'])} "
                 f"({sd['model']['layers']} layers, d={sd['model']['d']}, vocab={sd['model']['vocab']})")
    lines.append("")
    hdr = f"{'case':<48} {'size':>9} {'GB/s':>8} {'best':>8}  {'ratio':>7}  vs"
    lines.append(hdr)
    lines.append("-" * len(hdr) + "-" * 24)
    prev_group = None
    for r in rows:
        if r.get("cpu"):
            continue
        key = "lat" if r.get("latency") else ("sd" if r["case"].startswith("statedict") else r["size_bytes"])
        if prev_group is not None and key != prev_group:
            lines.append("")
        prev_group = key
        bad = "" if r.get("verified", True) else "  !! DATA MISMATCH"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else ""
        vs = r.get("ratio_vs", "")
        if r.get("latency"):
            lines.append(f"{r['case']:<48} {_size_label(r['size_bytes']):>9} "
                         f"p50 {r['p50_us']:7.0f} us  p99 {r['p99_us']:7.0f} us  {ratio:>7}  {vs}{bad}")
        else:
            notes = []
            if "ratio_vs_phase" in r:
                notes.append(f"{r['ratio_vs_phase']:.2f}x separate phase")
            if "ratio_vs_gloo" in r:
                notes.append(f"{r['ratio_vs_gloo']:.2f}x gloo")
            if "ratio_vs_nixl" in r:
                notes.append(f"{r['ratio_vs_nixl']:.2f}x NIXL")
            extra = f" ({', '.join(notes)})" if notes else ""
            if "ratio_vs_copy_loop" in r:
                extra = f" ({r['ratio_vs_copy_loop']:.2f}x copy_ loop)"
            lines.append(f"{r['case']:<48} {_size_label(r['size_bytes']):>9} {r['gbps']:8.2f} "
                         f"{r['gbps_best']:8.2f}  {ratio:>7}  {vs}{extra}{bad}")
    cpu_rows = [r for r in rows if r.get("cpu")]
    if cpu_rows:
        lines.append("")
        lines.append(f"CPU time per op, tcp (means over {cpu_rows[0]['ops']} ops per row; user+system CPU of "
                     f"each whole process from getrusage; {env['usable_cpus']} usable CPUs):")
        h = (f"{'case':<48} {'size':>9} {'wall us':>8} {'initiator':>10} {'target':>8} {'total':>8} "
             f"{'cores':>6}  extra CPU vs raw")
        lines.append(h)
        for r in cpu_rows:
            extra = f"{r['extra_cpu_us']:+.0f} us" if "extra_cpu_us" in r else ""
            lines.append(f"{r['case']:<48} {_size_label(r['size_bytes']):>9} {r['wall_us']:8.0f} "
                         f"{r['initiator_us']:10.0f} {r['target_us']:8.0f} {r['total_us']:8.0f} "
                         f"{r['cores_busy']:6.2f}  {extra}")
    lines.append("")
    tt = "torch.distributed._transport (NIXL)"
    if nixl_run is not None:
        lines += _format_nixl(nixl_run)
    elif nixl["available"]:
        lines.append(f"{tt:<48} {'-':>9} {'n/a':>8}  {nixl['reason']}")
    else:
        lines.append(f"{tt:<48} {'-':>9} {'n/a':>8}  not available: {nixl['reason']}")
    if errors:
        lines.append("")
        lines.append("ERRORS (these phases produced no numbers):")
        for e in errors:
            first = e["error"].strip().splitlines()
            lines.append(f"  {e['phase']} (round {e['round']}): {first[-1] if first else ''}")
    lines.append("")
    lines.append("targets (reported, never asserted):")
    for t in targets:
        if t["value"] is None:
            val = "-"
        elif "us" in t["target"]:
            val = f"{t['value']:.0f} us"
        else:
            val = f"{t['value']:.3f}x"
        lines.append(f"  {t['status']:<5} {t['target']:<46} {val:>9}  ({t['detail']})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def _idle_fraction(seconds: float = 1.0) -> float | None:
    """Share of CPU time that was idle over ``seconds`` (before the run: how busy other tenants are)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        return vals[3] + vals[4], sum(vals[:8])  # idle + iowait, total (without guest time)

    try:
        idle0, tot0 = sample()
        time.sleep(seconds)
        idle1, tot1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (idle1 - idle0) / max(1, tot1 - tot0)


def environment(cfg: dict[str, Any]) -> dict[str, Any]:
    return _common.environment(ROOT, cfg["threads"], _idle_fraction)


def _merge(acc: Any, new: Any) -> Any:
    """Pool one round's result into the previous rounds': lists concatenate, flags AND, the rest stays."""
    if acc is None:
        return new
    if isinstance(acc, dict) and isinstance(new, dict):
        out = dict(acc)
        for k, v in new.items():
            out[k] = _merge(acc.get(k), v)
        return out
    if isinstance(acc, list) and isinstance(new, list):
        return acc + new
    if isinstance(acc, bool) and isinstance(new, bool):
        return acc and new
    return acc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions (well under 2 minutes)")
    ap.add_argument("--max-mib", type=int, default=None, help="largest buffer size to measure, in MiB")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads in every benchmark process (default: half the usable cores, >= 1)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="run every phase this many times, rotating their order, and pool the repetitions "
                         "(default: 3, --quick: 1); spreads slow drifts of a shared machine over all cases")
    ap.add_argument("--only", default=None,
                    help="comma-separated phases to run (copy, raw, gloo, shm, tcp; default: all); "
                         "a ratio whose reference phase did not run is left out")
    ap.add_argument("--nixl-python", default=None, metavar="PATH",
                    help="python of a venv with torch >= 2.15 and nixl: adds a phase that runs "
                         "torch.distributed._transport's NIXL backend (bench/_nixl_peer.py) with the shm "
                         "phase's sizes and repetitions, whatever --only says, and ours / NIXL ratios")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "transport.json",
                    help="where to write the results (default: bench/results/transport.json)")
    args = ap.parse_args(argv)
    if args.threads is None:
        # two busy processes per measurement (target + initiator, sender + receiver): half the cores
        # each. More OpenMP threads than free cores makes every parallel copy_ wait for a descheduled
        # thread (on a 2-core VM, copy_ with 2 threads took 4-16 ms for 1-16 MiB instead of 0.02-0.7 ms).
        args.threads = max(1, usable_cpus() // 2)
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be >= 1")
    keep = None
    if args.only is not None:
        keep = {p.strip() for p in args.only.split(",") if p.strip()}
        known = {"copy", "raw", "gloo", "shm", "tcp"}
        if not keep or keep - known:
            ap.error(f"--only: unknown phase(s) {sorted(keep - known) or args.only!r}; choose from {sorted(known)}")
    cfg = make_config(args)
    if not cfg["sizes"]:
        ap.error(f"--max-mib {args.max_mib} leaves no size to measure (smallest is 1 MiB)")
    torch.set_num_threads(cfg["threads"])
    env = environment(cfg)
    t_start = time.monotonic()
    print(f"transport benchmark ({cfg['mode']}): sizes {', '.join(_size_label(s) for s in cfg['sizes'])}; "
          f"{cfg['rounds']} round(s); torch.set_num_threads({cfg['threads']}) in every process", flush=True)

    nixl = probe_torch_transport()
    res: dict[str, Any] = {}
    errors: list[dict[str, Any]] = []
    durations: dict[str, float] = {}
    phases: list[tuple[str, list[tuple[str, str, tuple[Any, ...]]], int, str]] = [
        ("copy", [("copy", "peer_copy", (cfg,))], 0, "copy"),
        ("raw", [("receiver", "peer_raw_receiver", (cfg,)), ("sender", "peer_raw_sender", (cfg,))], 1, "sender"),
        ("gloo", [("rank0", "peer_gloo", (0, cfg)), ("rank1", "peer_gloo", (1, cfg))], 1, "rank0"),
    ]
    for plane in ("shm", "tcp"):
        phases.append((f"transport_{plane}", [("target", "transport_target", (plane, cfg)),
                                              ("initiator", "transport_initiator", (plane, cfg))], 2, "initiator"))
    if keep is not None:
        phases = [ph for ph in phases if ph[0].removeprefix("transport_") in keep]
    if args.nixl_python:
        # not spawn phases: subprocesses of another venv (run_nixl_phase), NIXL and transport_rl per plane
        phases += [(name, [], 0, name) for name in TORCH_API_PHASES]
    try:
        for rnd in range(cfg["rounds"]):
            k = rnd % len(phases)
            for name, roles, nq, main_role in phases[k:] + phases[:k]:
                t0 = time.monotonic()
                print(f"  [{time.monotonic() - t_start:6.1f} s] round {rnd + 1}/{cfg['rounds']}: {name} ...",
                      flush=True)
                try:
                    if name in TORCH_API_PHASES:
                        backend, plane = TORCH_API_PHASES[name]
                        res[name] = _merge(res.get(name), run_nixl_phase(args.nixl_python, cfg, backend, plane,
                                                                         phase=name))
                    else:
                        out = run_phase(name, roles, cfg, queues=nq)
                        res[name] = _merge(res.get(name), out[main_role])
                except PhaseError as exc:
                    errors.append({"phase": name, "round": rnd + 1, "error": str(exc)})
                    print(f"  !! {name} failed: {str(exc).strip().splitlines()[-1]}", flush=True)
                durations[name] = durations.get(name, 0.0) + time.monotonic() - t0
    finally:
        for p in CTX.active_children():
            STRAGGLERS.append(f"{p.name} (pid {p.pid})")
            p.kill()
            p.join(3.0)

    env["loadavg_end"] = loadavg()
    rows = build_rows(cfg, res)
    targets = evaluate_targets(cfg, rows)
    total = time.monotonic() - t_start
    nixl_run = (nixl_section(args.nixl_python, res.get("nixl"), rows,
                             {name: res.get(name) for name in TORCH_API_PHASES if name != "nixl"})
                if args.nixl_python else None)
    report = format_report(cfg, env, rows, targets, errors, nixl, nixl_run)
    print()
    print(report)
    print("\nphase durations: " + ", ".join(f"{k} {v:.1f} s" for k, v in durations.items())
          + f"; total {total:.1f} s")
    if STRAGGLERS:
        print(f"killed stragglers: {', '.join(STRAGGLERS)}")

    doc = {
        "environment": env,
        "config": {k: v for k, v in cfg.items() if k != "statedict"}
        | {"statedict": {k: v for k, v in cfg["statedict"].items() if k != "shapes"}},
        "rows": rows,
        "targets": targets,
        "torch_distributed_transport": nixl,
        "nixl": nixl_run,
        "transport_planes": {p: {"plane": res[f"transport_{p}"].get("plane"),
                                 "reason": res[f"transport_{p}"].get("plane_reason")}
                             for p in ("shm", "tcp") if f"transport_{p}" in res},
        "torch_threads_in_processes": {k: v.get("torch_threads") for k, v in res.items()
                                       if isinstance(v, dict) and "torch_threads" in v},
        "errors": errors,
        "phase_durations_s": durations,
        "total_s": total,
        "killed_stragglers": STRAGGLERS,
    }
    _common.write_results(args.json, doc)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
