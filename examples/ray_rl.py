"""The RL loop on a local Ray cluster: a trainer actor and generator actors, weights pushed with rl_sync.

    python examples/ray_rl.py [--generators 2] [--steps 5] [--mode staged|swap|direct|shared]
                              [--kill-at STEP] [--step-timeout 60] [--fault GEN@STEP:SIG]
                              [--num-cpus 4] [--ray-temp-dir DIR] [-v]

Needs Ray (``pip install -e ".[ray]"``). ``ray.init`` starts a Ray instance on
this machine only (``--num-cpus`` logical CPUs, no dashboard), and the driver
(this script) reserves a placement group of one ``{"CPU": 1}`` bundle for the
trainer and one per generator (strategy ``PACK``). It places one actor in each:

- the **trainer** actor owns a ``transport.Endpoint`` and a
  ``rl_sync.WeightPublisher``, the policy (the small transformer of
  ``_toy_rl.py``) and its optimizer;
- each **generator** actor owns an ``Endpoint`` and a
  ``rl_sync.WeightSubscriber`` on its own copy of the policy, and samples.

No store is shared. Each endpoint opens on a ``torch.distributed.HashStore``
of its own process and describes itself as an opaque address record
(``Endpoint.address_record()``: its address, incarnation, host identity and
secret); the driver carries the records between the actors in ordinary actor
calls, and each side passes the other's to ``Endpoint.add_peer``. So nothing
but Ray's own control plane is needed to find peers: no port to agree on, no
TCPStore to host, and an actor restarted elsewhere just sends a new record.

Each step (synchronous, on-policy, as verl's and OpenRLHF's default loops):

1. every live generator waits for the version the trainer last pushed
   (``wait_for_version``), samples a batch of rollouts while holding it
   (``hold()``: the weights cannot change mid-sample) and returns the
   rollouts and the version it sampled with, through Ray's object store;
2. the trainer scores them, takes a REINFORCE step and pushes the next
   version to every generator (``WeightPublisher.push``); the bytes go over
   the transport (``shm`` between processes on one host, ``tcp`` across
   hosts), never through Ray.

``--kill-at STEP``: after that step, the driver kills the last generator
(``ray.kill``). The next push fails its entry only (the others commit, in
about the time a push takes), the trainer drops it from its subscribers,
and the loop goes on with the others.

A generator that dies or freezes by itself, at any point of a step, is
dropped the same way: the driver waits for the step's rollouts with
``ray.wait`` bounded by ``--step-timeout``, and passes the trainer only the
rollouts that came; a generator whose call failed with ``RayActorError``
(it died) or did not answer in time (frozen, or too slow) is unsubscribed
(``remove_subscriber``) before the push and killed (``ray.kill``). One that
fails after its rollouts came fails only its own entry of the push (rl_sync
bounds each subscriber by the push's timeout, ``--step-timeout`` too); the
driver then pings it: dead or silent for 3 s, it is dropped; still answering,
the run fails (a live generator missed a version). The summary's ``lost``
lists each one with its step, phase (rollouts, push, digest) and why.
``--fault GEN@STEP:SIG`` (for tests) sends SIGKILL or SIGSTOP to a
generator's worker just before step STEP's push.

At the end every live generator reports a sha256 of the weights it holds,
and the driver checks that each holds exactly the trainer's final weights.
The last line printed is ``summary: {json}`` (who sampled which versions,
each push's outcome, the placement, the generators lost). Exits non-zero if
a generator samples with a version other than the newest, a push misses a
generator that still answers, no generator is left, or the final weights
differ; every failure is one ``FAILED:`` line on stderr. Ray is shut down, the actors killed and the
placement group removed on every way out (SIGTERM and SIGINT included).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _toy_rl as toy
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch.distributed import HashStore

import rl_sync
import transport

log = logging.getLogger("ray_rl")
TRAINER = "trainer"
EXAMPLES = Path(__file__).resolve().parent
ROOT = EXAMPLES.parent
START_TIMEOUT = 120.0  # an actor process imports torch first: slow on a busy 2-core machine
STEP_TIMEOUT = 60.0  # --step-timeout's default
PUSH_SLACK = 30.0  # a push returns within its timeout plus planning (connect_timeout, 5 s): the driver waits this more
PROBE_TIMEOUT = 3.0  # a generator whose push failed: how long it has to answer a ping (milliseconds when alive)


def _endpoint(name: str, planes: tuple[str, ...] | None) -> transport.Endpoint:
    """An endpoint reachable only through its address record (its store is a HashStore no other
    process sees), listening on the address Ray knows this node by (so it also works across nodes)."""
    return transport.Endpoint(name, store=HashStore(), listen_host=ray.util.get_node_ip_address(), planes=planes)


# ---------------------------------------------------------------------------- actors
# Async actors: Ray runs every method on one event loop per actor, which is the endpoint's loop.
@ray.remote(num_cpus=1)
class Generator:
    def __init__(self, name: str, index: int, seed: int, mode: str, planes: tuple[str, ...] | None,
                 log_level: int) -> None:
        logging.basicConfig(level=log_level, format=f"[{name}] %(name)s: %(message)s")
        torch.set_num_threads(1)
        self.name, self.mode, self.planes = name, mode, planes
        # same architecture, different initial weights: the first push overwrites them
        self.policy = toy.build_policy(seed + 1000 + index).eval()
        self.rng = torch.Generator().manual_seed(seed * 100 + index)
        self.ep: transport.Endpoint | None = None
        self.sub: rl_sync.WeightSubscriber | None = None
        self.opening = asyncio.Lock()  # close() waits for an open() in progress (the driver may abort mid-start)

    async def open(self) -> bytes:
        """Open the endpoint with the subscriber registered on it; return its address record."""
        async with self.opening:
            self.ep = _endpoint(self.name, self.planes)
            self.sub = rl_sync.WeightSubscriber(self.ep, self.policy, mode=self.mode)
            await self.ep.open()
            return self.ep.address_record()

    async def add_peer(self, record: bytes) -> str:
        assert self.ep is not None
        return self.ep.add_peer(record)

    async def pid(self) -> int:
        return os.getpid()

    async def generate(self, batch: int, min_version: int, timeout: float) -> dict[str, Any]:
        """Sample ``batch`` rollouts with the newest committed version (at least ``min_version``)."""
        assert self.sub is not None
        await self.sub.wait_for_version(min_version, timeout=timeout)
        async with self.sub.hold(timeout=timeout) as version:  # weights fixed for the whole batch
            prompts = toy.make_prompts(batch, self.rng)
            actions = await asyncio.to_thread(toy.sample, self.policy, prompts, self.rng)
        return {"name": self.name, "version": version, "prompts": prompts, "actions": actions,
                "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    async def digest(self) -> tuple[int, str]:
        assert self.sub is not None
        async with self.sub.hold(timeout=STEP_TIMEOUT) as version:
            return version, toy.weights_digest(self.policy)

    async def close(self) -> None:
        async with self.opening:
            if self.sub is not None:
                self.sub.close()
            if self.ep is not None:
                await self.ep.close()


@ray.remote(num_cpus=1)
class Trainer:
    def __init__(self, seed: int, planes: tuple[str, ...] | None, log_level: int) -> None:
        logging.basicConfig(level=log_level, format="[trainer] %(name)s: %(message)s")
        torch.set_num_threads(1)
        self.planes = planes
        self.policy = toy.build_policy(seed)
        self.learner = toy.Trainer(self.policy)
        self.ep: transport.Endpoint | None = None
        self.pub: rl_sync.WeightPublisher | None = None
        self.opening = asyncio.Lock()

    async def open(self) -> bytes:
        async with self.opening:
            self.ep = _endpoint(TRAINER, self.planes)
            await self.ep.open()
            return self.ep.address_record()

    async def add_generators(self, records: list[bytes]) -> list[str]:
        """Make the generators reachable from their records and subscribe them (no byte moves yet)."""
        assert self.ep is not None
        names = [self.ep.add_peer(r) for r in records]
        if self.pub is None:
            self.pub = rl_sync.WeightPublisher(self.ep, names)
        else:
            for n in names:
                self.pub.add_subscriber(n)
        return names

    async def remove_generator(self, name: str) -> None:
        assert self.pub is not None
        self.pub.remove_subscriber(name)

    async def push(self, version: int, timeout: float) -> dict[str, Any]:
        assert self.pub is not None
        report = await self.pub.push(self.policy, version=version, timeout=timeout)
        return {"version": version, "ok": report.ok, "seconds": round(report.seconds, 4),
                "bytes": report.bytes, "summary": report.summary(),
                "results": {n: {"ok": r.ok, "seconds": round(r.seconds, 4), "stage": r.stage, "plane": r.plane,
                                "error": None if r.error is None else f"{type(r.error).__name__}: {r.error}"}
                            for n, r in report.results.items()}}

    async def train_and_push(self, version: int, timeout: float, *rollouts: dict[str, Any]) -> dict[str, Any]:
        """One REINFORCE step on the generators' rollouts (Ray resolved them from the object store), then
        push ``version``."""
        prompts = torch.cat([r["prompts"] for r in rollouts])
        actions = torch.cat([r["actions"] for r in rollouts])
        stats = self.learner.step(prompts, actions, toy.reward(prompts, actions))
        out = await self.push(version, timeout)
        out["mean_reward"] = round(stats["mean_reward"], 4)
        return out

    async def describe(self) -> dict[str, Any]:
        assert self.ep is not None
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "parameters": sum(p.numel() for p in self.policy.parameters()),
                "planes": {n: p.plane for n, p in self.ep.peers.items()}}

    async def digest(self) -> str:
        return toy.weights_digest(self.policy)

    async def pid(self) -> int:
        return os.getpid()

    async def close(self) -> None:
        async with self.opening:
            if self.pub is not None:
                self.pub.close()
            if self.ep is not None:
                await self.ep.close()


# ---------------------------------------------------------------------------- driver
def _get(refs: Any, what: str, timeout: float = STEP_TIMEOUT) -> Any:
    """``ray.get`` with a deadline; the error names what was waited for."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise SystemExit(f"FAILED: {what}: no answer within {timeout} s") from None


def _collect(refs: dict[str, Any], timeout: float, step: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """Wait (at most ``timeout`` s in all) for one call per generator; return the refs that succeeded, their
    values, and why each of the others failed: its actor died (``RayActorError``) or it did not answer in time
    (frozen, or too slow). Any other error is a bug in the generator, not a lost one: the run fails."""
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout, fetch_local=True)
    done = set(ready)
    ok: dict[str, Any] = {}
    values: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for name, ref in refs.items():
        if ref not in done:
            failed[name] = f"no answer within the step timeout ({timeout:g} s): frozen or too slow"
            continue
        try:
            values[name] = ray.get(ref, timeout=timeout)
            ok[name] = ref
        except ray.exceptions.RayActorError as exc:
            failed[name] = f"its actor died ({type(exc).__name__})"
        except ray.exceptions.RayTaskError as exc:
            raise SystemExit(f"FAILED: step {step}: {name} raised {exc}") from None
    return ok, values, failed


def _probe(actor: Any, timeout: float) -> str | None:
    """None if ``actor`` answers within ``timeout`` s, else what it is: dead, or not answering (frozen)."""
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=timeout)
        return None
    except ray.exceptions.RayActorError as exc:
        return f"its actor died ({type(exc).__name__})"
    except ray.exceptions.GetTimeoutError:
        return f"no answer to a ping within {timeout:g} s: frozen"


def _wait_dead(actor: Any, name: str, timeout: float = 30.0) -> None:
    """Return once Ray reports ``actor`` dead (a call on it fails with ``RayActorError``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=1.0)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue
        time.sleep(0.05)
    raise SystemExit(f"FAILED: {name} still answers {timeout} s after ray.kill")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The loop, once Ray is up; returns the summary (raises SystemExit on a broken invariant)."""
    names = [f"gen-{i}" for i in range(args.generators)]
    actors: dict[str, Any] = {}
    pg = placement_group([{"CPU": 1}] * (1 + len(names)), strategy="PACK", name="ray_rl")
    try:
        _get(pg.ready(), "placement group ready", START_TIMEOUT)

        def bundle(i: int) -> dict[str, Any]:
            return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)}

        trainer = actors[TRAINER] = Trainer.options(**bundle(0)).remote(args.seed, args.planes, args.log_level)
        for i, n in enumerate(names):
            actors[n] = Generator.options(**bundle(1 + i)).remote(n, i, args.seed, args.mode, args.planes,
                                                                 args.log_level)
        # rendezvous: every endpoint opens, the driver hands each side the other's address record
        t_start = time.monotonic()
        trainer_rec, *gen_recs = _get([trainer.open.remote()] + [actors[n].open.remote() for n in names],
                                      "actors start and open their endpoints", START_TIMEOUT)
        _get([actors[n].add_peer.remote(trainer_rec) for n in names], "generators add the trainer")
        assert _get(trainer.add_generators.remote(gen_recs), "trainer adds the generators") == names
        started_s = time.monotonic() - t_start

        pushes = [_get(trainer.push.remote(1, args.step_timeout), "first push", args.step_timeout + PUSH_SLACK)]
        if not pushes[0]["ok"]:
            raise SystemExit(f"FAILED: first push: {pushes[0]['summary']}")
        info = _get(trainer.describe.remote(), "trainer describe")
        print(f"trainer: policy of {info['parameters']} parameters; {len(names)} generator actor(s) "
              f"({', '.join(f'{n} over {p}' for n, p in sorted(info['planes'].items()))}, mode {args.mode}); "
              f"actors up and wired in {started_s:.1f} s; placement group of {1 + len(names)} CPU bundles (PACK)",
              flush=True)
        pids = dict(zip([TRAINER, *names], _get([trainer.pid.remote()] + [actors[n].pid.remote() for n in names],
                                                    "actor pids"), strict=True))
        print("pids: " + ", ".join(f"{n} {p}" for n, p in pids.items()), flush=True)
        print(f"{'step':>4} {'version':>7} {'sampled':>9} {'reward':>6} {'push ms':>8}  committed", flush=True)
        live = list(names)
        sampled: dict[str, list[int]] = {n: [] for n in names}
        nodes = {TRAINER: info["node"]}
        killed = None
        lost: list[dict[str, Any]] = []  # generators that died or froze by themselves, in order

        def drop(name: str, step: int, phase: str, why: str) -> None:
            """Give up on a generator that died or froze: unsubscribe it, kill it (a frozen process must not
            outlive the run), go on without it."""
            live.remove(name)
            victim = actors.pop(name)
            lost.append({"name": name, "step": step, "phase": phase, "why": why})
            print(f"  lost {name} at step {step} ({phase}): {why}; dropped (unsubscribed, ray.kill)", flush=True)
            _get(trainer.remove_generator.remote(name), f"trainer drops {name}")
            with contextlib.suppress(Exception):
                ray.kill(victim, no_restart=True)

        per_gen = max(1, args.batch // len(names))
        for step in range(1, args.steps + 1):
            refs = {n: actors[n].generate.remote(per_gen, step, args.step_timeout) for n in live}
            ok_refs, got, failed = _collect(refs, args.step_timeout, step)
            for n, why in failed.items():  # before the push: it must not wait for a generator known to be gone
                drop(n, step, "rollouts", why)
            if not live:
                raise SystemExit(f"FAILED: step {step}: no generator left ({lost})")
            for r in got.values():
                sampled[r["name"]].append(r["version"])
                nodes[r["name"]] = r["node"]
            wrong = {n: r["version"] for n, r in got.items() if r["version"] != step}
            if wrong:  # on-policy: the trainer pushed `step` and nothing newer, so that is the newest
                raise SystemExit(f"FAILED: step {step}: sampled with versions {wrong}, not {step}")
            for n, sig in args.fault.get(step, []):  # fault injection (tests): n dies or freezes mid-step
                if n in live:
                    os.kill(pids[n], sig)
                    print(f"  sent {sig.name} to {n} (pid {pids[n]}) before the push of version {step + 1}",
                          flush=True)
            # only the rollouts that came: the trainer resolves these refs from the object store
            report = _get(trainer.train_and_push.remote(step + 1, args.step_timeout, *ok_refs.values()),
                          f"push of version {step + 1}", args.step_timeout + PUSH_SLACK)
            pushes.append(report)
            committed = sorted(n for n, r in report["results"].items() if r["ok"])
            print(f"{step:4d} {step + 1:7d} {'/'.join(map(str, sorted({r['version'] for r in got.values()}))):>9} "
                  f"{report['mean_reward']:6.3f} {report['seconds'] * 1e3:8.2f}  {','.join(committed)}", flush=True)
            missed = [n for n in live if n != killed and not report["results"].get(n, {}).get("ok")]
            for n in missed:  # lost only if it died or stopped answering; a live one that missed it is a bug
                r = report["results"].get(n, {})
                state = _probe(actors[n], min(PROBE_TIMEOUT, args.step_timeout))
                if state is None:
                    raise SystemExit(f"FAILED: version {step + 1} did not reach {n}, which still answers: "
                                     f"{report['summary']}")
                drop(n, step, "push", f"push of version {step + 1} failed (stage {r.get('stage')}: "
                                      f"{r.get('error')}); {state}")
            if not live:
                raise SystemExit(f"FAILED: step {step}: no generator left ({lost})")
            if killed is not None and killed in report["results"]:
                r = report["results"][killed]
                print(f"  {killed} (killed): stage {r['stage']}, {r['error']}; the trainer drops it", flush=True)
                _get(trainer.remove_generator.remote(killed), "trainer drops the killed generator")
            if step == args.kill_at and len(live) >= 2:
                killed = live.pop()
                victim = actors.pop(killed)
                ray.kill(victim, no_restart=True)
                _wait_dead(victim, killed)  # so the next push surely meets a dead peer, not one about to die
                print(f"  killed {killed} (ray.kill) after step {step}", flush=True)
        final = args.steps + 1
        want = _get(trainer.digest.remote(), "trainer digest")
        refs = {n: actors[n].digest.remote() for n in live}
        _, held, failed = _collect(refs, args.step_timeout, args.steps)
        for n, why in failed.items():
            drop(n, args.steps, "digest", why)
        if not live:
            raise SystemExit(f"FAILED: no generator left to verify ({lost})")
        differ = {n: v for n, (v, d) in held.items() if (v, d) != (final, want)}
        if differ:
            raise SystemExit(f"FAILED: weights differ from the trainer's version {final} ({want[:16]}): {differ}")
        print(f"verified: {', '.join(live)} hold{'s' if len(live) == 1 else ''} exactly the trainer's final weights "
              f"(version {final}, sha256 {want[:16]})", flush=True)
        for e in lost:
            print(f"lost: {e['name']} at step {e['step']} ({e['phase']}): {e['why']}", flush=True)
        return {"generators": names, "steps": args.steps, "mode": args.mode, "final_version": final,
                "sampled": sampled, "killed": killed, "kill_at": args.kill_at, "verified": live, "lost": lost,
                "held": {n: list(held[n]) for n in live},
                "digest": want, "pids": pids, "step_timeout": args.step_timeout,
                "pushes": [{k: p[k] for k in ("version", "ok", "seconds", "results")} for p in pushes],
                "nodes": nodes, "bundles": 1 + len(names), "strategy": "PACK", "startup_s": round(started_s, 2)}
    finally:
        # close the endpoints (all at once, bounded), then make sure the processes are gone
        with contextlib.suppress(Exception):
            ray.wait([a.close.remote() for a in actors.values()], num_returns=len(actors), timeout=10)
        for actor in actors.values():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(pg)


def _terminate(signum: int, frame: Any) -> None:
    signal.signal(signum, signal.SIG_IGN)  # once: a second one must not cut the clean-up short
    raise SystemExit(f"FAILED: signal {signal.Signals(signum).name}")  # unwinds through ray.shutdown below


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="training steps (one push each)")
    ap.add_argument("--batch", type=int, default=toy.BATCH, help="rollouts per step, split over the generators")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=rl_sync.subscriber.MODES, default="staged",
                    help="the generators' WeightSubscriber mode (default staged: works on any node)")
    ap.add_argument("--planes", help="comma-separated transport planes to allow, e.g. tcp (default: the best one)")
    ap.add_argument("--kill-at", type=int, default=0, metavar="STEP",
                    help="ray.kill the last generator after this step (0: never)")
    ap.add_argument("--step-timeout", type=float, default=STEP_TIMEOUT, metavar="S",
                    help="how long a step waits for rollouts and a push for each generator; one that misses it "
                         "(frozen) is dropped (default %(default)g)")
    ap.add_argument("--fault", action="append", default=[], metavar="GEN@STEP:SIG",
                    help="fault injection, for tests: send SIG (KILL or STOP) to generator GEN's worker process "
                         "once step STEP's rollouts are in, just before the push (the driver's node only); repeatable")
    ap.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray instance")
    ap.add_argument("--ray-temp-dir", help="Ray's session folder (default: a new one under /tmp, removed at exit)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO (planes, plans, pushes)")
    args = ap.parse_args()
    if args.steps < 1 or args.generators < 1 or args.batch < args.generators:
        ap.error("--steps and --generators must be >= 1 and --batch >= --generators")
    if not args.step_timeout > 0:
        ap.error("--step-timeout must be > 0")
    if args.kill_at and (args.generators < 2 or not 1 <= args.kill_at < args.steps):
        ap.error("--kill-at needs --generators >= 2 and 1 <= STEP < --steps")
    faults: dict[int, list[tuple[str, signal.Signals]]] = {}
    for f in args.fault:
        try:
            gen, rest = f.split("@")
            step, sig = rest.split(":")
            faults.setdefault(int(step), []).append((gen, signal.Signals[f"SIG{sig.upper()}"]))
        except (ValueError, KeyError):
            ap.error(f"--fault {f!r}: want GEN@STEP:SIG, e.g. gen-1@2:KILL")
    args.fault = faults
    args.planes = tuple(args.planes.split(",")) if args.planes else None
    args.log_level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=args.log_level, format="[driver] %(name)s: %(message)s")
    temp_dir = args.ray_temp_dir or tempfile.mkdtemp(prefix="ray-rl-", dir="/tmp")  # short: Ray puts sockets there
    # The actors are processes Ray starts: they must import transport, rl_sync and _toy_rl. An editable install
    # covers the first two; PYTHONPATH covers all three from a plain checkout.
    path = os.pathsep.join(p for p in (str(ROOT), str(EXAMPLES), os.environ.get("PYTHONPATH")) if p)
    t0 = time.monotonic()
    try:
        ray.init(num_cpus=max(args.num_cpus, 1 + args.generators), include_dashboard=False,
                 object_store_memory=128 << 20, _temp_dir=temp_dir, logging_level=logging.WARNING,
                 runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
        signal.signal(signal.SIGTERM, _terminate)  # after ray.init, which installs a handler that aborts
        summary = run(args)
    except SystemExit as exc:  # ours carry a message; Ray's SIGTERM handler during ray.init() a number
        print(exc.code if isinstance(exc.code, str) else f"FAILED: exit {exc.code}", file=sys.stderr, flush=True)
        return 1
    except ray.exceptions.RayError as exc:  # e.g. the trainer died: no generator can go on without it
        print(f"FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        ray.shutdown()
        if args.ray_temp_dir is None:
            shutil.rmtree(temp_dir, ignore_errors=True)
    summary["wall_s"] = round(time.monotonic() - t0, 2)
    print("summary: " + json.dumps(summary, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
