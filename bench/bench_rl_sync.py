#!/usr/bin/env python
"""Weight pushes of ``rl_sync`` (trainer -> generators) against per-tensor Gloo broadcast, same run.

Usage::

    python bench/bench_rl_sync.py              # full run: ~355M params, 1 and 4 subscribers, every mode (~5 min)
    python bench/bench_rl_sync.py --quick      # ~20M params, 1 and 2 subscribers, every mode (seconds; smoke test)
    python bench/bench_rl_sync.py [--params 350M] [--subscribers 1,4] [--modes staged,swap,direct,shared] [--reps N]
                                  [--rounds N] [--warmup N] [--buckets-mib 256[,64]] [--threads N] [--no-gloo]
                                  [--debug] [--json PATH]

This is a benchmark, not a test: it never asserts on a number. It prints a
table, a breakdown of where each push's time went and a "targets" section
(PASS/MISS), and writes everything as JSON (default
``bench/results/rl_sync.json``, git-ignored). The exit status is non-zero
only when a case crashed, timed out or delivered wrong bytes.

The workload is the state dict of a GPT-like transformer built in code (no
downloads; default ~355M parameters: d_model 1024, 24 layers, ffn 4096,
vocab 50304, 1024 positions, lm_head tied to the token embedding, 292
tensors). The trainer holds it in float32; the generators hold bfloat16, so
every push casts on the way (the bytes delivered are the bfloat16 ones).

Cases, every one between real processes (``spawn``):

* **rl_sync**: the trainer is this process, with a ``transport.Endpoint``
  serving the store and an ``rl_sync.WeightPublisher(dtype=torch.bfloat16)``;
  each subscriber is a spawned process with its own Endpoint and an
  ``rl_sync.WeightSubscriber(ep, state, mode=...)`` over a bfloat16 state
  dict, once per ``--modes`` entry (fresh subscriber processes per mode):
  ``staged`` (buckets land in a staging arena, the commit copies them into
  the live tensors), ``swap`` (two banks of arenas, the commit re-points
  the live tensors into the bank just filled with ``Tensor.set_``, no copy)
  and ``direct`` (one bank that the live tensors point into, written while
  readers are held off; the commit only bumps the version), and ``shared``
  (no arenas: the publisher packs each version once into one of its banks
  and every subscriber's commit re-points its live tensors into that bank,
  mapped read-only; the subscribers copy nothing).
  Timed: ``await pub.push(state, version)`` until every subscriber has
  committed (the push's own completion rule), per mode, subscriber count
  and ``bucket_bytes``, after ``--warmup`` warm-up pushes per arena bank
  (planning, first-touch page faults of the arenas: staged has one bank,
  swap and shared two, filled alternately, so they warm up with twice as many pushes).
* **gloo broadcast/tensor**: what most RL frameworks do today. A process
  group over loopback, world = 1 trainer (this process, rank 0) + N
  receivers; the trainer casts each tensor to bfloat16 and broadcasts it,
  the receivers broadcast into their bfloat16 tensors. Timed from a barrier
  to a closing barrier (i.e. until every receiver holds every tensor).
* **limits**, in this process on one thread: ``copy_`` of the bfloat16 bytes
  (memcpy) and the float32 -> bfloat16 cast of the state dict tensor by
  tensor into one flat buffer (exactly the packing work of a push); plus
  one ``copy_`` per core in as many processes at the same moment (does a
  second core add memory bandwidth?). From these the report derives a
  memory-traffic floor per mode and subscriber count (see
  :func:`floor_model`): staged C + 2 N M of work, swap C + N M.

Phases (limits, rl_sync, gloo) never overlap: each one's processes are gone
before the next starts, so memory stays bounded (full run: the trainer's
1.4 GB, plus 1.4 GB per subscriber (2.1 GB in swap mode until its first
commit frees the tensors it was built with) or 0.7 GB per Gloo receiver).
They run ``--rounds`` times (default 3) in an order rotated every round (and
the order of the modes inside the rl_sync phase too) and the repetitions are
pooled, so a shared host's drift spreads over every case.
Every wait is bounded; a case that crashes or times out becomes an error
row, its processes are killed, and the run goes on.

Before every push/broadcast the trainer negates its weights in place (not
timed), so consecutive versions differ in every byte; after the last
repetition of a case every subscriber/receiver reports a SHA-256 of its
bfloat16 weights, which must equal the trainer's own bfloat16 cast.

Where the time goes: the trainer wraps ``rl_sync.push_run._pack`` and each
subscriber wraps ``WeightSubscriber._pull`` and its commit step to timestamp
them: ``_apply`` (staged: the copy into the live tensors, in a thread) or
``_repoint`` (swap: ``set_`` of every live tensor, on the event loop); a few
``time.monotonic()`` calls per bucket; private names, so the breakdown
shows n/a where they are renamed. Every process reports its CPU
time per push, next to the host's busy CPU time from ``/proc/stat`` (which
shows other tenants).

``torch.set_num_threads(--threads)`` (default 1) is the same in every process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import inspect
import logging
import math
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, inherited by every spawned process

import _common  # noqa: E402  (bench/_common.py)
import torch  # noqa: E402
from _common import loadavg, usable_cpus  # noqa: E402

MiB = 1 << 20
GB = 1e9
TRAINER = "bench-rl-trainer"
STARTUP_TIMEOUT = 180.0  # a spawned process importing torch and opening its endpoint (2 busy cores: slow)
CMD_TIMEOUT = 300.0  # a subscriber waiting for its next command
PUSH_TIMEOUT = 300.0  # deadline of one push (after planning)
OP_TIMEOUT = 120.0  # transport endpoint timeout of every op
GLOO_TIMEOUT = 300.0  # process group timeout (init and every collective)
BASE_LEN = 1_000_003  # period of the fill pattern, in elements (prime: no alignment with rows or buckets)
FULL_PARAMS = 355_000_000
QUICK_PARAMS = 20_000_000
MODES = ("staged", "swap", "direct", "shared")  # rl_sync.WeightSubscriber's modes (rl_sync.subscriber.MODES)
BANKS = {"staged": 1, "swap": 2, "direct": 1, "shared": 2}  # arena banks per mode: warm-up pushes are per bank
COMMIT_STEP = {"staged": "_apply", "swap": "_repoint", "direct": "_commit_direct", "shared": "_repoint"}  # per mode

CTX = mp.get_context("spawn")
log = logging.getLogger("bench_rl_sync")


class PhaseError(RuntimeError):
    pass


# ---------------------------------------------------------------------------- the model
def model_config(params: int, vocab: int = 50304, ctx: int = 1024) -> dict[str, Any]:
    """A GPT-like shape with about ``params`` parameters: d_model ~ 43 x layers (GPT-2 medium's
    1024/24), d a multiple of 64, ffn 4 d, lm_head tied to the token embedding."""
    best: tuple[float, dict[str, Any]] | None = None
    for layers in range(1, 129):
        d = max(64, round(layers * 128 / 3 / 64) * 64)
        cfg = {"d_model": d, "layers": layers, "ffn": 4 * d, "vocab": vocab, "ctx": ctx, "tied_lm_head": True}
        n = count_params(state_dict_shapes(cfg))
        err = abs(math.log(n / params))
        if best is None or err < best[0]:
            best = (err, cfg)
    assert best is not None
    return best[1]


def state_dict_shapes(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes (12 tensors per layer); with a tied lm_head it is not a separate entry."""
    d, f = cfg["d_model"], cfg["ffn"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte.weight", (cfg["vocab"], d)), ("wpe.weight", (cfg["ctx"], d))]
    for i in range(cfg["layers"]):
        p = f"h.{i}."
        shapes += [
            (p + "ln_1.weight", (d,)),
            (p + "ln_1.bias", (d,)),
            (p + "attn.qkv.weight", (3 * d, d)),
            (p + "attn.qkv.bias", (3 * d,)),
            (p + "attn.proj.weight", (d, d)),
            (p + "attn.proj.bias", (d,)),
            (p + "ln_2.weight", (d,)),
            (p + "ln_2.bias", (d,)),
            (p + "mlp.fc.weight", (f, d)),
            (p + "mlp.fc.bias", (f,)),
            (p + "mlp.proj.weight", (d, f)),
            (p + "mlp.proj.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    if not cfg.get("tied_lm_head", True):
        shapes.append(("lm_head.weight", (cfg["vocab"], d)))
    return shapes


def count_params(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(s) for _, s in shapes)


def trainer_state(shapes: list[tuple[str, tuple[int, ...]]], seed: int = 1234) -> dict[str, torch.Tensor]:
    """float32 tensors filled with a random pattern of period BASE_LEN, started at a different
    offset per tensor (random-ish contents at memcpy speed; ``randn`` of 1.4 GB takes ~10 s here)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(BASE_LEN, generator=g).mul_(0.2).sub_(0.1)
    out: dict[str, torch.Tensor] = {}
    for i, (name, shape) in enumerate(shapes):
        n = math.prod(shape)
        flat = torch.empty(n, dtype=torch.float32)
        off = (i * 7919 + 17) % BASE_LEN
        k = min(n, BASE_LEN - off)
        flat[:k].copy_(base[off:off + k])
        pos = k
        while pos < n:
            k = min(n - pos, BASE_LEN)
            flat[pos:pos + k].copy_(base[:k])
            pos += k
        out[name] = flat.view(shape)
    return out


def receiver_state(shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=dtype) for name, shape in shapes}


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes, in order (hashlib releases the GIL on large buffers)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def cast_digest(state: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
    """What a subscriber must hold: the trainer's tensors cast to ``dtype``, one at a time."""
    return digest(t.to(dtype) for t in state.values())


# ---------------------------------------------------------------------------- small utilities
def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _cpu_sample() -> tuple[float, float, float, float] | None:
    """(busy, steal, total, softirq) CPU seconds of the whole host so far, from /proc/stat (all
    tenants; steal = time the hypervisor gave this VM's CPUs to someone else; softirq, part of
    busy, is charged to no process: e.g. loopback TCP receive processing)."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = vals[:8]
    return (user + nice + system + irq + softirq) / hz, steal / hz, sum(vals[:8]) / hz, softirq / hz


def _host_busy(a: tuple[float, ...] | None, b: tuple[float, ...] | None) -> dict[str, float] | None:
    if a is None or b is None:
        return None
    return {"busy_s": b[0] - a[0], "steal_s": b[1] - a[1], "softirq_s": b[3] - a[3]}


def _rusage() -> tuple[float, float, int]:
    """(user s, system s, minor page faults) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def _rusage_delta(a: tuple[float, float, int], b: tuple[float, float, int]) -> dict[str, float]:
    return {"user_s": b[0] - a[0], "sys_s": b[1] - a[1], "minflt": b[2] - a[2]}


def _idle_fraction(seconds: float = 1.0) -> float | None:
    a = _cpu_sample()
    time.sleep(seconds)
    b = _cpu_sample()
    if a is None or b is None or b[2] <= a[2]:
        return None
    return 1.0 - (b[0] - a[0] + b[1] - a[1]) / (b[2] - a[2])


def _fmt_bytes(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / MiB:.1f} MiB"


# ---------------------------------------------------------------------------- child processes
class Children:
    """Spawned processes of one case, a shared result queue, one command queue each; every wait bounded."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.result_q = CTX.Queue()
        self.ctrl: dict[str, Any] = {}
        self.procs: dict[str, Any] = {}
        self.killed: list[str] = []

    def start(self, name: str, fn: Any, args: tuple[Any, ...], ctrl: bool = False) -> None:
        q = CTX.Queue() if ctrl else None
        if q is not None:
            self.ctrl[name] = q
        p = CTX.Process(target=_child_entry, name=f"bench-rl-{self.label}-{name}",
                        args=(fn.__name__, name, self.result_q, q, args), daemon=True)
        p.start()
        self.procs[name] = p

    def send(self, names: Iterable[str], *cmd: Any) -> None:
        for n in names:
            self.ctrl[n].put(cmd)

    def expect(self, kind: str, names: Iterable[str], timeout: float) -> dict[str, Any]:
        """Collect one ``kind`` message from each of ``names``; raise PhaseError on an error
        message, a dead process or the deadline."""
        want = set(names)
        got: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while want - got.keys():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PhaseError(f"{self.label}: no {kind!r} from {sorted(want - got.keys())} within {timeout:.0f} s")
            try:
                k, name, payload = self.result_q.get(timeout=min(0.5, remaining))
            except queue.Empty:
                dead = [(n, p) for n, p in self.procs.items() if p.exitcode is not None and n in want - got.keys()]
                if dead:
                    try:  # its traceback may still be on the way
                        k, name, payload = self.result_q.get(timeout=2.0)
                    except queue.Empty:
                        n, p = dead[0]
                        raise PhaseError(f"{self.label}: {n} exited with code {p.exitcode}") from None
                else:
                    continue
            if k == "error":
                raise PhaseError(payload)
            if k != kind:
                raise PhaseError(f"{self.label}: expected {kind!r} from {sorted(want)}, got {k!r} from {name}")
            got[name] = payload
        return got

    async def aexpect(self, kind: str, names: Iterable[str], timeout: float) -> dict[str, Any]:
        return await asyncio.to_thread(self.expect, kind, list(names), timeout)

    def reap(self, grace: float) -> None:
        end = time.monotonic() + grace
        for p in self.procs.values():
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs.values():
            if p.is_alive():
                self.killed.append(f"{p.name} (pid {p.pid})")
                p.terminate()
                p.join(3.0)
                if p.is_alive():
                    p.kill()
                    p.join(3.0)
        for q in (self.result_q, *self.ctrl.values()):
            q.close()
            q.cancel_join_thread()


def _child_entry(fn_name: str, name: str, result_q: Any, ctrl_q: Any, args: tuple[Any, ...]) -> None:
    try:
        globals()[fn_name](name, result_q, ctrl_q, *args)
    except BaseException:
        result_q.put(("error", name, f"{name} (pid {os.getpid()}): {traceback.format_exc()}"))
        sys.exit(1)


def _setup_child(threads: int, debug: bool) -> None:
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                        format="%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s")


# ---------------------------------------------------------------------------- rl_sync subscriber process
def _instrument_subscriber(rec: dict[str, list[tuple[float, float]]]) -> list[str]:
    """Timestamp every bucket pull and every commit step: ``_apply`` (staged: the copy from staging
    into the live tensors) and ``_repoint`` (swap: ``set_`` of the live tensors, sync, on the loop).
    Wraps private methods (of the subscriber and of its commit modes, rl_sync.modes); returns the names
    wrapped (those that moved are left alone)."""
    from rl_sync import modes as modes_mod
    from rl_sync import subscriber as sub_mod

    cls = sub_mod.WeightSubscriber
    done: list[str] = []
    pull = getattr(cls, "_pull", None)
    if inspect.iscoroutinefunction(pull):
        async def timed_pull(self: Any, *a: Any, **k: Any) -> Any:
            t0 = time.monotonic()
            try:
                return await pull(self, *a, **k)
            finally:
                rec["pulls"].append((t0, time.monotonic()))

        cls._pull = timed_pull  # type: ignore[method-assign]
        done.append("_pull")

    def wrap_commit(attr: str, owner: Any = cls) -> None:
        fn = getattr(owner, attr, None)
        if not callable(fn) or inspect.iscoroutinefunction(fn):
            return

        def timed(self: Any, *a: Any, **k: Any) -> Any:
            t0 = time.monotonic()
            try:
                return fn(self, *a, **k)
            finally:
                rec["commits"].append((t0, time.monotonic()))

        setattr(owner, attr, timed)
        done.append(attr)

    wrap_commit("_apply", getattr(modes_mod, "StagedMode", None))
    wrap_commit("_repoint")
    wrap_commit("_commit_direct", getattr(modes_mod, "DirectMode", None))
    return done


def rl_subscriber(name: str, result_q: Any, ctrl_q: Any, store_url: str, shapes: list[tuple[str, tuple[int, ...]]],
                  mode: str, threads: int, debug: bool) -> None:
    _setup_child(threads, debug)
    asyncio.run(_rl_subscriber(name, result_q, ctrl_q, store_url, shapes, mode))


async def _rl_subscriber(name: str, result_q: Any, ctrl_q: Any, store_url: str,
                         shapes: list[tuple[str, tuple[int, ...]]], mode: str) -> None:
    import rl_sync
    import transport

    rec: dict[str, list[tuple[float, float]]] = {"pulls": [], "commits": []}
    instrumented = _instrument_subscriber(rec)
    state = receiver_state(shapes, torch.bfloat16)
    cpu0, ru0 = time.process_time(), _rusage()
    async with transport.Endpoint(name, store=store_url, timeout=OP_TIMEOUT) as ep:
        sub = rl_sync.WeightSubscriber(ep, state, mode=mode)
        result_q.put(("ready", name, {"pid": os.getpid(), "mode": sub.mode, "nbytes": sub.nbytes,
                                      "arenas": len(sub.manifest.arenas), "instrumented": instrumented}))
        try:
            while True:
                cmd = await asyncio.to_thread(ctrl_q.get, True, CMD_TIMEOUT)
                op = cmd[0]
                if op == "mark":
                    rec["pulls"].clear()
                    rec["commits"].clear()
                    cpu0, ru0 = time.process_time(), _rusage()
                    result_q.put(("mark", name, None))
                elif op == "stats":
                    result_q.put(("stats", name, {"cpu_s": time.process_time() - cpu0,
                                                  "rusage": _rusage_delta(ru0, _rusage()),
                                                  "pulls": list(rec["pulls"]),
                                                  "commits": list(rec["commits"])}))
                elif op == "digest":
                    async with sub.hold() as version:
                        d = await asyncio.to_thread(digest, state.values())
                    peer = ep.peers.get(TRAINER)
                    result_q.put(("digest", name, {"version": version, "digest": d,
                                                   "plane": peer.plane if peer is not None else None}))
                elif op == "quit":
                    break
                else:
                    raise RuntimeError(f"unknown command {cmd!r}")
        finally:
            sub.close()
    result_q.put(("bye", name, None))


# ---------------------------------------------------------------------------- rl_sync trainer (this process)
class PackTimer:
    """Wraps ``rl_sync.push_run._pack`` to timestamp every bucket packed (this process only)."""

    _instance: PackTimer | None = None

    @classmethod
    def install(cls) -> PackTimer:
        """One timer per process (each round reuses it instead of wrapping the wrapper)."""
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self) -> None:
        self.records: list[tuple[float, float, int]] = []
        self.ok = False
        from rl_sync import push_run as run_mod

        orig = getattr(run_mod, "_pack", None)
        if not callable(orig):
            return

        def timed_pack(bucket: Any, *a: Any, **k: Any) -> Any:
            t0 = time.monotonic()
            try:
                return orig(bucket, *a, **k)
            finally:
                self.records.append((t0, time.monotonic(), int(getattr(bucket, "nbytes", 0))))

        run_mod._pack = timed_pack
        self.ok = True


async def run_rl_sync(cfg: dict[str, Any], state: dict[str, torch.Tensor], errors: list[dict[str, Any]],
                      killed: list[str], rnd: int = 0) -> list[dict[str, Any]]:
    """Every (mode, subscriber count, bucket size) case; returns one result per case. Subscribers are
    spawned per mode and count; the order of the modes is rotated by ``rnd`` (the round)."""
    import rl_sync
    import transport

    pack_timer = PackTimer.install()
    results: list[dict[str, Any]] = []
    version = 0
    k = rnd % len(cfg["modes"])
    modes = cfg["modes"][k:] + cfg["modes"][:k]
    async with transport.Endpoint(TRAINER, store="tcp://127.0.0.1:0", host_store=True, timeout=OP_TIMEOUT) as ep:
        for mode in modes:
            for n in cfg["subscribers"]:
                kids = Children(f"rl-{mode}-{n}")
                names = [f"bench-rl-gen-{mode}-n{n}-{i}" for i in range(n)]
                ok = False
                try:
                    t_spawn = time.monotonic()
                    for name in names:
                        kids.start(name, rl_subscriber,
                                   (ep.store_url, cfg["shapes"], mode, cfg["threads"], cfg["debug"]), ctrl=True)
                    ready = await kids.aexpect("ready", names, STARTUP_TIMEOUT)
                    print(f"    {n} {mode} subscriber(s) ready in {time.monotonic() - t_spawn:.1f} s", flush=True)
                    for bucket in cfg["buckets"]:
                        label = f"rl_sync {mode} N={n} bucket={bucket // MiB} MiB"
                        try:
                            res, version = await _rl_case(cfg, ep, kids, names, state, mode, bucket, version,
                                                          pack_timer)
                            res["subscriber_info"] = ready
                            results.append(res)
                            print(f"    {label}: median {res['median_s']:.3f} s, best {res['best_s']:.3f} s, "
                                  f"verified={res['verified']}", flush=True)
                        except (PhaseError, rl_sync.RlSyncError, transport.TransportError, TimeoutError) as exc:
                            errors.append({"case": label, "error": f"{type(exc).__name__}: {exc}"})
                            print(f"  !! {label} failed: {str(exc).strip().splitlines()[-1]}", flush=True)
                            results.append({"method": "rl_sync", "mode": mode, "subscribers": n,
                                            "bucket_bytes": bucket, "error": str(exc)})
                            if isinstance(exc, PhaseError):  # a subscriber is gone: the next bucket size cannot run
                                break
                    kids.send(names, "quit")
                    with contextlib.suppress(PhaseError):
                        await kids.aexpect("bye", names, 30.0)
                    ok = True
                except PhaseError as exc:
                    errors.append({"case": f"rl_sync {mode} N={n}", "error": str(exc)})
                    print(f"  !! rl_sync {mode} N={n} failed: {str(exc).strip().splitlines()[-1]}", flush=True)
                finally:
                    await asyncio.to_thread(kids.reap, 15.0 if ok else 2.0)
                    killed += kids.killed
    return results


async def _rl_case(cfg: dict[str, Any], ep: Any, kids: Children, names: list[str], state: dict[str, torch.Tensor],
                   mode: str, bucket: int, version: int, pack_timer: PackTimer) -> tuple[dict[str, Any], int]:
    import rl_sync

    pub = rl_sync.WeightPublisher(ep, names, dtype=torch.bfloat16, bucket_bytes=bucket)
    pushes: list[dict[str, Any]] = []
    warmup = cfg["warmup"] * BANKS.get(mode, 1)  # every arena bank written once before timing
    try:
        for i in range(warmup + cfg["reps"]):
            for t in state.values():  # every byte of the new version differs from the last one
                t.neg_()
            version += 1
            kids.send(names, "mark")
            await kids.aexpect("mark", names, CMD_TIMEOUT)
            pack_timer.records.clear()
            host0, cpu0, ru0 = _cpu_sample(), time.process_time(), _rusage()
            t0m = time.monotonic()
            t0 = time.perf_counter()
            report = await pub.push(state, version, timeout=PUSH_TIMEOUT)
            wall = time.perf_counter() - t0
            t1m = time.monotonic()
            cpu, host1, ru = time.process_time() - cpu0, _cpu_sample(), _rusage_delta(ru0, _rusage())
            if not report.ok:
                raise PhaseError(f"push of version {version} failed: {report.summary()}")
            kids.send(names, "stats")
            stats = await kids.aexpect("stats", names, CMD_TIMEOUT)
            pushes.append({
                "warmup": i < warmup,
                "version": version,
                "seconds": wall,
                "report_seconds": report.seconds,
                "report_gbps": report.gbps,
                "report_bytes": report.bytes,
                "packed_bytes": report.packed_bytes,
                "per_subscriber_s": {n: r.seconds for n, r in report.results.items()},
                "trainer_cpu_s": cpu,
                "trainer_rusage": ru,
                "host_cpu": _host_busy(host0, host1),
                "breakdown": _breakdown(t0m, t1m, pack_timer.records if pack_timer.ok else None, stats, mode),
            })
        expected = await asyncio.to_thread(cast_digest, state, torch.bfloat16)
        kids.send(names, "digest")
        got = await kids.aexpect("digest", names, CMD_TIMEOUT)
    finally:
        pub.close()
    verified = all(g["digest"] == expected and g["version"] == version for g in got.values())
    timed = [p for p in pushes if not p["warmup"]]
    times = [p["seconds"] for p in timed]
    res = {
        "method": "rl_sync",
        "mode": mode,
        "subscribers": len(names),
        "bucket_bytes": bucket,
        "times_s": times,
        "median_s": _median(times),
        "best_s": min(times),
        "report_gbps_median": _median([p["report_gbps"] for p in timed]),
        "warmup_s": [p["seconds"] for p in pushes if p["warmup"]],
        "verified": verified,
        "planes": sorted({str(g["plane"]) for g in got.values()}),
        "digests_match": {n: g["digest"] == expected for n, g in got.items()},
        "pushes": pushes,
    }
    return res, version


def _breakdown(t0: float, t1: float, packs: list[tuple[float, float, int]] | None,
               stats: dict[str, Any], mode: str) -> dict[str, Any]:
    """Seconds from the push's start (monotonic clock, shared by the processes of one host).
    ``commit_*``: the subscriber's commit step, ``_apply`` (staged: a copy) or ``_repoint`` (swap)."""
    out: dict[str, Any] = {"wall_s": t1 - t0, "commit_step": COMMIT_STEP.get(mode, "_apply")}
    if packs:
        out["pack_sum_s"] = sum(b - a for a, b, _ in packs)
        out["pack_first_start_s"] = min(a for a, _, _ in packs) - t0
        out["pack_last_end_s"] = max(b for _, b, _ in packs) - t0
        out["buckets_packed"] = len(packs)
    pulls = [s["pulls"] for s in stats.values()]
    commits = [s["commits"] for s in stats.values()]
    if all(pulls):
        out["pull_sum_s_per_sub"] = statistics.fmean(sum(b - a for a, b in p) for p in pulls)
        out["pulls_last_end_s"] = max(b for p in pulls for _, b in p) - t0
        out["pulls_first_start_s"] = min(a for p in pulls for a, _ in p) - t0
    if all(commits):
        out["commit_s_per_sub"] = statistics.fmean(sum(b - a for a, b in c) for c in commits)
        out["commit_first_start_s"] = min(a for c in commits for a, _ in c) - t0
        out["commit_last_end_s"] = max(b for c in commits for _, b in c) - t0
    out["subscribers_cpu_s"] = sum(s["cpu_s"] for s in stats.values())
    for k in ("user_s", "sys_s", "minflt"):
        out[f"subscribers_{k}"] = sum(s["rusage"][k] for s in stats.values())
    return out


# ---------------------------------------------------------------------------- Gloo broadcast per tensor
def gloo_receiver(name: str, result_q: Any, ctrl_q: Any, rank: int, world: int, port: int,
                  shapes: list[tuple[str, tuple[int, ...]]], rounds: int, threads: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    _setup_child(threads, False)
    tensors = receiver_state(shapes, torch.bfloat16)
    result_q.put(("started", name, os.getpid()))
    tmo = timedelta(seconds=GLOO_TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=tmo)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=tmo)
    cpus = []
    try:
        for _ in range(rounds):
            dist.barrier()
            cpu0 = time.process_time()
            for t in tensors.values():
                dist.broadcast(t, src=0)
            dist.barrier()
            cpus.append(time.process_time() - cpu0)
        result_q.put(("digest", name, {"digest": digest(tensors.values()), "cpu_s": cpus}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(cfg: dict[str, Any], state: dict[str, torch.Tensor], n: int,
             killed: list[str]) -> dict[str, Any]:
    from datetime import timedelta

    import torch.distributed as dist

    tmo = timedelta(seconds=GLOO_TIMEOUT)
    world = n + 1
    rounds = cfg["warmup"] + cfg["reps"]
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=tmo, wait_for_workers=False)
    kids = Children(f"gloo{n}")
    names = [f"gloo-rank{r}" for r in range(1, world)]
    ok = False
    try:
        for r, name in enumerate(names, start=1):
            kids.start(name, gloo_receiver, (r, world, store.port, cfg["shapes"], rounds, cfg["threads"]))
        kids.expect("started", names, STARTUP_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=0, world_size=world, timeout=tmo)
        try:
            times, host_cpu, cpus = [], [], []
            for _ in range(rounds):
                for t in state.values():  # every byte differs from the last broadcast's
                    t.neg_()
                dist.barrier()
                host0, cpu0 = _cpu_sample(), time.process_time()
                t0 = time.perf_counter()
                for t in state.values():
                    dist.broadcast(t.to(torch.bfloat16), src=0)
                dist.barrier()
                times.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - cpu0)
                host_cpu.append(_host_busy(host0, _cpu_sample()))
            expected = cast_digest(state, torch.bfloat16)
            got = kids.expect("digest", names, GLOO_TIMEOUT)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        ok = True
    finally:
        kids.reap(15.0 if ok else 2.0)
        killed += kids.killed
        del store
    w = cfg["warmup"]
    timed = times[w:]
    return {
        "method": "gloo broadcast/tensor",
        "mode": None,
        "subscribers": n,
        "bucket_bytes": None,
        "times_s": timed,
        "median_s": _median(timed),
        "best_s": min(timed),
        "warmup_s": times[:w],
        "trainer_cpu_s": cpus[w:],
        "receivers_cpu_s": [sum(g["cpu_s"][i] for g in got.values()) for i in range(w, rounds)],
        "host_cpu": host_cpu[w:],
        "verified": all(g["digest"] == expected for g in got.values()),
        "digests_match": {k: g["digest"] == expected for k, g in got.items()},
    }


# ---------------------------------------------------------------------------- limits (this process, one thread)
def measure_limits(state: dict[str, torch.Tensor], bf16_bytes: int, warmup: int, reps: int, cores: int,
                   killed: list[str]) -> dict[str, Any]:
    out = _one_core_limits(state, bf16_bytes, warmup, reps)  # its buffers are freed on return
    if cores > 1:
        try:
            out["copy_bf16_parallel"] = parallel_copy(bf16_bytes, cores, warmup, reps, killed)
        except PhaseError as exc:
            out["copy_bf16_parallel"] = {"error": str(exc)}
    return out


def _one_core_limits(state: dict[str, torch.Tensor], bf16_bytes: int, warmup: int, reps: int) -> dict[str, Any]:
    flat = torch.empty(bf16_bytes, dtype=torch.uint8)
    src = torch.ones(bf16_bytes, dtype=torch.uint8)
    offs, at = [], 0
    for t in state.values():
        offs.append(at)
        at += t.numel() * 2

    def cast() -> None:  # what _pack does, for the whole state dict: per tensor, into one flat buffer
        for o, t in zip(offs, state.values(), strict=True):
            flat[o:o + t.numel() * 2].view(torch.bfloat16).copy_(t.reshape(-1))

    def memcpy() -> None:
        flat.copy_(src)

    out: dict[str, Any] = {}
    for name, fn in (("cast_f32_to_bf16", cast), ("copy_bf16", memcpy)):
        times = []
        for i in range(warmup + reps):
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out[name] = {"times_s": times, "median_s": _median(times), "best_s": min(times),
                     "gbps": bf16_bytes / _median(times) / GB}
    return out


def copy_worker(name: str, result_q: Any, ctrl_q: Any, nbytes: int, rounds: int, barrier: Any, threads: int) -> None:
    _setup_child(threads, False)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    spans = []
    for _ in range(rounds):
        barrier.wait(STARTUP_TIMEOUT)
        t0 = time.monotonic()
        dst.copy_(src)
        spans.append((t0, time.monotonic()))
    result_q.put(("spans", name, spans))


def parallel_copy(nbytes: int, procs: int, warmup: int, reps: int, killed: list[str]) -> dict[str, Any]:
    """``procs`` processes each ``copy_`` their own ``nbytes`` at the same moment: the host's
    aggregate memcpy rate (on a VM whose memory bandwidth one core saturates, no faster than one)."""
    kids = Children("copy")
    names = [f"copy{i}" for i in range(procs)]
    barrier = CTX.Barrier(procs)
    ok = False
    try:
        for name in names:
            kids.start(name, copy_worker, (nbytes, warmup + reps, barrier, 1))
        got = kids.expect("spans", names, STARTUP_TIMEOUT)
        ok = True
    finally:
        kids.reap(10.0 if ok else 2.0)
        killed += kids.killed
    times = []
    for i in range(warmup, warmup + reps):
        spans = [got[n][i] for n in names]
        times.append(max(b for _, b in spans) - min(a for a, _ in spans))
    return {"processes": procs, "times_s": times, "median_s": _median(times), "best_s": min(times),
            "gbps": procs * nbytes / _median(times) / GB}


# ---------------------------------------------------------------------------- analysis and report
def _mode_rank(mode: str | None) -> int:
    return MODES.index(mode) if mode in MODES else len(MODES)


def _case_order(c: dict[str, Any]) -> tuple[Any, ...]:
    return (c["method"] != "rl_sync", _mode_rank(c.get("mode")), c["subscribers"], -(c["bucket_bytes"] or 0))


def merge_cases(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pool the repetitions of every round per (method, mode, subscribers, bucket) and recompute the medians."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for c in raw:
        key = (c["method"], c.get("mode"), c["subscribers"], c["bucket_bytes"])
        acc = out.get(key)
        if "times_s" not in c:  # a failed round: shown only if no round of this case succeeded
            if acc is None:
                out[key] = dict(c)
            continue
        if acc is None or "times_s" not in acc:
            out[key] = {**c, "rounds": 1}
            continue
        for f in ("times_s", "warmup_s", "pushes", "trainer_cpu_s", "receivers_cpu_s", "host_cpu"):
            if f in c:
                acc[f] = acc.get(f, []) + c[f]
        acc["verified"] = acc["verified"] and c["verified"]
        acc["digests_match"] = {n: acc["digests_match"].get(n, True) and ok for n, ok in c["digests_match"].items()}
        if "planes" in c:
            acc["planes"] = sorted(set(acc.get("planes", [])) | set(c["planes"]))
        acc["rounds"] += 1
    for c in out.values():
        if "times_s" in c:
            c["median_s"], c["best_s"] = _median(c["times_s"]), min(c["times_s"])
            if "pushes" in c:
                c["report_gbps_median"] = _median([p["report_gbps"] for p in c["pushes"] if not p["warmup"]])
    return sorted(out.values(), key=_case_order)


def merge_limits(raw: list[dict[str, Any]], nbytes: int) -> dict[str, Any] | None:
    if not raw:
        return None
    out: dict[str, Any] = {}
    for key in ("cast_f32_to_bf16", "copy_bf16", "copy_bf16_parallel"):
        runs = [r[key] for r in raw if key in r and "times_s" in r[key]]
        if not runs:
            continue
        times = [t for r in runs for t in r["times_s"]]
        procs = runs[0].get("processes", 1)
        out[key] = {"times_s": times, "median_s": _median(times), "best_s": min(times),
                    "gbps": procs * nbytes / _median(times) / GB}
        if key == "copy_bf16_parallel":
            out[key]["processes"] = procs
    return out if "cast_f32_to_bf16" in out and "copy_bf16" in out else None


def build_rows(cfg: dict[str, Any], cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    nb = cfg["bf16_bytes"]
    gloo = {c["subscribers"]: c for c in cases if c["method"].startswith("gloo") and "median_s" in c}
    rows = []
    for c in cases:
        if "median_s" not in c:
            rows.append({"method": c["method"], "mode": c.get("mode"), "subscribers": c["subscribers"],
                         "bucket_bytes": c["bucket_bytes"], "error": c.get("error")})
            continue
        n, med = c["subscribers"], c["median_s"]
        row = {
            "method": c["method"],
            "mode": c.get("mode"),  # rl_sync: the subscribers' mode; None for the baselines
            "subscribers": n,
            "bucket_bytes": c["bucket_bytes"],
            "reps": len(c["times_s"]),
            "median_s": med,
            "best_s": c["best_s"],
            "gbps_per_subscriber": nb / med / GB,
            "gbps_total": n * nb / med / GB,
            "verified": c["verified"],
        }
        if "report_gbps_median" in c:
            row["report_gbps"] = c["report_gbps_median"]
        g = gloo.get(n)
        if g is not None and c is not g:
            row["speedup_vs_gloo"] = g["median_s"] / med
            row["speedup_vs_gloo_best"] = g["best_s"] / c["best_s"]
        rows.append(row)
    return rows


def _row(rows: list[dict[str, Any]], method: str, mode: str | None, n: int, bucket: int | None) -> dict[str, Any] | None:
    return next((r for r in rows if r["method"] == method and r.get("mode") == mode and r["subscribers"] == n
                 and r["bucket_bytes"] == bucket and "median_s" in r), None)


def fanout_ratios(cfg: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """t(most subscribers) / t(fewest), per method, mode and bucket size."""
    subs = cfg["subscribers"]
    lo, hi = min(subs), max(subs)
    out: list[dict[str, Any]] = []
    if lo == hi:
        return out
    keys = sorted({(r["method"], r.get("mode"), r["bucket_bytes"]) for r in rows if "median_s" in r},
                  key=lambda k: (k[0] != "rl_sync", _mode_rank(k[1]), -(k[2] or 0)))
    for method, mode, bucket in keys:
        a, b = _row(rows, method, mode, lo, bucket), _row(rows, method, mode, hi, bucket)
        if a is not None and b is not None:
            out.append({"method": method, "mode": mode, "bucket_bytes": bucket, "n_low": lo, "n_high": hi,
                        "ratio": b["median_s"] / a["median_s"]})
    return out


# per mode: passes over the bfloat16 bytes per subscriber (k), passes that must follow the cast (tail)
FLOOR_PASSES = {"staged": (2, 1), "swap": (1, 0), "direct": (1, 0), "shared": (0, 0)}
FLOOR_TEXT = {"staged": ("C + 2 N M", "max(C + M, work / min(S, N + 1))"),
              "swap": ("C + N M", "max(C, work / min(S, N + 1))"),
              "direct": ("C + N M", "max(C, work / min(S, N + 1))"),
              "shared": ("C", "C (subscribers copy nothing: they map the bank)")}


def floor_model(cfg: dict[str, Any], limits: dict[str, Any], cores: int,
                rows: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The least a push can take here when moving bytes through memory is all that costs, per mode.

    One-core rates: C = the cast of the state dict (``_pack``), M = one copy_ of the bfloat16
    bytes. A staged push does C once plus 2 M per subscriber (pull into staging, commit copy into
    the live weights): work C + 2 N M; a swap push C once plus 1 M per subscriber (the pull into
    the spare bank; the commit re-points, no copy): work C + N M. Those passes can overlap at best
    by the measured parallel-copy speedup S (aggregate rate of ``cores`` simultaneous copies / one
    copy; 1.0 when one core already saturates memory bandwidth), and what must follow the cast
    cannot overlap it (staged: the commit copy of the last bytes; swap: nothing but one bucket's
    pull): floor = max(C + M, work / min(S, N + 1)) staged, max(C, work / min(S, N + 1)) swap.

    ``rows`` adds, per mode and N, the measured median at the first (target) bucket size and its
    ratio to the floor; ``fanout_floor_ratio`` = floor(N max) / floor(N min), the fan-out that a
    push running at its floor would show."""
    cast = limits["cast_f32_to_bf16"]["median_s"]
    copy = limits["copy_bf16"]["median_s"]
    par = limits.get("copy_bf16_parallel") or {}
    speedup = speedup_best = 1.0
    if "gbps" in par:
        speedup = min(float(cores), max(1.0, par["gbps"] / limits["copy_bf16"]["gbps"]))
        # the most favourable repetition: S varies a lot on a shared VM (the floor uses the median)
        speedup_best = min(float(cores), max(speedup, par["processes"] * limits["copy_bf16"]["best_s"] / par["best_s"]))
    bucket = cfg["buckets"][0]
    out: dict[str, Any] = {"cast_s": cast, "copy_s": copy, "cores": cores, "parallel_speedup": speedup,
                           "parallel_speedup_best": speedup_best, "measured_bucket_bytes": bucket, "modes": {}}

    def floor_at(k: int, tail: int, n: int, s: float) -> tuple[float, float, bool]:
        work = cast + k * n * copy
        path, shared = cast + tail * copy, work / min(s, n + 1)
        return work, max(path, shared), shared >= path

    lo, hi = str(min(cfg["subscribers"])), str(max(cfg["subscribers"]))
    for mode in cfg["modes"]:
        k, tail = FLOOR_PASSES[mode]
        mo: dict[str, Any] = {"work": FLOOR_TEXT[mode][0], "floor": FLOOR_TEXT[mode][1], "per_n": {}}
        for n in cfg["subscribers"]:
            work, floor, by_bandwidth = floor_at(k, tail, n, speedup)
            v: dict[str, Any] = {"work_s": work, "floor_s": floor,
                                 "bound_by": "bandwidth" if by_bandwidth else "critical path"}
            r = _row(rows or [], "rl_sync", mode, n, bucket)
            if r is not None:
                v["measured_s"] = r["median_s"]
                v["measured_over_floor"] = r["median_s"] / floor
            mo["per_n"][str(n)] = v
        mo["fanout_floor_ratio"] = mo["per_n"][hi]["floor_s"] / mo["per_n"][lo]["floor_s"]
        mo["fanout_floor_ratio_best_s"] = (floor_at(k, tail, int(hi), speedup_best)[1]
                                           / floor_at(k, tail, int(lo), speedup_best)[1])
        if "measured_s" in mo["per_n"][hi] and "measured_s" in mo["per_n"][lo]:
            mo["fanout_measured_ratio"] = mo["per_n"][hi]["measured_s"] / mo["per_n"][lo]["measured_s"]
        out["modes"][mode] = mo
    return out


FANOUT_GOAL = 1.6
GLOO_GOAL = 3.0


def evaluate_targets(cfg: dict[str, Any], rows: list[dict[str, Any]], fan: list[dict[str, Any]],
                     model: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per mode: >= 3x per-tensor Gloo broadcast at every N, and fan-out t(max N)/t(min N) <= 1.6x,
    all at the first bucket size."""
    out = []
    default_bucket = cfg["buckets"][0]
    gloo = {r["subscribers"]: r for r in rows if r["method"].startswith("gloo") and "median_s" in r}

    def add(name: str, mode: str, value: float | None, goal: float, higher: bool, detail: str) -> None:
        base = {"target": name, "mode": mode, "goal": goal}
        if value is None or math.isnan(value):
            out.append({**base, "status": "N/A", "value": None, "detail": detail})
            return
        ok = value >= goal if higher else value <= goal
        out.append({**base, "status": "PASS" if ok else "MISS", "value": value, "detail": detail})

    lo, hi = min(cfg["subscribers"]), max(cfg["subscribers"])
    for mode in cfg["modes"]:
        for n in cfg["subscribers"]:
            r = _row(rows, "rl_sync", mode, n, default_bucket)
            g = gloo.get(n)
            detail = (f"{r['median_s']:.3f} s vs gloo {g['median_s']:.3f} s" if r and g else
                      f"{r['median_s']:.3f} s, gloo not measured" if r else "not measured")
            add(f"rl_sync {mode} >= {GLOO_GOAL:g}x per-tensor Gloo broadcast, N={n}", mode,
                r.get("speedup_vs_gloo") if r else None, GLOO_GOAL, True, detail)
        f = next((f for f in fan if f["method"] == "rl_sync" and f["mode"] == mode
                  and f["bucket_bytes"] == default_bucket), None)
        detail = f"bucket {default_bucket // MiB} MiB" if f else "needs two subscriber counts"
        mo = (model or {}).get("modes", {}).get(mode)
        if f and mo:
            fl = mo["fanout_floor_ratio"]
            detail += (f"; {fl:.2f}x at the memory-traffic floor: "
                       + ("out of reach on this host" if fl > FANOUT_GOAL else "within reach on this host"))
        add(f"rl_sync {mode} fan-out t({hi})/t({lo}) <= {FANOUT_GOAL:g}x", mode, f["ratio"] if f else None,
            FANOUT_GOAL, False, detail)
    return out


def format_report(cfg: dict[str, Any], env: dict[str, Any], limits: dict[str, Any] | None, rows: list[dict[str, Any]],
                  fan: list[dict[str, Any]], model: dict[str, Any] | None, cases: list[dict[str, Any]],
                  targets: list[dict[str, Any]], errors: list[dict[str, Any]]) -> str:
    m = cfg["model"]
    lines = [
        f"rl_sync benchmark ({cfg['mode']}), torch {env['torch']}, python {env['python']}, "
        f"{env['cpu_count']} CPUs ({env['usable_cpus']} usable), {env['date']}",
    ]
    idle = env.get("cpu_idle_before_start")
    if idle is not None:
        la0, la1 = env.get("loadavg_start") or [float("nan")], env.get("loadavg_end") or [float("nan")]
        busy = " -- other processes were using the CPUs: expect noisy numbers" if idle < 0.9 else ""
        lines.append(f"CPU idle in the second before the run: {idle:.0%}; 1-min load average at start "
                     f"{la0[0]:.2f}, at end {la1[0]:.2f}{busy}")
    lines.append(f"model: {cfg['params'] / 1e6:.1f}M params in {cfg['tensors']} tensors (d_model {m['d_model']}, "
                 f"{m['layers']} layers, ffn {m['ffn']}, vocab {m['vocab']}, ctx {m['ctx']}, lm_head tied); "
                 f"trainer float32 {_fmt_bytes(cfg['f32_bytes'])}, generators bfloat16 {_fmt_bytes(cfg['bf16_bytes'])}")
    lines.append(f"torch.set_num_threads({cfg['threads']}) in every process; per case {cfg['warmup']} warm-up push(es) "
                 f"per arena bank + {cfg['reps']} timed repetition(s) in each of {cfg['rounds']} round(s) (phases "
                 "rotated, repetitions pooled); seconds = median, until every subscriber committed / holds every tensor")
    lines.append("mode = WeightSubscriber mode: staged (pull into a staging arena, commit = copy into the live "
                 "tensors), swap (pull into the spare bank, commit = re-point the live tensors with set_, no copy), "
                 "direct (pull into the live tensors while readers wait, commit = bump the version)")
    lines.append("GB/s = bfloat16 bytes (1e9/s) delivered per subscriber, and to all subscribers together; "
                 "vs gloo = gloo's median / this median, (best) = gloo's best / this best")
    lines.append("")
    hdr = (f"{'method':<24} {'mode':<6} {'subs':>4} {'bucket':>8} {'median s':>9} {'best s':>8} {'GB/s/sub':>9} "
           f"{'GB/s tot':>9} {'vs gloo':>8} {'(best)':>7}  ok")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    if limits:
        for key, label in (("copy_bf16", "limit: copy_ bf16"), ("cast_f32_to_bf16", "limit: cast f32->bf16")):
            x = limits[key]
            lines.append(f"{label:<24} {'-':<6} {'-':>4} {'-':>8} {x['median_s']:9.3f} {x['best_s']:8.3f} "
                         f"{x['gbps']:9.2f} {'-':>9} {'':>8}")
        x = limits.get("copy_bf16_parallel") or {}
        if "gbps" in x:
            label = f"limit: copy_ bf16 x{x['processes']}"
            lines.append(f"{label:<24} {'-':<6} {'-':>4} {'-':>8} {x['median_s']:9.3f} {x['best_s']:8.3f} "
                         f"{x['gbps'] / x['processes']:9.2f} {x['gbps']:9.2f} {'':>8}  ({x['processes']} processes at once)")
    for r in rows:
        bucket = f"{r['bucket_bytes'] // MiB} MiB" if r["bucket_bytes"] else "-"
        mode = r.get("mode") or "-"
        if "median_s" not in r:
            lines.append(f"{r['method']:<24} {mode:<6} {r['subscribers']:>4} {bucket:>8}  ERROR: "
                         f"{str(r.get('error', '')).strip().splitlines()[-1][:80]}")
            continue
        sp = f"{r['speedup_vs_gloo']:.2f}x" if "speedup_vs_gloo" in r else ""
        spb = f"{r['speedup_vs_gloo_best']:.2f}x" if "speedup_vs_gloo_best" in r else ""
        ok = "yes" if r["verified"] else "!! DATA MISMATCH"
        lines.append(f"{r['method']:<24} {mode:<6} {r['subscribers']:>4} {bucket:>8} {r['median_s']:9.3f} "
                     f"{r['best_s']:8.3f} {r['gbps_per_subscriber']:9.2f} {r['gbps_total']:9.2f} {sp:>8} {spb:>7}  {ok}")
    modes_fl = (model or {}).get("modes", {})
    if fan:
        lines.append("")
        lines.append("fan-out (median time with the most subscribers / with the fewest; 'at the floor' = the same "
                     "ratio of the memory-traffic floors below):")
        for f in fan:
            b = f" bucket {f['bucket_bytes'] // MiB} MiB" if f["bucket_bytes"] else ""
            name = f"{f['method']} {f['mode']}" if f.get("mode") else f["method"]
            fl = modes_fl.get(f.get("mode"))
            at = f" (at the floor {fl['fanout_floor_ratio']:.2f}x)" if fl else ""
            lines.append(f"  {name}{b}: t({f['n_high']})/t({f['n_low']}) = {f['ratio']:.2f}x{at}")
    if model:
        s = model["parallel_speedup"]
        lines.append("")
        sb = model.get("parallel_speedup_best", s)
        lines.append(f"memory-traffic floor: C = cast {model['cast_s']:.3f} s, M = copy_ {model['copy_s']:.3f} s (one "
                     f"core); {model['cores']} processes copying at once run S = {s:.2f}x one (median; {sb:.2f}x in "
                     "the best repetition)")
        lines.append("  staged: work = C + 2 N M (pack; per subscriber: pull into staging + commit copy), "
                     "floor = max(C + M, work / min(S, N + 1))")
        lines.append("  swap:   work = C + N M (pack; per subscriber: pull into the spare bank; commit re-points), "
                     "floor = max(C, work / min(S, N + 1))")
        lines.append("  direct: work = C + N M (pack; per subscriber: pull into the live tensors; commit bumps the "
                     "version), floor = max(C, work / min(S, N + 1))")
        lines.append("  shared: work = C (pack into a bank; per subscriber: commit re-points into it, no copy), "
                     "floor = C")
        bkt = model["measured_bucket_bytes"] // MiB
        lines.append(f"  {'mode':<6} {'subs':>4} {'work s':>7} {'floor s':>8} {'floor set by':>13} {'measured s':>11} "
                     f"{'/ floor':>8}   (measured = median at bucket {bkt} MiB)")
        for mode, mo in model["modes"].items():
            for n, v in mo["per_n"].items():
                meas = f"{v['measured_s']:.3f}" if "measured_s" in v else "n/a"
                ratio = f"{v['measured_over_floor']:.2f}x" if "measured_over_floor" in v else "n/a"
                lines.append(f"  {mode:<6} {n:>4} {v['work_s']:7.3f} {v['floor_s']:8.3f} {v['bound_by']:>13} "
                             f"{meas:>11} {ratio:>8}")
        if len(cfg["subscribers"]) > 1:
            lo, hi = min(cfg["subscribers"]), max(cfg["subscribers"])
            parts = []
            for mode, mo in model["modes"].items():
                fl = mo["fanout_floor_ratio"]
                verdict = "out of reach" if fl > FANOUT_GOAL else "within reach"
                parts.append(f"{mode} {fl:.2f}x ({verdict})")
            lines.append(f"  fan-out t({hi})/t({lo}) of a push at its floor: {'; '.join(parts)}; target <= "
                         f"{FANOUT_GOAL:g}x")
            if sb > s:
                best = ", ".join(f"{mode} {mo['fanout_floor_ratio_best_s']:.2f}x" for mode, mo in model["modes"].items())
                lines.append(f"  with the best repetition's S = {sb:.2f} instead: {best}")
            if s < 2 and all(v["bound_by"] == "bandwidth" for mo in model["modes"].values()
                             for v in mo["per_n"].values()):
                lines.append("  (S < 2: a second core adds little memory bandwidth, so every floor is work / S and "
                             "their ratio, (C + k N M) / (C + k M) with k = 2 staged, 1 swap, does not depend on S: the "
                             "subscribers' passes over memory queue for the same bandwidth instead of overlapping)")
        below = [f"{mode} N={n}" for mode, mo in model["modes"].items() for n, v in mo["per_n"].items()
                 if v.get("measured_over_floor", 1.0) < 1.0]
        if below:
            lines.append(f"  {', '.join(below)} ran below the floor: during those pushes the cores got more memory "
                         f"bandwidth than the median S = {s:.2f} assumes (S varies between repetitions here); the "
                         "floor is an estimate from the limits of this run, not a strict bound")
    bd = [c for c in cases if c["method"] == "rl_sync" and c.get("pushes")]
    if bd:
        lines.append("")
        lines.append("rl_sync breakdown (the median timed push; seconds from the push's start; *_sum = busy time; "
                     "commit = _apply (staged: the copy), _repoint (swap, shared: set_ of every tensor) or _commit_direct, "
                     "per subscriber):")
        h2 = (f"  {'mode':<6} {'subs':>4} {'bucket':>7} {'wall':>6} {'1st pack':>8} {'pack_sum':>8} {'packs end':>9} "
              f"{'pull_sum/sub':>12} {'pulls end':>9} {'commit/sub':>10} {'commits end':>11}")
        lines.append(h2)
        medians = []
        for c in bd:
            timed = sorted((p for p in c["pushes"] if not p["warmup"]), key=lambda p: p["seconds"])
            if not timed:
                continue
            p = timed[len(timed) // 2]
            medians.append((c, p))
            b = p["breakdown"]

            def g(key: str, b: dict[str, Any] = b) -> str:
                v = b.get(key)
                return f"{v:.3f}" if isinstance(v, float) else "n/a"

            commit = b.get("commit_s_per_sub")
            commit_s = ("n/a" if not isinstance(commit, float) else
                        f"{commit * 1e3:.2f} ms" if commit < 0.01 else f"{commit:.3f}")
            lines.append(f"  {c.get('mode') or '-':<6} {c['subscribers']:>4} {c['bucket_bytes'] // MiB:>3} MiB "
                         f"{p['seconds']:6.3f} {g('pack_first_start_s'):>8} {g('pack_sum_s'):>8} "
                         f"{g('pack_last_end_s'):>9} {g('pull_sum_s_per_sub'):>12} {g('pulls_last_end_s'):>9} "
                         f"{commit_s:>10} {g('commit_last_end_s'):>11}")
        lines.append("  CPU time during that push (s): ours = trainer + subscribers (user/sys), faults = minor page "
                     "faults; host = busy CPU of the whole VM, steal = CPU the hypervisor gave to other VMs")
        lines.append(f"  {'mode':<6} {'subs':>4} {'bucket':>7} {'trainer u/s':>12} {'subs u/s':>12} {'ours':>6} "
                     f"{'faults':>7} {'host':>6} {'others':>6} {'steal':>6} {'cores busy':>10}")
        for c, p in medians:
            tr, b = p.get("trainer_rusage") or {}, p["breakdown"]
            ours = p["trainer_cpu_s"] + b.get("subscribers_cpu_s", 0.0)
            host = p.get("host_cpu") or {}
            hb = f"{host['busy_s']:.2f}" if host else "n/a"
            others = f"{max(0.0, host['busy_s'] - ours):.2f}" if host else "n/a"
            st = f"{host['steal_s']:.2f}" if host else "n/a"
            cores = f"{host['busy_s'] / p['seconds']:.2f}" if host else "n/a"
            faults = tr.get("minflt", 0) + b.get("subscribers_minflt", 0)
            lines.append(f"  {c.get('mode') or '-':<6} {c['subscribers']:>4} {c['bucket_bytes'] // MiB:>3} MiB "
                         f"{tr.get('user_s', 0):>5.2f}/{tr.get('sys_s', 0):<5.2f} "
                         f"{b.get('subscribers_user_s', 0):>5.2f}/{b.get('subscribers_sys_s', 0):<5.2f} "
                         f"{ours:6.2f} {faults:>7} {hb:>6} {others:>6} {st:>6} {cores:>10}")
        gl = [c for c in cases if c["method"].startswith("gloo") and c.get("receivers_cpu_s")]
        for c in gl:
            ours = [a + b for a, b in zip(c["trainer_cpu_s"], c["receivers_cpu_s"], strict=True)]
            host = [h["busy_s"] for h in c["host_cpu"] if h]
            others = [max(0.0, h - o) for h, o in zip(host, ours, strict=False)]
            sirq = [h["softirq_s"] for h in c["host_cpu"] if h]
            lines.append(f"  gloo N={c['subscribers']}: per broadcast (median) ours {_median(ours):.2f} CPU s, host "
                         f"{_median(host):.2f} (softirq {_median(sirq):.2f}, charged to no process), others "
                         f"{_median(others):.2f} (max {max(others, default=0):.2f}); "
                         f"times {', '.join(f'{t:.3f}' for t in c['times_s'])} s")
    if errors:
        lines.append("")
        lines.append("ERRORS:")
        for e in errors:
            first = str(e["error"]).strip().splitlines()
            lines.append(f"  {e['case']}: {first[-1] if first else ''}")
    lines.append("")
    lines.append(f"targets (reported, never asserted), at bucket {cfg['buckets'][0] // MiB} MiB:")
    width = max((len(t["target"]) for t in targets), default=46)
    for t in targets:
        val = "-" if t["value"] is None else f"{t['value']:.2f}x"
        if t["value"] is not None and f"{t['value']:.2f}" == f"{t['goal']:.2f}":  # a MISS must not read "3.00x"
            val = f"{t['value']:.4f}x"
        lines.append(f"  {t['status']:<5} {t['target']:<{width}} {val:>8}  ({t['detail']})")
    return "\n".join(lines)


def environment(cfg: dict[str, Any]) -> dict[str, Any]:
    return _common.environment(ROOT, cfg["threads"], _idle_fraction)


# ---------------------------------------------------------------------------- main
def _int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def _params(s: str) -> int:
    mult = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9}
    try:
        v = float(s[:-1]) * mult[s[-1].lower()] if s and s[-1].lower() in mult else float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a parameter count like 350M or 20000000, got {s!r}") from None
    if v < 1e5:
        raise argparse.ArgumentTypeError("--params must be at least 100k")
    return int(v)


def _modes(s: str) -> list[str]:
    vals = list(dict.fromkeys(x.strip() for x in s.split(",") if x.strip()))
    bad = [v for v in vals if v not in MODES]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(MODES)}, got {s!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="~20M params, 1 and 2 subscribers, every mode, 1 timed repetition, buckets 256,16 MiB "
                         "(smoke test)")
    ap.add_argument("--params", type=_params, default=None, help="model size, e.g. 350M (default 355M; --quick 20M)")
    ap.add_argument("--subscribers", type=_int_list, default=None, help="subscriber counts (default 1,4; --quick 1,2)")
    ap.add_argument("--modes", type=_modes, default=list(MODES),
                    help="WeightSubscriber modes to run, in this order (default and --quick: staged,swap,direct,shared)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per case (default 3; --quick 1)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="warm-up pushes per case and arena bank (default 1: staged 1, swap 2)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="run every phase (limits, rl_sync, gloo) this many times in a rotated order and pool the "
                         "repetitions, so that a shared host's drift spreads over every case (default 3; --quick 1)")
    ap.add_argument("--buckets-mib", type=_int_list, default=None,
                    help="bucket_bytes values in MiB, first = the one targets and the floor use (default 256; "
                         "--quick 256,16; e.g. 256,64 to compare)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every process (default 1)")
    ap.add_argument("--no-gloo", action="store_true", help="skip the Gloo baseline")
    ap.add_argument("--debug", action="store_true", help="DEBUG logging (rl_sync, transport) in every process")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "rl_sync.json",
                    help="where to write the results (default: bench/results/rl_sync.json)")
    args = ap.parse_args(argv)
    quick = args.quick
    params = args.params or (QUICK_PARAMS if quick else FULL_PARAMS)
    subs = sorted(set(args.subscribers or ([1, 2] if quick else [1, 4])))
    reps = args.reps if args.reps is not None else (1 if quick else 3)
    buckets = [b * MiB for b in (args.buckets_mib or ([256, 16] if quick else [256]))]
    rounds = args.rounds if args.rounds is not None else (1 if quick else 3)
    if reps < 1 or rounds < 1 or args.warmup < 0 or args.threads < 1:
        ap.error("--reps, --rounds and --threads must be >= 1, --warmup >= 0")
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    mcfg = model_config(params)
    shapes = state_dict_shapes(mcfg)
    nparams = count_params(shapes)
    cfg: dict[str, Any] = {
        "mode": "quick" if quick else ("full" if args.params is None else "custom"),
        "model": mcfg,
        "params": nparams,
        "tensors": len(shapes),
        "f32_bytes": 4 * nparams,
        "bf16_bytes": 2 * nparams,
        "subscribers": subs,
        "modes": args.modes,  # WeightSubscriber modes ("mode" above is the kind of run)
        "buckets": buckets,
        "reps": reps,
        "rounds": rounds,
        "warmup": args.warmup,
        "threads": args.threads,
        "debug": args.debug,
        "gloo": not args.no_gloo,
        "shapes": shapes,
    }
    env = environment(cfg)
    t_start = time.monotonic()
    print(f"rl_sync benchmark ({cfg['mode']}): {nparams / 1e6:.1f}M params, {len(shapes)} tensors; subscribers "
          f"{subs}; modes {','.join(args.modes)}; buckets {[b // MiB for b in buckets]} MiB; {args.warmup} warm-up "
          f"per bank + {reps} repetitions x {rounds} round(s); "
          f"torch.set_num_threads({args.threads})", flush=True)

    errors: list[dict[str, Any]] = []
    killed: list[str] = []
    raw_cases: list[dict[str, Any]] = []
    raw_limits: list[dict[str, Any]] = []
    durations: dict[str, float] = {}
    t0 = time.monotonic()
    state = trainer_state(shapes)
    durations["build_state"] = time.monotonic() - t0
    print(f"  [{time.monotonic() - t_start:6.1f} s] state dict built ({_fmt_bytes(cfg['f32_bytes'])} float32) in "
          f"{durations['build_state']:.1f} s", flush=True)

    def phase_limits(rnd: int) -> None:
        raw_limits.append(measure_limits(state, cfg["bf16_bytes"], 1, max(3, reps), usable_cpus(), killed))

    def phase_rl_sync(rnd: int) -> None:
        raw_cases.extend(asyncio.run(run_rl_sync(cfg, state, errors, killed, rnd)))

    def phase_gloo(rnd: int) -> None:
        for n in subs:
            print(f"    gloo broadcast/tensor N={n} ...", flush=True)
            try:
                c = run_gloo(cfg, state, n, killed)
                raw_cases.append(c)
                print(f"    gloo N={n}: median {c['median_s']:.3f} s, best {c['best_s']:.3f} s, "
                      f"verified={c['verified']}", flush=True)
            except (PhaseError, RuntimeError) as exc:  # torch.distributed raises RuntimeError subclasses
                errors.append({"case": f"gloo N={n}", "error": f"{type(exc).__name__}: {exc}"})
                raw_cases.append({"method": "gloo broadcast/tensor", "mode": None, "subscribers": n,
                                  "bucket_bytes": None, "error": str(exc)})
                print(f"  !! gloo N={n} failed: {str(exc).strip().splitlines()[-1]}", flush=True)

    phases = [("limits", phase_limits), ("rl_sync", phase_rl_sync)]
    if cfg["gloo"]:
        phases.append(("gloo", phase_gloo))
    try:
        for rnd in range(cfg["rounds"]):
            k = rnd % len(phases)
            for name, fn in phases[k:] + phases[:k]:  # never two phases at once: memory stays bounded
                print(f"  [{time.monotonic() - t_start:6.1f} s] round {rnd + 1}/{cfg['rounds']}: {name} ...", flush=True)
                t0 = time.monotonic()
                try:
                    fn(rnd)
                except Exception as exc:  # a phase that crashed outright: reported, the run goes on
                    errors.append({"case": f"{name} (round {rnd + 1})", "error": traceback.format_exc()})
                    print(f"  !! {name} crashed: {type(exc).__name__}: {exc}", flush=True)
                durations[name] = durations.get(name, 0.0) + time.monotonic() - t0
    finally:
        for p in CTX.active_children():
            killed.append(f"{p.name} (pid {p.pid})")
            p.kill()
            p.join(3.0)
    cases = merge_cases(raw_cases)
    limits = merge_limits(raw_limits, cfg["bf16_bytes"])

    env["loadavg_end"] = loadavg()
    rows = build_rows(cfg, cases)
    fan = fanout_ratios(cfg, rows)
    model = floor_model(cfg, limits, usable_cpus(), rows) if limits else None
    targets = evaluate_targets(cfg, rows, fan, model)
    mismatches = [r for r in rows if r.get("verified") is False]
    for r in mismatches:
        label = f"{r['method']} {r['mode']}" if r.get("mode") else r["method"]
        errors.append({"case": f"{label} N={r['subscribers']}", "error": "delivered bytes differ from the trainer's"})
    total = time.monotonic() - t_start
    report = format_report(cfg, env, limits, rows, fan, model, cases, targets, errors)
    print()
    print(report)
    print("\ndurations: " + ", ".join(f"{k} {v:.1f} s" for k, v in durations.items()) + f"; total {total:.1f} s")
    if killed:
        print(f"killed stragglers: {', '.join(killed)}")
    doc = {
        "environment": env,
        "config": {k: v for k, v in cfg.items() if k != "shapes"},
        "limits": limits,
        "rows": rows,
        "fanout": fan,
        "floor_model": model,
        "targets": targets,
        "cases": cases,
        "errors": errors,
        "durations_s": durations,
        "total_s": total,
        "killed_stragglers": killed,
    }
    _common.write_results(args.json, doc)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
