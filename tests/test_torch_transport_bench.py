"""bench/_nixl_peer.py --backend transport_rl runs end to end under torch >= 2.15 (numbers never asserted).

Skipped, saying why, where torch has no ``torch.distributed._transport`` (the default venv's torch
2.13): .ci/torch215.sh runs it in its torch 2.15 venv, next to tests/test_torch_transport.py. The
peer is started the way ``bench_transport.py --nixl-python`` starts it: this checkout on
``PYTHONPATH``, so the backend comes from the entry point where the package is installed into
the venv, and is registered by the peer (``register_transport``) where it is not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    import torch.distributed._transport  # noqa: F401
except ImportError:
    pytest.skip(f"torch {torch.__version__} has no torch.distributed._transport (PyTorch >= 2.15 does)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
SIZE = 1 << 20


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plane", ["shm", "tcp"])
def test_nixl_peer_runs_transport_rl(plane):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "bench/_nixl_peer.py", "--backend", "transport_rl", "--plane", plane,
                        "--sizes", str(SIZE), "--reps", "2", "--warmup", "1", "--lat-iters", "20", "--lat-warmup", "5",
                        "--threads", "1", "--timeout", "30"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=55)
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert r.returncode == 0 and len(lines) == 1, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads(lines[0])
    assert doc["ok"] and doc["backend"] == "transport_rl" and doc["options"] == {"plane": plane}, doc
    assert doc["registration"].startswith(("entry point", "register_transport")), doc["registration"]
    assert Path(doc["transport_path"]) == ROOT / "transport"
    entry = doc["sizes"][str(SIZE)]
    assert entry["verified"] and len(entry["write"]) == len(entry["read"]) == 2
    lat = doc["latency"]
    assert lat["verified"] and len(lat["write"]) == len(lat["read"]) == 20
    assert all(t > 0 for t in entry["write"] + entry["read"] + lat["write"] + lat["read"])


def test_nixl_peer_rejects_a_plane_for_nixl():
    r = subprocess.run([sys.executable, "bench/_nixl_peer.py", "--backend", "nixl", "--plane", "shm",
                        "--sizes", str(SIZE), "--reps", "1", "--warmup", "0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "--plane" in r.stderr, r.stderr[-2000:]
