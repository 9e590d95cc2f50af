"""An RL loop on one machine: a trainer and generator processes, weights pushed with rl_sync.

    python examples/rl_loop.py [--steps 30] [--generators 2] [--seed 0] [--device cpu|cuda] [--planes tcp]
                               [--mode staged|swap|direct|shared] [--model toy|hf-llama] [-v]

A small transformer policy (built in code, nothing downloaded; see
``_toy_rl.py``) learns to copy a 4-digit prompt by policy gradient.
``--model hf-llama`` makes the policy a Hugging Face ``LlamaForCausalLM``
instead, built from a tiny config with tied embeddings (``_hf_llama.py``;
needs ``transformers``: ``pip install -e ".[hf]"``). Each step:

1. every generator waits until a new version of the weights is committed
   (``WeightSubscriber.wait_for_version``) and samples a batch of rollouts
   while holding it (``hold()``: the weights cannot change mid-sample);
2. it writes the rollouts straight into buffers the trainer registered, one
   per generator (``put(..., notify=b"rollout <version>")``); the trainer
   posts no receive, and learns that a batch landed from the notification,
   which is delivered only after the bytes are in its buffers;
3. the trainer scores them, takes a REINFORCE step and pushes the next
   version to every generator (``WeightPublisher.push``), printing the
   version, the mean reward, the push time and its GB/s.

The generators' ``WeightSubscriber`` mode is ``shared`` on the CPU (their
weights are the trainer's bank, mapped read-only: one pack per push,
whatever the number of generators) and ``staged`` on a GPU or over tcp;
``--mode`` picks another.

At the end each generator reports a sha256 of the weights it holds and the
trainer checks that every one holds exactly its final weights. Exits
non-zero if a generator fails, a push does not reach everyone, the weights
differ, or the reward did not rise (mean of the last 5 steps less than 0.2
above the first 5; 0.1 for ``hf-llama``; runs of fewer than 10 steps are not
judged).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import sys
import time

import _toy_rl as toy
import torch
from _procs import collect, stop_and_reap

import rl_sync
import transport

log = logging.getLogger("rl_loop")
TRAINER = "trainer"
READY_TIMEOUT = 120.0  # spawning a process that imports torch can be slow on a busy machine
STEP_TIMEOUT = 60.0
MODELS = {"toy": "policy", "hf-llama": "LlamaForCausalLM policy (transformers, tied embeddings)"}
# the rise of the mean reward (last 5 steps over the first 5) a run must show: the Llama (rotary positions,
# no learned ones) learns the copy task slower than the toy (one run: from 0.17 to 0.48 in 30 steps)
MIN_RISE = {"toy": 0.2, "hf-llama": 0.1}
JUDGE_STEPS = 10  # fewer steps: no verdict on learning (the weights are still verified)


def build_policy(model: str, seed: int) -> torch.nn.Module:
    """The policy: the toy transformer, or (``hf-llama``) a tiny ``LlamaForCausalLM`` reading the same tokens."""
    if model == "hf-llama":
        import _hf_llama  # (imports transformers: only when asked for)

        return _hf_llama.build_policy(seed, toy.NUM_DIGITS)
    return toy.build_policy(seed)


def rollout_buffers(gen: str, batch: int) -> dict[str, torch.Tensor]:
    """The trainer-side buffers a generator writes a batch of rollouts into."""
    return {f"rollout/{gen}/prompts": torch.zeros(batch, toy.K, dtype=torch.int64),
            f"rollout/{gen}/actions": torch.zeros(batch, toy.K, dtype=torch.int64)}


# ---------------------------------------------------------------------------- generator process
def generator(name: str, index: int, store: str, args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level, format=f"[{name}] %(name)s: %(message)s")
    torch.set_num_threads(1)
    sys.exit(asyncio.run(_generator(name, index, store, args)))


async def _generator(name: str, index: int, store: str, args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    # Same architecture, different initial weights: the first push overwrites them.
    policy = build_policy(args.model, args.seed + 1000 + index).to(device).eval()
    rng = torch.Generator().manual_seed(args.seed * 100 + index)
    ep = transport.Endpoint(name, store=store, planes=args.planes)
    sub = rl_sync.WeightSubscriber(ep, policy, mode=args.mode)  # registered before opening: the trainer finds it
    async with ep:
        stop = asyncio.Event()

        async def control() -> None:  # the trainer's own messages (rl_sync routes its messages itself)
            while True:
                note = await ep.next_notification()
                if note.payload == b"stop":
                    stop.set()
                    return
                if note.payload == b"digest":
                    async with sub.hold() as held:
                        digest = toy.weights_digest(policy)
                    await ep.notify(TRAINER, f"digest {held} {digest}".encode())

        ctl = asyncio.ensure_future(control())
        try:
            await ep.notify(TRAINER, b"ready", timeout=READY_TIMEOUT)
            used = 0  # the version of the last batch sent
            idle_since = time.monotonic()
            while used < args.steps and not stop.is_set():
                try:  # the newest committed version, as soon as it is newer than the last one used
                    await sub.wait_for_version(used + 1, timeout=0.5)
                except transport.TransportTimeoutError:
                    if TRAINER not in ep.peers:  # its channel broke: it died (a normal end says "stop" first)
                        log.error("lost the trainer; exiting")
                        return 1
                    if time.monotonic() - idle_since > STEP_TIMEOUT:
                        log.error("no new version for %s s (holding %d); giving up", STEP_TIMEOUT, sub.version)
                        return 1
                    continue
                idle_since = time.monotonic()
                async with sub.hold() as version:  # weights fixed for the whole batch
                    prompts = toy.make_prompts(args.batch // args.generators, rng)
                    actions = await asyncio.to_thread(toy.sample, policy, prompts, rng)
                # one-sided write into the trainer's buffers; the notification arrives after the bytes
                await ep.put(TRAINER, {f"rollout/{name}/prompts": prompts, f"rollout/{name}/actions": actions.cpu()},
                             notify=f"rollout {version}".encode())
                used = version
            async with asyncio.timeout(STEP_TIMEOUT):
                await asyncio.shield(ctl)  # answer the digest request, then the stop
            return 0
        except (transport.TransportError, TimeoutError) as exc:
            log.error("%s: %s", type(exc).__name__, exc)
            return 1
        finally:
            ctl.cancel()
            sub.close()


# ---------------------------------------------------------------------------- trainer
async def trainer(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    names = [f"gen-{i}" for i in range(args.generators)]
    policy = build_policy(args.model, args.seed).to(device)
    learner = toy.Trainer(policy)
    nparams = sum(p.numel() for p in policy.parameters())
    async with transport.Endpoint(TRAINER, store="tcp://127.0.0.1:0", host_store=True, planes=args.planes) as ep:
        buffers = {n: rollout_buffers(n, args.batch // args.generators) for n in names}
        for bufs in buffers.values():
            for buf_name, t in bufs.items():
                ep.register(buf_name, t)  # generators put rollouts here; the trainer never posts a receive
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=generator, name=n, args=(n, i, ep.store_url, args), daemon=True)
                 for i, n in enumerate(names)]
        for p in procs:
            p.start()
        pub = rl_sync.WeightPublisher(ep, names)
        rewards: list[float] = []
        try:
            await collect(ep, "ready", names, procs, READY_TIMEOUT, role="generator")
            planes = ", ".join(f"{n} over {ep.peers[n].plane}" for n in names if n in ep.peers)
            print(f"trainer: {MODELS[args.model]} of {nparams} parameters ({nparams * 4 / 2**10:.0f} KiB) on {device}; "
                  f"{len(names)} generator(s) ({planes}, mode {args.mode}); {args.batch} rollouts per step", flush=True)
            report = await pub.push(policy, version=1)
            if not report.ok:
                raise SystemExit(f"FAILED: first push: {report.summary()}")
            print(f"{'step':>4} {'version':>7} {'sampled':>7} {'reward':>6} {'push ms':>8} {'GB/s':>6}  ok", flush=True)
            for step in range(1, args.steps + 1):
                got = await collect(ep, "rollout", names, procs, STEP_TIMEOUT, role="generator")
                sampled = sorted({int(w[0]) for w in got.values()})
                prompts = torch.cat([buffers[n][f"rollout/{n}/prompts"] for n in names])
                actions = torch.cat([buffers[n][f"rollout/{n}/actions"] for n in names])
                stats = learner.step(prompts, actions, toy.reward(prompts, actions))
                rewards.append(stats["mean_reward"])
                report = await pub.push(policy, version=step + 1, timeout=STEP_TIMEOUT)
                print(f"{step:4d} {step + 1:7d} {'/'.join(map(str, sampled)):>7} {stats['mean_reward']:6.3f} "
                      f"{report.seconds * 1e3:8.2f} {report.gbps:6.3f}  {report.ok}", flush=True)
                if not report.ok:
                    raise SystemExit(f"FAILED: push did not reach every generator: {report.summary()}")
            final = args.steps + 1
            want = toy.weights_digest(policy)
            for n in names:
                await ep.notify(n, b"digest")
            digests = await collect(ep, "digest", names, procs, STEP_TIMEOUT, role="generator")
            wrong = {n: d for n, d in digests.items() if d != [str(final), want]}
            if wrong:
                raise SystemExit(f"FAILED: weights differ from the trainer's version {final} ({want[:16]}): "
                                 + "; ".join(f"{n} holds version {d[0]} ({d[1][:16]})" for n, d in wrong.items()))
            who = names[0] + " holds" if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]} hold"
            print(f"verified: {who} exactly the trainer's final weights (version {final}, sha256 {want[:16]})",
                  flush=True)
        finally:
            await stop_and_reap(ep, names, procs)
            pub.close()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit("FAILED: generator exit codes " + ", ".join(f"{p.name}={p.exitcode}" for p in procs))
    if len(rewards) < JUDGE_STEPS:
        print(f"{len(rewards)} steps are too few to judge learning (the reward is checked from {JUDGE_STEPS})",
              flush=True)
        return 0
    k = 5
    rise = MIN_RISE[args.model]
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(f"reward rose from {first:.3f} (mean of the first {k} steps) to {last:.3f} (last {k})"
          if last - first >= rise else f"reward did not rise enough: {first:.3f} -> {last:.3f}", flush=True)
    return 0 if last - first >= rise else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="training steps (one push each)")
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--batch", type=int, default=toy.BATCH, help="rollouts per step, split over the generators")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--planes", help="comma-separated transport planes to allow, e.g. tcp (default: the best one)")
    ap.add_argument("--mode", choices=rl_sync.subscriber.MODES,
                    help="the generators' WeightSubscriber mode (default: shared on the CPU, else staged)")
    ap.add_argument("--model", choices=tuple(MODELS), default="toy",
                    help="the policy: toy (default) or hf-llama (a tiny transformers LlamaForCausalLM, tied embeddings)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO (planes, plans, pushes)")
    args = ap.parse_args()
    if args.steps < 1 or args.generators < 1 or args.batch < args.generators:
        ap.error("--steps and --generators must be >= 1 and --batch >= --generators")
    args.planes = tuple(args.planes.split(",")) if args.planes else None
    if args.mode is None:  # shared needs CPU weights and the trainer reachable through shared memory
        local = args.planes is None or "shm" in args.planes
        args.mode = "shared" if args.device == "cpu" and local else "staged"
    args.log_level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=args.log_level, format="[trainer] %(name)s: %(message)s")
    torch.set_num_threads(1)
    return asyncio.run(trainer(args))


if __name__ == "__main__":
    sys.exit(main())
