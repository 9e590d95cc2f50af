"""``python -m transport doctor``: what this machine can use, and why.

Reports versions, host identity, each data plane's availability (with a real
cross-process shared-memory check), CUDA (availability, devices) and the
plane GPU buffers would use and why, NCCL as far as it is visible, and the
plane-choice rule. With ``--store URL --peer NAME`` it connects to a live
peer and prints the planes chosen for it (CPU and GPU buffers) and the reasons,
and where the job's secret came from (``$TRANSPORT_SECRET`` if set, else the
store's: the doctor has to prove it belongs to the job like any peer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import sys
from typing import Any

__all__ = ["collect", "main"]


def _probe_child(pid: int, fd: int, inode: int, q: Any) -> None:
    try:
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        ok = os.fstat(f).st_ino == inode
        os.close(f)
        q.put((ok, "another process mapped this process's segment" if ok else "inode mismatch"))
    except OSError as exc:
        q.put((False, f"another process cannot open /proc/{pid}/fd/{fd}: {exc}"))


def _cross_process_shm() -> tuple[bool, str]:
    if not hasattr(os, "memfd_create"):
        return False, "no memfd_create"
    fd = os.memfd_create("transport-doctor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4096)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_probe_child, args=(os.getpid(), fd, os.fstat(fd).st_ino, q), daemon=True)
        p.start()
        try:
            return q.get(timeout=60)
        except Exception as exc:  # noqa: BLE001 - report, don't crash the doctor
            return False, f"probe process gave no answer: {exc}"
        finally:
            p.join(5)
            if p.is_alive():
                p.kill()
    finally:
        os.close(fd)


def _nccl() -> dict[str, Any]:
    """Where libnccl was found (through the binding's search order), why, its version and optional functions."""
    from transport.cuda import NcclUnavailableError, load_nccl
    from transport.cuda.nccl_table import OPTIONAL_FUNCTIONS

    try:
        lib = load_nccl()
    except NcclUnavailableError as exc:
        return {"found": False, "error": str(exc),
                "attempts": [{"source": a.source.value, "reason": a.reason} for a in exc.attempts]}
    return {
        "found": True,
        "path": lib.path,
        "version": lib.version_string,
        "source": lib.source.value,
        "attempts": [{"source": a.source.value, "reason": a.reason} for a in lib.attempts],
        "optional": {f.name: lib.has(f.name) for f in OPTIONAL_FUNCTIONS},
    }


def _ipc() -> dict[str, Any]:
    """Whether this process can export and map CUDA IPC handles (the cuda_ipc plane's engine)."""
    try:
        from transport.cuda.ipc import cuda_ipc_engine

        engine, reason = cuda_ipc_engine()
    except Exception as exc:  # noqa: BLE001 - report, don't crash the doctor
        return {"available": False, "reason": f"the CUDA IPC engine cannot be loaded: {exc}"}
    out: dict[str, Any] = {"available": engine is not None, "reason": reason}
    from transport.planes import plane_features

    for feature, (have, why) in (plane_features("cuda_ipc") if engine is not None else {}).items():
        out[feature] = have
        out[f"{feature}_reason"] = why
    from transport.cuda.ipc import allocator_warning

    warning = allocator_warning()
    if warning:
        out["warning"] = warning
    return out


def _nccl_link() -> dict[str, Any]:
    """Whether this process can set up the nccl plane's links (CUDA, NCCL with non-blocking init)."""
    try:
        from transport.planes import link_engine_probe

        engine, reason = link_engine_probe(None)
    except Exception as exc:  # noqa: BLE001 - report, don't crash the doctor
        return {"available": False, "reason": f"the NCCL link engine cannot be loaded: {exc}"}
    return {"available": engine is not None, "reason": reason}


def _io_settings() -> dict[str, Any]:
    """The channel I/O settings the environment gives this process (read as a channel would)."""
    from transport import answer_spin, local_socket, loop_reads

    budget, error = answer_spin.env_setting()
    if error is not None:
        spin_note = f"{error}: the default is used"
    elif os.environ.get("TRANSPORT_SPIN_US") is not None:
        spin_note = "TRANSPORT_SPIN_US"
    else:
        spin_note = "default; TRANSPORT_SPIN_US sets it"
    return {
        "loop_reads": loop_reads.enabled(),
        "unix_sockets": local_socket.enabled(),
        "answer_spin_us": round(budget * 1e6, 3),
        "answer_spin_note": spin_note,
    }


def collect() -> dict[str, Any]:
    """Everything the doctor reports, as a dict."""
    import msgspec
    import torch

    import transport
    from transport.hostinfo import local_host
    from transport.planes import CPU_PLANES, choose_gpu_plane
    from transport.wire import HostInfo

    host = local_host()
    planes = {}
    for plane in CPU_PLANES:
        ok, reason = plane.probe()
        planes[plane.name] = {"available": ok, "reason": reason}
    if planes["shm"]["available"]:
        ok, reason = _cross_process_shm()
        planes["shm"] = {"available": ok, "reason": reason}
    for plane in CPU_PLANES:
        if planes[plane.name]["available"]:
            for feature, (have, why) in plane.features().items():
                planes[plane.name][feature] = have
                planes[plane.name][f"{feature}_reason"] = why
    cuda: dict[str, Any] = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    cuda["device_count"] = torch.cuda.device_count() if cuda["available"] else 0
    cuda["devices"] = [torch.cuda.get_device_name(i) for i in range(cuda["device_count"])]
    cuda["ipc"] = _ipc()
    ipc = (cuda["ipc"]["available"], cuda["ipc"]["reason"])
    cuda["nccl_link"] = _nccl_link()
    link = (("pending", f"a 2-rank NCCL link is set up with each channel ({cuda['nccl_link']['reason']})")
            if cuda["nccl_link"]["available"] else ("down", f"this process cannot use NCCL: {cuda['nccl_link']['reason']}"))
    # what a peer process on this host and one on another host would get
    neighbour = HostInfo(hostname=host.hostname, boot_id=host.boot_id, pid_ns=host.pid_ns, pid=0)
    other = HostInfo(hostname="another-host", boot_id="another-boot", pid_ns=host.pid_ns, pid=0)
    cuda["gpu_planes"] = {
        "same_host": dict(zip(("plane", "reason"), choose_gpu_plane(host, neighbour, ipc_engine=ipc, link=link),
                              strict=True)),
        "other_host": dict(zip(("plane", "reason"), choose_gpu_plane(host, other, ipc_engine=ipc, link=link),
                               strict=True)),
    }
    if not cuda["available"]:
        cuda["note"] = "no CUDA here: CUDA tensors cannot be created, so only CPU buffers move in this process"
    return {
        "io": _io_settings(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "msgspec": msgspec.__version__,
            "transport": transport.__version__,
        },
        "host": {"hostname": host.hostname, "boot_id": host.boot_id, "pid_namespace": host.pid_ns},
        "planes": planes,
        "cuda": cuda,
        "nccl": _nccl(),
        "choice": "CPU buffers: shm when both endpoints allow it and share a host (same boot id and pid "
        "namespace), otherwise tcp; Endpoint(planes=(...)) restricts the choice, and a peer no allowed "
        "plane reaches raises PlaneUnavailableError. GPU buffers (either side): cuda_ipc (same host, another "
        "process, both allow it, CUDA IPC available), then nccl (the channel's own 2-rank NCCL communicator, set "
        "up with the channel when both endpoints offer nccl and are not same-host peers that both allow "
        "cuda_ipc), then staged (bounce buffers, inline on the channel's socket, needs nothing else)",
    }


async def _peer_choice(store: str, peer: str, planes: tuple[str, ...] | None, timeout: float) -> dict[str, Any]:
    import transport

    async with transport.Endpoint(f"doctor-{os.getpid()}", store=store, planes=planes, timeout=timeout) as ep:
        p = await ep.connect(peer, timeout=timeout)
        return {"peer": p.name, "incarnation": hex(p.incarnation), "plane": p.plane, "reason": p.plane_reason,
                "gpu_plane": p.gpu_plane, "gpu_reason": p.gpu_plane_reason, "buffers": len(p.buffers),
                "socket": p.socket, "secret": ep.secret_source}


def _print_features(p: dict[str, Any], indent: str) -> None:
    """A plane's features in the text report: ``<feature>: yes|no: <why>`` (from the ``<feature>``
    and ``<feature>_reason`` keys :func:`collect` puts next to the plane's availability)."""
    for key in [k for k in p if k.endswith("_reason") and k[: -len("_reason")] in p]:
        feature = key[: -len("_reason")]
        print(f"{indent}{feature.replace('_', '-')}: {'yes' if p[feature] else 'no'}: {p[key]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m transport doctor", description=__doc__)
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--store", help="tcp://HOST:PORT of a live rendezvous store")
    ap.add_argument("--peer", help="name of a live endpoint: report the plane chosen for it")
    ap.add_argument("--planes", help="comma-separated planes to allow when connecting to --peer")
    ap.add_argument("--timeout", type=float, default=10.0)
    args = ap.parse_args(argv)
    report = collect()
    if args.peer:
        if not args.store and not os.environ.get("MASTER_ADDR"):
            ap.error("--peer needs --store (or MASTER_ADDR/MASTER_PORT)")
        planes = tuple(args.planes.split(",")) if args.planes else None
        try:
            report["peer"] = asyncio.run(_peer_choice(args.store, args.peer, planes, args.timeout))
        except Exception as exc:  # noqa: BLE001 - the doctor reports, it does not crash
            report["peer"] = {"peer": args.peer, "error": f"{type(exc).__name__}: {exc}"}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    v = report["versions"]
    print(f"transport {v['transport']}  python {v['python']}  torch {v['torch']}  msgspec {v['msgspec']}")
    h = report["host"]
    print(f"host {h['hostname']}  boot id {h['boot_id'] or '?'}  pid namespace {h['pid_namespace']}")
    print("planes:")
    for name, p in report["planes"].items():
        print(f"  {name:<5} {'yes' if p['available'] else 'NO ':<4} {p['reason']}")
        _print_features(p, "        ")
    c = report["cuda"]
    if c["available"]:
        print(f"cuda: available, {c['device_count']} device(s): {', '.join(c['devices'])} (torch CUDA {c['torch_cuda']})")
    else:
        print(f"cuda: not available ({c['note']})")
    ipc = c["ipc"]
    print(f"  cuda_ipc: {'yes' if ipc['available'] else 'no'}: {ipc['reason']}")
    _print_features(ipc, "    ")  # (only where it is available, as the CPU planes)
    nl = c["nccl_link"]
    print(f"  nccl plane: {'yes' if nl['available'] else 'no'}: {nl['reason']}")
    if "warning" in ipc:
        print(f"  WARNING: {ipc['warning']}")
    for where, g in c["gpu_planes"].items():
        print(f"  GPU buffers, peer on {where.replace('_', ' ')}: {g['plane']} because {g['reason']}")
    n = report["nccl"]
    if n["found"]:
        print(f"nccl: {n['version']} at {n['path']} (via {n['source']})")
        missing = [name for name, ok in n["optional"].items() if not ok]
        print(f"  optional functions missing: {', '.join(missing) if missing else 'none'}")
    else:
        print("nccl: not found")
    for a in n["attempts"]:
        print(f"  {a['source']}: {a['reason']}")
    io = report["io"]
    print(f"channel I/O: answers read on the event loop {'on' if io['loop_reads'] else 'off (TRANSPORT_LOOP_READS)'}; "
          f"same-host channels on Unix sockets {'on' if io['unix_sockets'] else 'off (TRANSPORT_UNIX_SOCKETS)'}; "
          f"a small op spins for its answer up to {io['answer_spin_us']:.0f} us ({io['answer_spin_note']})")
    print(f"choice: {report['choice']}")
    if "peer" in report:
        p = report["peer"]
        if "error" in p:
            print(f"peer {p['peer']}: {p['error']}")
        else:
            print(f"peer {p['peer']} (incarnation {p['incarnation']}, {p['buffers']} buffers): "
                  f"plane {p['plane']} because {p['reason']}")
            print(f"  GPU buffers: plane {p['gpu_plane']} because {p['gpu_reason']}")
            print(f"  channel socket: {p['socket']}" + (" (same host, same network namespace)" if p["socket"] == "unix"
                                                         else ""))
            print(f"  the job's secret: from {p['secret']} (the peer proved it holds the same)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
