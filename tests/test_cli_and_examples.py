"""The command line and the examples, run as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def test_doctor_reports_planes_and_choice():
    r = _run("-m", "transport", "doctor", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert set(rep["planes"]) == {"shm", "tcp"}
    assert rep["planes"]["tcp"]["available"] is True
    for p in rep["planes"].values():
        assert p["reason"]
    assert "shm" in rep["choice"] and "tcp" in rep["choice"]
    assert {"loop_reads", "unix_sockets", "answer_spin_us", "answer_spin_note"} <= set(rep["io"])
    nccl = rep["nccl"]
    assert nccl["found"] is True, nccl  # nvidia-nccl-cu12 is a dependency on Linux
    assert nccl["version"].startswith("2.") and nccl["source"] in {"explicit", "torch", "pathfinder", "system"}
    assert [a["source"] for a in nccl["attempts"]][-1] == nccl["source"] and all(a["reason"] for a in nccl["attempts"])
    assert nccl["optional"]["ncclCommAbort"] is True
    import torch

    cuda = rep["cuda"]
    assert cuda["available"] is torch.cuda.is_available()
    assert cuda["device_count"] == len(cuda["devices"]) == (torch.cuda.device_count() if cuda["available"] else 0)
    ipc = cuda["ipc"]
    assert ipc["available"] is cuda["available"] and ipc["reason"]  # a CUDA machine has its driver
    same, other = cuda["gpu_planes"]["same_host"], cuda["gpu_planes"]["other_host"]
    link = cuda["nccl_link"]
    assert link["available"] is cuda["available"] and link["reason"]  # (NCCL is a dependency on Linux)
    assert other["plane"] == ("nccl" if link["available"] else "staged"), other
    assert "cuda_ipc: the peer is not on this host" in other["reason"]
    if not link["available"]:
        assert f"nccl: this process cannot use NCCL: {link['reason']}" in other["reason"]
    if ipc["available"]:
        assert same["plane"] == "cuda_ipc"
    else:
        assert same["plane"] == "staged" and f"cuda_ipc: {ipc['reason']}" in same["reason"]
    human = _run("-m", "transport", "doctor")
    assert human.returncode == 0 and "planes:" in human.stdout and "choice:" in human.stdout
    assert "cuda: " in human.stdout and "cuda_ipc: " in human.stdout
    assert f"GPU buffers, peer on same host: {same['plane']} because" in human.stdout
    # a plane's features are reported where the plane is available, in the JSON and the text alike
    # (cuda_ipc's one-sided ops under its line)
    lines = human.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  cuda_ipc: "))
    if ipc["available"]:
        assert ipc["one_sided_reason"]
        assert lines[at + 1] == f"    one-sided: {'yes' if ipc['one_sided'] else 'no'}: {ipc['one_sided_reason']}"
    else:
        assert "one_sided" not in ipc and not lines[at + 1].startswith("    one-sided")
    if rep["planes"]["shm"]["available"]:
        assert f"one-sided: {'yes' if rep['planes']['shm']['one_sided'] else 'no'}: " in human.stdout


def test_doctor_shows_the_channel_io_settings_and_a_bad_spin_budget():
    r = _run("-m", "transport", "doctor", env={"TRANSPORT_SPIN_US": "0", "TRANSPORT_LOOP_READS": "0"})
    assert r.returncode == 0, r.stderr
    assert "answers read on the event loop off" in r.stdout and "up to 0 us" in r.stdout, r.stdout
    r = _run("-m", "transport", "doctor", "--json", env={"TRANSPORT_SPIN_US": "fast"})
    assert r.returncode == 0, r.stderr  # (never a crash: the default is used, and said)
    io = json.loads(r.stdout)["io"]
    assert io["answer_spin_us"] == 100 and "'fast'" in io["answer_spin_note"], io


def test_doctor_names_the_plane_for_a_live_peer(store_url):
    import transport

    with transport.BlockingEndpoint("doctor-peer", store=store_url) as ep:
        ep.register("w", __import__("torch").zeros(4))
        r = _run("-m", "transport", "doctor", "--store", store_url, "--peer", "doctor-peer", "--planes", "tcp")
    assert r.returncode == 0, r.stderr
    assert "peer doctor-peer" in r.stdout and "plane tcp" in r.stdout
    assert "GPU buffers: plane staged because cuda_ipc: not allowed here" in r.stdout
    assert "channel socket: unix (same host, same network namespace)" in r.stdout


def test_cli_usage():
    assert _run("-m", "transport").returncode == 2
    assert _run("-m", "transport", "bogus").returncode == 2
    assert _run("-m", "transport", "--help").returncode == 0


def test_example_asyncio_put_get():
    r = _run("examples/asyncio_put_get.py", "--mib", "8", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: every byte verified" in r.stdout
    r = _run("examples/asyncio_put_get.py", "--mib", "8", "--planes", "tcp", timeout=180)
    assert r.returncode == 0 and "over tcp" in r.stdout, r.stdout + r.stderr
