"""A small op reading its own answer on the event loop before it sleeps (transport.answer_spin).

What must hold, with real processes and sockets:
- small puts, gets and notifications over tcp read their answers in the op's own coroutine (the
  spin catches them) and move exact bytes, in order;
- a frozen peer costs almost nothing: after a few spins that ran out of budget, a channel lets
  most ops by without spinning, and it spins (and catches answers) again once the peer is back;
- an op never spins while the event loop has other work ready (the ops of a ``gather``, another
  task): it awaits at once;
- a loop of ops whose answers the spin catches still gives the event loop its turns (timers run),
  and callers resume in the order their answers came;
- an op's deadline bounds its spin; an endpoint of this same process is never spun for;
- an op larger than 64 KiB spins only once all its bytes are in the kernel (a 128 KiB put taken
  whole by the sender's fast path spins and catches its answer; a 2 MiB one, mostly queued for
  the writer thread, never spins), and its misses are its own: small ops to a frozen peer still
  spin after a large op's miss;
- ``TRANSPORT_SPIN_US`` is checked: a bad value is logged as an error and the default used,
  ``0`` turns spinning off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

import pytest

import transport
from tests._remote import RemoteEndpoint, make_tensor
from transport import answer_spin
from transport.errors import TransportTimeoutError

SIZE = 4096


def _spin(ep: transport.Endpoint, peer: str) -> answer_spin.AnswerSpin:
    return ep._channels[peer].ops.spin


@contextlib.asynccontextmanager
async def _pair(store_url, uname, budget: float, *, timeout: float = 10.0, names: tuple[str, ...] = ("x",)):
    """A target process B with a 4 KiB uint8 buffer per name, and an Endpoint here whose channel
    to B is up (one put of seed 0 into the first buffer) and spins with ``budget``."""
    b = RemoteEndpoint(uname("b"), store=store_url, planes=("tcp",), timeout=timeout)
    try:
        for name in names:
            b.call("register", name, "uint8", (SIZE,))
        async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=timeout) as ep:
            await ep.put(b.name, {names[0]: make_tensor("uint8", (SIZE,), 0)})
            spin = _spin(ep, b.name)
            spin.budget = budget
            yield ep, b, spin
    finally:
        b.kill()


@contextlib.contextmanager
def _frozen(b: RemoteEndpoint):
    """B stopped (SIGSTOP, every thread) until the block ends: nothing it would answer comes."""
    b.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        b.signal(signal.SIGCONT)


@pytest.mark.timeout(120)
async def test_small_ops_catch_their_answers_and_move_exact_bytes(store_url, uname):
    # (a wide budget: on this busy 2-core machine an answer can take a while)
    async with _pair(store_url, uname, 0.005) as (ep, b, spin):
        caught = spin.caught
        for i in range(1, 201):
            src = make_tensor("uint8", (SIZE,), i)
            await ep.put(b.name, {"x": src})
            dst = make_tensor("uint8", (SIZE,), 10_000 + i)
            await ep.get(b.name, {"x": dst})
            assert bool((dst == src).all()), i
            if i % 50 == 0:
                await ep.notify(b.name, f"n{i}".encode())
        assert b.call("check", "x", 200)
        assert spin.caught - caught >= 100, (spin.caught, spin.missed, spin.skipped)


@pytest.mark.timeout(120)
async def test_a_frozen_peer_is_rarely_spun_for_and_spinning_resumes_once_it_is_back(store_url, uname):
    async with _pair(store_url, uname, 0.002, timeout=20) as (ep, b, spin):
        src = make_tensor("uint8", (SIZE,), 1)
        with _frozen(b):
            missed, skipped = spin.missed, spin.skipped
            for _ in range(40):
                with pytest.raises(TransportTimeoutError):
                    await ep.put(b.name, {"x": src}, timeout=0.05)
            # spins at ops 1, 4, 9, 18 and 35 (each miss lets twice as many ops by as the one before)
            assert spin.missed - missed <= 8, (spin.missed, spin.skipped)
            assert spin.skipped - skipped >= 25, (spin.missed, spin.skipped)
        spin.budget = 0.02
        caught = spin.caught
        for i in range(300):
            await ep.put(b.name, {"x": make_tensor("uint8", (SIZE,), 100 + i)})
        assert b.call("check", "x", 399)
        assert spin.caught > caught, (spin.caught, spin.missed, spin.skipped)


@pytest.mark.timeout(120)
async def test_an_op_does_not_spin_while_the_loop_has_other_work(store_url, uname):
    async with _pair(store_url, uname, 0.05, timeout=20) as (ep, b, spin):
        src = make_tensor("uint8", (SIZE,), 1)
        loop = asyncio.get_running_loop()
        with _frozen(b):  # (no answer comes: a spin would run its whole budget)
            ran = []
            loop.call_soon(ran.append, 1)  # work ready for the loop's next pass
            with pytest.raises(TransportTimeoutError):
                await ep.put(b.name, {"x": src}, timeout=0.2)
            assert ran == [1]
            assert (spin.caught, spin.missed) == (0, 0), "spun with a callback ready to run"

            other = asyncio.ensure_future(asyncio.sleep(0))  # another task ready: likewise
            with pytest.raises(TransportTimeoutError):
                await ep.put(b.name, {"x": src}, timeout=0.2)
            await other
            assert (spin.caught, spin.missed) == (0, 0), "spun with another task ready to run"

            with pytest.raises(TransportTimeoutError):  # nothing else to run: it spins (and misses)
                await ep.put(b.name, {"x": src}, timeout=0.2)
            assert (spin.caught, spin.missed) == (0, 1)
        await ep.put(b.name, {"x": make_tensor("uint8", (SIZE,), 5)})
        assert b.call("check", "x", 5)


@pytest.mark.timeout(120)
async def test_a_loop_of_caught_ops_still_gives_the_event_loop_its_turns(store_url, uname):
    async with _pair(store_url, uname, 0.005) as (ep, b, spin):
        src = make_tensor("uint8", (SIZE,), 1)
        ticks = 0
        stop = False

        async def ticker() -> None:  # a timer due every millisecond
            nonlocal ticks
            while not stop:
                await asyncio.sleep(0.001)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.01)
        caught, ticks = spin.caught, 0
        t0 = time.monotonic()
        while time.monotonic() < t0 + 3.0 and spin.caught - caught < 300:  # (~0.35 s on an idle machine)
            await ep.put(b.name, {"x": src})
        elapsed_ms = (time.monotonic() - t0) * 1e3
        stop = True
        await task
        assert spin.caught - caught >= 100, (spin.caught, spin.missed)
        # (about one tick per ms here; an op that returned without a pass of the loop after its spin
        # caught the answer starved the timer: ~10 in 500 ms. Bounded by the elapsed time, not a fixed
        # count, so a loaded machine's slower ops do not fail it)
        assert ticks >= elapsed_ms / 10, (ticks, elapsed_ms)


@pytest.mark.timeout(120)
async def test_callers_resume_in_the_order_their_answers_came(store_url, uname):
    async with _pair(store_url, uname, 0.005, names=("x", "y")) as (ep, b, _spin_):
        s1, s2 = make_tensor("uint8", (SIZE,), 1), make_tensor("uint8", (SIZE,), 2)
        inverted = 0
        for _ in range(300):
            order: list[int] = []

            async def one(k: int, name: str, src, order=order) -> None:
                await ep.put(b.name, {name: src})
                order.append(k)

            await asyncio.gather(one(1, "x", s1), one(2, "y", s2))
            inverted += order == [2, 1]
        assert inverted == 0, f"the second put's caller went on before the first's in {inverted} of 300"
        assert b.call("check", "x", 1) and b.call("check", "y", 2)


BIG = 128 << 10


@pytest.mark.timeout(120)
async def test_a_larger_op_spins_once_its_bytes_are_all_in_the_kernel(store_url, uname):
    async with _pair(store_url, uname, 0.005, timeout=20) as (ep, b, spin):
        b.call("register", "big", "uint8", (BIG,))
        b.call("register", "huge", "uint8", (2 << 20,))
        await ep.put(b.name, {"big": make_tensor("uint8", (BIG,), 0)})  # (our registry copy learns of it)
        caught = spin.caught
        for i in range(1, 61):
            await ep.put(b.name, {"big": make_tensor("uint8", (BIG,), i)})
        assert b.call("check", "big", 60)
        assert spin.caught - caught >= 30, (spin.caught, spin.missed, spin.skipped)
        for i in range(1, 11):  # (a get's reply this large is the reader thread's: whether it spins or not)
            await ep.put(b.name, {"big": make_tensor("uint8", (BIG,), i)})
            dst = make_tensor("uint8", (BIG,), 1000 + i)
            await ep.get(b.name, {"big": dst})
            assert bool((dst == make_tensor("uint8", (BIG,), i)).all()), i

        huge = make_tensor("uint8", (2 << 20,), 7)
        await ep.put(b.name, {"huge": huge})
        caught, missed = spin.caught, spin.missed
        for _ in range(3):  # B frozen as each is handed over: the kernel takes no more than its buffers' room
            with _frozen(b):  # (a few hundred KiB), most of 2 MiB stays queued: no spin (with B draining the
                put = asyncio.ensure_future(ep.put(b.name, {"huge": huge}))  # socket meanwhile, the kernel
                await asyncio.sleep(0.2)  # could take it whole, and then it may spin: as documented)
            await asyncio.wait_for(put, 20)
        assert (spin.caught, spin.missed) == (caught, missed)
        assert b.call("check", "huge", 7)


def _keep_reads_on_the_loop(monkeypatch) -> None:
    """An op spins only while the loop owns the channel's reads; with no op pending, the thread takes
    them back after ``WATCH_S`` (20 ms). Freezing the peer (``_frozen``: polling /proc until every
    thread stopped) can take longer than that on a loaded machine, and the next op would then not
    spin at all (neither caught nor missed): these tests count misses, so the reads stay put longer."""
    from transport import loop_reads

    monkeypatch.setattr(loop_reads, "STALL_S", 0.5)
    monkeypatch.setattr(loop_reads, "WATCH_S", 0.5)


@pytest.mark.timeout(120)
async def test_a_large_ops_missed_spin_does_not_stop_small_ops_spinning(store_url, uname, monkeypatch):
    _keep_reads_on_the_loop(monkeypatch)
    async with _pair(store_url, uname, 0.005, timeout=20) as (ep, b, spin):
        b.call("register", "big", "uint8", (BIG,))
        # each size class's last op caught (the registry update the peer sent may have left the reads with the
        # thread a while; on a loaded machine an op may miss its 5 ms and back its class off): no skip is left
        for name, size in (("big", BIG), ("x", SIZE)):
            for _ in range(40):
                caught = spin.caught
                await ep.put(b.name, {name: make_tensor("uint8", (size,), 0)})
                await asyncio.sleep(0.002)
                if spin.caught > caught:
                    break
            assert spin.caught > caught, (name, spin.caught, spin.missed, spin.skipped)
        with _frozen(b):
            missed, skipped = spin.missed, spin.skipped
            with pytest.raises(TransportTimeoutError):  # (128 KiB fits the empty socket buffers: it spins, misses)
                await ep.put(b.name, {"big": make_tensor("uint8", (BIG,), 1)}, timeout=0.2)
            assert (spin.missed, spin.skipped) == (missed + 1, skipped)
            with pytest.raises(TransportTimeoutError):  # a small op is not let by for it: it spins too
                await ep.put(b.name, {"x": make_tensor("uint8", (SIZE,), 2)}, timeout=0.2)
            assert (spin.missed, spin.skipped) == (missed + 2, skipped)
            with pytest.raises(TransportTimeoutError):  # (and now small ops back off)
                await ep.put(b.name, {"x": make_tensor("uint8", (SIZE,), 3)}, timeout=0.2)
            assert (spin.missed, spin.skipped) == (missed + 2, skipped + 1)
        await ep.put(b.name, {"big": make_tensor("uint8", (BIG,), 4)})
        await ep.put(b.name, {"x": make_tensor("uint8", (SIZE,), 5)})
        assert b.call("check", "big", 4) and b.call("check", "x", 5)


@pytest.mark.timeout(120)
async def test_the_ops_deadline_bounds_its_spin(store_url, uname, monkeypatch):
    _keep_reads_on_the_loop(monkeypatch)
    async with _pair(store_url, uname, 2.0, timeout=20) as (ep, b, spin):
        with _frozen(b):
            t0 = time.monotonic()
            with pytest.raises(TransportTimeoutError):
                await ep.put(b.name, {"x": make_tensor("uint8", (SIZE,), 1)}, timeout=0.05)
            took = time.monotonic() - t0
        assert spin.missed == 1
        assert took < 1.0, f"the put's 50 ms deadline was passed by its 2 s spin: it raised after {took:.2f} s"


@pytest.mark.timeout(120)
async def test_no_spin_under_a_task_factory(store_url, uname):
    """With a task factory (Python 3.12's eager tasks are one) a gather's first op could run, and
    spin, before the others exist: a loop with one never spins."""
    loop = asyncio.get_running_loop()
    async with _pair(store_url, uname, 0.005) as (ep, b, spin):
        src = make_tensor("uint8", (SIZE,), 4)
        loop.set_task_factory(lambda lp, coro, **kw: asyncio.Task(coro, loop=lp, **kw))
        try:
            for _ in range(50):
                await ep.put(b.name, {"x": src})
        finally:
            loop.set_task_factory(None)
        assert (spin.caught, spin.missed) == (0, 0)
        for _ in range(50):  # (and without one it does)
            await ep.put(b.name, {"x": src})
        assert spin.caught + spin.missed > 0


async def test_an_endpoint_of_this_process_is_never_spun_for(store_url, uname):
    async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=10) as a, \
            transport.Endpoint(uname("b"), store=store_url, planes=("tcp",), timeout=10) as b:
        b.register("x", make_tensor("uint8", (SIZE,), 0))
        src = make_tensor("uint8", (SIZE,), 3)
        for _ in range(50):
            await a.put(b.name, {"x": src})
        spin = _spin(a, b.name)
        assert spin.budget == 0 and (spin.caught, spin.missed) == (0, 0)
        assert answer_spin.env_budget() > 0  # (the default: spinning is on for other processes)


def test_the_budget_comes_from_the_environment_and_bad_values_are_logged(monkeypatch, caplog):
    monkeypatch.setenv("TRANSPORT_SPIN_US", "0")
    assert answer_spin.budget_from_env() == 0.0
    assert answer_spin.env_budget() == 0.0
    assert answer_spin.AnswerSpin().budget == 0.0
    monkeypatch.setenv("TRANSPORT_SPIN_US", "250")
    assert answer_spin.budget_from_env() == pytest.approx(250e-6)
    assert answer_spin.AnswerSpin().budget == pytest.approx(250e-6)
    monkeypatch.delenv("TRANSPORT_SPIN_US")
    assert answer_spin.budget_from_env() == pytest.approx(100e-6)
    for bad in ("fast", "-1", "1e9"):
        monkeypatch.setenv("TRANSPORT_SPIN_US", bad)
        with pytest.raises(ValueError, match="TRANSPORT_SPIN_US"):
            answer_spin.budget_from_env()
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="transport.channel"):
            assert answer_spin.AnswerSpin().budget == pytest.approx(100e-6)  # (a channel is never refused for it)
        assert any("TRANSPORT_SPIN_US" in r.getMessage() and bad in r.getMessage() for r in caplog.records)
        budget, error = answer_spin.env_setting()
        assert budget == pytest.approx(100e-6) and error is not None and bad in error
    monkeypatch.setenv("TRANSPORT_SPIN_US", "250")
    assert answer_spin.env_setting() == (pytest.approx(250e-6), None)
    assert answer_spin.AnswerSpin.for_peer(same_process=True).budget == 0.0  # (never towards this process)
    assert answer_spin.AnswerSpin.for_peer(same_process=False).budget == pytest.approx(250e-6)
