"""The trainer on a "host" of ``tests/_netns.py``: it serves the TCPStore at its namespace address and pushes.

    python tests/_netns_trainer.py --hostname H --name NAME --addr 10.231.0.1 --spec JSON
                                   [--heartbeat-timeout S] [--bucket-bytes N]

Its ready line gives the store's URL. Commands (JSON lines): ``connect`` (the planes chosen
for each generator), ``push_start`` (starts a push of the version's weights as a task and
returns its start time, ``time.monotonic()``: the clock is system-wide, so the test can
compare it with its own), ``progress`` (the bucket pulls it served per subscriber since that
push started), ``push_result`` (waits, bounded, for the push's report).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def report_dict(report: Any, t0: float) -> dict[str, Any]:
    return {
        "t0": t0,
        "seconds": report.seconds,
        "summary": report.summary(),
        "results": {n: {"ok": r.ok, "error_type": type(r.error).__name__ if r.error is not None else None,
                        "error": str(r.error) if r.error is not None else None, "seconds": r.seconds,
                        "bytes": r.bytes, "source": r.source}
                    for n, r in report.results.items()},
    }


async def main() -> None:
    import asyncio
    import json
    import logging
    import os
    import time

    from tests._netns import child_setup

    ctl, args = child_setup()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    import rl_sync
    import transport
    from tests._netns_gen import weights

    torch.set_num_threads(1)
    spec = json.loads(args["spec"])
    hb = float(args.get("heartbeat-timeout", "10"))
    try:
        ep = transport.Endpoint(args["name"], store=f"tcp://{args['addr']}:0", host_store=True,
                                timeout=float(args.get("timeout", "20")), heartbeat_interval=min(1.0, hb / 4),
                                heartbeat_timeout=hb)
        await ep.open()
    except Exception as exc:
        ctl.send(0, error=f"{type(exc).__name__}: {exc}")
        return
    ctl.send(0, result={"pid": os.getpid(), "store_url": ep.store_url, "address": list(ep.address or ())})
    state: dict[str, Any] = {}

    async def handle(cmd: str, a: dict[str, Any]) -> Any:
        if cmd == "connect":
            out = {}
            for n in a["names"]:
                p = await ep.connect(n, timeout=a.get("timeout", 30))
                out[n] = {"plane": p.plane, "reason": p.plane_reason}
            return out
        if cmd == "push_start":
            if "pub" not in state:
                state["pub"] = rl_sync.WeightPublisher(ep, a["subscribers"], bucket_bytes=int(args["bucket-bytes"]),
                                                       connect_timeout=a.get("connect_timeout", 5.0))
            data = await asyncio.to_thread(weights, spec, a["version"])
            recs = ep.recorder.snapshot()
            state["mark"] = max((r["record_id"] for r in recs), default=0)
            t0 = time.monotonic()
            state["push"] = asyncio.ensure_future(state["pub"].push(data, a["version"], timeout=a["timeout"]))
            state["t0"] = t0
            return t0
        if cmd == "progress":  # bucket gets served (target side, done) per peer since the push started
            counts: dict[str, int] = {}
            for r in ep.recorder.snapshot():
                if (r["record_id"] > state["mark"] and r["kind"] == "get" and r["role"] == "target"
                        and r["state"] == "done" and r["nbytes"] > 0):
                    counts[r["peer"]] = counts.get(r["peer"], 0) + 1
            return {"counts": counts, "done": state["push"].done()}
        if cmd == "push_result":
            report = await asyncio.wait_for(asyncio.shield(state["push"]), a.get("timeout", 60))
            return report_dict(report, state["t0"])
        if cmd == "peers":
            return {n: {"plane": p.plane, "reason": p.plane_reason} for n, p in ep.peers.items()}
        raise ValueError(f"unknown command {cmd!r}")

    try:
        await ctl.serve(handle)
    finally:
        if "push" in state and not state["push"].done():
            state["push"].cancel()
        if "pub" in state:
            state["pub"].close()
        await ep.close(timeout=3)


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
