"""examples/ray_rl.py on a local Ray instance, run as a user runs it (real actors, real sockets, CPU).

Each run gets its own Ray temp folder and a tag in its environment, which every process Ray starts
for it inherits; after the run no process may carry the tag (raylet, GCS, workers: all gone).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]'; scripts/setup.sh installs it)")

pytestmark = pytest.mark.timeout(200)

ROOT = Path(__file__).resolve().parent.parent
TAG = "RAY_RL_TEST_TAG"


def _tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment holds ``TAG=tag``."""
    want = f"{TAG}={tag}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if want in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def _run(tmp_path: Path, *args: str, timeout: float = 120) -> tuple[int, str, str, dict]:
    """Run the example; return (exit code, stdout, stderr, summary). Asserts that nothing it started is left."""
    tag = uuid.uuid4().hex
    temp_dir = tempfile.mkdtemp(prefix="rayrl-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    env = dict(os.environ, **{TAG: tag, "TRANSPORT_FR_DIR": str(tmp_path / "fr")})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "examples/ray_rl.py", "--ray-temp-dir", temp_dir, *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # SIGTERM first: the example shuts Ray down on it
            proc.send_signal(signal.SIGTERM)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate(timeout=10)
            pytest.fail(f"the example ran past {timeout} s:\n{out}\n{err}")
        deadline = time.monotonic() + 15  # Ray's processes exit within moments of ray.shutdown()
        while (left := _tagged(tag)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"processes left behind by the run: {left}\n{out}\n{err}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in _tagged(tag):  # (only after a failed check above) ours: they carry this run's tag
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)
    lines = [ln for ln in out.splitlines() if ln.startswith("summary: ")]
    summary = json.loads(lines[-1].removeprefix("summary: ")) if lines else {}
    return proc.returncode, out, err, summary


def test_every_generator_samples_with_every_version(tmp_path):
    steps = 3
    rc, out, err, s = _run(tmp_path, "--generators", "2", "--steps", str(steps))
    assert rc == 0, out + err
    names = ["gen-0", "gen-1"]
    assert s["generators"] == names and s["killed"] is None, out
    # on-policy: at step k every generator sampled with version k, the newest the trainer had pushed
    assert s["sampled"] == {n: list(range(1, steps + 1)) for n in names}, out
    assert [p["version"] for p in s["pushes"]] == list(range(1, steps + 2)), out
    for p in s["pushes"]:
        assert p["ok"] and sorted(p["results"]) == names, out
        assert all(r["stage"] == "committed" and r["plane"] == "shm" for r in p["results"].values()), out
    assert s["verified"] == names and s["final_version"] == steps + 1, out
    assert s["bundles"] == 3 and s["strategy"] == "PACK", out
    assert len(set(s["nodes"].values())) == 1 and set(s["nodes"]) == {"trainer", *names}, out
    assert "verified: gen-0, gen-1 hold exactly the trainer's final weights" in out, out


def test_a_killed_generator_does_not_hold_up_the_others(tmp_path):
    steps, kill_at = 4, 2
    rc, out, err, s = _run(tmp_path, "--generators", "3", "--steps", str(steps), "--kill-at", str(kill_at))
    assert rc == 0, out + err
    alive, victim = ["gen-0", "gen-1"], "gen-2"
    assert s["killed"] == victim, out
    assert s["sampled"] == {**{n: list(range(1, steps + 1)) for n in alive}, victim: list(range(1, kill_at + 1))}, out
    pushes = {p["version"]: p for p in s["pushes"]}
    assert sorted(pushes) == list(range(1, steps + 2)), out
    for v in range(1, kill_at + 2):  # before the kill: everyone committed
        assert pushes[v]["ok"] and sorted(pushes[v]["results"]) == [*alive, victim], out
    hit = pushes[kill_at + 2]  # the first push after the kill: only the dead one's entry fails
    assert not hit["results"][victim]["ok"] and hit["results"][victim]["error"], out
    assert all(hit["results"][n]["ok"] for n in alive), out
    # not held up: a stall would run to the push's 60 s deadline; a push here takes milliseconds
    assert hit["seconds"] < 5 and all(hit["results"][n]["seconds"] < 5 for n in alive), out
    for v in range(kill_at + 3, steps + 2):  # afterwards the trainer has dropped it
        assert pushes[v]["ok"] and sorted(pushes[v]["results"]) == alive, out
    assert s["verified"] == alive and s["final_version"] == steps + 1, out
