"""rl_sync as the weight path of an inference engine: vLLM's weight-transfer engine interface and
SGLang's ``Engine.update_weights_from_tensor``. See docs/integrations.md for the wiring and for
what was and was not run (vLLM and SGLang were not: their wheels are CUDA builds).

The part both share, :class:`RlSyncReceiver`, imports neither and is tested
(tests/test_integrations_example.py): one inference worker's :class:`rl_sync.BlockingWeightSubscriber`
into receive buffers laid out as the trainer's weights (its names, dtypes and full shapes), handed
to the engine's own loader (``model.load_weights``, which maps checkpoint names onto fused and
sharded parameters) inside :meth:`rl_sync.BlockingWeightSubscriber.hold`, so a push never changes
them while the engine reads them. vLLM is imported only by :func:`make_vllm_engine`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

import rl_sync
import transport

__all__ = ["RlSyncReceiver", "make_vllm_engine", "register_vllm_engine", "subscriber_name", "update_sglang",
           "worker_rank"]

LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], Any]


def subscriber_name(prefix: str, rank: int) -> str:
    """The endpoint name of inference worker ``rank``: what the trainer lists in its publisher."""
    return f"{prefix}-{rank}"


class RlSyncReceiver:
    """One inference worker's receiving end: a blocking endpoint and subscriber (no asyncio needed).

    ``names``/``dtype_names``/``shapes`` describe the trainer's weights as it pushes them (the
    checkpoint names the engine's ``load_weights`` understands). The receive buffers are made
    here, zero-filled, on ``device``; ``mode`` is the subscriber's (``"staged"``: a push lands
    while the engine keeps reading the previous version). The endpoint joins the job's store
    ``store`` (``"tcp://HOST:PORT"``, typically served by the trainer) as ``name``.
    Constructing blocks until the endpoint is published (at most ``timeout``).
    """

    def __init__(self, name: str, store: str, names: Sequence[str], dtype_names: Sequence[str],
                 shapes: Sequence[Sequence[int]], *, device: str = "cpu", mode: str = "staged",
                 timeout: float = 120.0) -> None:
        if not len(names) == len(dtype_names) == len(shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: "
                             f"{len(names)}, {len(dtype_names)}, {len(shapes)}")
        self.buffers: dict[str, torch.Tensor] = {}
        for n, d, s in zip(names, dtype_names, shapes, strict=True):
            dtype = getattr(torch, d, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{n!r}: unknown dtype name {d!r}")
            self.buffers[n] = torch.zeros(tuple(s), dtype=dtype, device=device)
        self.timeout = timeout
        self._ep = transport.BlockingEndpoint(name, store=store, timeout=timeout)
        try:
            self._sub = rl_sync.BlockingWeightSubscriber(self._ep, self.buffers, mode=mode)
        except BaseException:
            self._ep.close()
            raise

    @property
    def name(self) -> str:
        return self._ep.name

    @property
    def version(self) -> int:
        """The newest committed version (0 before the first push)."""
        return self._sub.version

    def receive(self, version: int, load_weights: LoadWeights, *, timeout: float | None = None,
                chunk_bytes: int = 1 << 30) -> int:
        """Wait until ``version`` (or a newer one) is committed, then call ``load_weights`` with
        the received ``(name, tensor)`` pairs, in chunks of about ``chunk_bytes``, while holding
        the version (no push changes the buffers meanwhile); return the version loaded.

        Blocks at most ``timeout`` (default the receiver's) for the version and again for the
        hold; :class:`transport.TransportTimeoutError` if it is not pushed in time. The tensors
        passed are the receive buffers themselves: ``load_weights`` must copy out of them (as
        vLLM's and SGLang's loaders do) and keep no reference past its return."""
        t = self.timeout if timeout is None else timeout
        self._sub.wait_for_version(version, t)
        with self._sub.hold(t) as held:
            for chunk in self._chunks(chunk_bytes):
                load_weights(chunk)
        return held

    def _chunks(self, chunk_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        chunk: list[tuple[str, torch.Tensor]] = []
        size = 0
        for item in self.buffers.items():
            chunk.append(item)
            size += item[1].numel() * item[1].element_size()
            if size >= chunk_bytes:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk

    def close(self) -> None:
        """Stop receiving and close the endpoint (idempotent)."""
        with contextlib.suppress(transport.EndpointClosedError):
            self._sub.close()
        self._ep.close()


def worker_rank(parallel_config: Any) -> int:
    """A vLLM worker's rank across data-parallel replicas, computed as vLLM's NCCL engine does
    (``data_parallel_index * world_size + rank`` of its ``ParallelConfig``; a missing field
    counts as 0 for the index and the rank, 1 for the world size)."""
    dp = getattr(parallel_config, "data_parallel_index", getattr(parallel_config, "data_parallel_rank", 0)) or 0
    return int(dp) * int(getattr(parallel_config, "world_size", 1) or 1) + int(getattr(parallel_config, "rank", 0) or 0)


def make_vllm_engine() -> type:
    """Build the vLLM engine class (imports vLLM; ``ImportError`` without it).

    Written against ``vllm/distributed/weight_transfer/base.py`` and ``nccl_engine.py`` as read
    for docs/integrations.md, and never run: ``receive_weights`` takes the ``load_weights``
    callback where vLLM passes one (``receive_weights(update_info, load_weights)``) and
    falls back to ``self.model.load_weights`` where it does not (the later interface, whose
    engines get the model at construction)."""
    from dataclasses import dataclass, field

    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class RlSyncInitInfo(WeightTransferInitInfo):
        store: str
        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]
        name_prefix: str = "vllm"
        device: str = "cpu"
        mode: str = "staged"
        timeout: float = 120.0

    @dataclass
    class RlSyncUpdateInfo(WeightTransferUpdateInfo):
        version: int
        timeout: float | None = None
        chunk_bytes: int = field(default=1 << 30)

    class RlSyncWeightTransferEngine(WeightTransferEngine):  # type: ignore[misc, valid-type]
        """rl_sync as a vLLM weight-transfer engine: each worker subscribes as ``{prefix}-{rank}``."""

        init_info_cls = RlSyncInitInfo
        update_info_cls = RlSyncUpdateInfo

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.receiver: RlSyncReceiver | None = None

        def init_transfer_engine(self, init_info: RlSyncInitInfo) -> None:
            rank = worker_rank(self.parallel_config)
            self.receiver = RlSyncReceiver(subscriber_name(init_info.name_prefix, rank), init_info.store,
                                           init_info.names, init_info.dtype_names, init_info.shapes,
                                           device=init_info.device, mode=init_info.mode, timeout=init_info.timeout)

        def start_weight_update(self) -> None:
            pass  # the bytes land in rl_sync's buffers during the push, before update_weights is called

        def finish_weight_update(self) -> None:
            pass

        def receive_weights(self, update_info: RlSyncUpdateInfo, load_weights: LoadWeights | None = None) -> None:
            if self.receiver is None:
                raise RuntimeError("rl_sync weight transfer not initialized: call init_transfer_engine() first")
            if load_weights is None:
                load_weights = self.model.load_weights
            self.receiver.receive(update_info.version, load_weights, timeout=update_info.timeout,
                                  chunk_bytes=update_info.chunk_bytes)

        def shutdown(self) -> None:
            if self.receiver is not None:
                self.receiver.close()
                self.receiver = None

        @staticmethod
        def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
            raise NotImplementedError("rl_sync's trainer side is `await rl_sync.WeightPublisher(ep, names).push("
                                      "model, version)` on an asyncio endpoint; see docs/integrations.md")

    return RlSyncWeightTransferEngine


def register_vllm_engine(name: str = "rl_sync") -> type:
    """Register the engine with ``WeightTransferEngineFactory`` under ``name`` (in every process
    that creates engines, i.e. each vLLM worker) and return its class."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    cls = make_vllm_engine()
    WeightTransferEngineFactory.register_engine(name, cls)
    return cls


def update_sglang(engine: Any, receiver: RlSyncReceiver, version: int, *, timeout: float | None = None,
                  chunk_bytes: int = 1 << 30, flush_cache: bool = True) -> int:
    """Load ``version`` into an ``sglang.Engine`` with ``engine.update_weights_from_tensor``.

    Each chunk goes in with ``flush_cache=False`` and the cache is flushed once at the end
    (``engine.flush_cache()``), as SGLang's docstring recommends for several updates. A call
    that returns ``(False, message)`` raises ``RuntimeError(message)``. Returns the version."""

    def load(chunk: list[tuple[str, torch.Tensor]]) -> None:
        got = engine.update_weights_from_tensor(chunk, flush_cache=False)
        if isinstance(got, tuple) and got and got[0] is False:
            raise RuntimeError(f"SGLang refused the weights: {got[1] if len(got) > 1 else got}")

    held = receiver.receive(version, load, timeout=timeout, chunk_bytes=chunk_bytes)
    if flush_cache:
        engine.flush_cache()
    return held
