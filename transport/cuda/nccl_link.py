"""The CUDA engine of the ``nccl`` plane's link (:mod:`transport.planes.nccl_engine`, :mod:`transport.planes.nccl`).

One 2-rank communicator per channel, created non-blocking (``ncclCommInitRankConfig``, bounded by the
endpoint's timeout) on the endpoint's device, plus one dedicated stream. Right after joining, both
ranks exchange one byte inside a group, so NCCL's point-to-point connection is set up before the
first real op (posting then never waits on it). Each op's sends and receives are one NCCL group,
posted by the link's own thread (its group end returns ``ncclInProgress`` on a non-blocking
communicator and is polled there, never on the event loop), after a ``wait_event`` (on the GPU) for
the event recorded on the caller's current stream at the call; a blocking-sync event recorded after
the group is what the link's completion bridge sleeps on. Abort is ``ncclCommAbort``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..completion import Posted, Poster
from ..errors import PlaneUnavailableError, StagingError
from .marks import caller_marks
from .nccl_comm import Communicator
from .nccl_loader import NcclUnavailableError, load_nccl
from .staging import CudaCopyHandle

__all__ = ["NcclConn", "NcclLinkEngine", "nccl_link_engine"]


class NcclConn:
    """One side of a channel's link: the communicator, its peer rank, the channel's stream, and the
    thread that posts on them (:class:`~transport.completion.Poster`)."""

    def __init__(self, comm: Communicator, index: int) -> None:
        self.comm = comm
        self.index = index
        self.peer = 1 - comm.rank
        self.stream = torch.cuda.Stream(device=index)
        self._handle = self.stream.cuda_stream
        self._poster = Poster(f"transport-nccl-post-{index}")

    def post(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], after: Any) -> Posted:
        """One op's sends and receives in one NCCL group, after ``after`` (events of the caller's
        streams), on the poster's thread: the group end's ``ncclInProgress`` is polled there, never
        on the caller's. The event that completes the op is recorded once the group is launched."""
        sends, recvs = list(sends), list(recvs)

        def job() -> torch.cuda.Event:
            with torch.cuda.device(self.index):
                for event in after or ():
                    self.stream.wait_event(event)
                with self.comm.group():
                    for t in sends:
                        self.comm.send(t.data_ptr(), t.numel(), self.peer, self._handle)
                    for t in recvs:
                        self.comm.recv(t.data_ptr(), t.numel(), self.peer, self._handle)
                done = torch.cuda.Event(blocking=True)  # the completion bridge sleeps on it
                done.record(self.stream)
            return done

        return self._poster.submit(job)

    def abort(self) -> None:
        self.comm.abort()
        self._poster.close(timeout=0)  # (jobs still queued fail at once: the communicator is gone)


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
