"""Backend-generic cases of PyTorch's one-sided Transport contract (torch.distributed._transport).

These follow, case for case, ``TransportTestMixin`` in pytorch/pytorch
``test/distributed/transport_test_utils.py`` (the version at commit
0395cf87dc60b7a794885a0aba50378f3d30fd0f: test_transport_conformance,
test_transport_partial_view_and_registration_reuse, test_transport_async_work,
test_transport_asyncio_put_get), written anew here rather than copied: the same calls and the
same expectations, so a backend that passes them passes PyTorch's. PyTorch is BSD-3-Clause
licensed (Copyright (c) 2016- Facebook, Inc and its affiliates; see its LICENSE file); drop in
the verbatim file, with its notice, to run the upstream text itself.

A subclass (also a ``unittest.TestCase``) implements :meth:`make_transport_pair`, returning two
transports connected to each other.
"""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import torch
from torch.distributed._transport import Work, wait_all

__all__ = ["TransportContractMixin"]


class TransportContractMixin:
    assertEqual: Any
    assertTrue: Any
    assertFalse: Any
    assertIsInstance: Any
    assertRaises: Any

    def make_transport_pair(self) -> tuple[Any, Any]:
        raise NotImplementedError

    def test_transport_conformance(self) -> None:
        first, second = self.make_transport_pair()
        try:
            values = torch.arange(4096, dtype=torch.int32)
            landed = torch.zeros_like(values)
            mine = first.register_memory(values)
            theirs = second.register_memory(landed)
            remote = pickle.loads(pickle.dumps(theirs.to_remote_buffer()))  # descriptors survive pickling
            self.assertEqual(mine.to_view().size(), values.nbytes)
            self.assertEqual(theirs.to_mutable_view(16, 32).size(), 32)
            self.assertEqual(first.write(mine.to_view(), remote), 0)
            self.assertEqual(landed, values)
            back = torch.zeros_like(values)
            back_memory = first.register_memory(back)
            self.assertEqual(first.read(back_memory.to_mutable_view(), theirs.to_remote_buffer()), 0)
            self.assertEqual(back, values)
        finally:
            first.close()
            second.close()

    def test_transport_partial_view_and_registration_reuse(self) -> None:
        first, second = self.make_transport_pair()
        try:
            values = torch.arange(64, dtype=torch.uint8)
            landed = torch.zeros(16, dtype=torch.uint8)
            mine = first.register_memory(values)
            theirs = second.register_memory(landed)
            self.assertFalse(mine.reused_registration())
            self.assertTrue(first.register_memory(values).reused_registration())
            self.assertEqual(first.write(mine.to_view(16, 16), theirs.to_remote_buffer()), 0)
            self.assertEqual(landed, values[16:32])
            with self.assertRaises(ValueError):
                mine.to_view(values.nbytes + 1)
        finally:
            first.close()
            second.close()

    def test_transport_async_work(self) -> None:
        first, second = self.make_transport_pair()
        try:
            values = torch.arange(64, dtype=torch.uint8)
            landed = torch.zeros_like(values)
            back = torch.zeros_like(values)
            mine = first.register_memory(values)
            theirs = second.register_memory(landed)
            back_memory = first.register_memory(back)
            remote = pickle.loads(pickle.dumps(theirs.to_remote_buffer()))
            # as upstream: both are submitted before either is waited for
            write = first.write(mine.to_view(), remote, async_op=True)
            read = first.read(back_memory.to_mutable_view(), remote, async_op=True)
            self.assertIsInstance(write, Work)
            self.assertIsInstance(read, Work)
            self.assertTrue(read.wait())
            self.assertTrue(write.wait())
            self.assertTrue(write.is_completed())
            self.assertTrue(read.is_completed())
            self.assertEqual(read.get_future().wait(), [])
            self.assertEqual(landed, values)
            self.assertEqual(back, values)
        finally:
            first.close()
            second.close()

    def test_transport_asyncio_put_get(self) -> None:
        client, server = self.make_transport_pair()
        try:
            values = torch.arange(64, dtype=torch.uint8)
            kept = torch.zeros_like(values)
            returned = torch.zeros_like(values)
            values_memory = client.register_memory(values)
            kept_memory = server.register_memory(kept)

            async def run() -> None:
                await server.read_async(kept_memory.to_mutable_view(), values_memory.to_remote_buffer())
                returned_memory = client.register_memory(returned)
                await server.write_async(kept_memory.to_view(), returned_memory.to_remote_buffer())
                await wait_all(
                    server.write(kept_memory.to_view(), returned_memory.to_remote_buffer(), async_op=True)
                    for _ in range(2)
                )

            asyncio.run(run())
            self.assertEqual(kept, values)
            self.assertEqual(returned, values)
        finally:
            server.close()
            client.close()
