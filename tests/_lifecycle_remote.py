"""The few commands tests/test_connection_lifecycle.py needs in its spawned endpoints (tests._remote's
``commands=`` protocol: same pipe, every wait bounded)."""

from __future__ import annotations

import os
import resource
from typing import Any

import torch

from tests._remote import NOT_MINE


async def handle(ep: Any, state: dict[str, Any], cmd: str, a: tuple[Any, ...]) -> Any:
    if cmd == "exhaust_fds":  # lower the descriptor limit to `limit` and take every free descriptor
        (limit,) = a
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        hoard = state.setdefault("hoard", [])
        while True:
            try:
                hoard.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                return len(hoard)
    if cmd == "release_fds":
        for fd in state.pop("hoard", []):
            os.close(fd)
        return None
    if cmd == "address_record":
        return ep.address_record()
    if cmd == "add_peer":
        return ep.add_peer(a[0])
    if cmd == "put_error":  # put `value` into `peer`'s `name` (uint8, n; notified: a message to the peer's
        peer, name, n, value, timeout, *notify = a  # endpoint, never one-sided): None, or its error, as text
        try:
            await ep.put(peer, {name: torch.full((n,), value, dtype=torch.uint8)}, timeout=timeout,
                         notify=notify[0] if notify else None)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            return f"{type(exc).__name__}: {exc}"
        return None
    if cmd == "fork_and_exit":  # this process exits; a forked child keeps every descriptor (the channels'
        if os.fork() == 0:  # sockets: no EOF reaches the peers) for `a[0]` seconds
            import time

            time.sleep(a[0])  # noqa: ASYNC251 - the forked child only waits, then exits
            os._exit(0)
        os._exit(0)
    if cmd == "peer_names":  # the peers this endpoint has an open channel with
        return sorted(ep.peers)
    if cmd == "pause_state":  # whether the endpoint is open, and its pause watch's store look-ups so far
        return {"open": ep.is_open, "checks": ep.pauses.checks if ep.pauses is not None else -1}
    if cmd == "stop_self_on_answer":  # SIGSTOP this process once, from the pause watch's thread, right after
        import logging  # its store look-up said the name is still ours (its INFO record): a real pause at
        import signal  # the one point where the watch does not read the clock
        import threading

        class StopOnAnswer(logging.Handler):
            fired = False

            def emit(self, record: logging.LogRecord) -> None:
                if not self.fired and "the store still names it" in record.getMessage():
                    self.fired = True
                    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

        lg = logging.getLogger("transport.endpoint")
        lg.setLevel(logging.INFO)
        lg.addHandler(StopOnAnswer(logging.INFO))
        return None
    if cmd == "pause_watch_off":  # stop this endpoint's pause watch (transport.pauses): as if the store had
        ep.pauses.stop()  # not answered its check, so the peers' own checks alone keep the name from it
        return None
    if cmd == "served":  # (kind, state) of every op this endpoint served as a target (its flight recorder)
        return [(r["kind"], r["state"]) for r in ep.recorder.snapshot() if r["role"] == "target"]
    return NOT_MINE
