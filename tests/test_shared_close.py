"""``mode="shared"``'s close: a hold() after close never waits for a commit that can no longer come,
and close() never keeps the subscriber's writer lock (found by a review; both tests failed before)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import rl_sync
import rl_sync.modes.shared
import transport
from tests._remote import backing, same_bytes
from tests._rl_remote import seeded

SPEC = {"w": ("float32", (64, 64)), "b": ("bfloat16", (64,)), "steps": ("int64", (3,))}


def _model() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(sh, dtype=getattr(torch, dt)) for n, (dt, sh) in SPEC.items()}


def _is_version(model: dict[str, torch.Tensor], v: int) -> bool:
    want = seeded(SPEC, v)
    return all(same_bytes(model[n], want[n].to(model[n].dtype)) for n in SPEC)


@pytest.mark.timeout(90)
def test_blocking_shared_subscriber_holds_after_its_endpoint_closed_under_a_waiting_commit(store_url, uname):
    """A blocking shared subscriber's endpoint is closed while a commit waits for a reader to leave
    hold() (the trainer pushed just as the generator shut down). That commit's task stays suspended
    on the stopped loop, still counted as a waiting writer: once the reader left and the subscriber
    was closed (its weights copied out of the bank), hold() must still be had at once, since no commit
    can ever come (closing the blocking endpoint cancels the tasks left on its loop, as asyncio.run
    does). Before: every later hold() waited forever (here: its timeout)."""

    async def main() -> None:
        async with transport.Endpoint(uname("trainer"), store=store_url, timeout=20) as ep:
            bep = transport.BlockingEndpoint(uname("bgen"), store=store_url, timeout=20)
            try:
                model = _model()
                sub = rl_sync.BlockingWeightSubscriber(bep, model, mode="shared", commit_timeout=60)
                pub = rl_sync.WeightPublisher(ep, [bep.name])
                assert (await pub.push(seeded(SPEC, 1), 1, timeout=20)).ok
                inside, leave = threading.Event(), threading.Event()

                def reader() -> None:
                    with sub.hold(timeout=10):
                        inside.set()
                        leave.wait(30)

                t = threading.Thread(target=reader)
                t.start()
                assert await asyncio.to_thread(inside.wait, 10)
                push = asyncio.ensure_future(pub.push(seeded(SPEC, 2), 2, timeout=15))
                lock = sub.subscriber._lock
                end = time.monotonic() + 10
                while lock._writers_waiting == 0 and time.monotonic() < end:  # its commit waits for the reader
                    await asyncio.sleep(0.01)
                assert lock._writers_waiting == 1, "the push's commit never waited for the reader"
                await asyncio.to_thread(bep.close)  # the generator shuts down meanwhile
                report = await asyncio.wait_for(push, 30)
                assert not report.ok
                leave.set()
                await asyncio.to_thread(t.join, 10)
                assert not t.is_alive()
                await asyncio.to_thread(sub.close)  # (the endpoint is closed: the weights leave the bank here)
                assert backing(model["w"].data_ptr())[1] == "rw-p", "the weights left the bank"
                assert _is_version(model, 1)

                def hold_after_close() -> int | str:
                    try:
                        with sub.hold(timeout=3) as v:
                            return v
                    except transport.TransportTimeoutError:
                        return "timeout"

                assert await asyncio.to_thread(hold_after_close) == 1, "hold() after close must not wait"
                pub.close()
            finally:
                await asyncio.to_thread(bep.close)

    asyncio.run(main())


class _NoThread(threading.Thread):
    def start(self) -> None:
        if self.name == "rl_sync-leave-bank":
            raise RuntimeError("can't start new thread")
        super().start()


@pytest.mark.timeout(90)
async def test_shared_close_whose_copy_thread_cannot_start_keeps_the_subscriber_readable(store_url, uname,
                                                                                         monkeypatch):
    """close() on the loop takes the writer lock, then starts the thread that copies the weights out
    of the bank. If that thread cannot start (no threads left: RuntimeError), the writer lock must not
    stay held: the copy runs on the calling thread instead, and readers then get the weights (whole,
    of the last version, in private memory). Before: close() raised with the writer lock held, and
    every hold() after it waited forever (here: its timeout)."""
    async with transport.Endpoint(uname("trainer"), store=store_url, timeout=20) as ep, \
            transport.Endpoint(uname("gen"), store=store_url, timeout=20) as gep:
        model = _model()
        sub = rl_sync.WeightSubscriber(gep, model, mode="shared")
        pub = rl_sync.WeightPublisher(ep, [gep.name])
        try:
            assert (await pub.push(seeded(SPEC, 1), 1, timeout=20)).ok
            monkeypatch.setattr(rl_sync.modes.shared.threading, "Thread", _NoThread)
            sub.close()  # (the copy runs here instead, on the loop)
            monkeypatch.undo()
            assert backing(model["w"].data_ptr())[1] == "rw-p", "the weights left the bank"
            try:
                async with sub.hold(timeout=3) as v:
                    held = v, _is_version(model, 1)
            except transport.TransportTimeoutError:
                held = "timeout"
            assert held == (1, True), f"hold() after a close whose copy thread failed: {held}"
        finally:
            pub.close()
            sub.close()
