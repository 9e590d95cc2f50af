"""rl_sync commands for the spawned-process harness in ``tests/_remote.py``.

A child runs a real :class:`rl_sync.WeightSubscriber` on its real endpoint;
the test process is the trainer. Data is made from seeds on both sides
(``make_tensor``) so contents can be checked byte for byte without shipping
tensors through the pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from tests._remote import RemoteEndpoint, backing, dtype_of, make_tensor, poisoned, same_bytes
from transport.errors import TransportTimeoutError


def stamped(spec: dict[str, tuple[str, tuple[int, ...]]], version: int) -> dict[str, torch.Tensor]:
    """Every element of every tensor holds ``version``: the stamp a reader checks."""
    return {n: torch.full(tuple(sh), version, dtype=dtype_of(dt)) for n, (dt, sh) in spec.items()}


def seeded(spec: dict[str, tuple[str, tuple[int, ...]]], seed: int) -> dict[str, torch.Tensor]:
    return {n: make_tensor(dt, tuple(sh), seed + i) for i, (n, (dt, sh)) in enumerate(spec.items())}


async def handle_sub(ep: Any, state: dict[str, Any], cmd: str, args: tuple[Any, ...]) -> Any:
    from rl_sync import WeightSubscriber

    if cmd == "sub_create":  # (spec, kwargs[, device]): a poisoned model on the device (default the CPU)
        spec, kwargs, *where = args
        device = where[0] if where else "cpu"
        model = {n: poisoned(dt, tuple(sh)).to(device) for n, (dt, sh) in spec.items()}
        state["model"] = model
        state["sub"] = WeightSubscriber(ep, model, **kwargs)
        return len(state["sub"].manifest.arenas)
    sub = state["sub"]
    if cmd == "sub_version":
        return sub.version
    if cmd == "sub_wait":
        version, timeout = args
        return await sub.wait_for_version(version, timeout=timeout)
    if cmd == "sub_check":  # contents == the trainer's seeded tensors, cast to the subscriber's dtypes
        pub_spec, seed = args
        want = seeded(pub_spec, seed)
        async with sub.hold():
            return {n: same_bytes(state["model"][n].cpu(), want[n].to(state["model"][n].dtype)) for n in want}
    if cmd == "sub_check_held":  # inside one hold(): the version held, and whether the weights are exactly its bytes
        pub_spec = args[0]
        async with sub.hold() as v:
            if v == 0:
                return 0, True
            want = seeded(pub_spec, v)
            return v, all(same_bytes(state["model"][n].cpu(), want[n].to(state["model"][n].dtype)) for n in want)
    if cmd == "sub_gpu_read":  # inside hold(streams=[side]): a long kernel, then copies of the weights, on a
        # side stream; returns at once (GPU tests: the copies must see the version held, whatever commits next)
        cycles = args[0]
        side = state.setdefault("side", torch.cuda.Stream())
        async with sub.hold(streams=[side]) as v:
            with torch.cuda.stream(side):
                torch.cuda._sleep(cycles)
                state["snap"] = (v, {n: t.clone() for n, t in state["model"].items()})
        return v
    if cmd == "sub_gpu_read_result":  # once the side stream is done: the version read, and whether exactly its bytes
        pub_spec = args[0]
        await asyncio.to_thread(state["side"].synchronize)
        v, snap = state.pop("snap")
        if v == 0:
            return 0, True
        want = seeded(pub_spec, v)
        return v, all(same_bytes(snap[n].cpu(), want[n].to(snap[n].dtype)) for n in want)
    if cmd == "sub_check_stamp":
        async with sub.hold() as v:
            return v, all(bool((t == v).all()) for t in state["model"].values())
    if cmd == "sub_reader_start":  # a reader loop: inside hold(), every tensor must carry one stamp
        stats = state["reader"] = {"checks": 0, "bad": [], "versions": set()}

        async def reader() -> None:
            while True:
                async with sub.hold() as v:
                    for name, t in state["model"].items():
                        lo, hi = t.min().item(), t.max().item()
                        if lo != hi or (v > 0 and lo != v):
                            stats["bad"].append((v, name, lo, hi))
                    stats["checks"] += 1
                    stats["versions"].add(v)
                await asyncio.sleep(0)

        state["reader_task"] = asyncio.ensure_future(reader())
        return None
    if cmd == "sub_reader_stop":
        task = state.pop("reader_task")
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        stats = state.pop("reader")
        return stats["checks"], stats["bad"][:10], sorted(stats["versions"])
    if cmd == "sub_hold":  # hold the weights for `seconds` in the background; None: until sub_release
        seconds = args[0]
        release = state["release"] = asyncio.Event()
        entered = asyncio.Event()

        async def hold() -> None:
            async with sub.hold():
                entered.set()
                if seconds is None:
                    await asyncio.wait_for(release.wait(), 120)  # (bounded: a test that forgets still ends)
                else:
                    await asyncio.sleep(seconds)

        state["holder"] = asyncio.ensure_future(hold())
        await asyncio.wait_for(entered.wait(), 30)
        return None
    if cmd == "sub_release":  # let go of an open-ended sub_hold; returns once the reader has left hold()
        state.pop("release").set()
        await state.pop("holder")
        return None
    if cmd == "sub_hold_views":  # hold for `seconds` with views taken at the start: do they keep their bytes?
        seconds = args[0]

        async def hold_views() -> bool:
            async with sub.hold():
                views = [t.view(-1) for t in state["model"].values()]
                before = [v.clone() for v in views]
                await asyncio.sleep(seconds)
                return all(bool((v == b).all()) for v, b in zip(views, before, strict=True))

        state["views_holder"] = asyncio.ensure_future(hold_views())
        await asyncio.sleep(0.05)
        return None
    if cmd == "sub_hold_views_result":
        return await state.pop("views_holder")
    if cmd == "sub_fork_child":  # a forked child (no exec) that lives `seconds`, as a DataLoader worker does
        import os

        pid = os.fork()
        if pid == 0:
            time.sleep(args[0])  # noqa: ASYNC251 - the forked child has no event loop to run
            os._exit(0)
        return pid
    if cmd == "sub_torn":
        return sub.torn
    if cmd == "sub_pushing":  # whether a push is in progress here (begun, not committed, dropped or aborted)
        return sub._push is not None
    if cmd == "sub_try_hold":  # hold() with a timeout: the version held, or "timeout"
        try:
            async with sub.hold(timeout=args[0]) as v:
                return v
        except TransportTimeoutError:
            return "timeout"
    if cmd == "sub_backing":  # where the live tensors' bytes lie: {name: (mapped file, perms)} from /proc/self/maps
        return {n: backing(t.data_ptr()) for n, t in state["model"].items() if t.numel()}
    if cmd == "sub_buffers":
        return sorted(ep.buffers)
    if cmd == "sub_write":  # write into the live weights (shared mode: a read-only mapping, so SIGSEGV)
        name = args[0]
        with torch.no_grad():
            state["model"][name].view(-1)[0] = 0
        return "written"
    if cmd == "sub_slow_begin":  # every Begin is served `seconds` late, as by a generator whose loop is busy
        seconds = args[0]
        served = sub._begin_checked

        async def late(peer: str, msg: Any) -> None:
            await asyncio.sleep(seconds)
            await served(peer, msg)

        sub._begin_checked = late
        return None
    if cmd == "sub_close":
        sub.close()
        return None
    raise ValueError(f"unknown command {cmd!r}")


def blocking_generator(name: str, store_url: str, spec: dict[str, tuple[str, tuple[int, ...]]], seed: int,
                       out: Any) -> None:
    """A generator without asyncio: BlockingEndpoint + BlockingWeightSubscriber (run in a spawned process)."""
    import transport
    from rl_sync import BlockingWeightSubscriber

    try:
        with transport.BlockingEndpoint(name, store=store_url, timeout=20) as ep:
            model = {n: poisoned(dt, tuple(sh)) for n, (dt, sh) in spec.items()}
            sub = BlockingWeightSubscriber(ep, model)
            out.put(("ready", sub.version))
            v = sub.wait_for_version(1, timeout=30)
            want = seeded(spec, seed)
            with sub.hold() as held:
                ok = all(same_bytes(model[n], want[n]) for n in spec)
            out.put(("done", v, held, ok))
            deadline = time.monotonic() + 30
            while ep.endpoint.is_open and time.monotonic() < deadline:
                try:
                    ep.next_notification(timeout=0.5)
                    break  # any application notification: stop
                except transport.TransportTimeoutError:
                    pass
            sub.close()
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))


@contextlib.contextmanager
def generators(store_url: str, uname: Any, n: int, spec: dict, *, planes: tuple[str, ...] | None = None,
               heartbeat_timeout: float = 10.0, ipc_engine: Any = None,
               **sub_kwargs: Any) -> Iterator[list[RemoteEndpoint]]:
    """``n`` spawned generator endpoints, each with a WeightSubscriber of layout ``spec`` (``sub_kwargs``
    its arguments: mode, commit_timeout, ...); killed on the way out."""
    kw: dict[str, Any] = {"store": store_url, "timeout": 20, "heartbeat_timeout": heartbeat_timeout}
    if planes:
        kw["planes"] = planes
    if ipc_engine is not None:
        kw["engines"] = {"cuda_ipc": ipc_engine}
    gens = [RemoteEndpoint(uname(f"gen{i}"), **kw) for i in range(n)]
    try:
        for g in gens:
            g.call("sub_create", spec, sub_kwargs)
        yield gens
    finally:
        for g in gens:
            g.kill()
