from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator

import pytest
from torch.distributed import TCPStore

_names = itertools.count()

# Every process the tests start (spawned children, example scripts) dumps each of its threads'
# Python stacks on a fatal signal (SIGSEGV, SIGABRT, ...): a rare crash at exit then says where
# each thread was instead of only an exit code (a generator's "terminate called without an active
# exception", seen three times in CI, was a daemon thread copying during finalization: 5ad6d0e).
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


@pytest.fixture(scope="session")
def store_url() -> Iterator[str]:
    """A TCPStore served by the test process on a port the OS picked."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield f"tcp://127.0.0.1:{store.port}"
    del store


@pytest.fixture
def uname():
    """Unique endpoint names, so tests sharing a store never collide."""
    tag = uuid.uuid4().hex[:6]

    def make(prefix: str) -> str:
        return f"{prefix}-{tag}-{next(_names)}"

    return make


@pytest.fixture(params=["shm", "tcp"])
async def pair(request, store_url, uname):
    """Two endpoints in this process, both forced onto one plane (real sockets, real shared memory)."""
    import transport

    planes = (request.param,)
    async with transport.Endpoint(uname("a"), store=store_url, planes=planes, timeout=10) as a:
        async with transport.Endpoint(uname("b"), store=store_url, planes=planes, timeout=10) as b:
            yield a, b


@pytest.fixture(autouse=True)
def _fr_dir(tmp_path, monkeypatch):
    """Automatic flight-recorder dumps of a test go to its own folder."""
    monkeypatch.setenv("TRANSPORT_FR_DIR", str(tmp_path / "fr"))
    yield


def pytest_configure(config):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
