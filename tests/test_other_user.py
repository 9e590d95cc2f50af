"""README (Security): "Another user is held back by the usual permissions on /proc and memfd
descriptors". A process of another user (``nobody``, switched to by a root test process) cannot
open an endpoint's shm segment or slot table through ``/proc/<pid>/fd`` (which the owner's user
can). Needs root to switch users: skipped otherwise, saying so."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

import transport

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user (nobody) needs root")

PROBE = """
import os, sys
for path in sys.argv[1:]:
    try:
        os.close(os.open(path, os.O_RDWR))
    except PermissionError:
        continue
    print("opened", path)
    sys.exit(1)
print("refused")
"""


def _python_for_nobody() -> str:
    """An interpreter another user may run (the venv's may lie under a directory only root reads)."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        if cand and os.access(cand, os.X_OK) and subprocess.run(
                [cand, "-c", "pass"], user="nobody", capture_output=True, timeout=30).returncode == 0:
            return cand
    pytest.skip("no Python interpreter the user nobody may run")


def test_another_user_cannot_open_our_segments_through_proc(store_url, uname):
    python = _python_for_nobody()
    with transport.BlockingEndpoint(uname("owner"), store=store_url, planes=("shm",), timeout=10) as ep:
        w = torch.zeros(1024)
        ep.register("w", w)
        handle = ep._ep._registry.get("w").exports["shm"].handle
        paths = [f"/proc/{os.getpid()}/fd/{handle.fd}"]
        if handle.table_fd > 0:
            paths.append(f"/proc/{os.getpid()}/fd/{handle.table_fd}")
        assert all(os.path.exists(p) for p in paths)  # (they are there: we, root, can open them)
        os.close(os.open(paths[0], os.O_RDWR))
        run = subprocess.run([python, "-c", PROBE, *paths], user="nobody", capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0 and run.stdout.strip() == "refused", (run.returncode, run.stdout, run.stderr)
        assert bool((w == 0).all())
