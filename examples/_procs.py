"""Process plumbing shared by the examples: wait for one message from every child, stop and reap them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import time

import transport

__all__ = ["collect", "stop_and_reap"]

log = logging.getLogger("examples")


async def collect(ep: transport.Endpoint, kind: str, names: list[str], procs: list[mp.process.BaseProcess],
                  timeout: float, role: str = "child") -> dict[str, list[str]]:
    """Wait for one ``kind`` notification from each of ``names``; returns name -> its words after the kind.

    Raises ``SystemExit`` (with what went wrong) if a child exits first or ``timeout`` passes.
    """
    got: dict[str, list[str]] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(names):
        dead = [p.name for p in procs if p.exitcode is not None and p.name not in got]
        if dead:
            raise SystemExit(f"FAILED: {role}(s) {', '.join(dead)} exited while waiting for '{kind}'")
        left = deadline - time.monotonic()
        if left <= 0:
            raise SystemExit(f"FAILED: no '{kind}' from {sorted(set(names) - set(got))} within {timeout} s")
        try:
            note = await ep.next_notification(timeout=min(1.0, left))
        except transport.TransportTimeoutError:
            continue
        words = note.payload.decode(errors="replace").split()
        if words and words[0] == kind and note.peer in names:
            got[note.peer] = words[1:]
        else:
            log.warning("ignored notification %r from %s", note.payload[:80], note.peer)
    return got


async def stop_and_reap(ep: transport.Endpoint, names: list[str], procs: list[mp.process.BaseProcess]) -> None:
    """Tell every child to stop, then join each (bounded; killed if it hangs)."""
    for n in names:
        with contextlib.suppress(transport.TransportError):
            await ep.notify(n, b"stop", timeout=2.0)
    for p in procs:  # joined on a thread so this endpoint keeps answering the children's goodbyes
        await asyncio.to_thread(p.join, 20)
        if p.is_alive():
            log.warning("%s did not exit; killing it", p.name)
            p.kill()
            await asyncio.to_thread(p.join, 5)
