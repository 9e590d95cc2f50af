"""A real Endpoint in a spawned process, driven over a pipe.

Tests use it to put real processes on both sides of a channel: the child runs
its own event loop and Endpoint; the test sends commands (register a poisoned
buffer, check its contents against fresh random data, put, get, ...) and
every reply is awaited with a bound. Commands that make tensors take an
optional last argument ``device`` (default ``"cpu"``; e.g. ``"cuda:0"``):
the data is made on the CPU from the seed and moved there.

``RemoteEndpoint(name, commands="tests.MODULE", ...)`` adds a test file's own commands: the
child imports that module, calls its ``setup(ep, state)`` if it has one once the endpoint is
open, and asks its ``async handle(ep, state, cmd, args)`` first for every command (it returns
:data:`NOT_MINE` for the ones it leaves to this module). ``stage_cpu=True`` stages CPU tensors
through a small thread copy engine (the staged path's CPU stand-in).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from typing import Any

import torch

_CTX = mp.get_context("spawn")
POISON = 0xA5
NOT_MINE = object()  # what a test module's handle() returns for a command it leaves to _child_main


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def make_tensor(dtype: str | torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Fresh deterministic random data of any supported dtype."""
    dt = dtype_of(dtype) if isinstance(dtype, str) else dtype
    g = torch.Generator().manual_seed(seed)
    if dt.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dt)
    if dt == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dt == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.int64).to(torch.uint8)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64).to(dt)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def poisoned(dtype: str | torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    dt = dtype_of(dtype) if isinstance(dtype, str) else dtype
    t = torch.empty(shape, dtype=dt)
    as_bytes(t).fill_(POISON)
    return t


def backing(addr: int) -> tuple[str, str]:
    """The file mapped at ``addr`` in this process, and the mapping's permissions (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return (parts[5].strip() if len(parts) > 5 else "", parts[1])
    return ("?", "?")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


# ---------------------------------------------------------------------------- child side
def landed_elements(held: list[list[list[int]]]) -> set[int]:
    """The elements some put landed in, from "churn"'s results (per registration taken back, each
    element's ``(min, max)``; every put writes its own index into its own element). Asserts that
    no element holds bytes of no put of it (torn, or another's)."""
    landed = set()
    for reg in held:
        for pos, (lo, hi) in enumerate(reg):
            assert lo == hi and lo in (0, pos), f"element {pos} holds {lo}..{hi}: bytes of no put of it"
            if lo:
                landed.add(pos)
    return landed


def _child_main(conn: Any, name: str, kwargs: dict[str, Any]) -> None:
    import logging

    import transport

    logging.basicConfig(level=logging.WARNING)
    loop = asyncio.new_event_loop()
    state: dict[str, Any] = {"bufs": {}}

    cuda_device = kwargs.pop("cuda_device", None)
    extra = importlib.import_module(kwargs.pop("commands")) if kwargs.get("commands") else None
    kwargs.pop("commands", None)
    if kwargs.pop("stage_cpu", False):
        from transport.staging import StagingConfig, ThreadCopyEngine

        kwargs["staging"] = StagingConfig(chunk_bytes=1 << 20, buffers=4, cpu_engine=ThreadCopyEngine)

    async def open_ep() -> transport.Endpoint:
        if cuda_device is not None:  # use CUDA before creating the endpoint (it offers nccl only then)
            torch.cuda.set_device(cuda_device)
            torch.cuda.init()
        ep = transport.Endpoint(name, **kwargs)
        await ep.open()
        return ep

    try:
        ep = loop.run_until_complete(open_ep())
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    if extra is not None and hasattr(extra, "setup"):
        extra.setup(ep, state)
    conn.send(("ok", {"incarnation": ep.incarnation, "pid": os.getpid()}, ""))

    async def handle(cmd: str, args: tuple[Any, ...]) -> Any:
        if extra is not None:
            got = await extra.handle(ep, state, cmd, args)
            if got is not NOT_MINE:
                return got
        bufs = state["bufs"]
        if cmd == "register":
            bname, dtype, shape, *dev = args
            t = poisoned(dtype, tuple(shape)).to(*dev or ["cpu"])
            bufs[bname] = t
            ep.register(bname, t)
            return None
        if cmd == "register_data":
            bname, dtype, shape, seed, *dev = args
            t = make_tensor(dtype, tuple(shape), seed).to(*dev or ["cpu"])
            bufs[bname] = t
            ep.register(bname, t)
            return None
        if cmd == "unregister":
            ep.unregister(args[0])
            bufs.pop(args[0], None)
            return None
        if cmd == "repoint":  # re-point the registered tensor `name` at fresh poisoned memory (`.data =`, as
            # module.to() does), without telling the endpoint; "re_register" registers it again
            t = bufs[args[0]]
            t.data = poisoned(str(t.dtype).removeprefix("torch."), tuple(t.shape)).to(t.device)
            return None
        if cmd == "re_register":  # unregister `name` and register the same tensor object again
            ep.unregister(args[0])
            ep.register(args[0], bufs[args[0]])
            return None
        if cmd == "reregister":  # take `name` back and register a fresh poisoned buffer of `dtype`/`shape` under it;
            # the old tensor is kept (as `name` + "#old", for "check") to see that nothing more lands in it
            bname, dtype, shape, *dev = args
            old = bufs[bname]
            ep.unregister(bname)
            bufs[bname + "#old"] = old
            t = poisoned(dtype, tuple(shape)).to(*dev or ["cpu"])
            bufs[bname] = t
            ep.register(bname, t)
            return None
        if cmd == "register_view":  # register elements [start, start + count) of registered buffer `base` as `name`
            bname, base, start, count = args  # (a view of an arena: it shares the arena's segment, at its place)
            t = bufs[base].reshape(-1)[start : start + count]
            bufs[bname] = t
            ep.register(bname, t)
            return None
        if cmd == "all_equal":  # whether elements [start, start + count) of `name` all hold `value`
            bname, start, count, value = args
            return bool((bufs[bname].cpu().reshape(-1)[start : start + count] == value).all())
        if cmd == "register_fill":  # a flat uint8 buffer of `nbytes` bytes, each `value` (cancellation races)
            bname, nbytes, value, *dev = args
            t = torch.full((nbytes,), value, dtype=torch.uint8, device=(dev or ["cpu"])[0])
            bufs[bname] = t
            ep.register(bname, t)
            return None
        if cmd in ("holds", "count"):  # what a register_fill buffer holds (off the loop: it keeps serving)
            from tests._race_remote import count, describe

            t = bufs[args[0]]
            return await asyncio.to_thread(describe if cmd == "holds" else count, t.cpu(), args[1])
        if cmd == "check":
            bname, seed = args[0], args[1]
            t = bufs[bname].cpu()
            return same_bytes(t, make_tensor(t.dtype, tuple(t.shape), seed))
        if cmd == "check_range":
            bname, seed, offset, count = args
            t = bufs[bname].cpu().reshape(-1)
            want = make_tensor(t.dtype, (count,), seed)
            return same_bytes(t[offset : offset + count].contiguous(), want)
        if cmd == "is_poisoned":
            t = bufs[args[0]].cpu()
            return bool((as_bytes(t) == POISON).all())
        if cmd == "put":
            peer, spec, timeout, *dev = args
            data = {n: make_tensor(dt, tuple(sh), sd).to(*dev or ["cpu"]) for n, (dt, sh, sd) in spec.items()}
            await ep.put(peer, data, timeout=timeout)
            return None
        if cmd == "put_many":  # concurrently to several peers: [(peer, spec)]
            jobs, timeout = args
            await asyncio.gather(*[
                ep.put(p, {n: make_tensor(dt, tuple(sh), sd) for n, (dt, sh, sd) in spec.items()}, timeout=timeout)
                for p, spec in jobs
            ])
            return None
        if cmd == "get_check":
            peer, spec, timeout, *dev = args
            outs = {n: poisoned(dt, tuple(sh)).to(*dev or ["cpu"]) for n, (dt, sh, _) in spec.items()}
            await ep.get(peer, outs, timeout=timeout)
            return {n: same_bytes(outs[n].cpu(), make_tensor(dt, tuple(sh), sd)) for n, (dt, sh, sd) in spec.items()}
        if cmd == "churn":  # take buffer `name` back and register a fresh one, `cycles` times, every `period` s;
            # returns what each taken-back registration held: its values, by region of `region` elements
            bname, cycles, period, region = args
            held = []
            for _ in range(cycles):
                await asyncio.sleep(period)
                t = bufs[bname]
                ep.unregister(bname)  # (moves the bytes out of the segment into private memory, in place)
                fresh = torch.zeros_like(t)
                bufs[bname] = fresh
                ep.register(bname, fresh)
                held.append(t)
            return [torch.stack([t.reshape(-1, region).amin(1), t.reshape(-1, region).amax(1)], 1).tolist()
                    for t in held]
        if cmd == "churn_timed":  # as churn (zero-filled fresh buffers), returning how long each unregister took
            bname, cycles, period = args
            took = []
            for _ in range(cycles):
                await asyncio.sleep(period)
                t = bufs[bname]
                t0 = time.monotonic()
                ep.unregister(bname)
                took.append(time.monotonic() - t0)
                bufs[bname] = torch.zeros_like(t)
                ep.register(bname, bufs[bname])
            return took
        if cmd == "slow_shm_copies":  # every shm copy of this endpoint sleeps `seconds` before it starts (`args[1]`:
            # small ones too, which run_here otherwise copies at once)
            from transport.planes.shm import ShmPlane

            seconds = args[0]
            real_copy = ShmPlane._copy_one

            def slow_copy(self: Any, *a: Any, **k: Any) -> Any:
                time.sleep(seconds)
                return real_copy(self, *a, **k)

            ShmPlane._copy_one = slow_copy  # type: ignore[method-assign]
            if len(args) > 1 and args[1]:  # small copies too (else done on the loop by run_here, not slowed)
                ShmPlane.run_here = lambda self, kind, pairs: False  # type: ignore[method-assign]
            return None
        if cmd == "split_shm_copies":  # every shm copy into a peer writes half, sleeps `seconds`, writes the rest
            from transport.planes.shm import ShmPlane

            seconds = args[0]
            real_copy = ShmPlane._copy_one

            def split_copy(self: Any, op: Any, t: torch.Tensor, remote: torch.Tensor, into_peer: bool) -> bool:
                if not into_peer or t.numel() < 2:
                    return real_copy(self, op, t, remote, into_peer)
                half = t.numel() // 2
                flat, dst = t.reshape(-1), remote.view(t.dtype)
                dst[:half].copy_(flat[:half])
                time.sleep(seconds)
                dst[half:].copy_(flat[half:])
                return True

            ShmPlane._copy_one = split_copy  # type: ignore[method-assign]
            return None
        if cmd == "put_regions":  # puts j = 1..count, each filling region j % regions with the value j
            peer, bname, region, regions, count, timeout = args
            ok = typed = 0
            other: list[str] = []
            for j in range(1, count + 1):
                try:
                    await ep.put(peer, {bname: transport.At(torch.full((region,), float(j)), (j % regions) * region)},
                                 timeout=timeout)
                    ok += 1
                except (transport.StaleBufferError, transport.UnknownBufferError):
                    typed += 1
                except transport.TransportError as exc:
                    other.append(f"{type(exc).__name__}: {exc}")
            return ok, typed, other
        if cmd == "put_error":  # a put that is expected to fail: the exception's type and text ("" if it did not)
            peer, spec, timeout, *notify = args  # (notify: bytes, a message the peer's endpoint must serve)
            data = {n: make_tensor(dt, tuple(sh), sd) for n, (dt, sh, sd) in spec.items()}
            try:
                await ep.put(peer, data, timeout=timeout, notify=notify[0] if notify else None)
            except transport.TransportError as exc:
                return f"{type(exc).__name__}: {exc}"
            return ""
        if cmd == "lag":  # make this side's reader of the channel to `peer` sleep before a handler
            peer, method, seconds = args
            await ep.connect(peer)
            ch = ep._channels[peer]
            *path, method = method.split(".")  # e.g. "_target._serve_via_link": a method of the channel's target half
            for part in path:
                ch = getattr(ch, part)
            real = getattr(ch, method)

            def slow(*a: Any, **k: Any) -> Any:
                time.sleep(seconds)
                return real(*a, **k)

            setattr(ch, method, slow)
            return None
        if cmd == "fence_s":  # how long a new channel's reader waits for the peer's old channels' (transport.fence)
            from transport import fence
            fence.FENCE_S = float(args[0])
            return None
        if cmd == "peer_has":  # whether our copy of `peer`'s registry names `name`
            peer, bname = args
            return bname in (await ep.connect(peer)).buffers
        if cmd == "connect":
            await ep.connect(args[0])
            return None
        if cmd == "ipc_held":  # unregistered cuda_ipc exports held for peers: export id -> epoch it left
            return ep._exports.exporter("cuda_ipc").retention.held
        if cmd == "staging_stats":
            st = ep.staging.statistics()
            return {"in_use": st.in_use, "peak_in_use": st.peak_in_use, "allocated": st.allocated}
        if cmd == "peer_planes":
            p = await ep.connect(args[0])
            return {"plane": p.plane, "gpu_plane": p.gpu_plane, "gpu_reason": p.gpu_plane_reason, "socket": p.socket}
        if cmd == "peer_specs_local":  # the names this endpoint has registered
            return sorted(ep.buffers)
        if cmd == "op_planes":  # the planes this side's ops of a kind took, as its flight recorder has them
            return sorted({r["plane"] for r in ep.recorder.snapshot()
                           if r["kind"] == args[0] and r["role"] == "initiator" and r["nbytes"]})
        if cmd == "target_ops":  # how many put/get headers this side served as a target (its flight recorder)
            return sum(1 for r in ep.recorder.snapshot() if r["role"] == "target" and r["kind"] in ("put", "get"))
        if cmd == "notifications":
            count, timeout = args
            out = []
            for _ in range(count):
                note = await ep.next_notification(timeout)
                out.append((note.peer, note.payload))
            return out
        if cmd == "notify":
            peer, payload = args
            await ep.notify(peer, payload)
            return None
        if cmd == "notify_after":  # wait `delay` s, then notify `peer`: how long that took (s), or the error
            peer, payload, delay, timeout = args
            await asyncio.sleep(delay)
            t0 = time.monotonic()
            try:
                await ep.notify(peer, payload, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 (reported to the test)
                return f"{type(exc).__name__} after {time.monotonic() - t0:.2f} s: {exc}"
            return time.monotonic() - t0
        if cmd == "post":  # posted notifications (nothing answers them), in order
            peer, payloads = args
            for payload in payloads:
                await ep.post(peer, payload)
            return None
        if cmd == "dump":
            return str(ep.dump_flight_recorder(args[0]))
        if cmd == "store_url":
            return ep.store_url
        if cmd == "peer_incarnation":
            p = await ep.connect(args[0])
            return p.incarnation
        if cmd.startswith("sub_"):
            from tests._rl_remote import handle_sub

            return await handle_sub(ep, state, cmd, args)
        raise ValueError(f"unknown command {cmd!r}")

    threading.Thread(target=serve_commands, args=(conn, loop, handle), daemon=True).start()
    loop.run_forever()
    loop.run_until_complete(ep.close())
    loop.close()
    try:
        conn.send(("ok", "stopped", ""))
    except OSError:
        pass


def serve_commands(conn: Any, loop: asyncio.AbstractEventLoop, handle: Any, timeout: float | None = None) -> None:
    """A child's command thread: each ``(cmd, args)`` read from ``conn`` runs ``handle(cmd, args)``
    on ``loop`` (answered ``("ok", result, "")`` or ``("err", message, traceback)``, waiting at most
    ``timeout`` for it); ``"stop"`` or a closed pipe stops the loop."""
    while True:
        try:
            if not conn.poll(0.2):
                continue
            cmd, args = conn.recv()
        except (EOFError, OSError):
            break
        if cmd == "stop":
            break
        fut = asyncio.run_coroutine_threadsafe(handle(cmd, args), loop)
        try:
            conn.send(("ok", fut.result(timeout), ""))
        except BaseException as exc:  # report any failure to the test
            conn.send(("err", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    loop.call_soon_threadsafe(loop.stop)


# ---------------------------------------------------------------------------- test side
class RemoteError(Exception):
    pass


def pipe_reply(conn: Any, name: str, timeout: float) -> Any:
    """A child's next ``(status, value, traceback)`` reply on ``conn``, within ``timeout`` seconds:
    the value, or :class:`RemoteError` with the child's traceback, or ``TimeoutError``."""
    if not conn.poll(timeout):
        raise TimeoutError(f"{name}: no reply within {timeout} s")
    status, value, tb = conn.recv()
    if status != "ok":
        raise RemoteError(f"{name}: {value}\n{tb}")
    return value


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait (bounded) until every thread of ``pid`` is in the stopped state ('T' in /proc)."""
    end = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue
        if states and all(st in ("T", "t") for st in states):
            return
        if time.monotonic() > end:
            raise AssertionError(f"process {pid} did not stop within {timeout} s (thread states {states})")
        time.sleep(0.005)


class RemoteEndpoint:
    """Handle on an Endpoint in a spawned child process."""

    def __init__(self, name: str, ready_timeout: float = 60.0, **kwargs: Any) -> None:
        self.name = name
        self._conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=_child_main, args=(child, name, kwargs), daemon=True)
        self.proc.start()
        child.close()
        info = self._reply(ready_timeout)
        self.incarnation = info["incarnation"]
        self.pid = info["pid"]

    def _reply(self, timeout: float) -> Any:
        return pipe_reply(self._conn, self.name, timeout)

    def call(self, cmd: str, *args: Any, timeout: float = 60.0) -> Any:
        self._conn.send((cmd, args))
        return self._reply(timeout)

    def start(self, cmd: str, *args: Any) -> None:
        """Send a command without waiting; collect with :meth:`result`."""
        self._conn.send((cmd, args))

    def result(self, timeout: float = 60.0) -> Any:
        return self._reply(timeout)

    def signal(self, sig: int) -> None:
        """Send ``sig``; for SIGSTOP, return only once every thread of the process is stopped (a signal
        is delivered asynchronously: on a loaded VM a thread may run on for a while after kill())."""
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGSTOP:
            wait_stopped(self.proc.pid)

    def kill(self) -> None:
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.kill()
        self.proc.join(10)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send(("stop", ()))
                self._conn.poll(timeout)
            except (OSError, EOFError):
                pass
            self.proc.join(timeout)
        self.kill()
        self._conn.close()


# ---------------------------------------------------------------------------- test helpers
@contextlib.contextmanager
def child_env(env: dict[str, str] | None) -> Any:
    """Set ``env`` in this process's environment for the block (spawned children take the
    environment of the moment they start), then put back what was there."""
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def open_fds() -> list[str]:
    """What this process's open file descriptors point at (``readlink`` of each), sorted."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # (the listing's own descriptor, or one closed meanwhile)
            pass
    return sorted(out)


async def until(cond: Any, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``cond()`` (bounded) from a test's event loop; AssertionError if it never holds."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        await asyncio.sleep(0.02)


def op_records(ep: Any, kind: str, role: str = "initiator") -> list[dict]:
    """The flight-recorder records of ``ep``'s ops of ``kind`` in ``role``."""
    return [r for r in ep.recorder.snapshot() if r["kind"] == kind and r["role"] == role]


async def put_get_every_shape(init: Any, target: RemoteEndpoint, dtype: str, shapes: Any, uname: Any,
                              seed: Any) -> None:
    """For each shape: the target registers a poisoned buffer, ``init`` puts fresh data into it
    (checked there) and gets it back into a poisoned tensor (checked here)."""
    for shape in shapes:
        name = uname("w")
        target.call("register", name, dtype, shape)
        s = seed()
        await init.put(target.name, {name: make_tensor(dtype, shape, s)})
        assert target.call("check", name, s), (dtype, shape)
        out = poisoned(dtype, shape)
        await init.get(target.name, {name: out})
        assert same_bytes(out, make_tensor(dtype, shape, s)), (dtype, shape)



async def put_behind_side_stream(ep: Any, peer: str, name: str, shape: tuple[int, ...], seed: int, cycles: int,
                                 device: str = "cuda:0", timeout: float = 60) -> None:
    """Put ``make_tensor("float32", shape, seed)`` into ``peer``'s ``name`` from a CUDA tensor that
    a side stream writes right before the call, behind a ``cycles``-long kernel: a put that does
    not wait for the caller's stream sends zeros (GPU tests)."""
    want = make_tensor("float32", shape, seed).to(device)
    src = torch.zeros(shape, device=device)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        src.copy_(want)
        await ep.put(peer, {name: src}, timeout=timeout)
