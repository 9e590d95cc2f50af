"""The NCCL binding (transport/cuda/nccl_lib.py) on a real GPU.

What runs here (one GPU is enough for all but the last test): a non-blocking 1-rank communicator
(the 2.14-era ``ncclConfig_t`` through ctypes) reaching ready; a grouped send/recv to itself on a
dedicated stream, byte for byte, from 1 byte to 256 MiB; ordering against the caller's stream
(``dedicated.wait_stream(current)``); a lone self-recv reported as an error, not a hang;
``abort()`` bounded with the CUDA context still usable; ``close()`` idempotent; a 2-rank init
whose peer never comes timing out. Two processes on two GPUs run only where
``torch.cuda.device_count() >= 2``: NCCL refuses two ranks on one GPU ("Duplicate GPU detected").

No wait here is unbounded: GPU work is waited for by polling a CUDA event against a deadline,
never with ``synchronize()``, and child processes get bounded waits and are killed after them.
The conftest beside this file skips everything when CUDA is not available.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from transport.cuda import Communicator, NcclError, NcclLibrary, NcclResult, load_nccl
from transport.errors import Phase, TransportTimeoutError

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20

#: How long any single GPU step (one transfer, one small check) may take before it counts as a hang.
STEP_TIMEOUT_S = 30.0
#: The bound the design promises for ncclCommAbort (about 1 s with NCCL 2.28.9 on an H200, per the team's design notes).
ABORT_BOUND_S = 5.0


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _wait(stream: torch.cuda.Stream, what: str, timeout: float = STEP_TIMEOUT_S) -> float:
    """Wait for the work queued so far on ``stream`` by polling an event; fail (not hang) after
    ``timeout`` seconds. Returns the seconds waited."""
    event = torch.cuda.Event()
    event.record(stream)
    t0 = time.monotonic()
    deadline = t0 + timeout
    delay = 1e-4
    while not event.query():
        if time.monotonic() >= deadline:
            pytest.fail(f"{what}: the GPU work was not finished after {timeout:.0f} s (a hang)")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
    return time.monotonic() - t0


def _assert_cuda_usable(what: str) -> None:
    """A fresh allocation, a kernel and a copy back still work (bounded)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = torch.arange(1 << 20, device="cuda", dtype=torch.int64)
        total = (x * 2).sum()
    _wait(stream, f"{what}: a small tensor op", timeout=10.0)
    n = 1 << 20
    assert int(total.item()) == n * (n - 1), what


def _new_comm(lib: NcclLibrary, timeout: float = 60.0) -> Communicator:
    """Rank 0 of a fresh 1-rank non-blocking communicator on device 0."""
    return Communicator.init_rank(lib, 1, lib.get_unique_id(), 0, device=0, timeout=timeout)


@contextlib.contextmanager
def _aborted_at_exit(comm: Communicator) -> Iterator[Communicator]:
    """Whatever happens in the block, the communicator is torn down (abort is idempotent)."""
    try:
        yield comm
    finally:
        comm.abort()


def _self_send_recv(comm: Communicator, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Grouped send of ``src`` to rank 0 and receive into ``dst``, queued on ``stream``."""
    assert src.nbytes == dst.nbytes
    src.record_stream(stream)  # the allocator must not reuse them while the stream may still touch them
    dst.record_stream(stream)
    with comm.group(timeout=STEP_TIMEOUT_S):
        comm.send(src.data_ptr(), src.nbytes, 0, stream.cuda_stream)
        comm.recv(dst.data_ptr(), dst.nbytes, 0, stream.cuda_stream)


def _assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if torch.equal(got, want):
        return
    wrong = (got != want).nonzero().flatten()
    first = wrong[:5].tolist()
    pytest.fail(
        f"{what}: {wrong.numel()} of {want.numel()} bytes differ; first at {first}: "
        f"got {[int(got[i]) for i in first]}, want {[int(want[i]) for i in first]}"
    )


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lib() -> NcclLibrary:
    # On a GPU machine NCCL must be there (a CUDA torch maps one): a missing one is a failure.
    return load_nccl()


@pytest.fixture(scope="module")
def comm(lib: NcclLibrary) -> Iterator[Communicator]:
    """One healthy 1-rank communicator shared by the tests that leave it healthy."""
    c = _new_comm(lib)
    try:
        yield c
    finally:
        if not c.closed:
            c.close(timeout=STEP_TIMEOUT_S)  # aborts and raises if it cannot finish in time


# ---------------------------------------------------------------------------------------------
# One GPU
# ---------------------------------------------------------------------------------------------


def test_one_rank_nonblocking_communicator_is_ready(lib):
    t0 = time.monotonic()
    c = _new_comm(lib, timeout=60.0)
    with _aborted_at_exit(c):
        elapsed = time.monotonic() - t0
        assert (c.nranks, c.rank, c.device) == (1, 0, 0), repr(c)
        if os.environ.get("NCCL_COMM_BLOCKING") != "1":
            assert c.blocking is False, repr(c)
        assert c.async_error() == NcclResult.SUCCESS
        c.wait_ready(timeout=5.0)  # already ready: returns at once
        assert "non-blocking" in repr(c) or c.blocking
        assert elapsed < 60.0
        c.close(timeout=STEP_TIMEOUT_S)
        assert c.closed


@pytest.mark.parametrize("nbytes", [1, MiB + 3, 256 * MiB], ids=["1B", "1MiB+3", "256MiB"])
def test_grouped_self_send_recv_is_byte_exact(comm, nbytes):
    current = torch.cuda.current_stream()
    dedicated = torch.cuda.Stream()
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")  # fresh random data
    dst = torch.bitwise_not(src)  # poisoned: every byte differs from the source
    dedicated.wait_stream(current)  # src and dst were written on the current stream
    _self_send_recv(comm, src, dst, dedicated)
    _wait(dedicated, f"self send/recv of {nbytes} bytes")
    assert comm.async_error() == NcclResult.SUCCESS
    _assert_same_bytes(dst, src, f"self send/recv of {nbytes} bytes")


def test_send_is_ordered_after_the_callers_stream(comm):
    """Data written by a kernel on the caller's (current) stream, behind a ~0.2 s spin, is sent
    on the dedicated stream after ``dedicated.wait_stream(current)``: the bytes received are the
    kernel's, not the stale ones."""
    n = 64 * MiB
    want = ((torch.arange(n, dtype=torch.int64) * 7 + 3) % 251).to(torch.uint8)  # host reference
    current = torch.cuda.current_stream()
    dedicated = torch.cuda.Stream()
    src = torch.bitwise_not(want.to("cuda"))  # stale content: wrong everywhere
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(400_000_000)  # ~0.2 s at H200 clocks: the write below starts late
    src.copy_(((torch.arange(n, device="cuda", dtype=torch.int64) * 7 + 3) % 251).to(torch.uint8))
    dedicated.wait_stream(current)
    _self_send_recv(comm, src, dst, dedicated)
    current_still_busy = not current.query()  # if so, only the wait_stream kept the send in order
    _wait(dedicated, "ordered self send/recv")
    _assert_same_bytes(dst.cpu(), want, "send ordered after the current stream")
    print(f"current stream still busy when the group was queued: {current_still_busy}")


def test_close_is_bounded_and_idempotent(lib):
    c = _new_comm(lib)
    with _aborted_at_exit(c):
        src = torch.randint(0, 256, (MiB,), dtype=torch.uint8, device="cuda")
        dst = torch.bitwise_not(src)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        _self_send_recv(c, src, dst, stream)
        _wait(stream, "self send/recv before close")
        _assert_same_bytes(dst, src, "self send/recv before close")
        t0 = time.monotonic()
        c.close(timeout=STEP_TIMEOUT_S)
        assert time.monotonic() - t0 < STEP_TIMEOUT_S
        assert c.closed
        c.close()  # idempotent
        c.abort()  # a no-op on a closed communicator
        with pytest.raises(NcclError) as ei:
            c.send(src.data_ptr(), 16, 0, stream.cuda_stream)
        assert ei.value.code is NcclResult.INVALID_USAGE
    _assert_cuda_usable("after close")


def test_abort_is_bounded_and_cuda_stays_usable(lib):
    c = _new_comm(lib)
    with _aborted_at_exit(c):
        # Give it live connections first, so that abort has something to tear down.
        src = torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8, device="cuda")
        dst = torch.bitwise_not(src)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        _self_send_recv(c, src, dst, stream)
        _wait(stream, "self send/recv before abort")
        t0 = time.monotonic()
        c.abort()
        elapsed = time.monotonic() - t0
        assert elapsed < ABORT_BOUND_S, f"ncclCommAbort took {elapsed:.2f} s"
        assert c.closed
        c.abort()  # idempotent
        c.close()  # a no-op after abort
        with pytest.raises(NcclError) as ei:
            with c.group():
                pass
        assert ei.value.code is NcclResult.INVALID_USAGE
        print(f"abort took {elapsed:.3f} s")
    _assert_cuda_usable("after abort")
    # and NCCL itself still works: a new communicator moves bytes
    dst.fill_(0)
    stream.wait_stream(torch.cuda.current_stream())
    c2 = _new_comm(lib)
    with _aborted_at_exit(c2):
        _self_send_recv(c2, src, dst, stream)
        _wait(stream, "self send/recv on a new communicator after abort")
        _assert_same_bytes(dst, src, "self send/recv after abort")
        c2.close(timeout=STEP_TIMEOUT_S)


def test_lone_self_recv_is_an_error_not_a_hang(lib):
    """No matching send in the group: NCCL reports ncclInvalidUsage (so the team's design notes say of NCCL 2.28.9 on an H200), either
    from the call (NcclError raised) or asynchronously (async_error). Never a hang."""
    c = _new_comm(lib)
    stream = torch.cuda.Stream()
    dst = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    dst.record_stream(stream)
    stream.wait_stream(torch.cuda.current_stream())
    t0 = time.monotonic()
    error: NcclError | None = None
    reported: NcclResult | int | None = None
    with _aborted_at_exit(c):
        try:
            c.recv(dst.data_ptr(), dst.nbytes, 0, stream.cuda_stream, timeout=10.0)
        except NcclError as exc:
            error = exc
        except TransportTimeoutError as exc:
            pytest.fail(f"lone self-recv: NCCL stayed in progress until the deadline (a hang, bounded): {exc}")
        else:
            # Queued without an error: NCCL must report it asynchronously within the deadline.
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                state = c.async_error()
                if state not in (NcclResult.SUCCESS, NcclResult.IN_PROGRESS):
                    reported = state
                    break
                time.sleep(0.01)
            else:
                pytest.fail("lone self-recv: no error from the call nor from ncclCommGetAsyncError in 10 s")
    elapsed = time.monotonic() - t0  # the abort above included
    code = error.code if error is not None else reported
    print(f"lone self-recv: {error or reported!s} after {elapsed:.2f} s")
    assert code == NcclResult.INVALID_USAGE, f"expected ncclInvalidUsage, got {error or reported}"
    assert elapsed < 15.0
    _wait(stream, "the stream of the lone recv, after abort", timeout=10.0)
    _assert_cuda_usable("after a lone self-recv")


def test_two_rank_init_without_peer_times_out(lib):
    timeout = 3.0
    t0 = time.monotonic()
    with pytest.raises(TransportTimeoutError) as ei:
        c = Communicator.init_rank(lib, 2, lib.get_unique_id(), 0, device=0, timeout=timeout)
        c.abort()  # not reached unless the init wrongly succeeds
    elapsed = time.monotonic() - t0
    assert ei.value.phase is Phase.CONNECT
    assert "aborted" in str(ei.value)
    # The deadline, then ncclCommAbort (about 1 s; the binding polls an in-progress abort for 10 s at most).
    assert timeout - 0.1 <= elapsed < timeout + ABORT_BOUND_S + 10.0, f"{elapsed:.2f} s"
    print(f"2-rank init without a peer: TransportTimeoutError after {elapsed:.2f} s")
    _assert_cuda_usable("after an init that timed out")


# ---------------------------------------------------------------------------------------------
# Two processes, two GPUs
# ---------------------------------------------------------------------------------------------

_RANK_SCRIPT = r"""
import json, sys, time
import torch
from transport.cuda import Communicator, load_nccl

rank, uid, n = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), int(sys.argv[3])
torch.cuda.set_device(rank)
lib = load_nccl()
want = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1234))
comm = Communicator.init_rank(lib, 2, uid, rank, device=rank, timeout=60)
try:
    stream = torch.cuda.Stream()
    buf = want.to("cuda") if rank == 0 else torch.bitwise_not(want).to("cuda")
    stream.wait_stream(torch.cuda.current_stream())
    t0 = time.monotonic()
    if rank == 0:
        comm.send(buf.data_ptr(), n, 1, stream.cuda_stream, timeout=60)
    else:
        comm.recv(buf.data_ptr(), n, 0, stream.cuda_stream, timeout=60)
    event = torch.cuda.Event()
    event.record(stream)
    deadline = time.monotonic() + 60
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: transfer not finished after 60 s")
        time.sleep(0.001)
    seconds = time.monotonic() - t0
    ok = rank == 0 or torch.equal(buf.cpu(), want)
    comm.close(timeout=60)
except BaseException:
    comm.abort()
    raise
print(json.dumps({"rank": rank, "ok": bool(ok), "seconds": seconds, "device": comm.device}))
"""


def test_two_processes_two_gpus_send_recv(lib):
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {count}: NCCL refuses two ranks on one GPU")
    n = 64 * MiB
    uid = lib.get_unique_id().hex()  # this process hosts NCCL's bootstrap root for the pair
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT, str(rank), uid, str(n)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs: list[tuple[int | None, str, str]] = []
    deadline = time.monotonic() + 100.0
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate(timeout=10)
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for rank, (rc, out, err) in enumerate(outputs):
        assert rc == 0, f"rank {rank} exited with {rc}\nstdout:\n{out}\nstderr:\n{err[-4000:]}"
        result = json.loads(out.strip().splitlines()[-1])
        assert result["rank"] == rank and result["device"] == rank and result["ok"], result
    print(f"2 processes, 64 MiB: {[json.loads(o[1].strip().splitlines()[-1]) for o in outputs]}")
