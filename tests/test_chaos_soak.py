"""Chaos soak: one trainer (this process), four generator processes, faults every few seconds while pushing.

Marker ``soak``: ``make test`` deselects it, ``make soak`` (a CI step of its own) runs it.
``SOAK_SECONDS`` bounds the faulty phase (default 150); ``SOAK_SEED`` replays a run (the seed
is printed).

The trainer pushes a ~4 MiB model (float32, bfloat16, int64 tensors; 1 MiB buckets) every
0.5-1 s, each version's bytes seeded by the version, to four generators on this host (``shm``)
in modes staged, swap, direct and shared. Every 2-4 s a random healthy generator gets one of:

- ``kill``: SIGKILL, then a new process under the same name (a new incarnation, version 0);
- ``stop``: SIGSTOP for 0.5-5 s, then SIGCONT;
- ``sockets``: its transport sockets are destroyed from outside (``ss -K``, both ends reset);
  left out, with the reason printed, where the kernel or the privileges do not allow it;
- ``zombie``: SIGSTOP, a new process under the same name (published: the store names it), then
  SIGCONT: the stale process runs beside its replacement for 2-4 s, then is killed. It must not
  keep the name: it commits no version whose push began after it was stopped (it asks the store
  before it serves anything once it runs again: transport.pauses).

Checked: every push returns within its bound (connect_timeout + timeout + a margin); no reader
(a thread reading under ``hold_blocking()`` all along, hashing the weights) ever sees bytes
other than those of the version it holds; every fault is survived (the generator, or its
replacement, commits a version pushed after the fault within ``RECOVER_S``); a generator no
fault touched commits at least every ``GAP_S``; at the end every generator holds the last
version, bit-exact; the trainer's and each generator process's fds, threads and RSS stay
within a slack of an early sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import rl_sync
import transport
from tests._chaos_gen import HOLD_TIMEOUTS, MIXED, READS, generator_main, warm_default_executor
from tests._netns_gen import digest, weights

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "150"))
SPEC = {
    "embed.weight": ("float32", (512, 1024)),
    "layers.0.weight": ("bfloat16", (1024, 512)),
    "layers.0.bias": ("float32", (1024,)),
    "layers.1.weight": ("float32", (256, 1024)),
    "steps": ("int64", (3,)),
}
MODES = ("staged", "swap", "direct", "shared")
BUCKET = 1 << 20
HB = 3.0  # heartbeat_timeout everywhere (interval HB / 6)
PUSH_TIMEOUT = 5.0
CONNECT_TIMEOUT = 2.0
MARGIN = 3.0  # a 2-core machine shared with other runs
BOUND = CONNECT_TIMEOUT + PUSH_TIMEOUT + MARGIN
RECOVER_S = 20.0  # a faulted generator commits again within this after the fault ended
GAP_S = 15.0  # an untouched generator commits at least this often
GRACE_S = 8.0  # after a fault ends, its generator counts as touched this much longer
FD_SLACK, THREAD_SLACK, RSS_SLACK = 8, 4, (0.30, 100 << 20)

pytestmark = pytest.mark.soak
_CTX = mp.get_context("spawn")


# ---------------------------------------------------------------------------- /proc and sockets
def proc_stats(pid: int) -> dict[str, int] | None:
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = len(os.listdir(f"/proc/{pid}/task"))
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return {"fds": fds, "threads": threads, "rss": rss}


def _hexaddr(field: str) -> tuple[str, int]:
    host, port = field.split(":")
    return socket.inet_ntoa(bytes.fromhex(host)[::-1]), int(port, 16)


def tcp_sockets(pid: int) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """The established IPv4 TCP sockets process ``pid`` holds: (local, remote) addresses."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        with open(f"/proc/{pid}/net/tcp") as f:
            rows = f.read().splitlines()[1:]
    except OSError:
        return []
    out = []
    for row in rows:
        cols = row.split()
        if cols[3] == "01" and cols[9] in inodes:
            out.append((_hexaddr(cols[1]), _hexaddr(cols[2])))
    return out


def destroy(local: tuple[str, int], remote: tuple[str, int]) -> bool:
    """Destroy one socket by its 4-tuple (``ss -K``: the kernel aborts it and resets the peer)."""
    res = subprocess.run(["ss", "-K", "-t", "-n", "state", "established", "src", f"{local[0]}:{local[1]}",
                          "dst", f"{remote[0]}:{remote[1]}"], capture_output=True, text=True, timeout=10)
    return res.returncode == 0


def socket_kill_unavailable() -> str | None:
    """Why ``ss -K`` cannot destroy sockets here, or None (tried on a socket pair of this process)."""
    lsock = socket.socket()
    try:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen()
        a = socket.create_connection(lsock.getsockname(), timeout=5)
        b, _ = lsock.accept()
        with a, b:
            try:
                ok = destroy(a.getsockname(), a.getpeername())
            except (OSError, subprocess.TimeoutExpired) as exc:
                return f"ss -K cannot run: {exc}"
            b.settimeout(2)
            try:
                b.recv(1)
            except ConnectionResetError:
                return None
            except OSError as exc:
                return f"ss -K did not reset the peer ({exc})"
            return "ss -K left the socket alive (kernel without CONFIG_INET_DIAG_DESTROY, or no CAP_NET_ADMIN)" + (
                "" if ok else ": ss failed")
    finally:
        lsock.close()


# ---------------------------------------------------------------------------- generators
class Gen:
    """One generator slot: a spawned process under a fixed name, replaced by a new one after SIGKILL.
    Its counters (shared memory) add up over the slot's processes."""

    def __init__(self, slot: int, name: str, mode: str, store_url: str, log_dir: Path) -> None:
        self.slot, self.name, self.mode, self.store_url, self.log_dir = slot, name, mode, store_url, log_dir
        self.counters = _CTX.Array("q", 4, lock=False)
        self.proc: Any = None
        self.conn: Any = None
        self.pid = 0
        self.port = 0
        self.started_at = 0.0
        self.busy = False  # a fault is running on it
        self.lives: list[dict[str, Any]] = []  # per process: pid, first/last resource samples

    def start(self, timeout: float = 90.0) -> None:
        """Spawn a process and wait (bounded) for its endpoint and subscriber."""
        parent, child = _CTX.Pipe()
        log_path = self.log_dir / f"{self.name}-{len(self.lives)}.log"
        proc = _CTX.Process(target=generator_main, name=self.name, daemon=True,
                            args=(self.name, self.store_url, self.mode, SPEC, HB, child, self.counters,
                                  str(log_path)))
        proc.start()
        child.close()
        self.proc, self.conn = proc, parent
        if not parent.poll(timeout):
            raise AssertionError(f"{self.name}: not ready within {timeout} s")
        status, info = parent.recv()
        assert status == "ok", f"{self.name}: {info}"
        self.pid, self.port, self.started_at = info["pid"], info["address"][1], time.monotonic()
        self.lives.append({"pid": self.pid, "log": str(log_path), "first": None, "last": None,
                           "started": self.started_at})

    def sample(self, which: str) -> None:
        life = self.lives[-1]
        st = proc_stats(self.pid)
        if st is not None and (which == "last" or life["first"] is None):
            life[which] = (time.monotonic(), st)

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.kill()
        self.proc.join(10)
        self.conn.close()
        self.proc = None

    def status(self, timeout: float = 30.0, conn: Any = None) -> dict[str, Any]:
        conn = conn or self.conn
        conn.send("status")
        if not conn.poll(timeout):
            raise AssertionError(f"{self.name}: no status within {timeout} s")
        status, value = conn.recv()
        assert status == "ok", f"{self.name}: {value}"
        return value

    def stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            with contextlib.suppress(OSError, EOFError):
                self.conn.send("stop")
                self.conn.poll(10)
            self.proc.join(10)
        if self.proc is not None and self.lives:
            self.lives[-1]["exitcode"] = self.proc.exitcode
        self.kill()


# ---------------------------------------------------------------------------- the soak
@pytest.mark.timeout(int(SOAK_SECONDS) + 300)
async def test_chaos_soak(store_url, uname, tmp_path):
    seed = int(os.environ.get("SOAK_SEED", time.time_ns() % 2**32))
    rng = random.Random(seed)
    no_sockets = socket_kill_unavailable()
    kinds = ["kill", "stop", "zombie"] + ([] if no_sockets else ["sockets"])
    print(f"\nchaos soak: seed {seed} (SOAK_SEED={seed} replays it), {SOAK_SECONDS:.0f} s of faults, kinds "
          f"{kinds}" + (f"; 'sockets' left out: {no_sockets}" if no_sockets else ""))
    gens = [Gen(i, uname(f"soak{i}"), mode, store_url, tmp_path) for i, mode in enumerate(MODES)]
    pushes: list[dict[str, Any]] = []
    faults: list[dict[str, Any]] = []
    fault_tasks: set[asyncio.Task] = set()
    want: dict[int, str] = {}
    flags = {"pushing": True, "faulting": True, "baseline": None}
    push_task = inject_task = None
    ep = transport.Endpoint(uname("soak-trainer"), store=store_url, timeout=10, heartbeat_interval=HB / 6,
                            heartbeat_timeout=HB)
    try:
        await warm_default_executor()
        await asyncio.gather(*[asyncio.to_thread(g.start) for g in gens])
        await ep.open()
        pub = rl_sync.WeightPublisher(ep, [g.name for g in gens], bucket_bytes=BUCKET,
                                      connect_timeout=CONNECT_TIMEOUT)

        async def pusher() -> None:
            v = 0
            while flags["pushing"]:
                v += 1
                data = await asyncio.to_thread(weights, SPEC, v)
                t0 = time.monotonic()
                rep = await pub.push(data, v, timeout=PUSH_TIMEOUT)
                wall = time.monotonic() - t0
                pushes.append({"version": v, "t0": t0, "wall": wall, "ok": rep.ok, "summary": rep.summary(),
                               "results": {n: (r.ok, type(r.error).__name__ if r.error else None, t0 + r.seconds)
                                           for n, r in rep.results.items()}})
                await asyncio.sleep(max(0.0, t0 + rng.uniform(0.5, 1.0) - time.monotonic()))

        async def fault(g: Gen, kind: str) -> None:
            rec: dict[str, Any] = {"kind": kind, "gen": g.name, "start": time.monotonic(), "detail": ""}
            faults.append(rec)
            try:
                if kind == "kill":
                    g.sample("last")
                    old = g.pid
                    await asyncio.to_thread(g.kill)
                    await asyncio.to_thread(g.start)
                    rec["detail"] = f"pid {old} -> {g.pid}"
                elif kind == "stop":
                    secs = rng.uniform(0.5, 5.0)
                    os.kill(g.pid, signal.SIGSTOP)
                    try:
                        await asyncio.sleep(secs)
                    finally:
                        os.kill(g.pid, signal.SIGCONT)
                    rec["detail"] = f"{secs:.1f} s"
                elif kind == "zombie":
                    old_proc, old_conn, old_pid = g.proc, g.conn, g.pid
                    stopped = time.monotonic()
                    os.kill(old_pid, signal.SIGSTOP)
                    try:
                        g.sample("last")
                        await asyncio.to_thread(g.start)  # the replacement: published, subscribed
                        since = pushes[-1]["version"] if pushes else 0  # later versions are the replacement's
                    finally:
                        os.kill(old_pid, signal.SIGCONT)
                        thawed = time.monotonic()
                    await asyncio.sleep(rng.uniform(2.0, 4.0))  # the stale process runs beside it
                    try:
                        st = await asyncio.to_thread(g.status, 10.0, old_conn)
                        held = st["version"]
                    except (AssertionError, OSError, EOFError) as exc:
                        held = None
                        rec["detail"] = f"(no status from the stale process: {exc}) "
                    old_proc.kill()
                    await asyncio.to_thread(old_proc.join, 10)
                    old_conn.close()
                    rec["detail"] += f"pid {old_pid} (held v{held}) -> {g.pid}, pushes from v{since + 1}"
                    began = next((p["t0"] for p in pushes if p["version"] == held), None)
                    # (running again, it asks the store before it serves a frame: a push begun while it was
                    # stopped must not reach it)
                    if held is not None and held > since and began is not None and began > stopped:
                        rec["stale_commit"] = held
                        rec["detail"] += (f", v{held} began {began - stopped:.2f} s after it was stopped "
                                          f"({began - thawed:+.2f} s from when it ran again)")
                else:
                    socks = [s for s in tcp_sockets(g.pid) if s[1][1] == ep.address[1] or s[0][1] == g.port]
                    done = [await asyncio.to_thread(destroy, *s) for s in socks]
                    left = set(tcp_sockets(g.pid)) & set(socks)
                    rec["detail"] = f"{sum(done)}/{len(socks)} destroyed" + (f", {len(left)} left" if left else "")
            finally:
                rec["end"] = time.monotonic()
                g.busy = False

        async def injector() -> None:
            start = time.monotonic()
            await asyncio.sleep(5.0)
            while time.monotonic() - start < SOAK_SECONDS:
                if flags["baseline"] is None and time.monotonic() - start >= SOAK_SECONDS / 4:
                    await take_baseline()
                    continue
                await asyncio.sleep(rng.uniform(2.0, 4.0))
                free = [g for g in gens if not g.busy]
                if not free:
                    continue
                g, kind = rng.choice(free), rng.choice(kinds)
                g.busy = True
                for other in gens:  # a first sample of processes started after the baseline, once warm
                    if not other.busy and flags["baseline"] is not None and time.monotonic() - other.started_at > 10:
                        other.sample("first")
                t = asyncio.ensure_future(fault(g, kind))
                fault_tasks.add(t)
                t.add_done_callback(fault_tasks.discard)

        async def quiet(within: float) -> bool:
            """Wait (bounded) until no fault runs, none ended in the last 3 s, and a push went all ok."""
            end = time.monotonic() + within
            while time.monotonic() < end:
                last_end = max((f.get("end", time.monotonic()) for f in faults), default=0.0)
                if not fault_tasks and time.monotonic() - last_end > 3.0 and pushes and pushes[-1]["ok"] \
                        and pushes[-1]["t0"] > last_end:
                    return True
                await asyncio.sleep(0.2)
            return False

        async def take_baseline() -> None:
            if not await quiet(60.0):
                print("no quiet moment for the baseline sample within 60 s; taken anyway")
            flags["baseline"] = (time.monotonic(), proc_stats(os.getpid()))
            for g in gens:
                g.sample("first")

        push_task = asyncio.ensure_future(pusher())
        soak_start = time.monotonic()
        inject_task = asyncio.ensure_future(injector())
        while not inject_task.done():
            await asyncio.wait([inject_task, push_task], return_when=asyncio.FIRST_COMPLETED, timeout=1.0)
            if push_task.done():
                push_task.result()  # a push raised: fail now
                raise AssertionError("the pusher stopped")
        inject_task.result()
        await asyncio.wait_for(asyncio.gather(*fault_tasks), 120)
        faults_end = time.monotonic()
        # drain: faults are over; pushes go on until one is all ok after every fault ended
        assert await quiet(60.0), "no push reached every generator within 60 s after the last fault: " + \
            "; ".join(p["summary"] for p in pushes[-5:])
        flags["pushing"] = False
        await asyncio.wait_for(push_task, BOUND + 5)
        drain_end = time.monotonic()
        await asyncio.sleep(3.0)  # channel join threads (2 s) and dumps end
        end_trainer = proc_stats(os.getpid())
        for g in gens:
            g.sample("last")

        # ------------------------------------------------------------ checks
        last = pushes[-1]
        finals = {}
        for g in gens:
            st = await asyncio.to_thread(g.status)
            if last["version"] not in want:
                want[last["version"]] = await asyncio.to_thread(digest, weights(SPEC, last["version"]))
            finals[g.name] = st
        for g in gens:
            await asyncio.to_thread(g.stop)  # orderly: each process's exit code is kept
        problems: list[str] = []
        for name, st in finals.items():
            if st["version"] != last["version"] or st["sha256"] != want[last["version"]]:
                problems.append(f"{name} holds version {st['version']} (sha256 {st['sha256'][:12]}), the last push "
                                f"was {last['version']} ({want[last['version']][:12]})")
        over = [p for p in pushes if p["wall"] > BOUND]
        if over:
            problems.append(f"{len(over)} pushes beyond their bound of {BOUND:.1f} s: "
                            + "; ".join(f"v{p['version']} {p['wall']:.2f} s" for p in over[:5]))
        mixed = {g.name: g.counters[MIXED] for g in gens}
        if any(mixed.values()):
            problems.append(f"mixed-version reads: {mixed} (see the generators' logs: MIXED READ)")
        reads = {g.name: g.counters[READS] for g in gens}
        if min(reads.values()) < 20:
            problems.append(f"too few reads to mean anything: {reads}")

        commits: dict[str, list[float]] = {g.name: [] for g in gens}
        fails: dict[str, list[tuple[float, str, float]]] = {g.name: [] for g in gens}
        for p in pushes:
            for n, (ok, err, at) in p["results"].items():
                if ok:
                    commits[n].append(at)
                else:
                    fails[n].append((at, err, p["t0"]))
        for f in faults:
            f["recovered"] = next((at for p in pushes if p["t0"] >= f["end"]
                                   for n, (ok, _e, at) in p["results"].items() if n == f["gen"] and ok), None)
            hit = [(at, err) for at, err, t0 in fails[f["gen"]] if at >= f["start"]
                   and (f["recovered"] is None or at <= f["recovered"])]
            f["detected"] = (hit[0][0] - f["start"], hit[0][1]) if hit else None
        stale = [f for f in faults if f.get("stale_commit") is not None]
        if stale:
            problems.append("a stale incarnation committed a version pushed after its replacement came up: "
                            + "; ".join(f"{f['gen']} ({f['detail']})" for f in stale))
        unsurvived = [f for f in faults if f["recovered"] is None or f["recovered"] - f["end"] > RECOVER_S]
        if unsurvived:
            problems.append("faults not survived (no commit within "
                            f"{RECOVER_S:.0f} s after they ended): "
                            + "; ".join(f"{f['kind']} {f['gen']} at +{f['start'] - soak_start:.1f} s "
                                        f"({f['detail']})" for f in unsurvived))
        for g in gens:  # progress: untouched by any fault of its own, a generator keeps committing
            touched = [(f["start"], f["end"] + GRACE_S) for f in faults if f["gen"] == g.name]
            marks = [soak_start, *commits[g.name], drain_end]
            for a, b in zip(marks, marks[1:], strict=False):
                if b - a > GAP_S and not any(s < b and e > a for s, e in touched):
                    why = [f"v{p['version']}: {p['results'][g.name][1]}" for p in pushes
                           if a < p["t0"] < b and not p["results"][g.name][0]]
                    problems.append(f"{g.name} ({g.mode}), untouched by faults, committed nothing for {b - a:.1f} s "
                                    f"(+{a - soak_start:.1f} to +{b - soak_start:.1f} s); its entries failed with "
                                    f"{sorted(set(why))[:4]}; faults on others then: "
                                    + ", ".join(f"{f['kind']} {f['gen']} ({f['detail']})" for f in faults
                                                if f['start'] < b and f['end'] > a))
        # collateral: entries of generators no fault touched during that push (the known stall of
        # the others behind one frozen subscriber shows here), and their commit latency
        collateral, latency_calm, latency_near = [], [], []
        slowest: tuple[int, str, list[str]] | None = None
        for p in pushes:
            end = max(at for _ok, _e, at in p["results"].values())
            near = [f for f in faults if f["start"] < end and f.get("end", end) + 1.0 > p["t0"]]
            for n, (ok, err, at) in p["results"].items():
                if any(f["gen"] == n and f["start"] < end + GRACE_S and f["end"] + GRACE_S > p["t0"] for f in faults):
                    continue
                if not ok:
                    collateral.append((p["version"], n, err, [f"{f['kind']} {f['gen']}" for f in near]))
                else:
                    (latency_near if near else latency_calm).append(at - p["t0"])
                    if near and at - p["t0"] >= max(latency_near):
                        slowest = (p["version"], n, [f"{f['kind']} {f['gen']} ({f['detail']})" for f in near])
        # resources
        rows = []
        base = flags["baseline"]
        if base is not None and base[1] is not None and end_trainer is not None:
            rows.append(("trainer", os.getpid(), drain_end - base[0], base[1], end_trainer))
        else:
            problems.append("no baseline sample of the trainer was taken")
        for g in gens:
            for life in g.lives:
                if life["first"] and life["last"] and life["last"][0] - life["first"][0] >= 15:
                    rows.append((f"{g.name} ({g.mode})", life["pid"], life["last"][0] - life["first"][0],
                                 life["first"][1], life["last"][1]))
        for who, pid, span, a, b in rows:
            if b["fds"] > a["fds"] + FD_SLACK or b["threads"] > a["threads"] + THREAD_SLACK or \
                    b["rss"] > max(a["rss"] * (1 + RSS_SLACK[0]), a["rss"] + RSS_SLACK[1]):
                problems.append(f"{who} pid {pid} grew over {span:.0f} s: fds {a['fds']}->{b['fds']}, threads "
                                f"{a['threads']}->{b['threads']}, RSS {a['rss'] >> 20}->{b['rss'] >> 20} MiB")

        if os.environ.get("SOAK_DUMP"):  # every push and fault, for a closer look
            import json

            doc = json.dumps({"seed": seed, "start": soak_start, "pushes": pushes, "faults": faults}, indent=1,
                             default=str)
            await asyncio.to_thread(Path(os.environ["SOAK_DUMP"]).write_text, doc)
        # ------------------------------------------------------------ figures
        walls = sorted(p["wall"] for p in pushes)
        print(f"pushes: {len(pushes)} in {drain_end - soak_start:.0f} s ({sum(p['ok'] for p in pushes)} all ok), "
              f"wall p50 {statistics.median(walls):.3f} s, p99 {walls[int(0.99 * (len(walls) - 1))]:.3f} s, max "
              f"{walls[-1]:.3f} s (bound {BOUND:.1f} s: connect {CONNECT_TIMEOUT} + timeout {PUSH_TIMEOUT} + "
              f"{MARGIN}); last version {last['version']}")
        for kind in kinds:
            fk = [f for f in faults if f["kind"] == kind]
            surv = [f for f in fk if f not in unsurvived]
            det = sorted(f["detected"][0] for f in fk if f["detected"])
            rec = sorted(f["recovered"] - f["end"] for f in fk if f["recovered"] is not None)
            errs = sorted({f["detected"][1] for f in fk if f["detected"]})
            print(f"  {kind:8s} injected {len(fk):3d}, survived {len(surv)}/{len(fk)}; failed an entry (detected) "
                  f"{len(det)}/{len(fk)}, absorbed {len(fk) - len(det)}" + (f", detection median {statistics.median(det):.2f} s max {det[-1]:.2f} s "
                                              f"({', '.join(errs)})" if det else "")
                  + (f"; recovery after the fault ended median {statistics.median(rec):.2f} s max {rec[-1]:.2f} s"
                     if rec else ""))
        print(f"  faults survived {len(faults) - len(unsurvived)}/{len(faults)}")
        for g in gens:
            print(f"  {g.name} ({g.mode}): {len(g.lives)} process(es), {len(commits[g.name])} commits, "
                  f"{len(fails[g.name])} failed entries, reads {g.counters[READS]}, mixed-version reads "
                  f"{g.counters[MIXED]}, hold timeouts {g.counters[HOLD_TIMEOUTS]}; final version "
                  f"{finals[g.name]['version']} sha256 {finals[g.name]['sha256'][:12]}"
                  f"{' (matches)' if finals[g.name]['sha256'] == want[last['version']] else ' (MISMATCH)'}")
        print(f"  mixed-version reads: {sum(mixed.values())} of {sum(reads.values())}")
        if latency_calm:
            print(f"  untouched generators' commits: {len(latency_calm)} with no fault anywhere, latency p50 "
                  f"{statistics.median(latency_calm):.3f} s max {max(latency_calm):.3f} s; {len(latency_near)} "
                  f"while another generator was faulted, p50 "
                  f"{statistics.median(latency_near) if latency_near else 0:.3f} s max "
                  f"{max(latency_near, default=0):.3f} s"
                  + (f" (v{slowest[0]} {slowest[1]}, faults then: {', '.join(slowest[2])})" if slowest else ""))
        print(f"  untouched generators' failed entries (collateral of a fault elsewhere): {len(collateral)}"
              + (": " + "; ".join(f"v{v} {n} {e} (faults then: {', '.join(near)})" for v, n, e, near in collateral[:8])
                 if collateral else ""))
        codes = [(g.name, life["pid"], life["exitcode"]) for g in gens for life in g.lives if life.get("exitcode")]
        if codes:
            print(f"  processes that exited uncleanly at the end: {codes}")
        for who, pid, span, a, b in rows:
            print(f"  resources {who} pid {pid} over {span:.0f} s: fds {a['fds']} -> {b['fds']}, threads "
                  f"{a['threads']} -> {b['threads']}, RSS {a['rss'] / 2**20:.0f} -> {b['rss'] / 2**20:.0f} MiB")
        print(f"  (faults ended {faults_end - soak_start:.0f} s in; drained by {drain_end - soak_start:.0f} s)")
        if problems:
            for g in gens:
                for life in g.lives:
                    print(f"--- log of {g.name} pid {life['pid']}: {life['log']}")
        assert not problems, "\n".join(problems)
    finally:
        flags["pushing"] = False
        for t in [*fault_tasks, inject_task, push_task]:
            if t is not None and not t.done():
                t.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(t, 15)
        for g in gens:
            await asyncio.to_thread(g.stop)
        await ep.close(timeout=5)
