"""The transport alone, in two processes: a generator registers buffers and does
nothing else; a trainer puts into them and reads them back, by name.

    python examples/asyncio_put_get.py [--planes tcp] [--mib 64]

Exits non-zero if any byte landed wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time

import torch

import transport

SHAPES = {"embed.weight": (4096, 256), "layer0.weight": (1024, 1024), "layer0.bias": (1024,), "step": ()}


def generator(store: str, planes: tuple[str, ...] | None, mib: int) -> None:
    async def main() -> None:
        async with transport.Endpoint("gen-0", store=store, planes=planes) as ep:
            bufs = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
            bufs["big"] = torch.zeros(mib * 1024 * 1024 // 4)
            for name, t in bufs.items():
                ep.register(name, t)  # puts from the trainer land here, no receive posted
            note = await ep.next_notification(timeout=120)  # the trainer says when it is done
            print(f"[gen-0] notified by {note.peer}: {note.payload.decode()}; "
                  f"step buffer now holds {bufs['step'].item():.0f}", flush=True)

    asyncio.run(main())


async def trainer(args: argparse.Namespace) -> int:
    planes = tuple(args.planes.split(",")) if args.planes else None
    async with transport.Endpoint("trainer", store="tcp://127.0.0.1:0", host_store=True, planes=planes) as ep:
        proc = mp.get_context("spawn").Process(target=generator, args=(ep.store_url, planes, args.mib))
        proc.start()
        try:
            peer = await ep.connect("gen-0", timeout=60)
            while len(peer.buffers) < len(SHAPES) + 1:  # registrations arrive as the generator makes them
                await asyncio.sleep(0.01)
            print(f"[trainer] connected to {peer.name} over {peer.plane} ({peer.plane_reason})")
            for name, spec in sorted(peer.buffers.items()):
                print(f"[trainer]   {name:<14} {str(spec.dtype):<14} {tuple(spec.shape)}")
            ok = True
            for step in range(1, 4):
                new = {n: torch.randn(s.shape) for n, s in peer.buffers.items() if n != "step"}
                new["step"] = torch.tensor(float(step))
                t0 = time.perf_counter()
                await ep.put("gen-0", new)  # returns once gen-0 holds the bytes
                dt = time.perf_counter() - t0
                nbytes = sum(t.nbytes for t in new.values())
                back = {n: torch.empty_like(t) for n, t in new.items()}
                await ep.get("gen-0", back)  # one-sided read
                same = all(torch.equal(back[n], new[n]) for n in new)
                ok &= same
                print(f"[trainer] step {step}: put {nbytes / 2**20:.1f} MiB in {dt * 1e3:.1f} ms "
                      f"({nbytes / dt / 1e9:.2f} GB/s); read back {'identical' if same else 'DIFFERENT'}")
            chunk = torch.arange(8.0)
            await ep.put("gen-0", {"layer0.bias": transport.At(chunk, offset=100)})  # a sub-range
            out = torch.empty(8)
            await ep.get("gen-0", {"layer0.bias": transport.At(out, offset=100)})
            ok &= torch.equal(out, chunk)
            await ep.notify("gen-0", b"done")
            proc.join(60)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    print("OK: every byte verified" if ok and proc.exitcode == 0 else "FAILED")
    return 0 if ok and proc.exitcode == 0 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--planes", help="comma-separated planes to allow, e.g. tcp")
    ap.add_argument("--mib", type=int, default=64, help="size of the extra large buffer")
    sys.exit(asyncio.run(trainer(ap.parse_args())))
