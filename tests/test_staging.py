"""The staging pipeline (transport/staging.py) on CPU, with a real asynchronous copy engine.

``ThreadCopyEngine`` runs every copy on a worker thread, so copies complete while the pipeline
goes on, as on a CUDA stream. Subclasses below only slow a copy down, make it fail, or hold it,
to make races, bounds and errors observable; the pipeline itself is the code under test. Every
check uses fresh random bytes, a destination poisoned first, and byte equality.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from transport.bounce import stage_in, stage_out
from transport.errors import StagingError
from transport.staging import Staging, StagingConfig, ThreadCopyEngine

POISON = 0xA5


def random_bytes(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8)


def poisoned(n: int) -> torch.Tensor:
    return torch.full((n,), POISON, dtype=torch.uint8)


class Watched(ThreadCopyEngine):
    """Records which storages copies touch and how many copies are in flight at once;
    optionally sleeps in each copy (a slow device) or fails the copy number ``fail_at``."""

    def __init__(self, delay: float = 0.0, fail_at: int | None = None) -> None:
        super().__init__()
        self.delay = delay
        self.fail_at = fail_at
        self.calls = 0
        self.dst_ptrs: set[int] = set()  # storages copies wrote into (bounce buffers, when staging out)
        self.src_ptrs: set[int] = set()  # storages copies read from (bounce buffers, when staging in)
        self.in_flight = 0
        self.peak_in_flight = 0
        self._mu = threading.Lock()

    def copy(self, dst, src, after=None):
        with self._mu:
            self.calls += 1
            n = self.calls
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            self.dst_ptrs.add(dst.untyped_storage().data_ptr())
            self.src_ptrs.add(src.untyped_storage().data_ptr())
        if self.fail_at is not None and n == self.fail_at:
            with self._mu:
                self.in_flight -= 1
            raise RuntimeError(f"injected failure issuing copy {n}")
        return super().copy(dst, src, after)

    def _copy(self, dst, src):
        try:
            if self.delay:
                time.sleep(self.delay)
            dst.copy_(src)
        finally:
            with self._mu:
                self.in_flight -= 1


class FailsInCopy(ThreadCopyEngine):
    """The copy number ``fail_at`` fails on the worker thread (the error surfaces at its wait)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.calls = 0

    def _copy(self, dst, src):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected device error")
        dst.copy_(src)


class Held(ThreadCopyEngine):
    """Copies wait until ``release`` is set: a stalled device."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def _copy(self, dst, src):
        self.release.wait(30)
        dst.copy_(src)


def drain_out(src: torch.Tensor, staging: Staging, engine, *, pause: float = 0.0) -> torch.Tensor:
    """Consume stage_out like the sender does (use a view, then ask for the next one)."""
    out = poisoned(src.numel())
    ring = staging.ring(engine, src.numel())
    pos = 0
    try:
        for view in stage_out(src, ring, staging.config.stall_timeout):
            if pause:
                time.sleep(pause)  # the view must stay intact while it is being "sent"
            k = len(view)
            out[pos : pos + k] = torch.frombuffer(bytearray(view), dtype=torch.uint8)
            pos += k
    finally:
        ring.release()
    assert pos == src.numel()
    return out


def feed_in(dst: torch.Tensor, data: torch.Tensor, staging: Staging, engine, **kw) -> tuple[bool, list[int]]:
    """Run stage_in with ``data`` as the byte source; check ``more`` on every fill."""
    pos = 0
    mores: list[int] = []
    src = memoryview(data.numpy()).cast("B")

    def fill(view: memoryview, more: int) -> None:
        nonlocal pos
        k = len(view)
        assert more == data.numel() - pos - k, "fill was told a wrong number of bytes to follow"
        view[:] = src[pos : pos + k]
        pos += k
        mores.append(more)

    ring = staging.ring(engine, dst.numel())
    try:
        ok = stage_in(dst, ring, staging.config.stall_timeout, fill, **kw)
    finally:
        ring.release()
    assert pos == data.numel(), "stage_in did not consume the whole payload"
    return ok, mores


SIZES = [1, 2, 4095, 4096, 4097, 3 * 4096, 7 * 4096 + 3, 200 * 4096 + 17]


@pytest.mark.parametrize("buffers", [1, 2, 4])
@pytest.mark.parametrize("size", SIZES)
def test_stage_out_every_chunk_boundary(size, buffers):
    staging = Staging(StagingConfig(chunk_bytes=4096, buffers=buffers))
    engine = Watched()
    src = random_bytes(size)
    assert torch.equal(drain_out(src, staging, engine), src)
    assert engine.calls == -(-size // 4096)
    assert staging.statistics().in_use == 0


@pytest.mark.parametrize("buffers", [1, 2, 4])
@pytest.mark.parametrize("size", SIZES)
def test_stage_in_every_chunk_boundary(size, buffers):
    staging = Staging(StagingConfig(chunk_bytes=4096, buffers=buffers))
    engine = Watched()
    data, dst = random_bytes(size), poisoned(size)
    ok, mores = feed_in(dst, data, staging, engine)
    assert ok and torch.equal(dst, data)
    assert len(mores) == -(-size // 4096) and mores[-1] == 0
    assert staging.statistics().in_use == 0


def test_empty_and_mixed_payload_through_staging_payload():
    """Staging.payload: empty tensors are skipped, unstaged ones go straight, staged ones in chunks."""
    staging = Staging(StagingConfig(chunk_bytes=1000, buffers=2, cpu_engine=ThreadCopyEngine))
    parts = [random_bytes(0), random_bytes(1), random_bytes(2500), torch.randn(333, dtype=torch.float32)]
    got = b"".join(bytes(v) for v in staging.payload(parts))
    want = b"".join(p.reshape(-1).view(torch.uint8).numpy().tobytes() for p in parts)
    assert got == want
    assert staging.statistics().in_use == 0


def test_bounce_buffers_are_bounded_and_reused_only_after_sent():
    """A slow consumer and a fast engine: if a bounce buffer were refilled before its view was
    sent, the consumer would read the next chunk's bytes. Never more than K buffers exist."""
    k, chunk, chunks = 3, 4096, 60
    staging = Staging(StagingConfig(chunk_bytes=chunk, buffers=k))
    engine = Watched()
    src = random_bytes(chunk * chunks + 5)
    assert torch.equal(drain_out(src, staging, engine, pause=0.001), src)
    stats = staging.statistics()
    assert stats.peak_in_use == k, stats
    assert stats.allocated == k and stats.in_use == 0
    assert len(engine.dst_ptrs) == k, "bounce buffers used (observed by the engine) exceed the ring"
    assert engine.peak_in_flight <= k


def test_stage_in_waits_for_a_copy_before_refilling_its_buffer():
    """A slow engine and a fast source: refilling a bounce buffer whose copy is still running
    would copy the wrong chunk into the destination."""
    k, chunk = 2, 4096
    staging = Staging(StagingConfig(chunk_bytes=chunk, buffers=k))
    engine = Watched(delay=0.002)
    data = random_bytes(chunk * 40 + 77)
    dst = poisoned(data.numel())
    ok, _ = feed_in(dst, data, staging, engine)
    assert ok and torch.equal(dst, data)
    assert staging.statistics().peak_in_use == k
    assert len(engine.src_ptrs) == k
    assert 1 <= engine.peak_in_flight <= k


def test_copies_overlap_the_consumer():
    """The pipeline keeps copies in flight while the consumer works (it is a pipeline, not a loop
    of copy-then-send)."""
    staging = Staging(StagingConfig(chunk_bytes=4096, buffers=4))
    engine = Watched(delay=0.003)
    src = random_bytes(4096 * 30)
    assert torch.equal(drain_out(src, staging, engine), src)
    assert engine.peak_in_flight >= 2


@pytest.mark.parametrize("fail_at", [1, 5, 12])
def test_stage_out_engine_failure_mid_payload(fail_at):
    staging = Staging(StagingConfig(chunk_bytes=4096, buffers=3))
    engine = FailsInCopy(fail_at)
    src = random_bytes(4096 * 12)
    ring = staging.ring(engine, src.numel())
    got = 0
    gen = stage_out(src, ring, 5.0)
    t0 = time.monotonic()
    with pytest.raises(StagingError, match="injected device error"):
        for view in gen:
            assert bytes(view) == src[got : got + len(view)].numpy().tobytes()
            got += len(view)
    ring.release()
    assert time.monotonic() - t0 < 5
    assert got == (fail_at - 1) * 4096, "chunks before the failure are sent, none after"
    assert staging.statistics().in_use == 0


def test_stage_out_issue_failure_and_early_close_return_the_buffers():
    staging = Staging(StagingConfig(chunk_bytes=4096, buffers=3))
    src = random_bytes(4096 * 10)
    with pytest.raises(StagingError, match="cannot issue"):
        list(_staged_payload(staging, Watched(fail_at=4), src))
    assert staging.statistics().in_use == 0
    # a consumer that stops early (the socket broke): closing the generator returns the ring
    gen = _staged_payload(staging, Watched(delay=0.01), src)
    next(gen)
    assert staging.statistics().in_use == 3
    gen.close()
    assert staging.statistics().in_use == 0


def _staged_payload(staging: Staging, engine, src: torch.Tensor):
    ring = staging.ring(engine, src.numel())
    try:
        yield from stage_out(src, ring, staging.config.stall_timeout)
    finally:
        ring.release()


@pytest.mark.parametrize("fail_at", [1, 4, 9])
def test_stage_in_engine_failure_consumes_everything_then_raises(fail_at):
    staging = Staging(StagingConfig(chunk_bytes=4096, buffers=3))
    engine = FailsInCopy(fail_at)
    data = random_bytes(4096 * 9 + 1)
    dst = poisoned(data.numel())
    with pytest.raises(StagingError, match="injected device error"):
        feed_in(dst, data, staging, engine)  # asserts every byte was consumed
    assert staging.statistics().in_use == 0
    assert torch.equal(dst[: (fail_at - 1) * 4096], data[: (fail_at - 1) * 4096])


def test_a_stalled_copy_is_bounded_and_its_buffer_never_reused():
    staging = Staging(StagingConfig(chunk_bytes=4096, buffers=2, stall_timeout=0.3))
    engine = Held()
    src = random_bytes(4096 * 5)
    t0 = time.monotonic()
    with pytest.raises(StagingError, match="did not complete"):
        list(_staged_payload(staging, engine, src))
    assert time.monotonic() - t0 < 3
    assert staging.statistics().in_use == 0
    assert len(staging._parked) >= 1
    engine.release.set()


def test_stage_in_stalled_copy_keeps_its_buffer_and_destination_until_it_ends():
    """A receive copy that outlives stall_timeout: the op fails in bounded time, every byte is
    consumed, the stuck copy's bounce buffer is never refilled (so when it ends it writes the
    right bytes), on_stop is not called (something may still be written), and the bounce
    buffers and the destination are held until the stuck copies end."""
    chunk = 4096
    staging = Staging(StagingConfig(chunk_bytes=chunk, buffers=2, stall_timeout=0.3))
    engine = Held()
    data = random_bytes(chunk * 5)
    dst = poisoned(data.numel())
    stopped: list[float] = []
    t0 = time.monotonic()
    try:
        with pytest.raises(StagingError, match="did not complete.*still outstanding"):
            feed_in(dst, data, staging, engine, on_stop=lambda: stopped.append(time.monotonic()))
        assert time.monotonic() - t0 < 3
        assert stopped == [], "on_stop came while a stuck copy could still write into the destination"
        assert staging.statistics().in_use == 0
        assert staging.parked() == 2  # chunks 0 and 1: issued, never completed
        held = [t for _, ts in staging._parked for t in ts]
        assert any(t.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr() for t in held)
    finally:
        engine.release.set()
    deadline = time.monotonic() + 5
    while staging.parked() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert staging.parked() == 0, "parked memory was not let go once the stuck copies ended"
    # the late copies wrote what they were given: their bounce buffers were not refilled
    assert torch.equal(dst[: 2 * chunk], data[: 2 * chunk])
    assert bool((dst[2 * chunk :] == POISON).all()), "bytes drained after the error reached the destination"


def test_stage_in_stop_waits_for_copies_then_drains():
    """stop(): no copy after it, on_stop once the ones in flight are done, every byte consumed."""
    chunk = 4096
    staging = Staging(StagingConfig(chunk_bytes=chunk, buffers=3))
    engine = Watched(delay=0.002)
    data = random_bytes(chunk * 20)
    dst = poisoned(data.numel())
    fills = 0
    stopped_at: list[int] = []
    events: list[str] = []

    def stop() -> bool:
        return fills >= 6

    def on_stop() -> None:
        stopped_at.append(engine.calls)
        assert engine.in_flight == 0, "on_stop came while copies were still writing"
        events.append("stop")

    src = memoryview(data.numpy()).cast("B")
    pos = 0

    def fill(view: memoryview, more: int) -> None:
        nonlocal pos, fills
        view[:] = src[pos : pos + len(view)]
        pos += len(view)
        fills += 1

    ring = staging.ring(engine, dst.numel())
    ok = stage_in(dst, ring, 5.0, fill, stop=stop, on_stop=on_stop)
    ring.release()
    assert ok is False and events == ["stop"] and pos == data.numel()
    assert stopped_at == [6] and engine.calls == 6
    assert torch.equal(dst[: 6 * chunk], data[: 6 * chunk])
    assert bool((dst[6 * chunk :] == POISON).all()), "bytes were written after the stop"
    assert staging.statistics().in_use == 0


def test_config_is_checked():
    for bad in ({"chunk_bytes": 0}, {"buffers": 0}, {"stall_timeout": 0}, {"chunk_bytes": True}):
        with pytest.raises(ValueError):
            StagingConfig(**bad)
    s = Staging()
    assert s.stages("cuda:0") and not s.stages("cpu")
    assert Staging(StagingConfig(cpu_engine=ThreadCopyEngine)).stages(torch.device("cpu"))


class NoHostMemory(ThreadCopyEngine):
    """Bounce buffers cannot be allocated (pinned memory exhausted) after the first ``ok``."""

    def __init__(self, ok: int) -> None:
        super().__init__()
        self.ok = ok

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        if self.ok <= 0:
            raise RuntimeError("injected: out of pinned memory")
        self.ok -= 1
        return super().host_buffer(nbytes)


@pytest.mark.parametrize("ok", [0, 1, 2])
def test_no_bounce_buffer_fails_the_transfer_cleanly(ok):
    """Receiving: the payload is still consumed in full (through scratch) and the op fails;
    sending: the op fails before the chunk is handed over."""
    staging = Staging(StagingConfig(chunk_bytes=4096, buffers=3))
    data = random_bytes(4096 * 7 + 9)
    dst = poisoned(data.numel())
    with pytest.raises(StagingError, match="cannot allocate"):
        feed_in(dst, data, staging, NoHostMemory(ok))  # asserts every byte was consumed
    assert staging.statistics().in_use == 0
    with pytest.raises(StagingError, match="cannot allocate"):
        list(_staged_payload(staging, NoHostMemory(ok), data))
    assert staging.statistics().in_use == 0


def test_an_engine_that_cannot_start_still_consumes_the_payload():
    def broken() -> ThreadCopyEngine:
        raise RuntimeError("injected: CUDA failed to initialise")

    staging = Staging(StagingConfig(chunk_bytes=4096, buffers=2, cpu_engine=broken))
    data = random_bytes(3 * 4096 + 1)
    src = memoryview(data.numpy()).cast("B")
    pos = 0

    def fill(view: memoryview, more: int) -> None:
        nonlocal pos
        assert more == data.numel() - pos - len(view)
        view[:] = src[pos : pos + len(view)]
        pos += len(view)

    with pytest.raises(StagingError, match="cannot set up the staging copy engine"):
        staging.receive(poisoned(data.numel()), fill)
    assert pos == data.numel()
    with pytest.raises(StagingError, match="cannot set up"):
        list(staging.payload([data]))
