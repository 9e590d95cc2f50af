"""The benchmark script still runs end to end (numbers are printed, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COST_BLOCKS = 2  # bench_transport.COST_BLOCKS: blocks of each kind per size and round


def test_bench_quick_runs(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "bench/bench_transport.py", "--quick", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    cases = {row["case"] for row in doc["rows"]}
    assert "transport shm put" in cases and "transport tcp put" in cases
    assert any("raw socket" in c for c in cases) and any("gloo" in c for c in cases)
    assert "targets" in doc


def test_bench_only_runs_the_named_phases(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "bench/bench_transport.py", "--quick", "--max-mib", "1", "--only", "raw,tcp",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    cases = {row["case"] for row in doc["rows"]}
    assert "raw socket" in cases and "transport tcp put" in cases
    assert not any("shm" in c or "gloo" in c or "copy_" in c for c in cases), cases
    tcp = next(row for row in doc["rows"] if row["case"] == "transport tcp put")
    assert tcp["ratio_vs"] == "raw socket, interleaved" and tcp["verified"]
    # the reference measured in the op's own repetitions, and the ratio to the separate raw phase
    ref = next(row for row in doc["rows"] if row["case"] == "raw socket (interleaved with tcp ops)")
    assert ref["reps"] == tcp["reps"] and tcp["ratio"] == tcp["gbps"] / ref["gbps"]
    phase = next(row for row in doc["rows"] if row["case"] == "raw socket")
    assert tcp["ratio_vs_phase"] == tcp["gbps"] / phase["gbps"]
    # CPU time per op of both processes, raw socket against put, at 4 KiB and 1 MiB
    cpu = {(row["case"], row["size_bytes"]): row for row in doc["rows"] if row.get("cpu")}
    assert set(cpu) == {(f"CPU per op: {what}", size) for what in ("raw socket send+ack", "transport tcp put")
                        for size in (4096, 1 << 20)}, sorted(cpu)
    for (case, size), row in cpu.items():
        assert row["ops"] == doc["config"]["cost"]["ops"] * COST_BLOCKS * doc["config"]["rounds"], row
        assert row["wall_us"] > 0 and row["initiator_us"] > 0 and row["target_us"] > 0, row
        assert row["total_us"] == pytest.approx(row["initiator_us"] + row["target_us"])
        if case.endswith("put"):
            raw = cpu[("CPU per op: raw socket send+ack", size)]
            assert row["extra_cpu_us"] == pytest.approx(row["total_us"] - raw["total_us"])
    assert "CPU time per op, tcp" in r.stdout


def test_bench_shm_ratio_needs_no_copy_phase(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "bench/bench_transport.py", "--quick", "--max-mib", "1", "--only", "shm",
                        "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rows = {row["case"]: row for row in json.loads(out.read_text())["rows"]}
    assert "copy_ (memcpy)" not in rows and "copy_ (interleaved with shm ops)" in rows
    for op in ("put", "get"):
        row = rows[f"transport shm {op}"]
        assert row["verified"] and row["ratio_vs"] == "copy_, interleaved" and "ratio_vs_phase" not in row
        assert row["ratio"] == row["gbps"] / rows["copy_ (interleaved with shm ops)"]["gbps"]


def test_bench_only_rejects_an_unknown_phase(tmp_path):
    r = subprocess.run([sys.executable, "bench/bench_transport.py", "--quick", "--only", "raw,nixl",
                        "--json", str(tmp_path / "b.json")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown phase" in r.stderr and "nixl" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "b.json").exists()


FAKE_NIXL_PEER = r'''
import argparse, json, os
ap = argparse.ArgumentParser()
for a in ("--sizes", "--reps", "--warmup", "--lat-iters", "--lat-warmup", "--threads", "--timeout", "--plane"):
    ap.add_argument(a)
ap.add_argument("--backend", default="nixl")
a = ap.parse_args()
sizes, reps = [int(s) for s in a.sizes.split(",")], [int(r) for r in a.reps.split(",")]
# GB/s of write and read, us of a 4 KiB write and read, per backend (and plane)
speed = {("nixl", None): (2.0, 1.0, 20, 40), ("transport_rl", "shm"): (1.0, 0.5, 50, 60),
         ("transport_rl", "tcp"): (0.25, 0.125, 300, 320)}[(a.backend, a.plane)]
print("NIXL INFO a log line on stdout, before the json")
doc = {"ok": True, "torch": "2.15.0", "completion": "poll", "backend": a.backend,
       "torch_threads": int(a.threads), "setup_s": 0.1,
       "sizes": {str(s): {"write": [s / speed[0] / 1e9] * r, "read": [s / speed[1] / 1e9] * r, "verified": True}
                 for s, r in zip(sizes, reps)},
       "latency": {"write": [speed[2] * 1e-6] * int(a.lat_iters), "read": [speed[3] * 1e-6] * int(a.lat_iters),
                   "verified": True}}
if a.backend == "nixl":
    doc.update(nixl="1.5.1", plugin="UCX", options={}, registration="built into torch")
else:  # what bench_transport.py gives this backend's peer: this checkout on PYTHONPATH
    doc.update(options={"plane": a.plane}, registration="register_transport (stand-in)",
               transport_path=os.environ.get("PYTHONPATH"))
print(json.dumps(doc))
'''


def test_bench_nixl_phase_with_a_stand_in_peer(tmp_path):
    """--nixl-python: the peer's json becomes NIXL rows and ours / NIXL ratios, and its
    transport_rl runs (per plane) rows against NIXL and against our native API, side by side (a
    stand-in peer: the real one needs torch 2.15 and nixl in another venv, see bench/README.md)."""
    fake = tmp_path / "fake_peer.py"
    fake.write_text(FAKE_NIXL_PEER)
    py = tmp_path / "python"  # an "interpreter" that runs the stand-in instead of bench/_nixl_peer.py
    py.write_text(f'#!/bin/sh\nshift\nexec "{sys.executable}" "{fake}" "$@"\n')
    py.chmod(0o755)
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "bench/bench_transport.py", "--quick", "--max-mib", "1", "--only", "shm,tcp",
                        "--nixl-python", str(py), "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    rows = {row["case"]: row for row in doc["rows"]}
    assert rows["NIXL write"]["gbps"] == pytest.approx(2.0) and rows["NIXL read"]["gbps"] == pytest.approx(1.0)
    assert rows["NIXL write"]["reps"] == rows["transport shm put"]["reps"]
    assert rows["transport shm put"]["ratio_vs_nixl"] == pytest.approx(rows["transport shm put"]["gbps"] / 2.0)
    assert rows["transport shm get"]["ratio_vs_nixl"] == pytest.approx(rows["transport shm get"]["gbps"] / 1.0)
    assert rows["4 KiB NIXL write"]["p50_us"] == pytest.approx(20.0)
    sec = doc["nixl"]
    assert sec["ran"] and sec["torch"] == "2.15.0" and sec["python"] == str(py)
    lat = [e for e in sec["ours_vs_nixl"] if e.get("latency")]
    assert {e["nixl"] for e in lat} == {"4 KiB NIXL write", "4 KiB NIXL read"}
    put = next(e for e in lat if e["nixl"] == "4 KiB NIXL write")
    assert put["ratio"] == pytest.approx(rows["4 KiB transport shm put"]["p50_us"] / 20.0)
    assert "ours / NIXL" in r.stdout and "not available" not in r.stdout
    # transport_rl through torch's API, per plane: against its native put/get and against NIXL
    for plane, (w, rd) in (("shm", (1.0, 0.5)), ("tcp", (0.25, 0.125))):
        api = sec["torch_api"][f"torchapi_{plane}"]
        assert api["ran"] and api["options"] == {"plane": plane} and api["transport_path"] == str(ROOT), api
        for op, nop, gbps, nixl_gbps in (("put", "write", w, 2.0), ("get", "read", rd, 1.0)):
            row = rows[f"torch API transport_rl {plane} {nop}"]
            native = rows[f"transport {plane} {op}"]
            assert row["gbps"] == pytest.approx(gbps) and row["reps"] == native["reps"], row
            assert row["ratio"] == pytest.approx(gbps / native["gbps"]) and row["ratio_vs"].endswith("(native API)")
            assert row["ratio_vs_nixl"] == pytest.approx(gbps / nixl_gbps)
        lat_row = rows[f"4 KiB torch API transport_rl {plane} write"]
        assert lat_row["ratio"] == pytest.approx(lat_row["p50_us"] / rows[f"4 KiB transport {plane} put"]["p50_us"])
    side = {(e["size_bytes"], e["op"]): e for e in sec["torch_api_side_by_side"]}
    assert set(side) == {(s, op) for s in (1 << 20, 4096) for op in ("write", "read")}, sorted(side)
    e = side[(1 << 20, "read")]
    assert (e["nixl"], e["api_shm"], e["api_tcp"]) == pytest.approx((1.0, 0.5, 0.125))
    assert e["native_tcp"] == rows["transport tcp get"]["gbps"] and e["api_tcp_vs_nixl"] == pytest.approx(0.125)
    assert e["api_shm_vs_native"] == pytest.approx(0.5 / rows["transport shm get"]["gbps"])
    e = side[(4096, "write")]
    assert e["latency"] and (e["nixl"], e["api_shm"], e["api_tcp"]) == pytest.approx((20.0, 50.0, 300.0))
    assert e["api_shm_vs_nixl"] == pytest.approx(2.5)
    assert "torch API side by side" in r.stdout


def test_bench_nixl_phase_failure_is_an_error_row(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "bench/bench_transport.py", "--quick", "--max-mib", "1", "--only", "shm",
                        "--nixl-python", str(tmp_path / "no-such-python"), "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    # the NIXL phase and both transport_rl-through-torch phases need that python: three error rows
    assert sorted(e["phase"] for e in doc["errors"]) == ["nixl", "torchapi_shm", "torchapi_tcp"]
    assert doc["nixl"]["ran"] is False
    assert {k: v["ran"] for k, v in doc["nixl"]["torch_api"].items()} == {"torchapi_shm": False,
                                                                          "torchapi_tcp": False}
    assert "transport shm put" in {row["case"] for row in doc["rows"]}


def test_op_stages_runs_and_names_every_stage():
    """bench/op_stages.py wraps channel internals: it must keep up with them (or fail here)."""
    r = subprocess.run([sys.executable, "bench/op_stages.py", "--ops", "60"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    for stage in ("I call", "I send:Put", "T woke", "T send:Ack", "I settle", "I return", "whole put"):
        assert stage in r.stdout, f"{stage!r} missing:\n{r.stdout}"


def test_tcp_fanout_runs_both_ways_and_prints_the_ratios():
    r = subprocess.run([sys.executable, "bench/tcp_fanout.py", "--peers", "2", "--rounds", "1", "--reps", "20",
                        "--sizes", "4096,1048576"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith(("one peer", "2 peers at once"))]
    assert len(rows) == 4 and all(line.rstrip().endswith("x") for line in rows), r.stdout


def test_one_sided_runs_both_planes_and_sends_no_header_for_a_one_sided_op():
    r = subprocess.run([sys.executable, "bench/one_sided.py", "--reps", "20", "--sizes", "4096,1048576"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith(("shm ", "cuda_ipc "))]
    ratios = [row for row in rows if row[-1].endswith("x")]
    assert len(ratios) == 4, r.stdout
    served = {row[0]: int(row[3]) for row in rows if row[1:3] == ["target", "served"]}
    assert served == {"shm": 2 * 40, "cuda_ipc": 2 * 40}, r.stdout  # the put+notify ops only
