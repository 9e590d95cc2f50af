#!/usr/bin/env python
"""PyTorch's ``torch.distributed._transport``, one backend (NIXL or ``transport_rl``), timed between two processes.

Run by ``bench_transport.py --nixl-python PATH`` with the python of another virtual environment
(torch >= 2.15 and ``nixl``; see bench/README.md), once per backend; it prints ONE json line of
results to stdout (NIXL's own log lines go to stderr)::

    PATH bench/_nixl_peer.py --sizes 1048576,4194304 --reps 3,3 --warmup 1,1 --lat-iters 200 \
        --lat-warmup 20 --threads 1 --timeout 90                        # NIXL (--backend nixl)
    PYTHONPATH=. PATH bench/_nixl_peer.py --backend transport_rl --plane shm --sizes ...

``--backend nixl`` (default) imports nothing of this repository. ``--backend transport_rl``
(``--plane tcp``, the backend's default, or ``shm``: ``new_transport``'s ``plane`` option) imports
this repository's ``transport`` package, so it needs it importable: installed in the venv (then
its ``torch.distributed.transports`` entry point names the backend), or this checkout on
``PYTHONPATH`` (as ``bench_transport.py`` runs it), in which case the entry point is missing and
both processes register ``transport.torch_backend.TransportRL`` themselves with
``torch.distributed._transport.register_transport``; the json's ``registration`` says which.
The measurement below is the same for either backend.

The measurement mirrors the ``shm`` phase of ``bench_transport.py``: this process is the
initiator; it starts a target process (``multiprocessing`` spawn) and talks to it over a pipe,
which is the "trusted control plane" the API asks for. Both create a transport with
``new_transport(backend, "cpu", **options)``, exchange their ``bind()`` bytes and ``connect()`` to
each other.
Per size, the target registers a pre-touched buffer (``register_memory``) and sends the
``serialize()`` bytes of its remote buffer; the initiator registers a source and a destination
tensor of its own and times, per repetition, a ``write`` of the source's whole view into the
target's buffer (the put) and a ``read`` of it into the destination (the get), in an order that
alternates every repetition; then it zeroes the destination, writes and reads once more untimed
and checks the bytes it read against what it wrote. Then 4 KiB writes and reads (latency).

Completion: every op is submitted with ``async_op=True`` and its ``Work`` polled with
``is_completed()`` until done (then ``wait()`` to raise a transfer error): the earliest moment the
API can tell that the transfer finished. ``--completion wait`` uses the blocking call instead,
whose ``Work.wait`` sleeps 1 ms between polls with NIXL (adds up to 1 ms per op that does not
finish at its first poll) and blocks on an event with ``transport_rl``. ``transport_rl`` moves the
bytes on an event loop thread of this process, which needs the GIL that a busy poll holds (NIXL's
progress runs in native threads): the poll measures that too. Times are seconds per op, from
submission to completion, per timed repetition.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from typing import Any

LAT_BYTES = 4096


BACKENDS = ("nixl", "transport_rl")


def backend_options(backend: str, plane: str | None) -> dict[str, Any]:
    """The keyword options given to ``new_transport(backend, "cpu", **options)``."""
    if backend == "transport_rl":
        return {"plane": plane or "tcp"}
    if plane is not None:
        raise SystemExit("--plane is an option of --backend transport_rl only")
    return {}


def ensure_registered(backend: str) -> str:
    """Make ``backend`` known to ``new_transport`` in this process; say how it is known.

    NIXL ships with torch. ``transport_rl`` is found through its ``torch.distributed.transports``
    entry point where this repository is installed into the venv; run from a checkout
    (``PYTHONPATH=<repository root>``, as ``bench_transport.py`` does) the entry point is missing,
    and the factory it names (``transport.torch_backend.TransportRL``) is registered for this
    process with ``torch.distributed._transport.register_transport``."""
    import torch.distributed._transport as tdt

    if backend == "nixl":
        return "built into torch"
    if backend in tdt.available_transports():
        return "entry point (package installed)"
    from transport.torch_backend import TransportRL

    tdt.register_transport(backend, TransportRL)
    return "register_transport (no entry point: package imported from PYTHONPATH)"


def _transport(backend: str, options: dict[str, Any]) -> Any:
    from torch.distributed._transport import new_transport

    return new_transport(backend, "cpu", **options)


def _remote_cls(backend: str) -> Any:
    if backend == "nixl":
        from torch.distributed._transport.nixl import NIXLRemoteBuffer

        return NIXLRemoteBuffer
    from transport.torch_backend import TransportRLRemoteBuffer

    return TransportRLRemoteBuffer


def _pattern(nbytes: int, offset: float = 0.0) -> Any:
    import torch

    t = torch.arange(nbytes // 4, dtype=torch.float32)
    if offset:
        t.add_(offset)
    return t


# ---------------------------------------------------------------------------- target process
def target_main(conn: Any, threads: int, timeout: float, backend: str = "nixl",
                options: dict[str, Any] | None = None) -> None:
    """Bind, connect back, then serve register/unregister commands until "quit"."""
    try:
        import torch

        torch.set_num_threads(threads)
        ensure_registered(backend)
        tr = _transport(backend, options or {})
        try:
            conn.send(("url", tr.bind()))
            if not conn.poll(timeout):
                raise TimeoutError("no initiator url")
            kind, url = conn.recv()
            assert kind == "url", kind
            tr.connect(url)
            conn.send(("ok",))
            regs: dict[str, tuple[Any, Any]] = {}
            while True:
                if not conn.poll(timeout):
                    raise TimeoutError(f"no command within {timeout:.0f} s")
                cmd = conn.recv()
                if cmd[0] == "register":
                    name, nbytes = cmd[1], cmd[2]
                    buf = torch.zeros(nbytes // 4, dtype=torch.float32)  # pre-touched, like the tcp target's
                    mem = tr.register_memory(buf)
                    regs[name] = (buf, mem)
                    conn.send(("ok", mem.to_remote_buffer().serialize()))
                elif cmd[0] == "check":  # the target's own copy of what the initiator last wrote
                    buf = regs[cmd[1]][0]
                    conn.send(("ok", bool(torch.equal(buf, _pattern(buf.numel() * 4, cmd[2])))))
                elif cmd[0] == "unregister":
                    buf, mem = regs.pop(cmd[1])
                    tr.unregister_memory(mem)
                    del buf, mem
                    conn.send(("ok",))
                elif cmd[0] == "quit":
                    conn.send(("ok",))
                    break
                else:
                    raise RuntimeError(f"unknown command {cmd!r}")
        finally:
            tr.close()
    except BaseException:
        try:
            conn.send(("error", f"target (pid {os.getpid()}): {traceback.format_exc()}"))
        except OSError:
            pass
        sys.exit(1)


# ---------------------------------------------------------------------------- initiator (this process)
class Peer:
    def __init__(self, conn: Any, proc: Any, timeout: float) -> None:
        self.conn, self.proc, self.timeout = conn, proc, timeout

    def recv(self) -> tuple[Any, ...]:
        end = time.monotonic() + self.timeout
        while not self.conn.poll(0.2):
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise RuntimeError(f"the target process exited with code {self.proc.exitcode}")
            if time.monotonic() > end:
                raise TimeoutError(f"the target did not answer within {self.timeout:.0f} s")
        reply = self.conn.recv()
        if reply[0] == "error":
            raise RuntimeError(reply[1])
        return tuple(reply)

    def command(self, *cmd: Any) -> tuple[Any, ...]:
        self.conn.send(cmd)
        reply = self.recv()
        if reply[0] != "ok":
            raise RuntimeError(f"target answered {reply!r} to {cmd[0]}")
        return reply


def _op(tr: Any, kind: str, view: Any, remote: Any, completion: str) -> None:
    fn = tr.write if kind == "write" else tr.read
    if completion == "wait":
        fn(view, remote)
        return
    work = fn(view, remote, async_op=True)
    while not work.is_completed():
        pass
    work.wait()  # raises the transfer's error, if any


def _timed(tr: Any, steps: list[tuple[str, Any]], remote: Any, warmup: int, reps: int,
           completion: str) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k, _ in steps}
    for i in range(warmup + reps):
        k = i % len(steps)
        for kind, view in steps[k:] + steps[:k]:
            t0 = time.perf_counter()
            _op(tr, kind, view, remote, completion)
            if i >= warmup:
                times[kind].append(time.perf_counter() - t0)
    return times


def _one_size(tr: Any, peer: Peer, remote_cls: Any, name: str, nbytes: int, warmup: int, reps: int,
              completion: str, offset: float = 0.0) -> dict[str, Any]:
    import torch

    blob = peer.command("register", name, nbytes)[1]
    remote = remote_cls.deserialize(blob)
    src = _pattern(nbytes, offset)
    dst = torch.zeros(nbytes // 4, dtype=torch.float32)
    src_mem, dst_mem = tr.register_memory(src), tr.register_memory(dst)
    try:
        steps = [("write", src_mem.to_view()), ("read", dst_mem.to_mutable_view())]
        out: dict[str, Any] = _timed(tr, steps, remote, warmup, reps, completion)
        # untimed check: the target holds what was written, and a read of it brings the same bytes back
        dst.zero_()
        _op(tr, "write", steps[0][1], remote, completion)
        target_ok = bool(peer.command("check", name, offset)[1])
        _op(tr, "read", steps[1][1], remote, completion)
        out["verified"] = target_ok and bool(torch.equal(src, dst))
    finally:
        tr.unregister_memory(src_mem)
        tr.unregister_memory(dst_mem)
        peer.command("unregister", name)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    options = backend_options(args.backend, args.plane)
    if options.get("plane") == "tcp":  # over TCP, as from another host (transport.local_socket), in both processes
        os.environ["TRANSPORT_UNIX_SOCKETS"] = "0"
    remote_cls = _remote_cls(args.backend)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    reps = [int(s) for s in args.reps.split(",") if s]
    warm = [int(s) for s in args.warmup.split(",") if s]
    if not (len(sizes) == len(reps) == len(warm)):
        raise SystemExit("--sizes, --reps and --warmup need one value per size")
    for n in (*sizes, LAT_BYTES):
        if n <= 0 or n % 4:
            raise SystemExit(f"size {n}: must be a positive multiple of 4 bytes")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    t0 = time.perf_counter()
    proc = ctx.Process(target=target_main, args=(there, args.threads, args.timeout, args.backend, options),
                       name=f"{args.backend}-target", daemon=True)
    proc.start()
    there.close()
    peer = Peer(here, proc, args.timeout)
    out: dict[str, Any] = {"sizes": {}}
    try:
        tr = _transport(args.backend, options)
        try:
            kind, target_url = peer.recv()
            assert kind == "url", kind
            here.send(("url", tr.bind()))
            tr.connect(target_url)
            peer.recv()
            out["setup_s"] = time.perf_counter() - t0
            for size, r, w in zip(sizes, reps, warm, strict=True):
                out["sizes"][str(size)] = _one_size(tr, peer, remote_cls, f"buf_{size}", size, w, r,
                                                    args.completion)
            out["latency"] = _one_size(tr, peer, remote_cls, "lat", LAT_BYTES, args.lat_warmup,
                                       args.lat_iters, args.completion, offset=7.0)
            peer.command("quit")
        finally:
            tr.close()
    finally:
        here.close()
        proc.join(10.0)
        if proc.is_alive():
            proc.kill()
            proc.join(3.0)
    return out


def versions(backend: str) -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                            "torch_threads": torch.get_num_threads()}
    if backend == "nixl":
        for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
            try:
                info[dist] = md.version(dist)
            except md.PackageNotFoundError:
                pass
        info["ucx_env"] = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    else:
        import transport

        info["transport_path"] = os.path.dirname(transport.__file__)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", required=True, help="comma-separated buffer sizes in bytes")
    ap.add_argument("--reps", required=True, help="timed repetitions per size (comma-separated)")
    ap.add_argument("--warmup", required=True, help="warm-up repetitions per size (comma-separated)")
    ap.add_argument("--lat-iters", type=int, default=200, help="timed 4 KiB writes and reads")
    ap.add_argument("--lat-warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in both processes")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds either side waits for the other")
    ap.add_argument("--completion", choices=("poll", "wait"), default="poll",
                    help="poll Work.is_completed() (default) or the blocking write()/read()")
    ap.add_argument("--backend", choices=BACKENDS, default="nixl",
                    help="the new_transport backend to time (default nixl); transport_rl is this repository's "
                         "(PYTHONPATH=<repository root> where it is not installed)")
    ap.add_argument("--plane", choices=("tcp", "shm"), default=None,
                    help="transport_rl's plane option (default tcp, the backend's default)")
    args = ap.parse_args(argv)
    if args.plane is not None and args.backend != "transport_rl":
        ap.error("--plane is an option of --backend transport_rl only")
    # NIXL's logger and native libraries print to stdout: send fd 1 (also the target's) to stderr
    # and keep the real stdout for the one json line
    out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    doc: dict[str, Any] = {"ok": False, "completion": args.completion, "backend": args.backend}
    if args.backend == "nixl":
        doc["plugin"] = "UCX"
    try:
        import torch

        torch.set_num_threads(args.threads)
        doc["options"] = backend_options(args.backend, args.plane)
        doc["registration"] = ensure_registered(args.backend)
        doc.update(versions(args.backend))
        doc.update(run(args))
        doc["ok"] = True
    except BaseException as exc:  # one json line in every case; the caller reports the error
        doc["error"] = f"{type(exc).__name__}: {exc}"
        doc["traceback"] = traceback.format_exc()
    out.write(json.dumps(doc) + "\n")
    out.flush()
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
