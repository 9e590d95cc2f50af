"""transport_rl as a backend of torch.distributed._transport (torch >= 2.15), once per plane.

Skipped, saying why, where torch has no ``torch.distributed._transport``. The lifecycle, timeout
and cancellation cases re-express PyTorch's backend-independent ones
(test/distributed/test_transport_nixl.py, test_transport_nixl_native.py) without a stand-in
backend: a transfer is kept pending by holding the initiator's event loop (a real busy loop,
released by the test), and failures are real ones (a descriptor the peer unregistered).
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
import unittest
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import torch.distributed._transport as tdt
except ImportError:
    pytest.skip(f"torch {torch.__version__} has no torch.distributed._transport (PyTorch >= 2.15 does)",
                allow_module_level=True)

from _torch_transport_mixin import TransportContractMixin
from torch.distributed import HashStore, TCPStore

import transport
from transport.torch_backend import TransportRL, TransportRLRemoteBuffer

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent
BACKEND = "transport_rl"

# Run from a checkout (PYTHONPATH) the entry point is not installed: register the factory that it
# names for this process (test_entry_point_loads_the_backend checks the entry point itself).
if BACKEND not in tdt.available_transports():
    tdt.register_transport(BACKEND, TransportRL)


@contextmanager
def stalled(tr: TransportRL, limit: float = 20.0) -> Iterator[threading.Event]:
    """Hold ``tr``'s event loop (a blocking call on it) until the block ends: what it was asked
    to move stays pending meanwhile, as a transfer in flight would."""
    gate, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        gate.wait(limit)

    tr._loop.call_soon_threadsafe(hold)
    assert holding.wait(5), "the loop did not start the block"
    try:
        yield gate
    finally:
        gate.set()


class PlaneCase(unittest.TestCase):
    plane = "tcp"

    def assertEqual(self, first: Any, second: Any, msg: Any = None) -> None:  # noqa: N802
        """Tensors compare exactly (values, dtype, shape), as PyTorch's TestCase.assertEqual does."""
        if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
            torch.testing.assert_close(first, second, rtol=0, atol=0, msg=msg)
        else:
            super().assertEqual(first, second, msg)

    def make_transport_pair(self) -> tuple[Any, Any]:
        first = tdt.new_transport(BACKEND, "cpu", plane=self.plane, timeout=10)
        second = tdt.new_transport(BACKEND, "cpu", plane=self.plane, timeout=10)
        self.addCleanup(second.close)
        self.addCleanup(first.close)
        self.assertEqual(first.connect(second.bind()), 0)
        self.assertEqual(second.connect(first.bind()), 0)
        self.assertTrue(first.connected() and second.connected())
        return first, second

    def registered_pair(self, tensor: torch.Tensor | None = None) -> tuple[Any, Any, Any, Any]:
        first, second = self.make_transport_pair()
        tensor = torch.ones(8) if tensor is None else tensor
        source = first.register_memory(tensor)
        target = second.register_memory(torch.zeros_like(tensor))
        return first, second, source, target.to_remote_buffer()


class LifecycleCases:
    """PyTorch's backend-independent lifecycle, timeout and cancellation cases, for this backend."""

    def test_unregister_invalidates_aliases_and_views(self: Any) -> None:
        tensor = torch.ones(8)
        first, second, memory, remote = self.registered_pair(tensor)
        alias = first.register_memory(tensor)
        self.assertTrue(alias.reused_registration())
        view = alias.to_view()
        first.unregister_memory(memory)
        first.unregister_memory(alias)  # the same registration: a no-op
        self.assertEqual(len(first._ep.buffers), 0)
        for handle in (memory, alias):
            for call in (handle.to_view, handle.to_mutable_view, handle.to_remote_buffer):
                with self.assertRaisesRegex(RuntimeError, "unregistered"):
                    call()
        with self.assertRaisesRegex(RuntimeError, "unregistered"):
            first.write(view, remote)
        fresh = first.register_memory(tensor)
        self.assertFalse(fresh.reused_registration())
        first.unregister_memory(memory)
        self.assertEqual(first.write(fresh.to_view(), remote), 0)
        first.unregister_memory(fresh)
        first.close()
        self.assertEqual(len(first._ep.buffers), 0)

    def test_unregistered_descriptor_fails_the_peers_transfer(self: Any) -> None:
        first, second = self.make_transport_pair()
        source = first.register_memory(torch.ones(8))
        target = second.register_memory(torch.zeros(8))
        remote = target.to_remote_buffer()
        second.unregister_memory(target)
        # the peer learns of the unregistration asynchronously: a put racing it may land first
        # (shm, one-sided), never silently lose its bytes; once it knows, puts fail
        gone = (transport.UnknownBufferError, transport.StaleBufferError)
        deadline = time.monotonic() + 10
        while True:
            work = first.write(source.to_view(), remote, async_op=True)
            try:
                work.wait(timedelta(seconds=10))
            except gone:
                break
            self.assertLess(time.monotonic(), deadline, "puts into an unregistered buffer kept succeeding")
            time.sleep(0.05)
        self.assertTrue(work.is_completed())
        self.assertFalse(work.is_success())
        self.assertIsInstance(work.exception(), gone)
        with self.assertRaises(gone):
            work.get_future().wait()

    def test_unregister_rejects_pending_transfers(self: Any) -> None:
        for operation in ("read", "write"):
            with self.subTest(operation=operation):
                first, second, memory, remote = self.registered_pair()
                other = first.register_memory(torch.ones(16))
                view = memory.to_mutable_view() if operation == "read" else memory.to_view()
                with stalled(first):  # (unregistering needs the loop: `other` is unregistered after)
                    work = getattr(first, operation)(view, remote, async_op=True)
                    with self.assertRaisesRegex(RuntimeError, "pending transfers"):
                        first.unregister_memory(memory)
                    self.assertTrue(memory._registration.active)
                first.unregister_memory(other)
                work.wait(timedelta(seconds=10))
                first.unregister_memory(memory)
                self.assertEqual(len(first._ep.buffers), 0)

    def test_unregister_validates_owner(self: Any) -> None:
        first, second, memory, remote = self.registered_pair()
        for invalid in (None, remote):
            with self.assertRaisesRegex(TypeError, "not registered"):
                first.unregister_memory(invalid)
        with self.assertRaisesRegex(TypeError, "not registered"):
            second.unregister_memory(memory)
        with self.assertRaises(ValueError):
            first.unregister_memory(memory, timeout=-1)
        first.close()
        with self.assertRaisesRegex(RuntimeError, "closed"):
            first.unregister_memory(memory)
        with self.assertRaisesRegex(RuntimeError, "unregistered"):
            memory.to_view()

    def test_unregister_lock_timeout(self: Any) -> None:
        first, second, memory, remote = self.registered_pair()
        acquired, release = threading.Event(), threading.Event()

        def hold_lock() -> None:
            with first._lock:
                acquired.set()
                release.wait(5)

        thread = threading.Thread(target=hold_lock)
        thread.start()
        try:
            self.assertTrue(acquired.wait(5))
            with self.assertRaises(TimeoutError):
                first.unregister_memory(memory, timeout=0.001)
            self.assertTrue(memory._registration.active)
        finally:
            release.set()
            thread.join(5)
        self.assertFalse(thread.is_alive())
        first.unregister_memory(memory)

    def test_raw_tensors_are_not_implicitly_registered(self: Any) -> None:
        first, second, source, remote = self.registered_pair()
        registered = dict(first._ep.buffers)
        for operation in (first.write, first.read):
            with self.assertRaisesRegex(TypeError, "not registered"):
                operation(torch.ones(8), remote)
        self.assertEqual(first._ep.buffers, registered)

    def test_registrations_outlive_the_callers_references(self: Any) -> None:
        first, second = self.make_transport_pair()
        tensor = torch.arange(8, dtype=torch.float32)
        ref = weakref.ref(tensor)
        remote = first.register_memory(tensor).to_remote_buffer()
        del tensor
        gc.collect()
        self.assertIsNotNone(ref())  # the peer may still access it: held until unregister/close
        back = torch.zeros(8)
        self.assertEqual(second.read(second.register_memory(back).to_mutable_view(), remote), 0)
        self.assertEqual(back, torch.arange(8, dtype=torch.float32))
        first.close()
        gc.collect()
        self.assertIsNone(ref())

    def test_rejects_invalid_inputs_and_cleans_up(self: Any) -> None:
        first, second = self.make_transport_pair()
        source = first.register_memory(torch.arange(8, dtype=torch.uint8))
        target = second.register_memory(torch.zeros(4, dtype=torch.uint8))
        with self.assertRaisesRegex(ValueError, "does not fit"):
            first.write(source.to_view(), target.to_remote_buffer())
        with self.assertRaisesRegex(TypeError, "local_buffer"):
            first.write(target.to_view(), target.to_remote_buffer())
        with self.assertRaisesRegex(TypeError, "local_buffer"):
            first.read(source.to_view(), target.to_remote_buffer())  # a read needs a mutable view
        with self.assertRaisesRegex(ValueError, "outside"):
            source.to_view(9)
        for bad in (torch.zeros(0), torch.zeros(4, 4).t(), "not a tensor"):
            with self.assertRaises((ValueError, TypeError)):
                first.register_memory(bad)
        first.close()
        second.close()
        self.assertFalse(first.connected())
        self.assertFalse(first._thread.is_alive())

    def test_timeout_retains_pending_transfer(self: Any) -> None:
        first, second, source, remote = self.registered_pair(torch.arange(8, dtype=torch.uint8))
        with stalled(first):
            work = first.write(source.to_view(), remote, async_op=True, timeout=0.001)
            with self.assertRaises(TimeoutError):
                work.wait()  # the timeout it was submitted with
            self.assertFalse(work.is_completed())
            with self.assertRaises(TimeoutError):
                first.close(timeout=0.001)
            self.assertTrue(source._registration.active)
            with self.assertRaisesRegex(RuntimeError, "closed"):
                first.bind()
        first.close(timeout=10)
        self.assertTrue(work.is_completed() and work.is_success())
        self.assertFalse(source._registration.active)

    def test_operation_timeout(self: Any) -> None:
        for operation in ("read", "write", "read_async", "write_async"):
            with self.subTest(operation=operation):
                first, second, source, remote = self.registered_pair(torch.arange(8, dtype=torch.uint8))
                view = source.to_mutable_view() if operation.startswith("read") else source.to_view()
                with stalled(first):
                    with self.assertRaises(TimeoutError):
                        result = getattr(first, operation)(view, remote, timeout=0.001)
                        if operation.endswith("_async"):
                            asyncio.run(result)
                    self.assertTrue(first._pending)  # the transfer goes on
                first.close(timeout=10)
                self.assertFalse(first._pending)

    def test_asyncio_future_completes_from_the_loop_thread(self: Any) -> None:
        first, second, source, remote = self.registered_pair()

        async def run() -> None:
            loop = asyncio.get_running_loop()
            with stalled(first) as gate:
                work = first.write(source.to_view(), remote, async_op=True)
                future = work.get_future()
                ready = asyncio.Event()
                future.add_done_callback(lambda _: loop.call_soon_threadsafe(ready.set))
                loop.call_later(0.01, gate.set)
                await asyncio.wait_for(ready.wait(), 10)
            self.assertEqual(future.wait(), [])
            await tdt.wait_all([work])

        asyncio.run(run())

    def test_a_transfer_refused_on_the_loop_thread_leaves_nothing_pending(self: Any) -> None:
        """A write from a ``get_future()`` callback (the backend's loop thread, where those run)
        that cannot go the caller's way is refused (RuntimeError) and leaves no pending transfer
        behind: close and unregister still work, and the caller's fast path stays on."""
        first, second, source, remote = self.registered_pair()
        errors: list[BaseException] = []

        def chain(_fut: Any) -> None:  # (on the loop thread; `after` is still pending: never the caller's way)
            try:
                first.write(source.to_view(), remote, async_op=True)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        with stalled(first):  # (all three go the loop's way, in order)
            work = first.write(source.to_view(), remote, async_op=True)
            after = first.write(source.to_view(), remote, async_op=True)
            work.get_future().then(chain)
        work.wait()
        after.wait()
        deadline = time.monotonic() + 10
        while not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(len(errors), 1)
        self.assertIsInstance(errors[0], RuntimeError)
        self.assertEqual(first._pending, {})
        first.write(source.to_view(), remote)
        first.unregister_memory(source)
        first.close(timeout=5)

    def test_async_close_timeout_and_retry(self: Any) -> None:
        first, second, source, remote = self.registered_pair()

        async def run() -> None:
            with stalled(first):
                work = first.write(source.to_view(), remote, async_op=True)
                with self.assertRaises(TimeoutError):
                    await first.close_async(timeout=0.001)
                self.assertTrue(source._registration.active)
                self.assertFalse(work.is_completed())
            await first.close_async(timeout=10)
            self.assertTrue(work.is_completed())
            self.assertFalse(source._registration.active)

        asyncio.run(run())

    def test_async_close_waits_for_a_transfer_being_submitted(self: Any) -> None:
        """A read on another thread, past the transport's open check when close_async starts,
        becomes pending before close_async looks (it takes the operations' lock, as close does):
        close_async waits for it and the bytes land. Before, close_async did not see it and
        released everything under it (tcp: the read failed with the endpoint closed; shm: its
        worker thread's copy raced the destination's unregistration, which copies it out of its
        segment)."""
        n = 32 << 20
        first, second = self.make_transport_pair()
        dest = first.register_memory(torch.zeros(n, dtype=torch.uint8))
        theirs = torch.full((n,), 7, dtype=torch.uint8)
        remote = second.register_memory(theirs).to_remote_buffer()
        self.assertEqual(first.read(dest.to_mutable_view(0, 4096), remote), 0)  # (the channel, shm's mapping)
        view = dest.to_mutable_view()
        inside, go = threading.Event(), threading.Event()

        def size() -> int:  # called under the transport's lock, after its open check
            inside.set()
            go.wait(5)
            return n

        view.size = size
        out: dict[str, Any] = {}

        def submit() -> None:
            try:
                out["work"] = first.read(view, remote, async_op=True)
            except BaseException as exc:  # noqa: BLE001 - checked below
                out["error"] = exc

        submitter = threading.Thread(target=submit)
        submitter.start()
        self.assertTrue(inside.wait(5))
        threading.Timer(0.3, go.set).start()  # once close_async has begun
        asyncio.run(first.close_async(timeout=20))
        submitter.join(5)
        if "error" in out:  # (refused as closed: allowed, nothing was moved)
            self.assertIsInstance(out["error"], RuntimeError)
            return
        work = out["work"]
        self.assertTrue(work.is_completed() and work.is_success(), work.exception())
        self.assertTrue(bool((dest._registration.tensor == 7).all()))

    def test_cancellation_retains_buffers(self: Any) -> None:
        tensor = torch.ones(8)
        ref = weakref.ref(tensor)
        first, second, source, remote = self.registered_pair(tensor)

        async def run(memory: Any) -> None:
            task = asyncio.create_task(first.write_async(memory.to_view(), remote))
            await asyncio.sleep(0)
            task.cancel()
            with self.assertRaises(asyncio.CancelledError):
                await task
            self.assertTrue(first._pending)  # cancelling the wait did not cancel the transfer

        with stalled(first):
            asyncio.run(run(source))
            del source, tensor
            gc.collect()
            self.assertIsNotNone(ref())
        first.close(timeout=10)
        gc.collect()
        self.assertIsNone(ref())

    def test_dropped_work_retained_until_completion(self: Any) -> None:
        first, second, source, remote = self.registered_pair()
        with stalled(first):
            work = first.write(source.to_view(), remote, async_op=True)
            ref = weakref.ref(work)
            del work
            gc.collect()
            self.assertIsNotNone(ref())
        first.close(timeout=10)
        gc.collect()
        self.assertIsNone(ref())

    def test_a_kept_work_does_not_keep_the_registrations_memory(self: Any) -> None:
        tensor = torch.ones(8)
        ref = weakref.ref(tensor)
        first, second, source, remote = self.registered_pair(tensor)
        work = first.write(source.to_view(), remote, async_op=True)
        self.assertTrue(work.wait(timedelta(seconds=10)))
        first.unregister_memory(source)
        del source, tensor
        first.close(timeout=10)
        gc.collect()
        self.assertIsNone(ref())  # (the Work, still held, let its buffers go when its transfer ended)
        self.assertTrue(work.is_success())

    def test_transfers_into_one_range_land_in_submission_order(self: Any) -> None:
        """A large write (a worker thread's copy on shm, many segments on tcp) then a small one
        into the same remote bytes, both async, then a read: the small one's bytes win (it is
        never reordered ahead of the large one), and the read sees them."""
        n = 8 << 20
        first, second = self.make_transport_pair()
        big = first.register_memory(torch.ones(n, dtype=torch.uint8))
        small = first.register_memory(torch.full((4096,), 2, dtype=torch.uint8))
        landed = torch.zeros(n, dtype=torch.uint8)
        remote = second.register_memory(landed).to_remote_buffer()
        back = torch.zeros(n, dtype=torch.uint8)
        readback = first.register_memory(back)
        for _ in range(5):
            works = [first.write(big.to_view(), remote, async_op=True),
                     first.write(small.to_view(), remote, async_op=True),
                     first.read(readback.to_mutable_view(), remote, async_op=True)]
            for work in works:
                self.assertTrue(work.wait(timedelta(seconds=20)))
            self.assertTrue(bool((landed[:4096] == 2).all()) and bool((landed[4096:] == 1).all()))
            self.assertEqual(back, landed)
            landed.zero_()

    def test_concurrent_waiters(self: Any) -> None:
        first, second, source, remote = self.registered_pair()
        with stalled(first):
            work = first.write(source.to_view(), remote, async_op=True)
            errors: list[BaseException] = []

            def wait() -> None:
                try:
                    work.wait(timedelta(seconds=10))
                except BaseException as error:
                    errors.append(error)

            threads = [threading.Thread(target=wait) for _ in range(4)]
            for thread in threads:
                thread.start()
        for thread in threads:
            thread.join(15)
            self.assertFalse(thread.is_alive())
        self.assertEqual(errors, [])

    def test_cancelled_async_close_can_be_retried(self: Any) -> None:
        first, second, source, remote = self.registered_pair()

        async def run() -> None:
            with stalled(first):
                work = first.write(source.to_view(), remote, async_op=True)
                task = asyncio.create_task(first.close_async())
                await asyncio.sleep(0)
                task.cancel()
                with self.assertRaises(asyncio.CancelledError):
                    await task
                self.assertTrue(source._registration.active)
                self.assertFalse(work.is_completed())
                with self.assertRaisesRegex(RuntimeError, "closed"):
                    first.register_memory(torch.ones(8))
            await first.close_async(timeout=10)
            self.assertTrue(work.is_completed())

        asyncio.run(run())

    def test_held_lock_does_not_keep_a_transfer_from_completing(self: Any) -> None:
        first, second, source, remote = self.registered_pair()
        work = first.write(source.to_view(), remote, async_op=True)
        locked, release = threading.Event(), threading.Event()

        def hold_lock() -> None:
            with first._lock:
                locked.set()
                release.wait(5)

        thread = threading.Thread(target=hold_lock)
        thread.start()
        try:
            self.assertTrue(locked.wait(5))
            self.assertTrue(work.wait(timedelta(seconds=10)))
        finally:
            release.set()
            thread.join(5)

    def test_invalid_timeout(self: Any) -> None:
        for timeout in (-1, float("nan"), float("inf")):
            with self.subTest(timeout=timeout):
                with self.assertRaises(ValueError):
                    TransportRL(timeout=timeout)
                first, second = self.make_transport_pair()
                with self.assertRaises(ValueError):
                    first.bind(timeout=timeout)
                with self.assertRaises(ValueError):
                    first.close(timeout=timeout)

    def test_empty_view_and_replaced_storage(self: Any) -> None:
        tensor = torch.ones(8)
        first, second, source, remote = self.registered_pair(tensor)
        self.assertEqual(first.write(source.to_view(0, 0), remote), 0)
        with self.assertRaises(TypeError):
            source.to_view(0.5)
        tensor.set_(torch.zeros(8))
        with self.assertRaisesRegex(RuntimeError, "storage was replaced"):
            first.write(source.to_view(), remote)

    def test_peer_validation(self: Any) -> None:
        first, second, source, remote = self.registered_pair()
        with self.assertRaisesRegex(RuntimeError, "already connected"):
            first.connect(second.bind())
        with self.assertRaisesRegex(ValueError, "connected peer"):
            first.write(source.to_view(), replace(remote, endpoint="other"))
        with self.assertRaisesRegex(ValueError, "connected peer"):
            first.write(source.to_view(), replace(remote, incarnation=remote.incarnation ^ 1))
        with TransportRL(plane=self.plane) as lone, self.assertRaises(ValueError):
            lone.connect(b"not a record")

    def test_not_connected(self: Any) -> None:
        with TransportRL(plane=self.plane) as lone, TransportRL(plane=self.plane) as other:
            source = lone.register_memory(torch.ones(4))
            remote = other.register_memory(torch.ones(4)).to_remote_buffer()
            self.assertFalse(lone.connected())
            with self.assertRaisesRegex(RuntimeError, "not connected"):
                lone.write(source.to_view(), remote)

    def test_sub_range_read_and_write(self: Any) -> None:
        first, second = self.make_transport_pair()
        values = torch.arange(256, dtype=torch.uint8)
        mine = first.register_memory(values)
        landed = torch.zeros(100, dtype=torch.uint8)
        theirs = second.register_memory(landed)
        self.assertEqual(first.write(mine.to_view(3, 97), theirs.to_remote_buffer()), 0)  # odd offset and size
        self.assertEqual(landed[:97], values[3:100])
        self.assertEqual(landed[97:], torch.zeros(3, dtype=torch.uint8))
        back = torch.zeros(16, dtype=torch.float64)  # 128 bytes; reads 5..(5+50)
        back_memory = first.register_memory(back)
        self.assertEqual(first.read(back_memory.to_mutable_view(5, 50), theirs.to_remote_buffer()), 0)
        self.assertEqual(back.view(torch.uint8)[5:55], landed[:50])

    def test_stream_transfers_are_refused_on_cpu(self: Any) -> None:
        first, second, source, remote = self.registered_pair()
        with self.assertRaisesRegex(NotImplementedError, "CUDA"):
            first.write_stream(source.to_view(), remote)
        with self.assertRaisesRegex(NotImplementedError, "CUDA"):
            first.read_stream(source.to_mutable_view(), remote)

    def test_cuda_memory_is_refused(self: Any) -> None:
        with self.assertRaisesRegex(RuntimeError, "failed to create") as caught:
            tdt.new_transport(BACKEND, "cuda", plane=self.plane)
        self.assertIn("CPU memory only", str(caught.exception.__cause__))


class TestTcp(PlaneCase, TransportContractMixin, LifecycleCases):
    plane = "tcp"

    def test_registration_leaves_memory_in_place(self) -> None:
        first, second = self.make_transport_pair()
        tensor = torch.zeros(8)
        alias = tensor.view(2, 4)  # taken before registering: still aliases
        ptr = tensor.data_ptr()
        memory = first.register_memory(tensor)
        self.assertEqual(tensor.data_ptr(), ptr)
        second.write(second.register_memory(torch.ones(8)).to_view(), memory.to_remote_buffer())
        self.assertEqual(alias, torch.ones(2, 4))


class TestShm(PlaneCase, TransportContractMixin, LifecycleCases):
    plane = "shm"

    def test_registration_moves_storage_in_place(self) -> None:
        first, second = self.make_transport_pair()
        tensor = torch.arange(8, dtype=torch.float32)
        other = tensor.detach()  # another tensor object of the same storage, taken before registering
        ptr = tensor.data_ptr()
        memory = first.register_memory(tensor)
        self.assertNotEqual(tensor.data_ptr(), ptr)  # now in a shared-memory segment
        self.assertEqual(tensor, torch.arange(8, dtype=torch.float32))  # bytes kept
        second.write(second.register_memory(torch.ones(8)).to_view(), memory.to_remote_buffer())
        self.assertEqual(tensor, torch.ones(8))  # the registered object sees the write
        self.assertEqual(other, torch.arange(8, dtype=torch.float32))  # the old alias does not
        first.unregister_memory(memory)  # back into private memory, in place, bytes kept
        self.assertEqual(tensor, torch.ones(8))
        with self.assertRaisesRegex(ValueError, "base tensor"):
            first.register_memory(torch.zeros(16)[4:])

    def test_one_tensor_registered_with_two_transports_is_reached_through_both(self) -> None:
        """One transport per peer over the same weights: the second registration of a tensor
        exports the segment it already lies in (it is not moved again, which would cut the first
        transport's peer off from it); it moves back to private memory with the last one."""
        first, first_peer = self.make_transport_pair()
        second, second_peer = self.make_transport_pair()
        weights = torch.zeros(1024)
        mems = [first.register_memory(weights), second.register_memory(weights)]
        at = weights.data_ptr()
        weights.fill_(1.0)
        pairs = ((first_peer, mems[0]), (second_peer, mems[1]))
        for peer, mem in pairs:
            out = torch.zeros(1024)
            self.assertEqual(peer.read(peer.register_memory(out).to_mutable_view(), mem.to_remote_buffer()), 0)
            self.assertEqual(out, torch.ones(1024))
        for k, (peer, mem) in enumerate(pairs):
            src = torch.full((1024,), float(k + 2))
            self.assertEqual(peer.write(peer.register_memory(src).to_view(), mem.to_remote_buffer()), 0)
            self.assertEqual(weights, src)
        landed = torch.zeros(1024)
        remote = first_peer.register_memory(landed).to_remote_buffer()
        self.assertEqual(first.write(mems[0].to_view(), remote), 0)  # its own writes still read the weights
        self.assertEqual(landed, weights)
        first.unregister_memory(mems[0])
        self.assertEqual(weights.data_ptr(), at)  # the second still exports it, in place
        src = torch.full((1024,), 9.0)
        self.assertEqual(second_peer.write(second_peer.register_memory(src).to_view(), mems[1].to_remote_buffer()), 0)
        self.assertEqual(weights, src)
        second.unregister_memory(mems[1])
        self.assertNotEqual(weights.data_ptr(), at)  # the last one: back in private memory, bytes kept
        self.assertEqual(weights, src)

    def test_small_transfers_are_copied_by_the_calling_thread(self) -> None:
        """Once the peer's memory is mapped (a first transfer), a transfer submitted while none is
        pending needs nothing of the loop thread: with the loop stalled, a write and a read return
        with the bytes moved, an async_op one's Work completed at once; while one is pending the
        next waits its turn on the loop (submission order); one of 8 MiB goes to the loop."""
        first, second = self.make_transport_pair()
        values = torch.arange(4096, dtype=torch.int32)
        mine = first.register_memory(values)
        landed = torch.zeros(4096, dtype=torch.int32)
        theirs = second.register_memory(landed).to_remote_buffer()
        self.assertEqual(first.write(mine.to_view(), theirs), 0)  # (maps the peer's segment)
        back = torch.zeros(4096, dtype=torch.int32)
        readback = first.register_memory(back)
        big = torch.ones(8 << 20, dtype=torch.uint8)  # 8 MiB: a worker thread's copy, never the caller's
        big_mem, big_landed = first.register_memory(big), torch.zeros(8 << 20, dtype=torch.uint8)
        big_remote = second.register_memory(big_landed).to_remote_buffer()
        self.assertEqual(first.write(big_mem.to_view(), big_remote), 0)
        with stalled(first):
            values += 1
            self.assertEqual(first.write(mine.to_view(), theirs, timeout=5), 0)
            self.assertEqual(landed, values)
            self.assertEqual(first.read(readback.to_mutable_view(), theirs, timeout=5), 0)
            self.assertEqual(back, values)
            values += 1
            work = first.write(mine.to_view(), theirs, async_op=True)
            self.assertTrue(work.is_completed() and work.is_success())
            self.assertEqual(landed, values)
            big.fill_(7)
            pending = first.write(big_mem.to_view(), big_remote, async_op=True)  # 8 MiB: the loop's
            values += 1
            queued = first.write(mine.to_view(), theirs, async_op=True)  # behind it: the loop's too
            self.assertFalse(pending.is_completed() or queued.is_completed())
        self.assertTrue(pending.wait(timedelta(seconds=10)) and queued.wait(timedelta(seconds=10)))
        self.assertEqual(big_landed, big)
        self.assertEqual(landed, values)
        self.assertFalse(first._pending)


# ---------------------------------------------------------------------------- backend-wide cases
def test_descriptor_is_torchs_json_v1_envelope():
    desc = TransportRLRemoteBuffer("peer", 12345, "m1-ab", 64)
    data = desc.serialize()
    assert json.loads(data) == {"version": 1, "backend": BACKEND,
                                "fields": {"endpoint": "peer", "incarnation": 12345, "buffer": "m1-ab", "length": 64}}
    assert TransportRLRemoteBuffer.deserialize(data) == desc
    env = json.loads(data)
    for bad in (
        {**env, "backend": "nixl"},
        {**env, "version": 2},
        {**env, "fields": {**env["fields"], "extra": 1}},
        {**env, "fields": {**env["fields"], "length": -1}},
        {**env, "fields": {**env["fields"], "length": "64"}},
    ):
        with pytest.raises(ValueError):
            TransportRLRemoteBuffer.deserialize(json.dumps(bad).encode())
    for raw in (b"", b"\xff", b"[]", b'{"version":1,"version":1,"backend":"transport_rl","fields":{}}'):
        with pytest.raises(ValueError):
            TransportRLRemoteBuffer.deserialize(raw)
    with pytest.raises(TypeError):
        TransportRLRemoteBuffer.deserialize("text")  # type: ignore[arg-type]


def test_entry_point_loads_the_backend(tmp_path):
    """torch discovers the backend through the entry point pyproject.toml declares, in a fresh
    interpreter (the installed project's, or the same entry point as metadata on sys.path)."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    target = declared["torch.distributed.transports"][BACKEND]
    installed = [e for e in entry_points(group="torch.distributed.transports") if e.name == BACKEND]
    if installed:  # the project is installed (pip install -e .): its metadata must say the same
        assert [e.value for e in installed] == [target]
    else:  # from a checkout: the same entry point, as a distribution's metadata on sys.path
        dist = tmp_path / "transport_rl_probe-0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transport-rl-probe\nVersion: 0\n")
        (dist / "entry_points.txt").write_text(f"[torch.distributed.transports]\n{BACKEND} = {target}\n")
    code = (
        "import sys, torch\n"
        "from torch.distributed._transport import available_transports, new_transport\n"
        f"assert {BACKEND!r} in available_transports(), available_transports()\n"
        "assert 'transport.torch_backend' not in sys.modules\n"  # lazily: only once selected
        f"with new_transport({BACKEND!r}, 'cpu') as a, new_transport({BACKEND!r}, 'cpu') as b:\n"
        "    a.connect(b.bind()); b.connect(a.bind())\n"
        "    src = torch.arange(16.0); dst = torch.zeros(16)\n"
        "    m = a.register_memory(src); r = b.register_memory(dst).to_remote_buffer()\n"
        "    a.write(m.to_view(), type(r).deserialize(r.serialize()))\n"
        "    assert torch.equal(src, dst)\n"
        "print('ok', type(a).__module__)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "transport.torch_backend._transport"]


def test_the_library_does_not_import_torchs_transport():
    code = "import sys, transport, transport.blocking; print('torch.distributed._transport' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("plane", ["tcp", "shm"])
def test_new_transport_rank_over_a_store(plane):
    store = HashStore()
    made: dict[int, Any] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            made[r] = tdt.new_transport_rank(BACKEND, "cpu", store=store, rank=r, peer_rank=1 - r,
                                             bootstrap_timeout=20, plane=plane)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    try:
        src, dst = torch.arange(32.0), torch.zeros(32)
        mem = made[0].register_memory(src)
        remote = made[1].register_memory(dst).to_remote_buffer()
        assert made[0].write(mem.to_view(), TransportRLRemoteBuffer.deserialize(remote.serialize()), timeout=10) == 0
        assert torch.equal(src, dst)
    finally:
        for tr in made.values():
            tr.close(timeout=10)


def _stoppable_peer(to_test: Any, from_test: Any) -> None:
    tr = tdt.new_transport(BACKEND, "cpu", plane="tcp", timeout=10)
    to_test.put(tr.bind())
    tr.connect(from_test.get(timeout=60))
    memory = tr.register_memory(torch.zeros(1024))
    to_test.put(memory.to_remote_buffer().serialize())
    from_test.get(timeout=120)
    tr.close(timeout=10)


def test_a_transfers_bound_counts_its_turn_behind_earlier_ones():
    """``transfer_timeout`` bounds a transfer from its submission: three writes queued behind
    each other to a peer that does not answer (a spawned process, SIGSTOPped) all fail within
    about one bound, not one bound each in turn (the third after three)."""
    ctx = multiprocessing.get_context("spawn")
    to_test, from_test = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=_stoppable_peer, args=(to_test, from_test), daemon=True)
    peer.start()
    first = tdt.new_transport(BACKEND, "cpu", plane="tcp", timeout=10, transfer_timeout=1)
    try:
        address = to_test.get(timeout=60)
        from_test.put(first.bind())
        assert first.connect(address) == 0
        remote = TransportRLRemoteBuffer.deserialize(to_test.get(timeout=60))
        source = first.register_memory(torch.ones(1024))
        assert first.write(source.to_view(), remote) == 0
        os.kill(peer.pid, signal.SIGSTOP)
        try:
            from tests._remote import wait_stopped

            wait_stopped(peer.pid)  # (kill() returns before the peer stops: it could still answer the first write)
            start = time.monotonic()
            works = [first.write(source.to_view(), remote, async_op=True, timeout=1) for _ in range(3)]
            errors = []
            for work in works:
                try:
                    work.wait(timedelta(seconds=10))
                except BaseException as exc:  # noqa: BLE001 - checked below
                    errors.append(exc)
            took = time.monotonic() - start
        finally:
            os.kill(peer.pid, signal.SIGCONT)
        assert len(errors) == 3 and all(isinstance(e, transport.TransportTimeoutError) for e in errors), errors
        assert "never started" in str(errors[2])
        assert took < 2.5, took  # (one bound each in turn: 3 s)
        from_test.put("stop")
    finally:
        first.close(timeout=10)
        peer.join(30)
        if peer.is_alive():
            peer.kill()
            peer.join(5)


# ---------------------------------------------------------------------------- two processes
def _peer_process(rank: int, port: int, plane: str) -> None:
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    tr = tdt.new_transport_rank(BACKEND, "cpu", store=store, rank=rank, peer_rank=1 - rank,
                                bootstrap_timeout=30, plane=plane, timeout=10)
    other = 1 - rank
    source = torch.arange(1024, dtype=torch.float32) + rank
    target, second_target = torch.zeros_like(source), torch.zeros_like(source)
    mems = [tr.register_memory(t) for t in (source, target, second_target)]
    store.set(f"desc/{rank}", json.dumps([m.to_remote_buffer().serialize().decode() for m in mems]))
    store.wait([f"desc/{other}"], timedelta(seconds=30))
    remote_source, remote_target, remote_second = (
        TransportRLRemoteBuffer.deserialize(d.encode()) for d in json.loads(store.get(f"desc/{other}")))

    async def writes() -> None:
        works = [tr.write(mems[0].to_view(), r, async_op=True) for r in (remote_target, remote_second)]
        await tdt.wait_all(works, timeout=10)

    asyncio.run(writes())

    def barrier(tag: str) -> None:
        store.set(f"{tag}/{rank}", b"1")
        store.wait([f"{tag}/{other}"], timedelta(seconds=30))

    barrier("written")
    expected = torch.arange(1024, dtype=torch.float32) + other
    torch.testing.assert_close(target, expected)
    torch.testing.assert_close(second_target, expected)
    target.zero_()
    asyncio.run(tr.read_async(mems[1].to_mutable_view(), remote_source, timeout=10))
    torch.testing.assert_close(target, expected)
    barrier("finished")
    for m in mems:
        tr.unregister_memory(m)
    source.add_(10)
    target.zero_()
    fresh_source, fresh_target = tr.register_memory(source), tr.register_memory(target)
    assert not fresh_source.reused_registration() and not fresh_target.reused_registration()
    store.set(f"fresh/{rank}", fresh_target.to_remote_buffer().serialize())
    store.wait([f"fresh/{other}"], timedelta(seconds=30))
    tr.write(fresh_source.to_view(), TransportRLRemoteBuffer.deserialize(store.get(f"fresh/{other}")), timeout=10)
    barrier("rewritten")
    torch.testing.assert_close(target, expected + 10)
    barrier("checked")  # the peer no longer reads our memory: unregister and close
    tr.unregister_memory(fresh_source)
    tr.unregister_memory(fresh_target)
    asyncio.run(tr.close_async(timeout=10))


@pytest.mark.parametrize("plane", ["tcp", "shm"])
def test_two_processes(plane):
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_peer_process, args=(r, store.port, plane)) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 90
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        assert [p.exitcode for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            if p.pid is not None:
                p.join(5)
