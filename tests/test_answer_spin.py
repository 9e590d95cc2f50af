"""A small op reading its own answer on the event loop before it sleeps (transport.answer_spin).

What must hold, with real processes and sockets:
- small puts, gets and notifications over tcp read their answers in the op's own coroutine (the
  spin catches them) and move exact bytes, in order;
- a frozen peer costs almost nothing: after a few spins that ran out of budget, a channel lets
  most ops by without spinning, and it spins (and catches answers) again once the peer is back;
- an op never spins while the event loop has other work ready (the ops of a ``gather``, another
  task): it awaits at once;
- ``TRANSPORT_SPIN_US`` is checked: a bad value is a clear error, ``0`` turns spinning off.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

import transport
from tests._remote import RemoteEndpoint, make_tensor
from transport import answer_spin
from transport.errors import TransportTimeoutError

SIZE = 4096


def _spin(ep: transport.Endpoint, peer: str) -> answer_spin.AnswerSpin:
    return ep._channels[peer].ops.spin


@pytest.mark.timeout(120)
async def test_small_ops_catch_their_answers_and_move_exact_bytes(store_url, uname):
    b = RemoteEndpoint(uname("b"), store=store_url, planes=("tcp",), timeout=10)
    try:
        b.call("register", "x", "uint8", (SIZE,))
        async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=10) as ep:
            await ep.put(b.name, {"x": make_tensor("uint8", (SIZE,), 0)})
            spin = _spin(ep, b.name)
            spin.budget = 0.005  # (wide: on this busy 2-core machine an answer can take a while)
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
    finally:
        b.kill()


@pytest.mark.timeout(120)
async def test_a_frozen_peer_is_rarely_spun_for_and_spinning_resumes_once_it_is_back(store_url, uname):
    b = RemoteEndpoint(uname("b"), store=store_url, planes=("tcp",), timeout=20)
    try:
        b.call("register", "x", "uint8", (SIZE,))
        async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=20) as ep:
            src = make_tensor("uint8", (SIZE,), 1)
            await ep.put(b.name, {"x": src})
            spin = _spin(ep, b.name)
            spin.budget = 0.002
            b.signal(signal.SIGSTOP)
            try:
                missed, skipped = spin.missed, spin.skipped
                for _ in range(40):
                    with pytest.raises(TransportTimeoutError):
                        await ep.put(b.name, {"x": src}, timeout=0.05)
                # spins at ops 1, 4, 9, 18 and 35 (each miss lets twice as many ops by as the one before)
                assert spin.missed - missed <= 8, (spin.missed, spin.skipped)
                assert spin.skipped - skipped >= 25, (spin.missed, spin.skipped)
            finally:
                b.signal(signal.SIGCONT)
            spin.budget = 0.02
            caught = spin.caught
            for i in range(300):
                await ep.put(b.name, {"x": make_tensor("uint8", (SIZE,), 100 + i)})
            assert b.call("check", "x", 399)
            assert spin.caught > caught, (spin.caught, spin.missed, spin.skipped)
    finally:
        b.kill()


@pytest.mark.timeout(120)
async def test_an_op_does_not_spin_while_the_loop_has_other_work(store_url, uname):
    b = RemoteEndpoint(uname("b"), store=store_url, planes=("tcp",), timeout=20)
    try:
        b.call("register", "x", "uint8", (SIZE,))
        async with transport.Endpoint(uname("a"), store=store_url, planes=("tcp",), timeout=20) as ep:
            src = make_tensor("uint8", (SIZE,), 1)
            await ep.put(b.name, {"x": src})
            spin = _spin(ep, b.name)
            spin.budget = 0.05
            loop = asyncio.get_running_loop()
            b.signal(signal.SIGSTOP)  # (no answer comes: a spin would run its whole budget)
            try:
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
            finally:
                b.signal(signal.SIGCONT)
            await ep.put(b.name, {"x": make_tensor("uint8", (SIZE,), 5)})
            assert b.call("check", "x", 5)
    finally:
        b.kill()


def test_the_budget_comes_from_the_environment_and_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv("TRANSPORT_SPIN_US", "0")
    assert answer_spin.budget_from_env() == 0.0
    assert answer_spin.AnswerSpin(0.0).budget == 0.0
    monkeypatch.setenv("TRANSPORT_SPIN_US", "250")
    assert answer_spin.budget_from_env() == pytest.approx(250e-6)
    monkeypatch.delenv("TRANSPORT_SPIN_US")
    assert answer_spin.budget_from_env() == pytest.approx(100e-6)
    for bad in ("fast", "-1", "1e9"):
        monkeypatch.setenv("TRANSPORT_SPIN_US", bad)
        with pytest.raises(ValueError, match="TRANSPORT_SPIN_US"):
            answer_spin.budget_from_env()
