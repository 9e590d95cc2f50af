"""The head of a relay chain frozen: the subscribers behind it are moved to the publisher and
commit within the usual bound (2x a normal push + 1 s), never stalled for its silence.

Chain fan-out (``fanout="chain"``): gen0 pulls from the publisher, gen1 from gen0, gen2 from gen1.
Two cases the fault battery (``tests/test_rl_faults.py``, which freezes the middle one) does not reach:

* over tcp, the head frozen once told to commit (it holds every bucket): gen1's last pull from it
  hangs (a tcp get needs the relay's process to serve it). gen1 is then both silent with a pull
  outstanding and a relay itself; it was stalled as if it were the frozen one (its own dependent
  moved, it waited for its hung get until the deadline);
* over shm with a long push timeout, the head frozen right after its Begin: no pull of this push has
  been answered yet, and the bound for a silent relay took no yardstick from the pushes before (it
  was the push's whole budget / 8: 3.75 s of a 30 s timeout).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import rl_sync
import transport
from tests.test_rl_faults import BUCKET, TRAIN, _check_all, _Gens, _Trap, seeded, warm_up


class _TrapAtBegun(_Trap):
    """:class:`_Trap`, with one more phase: ``begun`` (the victim answered its Begin; no pull yet)."""

    def __call__(self, ev: rl_sync.PushEvent) -> None:
        armed = self.armed
        if armed is not None and armed[2] == "begun" and ev.subscriber == armed[0] and ev.kind == "begun":
            os.kill(armed[1], armed[3])
            self.armed, self.fired_at = None, time.monotonic()
        super().__call__(ev)


async def _head_frozen(store_url, uname, phase: str, timeout: float, **endpoint_kw) -> None:
    gens = _Gens(store_url, uname, "staged", **endpoint_kw)
    trap = _TrapAtBegun()
    try:
        async with transport.Endpoint(uname("trainer"), store=store_url, timeout=20, **endpoint_kw) as ep:
            pub = rl_sync.WeightPublisher(ep, [g.name for g in gens.gens], dtype="auto", bucket_bytes=BUCKET,
                                          fanout="chain", observer=trap)
            version, bound = await warm_up(pub)
            head = min(gens.gens, key=lambda g: g.name)  # (the chain runs in name order)
            trap.arm(head.name, head.pid, phase, signal.SIGSTOP)
            version += 1
            weights = seeded(TRAIN, version)
            report = await pub.push(weights, version, timeout=timeout)
            assert trap.fired_at is not None, f"the {phase} trap never fired: {report.summary()}"
            healthy = [report.results[g.name] for g in gens.gens if g is not head]
            said = ", ".join(f"{r.seconds:.2f}" for r in healthy)
            assert all(r.ok for r in healthy), f"{report.summary()}\n{trap.trace()}"
            assert all(r.seconds <= bound for r in healthy), \
                f"healthy committed in {said} s, bound {bound:.2f} s\n{report.summary()}\n{trap.trace()}"
            _check_all([g for g in gens.gens if g is not head], {version})
            head.signal(signal.SIGCONT)
            version += 1
            report = await pub.push(seeded(TRAIN, version), version, timeout=30)
            assert report.ok, report.summary()
            _check_all(gens.gens, {version})
            print(f"\nhead frozen in {phase}: healthy committed in {said} s (bound {bound:.2f} s)")
            pub.close()
    finally:
        gens.close()


@pytest.mark.timeout(240)
async def test_the_heads_dependents_commit_when_it_freezes_told_to_commit_over_tcp(store_url, uname):
    t0 = time.monotonic()
    await _head_frozen(store_url, uname, "commit", 3.0, planes=("tcp",))
    assert time.monotonic() - t0 < 200


@pytest.mark.timeout(240)
async def test_the_heads_dependents_commit_when_it_freezes_once_begun_under_a_long_timeout(store_url, uname):
    await _head_frozen(store_url, uname, "begun", 30.0)
