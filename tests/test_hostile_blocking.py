"""Hostile tests of the blocking API (``transport.BlockingEndpoint``, ``rl_sync.BlockingWeightSubscriber``)
under concurrency and failure: many caller threads at once, close() from one thread while others are in
calls, cancellation of submitted ops, frozen and killed peers, calls from the loop's own thread.

Real processes (spawn), real sockets, real shared memory. Every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import signal
import threading
import time

import pytest
import torch

import rl_sync
import transport
from tests._hostile_blocking_remote import Target, start_trainer, wait_reply
from tests._remote import wait_stopped

MiB = 1 << 20


# ---------------------------------------------------------------------------- helpers
def _fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return out


def _threads() -> set[str]:
    return {f"{t.name}#{t.ident}" for t in threading.enumerate()}


def _dev_shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


class Snapshot:
    """fds, threads and /dev/shm entries of this process, to compare before and after. ``store_url``:
    the process-wide store client (a thread and sockets kept for the process's life, by design) is
    made first, so it does not count."""

    def __init__(self, store_url: str | None = None) -> None:
        if store_url is not None:
            transport.BlockingEndpoint("hb-warm-" + os.urandom(4).hex(), store=store_url, timeout=10).close()
        gc.collect()
        self.fds, self.threads, self.shm = _fds(), _threads(), _dev_shm()

    def leaked(self, settle: float = 5.0) -> dict[str, set[str]]:
        end = time.monotonic() + settle
        while True:
            gc.collect()
            now = {"fds": _fds() - self.fds, "threads": _threads() - self.threads,
                   "dev_shm": _dev_shm() - self.shm}
            # threads that belong to pools living past the test (asyncio's default executor of other loops) aside
            now["threads"] = {t for t in now["threads"] if not t.startswith(("asyncio_", "ThreadPoolExecutor", "QueueFeederThread"))}
            # the test harness's own multiprocessing queues (pipes, semaphores) aside
            now["fds"] = {f for f in now["fds"] if "pipe:" not in f}
            now["dev_shm"] = {f for f in now["dev_shm"] if not f.startswith("sem.mp-")}
            if not any(now.values()) or time.monotonic() > end:
                return {k: v for k, v in now.items() if v}
            time.sleep(0.1)


def _run_threads(fns, join: float) -> list[threading.Thread]:
    ts = [threading.Thread(target=f, daemon=True) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join(join)
    return ts


@pytest.fixture
def target(store_url, uname):
    t = Target(uname("hb-tgt"), store=store_url, timeout=20)
    yield t
    t.kill()


# ============================================================================ close() vs other threads
@pytest.mark.timeout(90)
def test_two_threads_closing_at_once_both_return_promptly_and_release_everything(store_url, uname, target):
    """close() is documented idempotent and bounded by its timeout (5 s, plus the settle bound only for
    submitted ops still ending: there are none here). Two threads calling it at once must both return
    within that bound, without an untyped error, and the endpoint must be fully closed after."""
    target.call("register_fill", "w", 4096, 0)
    snap = Snapshot(store_url)
    ep = transport.BlockingEndpoint(uname("hb-cc"), store=store_url, timeout=10)
    ep.put(target.name, {"w": torch.ones(4096, dtype=torch.uint8)}, notify=b"x")  # a live channel
    out: dict[int, tuple[str, float]] = {}
    go = threading.Barrier(2)

    def closer(i: int) -> None:
        go.wait(5)
        t0 = time.monotonic()
        try:
            ep.close()
            out[i] = ("ok", time.monotonic() - t0)
        except BaseException as exc:  # noqa: BLE001
            out[i] = (repr(exc), time.monotonic() - t0)

    _run_threads([lambda: closer(0), lambda: closer(1)], join=60)
    assert len(out) == 2, f"a close() never returned within 60 s: {out}"
    slow = {i: r for i, r in out.items() if r[0] != "ok" or r[1] > 6.0}
    assert not slow, f"concurrent close(): {out}"
    ep = None
    leaked = snap.leaked()
    assert not leaked, f"left behind after both close() calls returned: {leaked}"


@pytest.mark.timeout(60)
def test_close_from_a_notification_callback_raises_clearly_and_leaves_nothing_behind(store_url, uname, target):
    """Blocking methods called on the loop thread (a notification callback) must raise at once, not
    deadlock; close() too. And whatever close() does there, the endpoint must not be left half-dead:
    a later close() from a normal thread closes it, and a pending submitted future resolves (its op's
    timeout is 3 s)."""
    target.call("register_fill", "w", 64, 0)
    snap = Snapshot(store_url)
    ep = transport.BlockingEndpoint(uname("hb-cb"), store=store_url, timeout=10)
    ep.connect(target.name)
    seen: list[tuple[str, str]] = []
    done = threading.Event()

    def cb(note) -> None:
        for what, fn in [("put", lambda: ep.put(target.name, {"w": torch.ones(64, dtype=torch.uint8)})),
                         ("submit_put", lambda: ep.submit_put(target.name, {"w": torch.ones(64, dtype=torch.uint8)})),
                         ("notify", lambda: ep.notify(target.name, b"n")),
                         ("call_in_loop", lambda: ep.call_in_loop(lambda: None)),
                         ("close", ep.close)]:
            try:
                fn()
                seen.append((what, "returned"))
            except BaseException as exc:  # noqa: BLE001
                seen.append((what, f"{type(exc).__name__}: {exc}"))
        done.set()

    ep.call_in_loop(lambda: ep.endpoint.on_notification(cb, prefix=b"poke"))
    pending = ep.submit_get("hb-nobody-" + uname("x"), {"w": torch.zeros(4, dtype=torch.uint8)}, timeout=3)
    ep2 = transport.BlockingEndpoint(uname("hb-poker"), store=store_url, timeout=10)
    try:
        ep2.notify(ep.name, b"poke")
        assert done.wait(10), f"the callback never finished: {seen}"
    finally:
        ep2.close()
    blocking_ones = [s for s in seen if s[0] != "close"]
    assert all("own event loop thread" in r for _, r in blocking_ones), seen
    try:
        pending.exception(10)  # the op's own deadline is 3 s
    except concurrent.futures.TimeoutError:
        pytest.fail(f"a submitted get (timeout=3) never resolved after close() was called in a callback; "
                    f"callback saw {seen}; endpoint state {ep.endpoint._state!r}, loop thread alive "
                    f"{ep._thread.is_alive()}")
    ep.close()
    assert not ep.endpoint.is_open, f"close() from a normal thread left the endpoint open (callback saw {seen})"
    ep = None
    leaked = snap.leaked()
    assert not leaked, f"left behind (callback saw {seen}): {leaked}"


@pytest.mark.timeout(90)
def test_calls_racing_close_end_with_endpoint_closed_promptly(store_url, uname):
    """Threads calling the endpoint (call_in_loop: what BlockingWeightSubscriber uses; register) while
    another thread closes it: each must end with EndpointClosedError (typed, saying what happened) soon
    after close() returned, not hang until its timeout + grace for a loop that is gone."""
    from torch.distributed import HashStore

    bad: list[tuple[int, str, float]] = []
    for rnd in range(4):
        ep = transport.BlockingEndpoint(uname("hb-race"), store=HashStore(), timeout=3)
        stop_at: list[float] = []

        def worker(i: int, ep=ep, rnd=rnd, stop_at=stop_at) -> None:
            n = 0
            while True:
                t0 = time.monotonic()
                try:
                    if i % 2:
                        ep.call_in_loop(lambda: None)
                    else:
                        ep.register(f"b{i}-{n}", torch.zeros(4))
                    n += 1
                except BaseException as exc:  # noqa: BLE001
                    end = time.monotonic()
                    late = end - (stop_at[0] if stop_at else t0)
                    if not isinstance(exc, transport.EndpointClosedError) or late > 1.5:
                        bad.append((rnd, f"{type(exc).__name__}: {exc}", round(end - t0, 2)))
                    return

        ts = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(4)]
        for t in ts:
            t.start()
        time.sleep(0.05)
        ep.close()
        stop_at.append(time.monotonic())
        for t in ts:
            t.join(20)
        assert not any(t.is_alive() for t in ts)
    gc.collect()  # (coroutines dropped with the stopped loop are reported here, not in a later test)
    assert not bad, f"calls that raced close(): {len(bad)} ended late or untyped: {bad[:6]}"


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (other tests' leftovers)
def test_close_while_threads_are_blocked_in_calls_and_hold_futures(store_url, uname, target):
    """Threads blocked in a put with notify to a frozen peer and in a get from it over tcp, plus
    submitted ops pending: close() from another thread ends every one of them with a
    typed error within close()'s bound, and nothing leaks."""
    target.call("register_fill", "w", 4 * MiB, 0)
    snap = Snapshot(store_url)
    ep = transport.BlockingEndpoint(uname("hb-cw"), store=store_url, timeout=20, planes=("tcp",))
    ep.connect(target.name)
    os.kill(target.pid, signal.SIGSTOP)
    wait_stopped(target.pid)
    try:
        res: dict[str, tuple[str, float]] = {}

        def call(tag, fn):
            def run():
                t0 = time.monotonic()
                try:
                    fn()
                    res[tag] = ("returned", time.monotonic() - t0)
                except BaseException as exc:  # noqa: BLE001
                    res[tag] = (type(exc).__name__, time.monotonic() - t0)
            return run

        buf = torch.zeros(4 * MiB, dtype=torch.uint8)
        fns = [call("put_notify", lambda: ep.put(target.name, {"w": torch.ones(4 * MiB, dtype=torch.uint8)},
                                                 notify=b"x", timeout=20)),
               call("get", lambda: ep.get(target.name, {"w": buf}, timeout=20))]
        futs = [ep.submit_put(target.name, {"w": torch.full((4 * MiB,), 3, dtype=torch.uint8)}, timeout=20),
                ep.submit_get(target.name, {"w": torch.zeros(4 * MiB, dtype=torch.uint8)}, timeout=20)]
        ts = [threading.Thread(target=f, daemon=True) for f in fns]
        for t in ts:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        ep.close(timeout=3)
        took = time.monotonic() - t0
        for t in ts:
            t.join(10)
        fut_out = []
        for f in futs:
            try:
                e = f.exception(5)
                fut_out.append(type(e).__name__ if e else "None")
            except concurrent.futures.TimeoutError:
                fut_out.append("unresolved")
        assert took < 3 + 2, f"close(timeout=3) took {took:.1f} s"
        assert set(res) == {"put_notify", "get"}, f"calls still blocked after close: {res}"
        for tag, (what, dt) in res.items():
            assert what in ("EndpointClosedError", "PeerLostError"), (tag, what, dt, res)
        assert all(x in ("EndpointClosedError", "PeerLostError") for x in fut_out), fut_out
    finally:
        os.kill(target.pid, signal.SIGCONT)
    ep = futs = fns = ts = None
    leaked = snap.leaked()
    assert not leaked, leaked


@pytest.mark.timeout(60)
def test_close_wakes_a_thread_blocked_in_next_notification(store_url, uname):
    """A thread blocked in next_notification(timeout=6) while another thread closes the endpoint must
    get EndpointClosedError (what next_notification documents for an endpoint that is not open) right
    after close() returned, not wait for a loop that is gone until timeout + grace."""
    ep = transport.BlockingEndpoint(uname("hb-nn"), store=store_url, timeout=20)
    res: list[tuple[str, float]] = []

    def waiter() -> None:
        try:
            ep.next_notification(timeout=6)
            res.append(("returned", time.monotonic()))
        except BaseException as exc:  # noqa: BLE001
            res.append((f"{type(exc).__name__}: {exc}", time.monotonic()))

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    time.sleep(0.5)
    ep.close()
    closed_at = time.monotonic()
    t.join(20)
    gc.collect()
    assert res, "next_notification never returned"
    what, at = res[0]
    assert what.startswith("EndpointClosedError") and at - closed_at < 1.0, \
        f"next_notification blocked across close(): {what!r}, {at - closed_at:.1f} s after close() returned"


@pytest.mark.timeout(60)
def test_gc_of_an_unclosed_blocking_endpoint_stops_its_loop_thread(store_url, uname):
    """A BlockingEndpoint dropped without close(): its loop thread, sockets and store record should not
    outlive it (an inference worker that rebuilds its engine leaks one loop thread per rebuild otherwise)."""
    snap = Snapshot(store_url)
    name = uname("hb-gc")
    ep = transport.BlockingEndpoint(name, store=store_url, timeout=10)
    ep.register("w", torch.zeros(1024))
    ep = None
    leaked = snap.leaked(settle=5.0)
    assert not leaked, f"a BlockingEndpoint dropped without close() left: {leaked}"


# ============================================================================ many threads, order, cancellation
@pytest.mark.timeout(60)
def test_many_threads_submit_then_notify_see_their_bytes_in_call_order(store_url, uname, target):
    """4 threads at once, each round of each thread in its own 8 MiB region of one shm buffer (threaded
    copies; no other op ever writes that region): submit_put of value v, then at once (not waiting) a
    blocking notify asking the target to check the region at delivery. notify()'s docstring: "a
    notification sent after a put arrives after that put's bytes"; the target must see all v."""
    nthreads, region, rounds = 4, 8 * MiB, 3
    target.call("register_fill", "w", nthreads * rounds * region, 0)
    with transport.BlockingEndpoint(uname("hb-mt"), store=store_url, timeout=20, planes=("shm",)) as ep:
        ep.connect(target.name)
        errs: list[str] = []

        def worker(i: int) -> None:
            try:
                for k in range(rounds):
                    v = i * rounds + k + 1
                    off = (i * rounds + k) * region
                    fut = ep.submit_put(target.name,
                                        {"w": transport.At(torch.full((region,), v, dtype=torch.uint8), off)})
                    ep.notify(target.name, f"chk:w:{off}:{region}:{v}".encode())
                    fut.result(20)
                    out = torch.zeros(region, dtype=torch.uint8)
                    ep.get(target.name, {"w": transport.At(out, off)})
                    if not bool((out == v).all()):
                        errs.append(f"thread {i} round {k}: got back {out.unique().tolist()} not {v}")
            except BaseException as exc:  # noqa: BLE001
                errs.append(f"thread {i}: {type(exc).__name__}: {exc}")

        ts = _run_threads([lambda i=i: worker(i) for i in range(nthreads)], join=45)
        assert not any(t.is_alive() for t in ts) and not errs, errs
        deadline = time.monotonic() + 10
        while len(seen := target.call("seen")) < nthreads * rounds and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(seen) == nthreads * rounds
        early = [p.decode() for p, ok in seen if not ok]
        assert not early, f"{len(early)}/{len(seen)} notifications reached the target before the put called " \
                          f"before them landed: {early[:5]}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delay", [0.0, 0.001, 0.004, 0.015])
def test_cancel_of_a_submitted_put_at_any_point_returns_false_and_never_overwrites_a_later_put(
        store_url, uname, target, delay):
    """submit_put A (24 MiB of 1s: a threaded copy in the middle when cancel() is called), cancel() it,
    submit_put B (all 2s) into the same bytes. The docstring: cancel() returns False, the op runs to its
    end. Call order to a peer: B lands after A, so the target ends all 2s, never a mix."""
    n = 24 * MiB
    target.call("register_fill", "w", n, 0)
    with transport.BlockingEndpoint(uname("hb-cn"), store=store_url, timeout=20, planes=("shm",)) as ep:
        ep.connect(target.name)
        a_src = torch.full((n,), 1, dtype=torch.uint8)
        b_src = torch.full((n,), 2, dtype=torch.uint8)
        for rep in range(3):
            fa = ep.submit_put(target.name, {"w": a_src})
            if delay:
                time.sleep(delay)
            assert fa.cancel() is False and not fa.cancelled()
            fb = ep.submit_put(target.name, {"w": b_src})
            assert fa.result(20) is None and not fa.cancelled()
            assert fb.result(20) is None
            counts = target.call("counts", "w", [0, 1, 2])
            assert counts == {0: 0, 1: 0, 2: n}, f"rep {rep}: after A (cancelled at {delay}s) then B: {counts}"
            ep.put(target.name, {"w": torch.zeros(n, dtype=torch.uint8)})


# ============================================================================ frozen / killed peer
@pytest.mark.timeout(60)
def test_timeouts_bound_blocking_calls_to_a_frozen_peer(store_url, uname, target):
    """A SIGSTOPped peer: put with notify and get over tcp, notify, and a submitted put each end with
    TransportTimeoutError at their own timeout (plus a small slack), from 4 threads at once; the endpoint
    stays usable for the peer once it resumes."""
    target.call("register_fill", "w", 1 * MiB, 0)
    with transport.BlockingEndpoint(uname("hb-fz"), store=store_url, timeout=20, planes=("tcp",)) as ep:
        ep.connect(target.name)
        os.kill(target.pid, signal.SIGSTOP)
        wait_stopped(target.pid)
        res: dict[str, tuple[str, float]] = {}
        try:
            def call(tag, fn):
                def run():
                    t0 = time.monotonic()
                    try:
                        fn()
                        res[tag] = ("returned", time.monotonic() - t0)
                    except BaseException as exc:  # noqa: BLE001
                        res[tag] = (type(exc).__name__, time.monotonic() - t0)
                return run

            one = torch.ones(1 * MiB, dtype=torch.uint8)
            _run_threads([
                call("put", lambda: ep.put(target.name, {"w": one}, notify=b"p", timeout=1.5)),
                call("get", lambda: ep.get(target.name, {"w": torch.zeros(1 * MiB, dtype=torch.uint8)}, timeout=1.5)),
                call("notify", lambda: ep.notify(target.name, b"n", timeout=1.5)),
                call("submit", lambda: ep.submit_put(target.name, {"w": one}, timeout=1.5).result(10)),
            ], join=20)
        finally:
            os.kill(target.pid, signal.SIGCONT)
        assert set(res) == {"put", "get", "notify", "submit"}, res
        for tag, (what, dt) in res.items():
            assert what == "TransportTimeoutError" and dt < 1.5 + 2.0, (tag, what, dt, res)
        ep.put(target.name, {"w": torch.full((1 * MiB,), 5, dtype=torch.uint8)}, timeout=15)
        assert target.call("counts", "w", [5]) == {5: 1 * MiB}


@pytest.mark.timeout(60)
def test_peer_killed_while_blocking_calls_wait(store_url, uname, target):
    """kill -9 of a frozen peer while threads wait in put/get/notify with long timeouts: each ends with
    PeerLostError (or a TransportError) well before its 25 s timeout; a later call redials and fails
    with a typed error, not a hang."""
    target.call("register_fill", "w", 1 * MiB, 0)
    with transport.BlockingEndpoint(uname("hb-kl"), store=store_url, timeout=25, planes=("tcp",)) as ep:
        ep.connect(target.name)
        os.kill(target.pid, signal.SIGSTOP)
        wait_stopped(target.pid)
        res: dict[str, tuple[str, float]] = {}

        def call(tag, fn):
            def run():
                t0 = time.monotonic()
                try:
                    fn()
                    res[tag] = ("returned", time.monotonic() - t0)
                except BaseException as exc:  # noqa: BLE001
                    res[tag] = (type(exc).__name__, time.monotonic() - t0)
            return run

        one = torch.ones(1 * MiB, dtype=torch.uint8)
        fns = [call("put", lambda: ep.put(target.name, {"w": one}, notify=b"p", timeout=25)),
               call("get", lambda: ep.get(target.name, {"w": torch.zeros(1 * MiB, dtype=torch.uint8)}, timeout=25)),
               call("notify", lambda: ep.notify(target.name, b"n", timeout=25)),
               call("submit", lambda: ep.submit_get(target.name, {"w": torch.zeros(1 * MiB, dtype=torch.uint8)},
                                                    timeout=25).result(30))]
        ts = [threading.Thread(target=f, daemon=True) for f in fns]
        for t in ts:
            t.start()
        time.sleep(0.5)
        t_kill = time.monotonic()
        os.kill(target.pid, signal.SIGKILL)
        for t in ts:
            t.join(20)
        assert set(res) == {"put", "get", "notify", "submit"}, f"still waiting {time.monotonic() - t_kill:.1f} s " \
                                                               f"after the kill: {res}"
        for tag, (what, dt) in res.items():
            assert what in ("PeerLostError", "EndpointClosedError") and dt < 10, (tag, what, dt, res)
        t0 = time.monotonic()
        with pytest.raises(transport.TransportError):
            ep.put(target.name, {"w": one}, timeout=3)
        assert time.monotonic() - t0 < 3 + 2


# ============================================================================ rl_sync blocking subscriber
SPEC = {"a": ("float32", (256, 64)), "b": ("float32", (64,)), "c": ("int64", (3, 5)), "d": ("float32", (40000,))}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["staged", "swap", "direct"])
def test_blocking_holders_in_many_threads_never_see_a_mixed_version(store_url, uname, mode):
    """6 reader threads loop in hold() while a trainer process pushes versions 1..N (every element of
    every tensor == the version): inside a hold every tensor must hold exactly the version yielded."""
    with transport.BlockingEndpoint(uname("hb-sub"), store=store_url, timeout=20) as ep:
        model = {n: torch.zeros(sh, dtype=getattr(torch, dt)) for n, (dt, sh) in SPEC.items()}
        sub = rl_sync.BlockingWeightSubscriber(ep, model, mode=mode, commit_timeout=10)
        stop = threading.Event()
        bad: list[str] = []
        stats = {"checks": 0, "versions": set()}

        def reader(i: int) -> None:
            while not stop.is_set():
                try:
                    with sub.hold(timeout=10) as v:
                        for n, t in model.items():
                            if t.numel() and not bool((t == v).all()):
                                bad.append(f"reader {i}: held {v}, {n} holds {t.unique()[:4].tolist()}")
                                break
                        stats["checks"] += 1
                        stats["versions"].add(v)
                except BaseException as exc:  # noqa: BLE001
                    bad.append(f"reader {i}: {type(exc).__name__}: {exc}")
                    return

        ts = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(6)]
        for t in ts:
            t.start()
        p, q = start_trainer(uname("hb-trainer"), store_url, ep.name, SPEC, 12)
        try:
            reply = wait_reply(q, 70)
        finally:
            stop.set()
            for t in ts:
                t.join(15)
            p.join(10)
            if p.is_alive():
                p.kill()
        assert reply[0] == "done", reply
        assert reply[1] == 12, reply
        assert not bad, bad[:5]
        assert sub.version == 12 and stats["checks"] > 0, stats
        sub.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_close_while_readers_hold_keeps_their_version_whole(store_url, uname, mode):
    """Readers inside hold() while BlockingWeightSubscriber.close() and the endpoint's close() run from
    another thread: the weights they hold never change under them, close() returns (bounded), readers
    leave normally, and nothing leaks."""
    snap = Snapshot(store_url)
    ep = transport.BlockingEndpoint(uname("hb-subc"), store=store_url, timeout=20)
    model = {n: torch.zeros(sh, dtype=getattr(torch, dt)) for n, (dt, sh) in SPEC.items()}
    sub = rl_sync.BlockingWeightSubscriber(ep, model, mode=mode)
    p, q = start_trainer(uname("hb-trainer"), store_url, ep.name, SPEC, 2)
    try:
        reply = wait_reply(q, 40)
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    assert reply[:2] == ("done", 2), reply
    assert sub.wait_for_version(2, timeout=5) == 2
    inside = threading.Barrier(5)
    leave = threading.Event()
    bad: list[str] = []

    def reader(i: int) -> None:
        try:
            with sub.hold(timeout=5) as v:
                inside.wait(5)
                while not leave.is_set():
                    for n, t in model.items():
                        if t.numel() and not bool((t == v).all()):
                            bad.append(f"reader {i}: held {v}, {n} changed")
                            return
                    time.sleep(0.01)
        except BaseException as exc:  # noqa: BLE001
            bad.append(f"reader {i}: {type(exc).__name__}: {exc}")

    ts = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(4)]
    for t in ts:
        t.start()
    inside.wait(10)
    t0 = time.monotonic()
    sub.close()
    ep.close()
    took = time.monotonic() - t0
    time.sleep(0.3)
    leave.set()
    for t in ts:
        t.join(10)
    assert took < 10, took
    assert not bad, bad
    assert all(bool((t == 2).all()) for t in model.values() if t.numel())
    with sub.hold(timeout=2) as v:  # a closed subscriber's weights stay readable
        assert v == 2
    sub = ep = model = ts = None  # (a closed endpoint keeps its slot table's fd until collected; direct: the arena is the weights)
    leaked = snap.leaked()
    assert not leaked, leaked


@pytest.mark.timeout(30)
def test_blocking_subscriber_methods_from_the_loop_thread_raise_at_once(store_url, uname):
    """BlockingWeightSubscriber's docstring: its methods block the calling thread, any thread but the
    loop's. Called on the loop's thread (a notification callback, call_in_loop) wait_for_version would
    block the loop that must serve the commit it waits for: it must raise at once, as
    BlockingEndpoint's methods do, not block the loop until its timeout (or forever with None)."""
    with transport.BlockingEndpoint(uname("hb-subl"), store=store_url, timeout=10) as ep:
        model = {n: torch.zeros(sh, dtype=getattr(torch, dt)) for n, (dt, sh) in SPEC.items()}
        sub = rl_sync.BlockingWeightSubscriber(ep, model)
        t0 = time.monotonic()
        try:
            ep.call_in_loop(lambda: sub.wait_for_version(1, timeout=3), timeout=10)
            outcome = "returned"
        except BaseException as exc:  # noqa: BLE001
            outcome = f"{type(exc).__name__}: {exc}"
        took = time.monotonic() - t0
        assert outcome.startswith("RuntimeError") and took < 1.0, \
            f"wait_for_version on the loop thread: {outcome} after {took:.1f} s (the loop was blocked meanwhile)"
        sub.close()
