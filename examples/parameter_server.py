"""A parameter server: workers push gradients one-sidedly, the server averages them and publishes weights.

    python examples/parameter_server.py [--steps 20] [--workers 2] [--seed 0] [-v]

The server holds a small MLP and registers one flat float32 gradient buffer
per worker (``grad/<worker>``). Each step:

1. every worker waits until a new version of the weights is committed
   (``WeightSubscriber.wait_for_version``) and, holding it (``hold()``),
   computes the loss and gradient on its own data shard;
2. it writes the flat gradient straight into its buffer on the server
   (``put(..., notify=b"grad <version> <loss>")``); the server posts no
   receive and learns the gradient landed from the notification;
3. once every worker's gradient is in, the server averages them, takes an
   SGD step and publishes the next version (``WeightPublisher.push``).

Prints the loss (the mean of the workers' losses, all computed on the same
version) per step. Exits non-zero if a worker fails, a push does not reach
every worker, or the loss did not fall below a quarter of where it started.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import sys
import time

import torch
from _procs import collect, stop_and_reap
from torch import nn

import rl_sync
import transport

log = logging.getLogger("parameter_server")
SERVER = "server"
IN, HIDDEN, SHARD = 16, 64, 512
READY_TIMEOUT = 120.0
STEP_TIMEOUT = 60.0


def build_model(seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def shard(seed: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``index``'s data: y = x . w + noise, with one w shared by every worker."""
    w = torch.randn(IN, 1, generator=torch.Generator().manual_seed(seed)) / 4
    g = torch.Generator().manual_seed(seed * 1000 + 100 + index)
    x = torch.randn(SHARD, IN, generator=g)
    return x, x @ w + 0.05 * torch.randn(SHARD, 1, generator=g)


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


# ---------------------------------------------------------------------------- worker process
def worker(name: str, index: int, store: str, args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level, format=f"[{name}] %(name)s: %(message)s")
    torch.set_num_threads(1)
    sys.exit(asyncio.run(_worker(name, index, store, args)))


async def _worker(name: str, index: int, store: str, args: argparse.Namespace) -> int:
    model = build_model(args.seed + 1000 + index)  # overwritten by the first push
    x, y = shard(args.seed, index)
    ep = transport.Endpoint(name, store=store)
    sub = rl_sync.WeightSubscriber(ep, model)
    async with ep:
        stop = asyncio.Event()

        async def control() -> None:
            while (await ep.next_notification()).payload != b"stop":
                pass
            stop.set()

        ctl = asyncio.ensure_future(control())
        try:
            await ep.notify(SERVER, b"ready", timeout=READY_TIMEOUT)
            used, idle_since = 0, time.monotonic()
            while not stop.is_set():
                try:
                    await sub.wait_for_version(used + 1, timeout=0.5)
                except transport.TransportTimeoutError:
                    if SERVER not in ep.peers:  # its channel broke: it died (a normal end says "stop" first)
                        log.error("lost the server; exiting")
                        return 1
                    if time.monotonic() - idle_since > STEP_TIMEOUT:
                        log.error("no new version for %s s (holding %d); giving up", STEP_TIMEOUT, sub.version)
                        return 1
                    continue
                idle_since = time.monotonic()
                async with sub.hold() as version:  # the weights cannot change during forward and backward
                    model.zero_grad(set_to_none=False)
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                await ep.put(SERVER, {f"grad/{name}": flat_grad(model)},
                             notify=f"grad {version} {loss.item():.9g}".encode())
                used = version
            return 0
        except transport.TransportError as exc:
            log.error("%s: %s", type(exc).__name__, exc)
            return 1
        finally:
            ctl.cancel()
            sub.close()


# ---------------------------------------------------------------------------- server
async def server(args: argparse.Namespace) -> int:
    names = [f"worker-{i}" for i in range(args.workers)]
    model = build_model(args.seed)
    params = list(model.parameters())
    nparams = sum(p.numel() for p in params)
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.5)
    losses: list[float] = []
    async with transport.Endpoint(SERVER, store="tcp://127.0.0.1:0", host_store=True) as ep:
        grads = {n: torch.zeros(nparams) for n in names}
        for n, g in grads.items():
            ep.register(f"grad/{n}", g)  # each worker puts its gradient here; the server posts no receive
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, name=n, args=(n, i, ep.store_url, args), daemon=True)
                 for i, n in enumerate(names)]
        for p in procs:
            p.start()
        pub = rl_sync.WeightPublisher(ep, names)
        try:
            await collect(ep, "ready", names, procs, READY_TIMEOUT, role="worker")
            print(f"server: MLP of {nparams} parameters, {len(names)} workers with {SHARD} samples each", flush=True)
            report = await pub.push(model, version=1)
            if not report.ok:
                raise SystemExit(f"FAILED: first push: {report.summary()}")
            print(f"{'step':>4} {'version':>7} {'loss':>9} {'push ms':>8}  ok", flush=True)
            for step in range(1, args.steps + 1):
                got = await collect(ep, "grad", names, procs, STEP_TIMEOUT, role="worker")
                stale = {n: w[0] for n, w in got.items() if int(w[0]) != step}
                if stale:
                    raise SystemExit(f"FAILED: gradients of another version than {step}: {stale}")
                losses.append(sum(float(w[1]) for w in got.values()) / len(got))
                avg = torch.stack([grads[n] for n in names]).mean(dim=0)
                offset = 0
                for p in params:
                    p.grad = avg[offset:offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
                opt.step()
                report = await pub.push(model, version=step + 1, timeout=STEP_TIMEOUT)
                print(f"{step:4d} {step + 1:7d} {losses[-1]:9.5f} {report.seconds * 1e3:8.2f}  {report.ok}", flush=True)
                if not report.ok:
                    raise SystemExit(f"FAILED: push did not reach every worker: {report.summary()}")
        finally:
            await stop_and_reap(ep, names, procs)
            pub.close()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit("FAILED: worker exit codes " + ", ".join(f"{p.name}={p.exitcode}" for p in procs))
    ok = losses[-1] < losses[0] / 4
    print(f"loss {'fell' if ok else 'did not fall enough'}: {losses[0]:.5f} -> {losses[-1]:.5f}", flush=True)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO (planes, plans, pushes)")
    args = ap.parse_args()
    if args.steps < 2 or args.workers < 1:
        ap.error("--steps must be >= 2 and --workers >= 1")
    args.log_level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=args.log_level, format="[server] %(name)s: %(message)s")
    torch.set_num_threads(1)
    return asyncio.run(server(args))


if __name__ == "__main__":
    sys.exit(main())
