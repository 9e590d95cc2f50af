"""The CUDA engine of the ``nccl`` plane's link (:mod:`transport.p2p`, :mod:`transport.planes.nccl`).

One 2-rank communicator per channel, created non-blocking (``ncclCommInitRankConfig``, bounded by the
endpoint's timeout) on the endpoint's device, plus one dedicated stream. Right after joining, both
ranks exchange one byte inside a group, so NCCL's point-to-point connection is set up before the
first real op (posting then never waits on it). A send or receive first waits (``wait_event``, on
the GPU) for the event recorded on the caller's current stream at the call, then is followed by a
blocking-sync event that the link's completion bridge sleeps on. Abort is ``ncclCommAbort``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import PlaneUnavailableError, StagingError
from .marks import caller_marks
from .nccl_lib import Communicator, NcclUnavailableError, load_nccl
from .staging import CudaCopyHandle

__all__ = ["NcclConn", "NcclLinkEngine", "nccl_link_engine"]


class NcclConn:
    """One side of a channel's link: the communicator, its peer rank and the channel's stream."""

    def __init__(self, comm: Communicator, index: int) -> None:
        self.comm = comm
        self.index = index
        self.peer = 1 - comm.rank
        self.stream = torch.cuda.Stream(device=index)
        self._handle = self.stream.cuda_stream

    def _post(self, what: str, data: torch.Tensor, after: Any) -> torch.cuda.Event:
        with torch.cuda.device(self.index):
            for event in after or ():
                self.stream.wait_event(event)
            if what == "send":
                self.comm.send(data.data_ptr(), data.numel(), self.peer, self._handle)
            else:
                self.comm.recv(data.data_ptr(), data.numel(), self.peer, self._handle)
            done = torch.cuda.Event(blocking=True)  # the completion bridge sleeps on it
            done.record(self.stream)
        return done

    def send(self, data: torch.Tensor, after: Any) -> torch.cuda.Event:
        return self._post("send", data, after)

    def recv(self, data: torch.Tensor, after: Any) -> torch.cuda.Event:
        return self._post("recv", data, after)

    def abort(self) -> None:
        self.comm.abort()


class NcclLinkEngine:
    """NCCL point-to-point on CUDA device ``index`` (the endpoint's device)."""

    name = "nccl"

    def __init__(self, index: int) -> None:
        self.lib = load_nccl()
        self.index = index
        self.device = f"cuda:{index}"

    def handles(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda and tensor.device.index == self.index

    def unique_id(self) -> bytes:
        return self.lib.get_unique_id()

    def connect(self, unique_id: bytes, rank: int, timeout: float) -> NcclConn:
        """Join the 2-rank communicator and do the first exchange; all of it within ``timeout``."""
        deadline = time.monotonic() + timeout

        def left() -> float:
            return max(deadline - time.monotonic(), 1e-3)

        comm = Communicator.init_rank(self.lib, 2, unique_id, rank, blocking=False, device=self.index, timeout=timeout)
        try:
            conn = NcclConn(comm, self.index)
            with torch.cuda.device(self.index):
                out = torch.zeros(1, dtype=torch.uint8, device=self.index)
                back = torch.empty(1, dtype=torch.uint8, device=self.index)
                torch.cuda.current_stream(self.index).synchronize()
                with comm.group(timeout=left()):  # set the p2p connection up now, in both directions
                    comm.send(out.data_ptr(), 1, conn.peer, conn._handle)
                    comm.recv(back.data_ptr(), 1, conn.peer, conn._handle)
                event = torch.cuda.Event()
                event.record(conn.stream)
            try:  # (the staged path's bounded event poll)
                CudaCopyHandle(event).wait(left())
            except StagingError as exc:
                raise PlaneUnavailableError(f"the NCCL link's first exchange: {exc}") from exc
            return conn
        except BaseException:
            comm.abort()
            raise

    def mark(self, tensors: Sequence[torch.Tensor]) -> list[torch.cuda.Event]:
        return caller_marks(tensors)

    def scratch(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.index)


_lock = threading.Lock()


def nccl_link_engine(device: int | None = None) -> tuple[NcclLinkEngine | None, str]:
    """An engine for ``device`` (default: the current CUDA device), or None and why not."""
    with _lock:
        if not torch.cuda.is_available():
            return None, "CUDA is not available in this process"
        index = torch.cuda.current_device() if device is None else device
        try:
            engine = NcclLinkEngine(index)
        except NcclUnavailableError as exc:
            return None, f"NCCL cannot be loaded: {exc}"
        if not engine.lib.has("ncclCommInitRankConfig"):
            return None, f"NCCL {engine.lib.version_string} has no ncclCommInitRankConfig (non-blocking init)"
        return engine, f"NCCL {engine.lib.version_string} on cuda:{index}"
