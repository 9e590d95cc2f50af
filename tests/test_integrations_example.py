"""examples/rl_sync_engines.py, the parts that need neither vLLM nor SGLang (docs/integrations.md).

A real trainer (asyncio endpoint + rl_sync.WeightPublisher) pushes to a real RlSyncReceiver
(BlockingEndpoint + BlockingWeightSubscriber) over a TCPStore, in one process on CPU. vLLM and
SGLang themselves are not installed here (CUDA wheels): the vLLM engine class is not built, and
update_sglang is driven by a recording object that has SGLang's two Engine methods it calls
(a stand-in for SGLang, not for the code under test)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rl_sync
import transport

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("rl_sync_engines", ROOT / "examples" / "rl_sync_engines.py")
assert _spec is not None and _spec.loader is not None
engines = importlib.util.module_from_spec(_spec)
sys.modules["rl_sync_engines"] = engines
_spec.loader.exec_module(engines)

WEIGHTS = {"model.embed.weight": torch.arange(24, dtype=torch.float32).reshape(4, 6),
           "model.layers.0.mlp.weight": torch.linspace(-1, 1, 40).reshape(8, 5),
           "lm_head.bias": torch.arange(3, dtype=torch.float32)}


def _layout() -> tuple[list[str], list[str], list[list[int]]]:
    names = list(WEIGHTS)
    return names, [str(t.dtype).removeprefix("torch.") for t in WEIGHTS.values()], [list(t.shape) for t in WEIGHTS.values()]


def _push(store_url: str, trainer: str, subscribers: list[str], version: int, scale: float) -> rl_sync.PushReport:
    async def go() -> rl_sync.PushReport:
        async with transport.Endpoint(trainer, store=store_url, timeout=20) as ep:
            pub = rl_sync.WeightPublisher(ep, subscribers, bucket_bytes=256)
            return await pub.push({n: t * scale for n, t in WEIGHTS.items()}, version, timeout=30)

    return asyncio.run(go())


def test_a_pushed_version_reaches_load_weights_in_chunks(store_url, uname):
    names, dtypes, shapes = _layout()
    rx = engines.RlSyncReceiver(engines.subscriber_name(uname("vllm"), 0), store_url, names, dtypes, shapes,
                                timeout=20)
    try:
        assert rx.version == 0
        report = _push(store_url, uname("trainer"), [rx.name], 1, 2.0)
        assert report.ok, report.summary()
        got: list[list[tuple[str, torch.Tensor]]] = []
        assert rx.receive(1, lambda chunk: got.append([(n, t.clone()) for n, t in chunk]), chunk_bytes=100) == 1
        assert [len(c) for c in got] == [2, 1]  # 96, 160, 12 bytes: a chunk ends once it holds >= 100
        loaded = dict(item for chunk in got for item in chunk)
        assert loaded.keys() == WEIGHTS.keys()
        for n, t in WEIGHTS.items():
            assert torch.equal(loaded[n], t * 2.0), n
        with pytest.raises(transport.TransportTimeoutError):
            rx.receive(2, lambda chunk: None, timeout=0.3)  # never pushed
    finally:
        rx.close()


def test_update_sglang_loads_every_chunk_then_flushes_once(store_url, uname):
    names, dtypes, shapes = _layout()
    rx = engines.RlSyncReceiver(uname("sglang"), store_url, names, dtypes, shapes, timeout=20)

    class Recording:  # the two sglang.Engine methods update_sglang calls, with the signatures read from SGLang
        def __init__(self, answer: tuple[bool, str] = (True, "Success")) -> None:
            self.calls: list[tuple[list[str], bool]] = []
            self.flushes = 0
            self.answer = answer

        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            self.calls.append(([n for n, _ in named_tensors], flush_cache))
            return self.answer

        def flush_cache(self):
            self.flushes += 1

    try:
        assert _push(store_url, uname("trainer"), [rx.name], 3, -1.0).ok
        eng = Recording()
        assert engines.update_sglang(eng, rx, 3, chunk_bytes=1 << 20) == 3
        assert eng.calls == [(names, False)] and eng.flushes == 1
        with pytest.raises(RuntimeError, match="nope"):
            engines.update_sglang(Recording((False, "nope")), rx, 3)
    finally:
        rx.close()


def test_worker_rank_follows_vllms_nccl_engine():
    assert engines.worker_rank(SimpleNamespace(data_parallel_index=2, world_size=4, rank=1)) == 9
    assert engines.worker_rank(SimpleNamespace(rank=3)) == 3


def test_the_layout_is_checked_and_vllm_is_imported_only_when_asked():
    with pytest.raises(ValueError, match="differ in length"):
        engines.RlSyncReceiver("x", "tcp://127.0.0.1:1", ["a"], [], [[1]])
    with pytest.raises(ValueError, match="unknown dtype"):
        engines.RlSyncReceiver("x", "tcp://127.0.0.1:1", ["a"], ["float99"], [[1]])
    assert "vllm" not in sys.modules
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError):
            engines.make_vllm_engine()
