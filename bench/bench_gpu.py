#!/usr/bin/env python
"""GPU bandwidths, and the cost of the NCCL binding's wrapper over raw ctypes calls.

Usage::

    python bench/bench_gpu.py [--out PATH] [--reps N] [--quick]

A benchmark, not a test: it prints a table and writes JSON (default ``bench/results/gpu.json``,
git-ignored). On a machine without CUDA it prints ``no CUDA: skipped`` and exits 0.

Rows (GB/s = bytes moved / time, each byte counted once; a device copy's memory traffic is twice
that, read plus write):

* ``d2d copy_``: ``dst.copy_(src)`` on the GPU, 256 MiB and 1 GiB.
* ``h2d pinned`` / ``h2d pageable``: ``dst.copy_(host)`` from page-locked and from ordinary
  host memory, 256 MiB and 1 GiB.
* ``nccl self send/recv``: a 1-rank NCCL communicator sending to itself, ``ncclSend`` +
  ``ncclRecv`` inside one group per iteration, 1 MiB .. 1 GiB, two ways on the same communicator
  and buffers: through :class:`transport.cuda.Communicator` (``group()``, ``send``, ``recv``: the
  argument checks, the lock, the ``ncclInProgress`` handling), and "raw", calling the library's
  typed ctypes function objects directly (``ncclGroupStart``, ``ncclSend``, ``ncclRecv``,
  ``ncclGroupEnd``, plus the ``ncclCommGetAsyncError`` poll a non-blocking communicator needs).
  The ratio library/raw should be >= 0.8; it matters at small sizes, where host overhead shows.
* ``put cuda_ipc`` / ``put staged``: ``await ep.put(peer, {...})`` of a CUDA tensor into a CUDA
  buffer registered by a second process on the same GPU, end to end (mark, copies, completion,
  header, the peer's acknowledgement), 256 MiB and 1 GiB: over ``cuda_ipc`` (an endpoint with the
  default planes) and over the staged path (an endpoint with ``planes=("tcp",)``: GPU -> pinned
  bounce buffers -> loopback tcp -> GPU). Timed with ``time.perf_counter`` around a loop of puts
  (each returns once the peer holds the bytes). Ratios against the same run's ``d2d copy_``
  (target >= 0.8 for cuda_ipc) and ``h2d pinned`` (target >= 0.6 for staged) of the same size.
  The bytes are read back (``get``) and compared once per plane.

Timing: CUDA events on one dedicated stream around a loop of iterations, after warm-up; each case
is repeated ``--reps`` times (the two NCCL variants alternate) and the median is reported. Every
wait for the GPU polls an event against a deadline: nothing here can hang without bound. Data is
random, never zeros, and the NCCL receive buffer is checked byte for byte once per size.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "bench" / "results" / "gpu.json"
MiB = 1 << 20
GiB = 1 << 30
TARGET_RATIO = 0.8
WAIT_S = 60.0

IN_PROGRESS = 7  # ncclInProgress


def _wait_event(event: Any, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    delay = 1e-5
    while not event.query():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: GPU work not finished after {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


def _time_loop(torch: Any, stream: Any, step: Callable[[], None], iters: int, what: str) -> float:
    """Seconds per iteration of ``step`` (which queues work on ``stream``), by CUDA events."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(iters):
        step()
    end.record(stream)
    _wait_event(end, what)
    return start.elapsed_time(end) / 1e3 / iters


def _iters_for(nbytes: int, budget: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, budget // max(nbytes, 1)))


def _fmt_size(nbytes: int) -> str:
    return f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


def _row(name: str, nbytes: int, iters: int, secs: list[float]) -> dict[str, Any]:
    med = statistics.median(secs)
    return {
        "case": name,
        "bytes": nbytes,
        "iters": iters,
        "reps": len(secs),
        "seconds_per_iter_median": med,
        "gbps_median": nbytes / med / 1e9,
        "gbps_min": nbytes / max(secs) / 1e9,
        "gbps_max": nbytes / min(secs) / 1e9,
    }


def bench_copies(torch: Any, stream: Any, reps: int, sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    biggest = max(sizes)
    with torch.cuda.stream(stream):
        src = torch.randint(0, 256, (biggest,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
    _wait_event(_recorded(torch, stream), "random source")
    pinned = torch.empty(biggest, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(biggest, dtype=torch.uint8)
    with torch.cuda.stream(stream):
        pinned.copy_(src, non_blocking=True)
    _wait_event(_recorded(torch, stream), "pinned fill")
    pageable.copy_(pinned)  # random content, pages touched

    cases: list[tuple[str, Any, int]] = [
        ("d2d copy_", lambda n: dst[:n].copy_(src[:n], non_blocking=True), 4 * GiB),
        ("h2d pinned", lambda n: dst[:n].copy_(pinned[:n], non_blocking=True), 2 * GiB),
        ("h2d pageable", lambda n: dst[:n].copy_(pageable[:n], non_blocking=True), GiB),
    ]
    for name, make, budget in cases:
        with torch.cuda.stream(stream):
            torch.bitwise_not(src, out=dst)  # poisoned, so that the check below sees this case's copies
        for n in sizes:
            iters = _iters_for(n, budget, 3, 100)

            def step(n: int = n, make: Any = make) -> None:
                make(n)

            with torch.cuda.stream(stream):
                _time_loop(torch, stream, step, 2, f"{name} warm-up")
                secs = [_time_loop(torch, stream, step, iters, name) for _ in range(reps)]
            rows.append(_row(f"{name} {_fmt_size(n)}", n, iters, secs))
            print(_fmt_row(rows[-1]), flush=True)
        _wait_event(_recorded(torch, stream), f"{name} check")
        with torch.cuda.stream(stream):
            if not torch.equal(dst[: sizes[0]], src[: sizes[0]]):
                raise AssertionError(f"{name}: the copied bytes differ from the source")
    return rows


def _recorded(torch: Any, stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def bench_nccl(torch: Any, stream: Any, reps: int, sizes: list[int]) -> dict[str, Any]:
    from transport.cuda import BYTES, Communicator, NcclError, load_nccl

    lib = load_nccl()
    comm = Communicator.init_rank(lib, 1, lib.get_unique_id(), 0, device=torch.cuda.current_device(), timeout=60)
    try:
        # The raw loop uses the same communicator and the library's own typed function objects
        # (NcclLibrary._fn, Communicator._handle: private, read here on purpose, nothing added).
        handle = comm._handle
        group_start = lib._fn("ncclGroupStart")
        group_end = lib._fn("ncclGroupEnd")
        send = lib._fn("ncclSend")
        recv = lib._fn("ncclRecv")
        get_async_error = lib._fn("ncclCommGetAsyncError")
        dtype = int(BYTES)
        s = stream.cuda_stream

        def raw_wait_ready() -> None:
            state = ctypes.c_int(IN_PROGRESS)
            deadline = time.monotonic() + WAIT_S
            while True:
                rc = get_async_error(handle, ctypes.byref(state))
                if rc != 0:
                    raise NcclError(rc, "ncclCommGetAsyncError")
                if state.value == 0:
                    return
                if state.value != IN_PROGRESS:
                    raise NcclError(state.value, "ncclGroupEnd (async)")
                if time.monotonic() >= deadline:
                    raise TimeoutError("raw loop: NCCL still in progress")
                time.sleep(1e-5)

        with torch.cuda.stream(stream):
            src = torch.randint(0, 256, (max(sizes),), dtype=torch.uint8, device="cuda")
            dst = torch.bitwise_not(src)
        _wait_event(_recorded(torch, stream), "random source")
        sp, dp = src.data_ptr(), dst.data_ptr()

        def lib_step(n: int) -> None:
            with comm.group():
                comm.send(sp, n, 0, s)
                comm.recv(dp, n, 0, s)

        def raw_step(n: int) -> None:
            rc = group_start()
            if rc != 0:
                raise NcclError(rc, "ncclGroupStart")
            rc = send(sp, n, dtype, 0, handle, s)
            if rc not in (0, IN_PROGRESS):
                raise NcclError(rc, "ncclSend")
            rc = recv(dp, n, dtype, 0, handle, s)
            if rc not in (0, IN_PROGRESS):
                raise NcclError(rc, "ncclRecv")
            rc = group_end()
            if rc == IN_PROGRESS:
                raw_wait_ready()
            elif rc != 0:
                raise NcclError(rc, "ncclGroupEnd")

        rows = []
        for n in sizes:
            iters = _iters_for(n, 4 * GiB, 10, 200)
            variants = {"library": lambda n=n: lib_step(n), "raw": lambda n=n: raw_step(n)}
            for name, step in variants.items():  # warm-up (the first group also sets up the connection)
                _time_loop(torch, stream, step, 3, f"nccl {name} warm-up")
            secs: dict[str, list[float]] = {"library": [], "raw": []}
            for rep in range(reps):
                order = ("library", "raw") if rep % 2 == 0 else ("raw", "library")
                for name in order:
                    secs[name].append(_time_loop(torch, stream, variants[name], iters, f"nccl {name}"))
            # what the loops left in dst must be src, byte for byte
            with torch.cuda.stream(stream):
                dst[:n].bitwise_not_()
                lib_step(n)
            _wait_event(_recorded(torch, stream), "nccl check")
            with torch.cuda.stream(stream):
                verified = bool(torch.equal(dst[:n], src[:n]))
            lib_row = _row(f"nccl self send/recv library {_fmt_size(n)}", n, iters, secs["library"])
            raw_row = _row(f"nccl self send/recv raw {_fmt_size(n)}", n, iters, secs["raw"])
            ratio = lib_row["gbps_median"] / raw_row["gbps_median"]
            overhead_us = (lib_row["seconds_per_iter_median"] - raw_row["seconds_per_iter_median"]) * 1e6
            rows.append(
                {
                    "bytes": n,
                    "iters": iters,
                    "library": lib_row,
                    "raw": raw_row,
                    "ratio": ratio,
                    "wrapper_overhead_us_per_iter": overhead_us,
                    "verified": verified,
                }
            )
            print(_fmt_row(lib_row), flush=True)
            print(
                _fmt_row(raw_row) + f"   ratio {ratio:.3f}, wrapper +{overhead_us:.1f} us/iter"
                f"{'' if verified else '   BYTES WRONG'}",
                flush=True,
            )
        comm.close(timeout=60)
    except BaseException:
        comm.abort()
        raise
    return {
        "nccl": lib.version_string,
        "nccl_path": lib.path,
        "nccl_source": lib.source.value,
        "rows": rows,
        "min_ratio": min(r["ratio"] for r in rows),
        "target_ratio": TARGET_RATIO,
        "all_verified": all(r["verified"] for r in rows),
    }


def _plane_target(conn: Any, store: str, name: str, nbytes: int) -> None:
    """Child process: an endpoint that registers one CUDA buffer and serves until told to stop."""
    import asyncio

    import torch

    import transport

    async def run() -> None:
        async with transport.Endpoint(name, store=store, timeout=60) as ep:
            ep.register("buf", torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda"))
            conn.send("ready")
            end = time.monotonic() + 1800
            while not conn.poll() and time.monotonic() < end:
                await asyncio.sleep(0.05)

    try:
        asyncio.run(run())
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(f"error: {type(exc).__name__}: {exc}")


def bench_planes(torch: Any, reps: int, sizes: list[int], copies: list[dict[str, Any]]) -> dict[str, Any]:
    """put of a CUDA tensor into another process's CUDA buffer, over cuda_ipc and over the staged path."""
    import asyncio
    import multiprocessing as mp

    import transport

    biggest = max(sizes)
    baseline = {r["case"]: r["gbps_median"] for r in copies}
    rows: list[dict[str, Any]] = []

    async def run() -> None:
        async with transport.Endpoint(f"bench-ipc-{time.time_ns()}", store="tcp://127.0.0.1:0", host_store=True,
                                      timeout=120) as ipc_ep:
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            target = f"bench-target-{time.time_ns()}"
            proc = ctx.Process(target=_plane_target, args=(child, ipc_ep.store_url, target, biggest), daemon=True)
            proc.start()
            try:
                if not await asyncio.to_thread(parent.poll, 120) or (msg := parent.recv()) != "ready":
                    raise RuntimeError(f"the target process did not start: {locals().get('msg', 'no answer')}")
                async with transport.Endpoint(f"bench-staged-{time.time_ns()}", store=ipc_ep.store_url,
                                              planes=("tcp",), timeout=300) as staged_ep:
                    src = torch.randint(0, 256, (biggest,), dtype=torch.uint8, device="cuda")
                    torch.cuda.synchronize()
                    for plane, ep, base, want in (("cuda_ipc", ipc_ep, "d2d copy_", 0.8),
                                                  ("staged", staged_ep, "h2d pinned", 0.6)):
                        for n in sizes:
                            part = {"buf": transport.At(src[:n], 0)}
                            iters = _iters_for(n, 4 * GiB if plane == "cuda_ipc" else GiB, 3, 50)
                            for _ in range(2):
                                await ep.put(target, part)
                            secs = []
                            for _ in range(reps):
                                t0 = time.perf_counter()
                                for _ in range(iters):
                                    await ep.put(target, part)
                                secs.append((time.perf_counter() - t0) / iters)
                            row = _row(f"put {plane} {_fmt_size(n)}", n, iters, secs)
                            used = {r["plane"] for r in ep.recorder.snapshot()
                                    if r["role"] == "initiator" and r["kind"] == "put"}
                            row["plane_used"] = sorted(used)
                            if row["plane_used"] != [plane]:
                                raise AssertionError(f"put {plane}: the puts went over {row['plane_used']}")
                            ref = baseline.get(f"{base} {_fmt_size(n)}")
                            row["vs"] = base
                            row["ratio"] = row["gbps_median"] / ref if ref else None
                            row["target_ratio"] = want
                            back = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(0x5A)
                            await ep.get(target, {"buf": transport.At(back, 0)})
                            row["verified"] = bool(torch.equal(back, src[:n]))
                            rows.append(row)
                            ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "n/a"
                            print(_fmt_row(row) + f"   vs {base}: {ratio} (target >= {want}); "
                                  f"plane {','.join(row['plane_used'])}; verified {row['verified']}", flush=True)
            finally:
                parent.send("stop")
                await asyncio.to_thread(proc.join, 30)
                if proc.is_alive():
                    proc.kill()

    asyncio.run(run())
    return {"rows": rows, "all_verified": all(r["verified"] for r in rows)}


def _fmt_row(row: dict[str, Any]) -> str:
    return (
        f"{row['case']:<40} {row['gbps_median']:10.1f} GB/s   (min {row['gbps_min']:.1f}, max {row['gbps_max']:.1f}; "
        f"{row['iters']} iters x {row['reps']})"
    )


def _write(out: Path, doc: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help=f"JSON output (default {DEFAULT_OUT.relative_to(ROOT)})")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per case (median reported)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes and 3 reps (a smoke run)")
    args = ap.parse_args(argv)
    out = args.out if args.out is not None else DEFAULT_OUT

    try:
        import torch
    except ImportError as exc:
        print(f"no CUDA: skipped (torch cannot be imported: {exc})")
        return 0
    if not torch.cuda.is_available():
        reason = (
            f"torch {torch.__version__}, {'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU-only build'}"
        )
        print(f"no CUDA: skipped ({reason})")
        if args.out is not None:  # asked for a file: say why there are no numbers in it
            _write(out, {"skipped": f"no CUDA ({reason})"})
        return 0

    reps = 3 if args.quick else max(1, args.reps)
    copy_sizes = [64 * MiB, 256 * MiB] if args.quick else [256 * MiB, GiB]
    nccl_sizes = [MiB, 16 * MiB, 256 * MiB] if args.quick else [MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB]
    props = torch.cuda.get_device_properties(0)
    doc: dict[str, Any] = {
        "when": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": props.name,
        "device_count": torch.cuda.device_count(),
        "reps": reps,
        "gbps": "bytes moved / time, each byte once (device copy memory traffic is twice that)",
        "copies": [],
        "nccl_self_send_recv": None,
        "planes": None,
        "errors": [],
    }
    print(f"{props.name}, torch {torch.__version__} (CUDA {torch.version.cuda}), {reps} reps, median GB/s")
    stream = torch.cuda.Stream()
    try:
        doc["copies"] = bench_copies(torch, stream, reps, copy_sizes)
    except Exception as exc:  # noqa: BLE001 - reported, and the NCCL part still runs
        doc["errors"].append(f"copies: {type(exc).__name__}: {exc}")
        print(f"ERROR copies: {type(exc).__name__}: {exc}")
    _write(out, doc)  # after each part: a run killed at its time limit keeps what it measured
    torch.cuda.empty_cache()
    try:
        doc["nccl_self_send_recv"] = nccl = bench_nccl(torch, stream, reps, nccl_sizes)
        verdict = "OK" if nccl["min_ratio"] >= TARGET_RATIO else "BELOW TARGET"
        print(f"NCCL {nccl['nccl']} from {nccl['nccl_path']} ({nccl['nccl_source']})")
        print(f"ratio library/raw: min {nccl['min_ratio']:.3f} (target >= {TARGET_RATIO}): {verdict}")
        if not nccl["all_verified"]:
            doc["errors"].append("nccl: received bytes differ from the source")
    except Exception as exc:  # noqa: BLE001
        doc["errors"].append(f"nccl: {type(exc).__name__}: {exc}")
        print(f"ERROR nccl: {type(exc).__name__}: {exc}")
    _write(out, doc)
    torch.cuda.empty_cache()
    try:
        doc["planes"] = planes = bench_planes(torch, reps, copy_sizes, doc["copies"])
        if not planes["all_verified"]:
            doc["errors"].append("planes: bytes read back differ from the source")
    except Exception as exc:  # noqa: BLE001
        doc["errors"].append(f"planes: {type(exc).__name__}: {exc}")
        print(f"ERROR planes: {type(exc).__name__}: {exc}")
    _write(out, doc)
    if doc["errors"]:
        print("errors:\n  " + "\n  ".join(doc["errors"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
