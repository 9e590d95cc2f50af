"""A generator on a "host" of ``tests/_netns.py``: an Endpoint and a WeightSubscriber, driven over stdin/stdout.

    python tests/_netns_gen.py --hostname H --name NAME --store tcp://ADDR:PORT --spec JSON
                               [--heartbeat-timeout S] [--mode staged]

Commands (JSON lines, see ``tests._netns.Control``): ``state`` (the version held and the
sha256 of the weights, read under ``hold()``), ``peers`` (open channels and their planes),
``wait_version``. The weights of every version are known from the version alone
(:func:`weights`), so the test checks them without shipping bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def weights(spec: dict[str, Any], version: int) -> dict[str, Any]:
    """What the trainer pushes as ``version``: fresh data seeded by the version (tests._remote.make_tensor)."""
    from tests._remote import make_tensor

    return {n: make_tensor(dt, tuple(sh), version * 1009 + i) for i, (n, (dt, sh)) in enumerate(spec.items())}


def digest(tensors: dict[str, Any]) -> str:
    """sha256 over every tensor's bytes, in name order (names and dtypes included)."""
    import hashlib

    h = hashlib.sha256()
    for n in sorted(tensors):
        t = tensors[n].detach().contiguous()
        h.update(f"{n}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.reshape(-1).view(__import__("torch").uint8).numpy())
    return h.hexdigest()


def peer_planes(ep: Any) -> dict[str, dict[str, str]]:
    return {n: {"plane": p.plane, "reason": p.plane_reason, "socket": p.socket} for n, p in ep.peers.items()}


async def main() -> None:
    import asyncio
    import json
    import logging
    import os
    import socket

    from tests._netns import child_setup

    ctl, args = child_setup()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    import rl_sync
    import transport
    from tests._remote import poisoned

    torch.set_num_threads(1)
    spec = json.loads(args["spec"])
    hb = float(args.get("heartbeat-timeout", "10"))
    try:
        ep = transport.Endpoint(args["name"], store=args["store"], timeout=float(args.get("timeout", "20")),
                                heartbeat_interval=min(1.0, hb / 4), heartbeat_timeout=hb)
        await ep.open()
        model = {n: poisoned(dt, tuple(sh)) for n, (dt, sh) in spec.items()}
        sub = rl_sync.WeightSubscriber(ep, model, mode=args.get("mode", "staged"))
    except Exception as exc:
        ctl.send(0, error=f"{type(exc).__name__}: {exc}")
        return
    ctl.send(0, result={"pid": os.getpid(), "hostname": socket.gethostname(), "address": list(ep.address or ()),
                        "incarnation": ep.incarnation})

    async def handle(cmd: str, a: dict[str, Any]) -> Any:
        if cmd == "state":
            async with sub.hold(timeout=a.get("timeout", 30)) as v:
                return {"version": v, "sha256": await asyncio.to_thread(digest, model), "torn": sub.torn}
        if cmd == "peers":
            return peer_planes(ep)
        if cmd == "wait_version":
            return await sub.wait_for_version(a["version"], timeout=a.get("timeout", 30))
        raise ValueError(f"unknown command {cmd!r}")

    try:
        await ctl.serve(handle)
    finally:
        sub.close()
        await ep.close(timeout=3)


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
